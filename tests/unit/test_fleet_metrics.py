"""core/fleet_metrics.py: recorded facts -> metric samples; core/scrape_config.py: fleet file ->
file_sd targets and a prometheus.yml that promtool accepts; the exporter's collector over a real
(temporary) Dagster instance."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import dagster as dg
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from spark_pipelines.core import fleet_metrics as fm
from spark_pipelines.core import scrape_config, steps, summary
from spark_pipelines.core.fleet import SEED_FLEET, load_fleet
from spark_pipelines.cli.metrics import registry_for, write_scrape_config
from spark_pipelines.state import records
from tests.plugins import unavailable

NOW = 1_800_000_000.0


def samples(fams, name):
    return {tuple(sorted(s.labels.items())): s.value for f in fams if f.name == name for s in f.samples}


def one(fams, name, **labels):
    return samples(fams, name).get(tuple(sorted(labels.items())))


def facts(nodes, rotation=summary.Rotation(), extra=None, **kw):
    return fm.FleetFacts(nodes=nodes, rotation=rotation, min_in_rotation=1, restart_budget=3, extra=extra or {},
                         now=NOW, **kw)


def test_a_quarantined_crash_loop_node_is_out_with_a_bounded_reason():
    f = summary.NodeFacts("spark2", health={"verdict": "crash-loop", "in_gateway": False,
                                            "quarantined": "crash-loop: 3 restarts (since ..., by health)"},
                          health_at=NOW - 30)
    ok = summary.NodeFacts("spark1", health={"verdict": "healthy", "in_gateway": True, "quarantined": ""},
                           health_at=NOW - 30)
    fams = fm.families(facts([ok, f]))
    assert one(fams, "spark_node_verdict", node="spark2", verdict="crash-loop") == 1
    assert one(fams, "spark_node_verdict", node="spark2", verdict="healthy") == 0
    assert one(fams, "spark_node_in_rotation", node="spark2") == 0
    assert one(fams, "spark_node_out_of_rotation", node="spark2", reason="quarantined") == 1
    assert {dict(k)["reason"] for k in samples(fams, "spark_node_out_of_rotation")} == set(fm.REASONS)
    assert one(fams, "spark_node_quarantined", node="spark2") == 1 and one(fams, "spark_node_quarantined", node="spark1") == 0
    assert one(fams, "spark_fleet_rotation_size") == 1 and one(fams, "spark_fleet_min_in_rotation") == 1
    assert one(fams, "spark_fleet_last_sweep_timestamp_seconds") == NOW - 30


def test_a_newer_gateway_event_decides_rotation_and_its_drain_note_the_reason():
    f = summary.NodeFacts("spark2", health={"verdict": "healthy", "in_gateway": True}, health_at=NOW - 60)
    rot = summary.Rotation(nodes=["spark1"], left_out={"spark2": "drained: bench of spark2"}, known=True, at=NOW - 5)
    fams = fm.families(facts([f], rot))
    assert one(fams, "spark_node_in_rotation", node="spark2") == 0
    assert one(fams, "spark_node_out_of_rotation", node="spark2", reason="drained") == 1
    older = summary.Rotation(nodes=["spark1"], known=True, at=NOW - 120)  # the sweep read the gateway since
    assert one(fm.families(facts([f], older)), "spark_node_in_rotation", node="spark2") == 1


def test_bench_figures_budget_and_good_bench_age():
    f = summary.NodeFacts("spark1", bench={"mean_tok_s": 41.0, "spec_acceptance_rate": 0.82, "promoted": False,
                                           "floor_tok_s": 45.0, "bench_record": {
                                               "node": "spark1", "conditions": {"sm_clock_mhz_p50": 2418.0,
                                                                                "power_w_p50": 38.5}}},
                          bench_means=[52.0, 51.0, 53.0, 41.0], floor_tok_s=45.0,
                          deployment={"free_gib_at_preflight": 117.1}, deployed_at=NOW - 500)
    extra = {"spark1": fm.NodeExtra(redeploys_in_window=3, last_good_bench_at=NOW - 3600, clean_boot_free_gib=117.5)}
    fams = fm.families(facts([f], extra=extra))
    assert one(fams, "spark_node_bench_tok_s", node="spark1") == 41.0
    assert one(fams, "spark_node_bench_floor_tok_s", node="spark1") == 45.0
    assert one(fams, "spark_node_bench_baseline_tok_s", node="spark1") == 52.0  # median of the earlier three
    assert one(fams, "spark_node_mtp_acceptance_ratio", node="spark1") == 0.82
    assert one(fams, "spark_node_bench_sm_clock_mhz", node="spark1") == 2418.0
    assert one(fams, "spark_node_bench_power_watts", node="spark1") == 38.5
    assert one(fams, "spark_node_restart_budget_remaining", node="spark1") == 0
    assert one(fams, "spark_node_seconds_since_good_bench", node="spark1") == 3600
    assert one(fams, "spark_node_preflight_free_gib", node="spark1") == 117.1
    assert one(fams, "spark_node_clean_boot_free_gib", node="spark1") == 117.5
    assert one(fams, "spark_node_verdict", node="spark1", verdict="healthy") == 1  # the deploy verified it
    # Not recorded (issue 25's quality phase): no sample, never a 0.
    assert samples(fams, "spark_node_quality_score") == {}
    with_quality = summary.NodeFacts("spark1", bench={"mean_tok_s": 52.0, "quality_score": 0.93})
    assert one(fm.families(facts([with_quality])), "spark_node_quality_score", node="spark1") == 0.93


def test_nothing_recorded_is_no_sample_not_a_zero():
    fams = fm.families(facts([summary.NodeFacts("spark1")]))
    for name in ("spark_node_verdict", "spark_node_in_rotation", "spark_node_bench_tok_s",
                 "spark_node_restart_budget_remaining", "spark_fleet_last_sweep_timestamp_seconds",
                 "spark_fleet_rotation_size"):  # not 0: SparkRotationAtFloor must not fire on an empty instance
        assert samples(fams, name) == {}, name
    text = fm.exposition(fams)
    assert "# TYPE spark_fleet_rotation_size gauge" in text and "spark_fleet_serve_nodes 1" in text


def test_scrape_targets_follow_the_fleet_file():
    fleet = load_fleet(SEED_FLEET)
    sd = scrape_config.targets(fleet, "10.0.0.5:9464")
    vllm = sd["spark-vllm.json"]
    assert [g["labels"]["node"] for g in vllm] == [n.name for n in fleet.serve_nodes]
    assert vllm[0]["targets"] == [f"{fleet.serve_nodes[0].host}:{fleet.launch_for(fleet.serve_nodes[0]).port}"]
    assert sd["spark-gateway.json"][0]["targets"] == [f"{fleet.gateway.host}:{fleet.gateway.proxy_port}"]
    assert sd["spark-fleet.json"][0]["targets"] == ["10.0.0.5:9464"]


def test_written_scrape_config_passes_promtool(tmp_path):
    fleet = load_fleet(SEED_FLEET)
    written = write_scrape_config(fleet, tmp_path, "127.0.0.1:9464", "127.0.0.1:9093")
    config = yaml.safe_load((tmp_path / "prometheus.yml").read_text())
    assert [j["job_name"] for j in config["scrape_configs"]] == list(scrape_config.SD_FILES)
    assert json.loads((tmp_path / "spark-vllm.json").read_text())[0]["labels"]["node"] == fleet.serve_nodes[0].name
    assert len(written) == 5
    tool = shutil.which("promtool")
    if tool is None:
        unavailable("promtool is not installed (scripts/bootstrap.sh prometheus)")
    out = subprocess.run([tool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_collector_reads_a_real_instance(tmp_path):
    fleet = load_fleet(SEED_FLEET)
    node = fleet.serve_nodes[0].name
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        for in_gateway in (True, False):
            instance.report_runless_asset_event(dg.AssetObservation(
                steps.NODE_DEPLOYMENT, partition=node, metadata={"verdict": "healthy", "in_gateway": in_gateway}))
        first_out = records.latest_health(instance, node)[1]
        time.sleep(0.3)  # the newest out-sweep is 0.3 s later: the figure must count from the first
        instance.report_runless_asset_event(dg.AssetObservation(
            steps.NODE_DEPLOYMENT, partition=node,
            metadata={"verdict": "wedged", "in_gateway": False, "quarantined": "wedged: clocks 702 MHz"}))
        instance.report_runless_asset_event(dg.AssetMaterialization(
            steps.BENCH_RESULTS, partition=node, metadata={"mean_tok_s": 34.0, "promoted": False}))
        # node_os measured this node's clean boot once; a later run that did not measure does not erase it
        for free in (116.9, None):
            instance.report_runless_asset_event(dg.AssetMaterialization(
                steps.NODE_OS, partition=node, metadata={"clean_boot_free_gib": free, "changes": 0}))
        asked_at = time.time()
        text = generate_latest(registry_for(fleet, lambda: instance, cache_s=0)).decode()
        read_at = time.time()
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert got[("spark_node_verdict", (("node", node), ("verdict", "wedged")))] == 1
    assert got[("spark_node_out_of_rotation", (("node", node), ("reason", "quarantined")))] == 1
    assert got[("spark_node_bench_tok_s", (("node", node),))] == 34.0
    assert got[("spark_node_clean_boot_free_gib", (("node", node),))] == 116.9  # measured, not the profile's 117.5
    other = fleet.serve_nodes[1].name
    assert got[("spark_node_clean_boot_free_gib", (("node", other),))] == fleet.profile_of(fleet.serve_nodes[1]).clean_boot_free_gib
    assert got[("spark_node_restart_budget_remaining", (("node", node),))] == 3
    assert got[("spark_exporter_instance_read_ok", ())] == 1
    # Out since the first sweep that found it out (not the newest one), against the fleet's bench_max_s.
    out_s = got[("spark_node_out_of_rotation_seconds", (("node", node),))]
    # Read between asked_at and read_at (however slow a loaded machine is): counted from the first
    # out-sweep, since the newest one is 0.3 s later it would fall below asked_at - first_out.
    assert asked_at - first_out - 0.01 <= out_s <= read_at - first_out + 0.01
    assert got[("spark_fleet_bench_max_seconds", ())] == fleet.health.bench_max_s


def test_an_unreadable_instance_is_a_metric_not_a_crash():
    def broken():
        raise RuntimeError("database is locked")

    text = generate_latest(registry_for(load_fleet(SEED_FLEET), broken, cache_s=0)).decode()
    assert "spark_exporter_instance_read_ok 0.0" in text


def test_the_metrics_command_line(tmp_path, monkeypatch, capsys):
    from spark_pipelines.cli.main import main

    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    seed = str(Path(SEED_FLEET).resolve())
    monkeypatch.chdir(tmp_path)  # no demo instance here
    assert main(["metrics", "show", "--fleet", seed]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"metrics: fleet file {seed} (--fleet)",
                   "metrics: no Dagster instance: set DAGSTER_HOME to the instance the chain records in, or run "
                   "`make demo` here (its instance is .dagster-home)"]
    assert main(["metrics", "scrape-config", "--fleet", seed, "--out", str(tmp_path),
                 "--exporter", "127.0.0.1:19464"]) == 0
    assert json.loads((tmp_path / "spark-fleet.json").read_text())[0]["targets"] == ["127.0.0.1:19464"]
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    assert main(["metrics", "show", "--fleet", seed]) == 0
    captured = capsys.readouterr()
    # An empty instance (a wrong DAGSTER_HOME) holds no fleet: not "read ok", and stderr says why.
    assert "spark_fleet_serve_nodes 2" in captured.out and "spark_exporter_instance_read_ok 0" in captured.out
    assert "holds no record of this fleet's nodes (spark1, spark2)" in captured.err


# -- issue 34, item 8: what the exporter reads ---------------------------------------------------

def read_ok_and_rollout(instance, fleet) -> tuple[float, float | None]:
    text = generate_latest(registry_for(fleet, lambda: instance, cache_s=0)).decode()
    got = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}
    return got["spark_exporter_instance_read_ok"], got.get("spark_fleet_rollout_in_progress")


def test_an_instance_without_this_fleet_is_not_read_ok(tmp_path):
    fleet = load_fleet(SEED_FLEET)
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        assert read_ok_and_rollout(instance, fleet)[0] == 0  # empty: was 1, with no sample to alert on
        instance.report_runless_asset_event(dg.AssetObservation(  # another fleet's node
            steps.NODE_DEPLOYMENT, partition="gpu-box-7", metadata={"verdict": "healthy", "in_gateway": True}))
        assert read_ok_and_rollout(instance, fleet)[0] == 0
        instance.report_runless_asset_event(dg.AssetObservation(  # a sweep of this fleet's spark2
            steps.NODE_DEPLOYMENT, partition="spark2", metadata={"verdict": "healthy", "in_gateway": True}))
        assert read_ok_and_rollout(instance, fleet)[0] == 1


def test_a_rollout_requested_by_job_name_counts_as_in_progress(tmp_path):
    """The pins sensor and the rollout sensor request rollout_job by name: the run carries no asset
    selection (the gauge read 0 during every sensor-launched rollout)."""
    from spark_pipelines.definitions import build_definitions

    fleet = load_fleet(SEED_FLEET)
    job = build_definitions(SEED_FLEET).resolve_job_def(steps.ROLLOUT_JOB)
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        instance.report_runless_asset_event(dg.AssetObservation(
            steps.NODE_DEPLOYMENT, partition="spark1", metadata={"verdict": "healthy", "in_gateway": True}))
        assert read_ok_and_rollout(instance, fleet) == (1, 0)
        run = instance.create_run_for_job(job, tags=dict(job.tags))
        assert run.asset_selection is None and run.job_name == steps.ROLLOUT_JOB
        assert read_ok_and_rollout(instance, fleet) == (1, 1)
        instance.report_run_failed(run)
        assert read_ok_and_rollout(instance, fleet) == (1, 0)
