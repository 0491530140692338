"""Fixtures that start real servers once per session: vLLM (CPU), LiteLLM proxy, vLLM stand-in.

The launchers live in spark_sim.servers (benchmarks/ uses the same ones); here they become
session fixtures, logging under the session's tmp dir and stopped when the session ends. A
missing venv skips the tests that need it, naming the venv.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from spark_sim.servers import (
    HEALTHY_GPU,
    LITELLM_BIN,
    MANDATORY_ENV,
    RECIPE_FLAGS,
    STANDIN,
    VLLM_PYTHON,
    Served,
    StandinFactory,
    free_port,
    make_tiny_model,
    start_real_litellm,
    start_real_vllm,
    start_server,
)
from tests.plugins import unavailable


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not VLLM_PYTHON.exists():
        unavailable(f"real vLLM venv missing: {VLLM_PYTHON}")
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def real_vllm(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A real vLLM 0.32 CPU server, started once (~60 s) and stopped at session end."""
    served = start_real_vllm(tiny_model_dir, tmp_path_factory.mktemp("vllm") / "vllm.log")
    yield served
    served.stop()


@pytest.fixture(scope="session")
def real_litellm(real_vllm: Served, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A real LiteLLM proxy in front of `real_vllm`; its master key is in extra['key_env']."""
    if not LITELLM_BIN.exists():
        unavailable(f"real LiteLLM venv missing: {LITELLM_BIN}")
    served = start_real_litellm(real_vllm, tmp_path_factory.mktemp("litellm"))
    key_env = served.extra["key_env"]
    os.environ[key_env] = served.extra.pop("key")  # the bench CLI reads it via --api-key-env; never printed
    yield served
    os.environ.pop(key_env, None)
    served.stop()


@pytest.fixture(scope="session")
def vllm_standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandinFactory]:
    """Factory: `vllm_standin(gpu=..., env=..., flags=...)` -> Served; all stopped at the end."""
    factory = StandinFactory(tmp_path_factory.mktemp("standins"))
    yield factory
    factory.stop_all()


@pytest.fixture(scope="session")
def healthy_standin(vllm_standin: StandinFactory) -> Served:
    """One stand-in launched with the recipe's full profile on a healthy Founders node."""
    return vllm_standin()


__all__ = [
    "HEALTHY_GPU", "MANDATORY_ENV", "RECIPE_FLAGS", "STANDIN", "Served", "StandinFactory", "free_port",
    "start_server",
]
