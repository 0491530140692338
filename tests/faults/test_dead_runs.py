"""A deploy whose run process is killed (kill -9) half-way: the next run on the node, or the
health sweep's repair, finishes what it left from the journal on the node, with no hand step.

Each deploy runs as its own process (deploy_node_job executed in-process in a subprocess, on the
fault suite's instance) with `fresh_jit_cache: true`, so it relaunches the base spec: nothing else
changes, and the rollback also has the cache to put back. The process is killed at a phase the
journal names: the old container set aside (the issue's fault), the new container launched, the
commit done but the gateway not yet given the node back.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import dagster as dg
import pytest

from tests.faults.conftest import Chain, deployed_id, failure_text
from tests.plugins import faults as fx

pytestmark = pytest.mark.slow

NODE = "spark2"
FRESH = {"ops": {"node_deployment": {"config": {"fresh_jit_cache": True}}}}

DEPLOY = """
import sys
import dagster as dg
from spark_pipelines.definitions import build_definitions
fleet, home, node = sys.argv[1:4]
instance = dg.DagsterInstance.local_temp(home)
job = build_definitions(fleet).resolve_job_def("deploy_node_job")
res = job.execute_in_process(instance=instance, partition_key=node, raise_on_error=False,
                             run_config={"ops": {"node_deployment": {"config": {"fresh_jit_cache": True}}}})
print("finished", res.success, flush=True)
"""


def journal_path(c: Chain, node: str = NODE) -> Path:
    return c.sim.node(node).home / ".cache" / "spark-pipelines" / "markers" / "deploy_journal.json"


def journal(c: Chain, node: str = NODE) -> dict[str, Any] | None:
    try:
        return json.loads(journal_path(c, node).read_text())
    except (OSError, ValueError):
        return None


def drains(c: Chain) -> dict[str, str]:
    from spark_pipelines.core.gateway import load_drains

    return load_drains(fx.gateway_config_path(c.sim).read_text())


def kill_deploy_when(c: Chain, when: Callable[[dict[str, Any]], bool], what: str, bound_s: float = 240) -> dict:
    """Start the deploy process, SIGKILL it the moment `when(journal)` holds; returns that journal."""
    p = subprocess.Popen([sys.executable, "-c", DEPLOY, c.fleet, str(c.root / "dagster"), NODE],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=os.getcwd())
    deadline = time.monotonic() + bound_s
    try:
        while time.monotonic() < deadline:
            j = journal(c)
            if j is not None and when(j):
                os.kill(p.pid, signal.SIGKILL)
                p.wait(10)
                return j
            if p.poll() is not None:
                pytest.fail(f"the deploy ended before {what}: {p.stdout.read()[-2000:]}", pytrace=False)
            time.sleep(0.05)
        pytest.fail(f"the deploy did not reach {what} within {bound_s:.0f} s", pytrace=False)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def names(c: Chain, node: str = NODE) -> dict[str, str]:
    """container name -> state on the node."""
    out = fx.docker(c.sim.node(node), "ps", "-a", "--format", "{{.Names}} {{.State}}").stdout.split("\n")
    return dict(line.split(" ", 1) for line in out if line.strip())


def assert_finished(c: Chain, container_id: str) -> None:
    """The node serves `container_id` under the live name, is in the rotation with no drain note,
    its journal is gone and no rollback point is left."""
    fx.assert_serving(c.sim, NODE, container_id)
    assert NODE in fx.rotation(fx.gateway_config(c.sim)), f"{NODE} is not in the gateway: {drains(c)}"
    assert NODE not in drains(c), drains(c)
    assert journal(c) is None, journal(c)
    assert f"{fx.CONTAINER}-previous" not in names(c), names(c)
    fx.assert_gateway_has_backend(c.sim)


def test_killed_after_the_set_aside_the_next_deploy_puts_the_previous_back(fleet):
    """The issue's fault: only `<name>-previous` (exited) is left and the node is drained. The next
    deploy_node_job finds the journal, puts the previous deployment back by id (and its cache),
    undoes the dead run's drain, and does not launch again: what serves is the launch spec."""
    c = fleet
    before = deployed_id(c.sim, NODE)
    j = kill_deploy_when(c, lambda j: j["phase"] == "launching", "the set-aside")
    assert j["kept_container_id"] == before and j["drain_reason"].startswith("deploying (run ")
    left = names(c)
    assert left.get(f"{fx.CONTAINER}-previous") == "exited" and fx.CONTAINER not in left, left
    assert drains(c).get(NODE, "").startswith(j["drain_reason"]), drains(c)
    since = len(c.commands())
    res = c.run("deploy_node_job", NODE)
    assert res.success, failure_text(res)
    assert_finished(c, before)
    assert not launches(c, since), "the repair launched again what already served"


def launches(c: Chain, since: int) -> list[Any]:
    return [r for r in c.commands(since) if r.node == NODE and list(r.argv[:3]) == ["docker", "run", "-d"]]


def test_killed_during_the_launch_the_sweep_requests_the_repair(fleet):
    """Killed with the new container starting: the health sweep sees the journal with the node's
    lease free, requests deploy_node_job for the node (keyed by the dead run), and that run rolls
    back to the previous deployment and puts the node back in the gateway."""
    from spark_pipelines.runbook import sweep

    c = fleet
    before = deployed_id(c.sim, NODE)
    m = c.sim.node(NODE)

    def launched(j: dict[str, Any]) -> bool:
        if j["phase"] != "launching" or not j.get("jit_key"):
            return False
        now = fx.container(m)
        return now is not None and now["Id"] != before

    j = kill_deploy_when(c, launched, "the launch")
    defs = c.defs()
    fleet_def = defs.resources["ssh"]
    with fleet_def.open_session() as s:
        seen = sweep.probe(s, s.fleet.node(NODE)).deploy_journal
    assert seen is not None and seen.run_id == j["run_id"] and seen.dead, seen
    sensor = defs.get_repository_def().get_sensor_def("node_health")
    with dg.build_sensor_context(instance=c.instance, definitions=defs,
                                 resources={"ssh": defs.resources["ssh"]}) as ctx:
        result = sensor(ctx)
    repair = [r for r in result.run_requests if r.job_name == "deploy_node_job"]
    assert [(r.partition_key, r.run_key) for r in repair] == [(NODE, f"repair-{NODE}-{j['run_id'][:8]}")], result
    req = repair[0]
    res = c.run(req.job_name, req.partition_key, run_config=req.run_config or {}, tags=req.tags)
    assert res.success, failure_text(res)
    assert_finished(c, before)


def test_killed_after_the_commit_the_next_run_gives_the_node_back_to_the_gateway(fleet):
    """Killed once the new deployment committed, before the gateway had the node back: the next
    run finds the journal ended, undoes the drain, and keeps the new deployment (no relaunch)."""
    c = fleet
    before = deployed_id(c.sim, NODE)
    j = kill_deploy_when(c, lambda j: j["phase"] == "ending", "the commit")
    assert j["outcome"] == "committed" and j["new_container_id"] != before
    new = deployed_id(c.sim, NODE)
    assert new == j["new_container_id"] and NODE in drains(c)
    since = len(c.commands())
    res = c.run("deploy_node_job", NODE)
    assert res.success, failure_text(res)
    assert_finished(c, new)
    assert not launches(c, since)
