"""Catch the PD-firmware wedge between benches, while production traffic is the load.

The wedge is invisible on an idle GPU (runbook: check "during load"), so a node is only judged on
a tick when vLLM reports requests running. A node in the gateway whose GPU shows the whole wedge
signature on WEDGED_TICKS_BEFORE_BENCH loaded ticks in a row gets a bench run: the bench drains it,
confirms with its own samples and keeps it out of the gateway with the cold-drain advice. Nodes
already out of the gateway are not watched: their load is a bench or an experiment, which judge
the GPU themselves.
"""

import json

import dagster as dg

from spark_pipelines.core import gpu
from spark_pipelines.core.diagnosis import METRIC_RUNNING
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession, FleetSSH, RemoteError
from spark_pipelines.runbook.engine import engine_metrics
from spark_pipelines.runbook import sweep
from spark_pipelines.runbook.preflight import read_gpu

WEDGED_TICKS_BEFORE_BENCH = 2


def judge(s: FleetSession, node: str) -> gpu.GpuVerdict:
    """One nvidia-smi read of a node that is serving live requests; unreadable = unknown."""
    try:
        return gpu.classify(read_gpu(s, node), under_load=True)
    except (RemoteError, gpu.GpuFormatError) as e:
        return gpu.GpuVerdict(state="unknown", reasons=[f"nvidia-smi not read ({e})"])


def wedge_sensors(fleet: Fleet) -> dg.Definitions:
    """`fleet` is the one loaded with the code location: an edit applies on reload (see pins.py)."""

    @dg.sensor(name="wedge_watch", job_name="bench_job", minimum_interval_seconds=120,
               default_status=dg.DefaultSensorStatus.STOPPED,
               description="Benches a gateway node whose GPU shows the PD-firmware wedge under live traffic.")
    def wedge_watch(context: dg.SensorEvaluationContext, ssh: FleetSSH) -> dg.SensorResult:
        counts: dict[str, int] = json.loads(context.cursor) if context.cursor else {}
        requests, seen = [], []
        # HTTP first: SSH is opened only on ticks where some node has live traffic to judge under.
        busy: dict[str, float] = {}
        for node in fleet.serve_nodes:
            metrics = engine_metrics(fleet, node, timeout=5)
            running = None if metrics is None else metrics.get(METRIC_RUNNING, 0.0)
            if running is None:
                seen.append(f"{node.name}: /metrics unreachable (node_health handles a dead engine)")
            elif not running:
                seen.append(f"{node.name}: no live requests, GPU not judged")  # its count stays as it was
            else:
                busy[node.name] = running
        if busy:
            # A tick must end in seconds: the sweep's short connect and no retries (fault suite:
            # a frozen gateway sshd held the tick past a minute through the runs' connect retries).
            with sweep.open_session(fleet, context.log, base=ssh) as s:
                try:
                    rotation = set(GatewayHost(s).rotation())
                except RemoteError as e:
                    return dg.SensorResult(skip_reason=f"gateway config unreadable: {e}", cursor=context.cursor)
                for name, running in busy.items():
                    if name not in rotation:
                        counts.pop(name, None)
                        seen.append(f"{name}: out of the gateway, not watched")
                        continue
                    verdict = judge(s, name)
                    seen.append(f"{name}: {verdict.state} under {running:g} live request(s)")
                    if verdict.state == "unknown":
                        continue  # cannot tell: the count stays as it was
                    counts[name] = counts.get(name, 0) + 1 if verdict.state == "wedged" else 0
                    if counts[name] >= WEDGED_TICKS_BEFORE_BENCH:
                        counts[name] = 0
                        requests.append(dg.RunRequest(partition_key=name, tags={
                            "reason": "wedge-suspected", "evidence": verdict.reasons[0][:200]}))
        return dg.SensorResult(run_requests=requests, cursor=json.dumps(counts),
                               skip_reason=None if requests else "; ".join(seen) or "no serving node")

    return dg.Definitions(sensors=[wedge_watch])
