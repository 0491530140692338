"""Faults in the deploy of one node: the previous deployment keeps serving (or the node is out
of the gateway with the reason said), the gateway keeps a backend, nothing copied is lost, and a
rerun (after the cause is gone) repairs."""

from __future__ import annotations

import re

import pytest

from tests.faults.conftest import Chain, deployed_id, error_classes, failure_text
from tests.plugins import faults as fx

pytestmark = pytest.mark.slow


def assert_in_gateway_or_out_with_reason(c: Chain, node: str, why: str) -> None:
    nodes = fx.rotation(fx.gateway_config(c.sim))
    if node in nodes:
        fx.assert_serving(c.sim, node)
    else:
        assert node in why, f"{node} is out of the gateway and the run did not say why: {why!r}"


def failed_deploy_keeps_previous(c: Chain, fleet_path: str, node: str = "spark2") -> str:
    """Run the failing deploy twice (a retry must not delete the kept deployment either), then the
    repaired one. Returns the first failure's text."""
    sim = c.sim
    before = deployed_id(sim, node)
    with fx.RotationWatch(sim) as watch:
        first = c.run("deploy_node_job", node, fleet=fleet_path)
        why = failure_text(first)
        assert not first.success, f"the faulty deploy of {node} succeeded"
        assert node in why, f"the failure does not name {node}: {why}"
        fx.assert_serving(sim, node, before)
        fx.assert_gateway_has_backend(sim)
        assert_in_gateway_or_out_with_reason(c, node, why)

        again = c.run("deploy_node_job", node, fleet=fleet_path)
        assert not again.success
        fx.assert_serving(sim, node, before)
    assert watch.fewest and watch.fewest >= 1, f"the gateway routed to no node at {watch.empty_at}"
    # Only the live deployment and at most its rollback point: no leftover the next retry trips on.
    names = [line.split()[0] for line in sim.containers(sim.node(node))]
    assert set(names) <= {fx.CONTAINER, f"{fx.CONTAINER}-previous"}, names
    fx.assert_artifacts_intact(sim, node)

    fixed = c.run("deploy_node_job", node)
    assert fixed.success, f"the rerun with the cause gone did not repair {node}:\n{failure_text(fixed)}"
    fx.assert_serving(sim, node, before)  # the kept deployment IS the base spec: nothing to redo
    return why


def test_docker_run_exiting_125_keeps_previous_serving(fleet):
    """A cache mount onto a file path: validation accepts it, `docker run` exits 125."""
    path = fleet.variant("run125", lambda d: d["launch"]["cache_mounts"].append(
        {"host": "~/.cache/fault-mount", "container": "/etc/passwd"}))
    why = failed_deploy_keeps_previous(fleet, path)
    assert "125" in why or "docker run" in why, why


def test_container_crashing_on_start_keeps_previous_serving(fleet):
    """A founders node declared exempt from the 2026-06-18 fix: the engine dies during start-up."""

    def drop_fix_var(d):
        d["hardware_profiles"] = {"founders": {"name": "founders", "cuda_total_gib": 121.69, "max_gmu": 0.85,
                                               "requires_fix_env": False, "clean_boot_free_gib": 117.5}}
        del d["launch"]["env"]["VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"]

    why = failed_deploy_keeps_previous(fleet, fleet.variant("crash", drop_fix_var), node="spark1")
    assert "did not become healthy" in why or "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS" in why, why


def test_two_deploys_of_one_node_at_once_never_overlap(fleet):
    """Two runs deploy spark2 at the same moment: one deploys, the other refuses (node busy) or
    finds the work done; never two preflights and two `docker run`s on one node."""
    c, sim = fleet, fleet.sim
    path = c.variant("twodeploys", lambda d: d["launch"]["env"].__setitem__("SPARK_FAULT_SUITE", "two-deploys"))
    since = len(c.commands())
    runs = [fx.Bounded(lambda: c.run("deploy_node_job", "spark2", fleet=path)).start() for _ in range(2)]
    with fx.RotationWatch(sim) as watch:
        for r in runs:
            assert r.join(300), "a concurrent deploy did not finish within 300 s"
    results = [r.result for r in runs]
    assert all(r.error is None for r in runs), [r.error for r in runs]
    ok = [r for r in results if r.success]
    assert ok, "neither concurrent deploy succeeded:\n" + "\n".join(failure_text(r) for r in results)
    # The launches only (`docker run -d`), not preflight's memcheck (`docker run --rm`).
    launches = [rec for rec in c.commands(since)
                if rec.node == "spark2" and docker_verb(rec.argv) == "run" and "-d" in rec.argv]
    if len(ok) == 1:
        loser = failure_text(next(r for r in results if not r.success))
        assert "spark2" in loser and re.search(r"busy|another run|lock|held|in progress", loser, re.I), loser
    assert len(launches) <= 1 or len(ok) == 2 and len(launches) == 2 and not overlapping(c, since), (
        f"{len(launches)} `docker run -d` on spark2 from two concurrent deploys")
    assert len(launches) >= 1
    fx.assert_serving(sim, "spark2")
    assert watch.fewest and watch.fewest >= 1
    fx.assert_gateway_has_backend(sim)
    fx.assert_artifacts_intact(sim, "spark2")
    running = [line for line in sim.containers(sim.node("spark2")) if " Up " in f" {line} "]
    assert len(running) == 1, running


def docker_verb(argv) -> str | None:
    """`docker run ...` -> "run", also under a `timeout ...` wrapper."""
    argv = list(argv)
    if "docker" in argv:
        i = argv.index("docker")
        return argv[i + 1] if i + 1 < len(argv) else None
    return None


def overlapping(c: Chain, since: int) -> bool:
    """Whether two deploys interleaved on spark2: one at a time shows each `docker run` after its
    own set-aside (rename), two at once show two set-asides before two runs."""
    kinds = "".join("U" if docker_verb(rec.argv) == "run" else "R" for rec in c.commands(since)
                    if rec.node == "spark2" and (docker_verb(rec.argv) == "rename"
                                                 or docker_verb(rec.argv) == "run" and "-d" in rec.argv))
    return "UU" in kinds


def test_host_key_change_refuses_and_touches_nothing(fleet):
    """spark2 comes back with a new host key: the run refuses with HostKeyError naming spark2 and
    changes nothing on it."""
    c, sim = fleet, fleet.sim
    m = sim.node("spark2")
    before = deployed_id(sim, "spark2")

    def snapshot():
        files = {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in m.home.rglob("*") if p.is_file()}
        ps = fx.docker(m, "ps", "-a", "--no-trunc", "--format", "{{.Names}} {{.ID}} {{.State}}").stdout
        return files, sorted(ps.split("\n"))

    with fx.host_key_changed(m):
        state = snapshot()
        since = len(c.commands())
        res = c.run("deploy_node_job", "spark2")
        assert not res.success, "a deploy went ahead against a node whose host key changed"
        why = failure_text(res)
        assert "HostKeyError" in error_classes(res) or "HostKeyError" in why, why
        assert "spark2" in why, why
        assert [r for r in c.commands(since) if r.node == "spark2"] == [], "commands ran on spark2"
        assert snapshot() == state, "something changed on spark2"
        fx.assert_serving(sim, "spark2", before)
        fx.assert_gateway_has_backend(sim)
    res = c.run("deploy_node_job", "spark2")
    assert res.success, f"the rerun with the original key did not pass:\n{failure_text(res)}"
    fx.assert_serving(sim, "spark2", before)
