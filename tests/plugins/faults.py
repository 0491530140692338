"""The invariants no fault may break, for the fault suite; the injectors themselves live in the
simulator package (spark_sim/faults.py) so that the soak harness uses them too.

The invariants read the real parts: the engine's /health over HTTP, the container through the
node's own dockerd, the LiteLLM config file on the gateway host and the proxy itself, and every
byte of the checkpoint on the build host and the receiver.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from spark_sim.fleet import Member, SimFleet
from spark_sim.faults import (  # noqa: F401 - the fault suite's names, re-exported
    CONTAINER,
    ENGINE_PORT,
    engine_healthy,
    PROXY_PORT,
    FaultError,
    _proc_table,
    descendants,
    _cmdline,
    _pidfile,
    sshd_pids,
    dockerd_pid,
    docker,
    engine_pids,
    stopped,
    frozen_sshd,
    frozen_dockerd,
    frozen_engine,
    link_down,
    slow_link,
    SessionKiller,
    _uid,
    tmpfs_over,
    corrupt_same_size,
    tree_digests,
    _start_sshd,
    _restart_sshd,
    _banner,
    host_key_changed,
    gateway_config_path,
    gateway_config,
    rotation,
    proxy_pid,
    kill_proxy,
    proxy_ready,
    restart_proxy,
    RotationWatch,
    wait_for,
)


# -- invariants --------------------------------------------------------------------------------


def engine_requests_running(m: Member) -> float:
    """vllm:num_requests_running on the node's deployed engine (0 when it does not answer)."""
    try:
        text = httpx.get(f"http://{m.ip}:{ENGINE_PORT}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def container(m: Member, name: str = CONTAINER) -> dict[str, Any] | None:
    import json

    r = docker(m, "container", "inspect", name, check=False)
    return json.loads(r.stdout)[0] if r.returncode == 0 else None


def assert_serving(sim: SimFleet, node: str, container_id: str | None = None, *, within_s: float = 30) -> None:
    """The node's deployment answers /health, its container runs under the live name, and (given
    the id from before the fault) it is that same deployment."""
    m = sim.node(node)
    deadline = time.monotonic() + within_s
    while not engine_healthy(m) and time.monotonic() < deadline:
        time.sleep(0.5)
    c = container(m)
    state = (c or {}).get("State", {})
    listing = "; ".join(sim.containers(m))
    assert c is not None and state.get("Running"), f"{node}: no running {CONTAINER} (containers: {listing})"
    assert engine_healthy(m), f"{node}: /health does not answer (containers: {listing})"
    if container_id:
        assert c["Id"] == container_id, (
            f"{node}: {CONTAINER} is {c['Id'][:12]}, not the deployment that served before the fault "
            f"({container_id[:12]}); containers: {listing}")


def ask_proxy(sim: SimFleet, pool: str = "fast", timeout: float = 60) -> httpx.Response:
    key = os.environ["LITELLM_MASTER_KEY"]
    return httpx.post(f"http://{sim.gateway.ip}:{PROXY_PORT}/v1/chat/completions",
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": pool, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                      timeout=timeout)


def assert_gateway_has_backend(sim: SimFleet, *, within_s: float = 60) -> list[str]:
    """The real config on the gateway host routes to at least one node, and the proxy answers a
    request through it. Returns the rotation."""
    nodes = rotation(gateway_config(sim))
    assert nodes, f"the gateway config {gateway_config_path(sim)} routes to no node"
    deadline = time.monotonic() + within_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = ask_proxy(sim)
            if r.status_code == 200:
                return nodes
            last = f"HTTP {r.status_code}: {r.text[:200]}"
        except httpx.HTTPError as e:
            last = type(e).__name__
        time.sleep(1)
    pytest.fail(f"the gateway proxy routes to {nodes} in its config but does not answer: {last}", pytrace=False)


def hybrid_dir(sim: SimFleet, node: str) -> Path:
    """The checkpoint directory on a node, as the seed fleet lays it out (~/models/<model_dir>)."""
    return sim.node(node).home / "models" / "qwen35-122b-hybrid-int4fp8"


def artifact_digests(sim: SimFleet, node: str) -> tuple[dict[str, str], str | None]:
    m = sim.node(node)
    image = docker(m, "image", "inspect", "--format", "{{.Id}}", "vllm-qwen35-v2:latest", check=False)
    return tree_digests(hybrid_dir(sim, node)), (image.stdout.strip() if image.returncode == 0 else None)


def assert_artifacts_intact(sim: SimFleet, node: str, build: str = "spark1") -> None:
    """Every file of the node's checkpoint is byte-identical to the build host's (and none is
    missing), and the node's serving image is the build host's."""
    src, src_image = artifact_digests(sim, build)
    dst, dst_image = artifact_digests(sim, node)
    assert src, f"{build}: the built checkpoint {hybrid_dir(sim, build)} is empty or gone"
    missing = sorted(set(src) - set(dst))
    differ = sorted(k for k in set(src) & set(dst) if src[k] != dst[k])
    assert not missing and not differ, f"{node}: checkpoint lost or damaged: missing {missing}, differing {differ}"
    assert src_image and dst_image == src_image, f"{node}: serving image {dst_image} != build host's {src_image}"


class Bounded:
    """Run `fn` in a thread and give it `bound_s`: a hang is a test failure, never a hung suite.
    Use: `b = Bounded(fn).start()`, inject/undo, `b.join(bound)`; then `b.result`, `b.seconds`."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.seconds: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            self.result = self.fn()
        except BaseException as e:  # reported by the test
            self.error = e
        self.seconds = round(time.monotonic() - t0, 1)

    def start(self) -> Bounded:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, seconds: float) -> bool:
        self._thread.join(timeout=max(0.0, seconds - (time.monotonic() - self._t0)))
        return self.done
