"""Files on a node over SFTP: every request bounded (the SFTP channel's timeout), a dead peer named.

Mixed into `FleetSession`, which owns the connections; this part owns the per-node SFTP clients.
"""

from __future__ import annotations

import secrets as pysecrets
import socket
import stat
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import paramiko

from spark_pipelines.core import remote
from spark_pipelines.core.fleet import SshTarget
from spark_pipelines.resources.ssh.connection import Connection, SshSettings
from spark_pipelines.resources.ssh.errors import NodeUnresponsive, RemoteError, RemoteFileError

SECRETS_DIR = "~/.cache/spark-pipelines/secrets"


class NodeFiles:
    """SFTP half of a session (see FleetSession for the connection half)."""

    settings: SshSettings
    _sftp: dict[str, paramiko.SFTPClient]
    _lock: threading.Lock

    # provided by FleetSession
    def target(self, node: str | SshTarget) -> tuple[str, SshTarget]: ...
    def expand(self, node: str | SshTarget, path: str) -> str: ...
    def connection(self, node: str | SshTarget) -> Connection: ...
    def _node_lock(self, key: str) -> threading.Lock: ...
    def _is_dead(self, key: str) -> bool: ...

    def sftp(self, node: str | SshTarget) -> paramiko.SFTPClient:
        key, _ = self.target(node)
        conn = self.connection(node)
        with self._node_lock(key):
            s = self._sftp.get(key)
            if s is None:
                transport = conn.transport
                if transport is None:
                    raise NodeUnresponsive(key, 0, "opening SFTP (the connection is gone)")
                chan = transport.open_session(timeout=self.settings.connect_timeout_s)
                # Every SFTP request waits at most this long for its reply: open, stat, read and
                # write raise socket.timeout instead of hanging on a peer that stopped answering.
                chan.settimeout(self.settings.sftp_timeout_s)
                chan.invoke_subsystem("sftp")
                s = paramiko.SFTPClient(chan)
                self._sftp[key] = s
            return s

    def _drop_sftp(self, key: str) -> None:
        s = self._sftp.pop(key, None)
        if s is not None:
            try:
                s.close()
            except Exception:  # closing a dead channel must not mask the real error
                pass

    def _sftp_hold(self, key: str) -> Any:  # a threading.RLock
        with self._lock:
            holds = self.__dict__.setdefault("_sftp_holds", {})
            return holds.setdefault(key, threading.RLock())

    @contextmanager
    def _file_op(self, node: str | SshTarget, what: str) -> Iterator[str]:
        """Map SFTP failures to errors naming the node: a timeout or dead peer -> NodeUnresponsive."""
        key, _ = self.target(node)
        # One operation at a time on the node's shared SFTP channel: paramiko reads its replies
        # without a lock, so two threads at once (adoption's, the distribution's) steal each
        # other's packets ("Server connection dropped", a reply never seen). Re-entrant: a write
        # removes its temp file under the same hold.
        with self._sftp_hold(key):
            try:
                yield key
            except (FileNotFoundError, RemoteError):
                raise
            except (socket.timeout, TimeoutError):
                self._drop_sftp(key)  # a late reply would answer the next request: start a fresh channel
                raise NodeUnresponsive(key, self.settings.sftp_timeout_s, f"SFTP {what}") from None
            except (OSError, EOFError, paramiko.SSHException) as e:
                self._drop_sftp(key)
                if self._is_dead(key):
                    raise NodeUnresponsive(key, self.settings.dead_peer_s, f"SFTP {what}") from None
                raise RemoteFileError(f"node {key}: SFTP {what} failed: {e or type(e).__name__}") from None

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
        full = self.expand(node, path)
        with self._file_op(node, f"write of {full}") as key:
            sftp = self.sftp(node)
            parent = full.rsplit("/", 1)[0] or "/"
            tmp = f"{full}.tmp-{pysecrets.token_hex(4)}"
            try:
                self._mkdirs(sftp, parent)
                with sftp.open(tmp, "w") as fh:
                    sftp.chmod(tmp, mode)  # before the content goes in: a 0600 file is never briefly 0644
                    fh.write(text.encode())
                sftp.posix_rename(tmp, full)
            except (socket.timeout, TimeoutError, EOFError, paramiko.SSHException):
                raise
            except OSError as e:
                self._remove_quietly(node, tmp)
                raise RemoteFileError(f"node {key}: cannot write {full}: {e}") from None
        return full

    def read_bytes(self, node: str | SshTarget, path: str, offset: int = 0, length: int | None = None) -> bytes:
        full = self.expand(node, path)
        with self._file_op(node, f"read of {full}") as key:
            try:
                with self.sftp(node).open(full, "rb") as fh:
                    if offset:
                        fh.seek(offset)
                    return fh.read(length) if length is not None else fh.read()
            except FileNotFoundError:
                raise RemoteFileError(f"node {key}: {full} does not exist") from None
            except (socket.timeout, TimeoutError, EOFError, paramiko.SSHException):
                raise
            except OSError as e:
                raise RemoteFileError(f"node {key}: cannot read {full}: {e}") from None
        raise AssertionError("unreachable")

    def read_text(self, node: str | SshTarget, path: str) -> str:
        return self.read_bytes(node, path).decode("utf-8", "replace")

    def exists(self, node: str | SshTarget, path: str) -> bool:
        full = self.expand(node, path)
        with self._file_op(node, f"stat of {full}"):
            try:
                self.sftp(node).stat(full)
                return True
            except FileNotFoundError:
                return False
        raise AssertionError("unreachable")

    def _remove_quietly(self, node: str | SshTarget, path: str) -> None:
        try:
            self.sftp(node).remove(path)
        except (OSError, EOFError, paramiko.SSHException, RemoteError):
            pass

    def _write_secret_env(self, node: str | SshTarget, secret_env: Mapping[str, str]) -> str:
        directory = self.expand(node, SECRETS_DIR)
        with self._file_op(node, f"write of a secret env file in {directory}"):
            sftp = self.sftp(node)
            self._mkdirs(sftp, directory, 0o700)
            if stat.S_IMODE(sftp.stat(directory).st_mode or 0) & 0o077:
                sftp.chmod(directory, 0o700)
            path = f"{directory}/env-{pysecrets.token_hex(8)}"
            with sftp.open(path, "w") as fh:
                sftp.chmod(path, 0o600)
                fh.write(remote.secret_env_file(secret_env).encode())
            return path
        raise AssertionError("unreachable")

