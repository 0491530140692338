"""The one dg.Definitions of spark-pipelines, built from a fleet file.

SPARK_FLEET names the fleet file (default: fleets/seed.yaml next to the package). The fleet gives
the node partitions and each step's code version; the resources reload it at run time.
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

from spark_pipelines.assets.bench import build_bench_assets
from spark_pipelines.assets.experiments import ab_experiment_job
from spark_pipelines.assets.gateway import build_gateway_assets
from spark_pipelines.assets.images import build_image_assets
from spark_pipelines.assets.model import build_model_assets
from spark_pipelines.assets.nodes import build_node_assets
from spark_pipelines.fleet import load_fleet
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.hub import ModelHub
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.schedules import build_schedules
from spark_pipelines.sensors.health import build_health_sensor
from spark_pipelines.sensors.wedge import build_wedge_sensor
from spark_pipelines.sensors.pins import build_pins_sensor

FLEET_ENV = "SPARK_FLEET"
DEFAULT_FLEET = str(Path(__file__).resolve().parent.parent / "fleets" / "seed.yaml")


def build_definitions(fleet_path: str | None = None, command_log_path: str | None = None) -> dg.Definitions:
    fleet_path = str(Path(fleet_path or os.environ.get(FLEET_ENV) or DEFAULT_FLEET).resolve())
    fleet = load_fleet(fleet_path)
    assets = [
        *build_model_assets(fleet),
        *build_image_assets(fleet),
        *build_node_assets(fleet),
        *build_gateway_assets(fleet),
        *build_bench_assets(fleet),
    ]
    build_job = dg.define_asset_job("build_job", selection=dg.AssetSelection.groups("model", "images"),
                                    description="Steps 0-4 on the build host: checkpoint, MTP weights, images.")
    node_job = dg.define_asset_job("deploy_node_job", selection=dg.AssetSelection.groups("nodes"),
                                   description="Artifacts and deployment on one node.")
    gateway_job = dg.define_asset_job("gateway_job", selection=dg.AssetSelection.groups("gateway"))
    bench_job = dg.define_asset_job("bench_job", selection=dg.AssetSelection.groups("bench"),
                                    description="Isolated bench of one node.")
    ssh = FleetSSH(fleet_path=fleet_path, command_log_path=command_log_path or os.environ.get("SPARK_COMMAND_LOG"))
    return dg.Definitions(
        assets=assets,
        jobs=[build_job, node_job, gateway_job, bench_job, ab_experiment_job],
        sensors=[
            build_pins_sensor(fleet_path, build_job, node_job),
            build_health_sensor(fleet_path, node_job),
            build_wedge_sensor(fleet_path, bench_job),
            # Carries a rebuilt checkpoint or image to every node (eager conditions on the node steps).
            dg.AutomationConditionSensorDefinition(
                "rollout", target=dg.AssetSelection.groups("nodes"), default_status=dg.DefaultSensorStatus.STOPPED
            ),
        ],
        schedules=build_schedules(build_job, bench_job, [n.name for n in fleet.serve_nodes]),
        resources={"ssh": ssh, "hub": ModelHub(), "litellm": LiteLLMGateway(ssh=ssh)},
    )


defs = build_definitions()
