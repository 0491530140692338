"""FleetSSH / FleetSession against the simulated fleet's real sshd."""

import logging
import subprocess
import time
from pathlib import Path

import dagster as dg
import paramiko
import pytest

from spark_pipelines.core import remote
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.ssh import (
    FleetSession,
    FleetSSH,
    HostKeyError,
    RemoteCommandError,
    RemoteCommandTimeout,
    SshSettings,
    SudoPasswordRequired,
    read_command_log,
)

pytestmark = pytest.mark.slow

_KEYGEN_TYPE = {"ssh-ed25519": "ed25519", "ssh-rsa": "rsa", "ecdsa-sha2-nistp256": "ecdsa"}


def _with_known_hosts(fleet: Fleet, node: str, path: str) -> Fleet:
    nodes = tuple(n.model_copy(update={"known_hosts": path}) if n.name == node else n for n in fleet.nodes)
    return fleet.model_copy(update={"nodes": nodes})


def test_argv_reaches_the_node_unchanged(node_pair, fleet_session):
    args = ["a b", "$HOME", "it's", "; echo pwned", "`id`", '{"method":"mtp","num_speculative_tokens":2}']
    r = fleet_session.run(node_pair.build, ["printf", "%s\\n", *args], log=False)
    assert r.exit_status == 0
    assert r.stdout.splitlines() == args


def test_connection_is_reused_and_commands_are_recorded(node_pair, fleet_session):
    first = fleet_session.client(node_pair.build)
    before = len(fleet_session.commands)
    fleet_session.run(node_pair.build, ["true"], log=False)
    fleet_session.run(node_pair.build, ["sh", "-c", "exit 3"], check=False, log=False)
    assert fleet_session.client(node_pair.build) is first
    recs = fleet_session.commands[before:]
    assert [(r.node, r.argv, r.exit_status) for r in recs] == [
        (node_pair.build, ("true",), 0),
        (node_pair.build, ("sh", "-c", "exit 3"), 3),
    ]
    assert all(r.seconds >= 0 for r in recs)


def test_output_streams_line_by_line_while_the_command_runs(node_pair, fleet_session):
    seen: list[tuple[float, str]] = []
    script = "for i in 1 2 3; do echo out-$i; echo err-$i >&2; sleep 0.6; done"
    started = time.monotonic()
    r = fleet_session.run(node_pair.serve, ["sh", "-c", script], log=lambda event: seen.append((time.monotonic(), event)))
    ended = time.monotonic()
    # A log event is a batch of lines (the first after a quiet spell goes out alone, at once).
    seen = [(t, line) for t, event in seen for line in event.split("\n")]
    lines = [line for _, line in seen]
    node = node_pair.serve
    for i in (1, 2, 3):
        assert f"[{node}] out-{i}" in lines and f"[{node} stderr] err-{i}" in lines
    first_out = next(t for t, line in seen if line.endswith("out-1"))
    # The first line was logged while the command still had >1 s to run, not after it ended.
    assert first_out - started < 0.8 and ended - first_out > 1.0
    assert r.stdout == "out-1\nout-2\nout-3\n" and r.stderr == "err-1\nerr-2\nerr-3\n"
    assert lines[0] == f"[{node}] $ sh -c {remote.quote_argv([script])}"


def test_failure_carries_node_command_exit_and_tail(node_pair, fleet_session):
    argv = ["sh", "-c", "for i in $(seq 1 100); do echo line-$i; done; echo 'disk full' >&2; exit 7"]
    with pytest.raises(RemoteCommandError) as ei:
        fleet_session.run(node_pair.serve, argv, log=False)
    e = ei.value
    assert e.node == node_pair.serve and e.exit_status == 7
    assert e.command == remote.quote_argv(argv)
    assert e.tail.splitlines()[-1] == "disk full" and "line-100" in e.tail and "line-1\n" not in e.tail
    assert node_pair.serve in str(e) and "status 7" in str(e)
    r = fleet_session.run(node_pair.serve, argv, check=False, log=False)
    assert r.exit_status == 7 and not r.ok


def test_stdin_is_delivered_and_timeout_kills_on_the_node(node_pair, fleet_session):
    payload = b"x" * 3_000_000
    r = fleet_session.run(node_pair.build, ["wc", "-c"], stdin=payload, log=False)
    assert r.stdout.strip() == str(len(payload))
    t0 = time.monotonic()
    with pytest.raises(RemoteCommandTimeout, match=node_pair.build):
        fleet_session.run(node_pair.build, ["sleep", "30"], timeout=1, log=False)
    assert time.monotonic() - t0 < 10
    left = fleet_session.run(node_pair.build, ["sh", "-c", "ps -eo args | grep -c '^sleep 30$' || true"], log=False)
    assert left.stdout.strip() == "0"


def test_secret_env_reaches_the_command_but_never_the_log(node_pair, fleet_session):
    secret = "hf_Sim" + "x7Q2" * 5
    logged: list[str] = []
    r = fleet_session.run(
        node_pair.build,
        ["sh", "-c", 'printf "%s" "$HF_TOKEN" | wc -c; echo "token=$HF_TOKEN"; echo "MODE=$MODE"; ps -eo args'],
        env={"MODE": "offline"},
        secret_env={"HF_TOKEN": secret},
        log=logged.append,
    )
    assert r.stdout.splitlines()[0].strip() == str(len(secret))
    assert "token=***" in r.stdout and "MODE=offline" in r.stdout
    assert secret not in r.stdout and all(secret not in line for line in logged)
    assert "[secret env: HF_TOKEN]" in logged[0] and "MODE=offline" in logged[0]
    assert all(secret not in " ".join(c.argv) for c in fleet_session.commands)
    left = fleet_session.run(node_pair.build, ["ls", "-A", fleet_session.expand(node_pair.build, "~/.cache/spark-pipelines/secrets")], log=False)
    assert left.stdout.strip() == "", "the secret env file must be deleted"


def test_sudo_without_sudoers_names_the_missing_line(node_pair, fleet_session):
    user = node_pair.fleet.node(node_pair.build).user
    with pytest.raises(SudoPasswordRequired) as ei:
        fleet_session.run(node_pair.build, ["true"], sudo=True, log=False)
    e = ei.value
    assert e.sudoers_line.startswith(f"{user} ALL=(root) NOPASSWD: /") and e.sudoers_line.endswith("/true")
    assert node_pair.build in str(e) and user in str(e) and e.sudoers_line in str(e) and "visudo" in str(e)
    assert e.command == "sudo -n true"


def test_put_text_and_read_text_round_trip_with_mode(node_pair, fleet_session):
    path = "~/spark-test/sub/config.yaml"
    full = fleet_session.put_text(node_pair.serve, path, "model_list: []\n", 0o600)
    assert full == fleet_session.expand(node_pair.serve, path) and full.startswith("/")
    assert fleet_session.read_text(node_pair.serve, path) == "model_list: []\n"
    mode = fleet_session.run(node_pair.serve, ["stat", "-c", "%a", full], log=False).stdout.strip()
    assert mode == "600"
    fleet_session.run(node_pair.serve, ["rm", "-rf", fleet_session.expand(node_pair.serve, "~/spark-test")], log=False)
    with pytest.raises(Exception, match=node_pair.serve):
        fleet_session.read_text(node_pair.serve, path)


def test_file_operations_from_many_threads_on_one_node_all_get_their_own_answer(node_pair, fleet_session):
    """Adoption and the distribution read one node's files from several threads at once over its one
    SFTP channel: each gets its own file's content, none a "Server connection dropped"."""
    from concurrent.futures import ThreadPoolExecutor

    node = node_pair.serve
    base = "~/spark-test-threads"
    for i in range(16):
        fleet_session.put_text(node, f"{base}/f{i}", f"file {i}\n" * (i * 500 + 1))

    def work(i: int) -> bool:
        return all(fleet_session.read_text(node, f"{base}/f{i}") == f"file {i}\n" * (i * 500 + 1)
                   and fleet_session.exists(node, f"{base}/f{i}") for _ in range(15))

    try:
        with ThreadPoolExecutor(max_workers=16) as pool:
            assert all(pool.map(work, range(16)))
    finally:
        fleet_session.run(node, ["rm", "-rf", fleet_session.expand(node, base)], log=False)


def test_host_key_mismatch_is_refused(node_pair, tmp_path):
    node = node_pair.fleet.node(node_pair.serve)
    real = paramiko.HostKeys(str(Path(node.known_hosts).expanduser()))
    name = remote.known_hosts_name(node.host, node.port)
    entries = real.lookup(name)
    assert entries, f"{name} must be in the sim's known_hosts"
    forged = tmp_path / "known_hosts"
    lines = []
    for key_type in entries:
        other = tmp_path / f"forged-{_KEYGEN_TYPE[key_type]}"
        subprocess.run(["ssh-keygen", "-q", "-t", _KEYGEN_TYPE[key_type], "-N", "", "-f", str(other)], check=True)
        key_type_read, key_b64 = other.with_suffix(".pub").read_text().split()[:2]
        lines.append(f"{name} {key_type_read} {key_b64}")
    forged.write_text("\n".join(lines) + "\n")
    fleet = _with_known_hosts(node_pair.fleet, node.name, str(forged))
    with FleetSession(fleet) as s, pytest.raises(HostKeyError) as ei:
        s.run(node.name, ["true"])
    msg = str(ei.value)
    assert "MISMATCH" in msg and node.name in msg and str(forged) in msg and "ssh-keygen -R" in msg


def test_unknown_host_is_refused_unless_opted_in(node_pair, tmp_path, caplog):
    node = node_pair.fleet.node(node_pair.serve)
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    fleet = _with_known_hosts(node_pair.fleet, node.name, str(empty))
    with FleetSession(fleet) as s, pytest.raises(HostKeyError, match=rf"node {node.name}: host .* is not in {empty}"):
        s.run(node.name, ["true"])
    assert empty.read_text() == ""
    with caplog.at_level(logging.WARNING, logger="spark_pipelines.remote"):
        with FleetSession(fleet, SshSettings(trust_unknown_host_keys=True)) as s:
            assert s.run(node.name, ["echo", "in"], log=False).stdout == "in\n"
    assert "TRUSTING UNKNOWN host key" in caplog.text
    pinned = empty.read_text()
    assert remote.known_hosts_name(node.host, node.port) in pinned
    with FleetSession(fleet) as s:  # pinned now: the strict default accepts it
        assert s.run(node.name, ["true"], log=False).ok


def test_unreachable_node_fails_after_connect_retries_only(node_pair):
    node = node_pair.fleet.node(node_pair.serve)
    dead = node.model_copy(update={"host": "127.0.0.1", "port": 9})  # nothing listens on discard
    fleet = node_pair.fleet.model_copy(update={"nodes": tuple(dead if n.name == node.name else n for n in node_pair.fleet.nodes)})
    t0 = time.monotonic()
    with FleetSession(fleet, SshSettings(connect_retries=2, retry_backoff_s=0.2, connect_timeout_s=2)) as s:
        with pytest.raises(Exception, match=rf"node {node.name}: cannot reach .* after 3 attempts"):
            s.run(node.name, ["true"])
        assert s.commands == []  # nothing ran, so nothing is recorded
    assert 0.5 < time.monotonic() - t0 < 15


def test_dagster_resource_streams_into_the_run_log(sim_fleet, node_pair, tmp_path):
    fleet_path = sim_fleet.fleet_file
    log_path = tmp_path / "commands.jsonl"

    @dg.asset
    def probe(ssh: FleetSSH) -> str:
        return ssh.run(node_pair.build, ["sh", "-c", "echo first; sleep 0.2; echo second"]).stdout

    instance = dg.DagsterInstance.ephemeral()
    result = dg.materialize(
        [probe],
        resources={"ssh": FleetSSH(fleet_path=str(fleet_path), command_log_path=str(log_path),
                                   output_dir=str(tmp_path / "out"))},
        instance=instance,
    )
    assert result.success
    assert result.output_for_node("probe") == "first\nsecond\n"
    messages = [line for e in instance.all_logs(result.run_id) for line in e.user_message.split("\n")]
    node = node_pair.build
    assert f"[{node}] first" in messages and f"[{node}] second" in messages
    assert messages.index(f"[{node}] first") < messages.index(f"[{node}] second")
    records = read_command_log(log_path)
    assert [(r.node, r.argv[0], r.exit_status) for r in records] == [(node, "sh", 0)]
    # The whole output is kept where the resource says, and the command log points to it.
    assert records[0].output and Path(records[0].output).parent == tmp_path / "out"
    assert Path(records[0].output).read_text().splitlines()[1:3] == ["first", "second"]
