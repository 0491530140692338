"""The console (code server + webserver + daemon) on a fresh instance, with the runbook's fleet
file: it comes up with the code location the UI's workspace names, refuses a second daemon on the
same instance, stops cleanly, and a fleet file that does not load is one line naming the log."""

from __future__ import annotations

import pytest
import yaml

from spark_pipelines.console import Console, ConsoleError, _start_time
from spark_pipelines.demo import prepare_instance_home

pytestmark = pytest.mark.slow

SEED = "fleets/seed.yaml"


def test_console_serves_the_code_location_and_keeps_one_daemon_per_instance(tmp_path):
    home = prepare_instance_home(tmp_path / "home")
    with Console(home, SEED, log=lambda *_: None) as console:
        repos = console.graphql("{ repositoriesOrError { ... on RepositoryConnection { nodes { name "
                                "location { name } jobs { name } } } } }")["repositoriesOrError"]["nodes"]
        assert [(r["name"], r["location"]["name"]) for r in repos] == [("__repository__", "spark_pipelines")]
        assert {"build_job", "deploy_node_job", "gateway_job", "bench_job"} <= {j["name"] for j in repos[0]["jobs"]}
        second = Console(home, SEED, log=lambda *_: None)
        try:
            with pytest.raises(ConsoleError, match="a Dagster daemon already serves"):
                second.start()
        finally:
            second.stop()  # whatever it started, were the refusal to fail
        assert console.graphql("{ version }")["version"]  # the first one still serves
        with pytest.raises(ConsoleError, match="no_such_job: not launched"):
            console.launch("no_such_job")
        pids = [(p.pid, st) for p, st, _ in console.processes.values()]
    assert all(_start_time(pid) != st for pid, st in pids)  # all three gone
    # Stopped: the next console on the instance starts (the old heartbeat does not count).
    with Console(home, SEED, log=lambda *_: None) as again:
        assert again.graphql("{ version }")["version"]


def test_a_fleet_file_that_does_not_load_is_one_line(tmp_path):
    data = yaml.safe_load(open(SEED))
    data["launch"]["gpu_memory_utilization"] = 0.95
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    home = prepare_instance_home(tmp_path / "home")
    with pytest.raises(ConsoleError) as e:
        Console(home, str(bad), log=lambda *_: None, startup_timeout_s=180).start()
    msg = str(e.value)
    assert "\n" not in msg and "log:" in msg and str(home / "console") in msg
