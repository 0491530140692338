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
from spark_pipelines.core.pins import code_versions, launch_versions
from spark_pipelines.definitions import build_definitions
from spark_pipelines.state import records

NODES = ("spark1", "spark2")


def write(tmp_path, data, name="fleet.yaml"):
    p = tmp_path / name
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


def rollout_records(instance, cv, record_deploy, nodes=NODES):
    """A run of a stand-in fleet_rollout recording each node's deploy and bench from its step, as
    assets/rollout.py's steps do."""

    @dg.asset(name=steps.FLEET_ROLLOUT)
    def fleet_rollout(context: dg.AssetExecutionContext) -> None:
        for node in nodes:
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


def deployed_by_rollout(cv, fleet):
    """A rollout's record_deploy of each node's launch, as assets/rollout.py's deploy step makes it."""
    launch = launch_versions(fleet)
    return lambda context, node: records.record_deploy(
        context, node, cv[steps.NODE_DEPLOYMENT], f"sig-{node}", {"image_id": "sha256:feed"}, launch=launch[node])


def store(result, instance):
    """What the daemon does with a sensor's asset events: stored on the instance, runless."""
    for event in result.asset_events:
        instance.report_runless_asset_event(event)
    return result


def test_a_launch_change_after_a_rollout_requests_a_rollout_and_dagster_agrees(tmp_path, seed_data):
    path = write(tmp_path, seed_data)
    loaded = build_definitions(path)
    cv = code_versions(load_fleet(path))
    with dg.instance_for_test() as instance:
        built(instance, loaded)
        rollout_records(instance, cv, deployed_by_rollout(cv, load_fleet(path)))
        # Current: the sensor requests nothing and observes nothing new (each deploy observed its
        # launch), and Dagster marks no node step stale (the recorded inputs are the node's own
        # artifacts and launch and the gateway, as an output records them).
        first = store(tick(loaded, instance), instance)
        assert not first.run_requests and not first.asset_events
        for asset in (steps.NODE_DEPLOYMENT, steps.BENCH_RESULTS):
            status, causes = stale_status(instance, loaded, asset)
            assert set(status.values()) == {StaleStatus.FRESH}, (asset, causes)
        assert records.recorded_code_version(instance, steps.NODE_DEPLOYMENT, "spark1") == cv[steps.NODE_DEPLOYMENT]

        seed_data["launch"]["max_model_len"] = 131072  # the fleet's launch profile, then the reload
        reloaded = build_definitions(write(tmp_path, seed_data))
        res = store(tick(reloaded, instance), instance)
        [req] = res.run_requests
        assert req.job_name == steps.ROLLOUT_JOB and req.tags[steps.NODES_TAG] == "spark1,spark2"
        status, causes = stale_status(instance, reloaded, steps.NODE_DEPLOYMENT)
        assert set(status.values()) == {StaleStatus.STALE}
        # Each node's own launch changed (its data), not node_deployment's code.
        assert all(c == ["has a new dependency data version"] for c in causes.values()), causes


def test_an_override_on_spark2_makes_exactly_spark2_stale(tmp_path, seed_data):
    """A node's launch is that node's data: an override changed on spark2 alone marks
    node_deployment[spark2] stale and leaves spark1 fresh, in Dagster's staleness and in the pins
    sensor alike; once the rollout recorded spark2's deploy both are fresh again."""
    path = write(tmp_path, seed_data)
    loaded = build_definitions(path)
    fleet = load_fleet(path)
    cv = code_versions(fleet)
    with dg.instance_for_test() as instance:
        built(instance, loaded)
        rollout_records(instance, cv, deployed_by_rollout(cv, fleet))
        seed_data["nodes"][1]["overrides"] = {"max_model_len": 131072}
        path2 = write(tmp_path, seed_data)
        reloaded, fleet2 = build_definitions(path2), load_fleet(path2)
        assert code_versions(fleet2) == cv  # no code version moved

        res = store(tick(reloaded, instance), instance)
        [req] = res.run_requests
        assert req.job_name == steps.ROLLOUT_JOB and req.tags[steps.NODES_TAG] == "spark2"
        # The sensor observed spark2's new launch only.
        assert [(e.asset_key.to_user_string(), e.partition) for e in res.asset_events] == [(steps.NODE_LAUNCH, "spark2")]
        status, causes = stale_status(instance, reloaded, steps.NODE_DEPLOYMENT)
        assert status == {"spark1": StaleStatus.FRESH, "spark2": StaleStatus.STALE}, causes
        assert causes["spark2"] == ["has a new dependency data version"]
        bench, _ = stale_status(instance, reloaded, steps.BENCH_RESULTS)
        assert set(bench.values()) == {StaleStatus.FRESH}  # nothing was redeployed yet

        # The rollout deploys spark2 (spark1 already serves its launch: left as it is, not recorded).
        launch2 = launch_versions(fleet2)
        rollout_records(instance, cv, lambda context, node: records.record_deploy(
            context, node, cv[steps.NODE_DEPLOYMENT], "sig-spark2-new", {}, launch=launch2[node]), nodes=("spark2",))
        after = store(tick(reloaded, instance), instance)
        assert not after.run_requests and not after.asset_events
        status, causes = stale_status(instance, reloaded, steps.NODE_DEPLOYMENT)
        assert set(status.values()) == {StaleStatus.FRESH}, causes
        assert records.recorded_launch(instance, "spark2") == launch2["spark2"] != launch_versions(fleet)["spark2"]
        assert records.recorded_launch(instance, "spark1") == launch2["spark1"] == launch_versions(fleet)["spark1"]


def test_a_deploy_points_at_its_own_launch_not_the_newest_observation(tmp_path, seed_data):
    """node_deployment's own output (records.launch_input_tags). A node's first deploy, before
    anything observed node_launch, observes its launch itself: the sensor's first tick then marks
    nothing stale (Dagster's own pointer would be NULL there, and such a deploy never goes stale).
    A deploy run after the fleet file was reloaded but before the sensor observed the new launch
    points at the launch it ran (Dagster's pointer, the newest observation before the step, would
    name the old one: stale as soon as the new one is observed)."""

    def deployment_of(path):
        nd = build_definitions(path).get_repository_def().asset_graph.get(dg.AssetKey(steps.NODE_DEPLOYMENT))
        launch = launch_versions(load_fleet(path))

        @dg.asset(name=steps.NODE_DEPLOYMENT, code_version=nd.code_version, partitions_def=nd.partitions_def,
                  deps=[steps.NODE_ARTIFACTS, steps.NODE_LAUNCH])
        def node_deployment(context: dg.AssetExecutionContext):
            node = context.partition_key
            return dg.Output(None, data_version=dg.DataVersion(f"sig-{node}"),
                             tags=records.launch_input_tags(context, node, launch[node]))

        return node_deployment

    path = write(tmp_path, seed_data)
    loaded = build_definitions(path)
    with dg.instance_for_test() as instance:
        built(instance, loaded)
        for node in NODES:
            assert dg.materialize([deployment_of(path)], instance=instance, partition_key=node).success
        tags = records.latest(instance, steps.NODE_DEPLOYMENT, "spark1").asset_materialization.tags
        assert tags["dagster/input_data_version/node_launch"] == launch_versions(load_fleet(path))["spark1"]
        assert tags["dagster/input_event_pointer/node_launch"].isdigit()
        first = store(tick(loaded, instance), instance)
        assert not first.run_requests and not first.asset_events
        status, causes = stale_status(instance, loaded, steps.NODE_DEPLOYMENT)
        assert set(status.values()) == {StaleStatus.FRESH}, causes

        seed_data["nodes"][1]["overrides"] = {"max_model_len": 131072}
        path2 = write(tmp_path, seed_data, "reloaded.yaml")
        reloaded = build_definitions(path2)
        # deploy_node_job for spark2 right after the reload, before any sensor tick.
        assert dg.materialize([deployment_of(path2)], instance=instance, partition_key="spark2").success
        assert records.recorded_launch(instance, "spark2") == launch_versions(load_fleet(path2))["spark2"]
        after = store(tick(reloaded, instance), instance)
        assert not after.run_requests and not after.asset_events
        status, causes = stale_status(instance, reloaded, steps.NODE_DEPLOYMENT)
        assert set(status.values()) == {StaleStatus.FRESH}, causes


def test_a_deployment_that_names_no_launch_is_asked_for_again(tmp_path, seed_data):
    """A deployment recorded without provenance (what the rollout logged once; or before node_launch
    existed) names no launch: the sensor asks a rollout for it, which records a node that serves
    its launch already without redeploying it (state/records.py record_as_serving)."""
    path = write(tmp_path, seed_data)
    loaded = build_definitions(path)
    cv = code_versions(load_fleet(path))
    with dg.instance_for_test() as instance:
        built(instance, loaded)
        rollout_records(instance, cv, lambda context, node: context.log_event(
            dg.AssetMaterialization(steps.NODE_DEPLOYMENT, partition=node, metadata={"image_id": "sha256:feed"})))
        [req] = tick(loaded, instance).run_requests
        assert req.job_name == steps.ROLLOUT_JOB and req.tags[steps.NODES_TAG] == "spark1,spark2"


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


def test_the_rollout_records_a_node_that_serves_its_launch_already(tmp_path, seed_data):
    """A node the rollout leaves as it is (it serves the new image, launch and checkpoint, healthy)
    but whose record names another launch or none (recorded before node_launch existed) is
    recorded current, without a deploy: it neither stays stale for ever nor makes the sensor ask
    again. A node whose record is current is not recorded again."""
    from spark_pipelines.core.artifacts import BuiltImage, Checkpoint
    from spark_pipelines.state.markers import deploy_signature
    from spark_pipelines.runbook.rollout import ALREADY_SERVES, Survey

    path = write(tmp_path, seed_data)
    loaded = build_definitions(path)
    fleet = load_fleet(path)
    cv = code_versions(fleet)
    launch = launch_versions(fleet)
    nd = steps.NODE_DEPLOYMENT
    with dg.instance_for_test() as instance:
        built(instance, loaded)
        rollout_records(instance, cv, lambda context, node: records.record_deploy(
            context, node, cv[nd], f"sig-{node}", {}, launch=launch[node]), nodes=("spark2",))
        rollout_records(instance, cv, lambda context, node: context.log_event(dg.AssetMaterialization(
            nd, partition=node, metadata={"image_id": "sha256:feed", "kv_cache_tokens": 268224})), nodes=("spark1",))
        spark2_before = records.latest(instance, nd, "spark2").storage_id
        assert tick(loaded, instance).run_requests[0].tags[steps.NODES_TAG] == "spark1"

        image = BuiltImage(node="spark1", ref="vllm-qwen35-v2", image_id="sha256:" + "b" * 64)
        mtp = Checkpoint(node="spark1", path="/models/x", index="idx-1", manifest="m" * 64)
        survey = Survey(new={n: "image bbbbbbbbbbbb, spec x, checkpoint y" for n in NODES},
                        before={n: "image bbbbbbbbbbbb, spec x, checkpoint y" for n in NODES}, running={},
                        rotation=list(NODES), skip={n: ALREADY_SERVES for n in NODES})

        @dg.asset(name=steps.FLEET_ROLLOUT)
        def fleet_rollout(context: dg.AssetExecutionContext) -> None:
            done = records.record_as_serving(context, fleet, survey.already_serving, survey.new, cv[nd],
                                             image.image_id, mtp.index, context.run.run_id)
            assert done == ["spark1"]

        assert dg.materialize([fleet_rollout], instance=instance).success
        rec = records.latest(instance, nd, "spark1")
        assert records.recorded_code_version(instance, nd, "spark1") == cv[nd]
        assert records.recorded_launch(instance, "spark1") == launch["spark1"]
        assert records.data_version_of(rec) == deploy_signature(cv[nd], launch["spark1"], image.image_id, mtp.index)
        meta = records.values(rec.asset_materialization)
        assert meta["skipped"] is True and meta["image_id"] == image.image_id
        assert meta["kv_cache_tokens"] == 268224 and meta.keys() >= {"rollout_run", "container"}  # carried
        assert records.latest(instance, nd, "spark2").storage_id == spark2_before  # current: not recorded again
        assert not tick(loaded, instance).run_requests
        status, causes = stale_status(instance, loaded, nd)
        assert set(status.values()) == {StaleStatus.FRESH}, causes
