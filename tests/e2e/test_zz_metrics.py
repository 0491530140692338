"""Metrics and alerts end to end on the simulated fleet: a real Prometheus (Debian's 2.42) scrapes
every node's vLLM stand-in, the gateway and the fleet exporter (`metrics serve`, reading the
instance node_health records in), through the file_sd targets `metrics scrape-config` wrote; a real
Alertmanager routes the alerts to a webhook this test runs.

A node wedged under live traffic, then its engine in a crash loop (quarantined, the rotation at its
floor): each alert arrives once its (scaled) `for:` window has passed, and resolves when the node is
healed. Reuses test_zz_healing's module fixture (the fleet test_chain deployed, one instance).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.cli.metrics import serve, write_scrape_config
from spark_pipelines.runbook import quarantine
from spark_pipelines.state import records
from spark_sim.servers import free_port
from tests.e2e.test_zz_doctor import inspect, production_aside
from tests.e2e.test_zz_healing import back_in_gateway, env, latest_observation, requests_of, run, tick  # noqa: F401
from tests.plugins.traffic import Traffic
from tests.plugins.prometheus import FOR_SCALE, prometheus_stack
from spark_pipelines.cli.metrics import RULES

pytestmark = pytest.mark.slow

SLACK_S = 12  # scrape (1 s) + evaluation (1 s) + exporter cache (0.5 s) + Alertmanager group_wait (1 s), with room
LATENCIES: dict[str, tuple[float, float]] = {}


@pytest.fixture(scope="module")
def stack(env, tmp_path_factory):  # noqa: F811 (the imported fixture)
    root = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    server = serve(env["fleet"], lambda: env["instance"], "127.0.0.1", port, cache_s=0.5)
    try:
        write_scrape_config(env["fleet"], root / "sd", f"127.0.0.1:{port}", None)  # read by prometheus_stack
        with prometheus_stack(root, root / "sd", RULES) as s:
            yield s
    finally:
        server.shutdown()
        server.server_close()
    for alert, (latency, window) in LATENCIES.items():
        print(f"\nalert latency {alert}: {latency:.1f} s after the verdict was recorded (for: {window:.1f} s, "
              f"x{FOR_SCALE} in production)")


def arrives(stack, alert, node, since):
    """The firing notification, checked against the alert's window; returns when it came."""
    window = stack.windows[alert]
    got = stack.webhook.wait(alert, "firing", node, since, window + SLACK_S + 20)
    latency = got.at - since
    LATENCIES[alert] = (latency, window)
    assert window - 1 <= latency <= window + SLACK_S, f"{alert}: {latency:.1f} s for a {window:.1f} s window"
    assert got.annotations["dagster_job"] and got.annotations["advice"] and got.annotations["runbook"]
    return got


def recorded_at(env, node):
    """When the instance recorded the node's newest verdict (the exporter's source)."""
    return records.latest_health(env["instance"], node)[1]


def until_verdict(env, node, verdict, cursor=None, tries=4):
    for _ in range(tries):
        res = tick(env, cursor)
        cursor = res.cursor
        if latest_observation(env, node)["verdict"].value == verdict:
            return res
        time.sleep(1)
    raise AssertionError(f"{node}: no {verdict} verdict, last {latest_observation(env, node)['verdict'].value}")


def test_prometheus_scrapes_every_node_the_gateway_and_the_exporter(env, stack):  # noqa: F811
    tick(env)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        up = {(t["labels"]["job"], t["labels"].get("node", "")): t["health"] for t in stack.targets()}
        if up.get(("spark-fleet", "")) == "up" and up.get(("spark-vllm", "spark2")) == "up":
            break
        time.sleep(0.5)
    assert up[("spark-vllm", "spark1")] == "up" and up[("spark-vllm", "spark2")] == "up", up
    assert up[("spark-fleet", "")] == "up", up
    assert ("spark-gateway", "") in up  # LiteLLM serves /metrics only with its prometheus callback
    # The vLLM stand-in's own series and the exporter's verdict arrive through the same Prometheus.
    assert stack.query('vllm:num_requests_running{job="spark-vllm",node="spark2"}')
    healthy = stack.query('spark_node_verdict{verdict="healthy"} == 1')
    assert {r["metric"]["node"] for r in healthy} == {"spark1", "spark2"}
    assert stack.query("spark_fleet_rotation_size")[0]["value"][1] == "2"


def test_an_edited_fleet_file_changes_the_targets_without_a_restart(env, stack, tmp_path):  # noqa: F811
    """file_sd: the scrape config rewritten from an edited fleet file (the gateway's port here) is
    picked up by the running Prometheus."""
    text = Path(env["sim"].fleet_file).read_text()
    port = env["fleet"].gateway.proxy_port
    # Another free port for the gateway: not LiteLLM's own behind the front (the fleet file refuses that).
    moved = next(p for p in range(port + 1, port + 50) if p != env["fleet"].gateway.front.litellm_port)
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump({**yaml.safe_load(text), "gateway": {
        **yaml.safe_load(text)["gateway"], "proxy_port": moved}}, sort_keys=False))
    sd = stack.dir / "sd"  # where the stack fixture wrote the targets Prometheus reads
    pid = stack.pid
    try:
        write_scrape_config(load_fleet(str(edited)), sd, exporter_of(stack), None)
        assert gateway_target(stack, f":{moved}"), "the edited fleet file's gateway port never became a target"
    finally:
        write_scrape_config(env["fleet"], sd, exporter_of(stack), None)
    assert gateway_target(stack, f":{port}") and stack.pid == pid  # the same process: no restart


def exporter_of(stack) -> str:
    return next(t["labels"]["instance"] for t in stack.targets() if t["labels"]["job"] == "spark-fleet")


def gateway_target(stack, suffix, seconds=15) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if [t for t in stack.targets() if t["labels"]["job"] == "spark-gateway" and
                t["labels"]["instance"].endswith(suffix)]:
            return True
        time.sleep(0.5)
    return False


def test_a_wedge_alerts_within_its_window_and_resolves_when_healed(env, stack):  # noqa: F811
    sim = env["sim"]
    sim.set_gpu("spark2", "wedged")
    try:
        with Traffic(env["fleet"]):
            until_verdict(env, "spark2", "wedged")
        since = recorded_at(env, "spark2")
        fired = arrives(stack, "SparkNodeWedgeSuspected", "spark2", since)
    finally:
        sim.set_gpu("spark2", "healthy")
    until_verdict(env, "spark2", "healthy")
    healed = recorded_at(env, "spark2")
    resolved = stack.webhook.wait("SparkNodeWedgeSuspected", "resolved", "spark2", fired.at, SLACK_S + 10)
    assert healed <= resolved.at <= healed + SLACK_S, "resolved before the healthy verdict, or late"
    LATENCIES["SparkNodeWedgeSuspected resolved"] = (resolved.at - healed, 0.0)


def test_a_crash_loop_and_the_rotation_floor_alert_and_resolve(env, stack):  # noqa: F811
    fleet = env["fleet"]
    with production_aside(fleet) as (s, spec):
        argv = spec.docker_run_argv()
        s.run("spark2", argv[:3] + ["--restart", "on-failure:50"] + argv[3:] + ["--enable-prefix-caching"],
              log=False, timeout=120)
        deadline = time.monotonic() + 90
        while inspect(s, "spark2", spec.container_name)["RestartCount"] < 2 and time.monotonic() < deadline:
            time.sleep(1)
        res = until_verdict(env, "spark2", "crash-loop")
        since = recorded_at(env, "spark2")
        if not requests_of(res, "quarantine_job"):  # the policy acts on the second sweep in a row
            res = tick(env, res.cursor)
        q = requests_of(res, "quarantine_job")
        assert [r.partition_key for r in q] == ["spark2"] and run(env, q[0]).success
        rotation = records.latest_rotation(env["instance"])  # the quarantine's record: spark2 out, one left
        assert rotation.nodes == ["spark1"]
        out = rotation.at
        loop = arrives(stack, "SparkNodeCrashLoop", "spark2", since)
        floor = arrives(stack, "SparkRotationAtFloor", None, out)
        reason = stack.query('spark_node_out_of_rotation{node="spark2"} == 1')
        assert [r["metric"]["reason"] for r in reason] == ["quarantined"]
        quarantine.release(s, "spark2", by="test")
    # back_in_gateway's sweeps record spark2 healthy and the reconcile puts it back: both resolve.
    cursor = back_in_gateway(env, res.cursor)
    until_verdict(env, "spark2", "healthy", cursor)
    stack.webhook.wait("SparkNodeCrashLoop", "resolved", "spark2", loop.at, SLACK_S + 10)
    stack.webhook.wait("SparkRotationAtFloor", "resolved", None, floor.at, SLACK_S + 10)
