"""Rerun exactly what a pin or a node's launch change makes stale.

The code versions are those of the fleet loaded with the code location (core/pins.py), the same
ones the UI shows. Each tick compares them with the code version Dagster RECORDED for each step's
latest materialization (per node for the node steps) and requests the steps that differ, so the
sensor and the UI's "code version changed" staleness always agree. The earliest changed steps are
requested; a changed launch profile (node steps) is one gated rollout_job, and declarative
automation on fleet_rollout carries a rebuilt checkpoint or image to the fleet the same way.

A node's launch is data (core.pins.launch_versions): each tick observes node_launch for the nodes
whose loaded launch differs from the newest observation (so the UI marks exactly those nodes'
deployments stale) and asks the rollout for the nodes whose deployment was made from another launch
than the loaded one, reading the observation its provenance points at as Dagster does.

An edited fleet file takes effect on a code-location reload (UI "Reload", or restarting `make ui`).
Until then the sensor keeps to the loaded fleet and says in its skip reason that the file changed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from spark_pipelines.core.fleet import Fleet, FleetError, load_fleet
from spark_pipelines.core.pins import code_versions, launch_versions
from spark_pipelines.core import steps
from spark_pipelines.state import records

UNPARTITIONED = steps.BUILD_STEPS
PER_NODE = steps.NODE_STEPS


def stale_steps(instance: dg.DagsterInstance, loaded: dict[str, str], fleet: Fleet,
                launch: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, list[str]]]:
    """(unpartitioned steps, node -> node steps) whose recorded code version differs from the
    loaded one, node_deployment also where it was deployed from another launch than `launch`
    (default: the loaded fleet's). A step never materialized is not stale: the first build is the
    operator's."""
    launch = launch_versions(fleet) if launch is None else launch

    def stale(step: str, partition: str | None = None) -> bool:
        if records.recorded_code_version(instance, step, partition) not in (None, loaded[step]):
            return True
        # A deployment recorded before node_launch existed names no launch: stale, the rollout
        # records it again (without a deploy when it serves the loaded launch already).
        return (step == steps.NODE_DEPLOYMENT and partition is not None
                and records.latest(instance, step, partition) is not None
                and records.recorded_launch(instance, partition) != launch[partition])

    build = [s for s in UNPARTITIONED if stale(s)]
    nodes = {n.name: [s for s in PER_NODE if stale(s, n.name)] for n in fleet.serve_nodes}
    return build, {name: stale_ones for name, stale_ones in nodes.items() if stale_ones}


def rollout_key(loaded: Mapping[str, str], launch: Mapping[str, str]) -> str:
    """The run key of a pins rollout: the fleet it brings every node to (the node steps' code
    versions and each node's launch). It changes when that target changes, not when a node reaches
    it or stops on a gate: a rollout is never retried blindly."""
    digest = hashlib.sha256(json.dumps(dict(launch), sort_keys=True).encode()).hexdigest()[:16]
    return "rollout-" + "-".join(f"{s}:{loaded[s]}" for s in PER_NODE) + f"-launch:{digest}"


RELOAD_NOTE = "the fleet file changed since the code location loaded: reload it (UI Reload) to apply the edit"


def pins_sensors(fleet: Fleet, fleet_path: str, jobs: Sequence[Any] = ()) -> dg.Definitions:
    """`jobs`: build_job and rollout_job (the same objects the asset modules define), so the UI
    shows the sensor's targets and its runs on those jobs' pages."""
    loaded = code_versions(fleet)
    launch = launch_versions(fleet)
    build_job = steps.BUILD_JOB if any(j.name == steps.BUILD_JOB for j in jobs) else None

    @dg.sensor(name=steps.PINS_SENSOR, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.STOPPED,
               jobs=list(jobs) or None,
               description="Compares the loaded fleet's pins (code versions) and each node's launch (node_launch, "
                           "observed here) with those recorded on each step's latest materialization and requests "
                           "exactly the stale steps: build_job from the earliest stale build step, then one gated "
                           "rollout_job for the nodes whose pins or launch changed once the build is current.")
    def pins_changed(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        # The file is read only to tell the operator; what is requested follows the loaded fleet.
        try:
            on_disk = load_fleet(fleet_path)
            note = None if (code_versions(on_disk), launch_versions(on_disk)) == (loaded, launch) else RELOAD_NOTE
        except FleetError as e:
            # Mid-edit: nothing runs until the file is whole again (and the location reloaded).
            return dg.SensorResult(skip_reason=f"fleet file unusable, nothing requested: {e}")
        # The loaded launches as node_launch's data: the UI's staleness follows from these.
        observed = records.launch_changes(context.instance, launch)
        build, nodes = stale_steps(context.instance, loaded, fleet, launch)
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
            # rollout (canary, waves, rollback), never as a deploy per node at once; it leaves every
            # node that serves its launch already as it is.
            stale = sorted({s for node_steps in nodes.values() for s in node_steps}, key=PER_NODE.index)
            requests.append(dg.RunRequest(run_key=rollout_key(loaded, launch), job_name=steps.ROLLOUT_JOB,
                                          tags={steps.PINS_TAG: ",".join(stale), steps.NODES_TAG: ",".join(nodes)}))
        if requests:
            return dg.SensorResult(run_requests=requests, asset_events=observed)
        return dg.SensorResult(skip_reason=note or "every step is at the loaded code versions and launches",
                               asset_events=observed)

    # Carries a rebuilt checkpoint or image to the fleet: fleet_rollout's eager condition.
    rollout = dg.AutomationConditionSensorDefinition(
        steps.ROLLOUT_SENSOR, target=dg.AssetSelection.assets(steps.FLEET_ROLLOUT), default_status=dg.DefaultSensorStatus.STOPPED,
        description="Declarative automation of the rollout: once the build host holds a new checkpoint or image, "
                    "fleet_rollout runs (canary, waves, gates, rollback of a failed node).")
    return dg.Definitions(sensors=[pins_changed, rollout])
