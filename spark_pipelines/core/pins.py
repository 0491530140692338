"""Which pins shape which step: the code version of every asset, derived from the fleet file.

Changing one pin changes exactly the code versions of the steps it feeds; Dagster then marks those
assets (and, through their data versions, everything downstream) stale, and the pins sensor asks
for exactly those to be rematerialized. A step whose signature matches what is already on the node
skips its heavy remote work.
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
    launch_by_node = {
        n.name: {
            # The fingerprint ignores env ordering: docker does not care, so neither do code versions.
            "launch": launch_spec(fleet, n).fingerprint,
            "gmu": fleet.launch_for(n).gpu_memory_utilization,
        }
        for n in fleet.serve_nodes
    }
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
        steps.NODE_DEPLOYMENT: launch_by_node,
        steps.GATEWAY: fleet.gateway.model_dump(),
        steps.BENCH_RESULTS: fleet.bench.model_dump(),
    }


def code_versions(fleet: Fleet) -> dict[str, str]:
    return {
        step: f"r{PROCEDURE_REVISION[step]}-{_digest(inputs)}" for step, inputs in step_inputs(fleet).items()
    }


def changed_steps(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """Steps whose code version differs (new steps count as changed), in chain order."""
    return [step for step in new if old.get(step) != new[step]]
