"""Where each runbook artifact lives on a node (plain paths, `~` already expanded)."""

from __future__ import annotations

from spark_pipelines.core.artifacts import Checkpoint
from spark_pipelines.core.launch import expand_home
from spark_pipelines.core.versions import version_path
from spark_pipelines.core.fleet import Fleet, ModelPin, Node

# State this tool keeps on nodes: step markers (what was built from which inputs) and secrets.
STATE_DIR = "~/.cache/spark-pipelines"


def recipe_dir(node: Node) -> str:
    return expand_home("~/DGX_Spark_Qwen3.5-122B-A10B-AR-INT4", node.home_dir)


def build_repo_dir(node: Node) -> str:
    return expand_home("~/spark-vllm-docker", node.home_dir)


def models_dir(fleet: Fleet, node: Node) -> str:
    return expand_home(fleet.launch_for(node).models_dir, node.home_dir)


def base_model_dir(fleet: Fleet, node: Node, pin: ModelPin | None = None) -> str:
    pin = pin or fleet.pins.base_model
    return f"{models_dir(fleet, node)}/{pin.repo.replace('/', '--')}"


def hybrid_dir(fleet: Fleet, node: Node) -> str:
    return f"{models_dir(fleet, node)}/{fleet.launch_for(node).model_dir}"


def marker_path(node: Node, step: str) -> str:
    return expand_home(f"{STATE_DIR}/markers/{step}.json", node.home_dir)


def checkpoint_version_path(fleet: Fleet, node: Node, checkpoint: Checkpoint) -> str:
    """Where `node` holds the checkpoint as a version (the build host: where mtp_weights made it)."""
    if node.name == fleet.build_node.name or not checkpoint.manifest:
        return checkpoint.path
    return version_path(hybrid_dir(fleet, node), checkpoint.manifest)

