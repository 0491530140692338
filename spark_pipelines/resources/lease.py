"""One run per node at a time: a lease held on the node itself.

The lease is an `flock` on a file on the target, held by a process that lives exactly as long
as a dedicated SSH channel: `flock -n LOCK sh -c 'echo held; exec cat'`. `cat` waits on the
channel's stdin, so closing the channel, the run process dying (even `kill -9`: the kernel closes
its socket) or the connection dropping (sshd's ClientAliveInterval ends the session) gives `cat`
EOF, and the lock is free again. No crashed run can leave it held forever, and no lock file has to
be cleaned up by hand. Whoever holds it is written next to the lock file, for the "busy" message.

Re-entrant within one session and thread: the A/B experiment holds its node's lease while the
deploys it runs take it again.

A lease can end under its run: the connection drops (the session would reconnect for the next
command) or the node's side of it ends. Another run may hold the node from then on (the health
sweep sees a dead run's journal with the lease free and requests the repair), so a run whose
lease ended stops touching the node: every later command or file operation of its session on
that node raises LeaseLost (FleetSession.guards) until the lease's block ends, and its undo is
left to the next holder (a deploy's journal stays on the node for it; `lost` tells a procedure
not to put the node back in the gateway either).
"""

from __future__ import annotations

import json
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import paramiko

from spark_pipelines.core import remote
from spark_pipelines.core.layout import STATE_DIR
from spark_pipelines.resources.ssh import FleetSession, RemoteError
from spark_pipelines.core.errors import RunbookError

LOCK_DIR = f"{STATE_DIR}/locks"
BUSY_EXIT = 75  # flock -E: the lock is held by someone else (EX_TEMPFAIL)
ACQUIRE_TIMEOUT_S = 30.0  # opening the channel and reading "held": seconds on a live node


class NodeBusy(RunbookError, RemoteError):
    """Another run holds the node's lease; the message says who and since when (a RunbookError:
    the asset shows it as one line, not a traceback)."""


class LeaseLost(RunbookError, RemoteError):
    """This run's lease on a node ended under it: it changes nothing more there."""


@dataclass
class Lease:
    target: str
    purpose: str
    holder: dict
    lock_path: str
    channel: paramiko.Channel | None = None
    depth: int = 1

    @property
    def lost(self) -> bool:
        """The channel ended under us (connection dropped): the node no longer holds the lock."""
        chan = self.channel
        if chan is None or chan.closed or chan.exit_status_ready():
            return True
        transport = chan.get_transport()
        return transport is None or not transport.is_active()

    def error(self) -> LeaseLost:
        return LeaseLost(
            f"node {self.target}: this run's lease for {self.purpose} ended under it (its SSH connection dropped or "
            f"the node's side of {self.lock_path} ended), so another run may hold {self.target} now: this run "
            f"changes nothing more there. The next run that takes {self.target}'s lease finishes what this one "
            f"left (a deploy's journal); the health sweep requests that run by itself")


# session -> {(thread id, target key): Lease}: what this session's threads hold right now.
_held: weakref.WeakKeyDictionary[FleetSession, dict[tuple[int, str], Lease]] = weakref.WeakKeyDictionary()
_held_lock = threading.Lock()


def lost(session: FleetSession, target: str) -> Lease | None:
    """A lease this session holds on `target` (any thread) that ended under it, or None."""
    with _held_lock:
        try:
            mine = list(_held.get(session, {}).items())
        except TypeError:  # no session that can hold a lease (a stand-in)
            return None
    if not mine:
        return None
    key, _ = session.target(target)
    return next((lease for (_, k), lease in mine if k == key and lease.lost), None)


def check(session: FleetSession, target: str) -> None:
    """At a step boundary: raise LeaseLost when this session's lease on `target` ended."""
    gone = lost(session, target)
    if gone is not None:
        raise gone.error()


def _guard(session: FleetSession, key: str) -> None:
    """FleetSession's guard: no command on a node whose lease this session lost."""
    with _held_lock:
        leases = [lease for (_, k), lease in _held.get(session, {}).items() if k == key]
    for lease in leases:
        if lease.lost:
            raise lease.error()


def lock_paths(session: FleetSession, target: str, name: str = "run") -> tuple[str, str]:
    """(lock file, holder file) on the target, `~` expanded for its user."""
    base = session.expand(target, f"{LOCK_DIR}/{name}")
    return f"{base}.lock", f"{base}.holder"


def lease_argv(lock_path: str, holder_path: str, holder: str) -> list[str]:
    """The command that holds the lock while its stdin stays open."""
    script = 'printf "%s\\n" "$1" > "$2" || exit 71; echo held; exec cat'
    return ["flock", "-n", "-E", str(BUSY_EXIT), lock_path, "sh", "-c", script, "sh", holder, holder_path]


def _describe(holder_text: str) -> str:
    try:
        h = json.loads(holder_text)
    except ValueError:
        return "an unknown holder (no readable holder file)"
    started = h.get("started")
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if isinstance(started, (int, float)) else "?"
    run = f"run {h['run_id']}, " if h.get("run_id") else ""
    return f"{h.get('purpose', '?')} ({run}pid {h.get('pid', '?')} on {h.get('host', '?')}, since {since})"


@contextmanager
def node_lease(session: FleetSession, target: str, purpose: str, *, run_id: str = "",
               timeout_s: float = ACQUIRE_TIMEOUT_S) -> Iterator[Lease]:
    """Hold `target`'s run lease (a node name or the gateway key) for the block, or raise
    NodeBusy naming who holds it. Released when the block ends, in every outcome."""
    key, _ = session.target(target)
    slot = (threading.get_ident(), key)
    with _held_lock:
        mine = _held.setdefault(session, {})
        if slot in mine:
            mine[slot].depth += 1
            outer = mine[slot]
        else:
            outer = None
    if outer is not None:
        try:
            yield outer
        finally:
            with _held_lock:
                outer.depth -= 1
        return

    if _guard not in session.guards:
        session.guards.append(_guard)
    lock_path, holder_path = lock_paths(session, target)
    holder = {"purpose": purpose, "run_id": run_id, "pid": os.getpid(), "host": socket.gethostname(),
              "started": round(time.time(), 1)}
    session.run(target, ["mkdir", "-p", lock_path.rsplit("/", 1)[0]], log=False, timeout=30)
    lease = Lease(key, purpose, holder, lock_path)
    lease.channel = _acquire(session, target, key, lock_path, holder_path, holder, timeout_s)
    with _held_lock:
        _held.setdefault(session, {})[slot] = lease
    session.log.info(f"[{key}] lease taken for {purpose} ({lock_path})")
    try:
        yield lease
    finally:
        with _held_lock:
            _held.get(session, {}).pop(slot, None)
        if lease.lost:
            session.log.warning(f"[{key}] the lease for {purpose} ended before the block did (connection dropped?); "
                          "its next command there raised LeaseLost")
        lease.channel.close()  # cat sees EOF, flock exits, the lock is free


def _acquire(session: FleetSession, target: str, key: str, lock_path: str, holder_path: str, holder: dict,
             timeout_s: float) -> paramiko.Channel:
    transport = session.client(target).get_transport()
    if transport is None or not transport.is_active():
        raise RemoteError(f"node {key}: no SSH connection to take the run lease on; check that the node is up")
    chan = transport.open_session(timeout=timeout_s)
    try:
        chan.exec_command(remote.quote_argv(lease_argv(lock_path, holder_path, json.dumps(holder, sort_keys=True))))
        deadline = time.monotonic() + timeout_s
        out = b""
        while b"\n" not in out:
            if chan.exit_status_ready() and not chan.recv_ready():
                break
            if time.monotonic() > deadline:
                raise RemoteError(
                    f"node {key}: taking the run lease ({lock_path}) gave no answer in {timeout_s:.0f} s; "
                    f"check that the node's sshd and disk respond")
            select.select([chan], [], [], 0.5)
            if chan.recv_ready():
                out += chan.recv(1024)
        if out.split(b"\n", 1)[0].strip() == b"held":
            return chan
        status = chan.recv_exit_status()
        err = chan.recv_stderr(4096).decode("utf-8", "replace").strip() if chan.recv_stderr_ready() else ""
    except BaseException:
        chan.close()
        raise
    chan.close()
    if status == BUSY_EXIT:
        r = session.run(target, ["cat", holder_path], check=False, log=False, timeout=30)
        raise NodeBusy(
            f"node {key} is busy: {_describe(r.stdout)} holds its run lease ({lock_path}); one run per node "
            f"at a time. Wait for that run to end (a crashed run frees it within a minute), then retry")
    raise RemoteError(
        f"node {key}: could not take the run lease {lock_path} (exit {status}: {err or 'no output'}); "
        f"check that util-linux `flock` is installed there and {LOCK_DIR} is writable")
