"""The simulated GB10 fleet: real sshd and dockerd per node, each in its own network namespace.

`spark-pipelines sim up` starts N nodes on this machine and writes a fleet file for them that is
the seed fleet with only the addresses, users, keys, repository URLs and commits changed, so every
other command runs against the simulation exactly as against the real Sparks.

Layout (slot s = SPARK_SIM_SLOT, default 0; root = SPARK_SIM_ROOT, default /var/lib/spark-sim):
- a switch namespace `<p>-net` holding one bridge; the root namespace joins it as 10.213.s.1/24,
  the gateway host is 10.213.s.2, node i is 10.213.s.(10+i). The bridge lives in its own namespace
  so the host's iptables (which any system dockerd may set to FORWARD DROP) never sees node-to-node
  traffic, and no host sysctl (ip_forward) has to change. Namespaces get no default route: nodes
  reach each other and this machine, nothing else.
- per node `<p>-<node>`: netns, an ordinary user `<p>-<node>` (home under the root), an sshd
  (key-only, own host key) on port 22, a dockerd on a unix socket under the root (host networking
  only), `nvidia-smi` and `nvidia-container-runtime-hook` stand-ins, a sudoers drop-in for the
  runbook's root steps.
- the gateway `<p>-gateway`: netns, user, sshd, and a `litellm-restart` script standing in for
  `docker compose restart litellm`.
Everything made is recorded in `<root>/state.json` before it is made, so `sim down` also cleans up
after a crash.
"""

from __future__ import annotations

import argparse
import copy
import grp
import hashlib
import http.client
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from spark_pipelines.core.fleet import FleetError, load_fleet, parse_fleet
from spark_sim import base_image, gpu_hook

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SEED_FLEET = PROJECT_ROOT / "fleets" / "seed.yaml"
DEFAULT_ROOT = Path("/var/lib/spark-sim")
DEFAULT_FLEET_OUT = "sim-fleet.yaml"
GPU_STATES = ("healthy", "idle", "wedged", "residue", "low-memory")
MAX_NODES = 32
SSH_PORT = 22
# The real proxy, installed by scripts/bootstrap.sh (run as root on the gateway, see litellm-proxy).
# The runbook's per-node single-stream figure (~52 tok/s); tests raise it to keep benches short.
DEFAULT_TOKENS_PER_SECOND = float(os.environ.get("SPARK_SIM_TOKENS_PER_SECOND", "52"))
LITELLM_BIN = Path(os.environ.get("SPARK_LITELLM_VENV", "/opt/spark-pipelines/litellm")) / "bin" / "litellm"
REQUIRED_BINARIES = ("ip", "dockerd", "docker", "/usr/sbin/sshd", "ssh-keygen", "useradd", "userdel", "visudo",
                     "sudo", "setsid", "fuser", "rsync", "git")


class SimError(Exception):
    """The simulated fleet cannot do what was asked; the message says why and what to do."""


# -- layout ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Member:
    """A simulated host: a node or the gateway."""

    name: str
    ip: str
    netns: str
    user: str
    dir: Path
    hardware: str | None  # None for the gateway

    @property
    def home(self) -> Path:
        return self.dir / "home"

    @property
    def bin(self) -> Path:
        return self.dir / "bin"

    @property
    def sbin(self) -> Path:
        """Root-owned wrappers that sudo's secure_path finds first (harmless root steps)."""
        return self.dir / "sbin"

    @property
    def hook_dir(self) -> Path:
        return self.dir / "hook"

    @property
    def gpu_state_file(self) -> Path:
        return self.dir / "gpu" / "state.json"

    @property
    def docker_sock(self) -> Path:
        return self.dir / "docker" / "docker.sock"

    @property
    def docker_host(self) -> str:
        return f"unix://{self.docker_sock}"

    @property
    def sshd_pidfile(self) -> Path:
        return self.dir / "ssh" / "sshd.pid"

    @property
    def dockerd_pidfile(self) -> Path:
        return self.dir / "docker" / "dockerd.pid"

    @property
    def sudoers_file(self) -> Path:
        return Path("/etc/sudoers.d") / self.user

    @property
    def is_gateway(self) -> bool:
        return self.hardware is None


class Layout:
    def __init__(self, root: Path | None = None, slot: int | None = None) -> None:
        self.root = Path(root or os.environ.get("SPARK_SIM_ROOT") or DEFAULT_ROOT).resolve()
        raw_slot = slot if slot is not None else os.environ.get("SPARK_SIM_SLOT", "0")
        try:
            self.slot = int(raw_slot)
        except ValueError:
            raise SimError(f"SPARK_SIM_SLOT={raw_slot!r} is not a number; use 0-31") from None
        if not 0 <= self.slot <= 31:
            raise SimError(f"SPARK_SIM_SLOT={self.slot} is out of range; use 0-31")
        if len(self.root.parts) < 3:
            raise SimError(f"SPARK_SIM_ROOT={self.root} is too close to /; use a dedicated dir like {DEFAULT_ROOT}")
        self.prefix = "sp" if self.slot == 0 else f"sp{self.slot}"
        self.subnet = f"10.213.{self.slot}"

    @property
    def state_file(self) -> Path:
        return self.root / "state.json"

    @property
    def marker(self) -> Path:
        """Present in every root the sim made: `down` deletes only such a root (or an empty one)."""
        return self.root / ".spark-sim-root"

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}-net"

    @property
    def root_link(self) -> str:
        return f"{self.prefix}-sim"

    @property
    def host_ip(self) -> str:
        return f"{self.subnet}.1"

    @property
    def hub_cache(self) -> Path:
        """The local model source (an HF hub cache layout) that the node's `hf` reads."""
        return self.root / "upstream" / "hub"

    @property
    def client_dir(self) -> Path:
        return self.root / "client"

    @property
    def key_path(self) -> Path:
        return self.client_dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.client_dir / "known_hosts"

    def member(self, name: str, index: int, hardware: str | None) -> Member:
        octet = 2 if hardware is None else 10 + index
        return Member(
            name=name,
            ip=f"{self.subnet}.{octet}",
            netns=f"{self.prefix}-{name}",
            user=f"{self.prefix}-{name}",
            dir=self.root / name,
            hardware=hardware,
        )

    def members(self, nodes: int) -> list[Member]:
        out = [self.member(f"spark{i}", i, "founders" if i == 1 else "gx10") for i in range(1, nodes + 1)]
        return [*out, self.member("gateway", 0, None)]


# -- small effects -----------------------------------------------------------------------------


def _run(argv: list[str], *, check: bool = True, what: str = "", env: dict[str, str] | None = None,
         input: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=env, input=input, timeout=timeout)
    except FileNotFoundError:
        raise SimError(f"{argv[0]} is not installed; apt-get install the sim's packages (see .ci/run)") from None
    except subprocess.TimeoutExpired:
        raise SimError(f"{what or argv[0]} did not finish within {timeout:.0f} s") from None
    if check and p.returncode != 0:
        msg = (p.stderr or p.stdout).strip().splitlines()
        raise SimError(f"{what or ' '.join(argv[:4])} failed (exit {p.returncode}): {msg[-1] if msg else ''}")
    return p


def _write(path: Path, text: str, mode: int = 0o644, owner: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.chmod(tmp, mode)
    if owner:
        shutil.chown(tmp, owner, owner)
    tmp.replace(path)


def _pid_from(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _netns_exists(name: str) -> bool:
    return Path("/run/netns", name).exists()


def _netns_pids(name: str) -> list[int]:
    if not _netns_exists(name):
        return []
    p = _run(["ip", "netns", "pids", name], check=False)
    return [int(x) for x in p.stdout.split() if x.isdigit()]


def _user_pids(user: str) -> list[int]:
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


def _kill_all(pids: list[int], grace_s: float = 5.0) -> None:
    """TERM, wait up to grace_s, then KILL: dockerd stops its containers on TERM."""
    pids = [p for p in pids if p != os.getpid()]
    for p in pids:
        try:
            os.kill(p, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    for p in pids:
        if _alive(p):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
    # KILL is asynchronous: wait so namespaces, cgroups and users are free to remove.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)


def _docker_ping(sock: Path) -> bool:
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


def _ssh_banner(ip: str, port: int = SSH_PORT) -> bool:
    try:
        with socket.create_connection((ip, port), timeout=1) as s:
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def _wait(what: str, ready: Any, timeout_s: float, log: Path | None = None, failed: Any = None) -> None:
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


# -- the fleet ---------------------------------------------------------------------------------


class SimFleet:
    """A simulated fleet under one root. `up()` then `down()`; `status()` and `set_gpu()` between."""

    def __init__(self, root: str | os.PathLike[str] | None = None, slot: int | None = None) -> None:
        self.layout = Layout(Path(root) if root else None, slot)
        self.state: dict[str, Any] = self._load_state()

    # -- state file --

    def _load_state(self) -> dict[str, Any]:
        try:
            return json.loads(self.layout.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def _save_state(self) -> None:
        lay = self.layout
        if not lay.root.exists() or not any(lay.root.iterdir()):
            lay.root.mkdir(parents=True, exist_ok=True)
            lay.marker.touch()
        elif not lay.marker.exists():
            raise SimError(f"{lay.root} exists and was not made by the sim; set SPARK_SIM_ROOT to a new dir")
        _write(self.layout.state_file, json.dumps(self.state, indent=2), mode=0o600)

    def _record(self, kind: str, value: str) -> None:
        made = self.state.setdefault("made", {})
        if value not in made.setdefault(kind, []):
            made[kind].append(value)
            self._save_state()

    # -- queries --

    @property
    def is_up(self) -> bool:
        return any(_netns_exists(ns) for ns in self.state.get("made", {}).get("netns", []))

    @property
    def members(self) -> list[Member]:
        return [Member(**{**m, "dir": Path(m["dir"])}) for m in self.state.get("members", [])]

    @property
    def nodes(self) -> list[Member]:
        return [m for m in self.members if not m.is_gateway]

    @property
    def gateway(self) -> Member:
        return next(m for m in self.members if m.is_gateway)

    def node(self, name: str) -> Member:
        for m in self.nodes:
            if m.name == name:
                return m
        known = ", ".join(m.name for m in self.nodes) or "none (run `spark-pipelines sim up`)"
        raise SimError(f"no simulated node named {name!r}; known nodes: {known}")

    @property
    def fleet_file(self) -> Path | None:
        f = self.state.get("fleet_file")
        return Path(f) if f else None

    @property
    def hub_cache(self) -> Path | None:
        """The local model source (an HF hub cache) standing in for the Hugging Face hub."""
        h = self.state.get("hub_cache")
        return Path(h) if h else None

    @property
    def master_key_file(self) -> Path:
        """The gateway proxy's master key (root-only file)."""
        return self.gateway.dir / "master_key"

    # -- up --

    def up(self, nodes: int = 2, fleet_out: str | os.PathLike[str] = DEFAULT_FLEET_OUT,
           tokens_per_second: float = DEFAULT_TOKENS_PER_SECOND) -> Path:
        """Start `nodes` simulated nodes and the gateway host; write and return the fleet file.
        tokens_per_second: the stand-in engine's single-stream decode rate on a healthy node."""
        if not 0 < tokens_per_second <= 100_000:
            raise SimError(f"--tokens-per-second {tokens_per_second:g}: choose a rate in (0, 100000]")
        self.tokens_per_second = tokens_per_second
        if not 1 <= nodes <= MAX_NODES:
            raise SimError(f"--nodes {nodes}: choose between 1 and {MAX_NODES}")
        if os.geteuid() != 0:
            raise SimError("sim up needs root (network namespaces, users, dockerd); run it as root")
        missing = [b for b in REQUIRED_BINARIES if not shutil.which(b)]
        if missing:
            raise SimError(f"missing programs: {', '.join(missing)}; apt-get install the sim's packages (see .ci/run)")
        if self.is_up:
            raise SimError(f"a simulated fleet is already up under {self.layout.root}; run `spark-pipelines sim down` first")
        if self.state or self.layout.root.exists():
            self.down()  # leftovers of a crashed run
        fleet_path = Path(fleet_out).resolve()
        seed = self._read_seed()
        # The stand-in nvidia-smi shows load while the engine on this port has requests running.
        self.engine_port = int(seed.get("launch", {}).get("port", 8000))
        members = self.layout.members(nodes)
        self.state = {
            "version": 1,
            "root": str(self.layout.root),
            "slot": self.layout.slot,
            "members": [{**m.__dict__, "dir": str(m.dir)} for m in members],
            "made": {},
        }
        self._save_state()
        try:
            with ThreadPoolExecutor(max_workers=1) as pool:
                # The base image (cached after the first run) builds while namespaces come up.
                tarball = pool.submit(base_image.build_tarball)
                self._make_client_key()
                self._make_switch()
                host_keys = {m.name: self._make_member(m) for m in members}
                self._write_known_hosts(members, host_keys)
                for m in members:
                    self._start_sshd(m)
                for m in members:
                    if not m.is_gateway:
                        self._start_dockerd(m)
                for m in members:
                    _wait(f"sshd of {m.name} ({m.ip}:{SSH_PORT})", lambda m=m: _ssh_banner(m.ip), 15,
                          m.dir / "ssh" / "sshd.log")
                for m in members:
                    if not m.is_gateway:
                        log = m.dir / "docker" / "dockerd.log"
                        _wait(f"dockerd of {m.name}", lambda m=m: _docker_ping(m.docker_sock), 30, log,
                              failed=lambda log=log: _dockerd_failed(log))
                tar = tarball.result()
            with ThreadPoolExecutor(max_workers=2) as pool:
                list(pool.map(lambda m: base_image.import_into(m.docker_host, tar), self.nodes))
            pins = self._make_upstream()
            fleet_doc = self._fleet_doc(seed, members, pins)
            parse_fleet(fleet_doc, "simulated fleet")  # refuse to write a fleet the tools would refuse
            text = (
                "# Simulated fleet written by `spark-pipelines sim up`: the seed fleet with only what must\n"
                "# differ to reach the simulated nodes. `spark-pipelines sim down` removes it.\n"
                + yaml.safe_dump(fleet_doc, sort_keys=False)
            )
            self.state["fleet_file"] = str(fleet_path)
            self.state["fleet_sha256"] = hashlib.sha256(text.encode()).hexdigest()
            self._save_state()
            _write(fleet_path, text)
            load_fleet(fleet_path)
        except BaseException:
            self.down()
            raise
        return fleet_path

    def _read_seed(self) -> dict[str, Any]:
        try:
            return yaml.safe_load(SEED_FLEET.read_text())
        except OSError as e:
            raise SimError(f"seed fleet {SEED_FLEET} cannot be read: {e.strerror}") from None

    def _make_client_key(self) -> None:
        lay = self.layout
        lay.client_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(lay.client_dir, 0o700)
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"spark-sim-{lay.slot}", "-f", str(lay.key_path)],
             what="ssh-keygen (client key)")

    def _make_switch(self) -> None:
        lay = self.layout
        self._record("netns", lay.switch_ns)
        _run(["ip", "netns", "add", lay.switch_ns], what=f"ip netns add {lay.switch_ns}")
        sw = ["ip", "-n", lay.switch_ns]
        _run([*sw, "link", "add", "br0", "type", "bridge"], what="creating the sim bridge")
        _run([*sw, "link", "set", "br0", "up"])
        _run([*sw, "link", "set", "lo", "up"])
        self._record("links", lay.root_link)
        _run(["ip", "link", "add", lay.root_link, "type", "veth", "peer", "name", "host", "netns", lay.switch_ns],
             what=f"creating veth {lay.root_link}")
        _run([*sw, "link", "set", "host", "master", "br0", "up"])
        _run(["ip", "addr", "add", f"{lay.host_ip}/24", "dev", lay.root_link])
        _run(["ip", "link", "set", lay.root_link, "up"])

    def _make_member(self, m: Member) -> list[str]:
        """Namespace, user, files and keys of one member; returns its host public key line."""
        lay = self.layout
        self._record("netns", m.netns)
        _run(["ip", "netns", "add", m.netns], what=f"ip netns add {m.netns}")
        port = f"p{m.ip.rsplit('.', 1)[1]}"
        _run(["ip", "-n", lay.switch_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", m.netns],
             what=f"creating the veth of {m.name}")
        _run(["ip", "-n", lay.switch_ns, "link", "set", port, "master", "br0", "up"])
        _run(["ip", "-n", m.netns, "addr", "add", f"{m.ip}/24", "dev", "eth0"])
        _run(["ip", "-n", m.netns, "link", "set", "eth0", "up"])
        _run(["ip", "-n", m.netns, "link", "set", "lo", "up"])

        for d in (m.dir, m.bin, m.sbin, m.hook_dir, m.dir / "ssh", m.dir / "docker", m.gpu_state_file.parent):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o755)
        self._record("users", m.user)
        _run(["useradd", "-m", "-d", str(m.home), "-s", "/bin/bash", "-U", "-c", f"spark-pipelines sim {m.name}", m.user],
             what=f"useradd {m.user}")
        # A locked account ('!') makes sshd refuse even key logins; '*' = no password, not locked.
        _run(["usermod", "-p", "*", m.user])
        ssh_dir = m.home / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        pub = Path(f"{lay.key_path}.pub").read_text()
        _write(ssh_dir / "authorized_keys", pub, 0o600)
        # The same key on every node lets the build node stream to the serving nodes (rsync over ssh).
        shutil.copyfile(lay.key_path, ssh_dir / "id_ed25519")
        os.chmod(ssh_dir / "id_ed25519", 0o600)
        _write(ssh_dir / "id_ed25519.pub", pub)
        _run(["chown", "-R", f"{m.user}:{m.user}", str(m.home)])

        hostkey = m.dir / "ssh" / "ssh_host_ed25519_key"
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{m.name}-host", "-f", str(hostkey)],
             what=f"ssh-keygen (host key of {m.name})")
        _write(m.dir / "ssh" / "sshd_config", self._sshd_config(m, hostkey))
        if m.is_gateway:
            self._make_gateway_files(m)
        else:
            self._make_node_files(m)
        return Path(f"{hostkey}.pub").read_text().split()[0:2]

    def _sshd_config(self, m: Member, hostkey: Path) -> str:
        env = [f"PATH={m.bin}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", f"SIM_NODE={m.name}"]
        if not m.is_gateway:
            env += [f"DOCKER_HOST={m.docker_host}", f"SIM_GPU_STATE_FILE={m.gpu_state_file}",
                    f"HF_HUB_CACHE={self.layout.hub_cache}"]
        lines = [
            f"# sshd of simulated {m.name}, written by `spark-pipelines sim up`",
            f"ListenAddress {m.ip}",
            f"Port {SSH_PORT}",
            f"HostKey {hostkey}",
            f"PidFile {m.sshd_pidfile}",
            f"AllowUsers {m.user}",
            "AuthorizedKeysFile .ssh/authorized_keys",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin no",
            "UsePAM no",
            "StrictModes no",
            "MaxStartups 500:30:1000",
            "MaxSessions 100",
            "PrintMotd no",
            "ClientAliveInterval 30",
            "Subsystem sftp /usr/lib/openssh/sftp-server",
            "SetEnv " + " ".join(env),
        ]
        return "\n".join(lines) + "\n"

    def _make_node_files(self, m: Member) -> None:
        py, pythonpath = _node_python()
        state = {"state": "healthy", "profile": m.hardware, "engine_port": self.engine_port}
        _write(m.gpu_state_file, json.dumps(state), 0o664, owner=m.user)
        # The GB10 nvidia-smi stand-in; under sudo the env is reset, hence the default state file.
        _write(m.bin / "nvidia-smi", (
            "#!/bin/sh\n"
            f": \"${{SIM_GPU_STATE_FILE:={m.gpu_state_file}}}\"\n"
            f"export SIM_GPU_STATE_FILE PYTHONPATH={pythonpath}\n"
            f"exec {py} -m spark_sim.nvidia_smi_standin \"$@\"\n"
        ), 0o755)
        hf = Path(__file__).with_name("hf_standin.py")
        if hf.exists():  # `hf download` reads the local model source instead of the Hub
            _write(m.bin / "hf", f"#!/bin/sh\nexec {py} -s {hf} \"$@\"\n", 0o755)
        # runc runs the hook with an empty environment: everything is spelled out here.
        _write(m.hook_dir / "nvidia-container-runtime-hook", (
            "#!/bin/sh\n"
            f"SIM_TOKENS_PER_SECOND={self.tokens_per_second:g} "
            f"PYTHONPATH={pythonpath} exec {py} -s {Path(gpu_hook.__file__).resolve()} "
            f"--state-file {m.gpu_state_file} \"$@\"\n"
        ), 0o755)
        # Root steps of the runbook, made harmless: drop caches writes a node-local file.
        vm = m.dir / "vm"
        vm.mkdir(exist_ok=True)
        _write(m.sbin / "sh", (
            "#!/bin/sh\n"
            "# sim stand-in for `sudo sh -c 'sync; echo 3 > /proc/sys/vm/drop_caches'` on a node\n"
            "if [ \"$#\" -eq 2 ] && [ \"$1\" = -c ] && [ \"$2\" = 'sync; echo 3 > /proc/sys/vm/drop_caches' ]; then\n"
            f"  echo 3 > {vm}/drop_caches && date -u +%FT%TZ >> {vm}/drop_caches.log && exit 0\n"
            "fi\n"
            "echo \"sim: only the runbook's drop-caches command runs as root on a simulated node\" >&2\n"
            "exit 1\n"
        ), 0o755)
        services = m.dir / "services"
        services.mkdir(exist_ok=True)
        _write(m.sbin / "systemctl", (
            "#!/bin/sh\n"
            "# sim stand-in for systemctl: units are files under the node's services dir\n"
            f"dir={services}\n"
            "case \"$1\" in\n"
            "  get-default) echo multi-user.target ;;\n"
            "  is-active) shift; rc=0; for u in \"$@\"; do s=$(cat \"$dir/$u\" 2>/dev/null || echo inactive);"
            " echo \"$s\"; [ \"$s\" = active ] || rc=3; done; exit $rc ;;\n"
            "  stop|disable|mask) shift; for u in \"$@\"; do case \"$u\" in --*) ;; *) echo inactive > \"$dir/$u\";; esac; done ;;\n"
            "  start|enable|restart) shift; for u in \"$@\"; do echo active > \"$dir/$u\"; done ;;\n"
            "  *) echo \"sim systemctl: unsupported: $*\" >&2; exit 1 ;;\n"
            "esac\n"
        ), 0o755)
        self._install_sudoers(m, [
            f"{m.sbin}/sh -c sync; echo 3 > /proc/sys/vm/drop_caches",
            "/usr/bin/fuser",
            f"{m.sbin}/systemctl",
            f"{m.bin}/nvidia-smi -pm *", f"{m.bin}/nvidia-smi -lgc *", f"{m.bin}/nvidia-smi -rgc",
        ])
        _write(m.dir / "docker" / "daemon.json", "{}\n")

    def _make_gateway_files(self, m: Member) -> None:
        """`litellm-restart` stands in for `docker compose restart litellm`. The proxy runs as
        root through one sudoers line (as it would in its container): the litellm venv's
        interpreter lives under root's 0700 home, out of the gateway user's reach."""
        work = m.home / "litellm"
        work.mkdir(exist_ok=True)
        shutil.chown(work, m.user, m.user)
        key = os.environ.get("LITELLM_MASTER_KEY") or f"sk-sim-{secrets.token_urlsafe(24)}"
        key_file = m.dir / "master_key"  # root-only; the proxy reads it, never the command line
        _write(key_file, key + "\n", 0o600)
        cfg, pidfile, log = work / "config.yaml", m.dir / "litellm.pid", work / "litellm.log"
        _write(m.sbin / "litellm-proxy", (
            "#!/bin/sh\n"
            "# (Re)start the simulated gateway's LiteLLM proxy; run as root via sudo.\n"
            "set -u\n"
            f"cfg={cfg}; pidfile={pidfile}; log={log}\n"
            f"[ -x {LITELLM_BIN} ] || {{ echo \"litellm-proxy: {LITELLM_BIN} is missing; install litellm[proxy] there\" >&2; exit 1; }}\n"
            "[ -f \"$cfg\" ] || { echo \"litellm-proxy: $cfg does not exist; write the gateway config first\" >&2; exit 1; }\n"
            "if [ -f \"$pidfile\" ]; then\n"
            "  old=$(cat \"$pidfile\"); kill \"$old\" 2>/dev/null\n"
            "  i=0; while kill -0 \"$old\" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done\n"
            "  kill -9 \"$old\" 2>/dev/null; rm -f \"$pidfile\"\n"
            "fi\n"
            f"LITELLM_MASTER_KEY=$(cat {key_file})\n"
            # Without LITELLM_LOCAL_MODEL_COST_MAP the proxy first tries an internet download.
            "export LITELLM_MASTER_KEY LITELLM_LOCAL_MODEL_COST_MAP=True\n"
            f"cd {work}\n"
            f"setsid {LITELLM_BIN} --config \"$cfg\" --host {m.ip} --port 4000 >\"$log\" 2>&1 </dev/null &\n"
            "echo $! > \"$pidfile\"\n"
            "chmod 644 \"$log\"\n"
            "echo $!\n"
        ), 0o755)
        url = f"http://{m.ip}:4000/health/liveliness"
        _write(m.bin / "litellm-restart", (
            "#!/bin/sh\n"
            "# Restart the simulated gateway's LiteLLM proxy and wait until it answers.\n"
            "set -u\n"
            f"log={log}\n"
            "pid=$(sudo -n litellm-proxy) || exit 1\n"
            "i=0\n"
            "while [ $i -lt 240 ]; do\n"
            f"  if python3 -c \"import urllib.request as u; u.urlopen('{url}', timeout=1)\" 2>/dev/null; then\n"
            f"    echo \"litellm ready on {m.ip}:4000 (pid $pid)\"; exit 0\n"
            "  fi\n"
            "  [ -d /proc/$pid ] || { echo 'litellm-restart: the proxy exited:' >&2; tail -n 5 \"$log\" >&2; exit 1; }\n"
            "  sleep 0.5; i=$((i+1))\n"
            "done\n"
            "echo \"litellm-restart: not ready after 120 s; see $log\" >&2; exit 1\n"
        ), 0o755)
        self._install_sudoers(m, [f"{m.sbin}/litellm-proxy"])

    def _install_sudoers(self, m: Member, commands: list[str]) -> None:
        sudoers = (
            f"# simulated {m.name}, written by `spark-pipelines sim up`; `sim down` removes it\n"
            f"Defaults:{m.user} secure_path=\"{m.sbin}:{m.bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\"\n"
            f"{m.user} ALL=(root) NOPASSWD: {', '.join(commands)}\n"
        )
        check = m.dir / "sudoers.check"
        _write(check, sudoers, 0o440)
        _run(["visudo", "-cf", str(check)], what=f"visudo check of the sudoers drop-in for {m.name}")
        check.unlink()
        self._record("sudoers", str(m.sudoers_file))
        _write(m.sudoers_file, sudoers, 0o440)

    def _write_known_hosts(self, members: list[Member], host_keys: dict[str, list[str]]) -> None:
        lines = "".join(f"{m.ip} {' '.join(host_keys[m.name])}\n" for m in members)
        _write(self.layout.known_hosts, lines, 0o644)
        for m in members:
            _write(m.home / ".ssh" / "known_hosts", lines, 0o644, owner=m.user)

    def _start_sshd(self, m: Member) -> None:
        log = m.dir / "ssh" / "sshd.log"
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        # sshd daemonizes itself (no zombie left with the caller) and writes its PidFile.
        _run(["ip", "netns", "exec", m.netns, "/usr/sbin/sshd", "-f", str(m.dir / "ssh" / "sshd_config"), "-E", str(log)],
             what=f"starting sshd of {m.name}")

    def _start_dockerd(self, m: Member) -> None:
        d = m.dir / "docker"
        env = {
            "PATH": f"{m.hook_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(d),
            "LANG": "C.UTF-8",
        }
        # Not `ip netns exec`: it remounts /sys and so hides the cgroup mounts dockerd needs.
        # A private mount namespace (slave: host mounts still come in) keeps dockerd's overlay
        # mounts out of the host's table, so a crashed sim leaves no mounts behind.
        argv = [
            "setsid", "-f", "unshare", "--mount", "--propagation", "slave",
            "nsenter", f"--net=/run/netns/{m.netns}", "dockerd",
            "--config-file", str(d / "daemon.json"),
            "--data-root", str(d / "data"),
            "--exec-root", str(d / "exec"),
            "--pidfile", str(m.dockerd_pidfile),
            "-H", m.docker_host,
            "--group", m.user,
            "--storage-driver", "overlay2",
            "--iptables=false", "--ip-forward=false", "--ip-masq=false", "--bridge=none",
            "--userland-proxy=false", "--log-level", "warn",
            "--cgroup-parent", self._cgroup_parent(m),
        ]
        with open(d / "dockerd.log", "ab") as log:
            # setsid -f: dockerd is re-parented away from us, so no zombie stays with the caller.
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, check=True, timeout=30)

    def _cgroup_parent(self, m: Member) -> str:
        return f"spark-sim-{m.netns}"

    def _make_upstream(self) -> dict[str, Any]:
        """Local stand-ins of the recipe and build repos and of the HF hub, if the module exists."""
        try:
            from spark_sim import upstream
        except ImportError:
            return {}
        base = self.layout.root / "upstream"
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o755)
        recipe_sha = upstream.make_recipe_repo(base / "recipe")
        build_sha = upstream.make_build_repo(base / "build")
        source = upstream.make_model_source(self.layout.hub_cache)
        self.state["hub_cache"] = str(source.hub_cache)
        self._save_state()
        # The stand-in repos belong to root; git refuses to clone a repo another user owns
        # ("dubious ownership"), so each node user trusts exactly these two.
        trusted = "".join(f"\tdirectory = {base / r}\n\tdirectory = {base / r}/.git\n" for r in ("recipe", "build"))
        for m in self.nodes:
            _write(m.home / ".gitconfig", f"[safe]\n{trusted}", 0o644, owner=m.user)
        return {
            "recipe_repo": {"url": f"file://{base / 'recipe'}", "commit": recipe_sha},
            "build_repo": {"url": f"file://{base / 'build'}", "commit": build_sha},
            "base_model_revision": source.intel_revision,
            "fp8_model_revision": source.fp8_revision,
        }

    def _fleet_doc(self, seed: dict[str, Any], members: list[Member], pins: dict[str, Any]) -> dict[str, Any]:
        doc = copy.deepcopy(seed)
        lay = self.layout
        templates = {n["hardware"]: n for n in seed["nodes"]}

        def target(m: Member) -> dict[str, Any]:
            return {"host": m.ip, "port": SSH_PORT, "user": m.user, "key_path": str(lay.key_path),
                    "known_hosts": str(lay.known_hosts), "home": str(m.home)}

        nodes = []
        for m in members:
            if m.is_gateway:
                continue
            template = copy.deepcopy(templates.get(m.hardware) or seed["nodes"][-1])
            # Same key order as the seed, with the reach fields where an operator looks for them.
            node = {"name": m.name, **target(m)}
            node.update({k: v for k, v in template.items() if k not in node})
            if m.name != "spark1":
                node["roles"] = ["serve"]
            nodes.append(node)
        doc["nodes"] = nodes
        gw = next(m for m in members if m.is_gateway)
        work = gw.home / "litellm"
        doc["gateway"].update({
            **target(gw),
            "config_path": str(work / "config.yaml"),
            "reload_dir": str(work),
            "reload_command": [str(gw.bin / "litellm-restart")],
        })
        # The stand-in checkpoint is a few MB, not ~71 GB: the runbook's disk floors do not apply.
        doc["preflight"] = {"build_host_disk_gib": 1, "serve_node_disk_gib": 1}
        # The stand-in needs no warm-up (no JIT, no graph capture): one measured run keeps the demo short.
        doc["bench"]["repeats"] = 1
        if pins:
            doc["pins"]["recipe_repo"] = pins["recipe_repo"]
            doc["pins"]["build_repo"] = pins["build_repo"]
            doc["pins"]["base_model"]["revision"] = pins["base_model_revision"]
            doc["pins"]["fp8_model"]["revision"] = pins["fp8_model_revision"]
        return doc

    # -- down --

    def down(self) -> list[str]:
        """Remove every process, container, namespace, user, sudoers file and file the sim made.
        Idempotent; works from the state file and the naming convention after a crash."""
        lay = self.layout
        if lay.root.exists() and not lay.marker.exists() and any(lay.root.iterdir()):
            raise SimError(f"{lay.root} was not made by the sim (no {lay.marker.name}); not touching it")
        made = self.state.get("made", {})
        done: list[str] = []
        netns = list(dict.fromkeys(
            [*made.get("netns", []),
             *(n.split()[0] for n in _run(["ip", "netns", "list"], check=False).stdout.splitlines()
               if n.startswith(f"{lay.prefix}-"))]
        ))
        users = list(dict.fromkeys([*made.get("users", []), *(m.user for m in self.members)]))
        # Only users of ours: the prefix AND a home under the sim root.
        users += [p.pw_name for p in pwd.getpwall()
                  if p.pw_name.startswith(f"{lay.prefix}-") and p.pw_dir.startswith(f"{lay.root}/") and p.pw_name not in users]
        # Every process of a node lives in its namespace (sshd, sessions, dockerd, containerd,
        # containers, litellm): TERM them (dockerd stops its containers), then KILL the rest.
        cgroups = list(dict.fromkeys([*(f"spark-sim-{ns}" for ns in netns), *_cgroup_parents(lay.prefix)]))

        def ours() -> list[int]:
            # Containers not on the host network have namespaces of their own: their cgroups
            # (under the node's --cgroup-parent) find them, also after dockerd was killed.
            return list(dict.fromkeys(
                [p for ns in netns for p in _netns_pids(ns)]
                + [p for cg in cgroups for p in _cgroup_pids(cg)]
                + [p for u in users for p in _user_pids(u)]
            ))

        pids = ours()
        dockerds = [p for p in pids if _comm(p) == "dockerd"]
        if dockerds:
            _kill_all(dockerds, grace_s=10)
        pids = ours()
        if pids:
            _kill_all(list(dict.fromkeys(pids)))
            done.append(f"stopped {len(pids)} processes")
        for cg in cgroups:
            _remove_cgroups(cg)
        for ns in netns:
            if _netns_exists(ns):
                _run(["ip", "netns", "del", ns], check=False)
                done.append(f"removed netns {ns}")
        for link in [*made.get("links", []), lay.root_link]:
            if Path("/sys/class/net", link).exists():
                _run(["ip", "link", "del", link], check=False)
        for u in users:
            try:
                pwd.getpwnam(u)
            except KeyError:
                continue
            _run(["userdel", u], check=False)
            done.append(f"removed user {u}")
            try:
                grp.getgrnam(u)
                _run(["groupdel", u], check=False)
            except KeyError:
                pass
        for f in {*made.get("sudoers", []), *(f"/etc/sudoers.d/{u}" for u in users)}:
            if Path(f).exists():
                Path(f).unlink()
        fleet_file = self.fleet_file
        if fleet_file and fleet_file.exists():
            # Only the file we wrote: an edited copy is the operator's now.
            if hashlib.sha256(fleet_file.read_bytes()).hexdigest() == self.state.get("fleet_sha256"):
                fleet_file.unlink()
                done.append(f"removed {fleet_file}")
        if lay.root.exists():
            _unmount_under(lay.root)
            shutil.rmtree(lay.root, ignore_errors=True)
            if lay.root.exists():
                raise SimError(f"{lay.root} could not be removed completely; check `findmnt -R {lay.root}`")
            done.append(f"removed {lay.root}")
        self.state = {}
        return done

    # -- status and GPU state --

    def status(self) -> list[dict[str, Any]]:
        rows = []
        for m in self.members:
            sshd = _pid_from(m.sshd_pidfile)
            row: dict[str, Any] = {
                "name": m.name, "ip": m.ip, "netns": m.netns, "netns_up": _netns_exists(m.netns),
                "user": m.user, "sshd_pid": sshd, "sshd_alive": _alive(sshd),
            }
            if not m.is_gateway:
                dockerd = _pid_from(m.dockerd_pidfile)
                row.update({"dockerd_pid": dockerd, "dockerd_alive": _alive(dockerd) and _docker_ping(m.docker_sock)})
                try:
                    row["gpu"] = json.loads(m.gpu_state_file.read_text())
                except (OSError, ValueError):
                    row["gpu"] = None
                row["containers"] = self.containers(m) if row["dockerd_alive"] else []
            else:
                proxy = _pid_from(m.dir / "litellm.pid")
                row.update({"litellm_pid": proxy, "litellm_alive": _alive(proxy)})
            rows.append(row)
        return rows

    def containers(self, m: Member) -> list[str]:
        p = _run(["docker", "ps", "-a", "--format", "{{.Names}} {{.Status}}"], check=False,
                 env={**os.environ, "DOCKER_HOST": m.docker_host})
        return [line for line in p.stdout.splitlines() if line.strip()]

    def set_gpu(self, node: str, state: str) -> list[str]:
        """Change a node's GPU state; running GPU containers see it too. Returns refreshed containers."""
        m = self.node(node)
        if state not in GPU_STATES:
            raise SimError(f"unknown GPU state {state!r}; use one of {', '.join(GPU_STATES)}")
        try:
            doc = json.loads(m.gpu_state_file.read_text())
        except (OSError, ValueError):
            doc = {"profile": m.hardware}
        doc["state"] = state
        _write(m.gpu_state_file, json.dumps(doc), 0o664, owner=m.user)
        env = {**os.environ, "DOCKER_HOST": m.docker_host}
        ps = _run(["docker", "ps", "-q"], env=env, what=f"docker ps on {m.name}")
        refreshed = []
        staged = m.dir / "gpu" / "container-state.json"
        gpu_hook.write_container_state(m.gpu_state_file, staged)
        for cid in ps.stdout.split():
            req = _run(["docker", "inspect", "--format", "{{json .HostConfig.DeviceRequests}}", cid], env=env, check=False)
            if req.returncode != 0 or req.stdout.strip() in ("", "null", "[]"):
                continue
            _run(["docker", "cp", str(staged), f"{cid}:/{gpu_hook.CONTAINER_STATE_PATH}"], env=env,
                 what=f"docker cp of the GPU state into {cid} on {m.name}")
            refreshed.append(cid)
        return refreshed


def _node_python() -> tuple[str, str]:
    """A python the node users can execute, and a PYTHONPATH giving it this project and its
    dependencies (pydantic). The venv's own interpreter may live under root's 0700 home."""
    import sysconfig

    packages = sysconfig.get_paths()["purelib"]
    path = ":".join(dict.fromkeys([str(PROJECT_ROOT), str(PROJECT_ROOT / "sim"), packages]))
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if system.exists():
        return str(system), path
    return sys.executable, path


def _dockerd_failed(log: Path) -> bool:
    try:
        text = log.read_bytes()
    except OSError:
        return False
    return b"failed to start daemon" in text or b"dockerd --help" in text


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


# cgroup v1 (this machine) keeps the pids controller in its own hierarchy; v2 has one tree.
_CGROUP_TREES = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))


def _cgroup_parents(prefix: str) -> list[str]:
    found: list[str] = []
    for tree in _CGROUP_TREES:
        if tree.is_dir():
            found += [d.name for d in tree.glob(f"spark-sim-{prefix}-*") if d.is_dir()]
    return found


def _cgroup_pids(parent: str) -> list[int]:
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


def _remove_cgroups(parent: str) -> None:
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


def _unmount_under(root: Path) -> None:
    """Mounts left in the root namespace under the sim root (none expected: dockerd mounts in
    the private mount namespace `ip netns exec` gives it)."""
    try:
        mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return
    for mp in sorted((p for p in mounts if p == str(root) or p.startswith(f"{root}/")), key=len, reverse=True):
        _run(["umount", "-l", mp], check=False)


# -- command line ------------------------------------------------------------------------------


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="spark-pipelines sim", description="the simulated GB10 fleet")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    up = sub.add_parser("up", help="start the simulated nodes and write a fleet file for them")
    up.add_argument("--nodes", type=int, default=2, help="number of nodes (spark1 founders+build, spark2.. gx10)")
    up.add_argument("--fleet-out", default=DEFAULT_FLEET_OUT, help="fleet file to write (default: sim-fleet.yaml)")
    up.add_argument("--tokens-per-second", type=float, default=DEFAULT_TOKENS_PER_SECOND,
                    help="stand-in engine's single-stream rate on a healthy node (default 52, the runbook's)")
    sub.add_parser("down", help="remove every process, namespace, user and file the sim made")
    sub.add_parser("status", help="show each node's namespace, sshd, dockerd, GPU state and containers")
    st = sub.add_parser("set", help="set a node's simulated GPU state")
    st.add_argument("node")
    st.add_argument("state", help=" | ".join(GPU_STATES))
    return p


def _print_status(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("no simulated fleet is up (run `spark-pipelines sim up`)")
        return
    for r in rows:
        parts = [
            f"{r['name']:<9}", f"{r['ip']:<12}",
            f"netns {r['netns']} {'up' if r['netns_up'] else 'MISSING'}",
            f"sshd {r['sshd_pid'] or '-'} {'alive' if r['sshd_alive'] else 'DEAD'}",
        ]
        if "dockerd_alive" in r:
            gpu = r["gpu"] or {}
            parts += [
                f"dockerd {'alive' if r['dockerd_alive'] else 'DEAD'}",
                f"gpu {gpu.get('state', '?')} ({gpu.get('profile', '?')})",
                f"containers: {'; '.join(r['containers']) or 'none'}",
            ]
        elif "litellm_alive" in r:
            parts.append(f"litellm {r['litellm_pid']} alive" if r["litellm_alive"] else "litellm not running")
        print("  ".join(parts))


def sim_command(argv: list[str]) -> int:
    """`spark-pipelines sim up [--nodes N] [--fleet-out FILE] | down | status | set NODE STATE`."""
    try:
        args = _parser().parse_args(argv)
    except _UsageError as e:
        print(f"spark-pipelines sim: {e}", file=sys.stderr)
        return 2
    try:
        if args.cmd == "set" and args.state not in GPU_STATES:
            print(f"spark-pipelines sim set: unknown GPU state {args.state!r}; use one of {', '.join(GPU_STATES)}",
                  file=sys.stderr)
            return 2
        fleet = SimFleet()
        if args.cmd == "up":
            if not 1 <= args.nodes <= MAX_NODES:
                print(f"spark-pipelines sim up: --nodes {args.nodes}: choose between 1 and {MAX_NODES}", file=sys.stderr)
                return 2
            t0 = time.monotonic()
            path = fleet.up(args.nodes, args.fleet_out, args.tokens_per_second)
            print(f"simulated fleet up: {args.nodes} nodes in {time.monotonic() - t0:.1f} s under {fleet.layout.root}")
            _print_status(fleet.status())
            print(f"fleet file: {path}")
        elif args.cmd == "down":
            for line in fleet.down():
                print(line)
            print("simulated fleet down")
        elif args.cmd == "status":
            _print_status(fleet.status())
        elif args.cmd == "set":
            if not fleet.state:
                print("spark-pipelines sim set: no simulated fleet is up (run `spark-pipelines sim up`)", file=sys.stderr)
                return 2
            try:
                fleet.node(args.node)
            except SimError as e:
                print(f"spark-pipelines sim set: {e}", file=sys.stderr)
                return 2
            refreshed = fleet.set_gpu(args.node, args.state)
            print(f"{args.node}: GPU state {args.state}" + (f" (refreshed {len(refreshed)} running containers)" if refreshed else ""))
        return 0
    except (SimError, FleetError, base_image.BaseImageError) as e:
        print(f"spark-pipelines sim {args.cmd}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(sim_command(sys.argv[1:]))
