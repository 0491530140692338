"""The console (code server + webserver + daemon) on a fresh instance, with the runbook's fleet
file: it comes up with the code location the UI's workspace names, refuses a second daemon on the
same instance, stops cleanly, and a fleet file that does not load is one line naming the log."""

from __future__ import annotations

import pytest
import yaml

from spark_pipelines.cli.console import Console, ConsoleError, _start_time
from spark_pipelines.cli.demo import prepare_instance_home

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


IN_PROCESS = """
import sys
import dagster as dg
from spark_pipelines.definitions import build_definitions
home, fleet = sys.argv[1:3]
instance = dg.DagsterInstance.from_config(home)
build_definitions(fleet).resolve_job_def("release_quarantine_job").execute_in_process(
    instance=instance, partition_key="spark1", raise_on_error=False)
"""


@pytest.fixture()
def hanging_fleet(tmp_path):
    """The seed fleet with every host on a loopback port that accepts and never answers: a run's
    SSH connect hangs (bounded), no traffic leaves the machine."""
    import socket
    import subprocess
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "key")], check=True)
    (tmp_path / "known_hosts").write_text("")
    data = yaml.safe_load(open(SEED))
    for target in [*data["nodes"], data["gateway"]]:
        target.update(host="127.0.0.1", port=srv.getsockname()[1], key_path=str(tmp_path / "key"),
                      known_hosts=str(tmp_path / "known_hosts"))
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    yield path, accepted
    srv.close()
    for c in accepted:
        c.close()


def test_a_dead_run_is_failed_by_the_daemon_and_the_nodes_queue_moves(tmp_path, hanging_fleet):
    """A run on spark1 whose process is killed -9 with no code server to notice (executed in
    process by another process on the demo's instance) is marked FAILURE by the daemon's run
    monitoring within about a minute, and the run queued behind it on spark1 starts. Then a valid
    edit of the fleet file: the next run is refused with one line, nothing touched."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import dagster as dg

    fleet, accepted = hanging_fleet
    home = prepare_instance_home(tmp_path / "home")
    instance = dg.DagsterInstance.from_config(str(home))
    with Console(home, str(fleet), log=lambda *_: None) as console:
        p = subprocess.Popen([sys.executable, "-c", IN_PROCESS, str(home), str(fleet)], cwd=os.getcwd(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            dead = None
            while dead is None and time.monotonic() < deadline:
                started = instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]))
                dead = started[0] if started else None
                time.sleep(0.5)
            assert dead is not None, "the in-process run did not start"
            queued = console.launch("release_quarantine_job", "spark1")
            time.sleep(5)
            assert instance.get_run_by_id(queued).status == dg.DagsterRunStatus.QUEUED  # one run per node
            os.kill(p.pid, signal.SIGKILL)
            p.wait(10)
            killed = time.monotonic()
        finally:
            if p.poll() is None:
                p.kill()
        while instance.get_run_by_id(dead.run_id).status == dg.DagsterRunStatus.STARTED:
            assert time.monotonic() - killed < 75, "the dead run is still STARTED 75 s after its process died"
            time.sleep(1)
        failed_after = time.monotonic() - killed
        assert instance.get_run_by_id(dead.run_id).status == dg.DagsterRunStatus.FAILURE
        while instance.get_run_by_id(queued).status == dg.DagsterRunStatus.QUEUED:
            assert time.monotonic() - killed < 120, "the queued run on spark1 did not leave the queue"
            time.sleep(1)
        print(f"dead run failed {failed_after:.0f} s after the kill; queued run left the queue "
              f"{time.monotonic() - killed:.0f} s after")
        console.terminate(queued)

        # The fleet file edited (valid) without a reload: the run is refused before any connection.
        data = yaml.safe_load(fleet.read_text())
        data["nodes"][1]["hardware"] = "founders"
        fleet.write_text(yaml.safe_dump(data, sort_keys=False))
        time.sleep(1)
        before = len(accepted)
        out = console.run(instance, "release_quarantine_job", "spark2", timeout_s=180, progress=lambda *_: None)
        assert not out.success
        assert out.why.startswith("spark_pipelines.resources.ssh.FleetChanged: the fleet file changed since the "
                                  "code location loaded: reload the code location (UI Reload) and launch again"), out.why
        assert "\n" not in out.why and len(accepted) == before
    instance.dispose()


def _step_started(instance, run_id: str) -> bool:
    import dagster as dg

    return bool(instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.STEP_START).records)


def _wait(what: str, probe, seconds: float) -> None:
    import time

    deadline = time.monotonic() + seconds
    while not probe():
        assert time.monotonic() < deadline, f"{what} within {seconds:.0f} s"
        time.sleep(1)


def test_a_bench_from_the_asset_page_waits_for_the_running_bench(tmp_path, hanging_fleet):
    """Issue 35, item 1: a bench materialized from the asset page runs as `__ASSET_JOB` without the
    bench tag, so the run queue's tag limit did not see it. The pool on bench_results holds it
    until the running bench (bench_job, another node) ends, on a real instance and daemon."""
    import time

    import dagster as dg

    fleet, _ = hanging_fleet
    data = yaml.safe_load(fleet.read_text())
    data["ssh"] = {**data.get("ssh", {}), "connect_retries": 0}  # the first bench hangs in one bounded connect
    fleet.write_text(yaml.safe_dump(data, sort_keys=False))
    home = prepare_instance_home(tmp_path / "home")
    instance = dg.DagsterInstance.from_config(str(home))
    with Console(home, str(fleet), log=lambda *_: None) as console:
        first = console.launch("bench_job", "spark1")
        _wait("the first bench's step started", lambda: _step_started(instance, first), 120)
        # What the asset page's Materialize sends for one partition.
        second = console.launch("__ASSET_JOB", "spark2", assets=["bench_results"])
        assert "spark/bench" not in instance.get_run_by_id(second).tags  # the tag limit cannot see it
        watched = time.monotonic()
        while time.monotonic() - watched < 25 and instance.get_run_by_id(first).status == dg.DagsterRunStatus.STARTED:
            assert not _step_started(instance, second), "a second bench started while the first one ran"
            time.sleep(1)
        status = instance.get_run_by_id(second).status
        assert status in (dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED)
        print(f"second bench {status.value} for {time.monotonic() - watched:.0f} s beside the first")
        console.terminate(first)
        _wait("the first bench ended", lambda: instance.get_run_by_id(first).is_finished, 120)
        _wait("the waiting bench started once the first ended", lambda: _step_started(instance, second), 120)
        console.terminate(second)
        _wait("the second bench ended", lambda: instance.get_run_by_id(second).is_finished, 120)
    instance.dispose()


def test_ctrl_c_while_a_run_starts_really_terminates_it(tmp_path, hanging_fleet):
    """Issue 35, item 6: a Ctrl-C in `make demo` printed "terminating run ... (its undo runs first)"
    while the run went on: Dagster refuses to terminate a run that is STARTING, and the refusal was
    not read. The interrupt arrives while the run starts; the run ends CANCELED and the lines say so."""
    import os
    import signal
    import threading
    import time

    import dagster as dg

    fleet, _ = hanging_fleet
    home = prepare_instance_home(tmp_path / "home")
    instance = dg.DagsterInstance.from_config(str(home))
    said: list[str] = []
    with Console(home, str(fleet), log=lambda *_: None) as console:
        def interrupt_while_starting() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                runs = instance.get_runs(dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTING]))
                if runs:
                    os.kill(os.getpid(), signal.SIGINT)
                    return
                time.sleep(0.05)

        watcher = threading.Thread(target=interrupt_while_starting, daemon=True)
        watcher.start()
        with pytest.raises(KeyboardInterrupt):
            console.run(instance, "release_quarantine_job", "spark1", progress=said.append)
        (run,) = instance.get_runs(dg.RunsFilter(job_name="release_quarantine_job"))
    assert run.status == dg.DagsterRunStatus.CANCELED, (run.status, said)
    assert any(line.strip().startswith("interrupted: terminating run") for line in said), said
    assert said[-1].strip() == f"run {run.run_id[:8]} ended CANCELED", said
    instance.dispose()
