"""Catch the PD-firmware wedge between benches, while production traffic is the load.

The wedge is invisible on an idle GPU (runbook: check "during load"), so a node is only judged on
a tick when vLLM reports requests running. A node in the gateway whose GPU shows the whole wedge
signature on WEDGED_TICKS_BEFORE_BENCH loaded ticks in a row gets a bench run: the bench drains it,
confirms with its own samples and keeps it out of the gateway with the cold-drain advice. Nodes
already out of the gateway are not watched: their load is a bench or an experiment, which judge
the GPU themselves.
"""

import json
from typing import Any

import dagster as dg
import httpx

from spark_pipelines.assets.nodes import GPU_QUERY, api_root
from spark_pipelines.core import gpu
from spark_pipelines.core.diagnosis import parse_metrics
from spark_pipelines.fleet import FleetError, load_fleet
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSSH, RemoteError

WEDGED_TICKS_BEFORE_BENCH = 2


def running_requests(url: str) -> float | None:
    try:
        return parse_metrics(httpx.get(url, timeout=5).text).get("vllm:num_requests_running", 0.0)
    except httpx.HTTPError:
        return None


def build_wedge_sensor(fleet_path: str, bench_job: Any) -> dg.SensorDefinition:
    @dg.sensor(name="wedge_watch", job=bench_job, minimum_interval_seconds=120,
               default_status=dg.DefaultSensorStatus.STOPPED,
               description="Benches a gateway node whose GPU shows the PD-firmware wedge under live traffic.")
    def wedge_watch(context: dg.SensorEvaluationContext, ssh: FleetSSH) -> dg.SensorResult:
        try:
            fleet = load_fleet(fleet_path)
        except FleetError as e:
            return dg.SensorResult(skip_reason=f"fleet file unusable, nothing requested: {e}", cursor=context.cursor)
        counts: dict[str, int] = json.loads(context.cursor) if context.cursor else {}
        requests, seen = [], []
        with ssh.open_session(context.log) as s:
            try:
                rotation = set(GatewayHost(s).rotation())
            except RemoteError as e:
                return dg.SensorResult(skip_reason=f"gateway config unreadable: {e}", cursor=context.cursor)
            for node in fleet.serve_nodes:
                if node.name not in rotation:
                    counts.pop(node.name, None)
                    continue
                running = running_requests(f"{api_root(fleet, node)}/metrics")
                if running is None:
                    seen.append(f"{node.name}: /metrics unreachable (node_health handles a dead engine)")
                    continue
                if not running:
                    seen.append(f"{node.name}: no live requests, GPU not judged")
                    continue  # idle: the wedge cannot show; keep the count as it was
                try:
                    out = s.run(node.name, list(GPU_QUERY), check=False, log=False, timeout=30)
                    verdict = gpu.classify(gpu.parse_reading(out.stdout), under_load=True)
                except (RemoteError, gpu.GpuFormatError) as e:
                    seen.append(f"{node.name}: nvidia-smi not read ({e})")
                    continue
                seen.append(f"{node.name}: {verdict.state} under {running:g} live request(s)")
                if verdict.state != "wedged":
                    counts[node.name] = 0
                    continue
                counts[node.name] = counts.get(node.name, 0) + 1
                if counts[node.name] >= WEDGED_TICKS_BEFORE_BENCH:
                    counts[node.name] = 0
                    requests.append(dg.RunRequest(partition_key=node.name,
                                                  tags={"reason": "wedge-suspected", "evidence": verdict.reasons[0][:200]}))
        return dg.SensorResult(run_requests=requests, cursor=json.dumps(counts),
                               skip_reason=None if requests else "; ".join(seen) or "no node in the gateway")

    return wedge_watch
