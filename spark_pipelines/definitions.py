"""The one dg.Definitions of spark-pipelines: each runbook phase's module and each sensor module
returns its own Definitions; they are merged here with the resources, declared once.

SPARK_FLEET names the fleet file (default: fleets/seed.yaml next to the package). It is read once
per code-location load: partitions, code versions and the resources all come from that read.
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from spark_pipelines.assets.bench import bench_definitions
from spark_pipelines.assets.experiments import experiment_definitions
from spark_pipelines.assets.fleet_summary import fleet_summary_definitions
from spark_pipelines.assets.gateway import gateway_definitions
from spark_pipelines.assets.health import health_definitions
from spark_pipelines.assets.images import image_definitions
from spark_pipelines.assets.model import model_definitions
from spark_pipelines.assets.jit_cache import jit_cache_definitions
from spark_pipelines.assets.nodes import node_definitions
from spark_pipelines.assets.rollout import rollout_definitions
from spark_pipelines.assets.wedge import wedge_definitions
from spark_pipelines.core import steps
from spark_pipelines.core.fleet import load_fleet
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


def fleet_path_from_env() -> str:
    return str(Path(os.environ.get(FLEET_ENV) or DEFAULT_FLEET).resolve())


def litellm_resource(key_env: str, ssh: FleetSSH) -> LiteLLMGateway:
    """The proxy's master key as a dg.EnvVar, bound only where the variable is set: Dagster fails
    a run at resource init on an unset EnvVar, and a proxy without a master key needs none."""
    return LiteLLMGateway(ssh=ssh, master_key=dg.EnvVar(key_env) if os.environ.get(key_env) else None)


def build_definitions(fleet_path: str | None = None, command_log_path: str | None = None) -> dg.Definitions:
    fleet_path = str(Path(fleet_path).resolve()) if fleet_path else fleet_path_from_env()
    fleet = load_fleet(fleet_path)
    ssh = FleetSSH(fleet_path=fleet_path, command_log_path=command_log_path or os.environ.get("SPARK_COMMAND_LOG"))
    # Sensors are given the very job objects the phases define (the UI shows them as targets).
    images, nodes, rollout = image_definitions(fleet), node_definitions(fleet), rollout_definitions(fleet)
    bench, healing = bench_definitions(fleet), health_definitions(fleet)
    return dg.Definitions.merge(
        model_definitions(fleet),
        images,
        nodes,
        rollout,
        jit_cache_definitions(fleet),
        gateway_definitions(fleet),
        bench,
        wedge_definitions(fleet),
        healing,
        fleet_summary_definitions(fleet),
        experiment_definitions(fleet),
        pins_sensors(fleet, fleet_path, jobs=[j for j in [*(images.jobs or []), *(rollout.jobs or [])]
                                              if j.name in (steps.BUILD_JOB, steps.ROLLOUT_JOB)]),
        health_sensors(fleet, jobs=[*(nodes.jobs or []), *(bench.jobs or []), *(healing.jobs or [])]),
        wedge_sensors(fleet),
        schedule_definitions(fleet),
        dg.Definitions(resources={"ssh": ssh, "hub": model_hub(), "io_manager": StepOutputs(),
                                  "litellm": litellm_resource(fleet.gateway.master_key_env, ssh)}),
    )


@dg.definitions
def defs() -> dg.Definitions:
    return build_definitions()
