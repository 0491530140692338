"""Which pins shape which step: the code version of every asset, derived from the fleet file.

Changing one pin changes exactly the code versions of the steps it feeds; Dagster then marks those
assets (and, through their data versions, everything downstream) stale, and the pins sensor asks
for exactly those to be rematerialized. A step whose signature matches what is already on the node
skips its heavy remote work.

A node's launch (the fleet's launch profile with the node's overrides) is that node's data, not the
fleet's code: `launch_versions` gives each node's, the data version of its `node_launch` partition
upstream of node_deployment. An override changed on one node makes that node's deployment stale and
no other's; node_deployment's code version holds only the fleet-wide procedure.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from spark_pipelines.core import steps
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.core.fleet import Fleet

# Bump when the procedure of a step changes in a way that needs a rerun on every fleet.
PROCEDURE_REVISION = {
    steps.BASE_MODEL: 1,
    steps.HYBRID_CHECKPOINT: 1,
    steps.MTP_WEIGHTS: 1,
    steps.BASE_IMAGE: 1,
    steps.SERVING_IMAGE: 1,
    steps.NODE_ARTIFACTS: 1,
    steps.NODE_DEPLOYMENT: 1,
    steps.GATEWAY: 1,
    steps.BENCH_RESULTS: 1,
}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def step_inputs(fleet: Fleet) -> dict[str, Any]:
    """The pins each step reads (not what it inherits from upstream: that is the data version's job)."""
    p = fleet.pins
    return {
        steps.BASE_MODEL: p.base_model.model_dump(),
        steps.HYBRID_CHECKPOINT: {"recipe": p.recipe_repo.model_dump(), "fp8": p.fp8_model.model_dump(),
                                  "model_dir": fleet.launch.model_dir},
        steps.MTP_WEIGHTS: {"recipe": p.recipe_repo.model_dump()},
        steps.BASE_IMAGE: {
            "build_repo": p.build_repo.model_dump(),
            "vllm_ref": p.vllm_ref,
            "torch": p.torch.model_dump(),
            "patches": [x.model_dump() for x in p.patches],
            "build": p.build.model_dump(),
            "recipe": p.recipe_repo.commit,  # the patch diffs come from the recipe checkout
        },
        steps.SERVING_IMAGE: {"recipe": p.recipe_repo.model_dump(), "serving": p.serving.model_dump(),
                              "image": fleet.launch.image},
        steps.NODE_ARTIFACTS: {"models_dir": fleet.launch.models_dir, "model_dir": fleet.launch.model_dir},
        steps.NODE_DEPLOYMENT: {},  # the procedure only (its revision): each node's launch is launch_versions'
        steps.GATEWAY: fleet.gateway.model_dump(),
        steps.BENCH_RESULTS: fleet.bench.model_dump(),
    }


def code_versions(fleet: Fleet) -> dict[str, str]:
    return {
        step: f"r{PROCEDURE_REVISION[step]}-{_digest(inputs)}" for step, inputs in step_inputs(fleet).items()
    }


def launch_versions(fleet: Fleet) -> dict[str, str]:
    """Each serve node's launch as data: its launch spec's fingerprint (image, env, mounts, serve
    arguments with the GPU memory utilization; env order ignored, as docker ignores it), the value
    of the container's launch-spec label. node_launch's data version, one per node."""
    return {n.name: launch_spec(fleet, n).fingerprint for n in fleet.serve_nodes}


def changed_steps(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Steps whose code version differs (new steps count as changed), in chain order."""
    return [step for step in new if old.get(step) != new[step]]
