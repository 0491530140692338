"""node_health: one run key per failure episode, and no redeploy inside a node's start-up window.

/health is probed over real HTTP on loopback (the `vllm_health` server of test_sensors); the
container's state, read over SSH in production, comes from the reader the test gives."""

import json
import time

import dagster as dg
import pytest
import yaml

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.sensors import health
from spark_pipelines.sensors.health import (FAILURES_BEFORE_REDEPLOY, SSH_SILENT_MAX_S, STARTUP_WINDOW_S,
                                            ContainerState, health_sensors, judge, parse_started_at)
from tests.unit.test_sensors import vllm_health  # noqa: F401  (fixture)


@pytest.fixture()
def fleet_path(tmp_path, seed_data, vllm_health):  # noqa: F811
    port, state = vllm_health
    for n in seed_data["nodes"]:
        n["host"] = "127.0.0.1"
    seed_data["launch"]["port"] = port
    p = tmp_path / "fleet.yaml"
    p.write_text(yaml.safe_dump(seed_data, sort_keys=False))
    return str(p), state


def ticks(sensor, n, cursor=None):
    out = []
    for _ in range(n):
        res = sensor(dg.build_sensor_context(cursor=cursor))
        cursor = res.cursor
        out.append(res)
    return out, cursor


def the_sensor(path, reader):
    return next(iter(health_sensors(load_fleet(path), container_state=reader).sensors))


def test_run_key_is_per_episode(fleet_path, monkeypatch):
    path, state = fleet_path
    clock = [1_000_000.0]
    monkeypatch.setattr(health.time, "time", lambda: clock[0])
    s = the_sensor(path, lambda f, n: ContainerState(False))
    state["up"] = False
    results, cursor = ticks(s, FAILURES_BEFORE_REDEPLOY + 2)
    requests = [r for res in results for r in res.run_requests]
    assert sorted(r.partition_key for r in requests) == ["spark1", "spark2"]
    first_keys = {r.run_key for r in requests}
    assert first_keys == {"health-spark1-1000000", "health-spark2-1000000"}
    # Recovery ends the episode; the next failure is a new episode with a new key.
    state["up"] = True
    _, cursor = ticks(s, 1, cursor)
    clock[0] += 3600
    state["up"] = False
    results, cursor = ticks(s, FAILURES_BEFORE_REDEPLOY, cursor)
    keys = {r.run_key for res in results for r in res.run_requests}
    assert keys == {"health-spark1-1003600", "health-spark2-1003600"} and not keys & first_keys


def test_no_redeploy_inside_the_start_up_window(fleet_path):
    path, state = fleet_path
    asked = []

    def starting(fleet, node):
        asked.append(node.name)
        return ContainerState(True, started_at=time.time() - 20 * 60)  # a first boot, 20 min in

    s = the_sensor(path, starting)
    state["up"] = False
    results, cursor = ticks(s, FAILURES_BEFORE_REDEPLOY + 3)
    assert not [r for res in results for r in res.run_requests]
    # The container is inspected only once /health has failed N times.
    assert asked and len(asked) == 2 * 4
    # Past the window, the same (still silent) engine is redeployed.
    s = the_sensor(path, lambda f, n: ContainerState(True, started_at=time.time() - STARTUP_WINDOW_S - 60))
    res = s(dg.build_sensor_context(cursor=cursor))
    assert sorted(r.partition_key for r in res.run_requests) == ["spark1", "spark2"]
    assert all(json.loads(res.cursor)[n]["requested"] for n in ("spark1", "spark2"))


def test_healthy_nodes_are_never_inspected(fleet_path):
    path, _ = fleet_path
    s = the_sensor(path, lambda f, n: pytest.fail("inspected a healthy node"))
    results, _ = ticks(s, FAILURES_BEFORE_REDEPLOY + 1)
    assert not [r for res in results for r in res.run_requests]


def test_an_old_cursor_is_read():
    s_old = json.dumps({"spark1": 2, "spark2": 0})
    assert health._episode(json.loads(s_old)["spark1"]) == {"failures": 2}


def test_judge_rules():
    now = 10_000_000.0
    assert judge(ContainerState(True, now - 60), now - 300, now).startswith("container started 1 min ago")
    assert judge(ContainerState(True, now - STARTUP_WINDOW_S - 1), now - 300, now) is None
    assert judge(ContainerState(False), now - 300, now) is None  # exited or gone: not starting
    # SSH silent: wait while graph capture may still hold it, then redeploy.
    assert "SSH may be silent" in judge(ContainerState(None, error="timeout"), now - 300, now)
    assert judge(ContainerState(None, error="timeout"), now - SSH_SILENT_MAX_S - 1, now) is None


def test_parse_started_at():
    assert parse_started_at("2026-12-03T11:20:01.5Z") == pytest.approx(1796296801.5)
    assert parse_started_at("2026-12-03T11:20:01.123456789Z") == pytest.approx(1796296801.123457)
    assert parse_started_at("0001-01-01T00:00:00Z") is None
    assert parse_started_at("garbage") is None
