"""Sensors: the pins sensor requests exactly the changed steps; the health sensor redeploys a node
only after consecutive failed probes (probed over real HTTP on loopback)."""

import http.server
import json
import threading

import dagster as dg
import pytest
import yaml

from spark_pipelines.definitions import build_definitions
from spark_pipelines.sensors.health import FAILURES_BEFORE_REDEPLOY, ContainerState, health_sensors


def write(tmp_path, data, name="fleet.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(p)


def sensor(defs, name):
    return defs.get_repository_def().get_sensor_def(name)


def test_pins_sensor_records_then_requests_changed_steps(tmp_path, seed_data):
    path = write(tmp_path, seed_data)
    defs = build_definitions(path)
    s = sensor(defs, "pins_changed")
    first = s(dg.build_sensor_context(cursor=None, definitions=defs))
    assert not first.run_requests and first.cursor
    same = s(dg.build_sensor_context(cursor=first.cursor, definitions=defs))
    assert not same.run_requests
    seed_data["pins"]["vllm_ref"] = "0123456789"
    write(tmp_path, seed_data)
    changed = s(dg.build_sensor_context(cursor=first.cursor, definitions=defs))
    assert len(changed.run_requests) == 1
    keys = {k.to_user_string() for k in changed.run_requests[0].asset_selection}
    assert keys == {"base_image", "serving_image"}
    assert json.loads(changed.cursor) != json.loads(first.cursor)


def test_pins_sensor_launch_change_requests_each_node(tmp_path, seed_data):
    path = write(tmp_path, seed_data)
    defs = build_definitions(path)
    s = sensor(defs, "pins_changed")
    cursor = s(dg.build_sensor_context(cursor=None, definitions=defs)).cursor
    seed_data["launch"]["max_model_len"] = 131072
    write(tmp_path, seed_data)
    res = s(dg.build_sensor_context(cursor=cursor, definitions=defs))
    assert sorted(r.partition_key for r in res.run_requests) == ["spark1", "spark2"]
    assert all(r.job_name == "deploy_node_job" for r in res.run_requests)


def test_pins_sensor_skips_a_broken_fleet_file(tmp_path, seed_data):
    path = write(tmp_path, seed_data)
    defs = build_definitions(path)
    s = sensor(defs, "pins_changed")
    cursor = s(dg.build_sensor_context(cursor=None, definitions=defs)).cursor
    seed_data["launch"]["gpu_memory_utilization"] = 0.5
    write(tmp_path, seed_data)
    res = s(dg.build_sensor_context(cursor=cursor, definitions=defs))
    assert not res.run_requests and res.cursor == cursor
    assert "fleet file unusable" in str(res.skip_reason) and "gpu_memory_utilization" in str(res.skip_reason)


@pytest.fixture()
def vllm_health():
    """A real HTTP server on loopback answering /health like vLLM; `state['up']` toggles it."""
    state = {"up": True}

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if state["up"] and self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1], state
    srv.shutdown()


def test_health_sensor_redeploys_after_consecutive_failures(tmp_path, seed_data, vllm_health):
    port, state = vllm_health
    for n in seed_data["nodes"]:
        n["host"] = "127.0.0.1"
    seed_data["launch"]["port"] = port
    # The container is gone (not starting): the redeploy is due at the Nth failed probe.
    defs = health_sensors(write(tmp_path, seed_data), container_state=lambda f, n: ContainerState(False))
    s = next(iter(defs.sensors))
    cursor = None
    res = s(dg.build_sensor_context(cursor=cursor))
    assert not res.run_requests
    state["up"] = False
    requested = []
    for _ in range(FAILURES_BEFORE_REDEPLOY + 1):
        res = s(dg.build_sensor_context(cursor=res.cursor))
        requested.append(sorted(r.partition_key for r in res.run_requests))
    # Nothing until the Nth failure, then exactly one request per node, then no storm.
    assert requested[: FAILURES_BEFORE_REDEPLOY - 1] == [[]] * (FAILURES_BEFORE_REDEPLOY - 1)
    assert requested[FAILURES_BEFORE_REDEPLOY - 1] == ["spark1", "spark2"]
    assert requested[FAILURES_BEFORE_REDEPLOY] == []
    state["up"] = True
    res = s(dg.build_sensor_context(cursor=res.cursor))
    assert json.loads(res.cursor) == {"spark1": {"failures": 0}, "spark2": {"failures": 0}}
