"""One verified SSH connection to a node, and the watchdog that notices when the node stops answering.

TCP alone cannot tell a frozen sshd (SIGSTOP, a wedged kernel) from a quiet one: the socket stays
open and a read waits forever. paramiko's own keepalive sends packets that expect no answer, so it
never notices either. Here every connection reads through a socket that remembers when bytes last
arrived, and a watchdog thread asks the server for an answer (`keepalive@openssh.com` with
want-reply, which OpenSSH answers) whenever the link has been quiet for `keepalive_s`. No bytes for
`dead_peer_s` means the peer is gone: the watchdog closes the connection, which ends every command
and SFTP call on it, and the caller raises `NodeUnresponsive` naming the node and what it was doing.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dagster as dg
import paramiko
from paramiko.common import cMSG_GLOBAL_REQUEST
from pydantic import Field

from spark_pipelines.core import remote
from spark_pipelines.core.fleet import SshTarget
from spark_pipelines.resources.ssh.errors import UNREACHABLE_ADVICE, HostKeyError, NodeConnectError, NodeUnreachable


class SshSettings(dg.Config):
    """How the fleet is reached over SSH: declared once, here. `FleetSSH` (the Dagster resource) is
    an `SshSettings` with a fleet file; `FleetSession` takes either."""

    connect_timeout_s: float = Field(default=15.0, gt=0, description="TCP connect, banner and auth, each")
    command_timeout_s: float = Field(
        default=remote.DEFAULT_COMMAND_TIMEOUT_S, gt=0,
        description="limit of a command that gives none (long steps give their own, see core.remote)",
    )
    # The runbook: "SSH will become unresponsive during CUDA graph compilation ... This is NORMAL" -
    # for new logins; an open connection's sshd still answers, slowly. 90 s without one byte is a
    # dead peer, well inside the runbook's 10 minutes before a hard reset.
    keepalive_s: float = Field(default=15.0, gt=0, description="ask for an answer after this long without bytes")
    dead_peer_s: float = Field(default=90.0, gt=0, description="no bytes for this long: the node is unresponsive")
    sftp_timeout_s: float = Field(default=60.0, gt=0, description="one SFTP request (open, stat, read, write)")
    # Retries within one connect (refused, reset, timed out: nothing ran yet), after retry_backoff_s
    # doubling. A step that still cannot connect is then retried whole by Dagster, per the fleet
    # file's ssh.connect_retries (core.fleet_settings.StepRetrySettings): two levels, two classes.
    connect_retries: int = Field(default=3, ge=0, description="retries within one connect, before it fails")
    retry_backoff_s: float = Field(default=1.0, ge=0)
    trust_unknown_host_keys: bool = Field(
        default=False, description="accept and pin unknown host keys (logged as a warning); off = refuse"
    )
    command_log_path: str | None = Field(
        default=None, description="append every remote command as a JSON line (readable across step processes)"
    )
    output_dir: str | None = Field(
        default=None,
        description="where each command's whole output is kept (0600 files); default: "
        "$DAGSTER_HOME/storage/command-output, else a per-user temp directory",
    )


def fingerprint(key: paramiko.PKey) -> str:
    return f"{key.get_name()} {key.fingerprint}"


class _RefuseUnknownHost(paramiko.MissingHostKeyPolicy):
    def __init__(self, node: str, known_hosts: Path):
        self.node, self.known_hosts = node, known_hosts

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        raise HostKeyError(
            f"node {self.node}: host {hostname} is not in {self.known_hosts} (it offered {fingerprint(key)}). "
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
            f"node {self.node}: TRUSTING UNKNOWN host key {fingerprint(key)} for {hostname} "
            f"(trust_unknown_host_keys=true); pinned in {self.known_hosts}"
        )
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with self.known_hosts.open("a") as fh:
            fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


def local_path(path: str) -> Path:
    return Path(os.path.expanduser(path))


class _WatchedSocket(socket.socket):
    """A TCP socket that remembers when bytes last arrived (paramiko's transport reads through it)."""

    last_recv: float

    def recv(self, bufsize: int, flags: int = 0) -> bytes:
        data = super().recv(bufsize, flags)
        if data:
            self.last_recv = time.monotonic()
        return data


class Liveness:
    """The watchdog of one connection: asks for an answer when quiet, closes the connection when none comes."""

    def __init__(self, node: str, transport: paramiko.Transport, sock: _WatchedSocket,
                 keepalive_s: float, dead_peer_s: float, log: Any) -> None:
        self.node, self.transport, self.sock = node, transport, sock
        self.keepalive_s, self.dead_peer_s = keepalive_s, dead_peer_s
        self.log = log
        self.dead = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"ssh-liveness-{node}", daemon=True)
        self._thread.start()

    def quiet_s(self) -> float:
        return time.monotonic() - self.sock.last_recv

    def stop(self) -> None:
        self._stop.set()

    def _ask_for_answer(self) -> None:
        # transport.global_request(wait=True) would block this thread on the very peer it watches;
        # the same message, sent without waiting: the answer (REQUEST_FAILURE from OpenSSH) is bytes
        # received, which is all that is looked at.
        m = paramiko.Message()
        m.add_byte(cMSG_GLOBAL_REQUEST)
        m.add_string("keepalive@openssh.com")
        m.add_boolean(True)
        self.transport._send_user_message(m)

    def _watch(self) -> None:
        step = min(self.keepalive_s, self.dead_peer_s) / 3
        last_ask = 0.0
        while not self._stop.wait(step):
            if not self.transport.is_active():
                return
            quiet = self.quiet_s()
            if quiet >= self.dead_peer_s:
                self.dead = True
                self.log.warning(f"node {self.node}: no answer from sshd for {quiet:.0f} s; closing the connection")
                self.transport.close()
                return
            now = time.monotonic()
            if quiet >= self.keepalive_s and now - last_ask >= self.keepalive_s:
                last_ask = now
                try:
                    self._ask_for_answer()
                except (OSError, EOFError, paramiko.SSHException):
                    pass  # the transport is going away; the next round sees it inactive


class Connection:
    """A connected, host-key verified SSHClient and its watchdog."""

    def __init__(self, client: paramiko.SSHClient, liveness: Liveness) -> None:
        self.client, self.liveness = client, liveness

    @property
    def transport(self) -> paramiko.Transport | None:
        return self.client.get_transport()

    def is_active(self) -> bool:
        t = self.transport
        return t is not None and t.is_active() and not self.liveness.dead

    def close(self) -> None:
        self.liveness.stop()
        self.client.close()


_known_hosts_cache: dict[tuple[str, int, int], paramiko.HostKeys] = {}
_known_hosts_lock = threading.Lock()


def _load_known_hosts(client: paramiko.SSHClient, path: Path) -> None:
    """client.load_host_keys, parsed once per file version: a sweep of N nodes sharing one
    known_hosts file parsed it N times (N x N lines, ~2 s of CPU at 100 nodes)."""
    st = path.stat()
    key = (str(path), st.st_mtime_ns, st.st_size)
    with _known_hosts_lock:
        parsed = _known_hosts_cache.get(key)
        if parsed is None:
            parsed = paramiko.HostKeys(str(path))
            if len(_known_hosts_cache) > 16:
                _known_hosts_cache.clear()
            _known_hosts_cache[key] = parsed
    client._host_keys_filename = str(path)  # what SSHClient.load_host_keys records (save_host_keys)
    mine = client.get_host_keys()
    for host, keys in parsed.items():
        for kind, k in keys.items():
            mine.add(host, kind, k)


def _open_socket(t: SshTarget, timeout_s: float) -> _WatchedSocket:
    raw = socket.create_connection((t.host, t.port), timeout=timeout_s)
    sock = _WatchedSocket(raw.family, raw.type, raw.proto, fileno=raw.detach())
    sock.settimeout(timeout_s)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.last_recv = time.monotonic()
    return sock


def key_path_problem(kp: Path) -> str | None:
    """What is wrong with a fleet file's key_path, worded with its fix (None: a file is there)."""
    if kp.is_dir():
        return (f"key_path {kp} is a directory, not a key file; point key_path at the private key itself "
                f"(e.g. {kp}/id_ed25519), or set it to null to use ssh-agent")
    if not kp.is_file():
        return f"key_path {kp} does not exist; fix key_path in the fleet file, or set it to null to use ssh-agent"
    return None


def connect(key: str, target: SshTarget, settings: SshSettings, log: Any) -> Connection:
    """Open and verify one connection to target t (called `key` in messages), with retries on
    connection-level failures only; host-key and auth failures are never retried."""
    known_hosts = local_path(target.known_hosts)
    key_file: str | None = None
    if target.key_path is not None:
        kp = local_path(target.key_path)
        problem = key_path_problem(kp)
        if problem:
            raise NodeConnectError(f"node {key}: {problem}")
        key_file = str(kp)
    elif not os.environ.get("SSH_AUTH_SOCK"):
        raise NodeConnectError(
            f"node {key}: no key_path and no ssh-agent (SSH_AUTH_SOCK is unset); set key_path in the "
            f"fleet file or start ssh-agent and add the key"
        )
    last: Exception | None = None
    tcp_up = False  # the last attempt got a TCP connection, yet no SSH answer: a frozen sshd
    for attempt in range(settings.connect_retries + 1):
        client = paramiko.SSHClient()
        if known_hosts.is_file():
            _load_known_hosts(client, known_hosts)
        elif not settings.trust_unknown_host_keys:
            raise HostKeyError(
                f"node {key}: known_hosts file {known_hosts} does not exist; add the node's verified "
                f"host key there (ssh-keyscan -p {target.port} {target.host}, compare the fingerprint on the node)"
            )
        if settings.trust_unknown_host_keys:
            client.set_missing_host_key_policy(_TrustOnFirstUse(key, known_hosts, target.port, log.warning))
        else:
            client.set_missing_host_key_policy(_RefuseUnknownHost(key, known_hosts))
        sock: _WatchedSocket | None = None
        try:
            tcp_up = False
            sock = _open_socket(target, settings.connect_timeout_s)
            tcp_up = True
            client.connect(
                target.host,
                port=target.port,
                username=target.user,
                key_filename=key_file,
                allow_agent=key_file is None,
                look_for_keys=False,
                timeout=settings.connect_timeout_s,
                banner_timeout=settings.connect_timeout_s,
                auth_timeout=settings.connect_timeout_s,
                channel_timeout=settings.connect_timeout_s,
                sock=sock,
            )
        except HostKeyError:
            client.close()
            raise
        except paramiko.BadHostKeyException as e:
            client.close()
            name = remote.known_hosts_name(target.host, target.port)
            raise HostKeyError(
                f"node {key}: HOST KEY MISMATCH for {name}: it offered {fingerprint(e.key)} but "
                f"{known_hosts} holds {fingerprint(e.expected_key)}. Refusing to connect: the node was "
                f"reinstalled, or someone is intercepting the connection. If the node was reinstalled, "
                f"check its new fingerprint on its console, then run "
                f"`ssh-keygen -R '{name}' -f {known_hosts}` and add the new key"
            ) from None
        except paramiko.AuthenticationException as e:
            client.close()
            how = f"key {key_file}" if key_file else "ssh-agent keys"
            raise NodeConnectError(
                f"node {key}: {target.user}@{target.host}:{target.port} refused {how} ({e}); add the public key to "
                f"~{target.user}/.ssh/authorized_keys on the node, or fix user/key_path in the fleet file"
            ) from None
        except socket.gaierror as e:
            # The name does not resolve: the fleet file's host, not the node (no retry, no reset advice).
            client.close()
            raise NodeConnectError(
                f"node {key}: host {target.host!r} does not resolve ({e.strerror or e}); fix host in the fleet "
                f"file: an address, or a name DNS or /etc/hosts knows (paramiko does not read ~/.ssh/config)"
            ) from None
        except (OSError, socket.timeout, paramiko.SSHException, EOFError) as e:
            # Connection-level failures only: nothing ran yet, so retrying is safe.
            client.close()
            if sock is not None:
                sock.close()
            last = e
            if attempt < settings.connect_retries:
                delay = settings.retry_backoff_s * (2**attempt)
                log.warning(
                    f"node {key}: connecting to {target.host}:{target.port} failed ({e}); retry "
                    f"{attempt + 1}/{settings.connect_retries} in {delay:.1f}s"
                )
                time.sleep(delay)
            continue
        transport = client.get_transport()
        assert transport is not None and sock is not None
        return Connection(client, Liveness(key, transport, sock, settings.keepalive_s, settings.dead_peer_s, log))
    if tcp_up:
        raise NodeUnreachable(
            f"node {key}: sshd at {target.host}:{target.port} accepted the connection but did not answer within "
            f"{settings.connect_timeout_s:.0f} s ({settings.connect_retries + 1} attempts, last: {last}); {UNREACHABLE_ADVICE}"
        )
    raise NodeUnreachable(
        f"node {key}: cannot reach {target.user}@{target.host}:{target.port} after {settings.connect_retries + 1} attempts "
        f"({last}); check that the node is up and sshd listens on port {target.port}"
    )
