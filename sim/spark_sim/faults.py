"""Fault injectors for the simulated fleet: what the fault suite (tests/faults) and the soak
(spark_sim/soak.py, benchmarks/soak.py) inject.

Every injector is a context manager whose undo runs in `finally` (SIGCONT, unmount, keys put
back, link up), so a failing caller still leaves the fleet as it found it. They use only the
simulator's public attributes (`SimFleet.nodes/gateway/node()`, `Member.sshd_pidfile`,
`dockerd_pidfile`, `netns`, `dir`, `home`, `docker_host`, `ip`).
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from spark_pipelines.core.diagnosis import MetricsFormatError, parse_exposition
from spark_sim.fleet import Member, SimFleet

CONTAINER = "vllm-qwen35-v2"  # the launch profile's container name in the seed fleet
ENGINE_PORT = 8000
PROXY_PORT = 4000


class FaultError(RuntimeError):
    """A fault could not be injected (its target is not there): one line naming what is missing."""

# -- processes ---------------------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, comm) for every live process."""
    out: dict[int, tuple[int, str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z":
            out[int(d.name)] = (int(fields[1]), comm)
    return out


def descendants(pid: int, table: dict[int, tuple[int, str]] | None = None) -> list[int]:
    table = table if table is not None else _proc_table()
    kids: dict[int, list[int]] = {}
    for p, (pp, _) in table.items():
        kids.setdefault(pp, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def engine_healthy(m: Member, timeout: float = 5) -> bool:
    """The node's vLLM (or its stand-in) answers /health with 200."""
    try:
        return httpx.get(f"http://{m.ip}:{ENGINE_PORT}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def engine_started_at(m: Member, timeout: float = 5) -> float | None:
    """When the node's engine process started (process_start_time_seconds on its /metrics, as a
    real vLLM exports it), or None when it does not answer: a new value is a new engine."""
    try:
        text = httpx.get(f"http://{m.ip}:{ENGINE_PORT}/metrics", timeout=timeout).text
        return next((s.value for s in parse_exposition(text) if s.name == "process_start_time_seconds"), None)
    except (httpx.HTTPError, MetricsFormatError):
        return None


def proxy_pids(sim: SimFleet) -> list[int]:
    """Every LiteLLM process on the gateway host (its network namespace), whatever the pid file says."""
    ns_pids = subprocess.run(["ip", "netns", "pids", sim.gateway.netns], capture_output=True, text=True,
                             timeout=10).stdout
    return [int(p) for p in ns_pids.split() if p.isdigit() and any("litellm" in a for a in _cmdline(int(p))[:3])]


def _pidfile(path: Path, what: str) -> int:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        raise FaultError(f"{what}: no pid in {path}; is the simulated fleet up?") from None


def sshd_pids(m: Member) -> list[int]:
    """The member's listening sshd and its per-connection children (not the sessions' shells)."""
    listener = _pidfile(m.sshd_pidfile, f"sshd of {m.name}")
    table = _proc_table()
    return [listener, *(p for p in descendants(listener, table) if table[p][1] == "sshd")]


def dockerd_pid(m: Member) -> int:
    return _pidfile(m.dockerd_pidfile, f"dockerd of {m.name}")


def docker(m: Member, *args: str, timeout: float = 30, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The docker CLI against the node's own dockerd, from this machine."""
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=check,
                          env={**os.environ, "DOCKER_HOST": m.docker_host})


def engine_pids(m: Member, container: str = CONTAINER) -> list[int]:
    """The serving container's processes (the vLLM stand-in and whatever it forked)."""
    pid = int(docker(m, "inspect", "--format", "{{.State.Pid}}", container).stdout.strip() or 0)
    if not pid:
        raise FaultError(f"{m.name}: container {container} is not running; nothing to freeze")
    return [pid, *descendants(pid)]


@contextmanager
def stopped(pids: list[int], what: str) -> Iterator[list[int]]:
    """SIGSTOP the processes for the block; SIGCONT in every outcome."""
    done: list[int] = []
    try:
        for p in pids:
            try:
                os.kill(p, signal.SIGSTOP)
                done.append(p)
            except ProcessLookupError:
                pass
        if not done:
            raise FaultError(f"{what}: none of the processes {pids} exists")
        yield done
    finally:
        for p in done:
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass


def frozen_sshd(m: Member) -> Any:
    return stopped(sshd_pids(m), f"sshd of {m.name}")


def frozen_dockerd(m: Member) -> Any:
    return stopped([dockerd_pid(m)], f"dockerd of {m.name}")


def frozen_engine(m: Member) -> Any:
    return stopped(engine_pids(m), f"engine on {m.name}")


# -- network -----------------------------------------------------------------------------------


@contextmanager
def link_down(m: Member) -> Iterator[None]:
    """The member's veth down (its network gone, processes untouched); up again in every outcome."""
    subprocess.run(["ip", "-n", m.netns, "link", "set", "eth0", "down"], check=True, timeout=10)
    try:
        yield
    finally:
        subprocess.run(["ip", "-n", m.netns, "link", "set", "eth0", "up"], check=False, timeout=10)


@contextmanager
def slow_link(m: Member, rate: str = "4mbit") -> Iterator[None]:
    """Shape the member's egress (a token bucket: netem is not in every kernel) so a copy from it
    lasts long enough to interrupt."""
    base = ["ip", "netns", "exec", m.netns, "tc", "qdisc"]
    subprocess.run([*base, "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"],
                   check=True, timeout=10, capture_output=True)
    try:
        yield
    finally:
        subprocess.run([*base, "del", "dev", "eth0", "root"], check=False, timeout=10, capture_output=True)


class SessionKiller:
    """Kill the sshd child that serves `rsync --server` on a member, as soon as one appears:
    the SSH connection of a node-to-node copy dropped mid-copy."""

    def __init__(self, m: Member, min_bytes_s: float = 0.0) -> None:
        self.m = m
        self.killed: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        uid = _uid(self.m.user)
        while not self._stop.is_set() and not self.killed:
            table = _proc_table()
            for pid, (ppid, comm) in table.items():
                if comm != "rsync" or "--server" not in _cmdline(pid):
                    continue
                try:
                    if os.stat(f"/proc/{pid}").st_uid != uid:
                        continue
                except OSError:
                    continue
                # Let some bytes land first: a drop mid-copy, not before it.
                time.sleep(0.3)
                chain = [ppid]
                while table.get(chain[-1], (0, ""))[1] not in ("sshd",) and chain[-1] > 1:
                    chain.append(table.get(chain[-1], (1, ""))[0])
                target = chain[-1] if table.get(chain[-1], (0, ""))[1] == "sshd" else ppid
                try:
                    os.kill(target, signal.SIGKILL)
                    self.killed.append(target)
                except ProcessLookupError:
                    pass
                return
            time.sleep(0.01)

    def __enter__(self) -> SessionKiller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _uid(user: str) -> int:
    import pwd

    return pwd.getpwnam(user).pw_uid


# -- disks and files ---------------------------------------------------------------------------


@contextmanager
def tmpfs_over(m: Member, path: str | Path, size_bytes: int) -> Iterator[Path]:
    """A small empty tmpfs over `path` as the member's SSH sessions see it (mounted in its sshd's
    mount namespace; the running container keeps its own bind mounts). Unmounted in every outcome;
    what was under it is untouched."""
    pid = _pidfile(m.sshd_pidfile, f"sshd of {m.name}")
    uid = _uid(m.user)
    ns = ["nsenter", "-t", str(pid), "-m", "--"]
    subprocess.run([*ns, "mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0755,uid={uid},gid={uid}",
                    f"fault-{m.name}", str(path)], check=True, timeout=10, capture_output=True)
    try:
        yield Path(path)
    finally:
        subprocess.run([*ns, "umount", "-l", str(path)], check=False, timeout=10, capture_output=True)


def corrupt_same_size(path: Path) -> str:
    """Flip the last bytes of a file, keeping its size and mtime (rsync's quick check and a
    structure-only verification both pass). Returns the digest it had before."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    before = hashlib.sha256(data).hexdigest()
    # The last bytes: tensor data, past the header a structure check reads.
    for i in range(max(0, len(data) - 64), len(data)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return before


def tree_digests(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every regular file under root (rsync's partial dir excluded)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not any(part.startswith(".rsync-partial") for part in p.relative_to(root).parts):
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# -- sshd host key -----------------------------------------------------------------------------


def _start_sshd(m: Member) -> None:
    # The same command `sim up` starts it with (sshd daemonizes and writes its PidFile).
    subprocess.run(["ip", "netns", "exec", m.netns, "/usr/sbin/sshd", "-f", str(m.dir / "ssh" / "sshd_config"),
                    "-E", str(m.dir / "ssh" / "sshd.log")], check=True, timeout=30, capture_output=True)
    wait_for(lambda: _banner(m.ip), 15, f"sshd of {m.name} after restart")


def _restart_sshd(m: Member) -> None:
    old = _pidfile(m.sshd_pidfile, f"sshd of {m.name}")
    try:
        os.kill(old, signal.SIGTERM)  # the listener only: open sessions keep their own processes
    except ProcessLookupError:
        pass
    wait_for(lambda: not Path(f"/proc/{old}").exists() or _proc_table().get(old) is None, 10,
             f"old sshd of {m.name} to exit")
    _start_sshd(m)


def _banner(ip: str) -> bool:
    import socket

    try:
        with socket.create_connection((ip, 22), timeout=1) as s:
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


@contextmanager
def host_key_changed(m: Member) -> Iterator[str]:
    """A new host key on the member's sshd (a reinstalled node, or a machine in the middle). The
    original key and sshd come back in every outcome. Yields the new key's public line."""
    key = m.dir / "ssh" / "ssh_host_ed25519_key"
    saved = {p: p.read_bytes() for p in (key, key.with_name(key.name + ".pub"))}
    try:
        for p in saved:
            p.unlink()
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{m.name}-rekeyed", "-f", str(key)],
                       check=True, timeout=30, capture_output=True)
        _restart_sshd(m)
        yield key.with_name(key.name + ".pub").read_text().strip()
    finally:
        for p, data in saved.items():
            p.write_bytes(data)
            os.chmod(p, 0o600 if not p.name.endswith(".pub") else 0o644)
        _restart_sshd(m)


# -- gateway -----------------------------------------------------------------------------------


def gateway_config_path(sim: SimFleet) -> Path:
    return sim.gateway.home / "litellm" / "config.yaml"


def gateway_config(sim: SimFleet) -> dict[str, Any]:
    return yaml.safe_load(gateway_config_path(sim).read_text()) or {}


def rotation(config: dict[str, Any]) -> list[str]:
    seen: list[str] = []
    for e in config.get("model_list") or []:
        info = e.get("model_info") or {}
        # The product's owner mark (older configs: spark_node); an operator's own entries have none.
        node = info.get("spark_pipelines_node") or info.get("spark_node")
        if node and node not in seen:
            seen.append(node)
    return seen


def proxy_pid(sim: SimFleet) -> int | None:
    try:
        return int((sim.gateway.dir / "litellm.pid").read_text().strip())
    except (OSError, ValueError):
        return None


def kill_proxy(sim: SimFleet) -> int:
    """The proxy dies as its container would: the gunicorn master and its workers (its process
    group) at once. Killing the master alone would leave its worker serving the old config."""
    pid = proxy_pid(sim)
    assert pid, "the gateway proxy has no pid file; is it running?"
    os.killpg(pid, signal.SIGKILL)
    return pid


def proxy_ready(sim: SimFleet) -> bool:
    try:
        return httpx.get(f"http://{sim.gateway.ip}:{PROXY_PORT}/health/readiness", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def restart_proxy(sim: SimFleet) -> None:
    """What the operator does after a proxy crash or a lost reload: stop every proxy on the
    gateway host (an orphan from two overlapping restarts keeps the port with a stale config, and
    the pid file names only the last one), then `litellm-restart`."""
    gw = sim.gateway
    for pid in proxy_pids(sim):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # As the gateway user: its sudoers line (and secure_path) is what finds `litellm-proxy`.
    r = subprocess.run(["ip", "netns", "exec", gw.netns, "runuser", "-u", gw.user, "--", str(gw.bin / "litellm-restart")],
                       timeout=150, capture_output=True, text=True, cwd=str(gw.home / "litellm"))
    assert r.returncode == 0, f"litellm-restart on the gateway host failed: {(r.stderr or r.stdout).strip()[-300:]}"


@dataclass
class RotationWatch:
    """Samples the gateway config on its host every `every_s` while a fault plays out: the fewest
    nodes it ever routed to, and when it had none."""

    sim: SimFleet
    every_s: float = 0.1
    samples: int = 0
    fewest: int | None = None
    empty_at: list[float] = field(default_factory=list)
    seen: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                nodes = tuple(rotation(gateway_config(self.sim)))
            except (OSError, yaml.YAMLError, AttributeError):
                nodes = None  # mid-write: not a sample
            if nodes is not None:
                self.samples += 1
                self.fewest = len(nodes) if self.fewest is None else min(self.fewest, len(nodes))
                t = round(time.monotonic() - self._t0, 2)
                if not nodes:
                    self.empty_at.append(t)
                if not self.seen or self.seen[-1][1] != nodes:
                    self.seen.append((t, nodes))
            self._stop.wait(self.every_s)

    def __enter__(self) -> RotationWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def wait_for(cond: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {seconds:.0f} s")
