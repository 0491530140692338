"""The one dg.Definitions of spark-pipelines: each runbook phase's module and each sensor module
returns its own Definitions; they are merged here with the resources, declared once.

SPARK_FLEET names the fleet file (default: fleets/seed.yaml next to the package). It is read once
per code-location load: partitions, code versions and the resources all come from that read. The
text read is kept as the location's reconstruction metadata: every run worker (launched from the
UI, a sensor, a schedule or the demo) rebuilds the definitions from that same text, not from the
file as it is now, and the `ssh` resource refuses a run whose file differs from it (one line:
reload the code location). An edit therefore takes effect exactly when the code location reloads.
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from spark_pipelines.assets.adoption import adoption_definitions
from spark_pipelines.assets.bench import bench_definitions
from spark_pipelines.assets.experiments import experiment_definitions
from spark_pipelines.assets.fleet_summary import fleet_summary_definitions
from spark_pipelines.assets.gateway import gateway_definitions
from spark_pipelines.assets.health import health_definitions
from spark_pipelines.assets.images import image_definitions
from spark_pipelines.assets.model import model_definitions
from spark_pipelines.assets.jit_cache import jit_cache_definitions
from spark_pipelines.assets.nodes import node_definitions
from spark_pipelines.assets.node_join import node_join_definitions
from spark_pipelines.assets.node_os import node_os_definitions
from spark_pipelines.assets.rollout import rollout_definitions
from spark_pipelines.assets.versions import versions_definitions
from spark_pipelines.assets.wedge import wedge_definitions
from spark_pipelines.core import steps
from spark_pipelines.core.fleet import fleet_digest, load_fleet_text, read_fleet_text
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.hub import model_hub
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.resources.step_outputs import StepOutputs
from spark_pipelines.schedules import schedule_definitions
from spark_pipelines.sensors.health import health_sensors
from spark_pipelines.sensors.pins import pins_sensors
from spark_pipelines.sensors.wedge import wedge_sensors

FLEET_ENV = "SPARK_FLEET"
DEFAULT_FLEET = str(Path(__file__).resolve().parent.parent / "fleets" / "seed.yaml")
FLEET_TEXT_KEY = "spark/fleet-file"  # reconstruction metadata: the fleet file's text as loaded


def fleet_path_from_env() -> str:
    return str(Path(os.environ.get(FLEET_ENV) or DEFAULT_FLEET).resolve())


def litellm_resource(key_env: str, ssh: FleetSSH) -> LiteLLMGateway:
    """The proxy's master key as a dg.EnvVar, bound only where the variable is set: Dagster fails
    a run at resource init on an unset EnvVar, and a proxy without a master key needs none."""
    return LiteLLMGateway(ssh=ssh, master_key=dg.EnvVar(key_env) if os.environ.get(key_env) else None)


def build_definitions(fleet_path: str | None = None, command_log_path: str | None = None,
                      fleet_text: str | None = None) -> dg.Definitions:
    """The definitions for the fleet file at `fleet_path` (default SPARK_FLEET), from `fleet_text`
    when given (the text the code location loaded), else from the file read now."""
    fleet_path = str(Path(fleet_path).resolve()) if fleet_path else fleet_path_from_env()
    text = read_fleet_text(fleet_path) if fleet_text is None else fleet_text
    fleet = load_fleet_text(text, fleet_path)
    ssh = FleetSSH(fleet_path=fleet_path, command_log_path=command_log_path or os.environ.get("SPARK_COMMAND_LOG"),
                   fleet_digest=fleet_digest(text))
    # Sensors are given the very job objects the phases define (the UI shows them as targets).
    images, nodes, rollout = image_definitions(fleet), node_definitions(fleet), rollout_definitions(fleet)
    bench, healing = bench_definitions(fleet), health_definitions(fleet)
    # The jobs that finish a dead run's procedure (core.steps.FINISHED_BY) are the sweep's too.
    node_os, join, wedge = node_os_definitions(fleet), node_join_definitions(fleet), wedge_definitions(fleet)
    finishers = [j for d in (node_os, join, wedge) for j in (d.jobs or []) if j.name in steps.FINISHED_BY.values()]
    return dg.Definitions.merge(
        adoption_definitions(fleet),
        model_definitions(fleet),
        images,
        nodes,
        node_os,
        join,
        rollout,
        jit_cache_definitions(fleet),
        versions_definitions(fleet),
        gateway_definitions(fleet),
        bench,
        wedge,
        healing,
        fleet_summary_definitions(fleet),
        experiment_definitions(fleet),
        pins_sensors(fleet, fleet_path, jobs=[j for j in [*(images.jobs or []), *(rollout.jobs or [])]
                                              if j.name in (steps.BUILD_JOB, steps.ROLLOUT_JOB)]),
        health_sensors(fleet, jobs=[*(nodes.jobs or []), *(bench.jobs or []), *(healing.jobs or []), *finishers]),
        wedge_sensors(fleet),
        schedule_definitions(fleet),
        dg.Definitions(resources={"ssh": ssh, "hub": model_hub(), "io_manager": StepOutputs(),
                                  "litellm": litellm_resource(fleet.gateway.master_key_env, ssh)}),
    )


@dg.definitions
def defs() -> dg.Definitions:
    from dagster._core.definitions.definitions_load_context import DefinitionsLoadContext, DefinitionsLoadType

    context = DefinitionsLoadContext.get()
    if context.load_type == DefinitionsLoadType.RECONSTRUCTION:  # a run worker: the loaded text
        loaded = context.reconstruction_metadata.get(FLEET_TEXT_KEY)
        if isinstance(loaded, str):
            return build_definitions(fleet_text=loaded)
    text = read_fleet_text(fleet_path_from_env())
    # Kept by Dagster with every run's execution plan and handed to its run worker's reconstruction.
    context.add_to_pending_reconstruction_metadata(FLEET_TEXT_KEY, text)
    return build_definitions(fleet_text=text)
