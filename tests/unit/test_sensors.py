"""Sensors: the pins sensor requests exactly the steps whose code version, as the instance recorded
it, differs from the loaded fleet's, and a rollout for exactly the nodes whose launch changed. (node_health: tests/unit/test_health_sensor.py, which uses
this module's `vllm_health` server.)"""

import http.server
import threading

import dagster as dg
import pytest
import yaml

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.pins import code_versions, launch_versions
from spark_pipelines.definitions import build_definitions
from spark_pipelines.state import records


def write(tmp_path, data, name="fleet.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(p)


def sensor(defs, name):
    return defs.get_repository_def().get_sensor_def(name)


def record(instance, path, steps, partitions=(None,)):
    """Materialize stand-ins of `steps` carrying the code versions the definitions of `path`
    declare, so the INSTANCE records them the way a real run does (Dagster writes each
    materialization's code version; node_deployment's points at the node's launch, as its own
    output does)."""
    defs, launch = build_definitions(path), launch_versions(load_fleet(path))
    graph = defs.get_repository_def().asset_graph
    assets = []
    for step in steps:
        node = graph.get(dg.AssetKey(step))

        @dg.asset(name=step, code_version=node.code_version, partitions_def=node.partitions_def)
        def stand_in(context: dg.AssetExecutionContext):
            if context.assets_def.key.to_user_string() != "node_deployment":
                return dg.Output(None)
            node_name = context.partition_key
            return dg.Output(None, tags=records.launch_input_tags(context, node_name, launch[node_name]))

        assets.append(stand_in)
    for p in partitions:
        assert dg.materialize(assets, instance=instance, partition_key=p).success


UNPARTITIONED = ["base_model", "hybrid_checkpoint", "mtp_weights", "base_image", "serving_image"]
PER_NODE = ["node_artifacts", "node_deployment"]


def built(instance, path):
    record(instance, path, UNPARTITIONED)
    record(instance, path, PER_NODE, partitions=("spark1", "spark2"))


def tick(defs, instance):
    """One evaluation of pins_changed; its asset events stored as the daemon stores them."""
    result = sensor(defs, "pins_changed")(dg.build_sensor_context(instance=instance, definitions=defs))
    for event in result.asset_events:
        instance.report_runless_asset_event(event)
    return result


def observed(result):
    return [(e.asset_key.to_user_string(), e.partition, e.tags["dagster/data_version"]) for e in result.asset_events]


def test_pins_sensor_requests_nothing_before_the_first_build_or_when_current(tmp_path, seed_data):
    path = write(tmp_path, seed_data)
    defs = build_definitions(path)
    with dg.instance_for_test() as instance:
        first = tick(defs, instance)
        assert not first.run_requests  # never built: the first build is the operator's
        # The first tick observes every node's launch (nothing was deployed: nothing is stale).
        assert {(n, v) for _, n, v in observed(first)} == set(launch_versions(load_fleet(path)).items())
        built(instance, path)
        same = tick(defs, instance)
        assert not same.run_requests and "loaded code versions" in str(same.skip_reason)
        assert not same.asset_events


def test_pins_sensor_requests_exactly_the_stale_steps_after_a_reload(tmp_path, seed_data):
    path = write(tmp_path, seed_data)
    loaded = build_definitions(path)
    with dg.instance_for_test() as instance:
        built(instance, path)
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
        record(instance, path, ["base_image", "serving_image"])
        assert not tick(reloaded, instance).run_requests


def test_pins_sensor_launch_change_requests_one_gated_rollout(tmp_path, seed_data):
    path = write(tmp_path, seed_data)
    with dg.instance_for_test() as instance:
        built(instance, path)
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
        record(instance, path, ["node_deployment"], partitions=("spark1",))
        [again] = tick(reloaded, instance).run_requests
        assert again.tags["nodes"] == "spark2" and again.run_key == req.run_key
        # Every node at the new version: nothing to request.
        record(instance, path, ["node_deployment"], partitions=("spark2",))
        assert not tick(reloaded, instance).run_requests


def test_pins_sensor_an_override_on_one_node_rolls_out_that_node_only(tmp_path, seed_data):
    """A node's launch is its data: spark2's override changed alone asks a rollout for spark2, with
    its launch observed; spark1's deployment is not touched, its code version did not move."""
    path = write(tmp_path, seed_data)
    with dg.instance_for_test() as instance:
        built(instance, path)
        spark1_before = launch_versions(load_fleet(path))["spark1"]
        seed_data["nodes"][1]["overrides"] = {"max_model_len": 131072}
        write(tmp_path, seed_data)
        reloaded = build_definitions(path)
        launch = launch_versions(load_fleet(path))
        res = tick(reloaded, instance)
        [req] = res.run_requests
        assert req.job_name == "rollout_job" and req.tags["nodes"] == "spark2"
        assert req.tags["pins"] == "node_deployment"
        assert observed(res) == [("node_launch", "spark2", launch["spark2"])] and launch["spark1"] == spark1_before
        assert records.recorded_code_version(instance, "node_deployment", "spark1") == \
            code_versions(load_fleet(path))["node_deployment"]
        # The next tick asks the same (same run key: launched once) and observes nothing new.
        again = tick(reloaded, instance)
        assert again.run_requests[0].run_key == req.run_key and not again.asset_events
        # spark2 deployed at its new launch: nothing to ask.
        record(instance, path, ["node_deployment"], partitions=("spark2",))
        assert not tick(reloaded, instance).run_requests


def test_pins_sensor_rollout_key_changes_when_what_it_asks_for_changes(tmp_path, seed_data):
    """The run key names the launches the rollout brings the fleet to: a second edit of spark2's
    override before its rollout ran is a new request; an edit that changes no node's launch or
    node step (the gateway's routing) is not, nor a node reaching its launch."""
    path = write(tmp_path, seed_data)
    with dg.instance_for_test() as instance:
        built(instance, path)
        seed_data["nodes"][1]["overrides"] = {"max_model_len": 131072}
        write(tmp_path, seed_data)
        first = tick(build_definitions(path), instance).run_requests[0]
        seed_data["gateway"]["routing_strategy"] = "simple-shuffle"
        write(tmp_path, seed_data)
        unrelated = tick(build_definitions(path), instance).run_requests[0]
        assert unrelated.run_key == first.run_key and unrelated.tags["nodes"] == "spark2"
        seed_data["nodes"][1]["overrides"] = {"max_model_len": 65536}
        write(tmp_path, seed_data)
        second = tick(build_definitions(path), instance).run_requests[0]
        assert second.run_key != first.run_key and second.tags["nodes"] == "spark2"
        # spark1's override edited too: spark1 joins the request, under a new key.
        seed_data["nodes"][0]["overrides"] = {"max_model_len": 65536}
        write(tmp_path, seed_data)
        both = tick(build_definitions(path), instance).run_requests[0]
        assert both.tags["nodes"] == "spark1,spark2" and both.run_key not in (first.run_key, second.run_key)
        # spark1 reaches its launch (a deploy_node_job) and spark2's rollout stopped on a gate:
        # the request shrinks to spark2, under the same key (never retried blindly).
        record(instance, path, ["node_deployment"], partitions=("spark1",))
        left = tick(build_definitions(path), instance).run_requests[0]
        assert left.tags["nodes"] == "spark2" and left.run_key == both.run_key


def test_pins_sensor_skips_a_broken_fleet_file(tmp_path, seed_data):
    path = write(tmp_path, seed_data)
    defs = build_definitions(path)
    with dg.instance_for_test() as instance:
        built(instance, path)
        seed_data["pins"]["vllm_ref"] = "0123456789"
        built(instance, write(tmp_path, seed_data))  # the instance now differs from `defs`
        seed_data["launch"]["gpu_memory_utilization"] = 0.5
        write(tmp_path, seed_data)
        res = tick(defs, instance)
        assert not res.run_requests
        assert "fleet file unusable" in str(res.skip_reason) and "gpu_memory_utilization" in str(res.skip_reason)


def test_pins_sensor_says_a_launch_only_edit_needs_a_reload(tmp_path, seed_data):
    """No code version moves on a node's override: the reload note must still be said."""
    path = write(tmp_path, seed_data)
    loaded = build_definitions(path)
    with dg.instance_for_test() as instance:
        built(instance, path)
        seed_data["nodes"][1]["overrides"] = {"max_model_len": 131072}
        write(tmp_path, seed_data)
        res = tick(loaded, instance)
        assert not res.run_requests and "reload" in str(res.skip_reason)


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
