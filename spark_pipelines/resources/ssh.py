"""SSH to the fleet's nodes: one verified paramiko connection per node, commands streamed line by line.

`FleetSession` holds the logic and works without Dagster (the CLI uses it directly);
`FleetSSH` is the thin Dagster resource that opens one session per step and closes it after.

Secrets: a command's secret env values (e.g. HF_TOKEN) travel in a file written over SFTP into a
0700 directory with mode 0600, which the command sources and deletes before it execs. They never
appear in a command line (not in our logs, not in `ps` on the node). Stdin was the other option,
but it is needed for the commands' own input (e.g. piping a config).
"""

from __future__ import annotations

import json
import logging
import os
import secrets as pysecrets
import select
import socket
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import paramiko
from pydantic import Field, PrivateAttr

from spark_pipelines.core import remote
from spark_pipelines.core.launch import expand_home
from spark_pipelines.core.fleet import Fleet, Gateway, Node, SshTarget, load_fleet

GATEWAY_KEY = "gateway"
# Keep at most this much stdout text in a result; the tail and the log carry the rest.
STDOUT_CAPTURE_BYTES = 8 * 1024 * 1024
SECRETS_DIR = "~/.cache/spark-pipelines/secrets"

LineSink = Callable[[str], None]
OnLine = Callable[[str, str], bool | None]  # (stream 'stdout'|'stderr', line) -> True stops the command


# -- errors ------------------------------------------------------------------------------------


class RemoteError(Exception):
    """Something on (or on the way to) a node failed; the message says which node and what to do."""


class NodeConnectError(RemoteError):
    """No SSH session could be opened to a node."""


class HostKeyError(NodeConnectError):
    """The node's host key is unknown or does not match known_hosts: refused, never retried."""


class RemoteFileError(RemoteError):
    """A file on a node could not be read or written."""


class RemoteCommandError(RemoteError):
    """A remote command exited non-zero. Carries node, the quoted command, exit status and output tail."""

    def __init__(self, node: str, command: str, exit_status: int | None, tail: str, message: str | None = None):
        self.node = node
        self.command = command
        self.exit_status = exit_status
        self.tail = tail
        super().__init__(
            message
            or f"node {node}: command exited with status {exit_status}: {command}\n--- last output ---\n{tail}"
        )


class RemoteCommandTimeout(RemoteCommandError):
    """The command ran past its timeout and was killed on the node."""


class SudoPasswordRequired(RemoteCommandError):
    """`sudo -n` wanted a password: the message holds the sudoers line to add."""

    def __init__(self, node: str, command: str, exit_status: int | None, tail: str, advice: str, line: str):
        self.sudoers_line = line
        super().__init__(node, command, exit_status, tail, f"{advice}\ncommand: {command}")


# -- results -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommandRecord:
    """One remote command of this session: what "nothing heavy reran" is checked against."""

    node: str
    argv: tuple[str, ...]
    exit_status: int | None
    seconds: float


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

    @property
    def ok(self) -> bool:
        return self.exit_status == 0


@dataclass(frozen=True)
class SshSettings:
    connect_timeout_s: float = 15.0
    command_timeout_s: float | None = None  # default for run(); None = no limit (builds take 90 min)
    keepalive_s: int = 30
    connect_retries: int = 3
    retry_backoff_s: float = 1.0
    trust_unknown_host_keys: bool = False
    command_log_path: str | None = None  # JSON lines, one per command, shared by every step of a run


def _fingerprint(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.fingerprint}"


class _RefuseUnknownHost(paramiko.MissingHostKeyPolicy):
    def __init__(self, node: str, known_hosts: Path):
        self.node, self.known_hosts = node, known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise HostKeyError(
            f"node {self.node}: host {hostname} is not in {self.known_hosts} (it offered {_fingerprint(key)}). "
            f"Refusing to trust an unknown key. Compare that fingerprint with the node's own "
            f"(`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub` on its console), then add it with "
            f"`ssh-keyscan -p PORT HOST >> {self.known_hosts}`; or set trust_unknown_host_keys=true to accept "
            f"it on first use (not recommended)"
        )


class _TrustOnFirstUse(paramiko.MissingHostKeyPolicy):
    """Explicit opt-in: accept an unknown key, say so loudly, and pin it in known_hosts."""

    def __init__(self, node: str, known_hosts: Path, port: int, warn: Callable[[str], None]):
        self.node, self.known_hosts, self.port, self.warn = node, known_hosts, port, warn

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        self.warn(
            f"node {self.node}: TRUSTING UNKNOWN host key {_fingerprint(key)} for {hostname} "
            f"(trust_unknown_host_keys=true); pinned in {self.known_hosts}"
        )
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with self.known_hosts.open("a") as fh:
            fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def _local_path(path: str) -> Path:
    return Path(os.path.expanduser(path))


# -- the session -------------------------------------------------------------------------------


class FleetSession:
    """Connections to the fleet's nodes (and the gateway host) for one run, or one CLI command."""

    def __init__(self, fleet: Fleet, settings: SshSettings | None = None, logger: Any = None) -> None:
        self.fleet = fleet
        self.settings = settings or SshSettings()
        self.log = logger or logging.getLogger("spark_pipelines.remote")
        self.commands: list[CommandRecord] = []
        self._clients: dict[str, paramiko.SSHClient] = {}
        self._sftp: dict[str, paramiko.SFTPClient] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
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
            for client in self._clients.values():
                client.close()
            self._sftp.clear()
            self._clients.clear()

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

    def client(self, node: str | SshTarget) -> paramiko.SSHClient:
        """The node's connection, opened (and host-key verified) on first use, reused afterwards."""
        key, target = self.target(node)
        with self._node_lock(key):
            c = self._clients.get(key)
            if c is not None:
                t = c.get_transport()
                if t is not None and t.is_active():
                    return c
                c.close()  # the node went away (reboot): reconnect, the old commands are not replayed
                self._sftp.pop(key, None)
            c = self._connect(key, target)
            self._clients[key] = c
            return c

    def _connect(self, key: str, t: SshTarget) -> paramiko.SSHClient:
        s = self.settings
        known_hosts = _local_path(t.known_hosts)
        key_file: str | None = None
        if t.key_path is not None:
            kp = _local_path(t.key_path)
            if not kp.is_file():
                raise NodeConnectError(
                    f"node {key}: key_path {kp} does not exist; fix key_path in the fleet file, or set it "
                    f"to null to use ssh-agent"
                )
            key_file = str(kp)
        elif not os.environ.get("SSH_AUTH_SOCK"):
            raise NodeConnectError(
                f"node {key}: no key_path and no ssh-agent (SSH_AUTH_SOCK is unset); set key_path in the "
                f"fleet file or start ssh-agent and add the key"
            )
        last: Exception | None = None
        for attempt in range(s.connect_retries + 1):
            client = paramiko.SSHClient()
            if known_hosts.is_file():
                client.load_host_keys(str(known_hosts))
            elif not s.trust_unknown_host_keys:
                raise HostKeyError(
                    f"node {key}: known_hosts file {known_hosts} does not exist; add the node's verified "
                    f"host key there (ssh-keyscan -p {t.port} {t.host}, compare the fingerprint on the node)"
                )
            if s.trust_unknown_host_keys:
                client.set_missing_host_key_policy(_TrustOnFirstUse(key, known_hosts, t.port, self.log.warning))
            else:
                client.set_missing_host_key_policy(_RefuseUnknownHost(key, known_hosts))
            try:
                client.connect(
                    t.host,
                    port=t.port,
                    username=t.user,
                    key_filename=key_file,
                    allow_agent=key_file is None,
                    look_for_keys=False,
                    timeout=s.connect_timeout_s,
                    banner_timeout=s.connect_timeout_s,
                    auth_timeout=s.connect_timeout_s,
                )
            except HostKeyError:
                client.close()
                raise
            except paramiko.BadHostKeyException as e:
                client.close()
                name = remote.known_hosts_name(t.host, t.port)
                raise HostKeyError(
                    f"node {key}: HOST KEY MISMATCH for {name}: it offered {_fingerprint(e.key)} but "
                    f"{known_hosts} holds {_fingerprint(e.expected_key)}. Refusing to connect: the node was "
                    f"reinstalled, or someone is intercepting the connection. If the node was reinstalled, "
                    f"check its new fingerprint on its console, then run "
                    f"`ssh-keygen -R '{name}' -f {known_hosts}` and add the new key"
                ) from None
            except paramiko.AuthenticationException as e:
                client.close()
                how = f"key {key_file}" if key_file else "ssh-agent keys"
                raise NodeConnectError(
                    f"node {key}: {t.user}@{t.host}:{t.port} refused {how} ({e}); add the public key to "
                    f"~{t.user}/.ssh/authorized_keys on the node, or fix user/key_path in the fleet file"
                ) from None
            except (OSError, socket.timeout, paramiko.SSHException, EOFError) as e:
                # Connection-level failures only: nothing ran yet, so retrying is safe.
                client.close()
                last = e
                if attempt < s.connect_retries:
                    delay = s.retry_backoff_s * (2**attempt)
                    self.log.warning(
                        f"node {key}: connecting to {t.host}:{t.port} failed ({e}); retry "
                        f"{attempt + 1}/{s.connect_retries} in {delay:.1f}s"
                    )
                    time.sleep(delay)
                continue
            transport = client.get_transport()
            if transport is not None and s.keepalive_s:
                transport.set_keepalive(s.keepalive_s)
            return client
        raise NodeConnectError(
            f"node {key}: cannot reach {t.user}@{t.host}:{t.port} after {s.connect_retries + 1} attempts "
            f"({last}); check that the node is up and sshd listens on port {t.port}"
        )

    def _open_channel(self, node: str | SshTarget) -> paramiko.Channel:
        key, _ = self.target(node)
        for attempt in (0, 1):
            transport = self.client(node).get_transport()
            try:
                assert transport is not None
                return transport.open_session(timeout=self.settings.connect_timeout_s)
            except (paramiko.SSHException, EOFError, OSError, AssertionError):
                # The cached connection died between commands; reopen once. No command was sent.
                if attempt:
                    raise
                with self._node_lock(key):
                    c = self._clients.pop(key, None)
                    self._sftp.pop(key, None)
                    if c:
                        c.close()
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
        """Run argv on node, streaming each output line to the log as it arrives.

        env values are shown in the logged command; secret_env values never are (see module doc).
        timeout kills the command ON THE NODE (coreutils `timeout`). on_line(stream, line) returning
        True stops following the command (used to wait for a log line)."""
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
            secret_file = self._write_secret_env(node, secret_env)
            argv_run = remote.source_env_file_argv(secret_file, argv_run)
        timeout = timeout if timeout is not None else self.settings.command_timeout_s
        if timeout:
            argv_run = remote.with_timeout(argv_run, timeout)
        sink = self._sink(log)
        if sink:
            sink(f"[{key}] $ {command}")

        started = time.monotonic()
        exit_status: int | None = None
        stopped = False
        tail = remote.OutputTail()
        out_buf: list[str] = []
        out_bytes = 0
        err_buf: list[str] = []
        splitters = {"stdout": remote.LineSplitter(), "stderr": remote.LineSplitter()}
        chan = self._open_channel(node)
        try:
            chan.exec_command(remote.quote_argv(argv_run))
            writer = self._feed_stdin(chan, stdin)

            def emit(stream: str, lines: list[str]) -> bool:
                nonlocal out_bytes
                for line in lines:
                    line = remote.redact(line, secret_values)
                    tail.add(line)
                    if stream == "stdout":
                        if out_bytes < STDOUT_CAPTURE_BYTES:
                            out_buf.append(line)
                            out_bytes += len(line) + 1
                    elif sum(map(len, err_buf)) < STDOUT_CAPTURE_BYTES:
                        err_buf.append(line)
                    if sink:
                        sink(f"[{key}{'' if stream == 'stdout' else ' stderr'}] {line}")
                    if on_line is not None and on_line(stream, line):
                        return True
                return False

            hard_deadline = started + timeout + 15 if timeout else None
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
                if chan.exit_status_ready() and (chan.eof_received or chan.closed):
                    break
                if chan.closed:
                    break
                if hard_deadline and time.monotonic() > hard_deadline:
                    raise RemoteCommandTimeout(
                        key, command, None, tail.text(),
                        f"node {key}: no end of command after {timeout:.0f}s (+15s grace); connection "
                        f"closed: {command}\n--- last output ---\n{tail.text()}",
                    )
            if not stopped:
                for stream, sp in splitters.items():
                    emit(stream, sp.flush())
                exit_status = chan.recv_exit_status()
            if writer is not None:
                writer.join(timeout=5)
        finally:
            chan.close()
            seconds = time.monotonic() - started
            self._record(CommandRecord(key, tuple(user_argv), exit_status, round(seconds, 3)))
            if secret_file is not None:
                self._remove_quietly(node, secret_file)
        if sink and not stopped:
            sink(f"[{key}] exit {exit_status} after {seconds:.1f}s")
        result = CommandResult(
            node=key,
            command=command,
            exit_status=exit_status,
            stdout="\n".join(out_buf) + ("\n" if out_buf else ""),
            stderr="\n".join(err_buf) + ("\n" if err_buf else ""),
            tail=tail.text(),
            seconds=seconds,
            stopped=stopped,
        )
        if stopped or exit_status == 0 or not check:
            return result
        if timeout and exit_status in remote.TIMEOUT_EXIT_CODES:
            raise RemoteCommandTimeout(
                key, command, exit_status, result.tail,
                f"node {key}: command killed after its {timeout:.0f}s timeout: {command}\n"
                f"--- last output ---\n{result.tail}",
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

    def _record(self, rec: CommandRecord) -> None:
        with self._lock:
            self.commands.append(rec)
        path = self.settings.command_log_path
        if path:
            line = json.dumps({"node": rec.node, "argv": list(rec.argv), "exit": rec.exit_status,
                               "seconds": rec.seconds, "at": time.time()})
            # O_APPEND of one short line: safe with several step processes writing the same file.
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, (line + "\n").encode())
            finally:
                os.close(fd)

    # -- files (SFTP) --

    def sftp(self, node: str | SshTarget) -> paramiko.SFTPClient:
        key, _ = self.target(node)
        client = self.client(node)
        with self._node_lock(key):
            s = self._sftp.get(key)
            if s is None:
                s = client.open_sftp()
                self._sftp[key] = s
            return s

    def _mkdirs(self, sftp: paramiko.SFTPClient, directory: str, mode: int = 0o755) -> None:
        parts = [p for p in directory.split("/") if p]
        cur = ""
        for p in parts:
            cur += "/" + p
            try:
                sftp.stat(cur)
            except FileNotFoundError:
                sftp.mkdir(cur, mode)

    def put_text(self, node: str | SshTarget, path: str, text: str, mode: int = 0o644) -> str:
        """Write text to path on node atomically (temp file + rename), creating parent directories."""
        key, _ = self.target(node)
        full = self.expand(node, path)
        sftp = self.sftp(node)
        parent = full.rsplit("/", 1)[0] or "/"
        tmp = f"{full}.tmp-{pysecrets.token_hex(4)}"
        try:
            self._mkdirs(sftp, parent)
            with sftp.open(tmp, "w") as fh:
                sftp.chmod(tmp, mode)  # before the content goes in: a 0600 file is never briefly 0644
                fh.write(text.encode())
            sftp.posix_rename(tmp, full)
        except OSError as e:
            self._remove_quietly(node, tmp)
            raise RemoteFileError(f"node {key}: cannot write {full}: {e}") from None
        return full

    def read_bytes(self, node: str | SshTarget, path: str, offset: int = 0, length: int | None = None) -> bytes:
        key, _ = self.target(node)
        full = self.expand(node, path)
        try:
            with self.sftp(node).open(full, "rb") as fh:
                if offset:
                    fh.seek(offset)
                return fh.read(length) if length is not None else fh.read()
        except FileNotFoundError:
            raise RemoteFileError(f"node {key}: {full} does not exist") from None
        except OSError as e:
            raise RemoteFileError(f"node {key}: cannot read {full}: {e}") from None

    def read_text(self, node: str | SshTarget, path: str) -> str:
        return self.read_bytes(node, path).decode("utf-8", "replace")

    def exists(self, node: str | SshTarget, path: str) -> bool:
        try:
            self.sftp(node).stat(self.expand(node, path))
            return True
        except FileNotFoundError:
            return False

    def _remove_quietly(self, node: str | SshTarget, path: str) -> None:
        try:
            self.sftp(node).remove(path)
        except (OSError, paramiko.SSHException, RemoteError):
            pass

    def _write_secret_env(self, node: str | SshTarget, secret_env: Mapping[str, str]) -> str:
        sftp = self.sftp(node)
        directory = self.expand(node, SECRETS_DIR)
        self._mkdirs(sftp, directory, 0o700)
        if stat.S_IMODE(sftp.stat(directory).st_mode or 0) & 0o077:
            sftp.chmod(directory, 0o700)
        path = f"{directory}/env-{pysecrets.token_hex(8)}"
        with sftp.open(path, "w") as fh:
            sftp.chmod(path, 0o600)
            fh.write(remote.secret_env_file(secret_env).encode())
        return path


# -- Dagster resource --------------------------------------------------------------------------


class FleetSSH(dg.ConfigurableResource):
    """SSH to every node of the fleet (and the gateway host); see FleetSession for the behaviour."""

    fleet_path: str
    connect_timeout_s: float = 15.0
    command_timeout_s: float | None = Field(default=None, description="default per-command limit; None = none")
    keepalive_s: int = 30
    connect_retries: int = 3
    trust_unknown_host_keys: bool = Field(
        default=False, description="accept and pin unknown host keys (logged as a warning); off = refuse"
    )
    command_log_path: str | None = Field(
        default=None, description="append every remote command as a JSON line (readable across step processes)"
    )

    _session: FleetSession | None = PrivateAttr(default=None)

    def settings(self) -> SshSettings:
        return SshSettings(
            connect_timeout_s=self.connect_timeout_s,
            command_timeout_s=self.command_timeout_s,
            keepalive_s=self.keepalive_s,
            connect_retries=self.connect_retries,
            trust_unknown_host_keys=self.trust_unknown_host_keys,
            command_log_path=self.command_log_path,
        )

    def open_session(self, logger: Any = None) -> FleetSession:
        """A new session, for use outside a Dagster step (the CLI): `with res.open_session() as s:`."""
        return FleetSession(load_fleet(self.fleet_path), self.settings(), logger or dg.get_dagster_logger())

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        self._session = self.open_session(context.log)

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    @property
    def session(self) -> FleetSession:
        if self._session is None:
            self._session = self.open_session()
        return self._session

    @property
    def fleet(self) -> Fleet:
        return self.session.fleet

    @property
    def commands(self) -> list[CommandRecord]:
        return self.session.commands

    def run(self, node: str | SshTarget, argv: Sequence[str], **kwargs: Any) -> CommandResult:
        return self.session.run(node, argv, **kwargs)

    def put_text(self, node: str | SshTarget, path: str, text: str, mode: int = 0o644) -> str:
        return self.session.put_text(node, path, text, mode)

    def read_text(self, node: str | SshTarget, path: str) -> str:
        return self.session.read_text(node, path)


def read_command_log(path: str | os.PathLike[str]) -> list[CommandRecord]:
    """The records a FleetSSH with command_log_path wrote (every step process of a run)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        d = json.loads(line)
        out.append(CommandRecord(d["node"], tuple(d["argv"]), d["exit"], d["seconds"]))
    return out


__all__ = [
    "CommandRecord",
    "CommandResult",
    "FleetSSH",
    "FleetSession",
    "HostKeyError",
    "NodeConnectError",
    "RemoteCommandError",
    "RemoteCommandTimeout",
    "RemoteError",
    "RemoteFileError",
    "SshSettings",
    "SudoPasswordRequired",
    "read_command_log",
]
