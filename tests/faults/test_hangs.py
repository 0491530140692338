"""Frozen peers: a stopped dockerd, a stopped sshd, a stopped engine. A run or a sensor tick must
end within a bound with a message naming the node, never hang until someone resumes the process;
the node keeps serving meanwhile, and once the peer is back a rerun passes."""

from __future__ import annotations

import time

import dagster as dg
import pytest

from tests.faults.conftest import BOUND_S, TICK_BOUND_S, deployed_id, failure_text
from tests.plugins import faults as fx

pytestmark = pytest.mark.slow


def bounded_run(c, job, node, freeze, bound_s=BOUND_S):
    """Run `job` for `node` under the frozen peer; undo the freeze at the bound whatever happened,
    then report (finished within the bound?, result, seconds)."""
    with freeze:
        run = fx.Bounded(lambda: c.run(job, node)).start()
        within = run.join(bound_s)
        # While frozen: the engine still serves (containers need neither dockerd nor sshd; asked
        # over HTTP, not through the frozen dockerd), and the gateway still routes.
        assert fx.engine_healthy(c.sim.node(node)), f"{node} stopped serving while its peer was frozen"
        fx.assert_gateway_has_backend(c.sim)
    run.join(bound_s + 120)  # after SIGCONT a hung run carries on; let it end before the next test
    assert run.error is None, f"the run raised instead of failing cleanly: {run.error!r}"
    return within, run.result, run.seconds


def assert_routed(c, node: str) -> None:
    """Issue 34 item 4: a run that leaves the node serving its launch spec leaves it routed: in the
    gateway, no drain note, no deploy hold-out left in the ledger (the failed run's, no longer true)."""
    import json
    from pathlib import Path

    from spark_pipelines.core.gateway import load_drains

    config = fx.gateway_config_path(c.sim)
    notes = load_drains(config.read_text())
    try:
        led = json.loads(Path(str(config) + ".ledger.json").read_text()).get("nodes", {}).get(node, {})
    except (OSError, ValueError):
        led = {}
    assert node in fx.rotation(fx.gateway_config(c.sim)) and node not in notes, (notes, led)
    assert "deploy" not in led.get("holds", {}), led


def test_frozen_dockerd_fails_the_deploy_within_bound(fleet):
    c, sim = fleet, fleet.sim
    before = deployed_id(sim, "spark2")
    within, res, seconds = bounded_run(c, "deploy_node_job", "spark2", fx.frozen_dockerd(sim.node("spark2")))
    assert within, f"deploy of spark2 with a frozen dockerd still running after {BOUND_S:.0f} s (took {seconds} s)"
    assert not res.success
    why = failure_text(res)
    assert "spark2" in why and ("docker" in why.lower()), why
    fx.assert_serving(sim, "spark2", before)
    fx.assert_artifacts_intact(sim, "spark2")
    again = c.run("deploy_node_job", "spark2")
    assert again.success, failure_text(again)
    fx.assert_serving(sim, "spark2", before)
    assert_routed(c, "spark2")


def test_frozen_sshd_fails_the_deploy_within_bound(fleet):
    c, sim = fleet, fleet.sim
    before = deployed_id(sim, "spark2")
    within, res, seconds = bounded_run(c, "deploy_node_job", "spark2", fx.frozen_sshd(sim.node("spark2")))
    assert within, f"deploy of spark2 with a frozen sshd still running after {BOUND_S:.0f} s (took {seconds} s)"
    assert not res.success
    why = failure_text(res)
    assert "spark2" in why, why
    fx.assert_serving(sim, "spark2", before)
    fx.assert_artifacts_intact(sim, "spark2")
    again = c.run("deploy_node_job", "spark2")
    assert again.success, failure_text(again)
    fx.assert_serving(sim, "spark2", before)
    assert_routed(c, "spark2")


def test_frozen_gateway_sshd_fails_the_bench_within_bound_and_node_returns(fleet):
    """The issue's 90 s hang: the bench reads the rotation over the gateway host's frozen sshd."""
    c, sim = fleet, fleet.sim
    with fx.RotationWatch(sim) as watch:
        within, res, seconds = bounded_run(c, "bench_job", "spark2", fx.frozen_sshd(sim.gateway))
    assert within, f"bench with the gateway's sshd frozen still running after {BOUND_S:.0f} s (took {seconds} s)"
    assert watch.fewest and watch.fewest >= 1, watch.seen
    if not res.success:
        assert "gateway" in failure_text(res).lower() or sim.gateway.ip in failure_text(res), failure_text(res)
    # Whatever the outcome, spark2 is back in rotation or held out with the reason recorded.
    nodes = fx.rotation(fx.gateway_config(sim))
    assert "spark2" in nodes or "spark2" in failure_text(res), (nodes, failure_text(res))
    fx.assert_gateway_has_backend(sim)


def tick(c, name):
    defs = c.defs()
    sensor = defs.get_repository_def().get_sensor_def(name)
    resources = {"ssh": defs.resources["ssh"]} if "ssh" in defs.resources else {}
    with dg.build_sensor_context(definitions=defs, instance=c.instance, resources=resources) as context:
        return sensor(context)


@pytest.mark.parametrize("sensor", ["node_health", "wedge_watch"])
def test_sensor_tick_returns_within_bound_with_engine_frozen(fleet, sensor):
    """vLLM frozen on spark2 (accepts connections, answers nothing): a tick still returns in
    bounded time, and requests no redeploy on the first failed probe."""
    c, sim = fleet, fleet.sim
    with fx.frozen_engine(sim.node("spark2")):
        t = fx.Bounded(lambda: tick(c, sensor)).start()
        within = t.join(TICK_BOUND_S)
    t.join(120)
    assert within, f"{sensor} tick with spark2's engine frozen took longer than {TICK_BOUND_S:.0f} s ({t.seconds} s)"
    assert t.error is None, repr(t.error)
    result = t.result
    requests = getattr(result, "run_requests", None) or []
    assert not requests, f"{sensor} requested {requests} after one tick of a frozen engine"
    deadline = time.monotonic() + 30
    while not fx.engine_healthy(sim.node("spark2")) and time.monotonic() < deadline:
        time.sleep(0.5)
    fx.assert_serving(sim, "spark2")


def test_sensor_tick_returns_within_bound_with_gateway_sshd_frozen(fleet):
    """wedge_watch reads the rotation over SSH when a node has live traffic: a frozen gateway
    sshd must not hang the tick."""
    import threading

    import httpx

    c, sim = fleet, fleet.sim
    m = sim.node("spark2")
    stop = threading.Event()

    def traffic():
        while not stop.is_set():
            try:
                httpx.post(f"http://{m.ip}:{fx.ENGINE_PORT}/v1/chat/completions",
                           json={"model": served_model(c), "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2048}, timeout=30)
            except httpx.HTTPError:
                pass

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    try:
        time.sleep(0.5)
        with fx.frozen_sshd(sim.gateway):
            t = fx.Bounded(lambda: tick(c, "wedge_watch")).start()
            within = t.join(TICK_BOUND_S + 30)
        t.join(120)
    finally:
        stop.set()
        worker.join(timeout=60)
    assert within, f"wedge_watch tick with the gateway's sshd frozen took more than {TICK_BOUND_S + 30:.0f} s ({t.seconds} s)"
    assert t.error is None or "gateway" in str(t.error).lower(), repr(t.error)


def served_model(c) -> str:
    from spark_pipelines.core.fleet import load_fleet

    f = load_fleet(c.fleet)
    return f.launch_for(f.node("spark2")).served_model_name
