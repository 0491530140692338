"""Every wait on a node is bounded, against the simulated fleet's real sshd and dockerd.

A frozen sshd (SIGSTOP: TCP stays up, no SSH bytes) and a frozen dockerd are what hung a bench and a
deploy before (issue 9, point 5); here each must fail in bounded time with a message naming the
node. Output capture must be linear and the run log bounded, with the whole output kept in a file.
"""

from __future__ import annotations

import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from spark_pipelines.core import remote
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.ssh import (
    FleetSession,
    NodeConnectError,
    NodeUnresponsive,
    RemoteCommandError,
    RemoteCommandTimeout,
    SshSettings,
    read_command_log,
)
from tests.plugins.faults import descendants, stopped

pytestmark = pytest.mark.slow

# Short limits so a test takes seconds; the defaults (15 s / 90 s) are the same mechanism.
FAST = dict(keepalive_s=1.0, dead_peer_s=4.0, sftp_timeout_s=3.0, connect_timeout_s=3.0, connect_retries=0)


@contextmanager
def frozen(pidfile: Path) -> Iterator[list[int]]:
    """SIGSTOP the daemon in pidfile and every process under it (sshd's per-connection children);
    SIGCONT them whatever happens (the fault suite's injector)."""
    pid = int(pidfile.read_text().strip())
    with stopped([pid, *descendants(pid)], str(pidfile)) as done:
        yield done


def _freeze_after(seconds: float, pidfile: Path, thawed: threading.Event, hold_s: float) -> threading.Thread:
    def go() -> None:
        time.sleep(seconds)
        with frozen(pidfile):
            thawed.wait(hold_s)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_frozen_sshd_ends_a_running_command_in_bounded_time(sim_fleet, node_pair, tmp_path):
    node = node_pair.serve
    with FleetSession(node_pair.fleet, SshSettings(**FAST, output_dir=str(tmp_path))) as s:
        assert s.run(node, ["true"], log=False).ok  # connected before the freeze
        done = threading.Event()
        t = _freeze_after(1.0, sim_fleet.node(node).sshd_pidfile, done, hold_s=30)
        t0 = time.monotonic()
        try:
            with pytest.raises(NodeUnresponsive) as ei:
                s.run(node, ["sleep", "25"], log=False)
            took = time.monotonic() - t0
        finally:
            done.set()
            t.join(10)
    msg = str(ei.value)
    print(f"frozen sshd: command ended after {took:.1f} s (dead_peer_s={FAST['dead_peer_s']})")
    assert took < 12, f"a frozen sshd must end the command within dead_peer_s, took {took:.1f} s"
    assert f"node {node}:" in msg and "no answer from sshd" in msg and "`timeout -k" not in msg
    assert "sleep 25" in msg and "hard-reset" in msg


def test_frozen_sshd_fails_a_new_command_and_an_sftp_read_in_bounded_time(sim_fleet, node_pair, tmp_path):
    node = node_pair.serve
    path = "~/.bounded-waits-probe"
    with FleetSession(node_pair.fleet, SshSettings(**FAST, output_dir=str(tmp_path))) as s:
        s.put_text(node, path, "probe\n")
        assert s.read_text(node, path) == "probe\n"  # SFTP channel open before the freeze
        with frozen(sim_fleet.node(node).sshd_pidfile):
            t0 = time.monotonic()
            with pytest.raises(NodeUnresponsive) as read_err:
                s.read_text(node, path)
            read_took = time.monotonic() - t0
            t0 = time.monotonic()
            # Whichever notices first: the open channel gets no answer, or the watchdog has closed
            # the connection and the reconnect finds sshd accepting TCP but saying nothing.
            with pytest.raises((NodeUnresponsive, NodeConnectError)) as run_err:
                s.run(node, ["docker", "image", "inspect", "x"], log=False)
            run_took = time.monotonic() - t0
        print(f"frozen sshd: SFTP read failed after {read_took:.1f} s, new command after {run_took:.1f} s")
        assert read_took < 10 and run_took < 10
        assert f"node {node}:" in str(read_err.value) and "SFTP read of" in str(read_err.value)
        assert f"node {node}:" in str(run_err.value) and "answer" in str(run_err.value)
        assert "hard-reset" in str(run_err.value)
        # Thawed: the session reconnects by itself and the node is usable again.
        assert s.read_text(node, path) == "probe\n"
        s.run(node, ["rm", "-f", s.expand(node, path)], log=False)


def test_frozen_dockerd_fails_a_docker_probe_in_bounded_time(sim_fleet, node_pair, tmp_path):
    node = node_pair.serve
    with FleetSession(node_pair.fleet, SshSettings(**FAST, output_dir=str(tmp_path))) as s:
        docker = NodeDocker(s)
        docker.image_id(node, "spark-test-absent:x")  # dockerd answers before the freeze
        with frozen(sim_fleet.node(node).dockerd_pidfile):
            t0 = time.monotonic()
            with pytest.raises(RemoteCommandError) as ei:
                docker.image_id(node, "spark-test-absent:x")
            took = time.monotonic() - t0
        print(f"frozen dockerd: docker image inspect ended after {took:.1f} s")
    assert took < remote.PROBE_TIMEOUT_S + 20
    e = ei.value
    assert e.node == node and e.exit_status in remote.TIMEOUT_EXIT_CODES
    assert "docker image inspect" in str(e) and "dockerd" in str(e)


def test_the_default_timeout_kills_the_command_on_the_node(node_pair, tmp_path):
    node = node_pair.build
    with FleetSession(node_pair.fleet, SshSettings(command_timeout_s=2, connect_retries=1, output_dir=str(tmp_path))) as s:
        t0 = time.monotonic()
        with pytest.raises(RemoteCommandTimeout, match=rf"node {node}: command killed after its 2s timeout"):
            s.run(node, ["sleep", "41"], log=False)  # no timeout given: the default applies
        assert time.monotonic() - t0 < 10
        left = s.run(node, ["sh", "-c", "ps -eo args | grep -c '^sleep 41$' || true"], log=False)
        assert left.stdout.strip() == "0", "the command must be killed on the node, not only abandoned"


def test_40k_stderr_lines_are_captured_whole_with_a_bounded_log(node_pair, tmp_path):
    node = node_pair.build
    n = 40_000
    events: list[str] = []
    with FleetSession(node_pair.fleet, SshSettings(connect_retries=1, output_dir=str(tmp_path))) as s:
        timings = {}
        for stream, redirect in (("stdout", ""), ("stderr", " >&2")):
            events.clear()
            t0 = time.monotonic()
            r = s.run(node, ["sh", "-c", f"seq 1 {n} | sed 's/^/line-/'{redirect}"], log=events.append)
            timings[stream] = time.monotonic() - t0
            assert r.ok
            captured = getattr(r, stream).splitlines()
            assert captured == [f"line-{i}" for i in range(1, n + 1)]
            assert r.output_path is not None
            body = Path(r.output_path).read_text().splitlines()
            prefix = "" if stream == "stdout" else "[stderr] "
            assert [x for x in body if not x.startswith("#")] == [f"{prefix}line-{i}" for i in range(1, n + 1)]
            # "$ command", at most max_events batches, one "... K more lines in FILE", "exit 0".
            assert len(events) <= remote.LogBatcher().max_events + 3
            assert len(events) < n / 100  # batches, not one event per line
            if len(events) > remote.LogBatcher().max_events:
                assert f"more lines in {r.output_path}" in events[-2]
        print(f"40k lines: stdout {timings['stdout']:.2f} s, stderr {timings['stderr']:.2f} s, "
              f"{len(events)} log events")
        # Linear: stderr costs what stdout costs (it took 19 s vs 0.1 s when it was quadratic).
        assert timings["stderr"] < 3 * timings["stdout"] + 2


def test_the_output_file_is_private_whole_redacted_and_recorded(node_pair, tmp_path):
    node = node_pair.build
    secret = "hf_Sim" + "k9Z3" * 5
    out_dir = tmp_path / "out"
    log_path = tmp_path / "commands.jsonl"
    settings = SshSettings(connect_retries=1, output_dir=str(out_dir), command_log_path=str(log_path))
    with FleetSession(node_pair.fleet, settings) as s:
        r = s.run(node, ["sh", "-c", 'echo "token=$HF_TOKEN"; echo "warn $HF_TOKEN" >&2; echo done'],
                  secret_env={"HF_TOKEN": secret}, log=lambda _: None)
        probe = s.run(node, ["true"], log=False)
        records = list(s.commands)
    assert r.output_path and Path(r.output_path).parent == out_dir
    path = Path(r.output_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(out_dir.stat().st_mode) == 0o700
    text = path.read_text()
    assert secret not in text
    assert "token=***" in text and "[stderr] warn ***" in text and "done" in text
    assert "[secret env: HF_TOKEN]" in text.splitlines()[0] and "exit 0" in text.splitlines()[-1]
    assert probe.output_path is None  # log=False probes keep no file
    assert records[-2].output == r.output_path and records[-1].output is None
    assert [rec.output for rec in read_command_log(log_path)] == [r.output_path, None]


def test_a_quiet_command_on_a_live_node_outlasts_dead_peer_s(node_pair, tmp_path):
    """The watchdog counts the keepalive ANSWERS: a silent command is not mistaken for a dead peer."""
    node = node_pair.serve
    with FleetSession(node_pair.fleet, SshSettings(**FAST, output_dir=str(tmp_path))) as s:
        conn = s.connection(node)
        r = s.run(node, ["sh", "-c", "sleep 9; echo awake"], log=False)  # silent for 2x dead_peer_s
        assert r.ok and r.stdout == "awake\n"
        assert s.connection(node) is conn and not conn.liveness.dead  # the same connection survived
