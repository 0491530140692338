"""The soak's end state (spark_sim/soak.py's checker, at the end): every node serving and routed or
out with a ledger reason, no run STARTED, no run lease held, no stray `-previous` container, the
ledger and the deploy markers agreeing with what the nodes run. Read from the real parts: the
nodes' engines and docker, the proxy, the lock files, the Dagster instance."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from spark_pipelines.core import steps
from spark_pipelines.core.layout import marker_path
from spark_sim.faults import engine_healthy

# `soak` below is a spark_sim.soak.Soak (not imported: soak.py imports this module).
Soak = Any


def end_state(soak: Soak) -> dict[str, Any]:
    from dagster import DagsterRunStatus, RunsFilter

    problems: list[str] = []
    routes = soak.proxy_routes() or []
    try:
        held = soak.held_out()
    except Exception as e:
        held, problems = {}, [f"the ledger was not read: {e}"]
    nodes = {}
    for n in soak.nodes:
        m = soak.sim.node(n)
        serving = engine_healthy(m)
        names = [line.split()[0] for line in soak.sim.containers(m)]
        stray = [c for c in names if c.endswith("-previous")]
        lock = m.home / ".cache/spark-pipelines/locks/run.lock"  # core.layout.STATE_DIR
        held_lock = lease_held_here(lock)
        state = ("serving+routed" if serving and n in routes else f"out: {held[n]}" if n in held
                 else f"neither (engine {'up' if serving else 'down'}, {'routed' if n in routes else 'not routed'})")
        nodes[n] = {"state": state, "containers": names, "lease_held": held_lock}
        if state.startswith("neither"):
            problems.append(f"{n}: {state}")
        if stray:
            problems.append(f"{n}: stray container(s) {stray}")
        if held_lock:
            problems.append(f"{n}: its run lease is still held")
        if n in held and n in routes:
            problems.append(f"{n}: the ledger holds it out ({held[n][:80]}) but the proxy routes to it")
        if serving:
            disagree = marker_disagrees(soak, n)
            if disagree:
                problems.append(f"{n}: {disagree}")
    started = soak.instance.get_runs(filters=RunsFilter(statuses=[DagsterRunStatus.STARTED]))
    if started:
        problems.append(f"{len(started)} run(s) left STARTED: {[r.job_name for r in started]}")
    return {"nodes": nodes, "routes": routes, "quarantined": held, "started_runs": len(started), "problems": problems}


def marker_disagrees(soak: Soak, node: str) -> str:
    """What the node's deploy marker says serves against the container that serves ("" when they
    agree): a marker naming another container would make the next deploy skip, or redo, wrongly."""
    m = soak.sim.node(node)
    name = soak.fleet.launch_for(soak.fleet.node(node)).container_name
    marker = Path(marker_path(soak.fleet.node(node), steps.NODE_DEPLOYMENT))
    try:
        recorded = json.loads(marker.read_text()).get("container_id")
    except (OSError, ValueError) as e:
        return f"its deploy marker is unreadable ({e})"
    running = subprocess.run(["docker", "inspect", "--format", "{{.Id}}", name], capture_output=True, text=True,
                             timeout=30, env={**os.environ, "DOCKER_HOST": m.docker_host}).stdout.strip()
    if recorded and running and recorded != running:
        return f"its deploy marker names container {recorded[:12]}, {name} is {running[:12]}"
    return ""


def lease_held_here(lock: Path) -> bool | None:
    """The node's run lease, from this machine (a simulated node's home is a local directory)."""
    if not lock.exists():
        return False
    r = subprocess.run(["flock", "-n", "-E", "75", str(lock), "true"], capture_output=True, timeout=10)
    return r.returncode == 75
