"""Faults around the gateway during a bench: the proxy killed mid-bench, the reload failing at
drain, two benches at once. The gateway config always routes to a node, the proxy answers
afterwards, and the benched node is back in rotation or out with the reason recorded."""

from __future__ import annotations

import os
import re
import time

import pytest

from tests.faults.conftest import bench_gate, deployed_id, failure_text
from tests.plugins import faults as fx

pytestmark = pytest.mark.slow


def back_or_held_with_reason(sim, node: str, res) -> None:
    nodes = fx.rotation(fx.gateway_config(sim))
    if node in nodes:
        return
    gate = bench_gate(sim, node)
    reason = gate.read_text() if gate.exists() else ""
    assert node in failure_text(res) or "reason" in reason, (
        f"{node} is out of the gateway with no reason recorded (gate {reason!r}, run: {failure_text(res)[:300]})")


def test_proxy_killed_during_a_bench(fleet):
    c, sim = fleet, fleet.sim
    with fx.RotationWatch(sim, every_s=0.05) as watch:
        run = fx.Bounded(lambda: c.run("bench_job", "spark2")).start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not run.done:
            if "spark2" not in fx.rotation(fx.gateway_config(sim)):
                break  # drained: the bench is measuring now
            time.sleep(0.05)
        assert not run.done, "the bench ended before it drained spark2: the fault was not injected"
        killed = fx.kill_proxy(sim)
        assert run.join(300), "the bench did not end within 300 s after the proxy died"
    assert run.error is None, repr(run.error)
    res = run.result
    assert watch.fewest and watch.fewest >= 1, f"the config routed to no node at {watch.empty_at}"
    assert fx.proxy_pid(sim) != killed or fx.proxy_ready(sim), "nobody noticed the proxy was dead"
    back_or_held_with_reason(sim, "spark2", res)
    fx.assert_gateway_has_backend(sim)


@pytest.fixture()
def reload_fails_once(fleet):
    """A reload command that refuses its first call (the drain's) and works after."""
    gw = fleet.sim.gateway
    script, flag = gw.home / "fault-reload", gw.home / "fault-reload.done"
    script.write_text(
        "#!/bin/sh\n"
        "# fault suite: the first reload fails, every later one is the real restart\n"
        f"if [ ! -e {flag} ]; then : > {flag}; echo 'fault: reload refused (simulated)' >&2; exit 1; fi\n"
        f"exec {gw.bin / 'litellm-restart'}\n")
    os.chmod(script, 0o755)
    try:
        yield fleet.variant("reloadfails", lambda d: d["gateway"].__setitem__("reload_command", [str(script)])), flag
    finally:
        script.unlink(missing_ok=True)
        flag.unlink(missing_ok=True)


def test_reload_failing_at_drain_puts_the_node_back(fleet, reload_fails_once):
    c, sim = fleet, fleet.sim
    path, flag = reload_fails_once
    with fx.RotationWatch(sim) as watch:
        res = c.run("bench_job", "spark2", fleet=path)
    assert flag.exists(), "the drain never reloaded the proxy: the fault was not injected"
    assert watch.fewest and watch.fewest >= 1
    assert not res.success, "a bench whose drain failed reported success"
    why = failure_text(res)
    assert re.search(r"reload|refused|litellm|gateway", why, re.I), why
    assert "spark2" in fx.rotation(fx.gateway_config(sim)), "spark2 left out of the gateway after a failed drain"
    fx.assert_gateway_has_backend(sim)


def test_two_benches_at_once_never_empty_the_gateway(fleet):
    c, sim = fleet, fleet.sim
    with fx.RotationWatch(sim, every_s=0.05) as watch:
        runs = {n: fx.Bounded(lambda n=n: c.run("bench_job", n)).start() for n in ("spark1", "spark2")}
        for n, r in runs.items():
            assert r.join(300), f"the bench of {n} did not end within 300 s"
    assert all(r.error is None for r in runs.values()), {n: r.error for n, r in runs.items()}
    results = {n: r.result for n, r in runs.items()}
    texts = {n: failure_text(r) for n, r in results.items()}
    assert watch.fewest and watch.fewest >= 1, f"two benches left the gateway with no node at {watch.empty_at[:5]}"
    assert any(r.success for r in results.values()), texts
    for n, r in results.items():
        assert "address already in use" not in texts[n], texts[n]
        if not r.success:
            assert re.search(r"busy|min_in_rotation|in rotation|another|wait|lock", texts[n], re.I), texts[n]
        back_or_held_with_reason(sim, n, r)
    fx.assert_gateway_has_backend(sim)


def test_reload_failing_at_the_bench_restore_is_repaired(fleet):
    """Issue 22.7: the restore after a bench wrote the config and its reload failed; the running
    proxy kept serving spark1 only while the file listed both. Now the restore reloads again and
    confirms on the running proxy: spark2 is served again without a hand step."""
    from spark_pipelines.core.fleet import load_fleet
    from spark_pipelines.resources.gateway import GatewayHost
    from spark_pipelines.resources.ssh import FleetSession

    c, sim = fleet, fleet.sim
    gw = sim.gateway
    script, count = gw.home / "fault-reload-2nd", gw.home / "fault-reload-2nd.count"
    script.write_text(
        "#!/bin/sh\n"
        "# fault suite: the second reload (the bench's restore) fails, every other one is the real one\n"
        f"n=$(($(cat {count} 2>/dev/null || echo 0) + 1)); echo $n > {count}\n"
        "if [ $n -eq 2 ]; then echo 'fault: reload refused (simulated)' >&2; exit 1; fi\n"
        f"exec {gw.bin / 'litellm-reload'}\n")
    os.chmod(script, 0o755)
    try:
        path = c.variant("reloadfails2", lambda d: d["gateway"].__setitem__("reload_command", [str(script)]))
        with fx.RotationWatch(sim) as watch:
            res = c.run("bench_job", "spark2", fleet=path)
        assert int(count.read_text()) >= 3, "the restore's reload was not retried: the fault was not injected"
        assert watch.fewest and watch.fewest >= 1
        assert res.success, failure_text(res)
        assert "spark2" in fx.rotation(fx.gateway_config(sim))
        with FleetSession(load_fleet(c.fleet)) as s:
            assert GatewayHost(s).serving_nodes() == ["spark1", "spark2"], "the running proxy left spark2 out"
        fx.assert_gateway_has_backend(sim)
    finally:
        script.unlink(missing_ok=True)
        count.unlink(missing_ok=True)


def test_a_deploy_cuts_no_stream_its_node_is_sending(fleet):
    """Issue 34.3: a stream sent to a node before its deploy's drain was confirmed was cut by
    `docker stop` a second later (the bench's drain waited for requests in flight, the deploy's
    did not). Now the deploy's drain waits until the node's vLLM reads zero requests in flight:
    the stream ends whole, then the new launch spec serves."""
    from spark_pipelines.core.fleet import load_fleet
    from spark_sim.traffic import Streams

    c, sim = fleet, fleet.sim
    m = sim.node("spark2")
    base = f"http://{m.ip}:{fx.ENGINE_PORT}"
    model = load_fleet(c.fleet).launch.served_model_name
    # ~10 s at the sim's 1000 tok/s: what the gateway had sent spark2 just before its drain.
    stream = Streams(base, "unused", {base: "spark2"}, max_tokens=10_000, pool=model).add(1)
    fx.wait_for(lambda: fx.engine_requests_running(m) >= 1, 10, "the stream reaching spark2's engine")
    before = deployed_id(sim, "spark2")
    path = c.variant("stream-deploy", lambda d: d["launch"]["env"].__setitem__("VLLM_LOGGING_LEVEL", "INFO"))
    res = c.run("deploy_node_job", "spark2", fleet=path)
    assert res.success, failure_text(res)
    [s] = stream.wait(60)
    assert s.finished and not s.error, f"the stream was cut: {s.error} after {s.chunks} chunks"
    assert fx.container(m)["Id"] != before, "the variant was not deployed: the test proved nothing"
