"""Launchers of the servers the tests and the benchmarks run against: real vLLM (CPU) serving a
tiny random-weight Llama, a real LiteLLM proxy, and the vLLM stand-in.

One copy for both: the pytest fixtures (tests/plugins/servers.py) and benchmarks/ import from here.
Every server binds 127.0.0.1 on a free port, logs to a file, runs in its own process group and is
stopped by its pid.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from spark_pipelines.core.polling import poll_until

# bootstrap.sh puts the venvs here; SPARK_*_VENV moves them.
VLLM_PYTHON = Path(os.environ.get("SPARK_VLLM_VENV", "/opt/spark-pipelines/vllm")) / "bin" / "python"
LITELLM_BIN = Path(os.environ.get("SPARK_LITELLM_VENV", "/opt/spark-pipelines/litellm")) / "bin" / "litellm"
SYSTEM_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
STANDIN = Path(__file__).with_name("vllm_standin.py")
TINY_MODEL_SCRIPT = Path(__file__).with_name("tiny_model.py")
TINY_MODEL_NAME = "tiny"
# LongCode asks for 2048 tokens; the context must hold it plus the prompt.
TINY_MAX_MODEL_LEN = 2304
# The recipe's launch profile (runbook Phase 4), as the stand-in receives it.
RECIPE_FLAGS = (
    "--max-model-len", "262144",
    "--gpu-memory-utilization", "0.85",
    "--reasoning-parser", "qwen3",
    "--attention-backend", "FLASHINFER",
    "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}',
)
HEALTHY_GPU = {"state": "healthy", "profile": "founders", "free_gib": 107.82, "total_gib": 121.69}
MANDATORY_ENV = {"VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS": "1", "MAX_JOBS": "2",
                 "FLASHINFER_NVCC_THREADS": "1"}
LITELLM_KEY_ENV = "SPARK_TEST_LITELLM_KEY"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    """A running server: where it answers, its log, and how to stop it."""

    base_url: str
    model: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    extra: dict[str, str] = field(default_factory=dict)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0) -> int | None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode


def _get(url: str, headers: Mapping[str, str] | None = None, timeout: float = 2.0) -> int:
    req = urllib.request.Request(url, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310 - loopback only
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return 0


def start_server(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    ready_url: str,
    base_url: str,
    model: str,
    timeout: float,
    ready_headers: Mapping[str, str] | None = None,
) -> Served:
    """Start argv in its own process group and wait until ready_url answers 200."""
    log = open(log_path, "wb")  # noqa: SIM115 - the child owns it for its lifetime
    proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=dict(env),
                            start_new_session=True)
    log.close()
    served = Served(base_url, model, proc, log_path)

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"{argv[0]} exited {proc.returncode} before ready; log "
                               f"{log_path}:\n{served.log()[-3000:]}")
        return _get(ready_url, ready_headers) == 200

    try:
        if poll_until(ready, bool, timeout_s=timeout, every_s=0.5).done:
            return served
    except BaseException:
        served.stop()
        raise
    served.stop()
    raise RuntimeError(f"{argv[0]} not ready after {timeout:.0f} s; log {log_path}:\n"
                       f"{served.log()[-3000:]}")


def loopback_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SIM_", "VLLM_"))}
    # Loopback only, never through a proxy.
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        env.pop(k, None)
    return env


# ---------------------------------------------------------------------------------------------
# Real vLLM (CPU) serving a tiny random-weight Llama, and a real LiteLLM proxy in front of it
# ---------------------------------------------------------------------------------------------


def make_tiny_model(out: Path, timeout: float = 120) -> Path:
    """The tiny checkpoint directory (written by the vLLM venv's python: it needs `tokenizers`)."""
    subprocess.run([str(VLLM_PYTHON), str(TINY_MODEL_SCRIPT), str(out)], check=True, capture_output=True,
                   timeout=timeout)
    return out


def start_real_vllm(model_dir: Path, log_path: Path, *, timeout: float = 300,
                    wrap: Callable[[list[str]], list[str]] = lambda argv: argv) -> Served:
    """A real vLLM CPU server for `model_dir`; `wrap` may prefix the argv (e.g. taskset)."""
    port = free_port()
    env = loopback_env()
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", TINY_MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(port), "--load-format", "dummy",
            "--max-model-len", str(TINY_MAX_MODEL_LEN)]
    base = f"http://127.0.0.1:{port}"
    return start_server(wrap(argv), env=env, log_path=log_path, ready_url=base + "/health",
                        base_url=base, model=TINY_MODEL_NAME, timeout=timeout)


def start_real_litellm(backend: Served, work: Path, *, timeout: float = 120) -> Served:
    """A real LiteLLM proxy in front of `backend`, with a fresh master key: its value is in
    extra['key'], the variable the proxy reads it from in extra['key_env']."""
    port = free_port()
    key = "sk-" + secrets.token_hex(16)
    config = {
        "model_list": [{
            "model_name": backend.model,
            "litellm_params": {"model": f"openai/{backend.model}", "api_base": backend.base_url + "/v1",
                               "api_key": "none"},
        }],
        "general_settings": {"master_key": f"os.environ/{LITELLM_KEY_ENV}"},
    }
    (work / "config.yaml").write_text(json.dumps(config))  # JSON is valid YAML
    env = loopback_env()
    env.update({"LITELLM_LOCAL_MODEL_COST_MAP": "True", LITELLM_KEY_ENV: key})
    base = f"http://127.0.0.1:{port}"
    served = start_server(
        [str(LITELLM_BIN), "--config", str(work / "config.yaml"), "--host", "127.0.0.1", "--port", str(port)],
        env=env, log_path=work / "litellm.log", ready_url=base + "/health/readiness",
        base_url=base, model=backend.model, timeout=timeout,
    )
    served.extra.update(key_env=LITELLM_KEY_ENV, key=key)
    return served


# ---------------------------------------------------------------------------------------------
# The vLLM stand-in (system python3, stdlib only)
# ---------------------------------------------------------------------------------------------


def standin_argv(port: int, flags: Sequence[str] = RECIPE_FLAGS, model: str = "qwen35-hybrid-v2"
                 ) -> list[str]:
    return [SYSTEM_PYTHON, str(STANDIN), "serve", "/models/qwen35-122b-hybrid-int4fp8",
            "--served-model-name", model, "--host", "127.0.0.1", "--port", str(port), *flags]


def standin_env(gpu_file: Path, gpu: Mapping[str, object], extra: Mapping[str, str]) -> dict[str, str]:
    gpu_file.write_text(json.dumps(gpu))
    env = loopback_env()
    env.update({"SIM_GPU_STATE_FILE": str(gpu_file), "SIM_STARTUP_SECONDS": "0.4"})
    env.update(extra)
    return env


class StandinFactory:
    """Starts stand-ins with a given GPU state, env and flags; stops them all at teardown."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[Served] = []

    def __call__(
        self,
        *,
        gpu: Mapping[str, object] = HEALTHY_GPU,
        env: Mapping[str, str] = MANDATORY_ENV,
        flags: Sequence[str] = RECIPE_FLAGS,
        model: str = "qwen35-hybrid-v2",
        timeout: float = 30.0,
    ) -> Served:
        port = free_port()
        d = self.root / f"standin-{port}"
        d.mkdir(parents=True)
        base = f"http://127.0.0.1:{port}"
        served = start_server(standin_argv(port, flags, model),
                              env=standin_env(d / "gpu.json", gpu, env), log_path=d / "vllm.log",
                              ready_url=base + "/health", base_url=base, model=model,
                              timeout=timeout)
        served.extra["gpu_file"] = str(d / "gpu.json")
        self.started.append(served)
        return served

    def run_to_exit(
        self,
        *,
        gpu: Mapping[str, object] = HEALTHY_GPU,
        env: Mapping[str, str] = MANDATORY_ENV,
        flags: Sequence[str] = RECIPE_FLAGS,
        timeout: float = 30.0,
    ) -> tuple[int, str]:
        """Launch a stand-in expected to die during startup: (exit code, its log)."""
        port = free_port()
        d = self.root / f"standin-fail-{port}"
        d.mkdir(parents=True)
        proc = subprocess.run(standin_argv(port, flags), env=standin_env(d / "gpu.json", gpu, env),
                              capture_output=True, timeout=timeout)
        return proc.returncode, (proc.stdout + proc.stderr).decode(errors="replace")

    def stop_all(self) -> None:
        for served in self.started:
            served.stop()
