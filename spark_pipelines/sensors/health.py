"""Redeploy a node whose vLLM stopped answering, but not one that is still starting.

One failed probe can be a hiccup (SSH and HTTP go unresponsive during CUDA graph capture), so a
node must fail FAILURES_BEFORE_REDEPLOY ticks in a row. Then, and only then, the node's container
is inspected (one `docker inspect` over SSH, seconds): a running container younger than the
runbook's start-up window is starting, not dead. A request carries a run key per failure episode
(node + the time the episode's first failed probe was seen): one redeploy per episode, however
many ticks, sensor restarts or daemons see it. The cursor keeps each node's episode.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import dagster as dg

from spark_pipelines.core.fleet import Fleet, Node
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.runbook.engine import healthy

FAILURES_BEFORE_REDEPLOY = 3
# Runbook: a first boot takes 25-45 min (weights load, torch.compile, CUDA graph capture), a warm
# boot 7-10 min. A running container younger than the longest first boot is starting, not dead.
STARTUP_WINDOW_S = 45 * 60
# Runbook: SSH may stay unresponsive during graph capture for up to 30 min. A node whose container
# cannot be inspected is redeployed only once its failure episode is older than that.
SSH_SILENT_MAX_S = 30 * 60
# Each inspection is a probe: seconds, never minutes. The tick stays inside Dagster's 60 s limit.
INSPECT_CONNECT_TIMEOUT_S = 5.0
INSPECT_TIMEOUT_S = 10.0
TICK_BUDGET_S = 40.0


@dataclass(frozen=True)
class ContainerState:
    """What `docker inspect` said about the serving container (running None: could not ask)."""

    running: bool | None
    started_at: float | None = None  # epoch seconds
    error: str = ""


ContainerReader = Callable[[Fleet, Node], ContainerState]


def parse_started_at(text: str) -> float | None:
    """Docker's RFC 3339 StartedAt (nanoseconds, `Z`) -> epoch seconds; None for the zero time."""
    text = text.strip()
    if not text or text.startswith("0001-"):
        return None
    head, _, frac = text.rstrip("Z").partition(".")
    try:
        base = datetime.fromisoformat(head + "+00:00").timestamp()
    except ValueError:
        return None
    digits = "".join(ch for ch in frac if ch.isdigit())[:6]
    return base + (int(digits) / 10 ** len(digits) if digits else 0.0)


def inspect_container(fleet: Fleet, node: Node) -> ContainerState:
    """One `docker inspect` of the node's serving container over SSH, with short timeouts."""
    from spark_pipelines.resources.ssh import FleetSession, RemoteError, SshSettings

    name = launch_spec(fleet, node).container_name
    settings = SshSettings(connect_timeout_s=INSPECT_CONNECT_TIMEOUT_S, connect_retries=0,
                           command_timeout_s=INSPECT_TIMEOUT_S)
    try:
        with FleetSession(fleet, settings) as s:
            r = s.run(node.name, ["docker", "inspect", "--format", "{{.State.Running}} {{.State.StartedAt}}", name],
                      check=False, log=False, timeout=INSPECT_TIMEOUT_S)
    except (RemoteError, OSError) as e:
        return ContainerState(None, error=str(e).splitlines()[0][:200])
    if r.exit_status != 0:
        if "No such" in r.stderr:
            return ContainerState(False)
        return ContainerState(None, error=(r.stderr.strip() or f"exit {r.exit_status}")[:200])
    running, _, started = r.stdout.strip().partition(" ")
    return ContainerState(running == "true", parse_started_at(started))


def judge(state: ContainerState, episode_started: float, now: float) -> str | None:
    """Why not to redeploy yet (None: redeploy)."""
    if state.running and state.started_at is not None and now - state.started_at < STARTUP_WINDOW_S:
        return (f"container started {(now - state.started_at) / 60:.0f} min ago: inside the "
                f"{STARTUP_WINDOW_S // 60} min start-up window (first boot 25-45 min)")
    if state.running is None and now - episode_started < SSH_SILENT_MAX_S:
        return (f"container cannot be inspected ({state.error or 'no answer'}); SSH may be silent during "
                f"graph capture for up to {SSH_SILENT_MAX_S // 60} min")
    return None


def _episode(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return dict(raw)
    return {"failures": int(raw or 0)}  # the cursor of an older version: a bare count


def health_sensors(fleet: Fleet, container_state: ContainerReader = inspect_container) -> dg.Definitions:
    """`fleet` is the one loaded with the code location (the UI, the runs and this sensor agree)."""
    @dg.sensor(name="node_health", job_name="deploy_node_job", minimum_interval_seconds=60,
               default_status=dg.DefaultSensorStatus.STOPPED,
               description="Redeploys a node after consecutive failed /health probes, outside its start-up window.")
    def node_health(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        episodes = {k: _episode(v) for k, v in (json.loads(context.cursor) if context.cursor else {}).items()}
        requests = []
        tick_started = time.monotonic()
        for node in fleet.serve_nodes:
            now = time.time()
            if healthy(fleet, node):
                episodes[node.name] = {"failures": 0}
                continue
            ep = episodes.get(node.name) or {"failures": 0}
            if not ep.get("failures"):
                ep = {"failures": 0, "since": int(now)}
            ep["failures"] += 1
            episodes[node.name] = ep
            if ep["failures"] < FAILURES_BEFORE_REDEPLOY or ep.get("requested"):
                continue
            if time.monotonic() - tick_started > TICK_BUDGET_S:
                context.log.info(f"{node.name}: /health down; inspection left to the next tick (tick budget spent)")
                continue
            wait = judge(container_state(fleet, node), float(ep["since"]), now)
            if wait:
                context.log.info(f"{node.name}: /health down for {ep['failures']} probes, not redeployed: {wait}")
                continue
            ep["requested"] = True
            requests.append(dg.RunRequest(run_key=f"health-{node.name}-{ep['since']}", partition_key=node.name,
                                          tags={"reason": "health"}))
        return dg.SensorResult(run_requests=requests, cursor=json.dumps(episodes, sort_keys=True))

    return dg.Definitions(sensors=[node_health])
