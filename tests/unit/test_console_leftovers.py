"""A console a killed caller left behind: its recorded processes are stopped by the next start,
a process that merely reuses a recorded pid is not."""

import json
import subprocess

from spark_pipelines.cli.console import _start_time, console_dir, stop_leftovers


def _record(home, procs, owner=None):
    d = console_dir(home)
    d.mkdir(parents=True, exist_ok=True)
    (d / "console.json").write_text(json.dumps({"processes": procs, "stopped_at": None, "owner": owner}))


def test_leftover_processes_are_stopped_and_the_stop_recorded(tmp_path):
    home = tmp_path / "home"
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        _record(home, {"daemon": {"pid": proc.pid, "started": _start_time(proc.pid)}})
        lines = []
        assert stop_leftovers(home, lines.append) == [f"daemon (pid {proc.pid})"]
        assert _start_time(proc.pid) is None  # gone (and reaped)
        assert "stopped the Dagster console a previous run left" in lines[0]
        state = json.loads((console_dir(home) / "console.json").read_text())
        assert state["processes"] == {} and state["stopped_at"] > 0
        assert stop_leftovers(home, lines.append) == []  # idempotent
    finally:
        proc.kill()
        proc.wait()


def test_a_recycled_pid_is_left_alone(tmp_path):
    home = tmp_path / "home"
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        # Same pid, another start time: not the process the console started.
        _record(home, {"webserver": {"pid": proc.pid, "started": "1"}})
        assert stop_leftovers(home, lambda *_: None) == []
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_no_state_file_is_nothing_to_stop(tmp_path):
    assert stop_leftovers(tmp_path / "nowhere", lambda *_: None) == []


def test_a_console_whose_owner_still_runs_is_not_a_leftover(tmp_path):
    home = tmp_path / "home"
    owner = subprocess.Popen(["sleep", "300"], start_new_session=True)
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        _record(home, {"daemon": {"pid": proc.pid, "started": _start_time(proc.pid)}},
                owner={"pid": owner.pid, "started": _start_time(owner.pid)})
        lines = []
        assert stop_leftovers(home, lines.append) == []
        assert proc.poll() is None and "belongs to a running process" in lines[0]
        owner.kill()
        owner.wait()
        assert stop_leftovers(home, lines.append) == [f"daemon (pid {proc.pid})"]
    finally:
        for p in (owner, proc):
            p.kill()
            p.wait()
