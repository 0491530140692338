"""What the Dagster UI shows an operator: the fleet summary rows, the bench chart's axes, rounded
typed metadata, per-node checks, and a description on every definition."""

from __future__ import annotations

import datetime as dt
import io

import dagster as dg
import pytest

from spark_pipelines.assets.metadata import bench_rows, bench_table, num, readable, table
from spark_pipelines.assets.bench_chart import render_fleet_history_png, x_range, y_range
from spark_pipelines.core import bench as bench_core
from spark_pipelines.core import summary

# -- fleet summary rows (pure) --


def _facts(**kw) -> summary.NodeFacts:
    base = dict(
        node="spark1",
        deployment={"image_id": "sha256:0123456789abcdef0123", "container_id": "c0ffee000000"},
        deployed_at=dt.datetime(2026, 12, 3, 9, 30, tzinfo=dt.timezone.utc).timestamp(),
        artifacts={"image_id": "sha256:0123456789abcdef0123", "checkpoint": "9f8e7d6c5b4a3210"},
        bench={"mean_tok_s": 51.60761915408371, "promoted": True, "spec_acceptance_rate": 0.9465020576131687},
        benched_at=dt.datetime(2026, 12, 3, 10, 0, tzinfo=dt.timezone.utc).timestamp(),
        health={"verdict": "healthy", "evidence": "/health 200 in 0.01 s", "advice": "none",
                "in_gateway": True, "quarantined": False},
        health_at=dt.datetime(2026, 12, 3, 9, 40, tzinfo=dt.timezone.utc).timestamp(),
        floor_tok_s=45.0,
        reference_tok_s=51.6,
    )
    base.update(kw)
    return summary.NodeFacts(**base)


def test_summary_row_reads_rounded_with_units():
    row = summary.summary_row(_facts(), summary.Rotation(nodes=["spark1"], known=True))
    tables = (summary.COLUMNS, summary.DETAIL_COLUMNS, summary.BENCH_COLUMNS, summary.VERSION_COLUMNS,
              summary.WHEN_COLUMNS)
    assert {c[0] for t in tables for c in t} <= set(row)
    assert len(summary.COLUMNS) <= 5  # the first table fits the asset pane (issue 23, item 8)
    assert row["health"] == "healthy" and row["evidence"] == "/health 200 in 0.01 s -> none"
    assert row["why"] == "Health: /health 200 in 0.01 s -> none"
    assert row["gateway"] == "in"
    assert row["image id"] == "0123456789ab" and row["checkpoint"] == "9f8e7d6c5b4a"
    assert row["mean tok/s"] == 51.6 and row["vs reference"] == "1.00x" and row["floor tok/s"] == 45.0
    assert row["MTP acceptance (%)"] == 94.7
    assert row["last bench (UTC)"] == "2026-12-03 10:00" and row["last deploy (UTC)"] == "2026-12-03 09:30"


def test_summary_row_says_why_a_node_is_out():
    gate = "bench 30.1 tok/s < floor 45"
    benched_out = _facts(node="spark2", bench={"mean_tok_s": 30.1, "promoted": False, "gate": gate})
    # The gateway's own reason wins; else the bench gate; else the health sweep's quarantine.
    # Issue 35, item 11: a short state in the narrow table (a long reason pushed tok/s off-screen),
    # the reason whole in the detail table.
    rot = summary.Rotation(nodes=["spark1"], left_out={"spark2": "vLLM /health does not answer"}, known=True)
    row = summary.summary_row(benched_out, rot)
    assert row["gateway"] == "out (down)" and row["why"].startswith("out of the gateway: vLLM /health does not answer. ")
    rot = summary.Rotation(nodes=["spark1"], known=True)
    row = summary.summary_row(benched_out, rot)
    assert row["gateway"] == "out (bench)" and row["why"].startswith(f"out of the gateway: {gate}. Health: ")
    quarantined = _facts(node="spark2", health={"verdict": "wedged", "quarantined": True})
    row = summary.summary_row(quarantined, rot)
    assert row["gateway"] == "out (quarantined)" and "quarantined by the health sweep" in row["why"]
    held = summary.Rotation(nodes=["spark1"], known=True, left_out={
        "spark2": "quarantined: manual: quarantined by an operator (since 2026-12-07T10:00:00Z, by run 1a2b3c4d)"})
    assert summary.summary_row(_facts(node="spark2"), held)["gateway"] == "out (quarantined)"
    drained = summary.Rotation(nodes=["spark1"], known=True, left_out={"spark2": "drained for its bench"})
    assert summary.summary_row(_facts(node="spark2"), drained)["gateway"] == "out (bench)"
    rows = summary.summary_rows([_facts(), benched_out], rot)
    assert summary.headline(rows) == "1 of 2 node(s) in the gateway; out: spark2 (bench)"
    assert all(len(r["gateway"]) <= len("out (quarantined)") for r in rows)


def test_a_failed_bench_run_shows_in_the_summary():
    """Issue 35, item 5: a bench that failed (no key: 3 minutes, then a stack trace) left no sign there."""
    at = dt.datetime(2026, 12, 3, 11, 0, tzinfo=dt.timezone.utc).timestamp()
    row = summary.summary_row(_facts(bench_failed_at=at, bench_failure="spark2 not drained, nothing was changed: "
                                     "LiteLLM on gw: /model/info answered HTTP 500; no key was sent"),
                              summary.Rotation(nodes=["spark1"], known=True))
    assert row["last bench (UTC)"] == "2026-12-03 10:00 (FAILED 2026-12-03 11:00)"
    assert "Last bench run FAILED 2026-12-03 11:00: spark2 not drained, nothing was changed" in row["why"]


def test_a_deploy_newer_than_the_last_sweep_shows_the_deploys_own_health():
    """Issue 23, item 8: after a demo the health column read "-" (no sweep yet) though each deploy
    had verified /health, readiness and a smoke answer."""
    never_swept = _facts(health=None, health_at=None)
    assert summary.summary_row(never_swept, summary.Rotation())["health"] == summary.HEALTHY_AT_DEPLOY
    swept_after = _facts(health={"verdict": "engine-down"}, health_at=never_swept.deployed_at + 60)
    assert summary.summary_row(swept_after, summary.Rotation())["health"] == "engine-down"
    swept_before = _facts(health={"verdict": "engine-down"}, health_at=never_swept.deployed_at - 60)
    assert summary.summary_row(swept_before, summary.Rotation())["health"] == summary.HEALTHY_AT_DEPLOY


def test_summary_row_of_a_node_never_seen_is_dashes():
    assert summary.summary_row(_facts(health=None), summary.Rotation())["why"] == (
        "Health: no sweep recorded (node_health off); its deploy verified it")
    row = summary.summary_row(summary.NodeFacts(node="spark9"), summary.Rotation())
    assert row["health"] == row["gateway"] == row["image id"] == row["last deploy (UTC)"] == "-"
    assert row["mean tok/s"] is None and row["MTP acceptance (%)"] is None


# -- chart --


def test_chart_axis_is_dated_and_a_lone_point_is_not_years_wide():
    t = dt.datetime(2026, 12, 3, 4, 30, tzinfo=dt.timezone.utc)
    lo, hi = x_range([t])
    assert lo < t < hi and dt.timedelta(minutes=30) <= hi - lo <= dt.timedelta(hours=1)
    # Issue 23, item 12: two benches two minutes apart got a 14-hour axis.
    lo, hi = x_range([t, t + dt.timedelta(minutes=2)])
    assert hi - lo <= dt.timedelta(hours=1)
    lo, hi = x_range([t, t + dt.timedelta(days=30)])
    assert lo < t and hi > t + dt.timedelta(days=30) and hi - lo < dt.timedelta(days=34)


def test_chart_y_axis_starts_at_zero_so_a_small_wobble_is_flat():
    lo, hi = y_range([51.60, 51.61], [51.6, 45.0])
    assert lo == 0.0 and hi == pytest.approx(51.61 * 1.15)
    assert (51.61 - 51.60) / (hi - lo) < 0.001  # a 0.01 tok/s difference is a hair, not a drop
    assert y_range([], []) == (0.0, 1.0)


def test_fleet_chart_draws_one_series_per_node_with_floor_and_reference(monkeypatch):
    import matplotlib.axes

    drawn: dict[str, list] = {"plot": [], "axhline": []}
    real_plot, real_hline = matplotlib.axes.Axes.plot, matplotlib.axes.Axes.axhline

    def plot(self, *a, **kw):
        drawn["plot"].append(kw.get("label"))
        return real_plot(self, *a, **kw)

    def axhline(self, *a, **kw):
        drawn["axhline"].append(kw.get("label"))
        return real_hline(self, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", plot)
    monkeypatch.setattr(matplotlib.axes.Axes, "axhline", axhline)
    t0 = dt.datetime(2026, 12, 1, 4, 30, tzinfo=dt.timezone.utc)
    png = render_fleet_history_png(
        {"spark1": [(t0, 51.6), (t0 + dt.timedelta(days=1), 51.61)], "spark2": [(t0, 50.9)]},
        floors={"spark1": 45.0, "spark2": 40.0}, reference=51.6)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn["plot"] == ["spark1 mean tok/s", "spark2 mean tok/s"]
    assert drawn["axhline"] == ["spark1 floor 45 tok/s", "spark2 floor 40 tok/s", "reference 51.6 tok/s"]
    import matplotlib.image as mpimg

    assert mpimg.imread(io.BytesIO(png), format="png").shape[1] > 400


def test_chart_ticks_carry_the_year():
    from spark_pipelines.assets import bench_chart

    assert "%Y" in bench_chart.DATE_FORMAT


# -- metadata formatting --


def _report() -> bench_core.BenchReport:
    plan = bench_core.plan_suite("all", concurrency=2, repeats=2)
    samples = []
    t = 0.0
    for repeat in range(plan.repeats):
        for phase, prompts, _ in plan.phases:
            for p in prompts:
                samples.append(bench_core.RequestSample(phase, p.name, repeat, p.max_tokens, started=t,
                                                        finished=t + 3.0, chunk_times=(t + 0.1, t + 2.9),
                                                        completion_tokens=155))
                t += 3.0
    return bench_core.build_report(samples, plan, base_url="http://n:8000/v1", model="m", suite="all",
                                   concurrency=2, reference_mean_tok_s=51.6)


def test_bench_rows_are_rounded_and_carry_units_in_their_columns():
    rows = bench_rows(_report())
    recipe = [r for r in rows if r["phase"] == bench_core.PHASE_RECIPE]
    assert len(recipe) == len(bench_core.RECIPE_PROMPTS) + 1 and recipe[-1]["prompt"] == "mean"
    assert recipe[0]["tok/s"] == round(155 / 3.0, 1) and recipe[0]["TTFT ms"] == 100.0
    loaded = [r for r in rows if r["phase"] == bench_core.PHASE_LOADED]
    assert loaded and loaded[0]["prompt"] == "2 requests, 2 at once"
    tables = bench_table(_report())
    assert set(tables) == {"table", "latency"} and all(isinstance(v, dg.TableMetadataValue) for v in tables.values())
    # Issue 35, item 12: tables whole in the asset pane (ten columns were cut at the right edge).
    assert [c.name for c in tables["table"].schema.columns] == ["prompt", "tok/s", "reference tok/s", "vs reference"]
    assert [c.name for c in tables["latency"].schema.columns] == ["prompt", "measured", "TTFT ms", "TPOT ms", "failures"]
    assert [r.data["prompt"] for r in tables["latency"].records] == [
        r["prompt"] for r in rows if r["prompt"] != "mean"]
    # Every number in the table is short: no 15-digit floats.
    for value in tables.values():
        for rec in value.records:
            for v in rec.data.values():
                if isinstance(v, float):
                    assert len(repr(v).split(".")[1]) <= 2


def test_num_and_readable_round_floats_and_keep_keys():
    assert num(51.60761915408371).value == 51.61
    assert num(None).value is None
    meta = readable({"startup_seconds": 431.123456, "kv_cache_tokens": 268224, "skipped": False})
    assert meta["startup_seconds"].value == 431.12 and meta["kv_cache_tokens"] == 268224
    t = table((("a", "number", "x"),), [{"a": 0.123456}])
    assert t.records[0].data == {"a": 0.12}


# -- definitions as the UI lists them --


@pytest.fixture(scope="module")
def repo():
    from spark_pipelines.definitions import build_definitions

    return build_definitions("fleets/seed.yaml").get_repository_def()


def test_every_definition_is_described(repo):
    missing = []
    for key in repo.asset_graph.get_all_asset_keys():
        node = repo.asset_graph.get(key)
        if not (node.description or "").strip():
            missing.append(f"asset {key.to_user_string()}")
    for checks in repo.asset_graph.asset_check_keys:
        spec = repo.asset_graph.get_check_spec(checks)
        if not (spec.description or "").strip():
            missing.append(f"check {checks.to_user_string()}")
    for job in repo.get_all_jobs():
        if not job.name.startswith("__") and not (job.description or "").strip():
            missing.append(f"job {job.name}")
    missing += [f"schedule {s.name}" for s in repo.schedule_defs if not (s.description or "").strip()]
    missing += [f"sensor {s.name}" for s in repo.sensor_defs if not (s.description or "").strip()]
    assert not missing, missing


def test_node_checks_are_per_node_and_the_gate_blocks(repo):
    for asset, check in (("node_artifacts", "same_image_as_build_host"), ("node_deployment", "serving"),
                         ("bench_results", "above_floor")):
        spec = repo.asset_graph.get_check_spec(dg.AssetCheckKey(dg.AssetKey(asset), check))
        assert spec.blocking, check
        assert spec.partitions_def is not None and spec.partitions_def.get_partition_keys() == ["spark1", "spark2"]
    gate = repo.asset_graph.get_check_spec(dg.AssetCheckKey(dg.AssetKey("bench_results"), "above_floor"))
    assert "promotion gate" in gate.description


def test_catalog_groups_read_in_pipeline_order(repo):
    order = ["base_model", "hybrid_checkpoint", "mtp_weights", "base_image", "serving_image", "node_artifacts",
             "node_deployment", "gateway", "bench_results"]
    groups = [repo.asset_graph.get(dg.AssetKey(k)).group_name for k in order]
    assert groups == sorted(groups)
    assert repo.asset_graph.get(dg.AssetKey("fleet_summary")).group_name < groups[0]  # opened first


def test_pins_changed_shows_its_target_jobs(repo):
    sensor = repo.get_sensor_def("pins_changed")
    assert {t.job_name for t in sensor.targets} == {"build_job", "rollout_job"}


def test_ab_experiment_launches_with_a_node_by_default(repo):
    job = repo.get_job("ab_experiment_job")
    assert "spark1" in job.description and "spark2" in job.description
    from spark_pipelines.assets.experiments import ABConfig

    assert ABConfig().node is None  # the op takes the first serve node


def test_ratios_read_with_two_decimals_and_recorded_json_is_rounded():
    """Issue 23, item 12: "1" read as "1.00x"; bench_record's 0.9465020576131687 as 0.9465."""
    from spark_pipelines.assets.metadata import rounded_json

    assert summary.ratio(1.0) == "1.00x" and summary.ratio(0.9876) == "0.99x" and summary.ratio(None) == "-"
    rec = {"acceptance": 0.9465020576131687, "runs": [{"tok_s": 51.60761915408371}], "node": "spark1", "n": 3}
    assert rounded_json(rec) == {"acceptance": 0.9465, "runs": [{"tok_s": 51.6076}], "node": "spark1", "n": 3}


def test_each_nodes_points_have_their_own_marker_and_later_ones_are_hollow():
    from spark_pipelines.assets.bench_chart import marker_style

    styles = [marker_style(i) for i in range(4)]
    assert len({st["marker"] for st in styles}) == 4
    assert "markerfacecolor" not in styles[0] and all(st["markerfacecolor"] == "none" for st in styles[1:])
    assert styles[1]["markersize"] > styles[0]["markersize"]  # drawn around an equal point, not under it


def test_the_trend_column_is_the_chart_at_a_glance():
    """Issue 23, item 12: the history chart sits behind "Show Markdown"; the tables show a sparkline
    inline, scaled from 0 like the chart (a wobble is flat, a wedge's third of the speed reads low)."""
    assert summary.trend([51.6, 51.7, 51.6]) == "███"
    assert summary.trend([52.0, 52.0, 17.3]) == "██▃"
    assert summary.trend([]) == "-" and len(summary.trend([50.0] * 40)) == summary.TREND_POINTS
    row = summary.summary_row(_facts(bench_means=[51.0, 34.0, 51.6]), summary.Rotation())
    assert row["trend"] == "█▆█"
