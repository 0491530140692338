"""Catch the PD-firmware wedge between benches, while production traffic is the load.

The wedge is invisible on an idle GPU (runbook: check "during load"), so a node is only judged on
a tick when vLLM reports requests running. A node in the gateway whose GPU shows the whole wedge
signature on WEDGED_TICKS_BEFORE_CAPTURE loaded ticks in a row gets a `wedge_capture_job` run: it
quarantines the node (out of the gateway, held out) and captures the runbook's pre-drain evidence
to the build host. One request per episode (run key: node + the episode's first wedged tick); the
cold drain itself waits for a person (cold_drain_job). Nodes already out of the gateway are not
watched: their load is a bench, an experiment or a capture, which judge the GPU themselves.
"""

import json
import time
from typing import Any

import dagster as dg

from spark_pipelines.core import gpu, steps
from spark_pipelines.core.diagnosis import METRIC_RUNNING
from spark_pipelines.core.errors import first_line
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession, FleetSSH, RemoteError
from spark_pipelines.resources.engine import engine_metrics
from spark_pipelines.runbook import sweep
from spark_pipelines.runbook.preflight import read_gpu

WEDGED_TICKS_BEFORE_CAPTURE = 2
CAPTURE_JOB = steps.WEDGE_CAPTURE_JOB


def judge(s: FleetSession, node: str) -> gpu.GpuVerdict:
    """One nvidia-smi read of a node that is serving live requests; unreadable = unknown."""
    try:
        return gpu.classify(read_gpu(s, node, timeout=sweep.GPU_TIMEOUT_S), under_load=True)
    except (RemoteError, gpu.GpuFormatError) as e:
        return gpu.GpuVerdict(state="unknown", reasons=[f"nvidia-smi not read ({first_line(e)})"])


def _episode(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return dict(raw)
    return {"wedged": int(raw or 0)}  # an older cursor: a bare count


def wedge_sensors(fleet: Fleet) -> dg.Definitions:
    """`fleet` is the one loaded with the code location: an edit applies on reload (see pins.py)."""

    @dg.sensor(name=steps.WEDGE_SENSOR, job_name=CAPTURE_JOB, minimum_interval_seconds=120,
               default_status=dg.DefaultSensorStatus.STOPPED,
               description=f"Judges each gateway node's GPU while vLLM reports live requests; after "
                           f"{WEDGED_TICKS_BEFORE_CAPTURE} wedged ticks in a row requests {CAPTURE_JOB} for it "
                           "(quarantine + the pre-drain evidence), once per episode. The cold drain waits for a "
                           "person: cold_drain_job.")
    def wedge_watch(context: dg.SensorEvaluationContext, ssh: FleetSSH) -> dg.SensorResult:
        raw = json.loads(context.cursor) if context.cursor else {}
        episodes = {k: _episode(v) for k, v in raw.items()}
        requests, seen = [], []
        # HTTP first: SSH is opened only on ticks where some node has live traffic to judge under.
        busy: dict[str, float] = {}
        for node in fleet.serve_nodes:
            metrics = engine_metrics(fleet, node, timeout=5)
            running = None if metrics is None else metrics.get(METRIC_RUNNING, 0.0)
            if running is None:
                seen.append(f"{node.name}: /metrics unreachable (node_health handles a dead engine)")
            elif not running:
                seen.append(f"{node.name}: no live requests, GPU not judged")  # its episode stays as it was
            else:
                busy[node.name] = running
        if busy:
            # A tick must end in seconds: the sweep's short connect and no retries (fault suite:
            # a frozen gateway sshd held the tick past a minute through the runs' connect retries).
            with sweep.open_session(fleet, context.log, base=ssh) as s:
                try:
                    rotation = set(GatewayHost(s).rotation())
                except RemoteError as e:
                    return dg.SensorResult(skip_reason=f"gateway config unreadable: {first_line(e)}", cursor=context.cursor)
                for name, running in busy.items():
                    if name not in rotation:
                        episodes.pop(name, None)
                        seen.append(f"{name}: out of the gateway, not watched")
                        continue
                    verdict = judge(s, name)
                    seen.append(f"{name}: {verdict.state} under {running:g} live request(s)")
                    if verdict.state in ("unknown", "idle"):
                        continue  # cannot tell (read between two requests): the episode stays as it was
                    if verdict.state != "wedged":
                        episodes[name] = {"wedged": 0}
                        continue
                    ep = episodes.get(name) or {"wedged": 0}
                    if not ep.get("wedged"):
                        ep = {"wedged": 0, "since": int(time.time())}
                    ep["wedged"] += 1
                    episodes[name] = ep
                    if ep["wedged"] < WEDGED_TICKS_BEFORE_CAPTURE:
                        seen.append(f"{name}: wedged tick {ep['wedged']} of {WEDGED_TICKS_BEFORE_CAPTURE}")
                    elif ep.get("requested"):
                        seen.append(f"{name}: capture already requested for this episode")
                    else:
                        ep["requested"] = True
                        requests.append(dg.RunRequest(
                            run_key=f"wedge-{name}-{ep.get('since', 0)}", job_name=CAPTURE_JOB, partition_key=name,
                            tags={steps.REASON_TAG: "wedge-suspected", steps.EVIDENCE_TAG: verdict.reasons[0][:200]}))
        return dg.SensorResult(run_requests=requests, cursor=json.dumps(episodes, sort_keys=True),
                               skip_reason=None if requests else "; ".join(seen) or "no serving node")

    return dg.Definitions(sensors=[wedge_watch])
