"""Rerun exactly what a pin change makes stale.

Every tick reads the fleet file, derives each step's code version (core/pins.py) and compares it
with the cursor. The earliest changed steps are requested; declarative automation on the node
steps carries the change downstream (artifacts -> deployment -> gateway) once they complete.
"""


import json


import dagster as dg

from spark_pipelines.core.pins import changed_steps, code_versions
from spark_pipelines.core.fleet import FleetError, load_fleet

UNPARTITIONED = ("base_model", "hybrid_checkpoint", "mtp_weights", "base_image", "serving_image")
PER_NODE = ("node_artifacts", "node_deployment")


def pins_sensors(fleet_path: str) -> dg.Definitions:
    @dg.sensor(name="pins_changed", minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.STOPPED,
               description="Requests the steps whose pins changed in the fleet file.")
    def pins_changed(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        try:
            fleet = load_fleet(fleet_path)
        except FleetError as e:
            return dg.SensorResult(skip_reason=f"fleet file unusable, nothing requested: {e}", cursor=context.cursor)
        now = code_versions(fleet)
        if context.cursor is None:
            return dg.SensorResult(cursor=json.dumps(now), skip_reason="first tick: pins recorded")
        changed = changed_steps(json.loads(context.cursor), now)
        if not changed:
            return dg.SensorResult(cursor=json.dumps(now), skip_reason="no pin changed")
        key = "-".join(f"{s}:{now[s]}" for s in changed)
        requests: list[dg.RunRequest] = []
        build = [s for s in UNPARTITIONED if s in changed]
        if build:
            # The changed steps and everything unpartitioned after them; nodes follow by automation.
            first = UNPARTITIONED.index(build[0])
            selection = [dg.AssetKey(s) for s in UNPARTITIONED[first:] if s in changed or UNPARTITIONED.index(s) > first]
            requests.append(dg.RunRequest(run_key=f"build-{key}", asset_selection=selection, tags={"pins": ",".join(changed)}))
        elif any(s in changed for s in PER_NODE):
            for node in fleet.serve_nodes:
                requests.append(dg.RunRequest(run_key=f"{node.name}-{key}", job_name="deploy_node_job",
                                              partition_key=node.name, tags={"pins": ",".join(changed)}))
        return dg.SensorResult(run_requests=requests, cursor=json.dumps(now))

    # Carries a rebuilt checkpoint or image to every node (eager conditions on the node steps).
    rollout = dg.AutomationConditionSensorDefinition(
        "rollout", target=dg.AssetSelection.groups("nodes"), default_status=dg.DefaultSensorStatus.STOPPED,
        description="Declarative automation of the node steps: once the build host holds a new checkpoint or "
                    "image, node_artifacts and node_deployment follow on every node (eager conditions).")
    return dg.Definitions(sensors=[pins_changed, rollout])
