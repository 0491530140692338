"""Where a simulated fleet lives: slot, root, names and addresses of its members."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
SEED_FLEET = PROJECT_ROOT / "fleets" / "seed.yaml"
DEFAULT_ROOT = Path("/var/lib/spark-sim")
DEFAULT_FLEET_OUT = "sim-fleet.yaml"
GPU_STATES = ("healthy", "idle", "wedged", "residue", "low-memory")
MAX_NODES = 32
SSH_PORT = 22
# The runbook's per-node single-stream figure (~52 tok/s); tests raise it to keep benches short.
DEFAULT_TOKENS_PER_SECOND = float(os.environ.get("SPARK_SIM_TOKENS_PER_SECOND", "52"))
# The real proxy, installed by scripts/bootstrap.sh (run as root on the gateway, see litellm-proxy).
LITELLM_BIN = Path(os.environ.get("SPARK_LITELLM_VENV", "/opt/spark-pipelines/litellm")) / "bin" / "litellm"
# What `litellm` runs, for `python3 -c` with the ascii codec imported first (node_host.py says why).
LITELLM_MAIN = "import encodings.ascii, sys; from litellm import run_server; sys.exit(run_server())"
REQUIRED_BINARIES = ("ip", "dockerd", "docker", "/usr/sbin/sshd", "ssh-keygen", "useradd", "userdel", "visudo", "nginx",
                     "sudo", "setsid", "setpriv", "fuser", "rsync", "git")
# The command that installs REQUIRED_BINARIES (and the venv) on a bare Debian machine.
INSTALL_HINT = "run `scripts/bootstrap.sh base` as root (it apt-get installs the sim's packages)"


class SimError(Exception):
    """The simulated fleet cannot do what was asked; the message says why and what to do."""


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

    def link_address(self, end: int) -> str:
        """An address on a node pair's direct link (network.make_pair_link): its own subnet, only
        the two nodes' namespaces are on it."""
        return f"10.214.{self.slot}.{end}"

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
