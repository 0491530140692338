"""A command's output on our side: linear capture, the private output file, bounded log events."""

import stat
import time

from spark_pipelines.core import remote
from spark_pipelines.resources.ssh.output import STDOUT_CAPTURE_BYTES, CommandOutput, output_root


def test_output_file_is_private_whole_and_redacted(tmp_path):
    events: list[str] = []
    secret = "hf_" + "Q" * 20
    out = CommandOutput("spark1", "sh -c x", "sh", tmp_path / "out", events.append, [secret], "spark1")
    assert out.add("stdout", f"token={secret}") == "token=***"
    out.add("stderr", "warning")
    out.close("exit 0 after 0.1s")
    assert out.path is not None and out.path.parent == tmp_path / "out"
    assert stat.S_IMODE(out.path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o700
    assert out.path.read_text().splitlines() == [
        "# node spark1: $ sh -c x", "token=***", "[stderr] warning", "# exit 0 after 0.1s"]
    assert secret not in "".join(events) and "[spark1] token=***" in events[0]
    assert out.text("stdout") == "token=***\n" and out.text("stderr") == "warning\n"


def test_capture_is_linear_and_capped_per_stream(tmp_path):
    out = CommandOutput("n", "c", "c", None, None, [], "n")
    line = "e" * 199
    t0 = time.perf_counter()
    for _ in range(60_000):  # 12 MB of stderr: past the cap
        out.add("stderr", line)
    took = time.perf_counter() - t0
    assert took < 5, f"60k lines took {took:.1f} s"  # ~0.1 s; re-summing the buffer per line took minutes
    kept = out.text("stderr")
    assert STDOUT_CAPTURE_BYTES <= len(kept) <= STDOUT_CAPTURE_BYTES + 200
    assert out.tail.total_lines == 60_000 and out.path is None


def test_log_events_per_command_are_bounded(tmp_path):
    events: list[str] = []
    out = CommandOutput("n", "c", "c", tmp_path, events.append, [], "n")
    for i in range(100_000):
        out.add("stdout", f"l{i}")
    out.close()
    assert len(events) <= remote.LogBatcher().max_events + 1
    assert events[-1].startswith("... ") and str(out.path) in events[-1] and events[-1].endswith("[n] l99999")
    assert len(out.path.read_text().splitlines()) == 100_000 + 1  # every line, and the header


def test_output_root_prefers_config_then_dagster_home(tmp_path, monkeypatch):
    assert output_root(str(tmp_path / "x")) == tmp_path / "x"
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dh"))
    assert output_root(None) == tmp_path / "dh" / "storage" / "command-output"
    monkeypatch.delenv("DAGSTER_HOME")
    assert output_root(None).name == "command-output"
