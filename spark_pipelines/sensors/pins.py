"""Rerun exactly what a pin change makes stale.

The code versions are those of the fleet loaded with the code location (core/pins.py), the same
ones the UI shows. Each tick compares them with the code version Dagster RECORDED for each step's
latest materialization (per node for the node steps) and requests the steps that differ, so the
sensor and the UI's "code version changed" staleness always agree. The earliest changed steps are
requested; a changed launch profile (node steps) is one gated rollout_job, and declarative
automation on fleet_rollout carries a rebuilt checkpoint or image to the fleet the same way.

An edited fleet file takes effect on a code-location reload (UI "Reload", or restarting `make ui`).
Until then the sensor keeps to the loaded fleet and says in its skip reason that the file changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import dagster as dg

from spark_pipelines.core.fleet import Fleet, FleetError, load_fleet
from spark_pipelines.core.pins import code_versions
from spark_pipelines.core import steps
from spark_pipelines.state import records

UNPARTITIONED = steps.BUILD_STEPS
PER_NODE = steps.NODE_STEPS


def stale_steps(instance: dg.DagsterInstance, loaded: dict[str, str],
                fleet: Fleet) -> tuple[list[str], dict[str, list[str]]]:
    """(unpartitioned steps, node -> node steps) whose recorded code version differs from the
    loaded one. A step never materialized is not stale: the first build is the operator's."""
    def stale(step: str, partition: str | None = None) -> bool:
        return records.recorded_code_version(instance, step, partition) not in (None, loaded[step])

    build = [s for s in UNPARTITIONED if stale(s)]
    nodes = {n.name: [s for s in PER_NODE if stale(s, n.name)] for n in fleet.serve_nodes}
    return build, {name: stale_ones for name, stale_ones in nodes.items() if stale_ones}


RELOAD_NOTE = "the fleet file changed since the code location loaded: reload it (UI Reload) to apply the edit"


def pins_sensors(fleet: Fleet, fleet_path: str, jobs: Sequence[Any] = ()) -> dg.Definitions:
    """`jobs`: build_job and rollout_job (the same objects the asset modules define), so the UI
    shows the sensor's targets and its runs on those jobs' pages."""
    loaded = code_versions(fleet)
    build_job = steps.BUILD_JOB if any(j.name == steps.BUILD_JOB for j in jobs) else None

    @dg.sensor(name=steps.PINS_SENSOR, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.STOPPED,
               jobs=list(jobs) or None,
               description="Compares the loaded fleet's pins (code versions) with those recorded on each step's "
                           "latest materialization and requests exactly the stale steps: build_job from the "
                           "earliest stale build step, then one gated rollout_job once the build is current.")
    def pins_changed(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        # The file is read only to tell the operator; what is requested follows the loaded fleet.
        try:
            note = None if code_versions(load_fleet(fleet_path)) == loaded else RELOAD_NOTE
        except FleetError as e:
            # Mid-edit: nothing runs until the file is whole again (and the location reloaded).
            return dg.SensorResult(skip_reason=f"fleet file unusable, nothing requested: {e}")
        build, nodes = stale_steps(context.instance, loaded, fleet)
        requests: list[dg.RunRequest] = []
        if build:
            # The changed steps and everything unpartitioned after them; nodes follow by automation.
            after = UNPARTITIONED[UNPARTITIONED.index(build[0]):]
            key = "-".join(f"{s}:{loaded[s]}" for s in after)
            # The run key holds the code versions: a request is made once per pin change, not per tick.
            requests.append(dg.RunRequest(run_key=f"build-{key}", asset_selection=[dg.AssetKey(s) for s in after],
                                          job_name=build_job, tags={steps.PINS_TAG: ",".join(build)}))
        elif nodes:
            # Node steps only once the build is current (they consume its output), and as one gated
            # rollout (canary, waves, rollback), never as a deploy per node at once. The run key
            # holds the code versions: a rollout that stopped on a gate is not retried blindly.
            key = "-".join(f"{s}:{loaded[s]}" for s in PER_NODE)
            stale = sorted({s for node_steps in nodes.values() for s in node_steps}, key=PER_NODE.index)
            requests.append(dg.RunRequest(run_key=f"rollout-{key}", job_name=steps.ROLLOUT_JOB,
                                          tags={steps.PINS_TAG: ",".join(stale), steps.NODES_TAG: ",".join(nodes)}))
        if requests:
            return dg.SensorResult(run_requests=requests)
        return dg.SensorResult(skip_reason=note or "every step is at the loaded code versions")

    # Carries a rebuilt checkpoint or image to the fleet: fleet_rollout's eager condition.
    rollout = dg.AutomationConditionSensorDefinition(
        steps.ROLLOUT_SENSOR, target=dg.AssetSelection.assets(steps.FLEET_ROLLOUT), default_status=dg.DefaultSensorStatus.STOPPED,
        description="Declarative automation of the rollout: once the build host holds a new checkpoint or image, "
                    "fleet_rollout runs (canary, waves, gates, rollback of a failed node).")
    return dg.Definitions(sensors=[pins_changed, rollout])
