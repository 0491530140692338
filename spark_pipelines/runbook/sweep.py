"""The health sweep: probe every serve node at once, read-only, and judge each with `core.health`.

A probe of one node reads /health and /metrics (runbook/engine.py), then over SSH: reachability,
nvidia-smi (runbook/preflight.read_gpu), `docker inspect` of the serving container and the tail of
its log. Every step has its own short timeout, so a dead node costs seconds, not the default
connect retries. Nothing on a node is changed. Nodes are probed in parallel threads: a
FleetSession opens one connection per node under a per-node lock and one channel per command,
so threads probing different nodes never share a channel.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from spark_pipelines.core import diagnosis, gpu, health, remote
from spark_pipelines.core.fleet import Fleet, Node
from spark_pipelines.core.launch import expand_home
from spark_pipelines.resources.ssh import (
    FleetSession,
    HostKeyError,
    NodeConnectError,
    RemoteError,
    SshSettings,
)
from spark_pipelines.runbook import engine
from spark_pipelines.runbook.preflight import read_gpu

# Per-step limits: a probe is a glance, not a wait.
SSH_CONNECT_TIMEOUT_S = 5.0
SSH_REACH_TIMEOUT_S = 10.0
GPU_TIMEOUT_S = 15.0
INSPECT_TIMEOUT_S = 15.0
LOG_TIMEOUT_S = 20.0
HEALTH_TIMEOUT_S = 5.0
METRICS_TIMEOUT_S = 5.0
LOG_TAIL_LINES = 400
MAX_PARALLEL = 16

_NO_SUCH = ("No such container", "No such object", "no such container")


def probe_settings(base: SshSettings | None = None) -> SshSettings:
    """SSH settings for a sweep: a short connect timeout and no connect retries (a dead node must
    be reported in seconds; the next sweep is the retry)."""
    fields = (base or SshSettings()).model_dump(include=set(SshSettings.model_fields))
    return SshSettings(**{**fields, "connect_timeout_s": SSH_CONNECT_TIMEOUT_S, "connect_retries": 0})


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _http(fleet: Fleet, node: Node) -> dict[str, Any]:
    ok = engine.healthy(fleet, node, timeout=HEALTH_TIMEOUT_S)
    out: dict[str, Any] = {"health_ok": ok,
                           "health_error": None if ok else f"no 200 from {engine.api_root(fleet, node)}/health "
                                                           f"within {HEALTH_TIMEOUT_S:g} s"}
    if ok:  # a dead engine's /metrics says nothing the container state does not
        try:
            metrics = engine.engine_metrics(fleet, node, timeout=METRICS_TIMEOUT_S)
        except diagnosis.MetricsFormatError as e:
            metrics, out["metrics_error"] = None, str(e)
        out["metrics"] = metrics
        if metrics is None and "metrics_error" not in out:
            out["metrics_error"] = f"/metrics did not answer within {METRICS_TIMEOUT_S:g} s"
    return out


def _warm_start(s: FleetSession, fleet: Fleet, node: Node) -> bool | None:
    """Whether the torch.compile cache the launch mounts holds anything (a warm 7-10 min boot)."""
    mounts = [m.host for m in fleet.launch_for(node).cache_mounts if "vllm" in m.host]
    if not mounts:
        return None
    path = expand_home(mounts[0], node.home_dir)
    r = s.run(node.name, ["find", path, "-mindepth", "1", "-maxdepth", "1", "-print", "-quit"],
              check=False, log=False, timeout=INSPECT_TIMEOUT_S)
    return bool(r.stdout.strip()) if r.ok else False


def _inspect(s: FleetSession, node: Node, container: str) -> tuple[health.ContainerState | None, str | None]:
    """(state, None), or (None, why it could not be read)."""
    try:
        r = s.run(node.name, ["docker", "container", "inspect", container], check=False, log=False,
                  timeout=INSPECT_TIMEOUT_S)
        if r.ok:
            data = json.loads(r.stdout)
            return health.container_state(data[0] if data else None), None
        if any(m in r.stderr for m in _NO_SUCH):
            return health.container_state(None), None
        return None, f"docker inspect {container} exited {r.exit_status}: {r.tail.strip()[-200:]}"
    except (RemoteError, ValueError) as e:
        return None, _one_line(e)


def probe(s: FleetSession, node: Node, *, bench: health.BenchHistory | None = None,
          clock: Callable[[], float] = time.time) -> health.Observation:
    """Read one node. Never raises for what the node does; the errors become observations."""
    fleet = s.fleet
    container = fleet.launch_for(node).container_name
    fields: dict[str, Any] = {
        "node": node.name, "probed_at": clock(), "bench": bench,
        "clean_boot_free_gib": fleet.profile_of(node).clean_boot_free_gib,
    }
    fields.update(_http(fleet, node))
    try:
        s.run(node.name, ["true"], log=False, timeout=SSH_REACH_TIMEOUT_S)
    except (HostKeyError, NodeConnectError) as e:
        # Only "cannot reach" is a node that does not answer; the rest is a key or credential problem.
        refused = isinstance(e, HostKeyError) or "cannot reach" not in str(e)
        return health.Observation(ssh_ok=False, ssh_error=_one_line(e), ssh_refused=refused, **fields)
    except (RemoteError, OSError, EOFError) as e:
        return health.Observation(ssh_ok=False, ssh_error=_one_line(e), **fields)
    fields["ssh_ok"] = True

    try:
        fields["gpu"] = read_gpu(s, node.name, timeout=GPU_TIMEOUT_S)
    except (RemoteError, gpu.GpuFormatError) as e:
        fields["gpu_error"] = _one_line(e)

    fields["container"], fields["container_error"] = _inspect(s, node, container)

    state = fields.get("container")
    if state is not None and not state.exists:
        fields["previous_container"] = _inspect(s, node, remote.previous_container_name(container))[0]
    if state is not None and state.exists:
        try:
            r = s.run(node.name, ["docker", "logs", "--tail", str(LOG_TAIL_LINES), container], check=False,
                      log=False, timeout=LOG_TIMEOUT_S)
            fields["log_tail"] = r.stdout + r.stderr
        except RemoteError as e:
            fields["log_tail"] = None
            fields.setdefault("container_error", f"docker logs: {_one_line(e)}")
        if not state.running or not fields.get("health_ok"):
            try:
                fields["warm_start"] = _warm_start(s, fleet, node)
            except RemoteError:
                pass
    return health.Observation(**fields)


@dataclass(frozen=True)
class NodeReport:
    observation: health.Observation
    verdict: health.NodeVerdict


def probe_and_judge(s: FleetSession, node: Node, *, bench: health.BenchHistory | None = None,
                    earlier: health.Observation | None = None,
                    clock: Callable[[], float] = time.time) -> NodeReport:
    try:
        obs = health.with_earlier(probe(s, node, bench=bench, clock=clock), earlier)
    except Exception as e:  # one node's surprise must not hide the others' verdicts
        obs = health.Observation(node=node.name, probed_at=clock(), ssh_ok=True, ssh_error=None)
        return NodeReport(obs, health.NodeVerdict(node.name, "unknown", (f"the probe failed: {_one_line(e)}",),
                                                  health.ADVICE["unknown"]))
    return NodeReport(obs, health.judge(obs))


def sweep(s: FleetSession, nodes: Iterable[Node] | None = None, *,
          bench: Mapping[str, health.BenchHistory] | None = None,
          earlier: Mapping[str, health.Observation] | None = None,
          max_parallel: int = MAX_PARALLEL,
          clock: Callable[[], float] = time.time) -> dict[str, NodeReport]:
    """Probe and judge the nodes (default: every serve node) in parallel, in fleet order."""
    targets = list(nodes) if nodes is not None else s.fleet.serve_nodes
    if not targets:
        return {}
    bench, earlier = bench or {}, earlier or {}
    with ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(targets))),
                            thread_name_prefix="health-probe") as pool:
        futures = {n.name: pool.submit(probe_and_judge, s, n, bench=bench.get(n.name),
                                       earlier=earlier.get(n.name), clock=clock) for n in targets}
        return {name: f.result() for name, f in futures.items()}


def open_session(fleet: Fleet, logger: Any = None, base: SshSettings | None = None) -> FleetSession:
    """A FleetSession with the sweep's short timeouts (the caller closes it)."""
    return FleetSession(fleet, probe_settings(base), logger)
