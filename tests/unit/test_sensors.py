"""Sensors: the pins sensor requests exactly the steps whose code version, as the instance recorded
it, differs from the loaded fleet's. (node_health: tests/unit/test_health_sensor.py, which uses
this module's `vllm_health` server.)"""

import http.server
import threading

import dagster as dg
import pytest
import yaml

from spark_pipelines.definitions import build_definitions


def write(tmp_path, data, name="fleet.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(p)


def sensor(defs, name):
    return defs.get_repository_def().get_sensor_def(name)


def record(instance, defs, steps, partitions=(None,)):
    """Materialize stand-ins of `steps` carrying the code versions `defs` declares, so the INSTANCE
    records them the way a real run does (Dagster writes each materialization's code version)."""
    graph = defs.get_repository_def().asset_graph
    assets = []
    for step in steps:
        node = graph.get(dg.AssetKey(step))

        @dg.asset(name=step, code_version=node.code_version, partitions_def=node.partitions_def)
        def stand_in() -> None:
            return None

        assets.append(stand_in)
    for p in partitions:
        assert dg.materialize(assets, instance=instance, partition_key=p).success


UNPARTITIONED = ["base_model", "hybrid_checkpoint", "mtp_weights", "base_image", "serving_image"]
PER_NODE = ["node_artifacts", "node_deployment"]


def built(instance, defs):
    record(instance, defs, UNPARTITIONED)
    record(instance, defs, PER_NODE, partitions=("spark1", "spark2"))


def tick(defs, instance):
    return sensor(defs, "pins_changed")(dg.build_sensor_context(instance=instance, definitions=defs))


def test_pins_sensor_requests_nothing_before_the_first_build_or_when_current(tmp_path, seed_data):
    defs = build_definitions(write(tmp_path, seed_data))
    with dg.instance_for_test() as instance:
        first = tick(defs, instance)
        assert not first.run_requests  # never built: the first build is the operator's
        built(instance, defs)
        same = tick(defs, instance)
        assert not same.run_requests and "loaded code versions" in str(same.skip_reason)


def test_pins_sensor_requests_exactly_the_stale_steps_after_a_reload(tmp_path, seed_data):
    path = write(tmp_path, seed_data)
    loaded = build_definitions(path)
    with dg.instance_for_test() as instance:
        built(instance, loaded)
        seed_data["pins"]["vllm_ref"] = "0123456789"
        write(tmp_path, seed_data)
        # Not reloaded yet: the sensor keeps to the loaded code versions, as the UI does, and says why.
        before = tick(loaded, instance)
        assert not before.run_requests and "reload" in str(before.skip_reason)
        reloaded = build_definitions(path)
        res = tick(reloaded, instance)
        assert len(res.run_requests) == 1
        keys = {k.to_user_string() for k in res.run_requests[0].asset_selection}
        assert keys == {"base_image", "serving_image"}
        assert res.run_requests[0].tags["pins"] == "base_image"
        # The same request (same run key) on the next tick: Dagster launches it once.
        assert tick(reloaded, instance).run_requests[0].run_key == res.run_requests[0].run_key
        # Once the instance records the new code versions, nothing is stale any more.
        record(instance, reloaded, ["base_image", "serving_image"])
        assert not tick(reloaded, instance).run_requests


def test_pins_sensor_launch_change_requests_one_gated_rollout(tmp_path, seed_data):
    path = write(tmp_path, seed_data)
    with dg.instance_for_test() as instance:
        built(instance, build_definitions(path))
        seed_data["launch"]["max_model_len"] = 131072
        write(tmp_path, seed_data)
        reloaded = build_definitions(path)
        res = tick(reloaded, instance)
        # One gated rollout of both nodes, never a deploy per node at once.
        [req] = res.run_requests
        assert req.job_name == "rollout_job" and req.partition_key is None
        assert req.tags["pins"] == "node_deployment" and req.tags["nodes"] == "spark1,spark2"
        # One node already at the new launch profile: the rollout is for the other; the same run
        # key, so a rollout that stopped on a gate is not launched again by the next tick.
        record(instance, reloaded, ["node_deployment"], partitions=("spark1",))
        [again] = tick(reloaded, instance).run_requests
        assert again.tags["nodes"] == "spark2" and again.run_key == req.run_key
        # Every node at the new version: nothing to request.
        record(instance, reloaded, ["node_deployment"], partitions=("spark2",))
        assert not tick(reloaded, instance).run_requests


def test_pins_sensor_skips_a_broken_fleet_file(tmp_path, seed_data):
    path = write(tmp_path, seed_data)
    defs = build_definitions(path)
    with dg.instance_for_test() as instance:
        built(instance, defs)
        seed_data["pins"]["vllm_ref"] = "0123456789"
        built(instance, build_definitions(write(tmp_path, seed_data)))  # the instance now differs from `defs`
        seed_data["launch"]["gpu_memory_utilization"] = 0.5
        write(tmp_path, seed_data)
        res = tick(defs, instance)
        assert not res.run_requests
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
