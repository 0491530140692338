"""fleet_summary on a real Dagster instance: it reads what the steps recorded (materializations,
a health sweep's observation, a bench's drain/restore observation on gateway), and its sensor
requests it once per new observation."""

import dagster as dg
import pytest

from spark_pipelines.assets.fleet_summary import fleet_summary_definitions
from spark_pipelines.core.fleet import load_fleet


@pytest.fixture
def instance(tmp_path):
    with dg.instance_for_test(temp_dir=str(tmp_path)) as inst:
        yield inst


@pytest.fixture(scope="module")
def defs():
    return fleet_summary_definitions(load_fleet("fleets/seed.yaml"))


def record(instance, event):
    instance.report_runless_asset_event(event)


def seed(instance):
    for node in ("spark1", "spark2"):
        record(instance, dg.AssetMaterialization("node_artifacts", partition=node,
                                                 metadata={"image_id": "sha256:aaaabbbbccccdddd", "checkpoint": "1234567890ab"}))
        record(instance, dg.AssetMaterialization("node_deployment", partition=node,
                                                 metadata={"image_id": "sha256:aaaabbbbccccdddd", "container_id": f"{node}c0ffee00"}))
    record(instance, dg.AssetMaterialization("bench_results", partition="spark1",
                                             metadata={"mean_tok_s": 51.64, "promoted": True,
                                                       "spec_acceptance_rate": 0.9465, "quality_score": 100.0,
                                                       "quality_checks": "all passed"}))
    record(instance, dg.AssetMaterialization("bench_results", partition="spark2",
                                             metadata={"mean_tok_s": 30.2, "promoted": False,
                                                       "gate": "bench 30.2 tok/s < floor 45"}))
    record(instance, dg.AssetMaterialization("gateway", metadata={"rotation": "spark1, spark2"}))
    # spark2's bench kept it out after the gateway's own write: the observation is newer.
    record(instance, dg.AssetObservation("gateway", metadata={
        "event": "keep out spark2", "rotation": "spark1",
        "left_out_by_node": dg.MetadataValue.json({"spark2": "bench 30.2 tok/s < floor 45"})}))


def summary_rows(instance, defs):
    (asset,) = defs.assets
    res = dg.materialize([asset], instance=instance)
    assert res.success
    (mat,) = [e.materialization for e in res.get_asset_materialization_events()]
    narrow, detail = mat.metadata["nodes"], mat.metadata["detail"]
    assert isinstance(narrow, dg.TableMetadataValue) and isinstance(detail, dg.TableMetadataValue)
    assert len(narrow.schema.columns) <= 5  # the first table fits the asset pane
    rows = {r.data["node"]: dict(r.data) for r in narrow.records}
    for name in ("detail", "bench", "versions", "when"):
        for r in mat.metadata[name].records:
            rows[r.data["node"]].update(r.data)
    return rows, mat.metadata


def test_summary_rows_come_from_the_latest_records(instance, defs):
    seed(instance)
    record(instance, dg.AssetObservation("node_deployment", partition="spark1", metadata={
        "verdict": "healthy", "evidence": "/health 200", "advice": "none", "in_gateway": True, "quarantined": False}))
    rows, meta = summary_rows(instance, defs)
    s1, s2 = rows["spark1"], rows["spark2"]
    assert s1["health"] == "healthy" and s1["gateway"] == "in" and s1["mean tok/s"] == 51.6
    assert s1["MTP acceptance (%)"] == 94.7 and s1["image id"] == "aaaabbbbcccc" and s1["checkpoint"] == "1234567890ab"
    assert s1["floor tok/s"] is not None and s1["vs reference"].endswith("x")
    # the quality figures in the detail table only (the narrow one stays at five columns)
    assert s1["quality (/100)"] == 100.0 and "Quality checks failed" not in s1["why"]
    assert "quality (/100)" not in [c.name for c in meta["nodes"].schema.columns]
    assert s2["quality (/100)"] is None
    assert s2["health"] == "healthy (deploy)"  # no sweep for spark2: its deploy's own check
    assert s2["gateway"] == "out (bench)" and s2["why"].startswith("out of the gateway: bench 30.2 tok/s < floor 45. ")
    assert meta["nodes_in_gateway"].value == 1 and meta["nodes_total"].value == 2
    assert meta["headline"].value.startswith("1 of 2 node(s) in the gateway")


def test_refresh_sensor_requests_once_per_new_observation(instance, defs):
    sensor = next(s for s in defs.sensors if s.name == "fleet_summary_refresh")

    def tick(cursor):
        with dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs) as ctx:
            return sensor(ctx)

    empty = tick(None)
    assert not empty.run_requests and "no new" in empty.skip_reason.skip_message
    seed(instance)  # materializations are declarative automation's job; one gateway observation here
    first = tick(None)
    # Issue 35, item 13: recorded by the sensor itself, no run (a sweep each minute made ~60 runs an hour).
    assert not first.run_requests
    (made,) = first.asset_events
    assert made.asset_key == dg.AssetKey("fleet_summary") and {"nodes", "detail", "bench"} <= set(made.metadata)
    again = tick(first.cursor)
    assert not again.run_requests and not again.asset_events
    record(instance, dg.AssetObservation("node_deployment", partition="spark2",
                                         metadata={"verdict": "wedged", "quarantined": True}))
    later = tick(again.cursor or first.cursor)
    assert len(later.asset_events) == 1 and not later.run_requests and int(later.cursor) > int(first.cursor)


def test_a_quarantine_keeps_the_sweeps_verdict_and_shows_the_node_out(instance, defs):
    """A quarantine records no verdict of its own: the health column keeps the newest sweep's; the
    quarantine job's gateway observation makes the gateway column say why the node is out."""
    seed(instance)
    record(instance, dg.AssetObservation("node_deployment", partition="spark1", metadata={
        "verdict": "residue", "evidence": "free 96.5 GiB", "advice": "reboot the node", "quarantined": ""}))
    record(instance, dg.AssetObservation("node_deployment", partition="spark1", metadata={
        "quarantined": "residue: relaunching cannot help", "policy": "quarantined; drained"}))
    record(instance, dg.AssetObservation("gateway", metadata={
        "event": "quarantine spark1", "rotation": "",
        "left_out_by_node": dg.MetadataValue.json({"spark1": "quarantined: residue"})}))
    rows, _ = summary_rows(instance, defs)
    assert rows["spark1"]["health"] == "residue"
    assert rows["spark1"]["gateway"].startswith("out") and "quarantined" in rows["spark1"]["gateway"]


def test_refresh_sensor_requests_nothing_when_the_summary_is_already_newer(instance, defs):
    """Issue 23, item 10: opening the UI after a demo must not launch a summary the demo made last."""
    sensor = next(s for s in defs.sensors if s.name == "fleet_summary_refresh")
    seed(instance)
    summary_rows(instance, defs)  # made after every observation, as the demo's last run does
    with dg.build_sensor_context(instance=instance, cursor=None, definitions=defs) as ctx:
        result = sensor(ctx)
    assert not result.run_requests and "newer than the last observation" in result.skip_reason.skip_message
    record(instance, dg.AssetObservation("node_deployment", partition="spark2", metadata={"verdict": "wedged"}))
    with dg.build_sensor_context(instance=instance, cursor=result.cursor, definitions=defs) as ctx:
        (made,) = sensor(ctx).asset_events  # a newer observation: one refresh


def test_refresh_sensor_waits_for_a_summary_run_already_on_its_way(instance, defs):
    """Both sensors saw one change (a bench: a materialization and a drain observation): one run."""
    sensor = next(s for s in defs.sensors if s.name == "fleet_summary_refresh")
    seed(instance)
    (asset,) = defs.assets
    # A run created and not started yet (NOT_STARTED), as a sensor's request is before it launches.
    instance.create_run_for_job(dg.Definitions(assets=[asset]).get_implicit_global_asset_job_def(),
                                asset_selection=frozenset({dg.AssetKey("fleet_summary")}))
    with dg.build_sensor_context(instance=instance, cursor=None, definitions=defs) as ctx:
        result = sensor(ctx)
    assert not result.run_requests and "already on its way" in result.skip_reason.skip_message


def test_automation_launches_nothing_when_the_summary_was_made_after_the_change(instance, defs):
    """Issue 23, item 10: the demo's last run is the summary; the UI's daemon must not make it again."""
    first = dg.evaluate_automation_conditions(defs=defs, instance=instance)
    record(instance, dg.AssetMaterialization("bench_results", partition="spark1", metadata={"mean_tok_s": 51.6}))
    record(instance, dg.AssetMaterialization("fleet_summary"))  # the demo's fleet_summary_job, after the bench
    after_demo = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=first.cursor)
    assert after_demo.total_requested == 0
    record(instance, dg.AssetMaterialization("bench_results", partition="spark2", metadata={"mean_tok_s": 51.2}))
    later = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=after_demo.cursor)
    assert later.total_requested == 1  # a change the summary has not seen: one refresh
