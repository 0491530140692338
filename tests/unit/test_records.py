"""state/records.py: a step recorded outside its asset (a rollout's deploy and bench, an adopted
step) carries what Dagster writes on the asset's own output, so the pins sensor and Dagster's own
staleness both see it, and agree. A real instance; the steps upstream are stand-ins materialized
with the code versions the definitions declare, as a run would record them."""

import dagster as dg
import yaml
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest

from spark_pipelines.core import steps
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.pins import code_versions
from spark_pipelines.definitions import build_definitions
from spark_pipelines.state import records

NODES = ("spark1", "spark2")


def write(tmp_path, data):
    p = tmp_path / "fleet.yaml"
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(p)


def materialize_stand_ins(instance, defs, names, partitions=(None,)):
    graph = defs.get_repository_def().asset_graph
    assets = []
    for name in names:
        node = graph.get(dg.AssetKey(name))

        @dg.asset(name=name, code_version=node.code_version, partitions_def=node.partitions_def)
        def stand_in() -> None:
            return None

        assets.append(stand_in)
    for p in partitions:
        assert dg.materialize(assets, instance=instance, partition_key=p).success


def built(instance, defs):
    """The build host's steps, the gateway and each node's artifacts, recorded by their own runs."""
    materialize_stand_ins(instance, defs, [*steps.BUILD_STEPS, steps.GATEWAY])
    materialize_stand_ins(instance, defs, [steps.NODE_ARTIFACTS], partitions=NODES)


def rollout_records(instance, cv, record_deploy):
    """A run of a stand-in fleet_rollout recording each node's deploy and bench from its step, as
    assets/rollout.py's steps do."""

    @dg.asset(name=steps.FLEET_ROLLOUT)
    def fleet_rollout(context: dg.AssetExecutionContext) -> None:
        for node in NODES:
            record_deploy(context, node)
            records.record_bench(context, node, cv[steps.BENCH_RESULTS], {"mean_tok_s": 52.0})

    assert dg.materialize([fleet_rollout], instance=instance).success


def tick(defs, instance):
    sensor = defs.get_repository_def().get_sensor_def(steps.PINS_SENSOR)
    return sensor(dg.build_sensor_context(instance=instance, definitions=defs))


def stale_status(instance, defs, asset):
    graph = defs.get_repository_def().asset_graph
    resolver = CachingStaleStatusResolver(instance, graph, LoadingContextForTest(instance))
    key = dg.AssetKey(asset)
    return {n: resolver.get_status(key, n) for n in NODES}, {
        n: [c.reason for c in resolver.get_stale_causes(key, n)] for n in NODES}


def test_a_launch_change_after_a_rollout_requests_a_rollout_and_dagster_agrees(tmp_path, seed_data):
    path = write(tmp_path, seed_data)
    loaded = build_definitions(path)
    cv = code_versions(load_fleet(path))
    with dg.instance_for_test() as instance:
        built(instance, loaded)
        rollout_records(instance, cv, lambda context, node: records.record_deploy(
            context, node, cv[steps.NODE_DEPLOYMENT], f"sig-{node}", {"image_id": "sha256:feed"}))
        # Current: the sensor requests nothing, and Dagster marks no node step stale (the
        # recorded inputs are the node's own artifacts and the gateway, as an output records them).
        assert not tick(loaded, instance).run_requests
        for asset in (steps.NODE_DEPLOYMENT, steps.BENCH_RESULTS):
            status, causes = stale_status(instance, loaded, asset)
            assert set(status.values()) == {StaleStatus.FRESH}, (asset, causes)
        assert records.recorded_code_version(instance, steps.NODE_DEPLOYMENT, "spark1") == cv[steps.NODE_DEPLOYMENT]

        seed_data["launch"]["max_model_len"] = 131072  # a launch-profile change, then the reload
        reloaded = build_definitions(write(tmp_path, seed_data))
        [req] = tick(reloaded, instance).run_requests
        assert req.job_name == steps.ROLLOUT_JOB and req.tags[steps.NODES_TAG] == "spark1,spark2"
        status, causes = stale_status(instance, reloaded, steps.NODE_DEPLOYMENT)
        assert set(status.values()) == {StaleStatus.STALE}
        assert all("new code version" in " ".join(c) for c in causes.values()), causes


def test_a_bare_materialization_is_what_left_the_sensor_blind(tmp_path, seed_data):
    """What the rollout logged before: no code version, so 'never materialized, not stale'."""
    path = write(tmp_path, seed_data)
    loaded = build_definitions(path)
    cv = code_versions(load_fleet(path))
    with dg.instance_for_test() as instance:
        built(instance, loaded)
        rollout_records(instance, cv, lambda context, node: context.log_event(
            dg.AssetMaterialization(steps.NODE_DEPLOYMENT, partition=node, metadata={"image_id": "sha256:feed"})))
        seed_data["launch"]["max_model_len"] = 131072
        assert not tick(build_definitions(write(tmp_path, seed_data)), instance).run_requests


def test_a_step_recorded_runless_on_an_instance_carries_its_versions(tmp_path):
    with dg.instance_for_test() as instance:
        records.record_step(instance, steps.NODE_ARTIFACTS, "spark1", "r1-abc", "idx-1", {"image_id": "sha256:1"})
        mat = records.record_step(instance, steps.NODE_DEPLOYMENT, "spark1", "r1-def", None, {},
                                  description="adopted", inputs={steps.NODE_ARTIFACTS: "spark1"})
        rec = records.latest(instance, steps.NODE_DEPLOYMENT, "spark1")
        tags = rec.asset_materialization.tags
        assert tags["dagster/code_version"] == "r1-def"
        assert tags["dagster/input_data_version/node_artifacts"] == "idx-1"
        assert int(tags["dagster/input_event_pointer/node_artifacts"]) == records.latest(
            instance, steps.NODE_ARTIFACTS, "spark1").storage_id
        # No data version given: derived from the code version and the inputs', as Dagster does.
        assert tags["dagster/data_version"] and "dagster/data_version_is_user_provided" not in tags
        assert mat.description == "adopted"
        assert records.latest_metadata(instance, steps.NODE_ARTIFACTS, "spark1") == {"image_id": "sha256:1"}


def test_the_recorded_inputs_are_the_asset_graphs(tmp_path, seed_data):
    graph = build_definitions(write(tmp_path, seed_data)).get_repository_def().asset_graph
    parents = lambda a: {k.to_user_string() for k in graph.get(dg.AssetKey(a)).parent_keys}  # noqa: E731
    assert parents(steps.NODE_DEPLOYMENT) == set(records.DEPLOY_INPUTS)
    assert parents(steps.BENCH_RESULTS) == set(records.BENCH_INPUTS)
    per_node = {k.to_user_string() for k in graph.get_all_asset_keys() if graph.get(k).partitions_def}
    assert records.PER_NODE <= per_node
