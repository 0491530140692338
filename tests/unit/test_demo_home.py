"""The demo's Dagster instance home: telemetry off by default, an operator's own config kept."""

from spark_pipelines.demo import prepare_instance_home


def test_instance_home_turns_telemetry_off_but_keeps_an_existing_config(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    assert prepare_instance_home() == home
    assert (home / "dagster.yaml").read_text() == "telemetry:\n  enabled: false\n"
    (home / "dagster.yaml").write_text("run_retries:\n  enabled: true\n")
    prepare_instance_home()
    assert (home / "dagster.yaml").read_text() == "run_retries:\n  enabled: true\n"
