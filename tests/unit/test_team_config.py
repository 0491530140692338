"""The team instance's dagster.yaml: rendered from the one template with the run launcher's
per-machine values, no secret value in it, the embedded demo sharing its run-queue limits."""

import yaml

from spark_pipelines.core.fleet import load_fleet, parse_fleet
from spark_pipelines.cli.team.instance import (
    INSTANCE_ENV,
    TEAM_LABEL,
    TEMPLATE,
    Mount,
    render_instance_config,
    secret_env_names,
    secret_mounts,
)


def rendered(tmp_path, **over):
    args = dict(image_ref="spark-pipelines-team:abc123", env_names=[*INSTANCE_ENV, "LITELLM_MASTER_KEY"],
                mounts=[Mount("/etc/fleet.yaml"), Mount(str(tmp_path / "home"), writable=True)], label="lbl")
    args.update(over)
    return render_instance_config(TEMPLATE.read_text(), **args)


def test_the_launcher_gets_image_env_names_mounts_and_label(tmp_path):
    cfg = yaml.safe_load(rendered(tmp_path))
    launcher = cfg["run_launcher"]
    assert launcher["class"] == "DockerRunLauncher"
    c = launcher["config"]
    assert c["image"] == "spark-pipelines-team:abc123" and c["network"] == "host"
    assert c["env_vars"] == sorted({*INSTANCE_ENV, "LITELLM_MASTER_KEY"})
    assert all("=" not in e for e in c["env_vars"])  # names only: values stay in the daemon's environment
    vols = c["container_kwargs"]["volumes"]
    assert vols["/etc/fleet.yaml"] == {"bind": "/etc/fleet.yaml", "mode": "ro"}
    assert vols[str(tmp_path / "home")]["mode"] == "rw"
    assert c["container_kwargs"]["labels"] == {TEAM_LABEL: "lbl"}
    assert c["container_kwargs"]["stop_timeout"] >= 300  # a terminated deploy has time for its rollback


def test_storage_is_postgres_through_env_references_only(tmp_path, monkeypatch):
    text = rendered(tmp_path)
    pg = yaml.safe_load(text)["storage"]["postgres"]["postgres_db"]
    assert {k: v for k, v in pg.items() if k != "scheme"} == {
        "hostname": {"env": "DAGSTER_PG_HOST"}, "port": {"env": "DAGSTER_PG_PORT"},
        "username": {"env": "DAGSTER_PG_USER"}, "password": {"env": "DAGSTER_PG_PASSWORD"},
        "db_name": {"env": "DAGSTER_PG_DB"}}
    assert pg["scheme"] == "postgresql+psycopg2"  # SQLAlchemy 2.1's default would need psycopg 3
    # Dagster accepts the whole file (schema, run queue vs coordinator) without a database.
    from dagster._core.instance.config import dagster_instance_config

    home = tmp_path / "home"
    home.mkdir()
    (home / "dagster.yaml").write_text(text)
    cfg, _ = dagster_instance_config(str(home))
    assert cfg["run_monitoring"]["max_runtime_seconds"] >= 90 * 60  # a GX10's image build
    assert cfg["run_retries"]["enabled"] is False  # a failed launch is never rerun blindly


def test_the_queue_limits_one_run_per_node_one_bench_one_build(tmp_path):
    concurrency = yaml.safe_load(TEMPLATE.read_text())["concurrency"]
    assert concurrency["pools"]["default_limit"] == 1  # gateway_drain, image_build: one slot each
    limits = concurrency["runs"]["tag_concurrency_limits"]
    assert {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True}, "limit": 1} in limits
    assert {"key": "spark/bench", "limit": 1} in limits
    assert {"key": "spark/build", "limit": 1} in limits


def test_build_runs_carry_the_build_tag(seed_data, tmp_path):
    from spark_pipelines.core.steps import BUILD_TAG
    from spark_pipelines.definitions import build_definitions

    p = tmp_path / "fleet.yaml"
    p.write_text(yaml.safe_dump(seed_data, sort_keys=False))
    job = build_definitions(str(p)).resolve_job_def("build_job")
    assert BUILD_TAG == "spark/build" and job.tags[BUILD_TAG]


def test_mounts_are_the_fleet_file_keys_and_home_and_skip_missing_files(seed_data, tmp_path):
    key, kh = tmp_path / "id_ed25519", tmp_path / "known_hosts"
    key.write_text("k")
    for n in seed_data["nodes"]:
        n["key_path"], n["known_hosts"] = str(key), str(kh)  # known_hosts absent here
    fleet = parse_fleet(seed_data, "f.yaml")
    fleet_file = tmp_path / "f.yaml"
    mounts = secret_mounts(fleet, str(fleet_file), tmp_path / "home")
    assert [(m.path, m.writable) for m in mounts] == [
        (str(fleet_file), False), (str(key), False), (str(tmp_path / "home"), True)]


def test_secret_env_names_are_those_set_here():
    fleet = load_fleet("fleets/seed.yaml")
    assert secret_env_names(fleet, {"PATH": "x"}) == []
    assert secret_env_names(fleet, {"LITELLM_MASTER_KEY": "s", "HF_TOKEN": "t"}) == ["LITELLM_MASTER_KEY", "HF_TOKEN"]
