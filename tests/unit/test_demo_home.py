"""The demo's Dagster instance home: telemetry off and one run per node by default, an operator's
own config kept."""

from pathlib import Path

import dagster as dg
import yaml

from spark_pipelines.cli.demo import prepare_instance_home
from spark_pipelines.cli.team.instance import TEMPLATE


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
        concurrency = instance.get_concurrency_config()
        limits = concurrency.run_queue_config.tag_concurrency_limits
        assert {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True}, "limit": 1} in limits
        assert {"key": "spark/bench", "limit": 1} in limits
        # the team instance's template is the one home of these limits
        assert limits == yaml.safe_load(TEMPLATE.read_text())["concurrency"]["runs"]["tag_concurrency_limits"]
        # Issue 35, item 1: one slot in every pool (one drain, one image build), whoever launches the step,
        # and a slot a dead run held is freed once the monitoring failed it.
        assert concurrency.pool_config.default_pool_limit == 1
        assert instance.run_monitoring_settings["free_slots_after_run_end_seconds"] > 0
        assert instance.telemetry_enabled is False
    finally:
        instance.dispose()


def test_every_step_that_drains_a_node_or_builds_an_image_is_in_its_pool(seed_data, tmp_path):
    """Issue 35, item 1: a bench materialized from the asset page (`__ASSET_JOB`, no bench tag) was not
    bound by the one-bench limit. The limit is on the assets themselves now."""
    from spark_pipelines.core.steps import BUILD_POOL, DRAIN_POOL
    from spark_pipelines.definitions import build_definitions

    p = tmp_path / "fleet.yaml"
    p.write_text(yaml.safe_dump(seed_data, sort_keys=False))
    defs = build_definitions(str(p))
    pools = {k.to_user_string(): defs.resolve_assets_def(k).op.pool for k in defs.resolve_asset_graph().get_all_asset_keys()}
    drains = {"bench_results", "fleet_rollout", "node_join", "node_os"}
    assert {k for k, v in pools.items() if v == DRAIN_POOL} == drains
    assert {k for k, v in pools.items() if v == BUILD_POOL} == {"base_image", "serving_image"}
    assert [n.definition.pool for n in defs.resolve_job_def("ab_experiment_job").graph.nodes] == [DRAIN_POOL]


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
    from spark_pipelines.cli.console_launcher import LocalRunLauncher
    from spark_pipelines.cli.demo import MONITOR_POLL_S, WRITTEN_BY

    home = tmp_path / "home"
    home.mkdir()
    older = {"telemetry": {"enabled": False}, "run_queue": {"max_concurrent_runs": 8, "tag_concurrency_limits": [
        {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True}, "limit": 1}]}}
    (home / "dagster.yaml").write_text(yaml.safe_dump(older))
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
    from spark_pipelines.cli.demo import DEMO_FLEET_RECORD, ui_fleet

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
    assert f"{demo_file} is gone" in warning and "real nodes" in warning and "SPARK_FLEET=FILE" in warning


def _demo_here(tmp_path):
    """A directory after `make demo`: its instance, the fleet file it recorded, the sim's key file."""
    from spark_pipelines.cli.demo import DEMO_FLEET_RECORD, DEMO_KEY_RECORD

    home = prepare_instance_home(tmp_path / ".dagster-home")
    fleet = tmp_path / "sim-fleet.yaml"
    fleet.write_text(open("fleets/seed.yaml").read().replace("0.85        #", "0.84        #"))
    key = tmp_path / "master_key"
    key.write_text("sk-sim-secret\n")
    key.chmod(0o600)
    (home / DEMO_FLEET_RECORD).write_text(f"{fleet}\n")
    (home / DEMO_KEY_RECORD).write_text(f"{key}\n")
    return home, fleet, key


def test_after_the_demo_every_command_finds_its_fleet_file_and_names_it(tmp_path):
    """Issue 35, item 4: after `make demo`, plan and doctor read fleets/seed.yaml and failed on its
    key path without naming the file; metrics wanted DAGSTER_HOME."""
    import os
    import subprocess
    import sys

    home, fleet, _ = _demo_here(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("SPARK_FLEET", "DAGSTER_HOME", "LITELLM_MASTER_KEY")}

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "spark_pipelines.cli", *args], capture_output=True, text=True,
                              timeout=120, cwd=tmp_path, env=env)

    recorded = f"{fleet} (the demo's, recorded in {home / 'demo-fleet-file'})"
    plan = cli("plan")
    assert plan.returncode == 0 and plan.stdout.splitlines()[0] == f"# fleet file: {recorded}", plan.stdout[:300]
    assert "--gpu-memory-utilization 0.84" in plan.stdout
    assert cli("sudoers").stdout.splitlines()[0] == f"# fleet file: {recorded}"
    show = cli("metrics", "show")
    assert show.returncode == 0, show.stderr
    assert show.stderr.splitlines()[:2] == [f"metrics: fleet file {recorded}", f"metrics: Dagster instance {home} (the demo's)"]
    # The seed's hosts are real nodes: a key path missing here is named with the fleet file it came from.
    doctor = cli("doctor")
    assert doctor.returncode == 2 and f"(fleet file {recorded})" in doctor.stderr, doctor.stderr
    assert len(doctor.stderr.strip().splitlines()) == 1


def test_the_simulators_gateway_key_goes_with_the_demos_fleet_file_only(tmp_path):
    """Issue 35, items 4-5: `plan --live` and `adopt --check` on the demo's fleet sent no key (the
    key is a file under the sim's root); `make ui` did not pass it either."""
    from spark_pipelines.cli.demo import demo_gateway_key

    home, fleet, key = _demo_here(tmp_path)
    env: dict[str, str] = {}
    said = demo_gateway_key(str(fleet), "LITELLM_MASTER_KEY", env, home)
    assert env == {"LITELLM_MASTER_KEY": "sk-sim-secret"}
    assert said == f"$LITELLM_MASTER_KEY from the simulator's key file {key}" and "sk-sim" not in said
    other = tmp_path / "other.yaml"
    other.write_text(fleet.read_text())
    env = {}
    assert demo_gateway_key(str(other), "LITELLM_MASTER_KEY", env, home) is None and env == {}
    env = {"LITELLM_MASTER_KEY": "mine"}  # the operator's own key wins
    assert demo_gateway_key(str(fleet), "LITELLM_MASTER_KEY", env, home) is None and env["LITELLM_MASTER_KEY"] == "mine"


def test_make_ui_runs_dg_dev_on_the_port_asked_with_the_key(tmp_path, monkeypatch):
    """Issue 35, item 5: `make ui` hard-coded port 3000, ran the deprecated `dagster dev` and did not
    pass the simulator's key."""
    import os

    from spark_pipelines.cli import demo

    home, fleet, _ = _demo_here(tmp_path)
    monkeypatch.chdir(tmp_path)
    for var in ("SPARK_FLEET", "LITELLM_MASTER_KEY", "DAGSTER_HOME"):
        monkeypatch.setenv(var, "recorded")  # so that teardown removes what ui_command sets
        monkeypatch.delenv(var)
    execs = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: execs.append((path, argv, env)))
    assert demo.ui_command("3210") == 0
    (path, argv, env), = execs
    assert Path(path).name == "dg" and argv[1:] == ["dev", "-h", "127.0.0.1", "-p", "3210"]
    assert env["SPARK_FLEET"] == str(fleet) and env["LITELLM_MASTER_KEY"] == "sk-sim-secret"
    assert env["DAGSTER_HOME"] == str(home)
    assert demo.ui_command("99999") == 2


def test_a_fleet_that_does_not_come_up_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """Another fleet's leftovers on the slot (a network namespace of the same name): `make demo`
    says what failed, where, and what to run, in one line, exit 1."""
    from spark_pipelines.cli import demo
    from spark_pipelines.cli.main import parser
    from spark_sim.fleet import SimFleet
    from spark_sim.layout import SimError

    monkeypatch.setenv("SPARK_SIM_ROOT", str(tmp_path / "sim"))
    monkeypatch.setenv("SPARK_SIM_SLOT", "29")

    def up(self, **_):
        raise SimError('ip netns add sp29-net failed (exit 1): Cannot create namespace file "/run/netns/sp29-net": File exists')

    monkeypatch.setattr(SimFleet, "up", up)
    rc = demo.demo_command(parser().parse_args(["demo", "--nodes", "2"]))
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "File exists" in err and "slot 29" in err and "sim down" in err, err


def test_a_home_the_demo_wrote_before_the_commands_moved_is_brought_up_to_date(tmp_path):
    """Issue 36: the commands moved into spark_pipelines/cli/, and with them the run launcher's
    module; a demo home written before names the old module and must not be left unloadable."""
    from spark_pipelines.cli.demo import WRITTEN_BEFORE, WRITTEN_BY

    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(WRITTEN_BEFORE[0] + "\n" + yaml.safe_dump(
        {"telemetry": {"enabled": False},
         "run_launcher": {"module": "spark_pipelines.console_launcher", "class": "LocalRunLauncher"}}))
    prepare_instance_home(home)
    text = (home / "dagster.yaml").read_text()
    assert text.startswith(WRITTEN_BY)
    assert yaml.safe_load(text)["run_launcher"]["module"] == "spark_pipelines.cli.console_launcher"
