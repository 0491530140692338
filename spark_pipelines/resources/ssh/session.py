"""The session: one verified connection per node for a run, commands streamed line by line.

`FleetSession` works without Dagster (the CLI uses it directly); `FleetSSH` is the Dagster resource
that opens one per step. Every command is bounded: its own timeout or the settings' default, killed
ON THE NODE by coreutils `timeout`, with a local deadline and the dead-peer watchdog behind it.

Secrets: a command's secret env values (e.g. HF_TOKEN) travel in a file written over SFTP into a
0700 directory with mode 0600, which the command sources and deletes before it execs. They never
appear in a command line (not in our logs, not in `ps` on the node). Stdin was the other option,
but it is needed for the commands' own input (e.g. piping a config).
"""

from __future__ import annotations

import json
import logging
import os
import select
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import paramiko

from spark_pipelines.core import remote
from spark_pipelines.core.fleet import Fleet, Gateway, Node, SshTarget
from spark_pipelines.core.launch import expand_home
from spark_pipelines.core.errors import first_line
from spark_pipelines.resources.ssh.connection import Connection, SshSettings, connect
from spark_pipelines.resources.ssh.errors import (
    NodeUnresponsive,
    RemoteCommandError,
    RemoteCommandTimeout,
    SudoPasswordRequired,
)
from spark_pipelines.resources.ssh.files import NodeFiles
from spark_pipelines.resources.ssh.output import CommandOutput, LineSink, output_root

GATEWAY_KEY = "gateway"
# After the node-side `timeout` (and its -k grace) should have ended the command, how long to wait
# for the channel to close before giving up on it locally.
LOCAL_GRACE_S = 15

TIMEOUT_ADVICE = (
    "check what it waits on, on the node (a frozen dockerd for a docker command, a stalled download or "
    "link); if the step legitimately takes longer, give it a longer limit (core.remote holds the runbook's)"
)

OnLine = Callable[[str, str], bool | None]  # (stream 'stdout'|'stderr', line) -> True stops the command


@dataclass(frozen=True)
class CommandRecord:
    """One remote command of this session: what "nothing heavy reran" is checked against."""

    node: str
    argv: tuple[str, ...]
    exit_status: int | None
    seconds: float
    output: str | None = None  # the local file with the command's whole output (logged commands)


@dataclass
class CommandResult:
    node: str
    command: str  # quoted, as logged (secret values never included)
    exit_status: int | None
    stdout: str
    stderr: str
    tail: str  # last lines of stdout and stderr interleaved as they arrived
    seconds: float
    stopped: bool = False  # on_line asked to stop before the command ended
    output_path: str | None = None  # whole output, redacted, mode 0600 (None for log=False commands)

    @property
    def ok(self) -> bool:
        return self.exit_status == 0


class FleetSession(NodeFiles):
    """Connections to the fleet's nodes (and the gateway host) for one run, or one CLI command."""

    def __init__(self, fleet: Fleet, settings: SshSettings | None = None, logger: Any = None) -> None:
        self.fleet = fleet
        self.settings = settings if settings is not None else SshSettings()
        self.log = logger or logging.getLogger("spark_pipelines.remote")
        self.commands: list[CommandRecord] = []
        self.output_dir = output_root(self.settings.output_dir)
        self._conns: dict[str, Connection] = {}
        self._sftp: dict[str, paramiko.SFTPClient] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        # Asked before any use of a target's connection, with (session, key): one that raises stops
        # the command there (resources.lease: a run whose lease on the node ended under it must not
        # reconnect and go on changing the node another run may hold now).
        self.guards: list[Callable[[FleetSession, str], None]] = []
        # Whether the run with this id has ended, as the Dagster instance the session's run belongs
        # to knows it (None: no instance to ask). A procedure journal whose node was down for it is
        # finished as a dead run's only when its run ended (runbook/journal.py).
        self.run_ended: Callable[[str], bool] | None = None
        if self.settings.trust_unknown_host_keys:
            self.log.warning(
                "trust_unknown_host_keys is on: unknown SSH host keys will be accepted and pinned "
                "(a first connection could be intercepted)"
            )

    # -- lifecycle --

    def __enter__(self) -> FleetSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            for sftp in self._sftp.values():
                try:
                    sftp.close()
                except Exception:  # closing a dead connection must not mask the real error
                    pass
            for conn in self._conns.values():
                conn.close()
            self._sftp.clear()
            self._conns.clear()

    # -- targets --

    def target(self, node: str | SshTarget) -> tuple[str, SshTarget]:
        """(cache key, ssh target) of a node name, a Node, or the gateway."""
        if isinstance(node, Node):
            return node.name, node
        if isinstance(node, Gateway):
            return GATEWAY_KEY, node
        if isinstance(node, SshTarget):
            return f"{node.user}@{node.host}:{node.port}", node
        if node == GATEWAY_KEY:
            return GATEWAY_KEY, self.fleet.gateway
        n = self.fleet.node(node)  # FleetError names the known nodes
        return n.name, n

    def expand(self, node: str | SshTarget, path: str) -> str:
        """A node path with `~` expanded for that node's user."""
        _, t = self.target(node)
        return expand_home(path, t.home_dir)

    # -- connecting --

    def _node_lock(self, key: str) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(key, threading.Lock())

    def connection(self, node: str | SshTarget) -> Connection:
        """The node's connection, opened (and host-key verified) on first use, reused afterwards."""
        key, target = self.target(node)
        with self._node_lock(key):
            c = self._conns.get(key)
            if c is not None and not c.is_active():
                c.close()  # the node went away (reboot) or stopped answering: reconnect, nothing is replayed
                self._sftp.pop(key, None)
                del self._conns[key]
                c = None
            for guard in self.guards:  # after a dead connection closed: a lease on it is gone too
                guard(self, key)
            if c is not None:
                return c
            c = connect(key, target, self.settings, self.log)
            self._conns[key] = c
            return c

    def client(self, node: str | SshTarget) -> paramiko.SSHClient:
        return self.connection(node).client

    def _is_dead(self, key: str) -> bool:
        c = self._conns.get(key)
        return c is not None and c.liveness.dead

    def _forget(self, key: str) -> None:
        with self._node_lock(key):
            c = self._conns.pop(key, None)
            self._sftp.pop(key, None)
            if c:
                c.close()

    def _open_channel(self, node: str | SshTarget, command: str) -> tuple[Connection, paramiko.Channel]:
        key, _ = self.target(node)
        for attempt in (0, 1):
            conn = self.connection(node)
            transport = conn.transport
            try:
                assert transport is not None
                return conn, transport.open_session(timeout=self.settings.connect_timeout_s)
            except (paramiko.SSHException, EOFError, OSError, AssertionError):
                if transport is not None and transport.is_active() and not conn.liveness.dead:
                    # Connected, yet no answer to "open a channel": sshd is frozen or overloaded.
                    # Reconnecting would hang at the banner the same way; say so instead.
                    self._forget(key)
                    raise NodeUnresponsive(key, self.settings.connect_timeout_s, f"`{command}`") from None
                # The cached connection died between commands; reopen once. No command was sent.
                self._forget(key)
                if attempt:
                    raise
        raise AssertionError("unreachable")

    # -- commands --

    def _sink(self, log: Any) -> LineSink | None:
        if log is True:
            return self.log.info
        if not log:
            return None
        if callable(log):
            return log
        return log.info

    def run(
        self,
        node: str | SshTarget,
        argv: Sequence[str],
        *,
        sudo: bool = False,
        timeout: float | None = None,
        check: bool = True,
        stdin: bytes | str | None = None,
        env: Mapping[str, str] | None = None,
        secret_env: Mapping[str, str] | None = None,
        log: Any = True,
        on_line: OnLine | None = None,
    ) -> CommandResult:
        """Run argv on node, streaming its output to the log in batches as it arrives.

        env values are shown in the logged command; secret_env values never are (see module doc).
        timeout (default: settings.command_timeout_s) kills the command ON THE NODE. on_line(stream,
        line) returning True stops following the command (used to wait for a log line). A logged
        command's whole output goes to a local file (result.output_path); log=False commands are
        probes whose output the caller holds, and get none."""
        key, target = self.target(node)
        user_argv = remote.check_argv(argv)
        argv_run = remote.with_env(user_argv, env or {})
        if sudo:
            argv_run = remote.sudo_argv(argv_run)
        command = remote.quote_argv(argv_run)
        secret_values = list((secret_env or {}).values())
        secret_file = None
        if secret_env:
            command += f"  [secret env: {', '.join(sorted(secret_env))}]"
        limit = float(timeout) if timeout else self.settings.command_timeout_s
        conn, chan = self._open_channel(node, command)  # fails before anything ran: nothing recorded
        if secret_env:
            try:
                secret_file = self._write_secret_env(node, secret_env)
            except BaseException:
                chan.close()
                raise
            argv_run = remote.source_env_file_argv(secret_file, argv_run)
        argv_run = remote.with_timeout(argv_run, limit)
        sink = self._sink(log)
        if sink:
            sink(f"[{key}] $ {command}")
        out = CommandOutput(key, command, user_argv[0].rsplit("/", 1)[-1], self.output_dir if sink else None,
                            sink, secret_values, key, keep=self.fleet.retention)

        started = time.monotonic()
        exit_status: int | None = None
        stopped = False
        splitters = {"stdout": remote.LineSplitter(), "stderr": remote.LineSplitter()}
        footer = None

        def emit(stream: str, lines: list[str]) -> bool:
            for line in lines:
                line = out.add(stream, line)
                if on_line is not None and on_line(stream, line):
                    return True
            return False

        def unresponsive(conn: Connection) -> NodeUnresponsive:
            return NodeUnresponsive(key, conn.liveness.quiet_s(), f"`{command}`")

        try:
            try:
                chan.exec_command(remote.quote_argv(argv_run))
                writer = self._feed_stdin(chan, stdin)
                hard_deadline = started + limit + LOCAL_GRACE_S
                while True:
                    select.select([chan], [], [], 0.5)
                    if chan.recv_ready():
                        if emit("stdout", splitters["stdout"].feed(chan.recv(65536))):
                            stopped = True
                            break
                    if chan.recv_stderr_ready():
                        if emit("stderr", splitters["stderr"].feed(chan.recv_stderr(65536))):
                            stopped = True
                            break
                    if chan.recv_ready() or chan.recv_stderr_ready():
                        continue
                    out.tick()
                    if conn.liveness.dead:
                        raise unresponsive(conn)
                    if chan.exit_status_ready() and (chan.eof_received or chan.closed):
                        break
                    if chan.closed:
                        break
                    if time.monotonic() > hard_deadline:
                        raise RemoteCommandTimeout(
                            key, command, None, out.tail.text(),
                            f"node {key}: no end of command after {limit:.0f}s (+{LOCAL_GRACE_S}s grace); "
                            f"connection closed: {command}\n{TIMEOUT_ADVICE}\n--- last output ---\n{out.tail.text()}",
                        )
                if not stopped:
                    for stream, sp in splitters.items():
                        emit(stream, sp.flush())
                    exit_status = chan.recv_exit_status()
                    if conn.liveness.dead:
                        raise unresponsive(conn)
                if writer is not None:
                    writer.join(timeout=5)
            except (paramiko.SSHException, EOFError, OSError):
                if conn.liveness.dead:
                    raise unresponsive(conn) from None
                raise
            finally:
                chan.close()
        except BaseException as e:
            footer = first_line(e)
            raise
        finally:
            seconds = time.monotonic() - started
            out.close(footer or f"exit {exit_status} after {seconds:.1f}s")
            path = str(out.path) if out.path else None
            self._record(CommandRecord(key, tuple(user_argv), exit_status, round(seconds, 3), path))
            if secret_file is not None:
                self._remove_quietly(node, secret_file)
        if sink and not stopped:
            sink(f"[{key}] exit {exit_status} after {seconds:.1f}s")
        result = CommandResult(
            node=key,
            command=command,
            exit_status=exit_status,
            stdout=out.text("stdout"),
            stderr=out.text("stderr"),
            tail=out.tail.text(),
            seconds=seconds,
            stopped=stopped,
            output_path=path,
        )
        if stopped or exit_status == 0 or not check:
            return result
        if exit_status in remote.TIMEOUT_EXIT_CODES:
            raise RemoteCommandTimeout(
                key, command, exit_status, result.tail,
                f"node {key}: command killed after its {limit:.0f}s timeout: {command}\n{TIMEOUT_ADVICE}"
                f"{f' (whole output: {path})' if path else ''}\n--- last output ---\n{result.tail}",
            )
        if sudo and remote.sudo_wants_password(result.stderr):
            program = self._which(node, user_argv[0] if not env else "env")
            line = remote.sudoers_line(target.user, program)
            raise SudoPasswordRequired(
                key, command, exit_status, result.tail, remote.sudo_advice(key, target.user, program), line
            )
        raise RemoteCommandError(key, command, exit_status, result.tail)

    def _which(self, node: str | SshTarget, program: str) -> str:
        if program.startswith("/"):
            return program
        r = self.run(node, ["command", "-v", program], check=False, log=False)
        path = r.stdout.strip().splitlines()[-1] if r.ok and r.stdout.strip() else ""
        return path if path.startswith("/") else f"/usr/bin/{program}"

    @staticmethod
    def _feed_stdin(chan: paramiko.Channel, stdin: bytes | str | None) -> threading.Thread | None:
        if stdin is None:
            chan.shutdown_write()  # commands that read stdin see EOF instead of waiting forever
            return None
        data = stdin.encode() if isinstance(stdin, str) else stdin

        # A separate thread: a large stdin and a chatty command would otherwise deadlock on
        # full SSH windows in both directions.
        def feed() -> None:
            try:
                chan.sendall(data)
                chan.shutdown_write()
            except (OSError, EOFError, paramiko.SSHException):
                pass  # the command ended early; its exit status tells the story

        t = threading.Thread(target=feed, daemon=True)
        t.start()
        return t

    def record_command(self, node: str, argv: Sequence[str], exit_status: int | None, seconds: float) -> None:
        """A command run on a channel of its own (a relay fed while it runs), in the command log."""
        key, _ = self.target(node)
        self._record(CommandRecord(key, tuple(argv), exit_status, round(seconds, 3)))

    def _record(self, rec: CommandRecord) -> None:
        with self._lock:
            self.commands.append(rec)
        path = self.settings.command_log_path
        if path:
            line = json.dumps({"node": rec.node, "argv": list(rec.argv), "exit": rec.exit_status,
                               "seconds": rec.seconds, "output": rec.output, "at": time.time()})
            # O_APPEND of one short line: safe with several step processes writing the same file.
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)
