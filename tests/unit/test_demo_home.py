"""The demo's Dagster instance home: telemetry off and one run per node by default, an operator's
own config kept."""

import dagster as dg
import yaml

from spark_pipelines.demo import prepare_instance_home
from spark_pipelines.team.instance import TEMPLATE


def test_instance_home_turns_telemetry_off_but_keeps_an_existing_config(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    assert prepare_instance_home() == home
    assert "\ntelemetry:\n  enabled: false\n" in (home / "dagster.yaml").read_text()
    (home / "dagster.yaml").write_text("run_retries:\n  enabled: true\n")
    prepare_instance_home()
    assert (home / "dagster.yaml").read_text() == "run_retries:\n  enabled: true\n"


def test_instance_runs_one_run_per_node_and_one_bench_at_a_time(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    prepare_instance_home()
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        limits = instance.run_coordinator.get_run_queue_config().tag_concurrency_limits
        assert {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True}, "limit": 1} in limits
        assert {"key": "spark/bench", "limit": 1} in limits
        # the team instance's template is the one home of these limits
        assert limits == yaml.safe_load(TEMPLATE.read_text())["run_queue"]["tag_concurrency_limits"]
        assert instance.telemetry_enabled is False
    finally:
        instance.dispose()


def test_bench_runs_carry_the_bench_tag(seed_data, tmp_path):
    from spark_pipelines.core.steps import BENCH_TAG
    from spark_pipelines.definitions import build_definitions

    p = tmp_path / "fleet.yaml"
    p.write_text(yaml.safe_dump(seed_data, sort_keys=False))
    defs = build_definitions(str(p))
    assert defs.resolve_job_def("bench_job").tags.get(BENCH_TAG)
    sched = defs.get_repository_def().get_schedule_def("nightly_bench")
    ctx = dg.build_schedule_context(scheduled_execution_time=__import__("datetime").datetime(2026, 12, 3, 4, 30),
                                    repository_def=defs.get_repository_def())
    reqs = list(sched.evaluate_tick(ctx).run_requests)
    assert reqs and all(r.tags.get(BENCH_TAG) for r in reqs)
    assert len({r.partition_key for r in reqs}) == len(reqs)


def test_the_demo_instance_fails_a_dead_run_and_upgrades_the_config_it_wrote_before(tmp_path):
    """Run monitoring with the local launcher (a dead run's process is noticed, never resumed); a
    dagster.yaml an older demo wrote (telemetry and run queue only) is brought up to date."""
    from spark_pipelines.console_launcher import LocalRunLauncher
    from spark_pipelines.demo import MONITOR_POLL_S, WRITTEN_BY

    home = tmp_path / "home"
    home.mkdir()
    cfg = yaml.safe_load(TEMPLATE.read_text())
    (home / "dagster.yaml").write_text(yaml.safe_dump({k: cfg[k] for k in ("telemetry", "run_queue")}))
    prepare_instance_home(home)
    assert (home / "dagster.yaml").read_text().startswith(WRITTEN_BY)
    instance = dg.DagsterInstance.from_config(str(home))
    try:
        assert isinstance(instance.run_launcher, LocalRunLauncher)
        assert instance.run_launcher.supports_check_run_worker_health
        assert instance.run_monitoring_enabled and instance.run_monitoring_max_resume_run_attempts == 0
        assert instance.run_monitoring_poll_interval_seconds == MONITOR_POLL_S
    finally:
        instance.dispose()


def test_make_ui_keeps_the_demos_fleet_file_or_says_loudly_that_it_switched(tmp_path, monkeypatch):
    """Issue 23, item 11: after `make sim-down` the UI must not quietly open on the seed's real hosts."""
    from spark_pipelines.core.fleet import SEED_FLEET
    from spark_pipelines.demo import DEMO_FLEET_RECORD, ui_fleet

    monkeypatch.chdir(tmp_path)
    home = tmp_path / ".dagster-home"
    home.mkdir()
    assert ui_fleet(home, {}) == (SEED_FLEET, None)  # no demo ever ran here: the seed, quietly
    demo_file = tmp_path / "sim-fleet.yaml"
    demo_file.write_text("nodes: []\n")
    (home / DEMO_FLEET_RECORD).write_text(f"{demo_file}\n")
    assert ui_fleet(home, {}) == (str(demo_file), None)
    assert ui_fleet(home, {"SPARK_FLEET": "mine.yaml"}) == ("mine.yaml", None)
    demo_file.unlink()  # make sim-down
    path, warning = ui_fleet(home, {})
    assert path == SEED_FLEET and warning is not None
    assert f"{demo_file} is gone" in warning and "real nodes" in warning and "SPARK_FLEET=path make ui" in warning
