"""Redeploy a node whose vLLM stopped answering.

One failed probe can be a hiccup (SSH and HTTP go unresponsive during CUDA graph capture), so a
node must fail FAILURES_BEFORE_REDEPLOY ticks in a row; the cursor keeps the counts per node.
"""


import json


import dagster as dg

from spark_pipelines.runbook.engine import healthy
from spark_pipelines.core.fleet import FleetError, load_fleet

FAILURES_BEFORE_REDEPLOY = 3


def health_sensors(fleet_path: str) -> dg.Definitions:
    @dg.sensor(name="node_health", job_name="deploy_node_job", minimum_interval_seconds=60,
               default_status=dg.DefaultSensorStatus.STOPPED,
               description="Redeploys a node after consecutive failed /health probes.")
    def node_health(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        try:
            fleet = load_fleet(fleet_path)
        except FleetError as e:
            return dg.SensorResult(skip_reason=f"fleet file unusable, nothing requested: {e}", cursor=context.cursor)
        counts: dict[str, int] = json.loads(context.cursor) if context.cursor else {}
        requests = []
        for node in fleet.serve_nodes:
            if healthy(fleet, node):
                counts[node.name] = 0
                continue
            counts[node.name] = counts.get(node.name, 0) + 1
            if counts[node.name] == FAILURES_BEFORE_REDEPLOY:
                # No run_key: a node that recovers and fails again must be redeployed again.
                requests.append(dg.RunRequest(partition_key=node.name, tags={"reason": "health"}))
        return dg.SensorResult(run_requests=requests, cursor=json.dumps(counts))

    return dg.Definitions(sensors=[node_health])
