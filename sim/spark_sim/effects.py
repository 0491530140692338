"""Small effects on this machine the simulator is built from: run a program, write a file,
find and stop processes, wait for a daemon, clean cgroups and mounts."""

from __future__ import annotations

import http.client
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from spark_sim.layout import INSTALL_HINT, SSH_PORT, SimError


def run(argv: list[str], *, check: bool = True, what: str = "", env: dict[str, str] | None = None,
        input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=env, input=input, timeout=timeout)
    except FileNotFoundError:
        raise SimError(f"{argv[0]} is not installed; {INSTALL_HINT}") from None
    except subprocess.TimeoutExpired:
        raise SimError(f"{what or argv[0]} did not finish within {timeout:.0f} s") from None
    if check and p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().splitlines()
        raise SimError(f"{what or ' '.join(argv[:4])} failed (exit {p.returncode}): {msg[-1] if msg else ''}")
    return p


def write(path: Path, text: str, mode: int = 0o644, owner: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    if owner:
        shutil.chown(tmp, owner, owner)
    tmp.replace(path)


def pid_from(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def netns_pids(name: str) -> list[int]:
    if not netns_exists(name):
        return []
    p = run(["ip", "netns", "pids", name], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def user_pids(user: str) -> list[int]:
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        return []
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if d.stat().st_uid == uid:
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def kill_all(pids: list[int], grace_s: float = 5.0) -> None:
    """TERM, wait up to grace_s, then KILL: dockerd stops its containers on TERM."""
    pids = [p for p in pids if p != os.getpid()]
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    for p in pids:
        if alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    # KILL is asynchronous: wait so namespaces, cgroups and users are free to remove.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)


def docker_ping(sock: Path) -> bool:
    class _Unix(http.client.HTTPConnection):
        def connect(self) -> None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(2)
            self.sock.connect(str(sock))

    try:
        c = _Unix("localhost", timeout=2)
        c.request("GET", "/_ping")
        ok = c.getresponse().status == 200
        c.close()
        return ok
    except OSError:
        return False


def ssh_banner(ip: str, port: int = SSH_PORT) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=1) as s:
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def wait_until(what: str, ready: Any, timeout_s: float, log: Path | None = None, failed: Any = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        if failed is not None and failed():
            break
        time.sleep(0.1)
    tail = ""
    if log and log.exists():
        lines = log.read_text(errors="replace").strip().splitlines()
        tail = f"; last log line: {lines[-1]}" if lines else ""
    raise SimError(f"{what} did not become ready{tail}")


def dockerd_failed(log: Path) -> bool:
    try:
        text = log.read_bytes()
    except OSError:
        return False
    return b"failed to start daemon" in text or b"dockerd --help" in text


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# cgroup v1 (this machine) keeps the pids controller in its own hierarchy; v2 has one tree.
_CGROUP_TREES = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))


def cgroup_parents(prefix: str) -> list[str]:
    found: list[str] = []
    for tree in _CGROUP_TREES:
        if tree.is_dir():
            found += [d.name for d in tree.glob(f"spark-sim-{prefix}-*") if d.is_dir()]
    return found


def cgroup_pids(parent: str) -> list[int]:
    pids: list[int] = []
    for tree in _CGROUP_TREES:
        top = tree / parent
        if top.is_dir():
            for procs in top.rglob("cgroup.procs"):
                try:
                    pids += [int(x) for x in procs.read_text().split()]
                except (OSError, ValueError):
                    pass
    return pids


def remove_cgroups(parent: str) -> None:
    """Empty cgroup dirs that killed containers leave under the node's --cgroup-parent."""
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / parent
        if not top.is_dir():
            continue
        for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            try:
                d.rmdir()
            except OSError:
                pass
        try:
            top.rmdir()
        except OSError:
            pass


def unmount_under(root: Path) -> None:
    """Mounts left in the root namespace under the sim root (none expected: dockerd mounts in
    the private mount namespace `ip netns exec` gives it)."""
    try:
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return
    for mp in sorted((p for p in mounts if p == str(root) or p.startswith(f"{root}/")), key=len, reverse=True):
        run(["umount", "-l", mp], check=False)
