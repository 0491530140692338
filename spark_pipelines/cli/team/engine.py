"""The Docker engine the team instance launches its containers on.

An operator's engine is used as it is when DOCKER_HOST names one. Otherwise the team runs a
dockerd of its own under its root: its socket, images and containers are the team's alone, so
`team down` can stop every container it started without touching anyone else's, and the host's
engine (if any) is never reconfigured. Host networking only (--bridge=none, no iptables): runs
reach the fleet and PostgreSQL as the daemon does.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from spark_pipelines.core.polling import poll_until

START_TIMEOUT_S = 60.0
STOP_GRACE_S = 30.0  # dockerd stops its containers on TERM


class EngineError(Exception):
    """The team's Docker engine could not be started; the message names the log."""


def ping(docker_host: str, timeout: float = 10) -> bool:
    try:
        p = subprocess.run(["docker", "version", "-f", "{{.Server.Version}}"], capture_output=True, timeout=timeout,
                           env={**os.environ, "DOCKER_HOST": docker_host})
    except (subprocess.TimeoutExpired, FileNotFoundError):
        return False
    return p.returncode == 0


@dataclass
class TeamEngine:
    root: Path  # <team root>/docker

    @property
    def sock(self) -> Path:
        return self.root / "docker.sock"

    @property
    def host(self) -> str:
        return f"unix://{self.sock}"

    @property
    def pidfile(self) -> Path:
        return self.root / "dockerd.pid"

    @property
    def log_path(self) -> Path:
        return self.root / "dockerd.log"

    @property
    def exec_root(self) -> Path:
        # containerd's socket paths must stay under the kernel's 108-byte limit: a short path in /run.
        return Path("/run") / f"spark-team-{hashlib.sha256(str(self.root).encode()).hexdigest()[:8]}"

    def pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text().strip())
            os.kill(pid, 0)
            return pid
        except (OSError, ValueError):
            return None

    def start(self) -> str:
        """Start it unless it answers already; returns its DOCKER_HOST."""
        if self.pid() and ping(self.host):
            return self.host
        if os.geteuid() != 0:
            raise EngineError("the team's own dockerd needs root; or set DOCKER_HOST to an engine you may use")
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        argv = [
            # A private mount namespace (slave: host mounts still come in) keeps the containers'
            # overlay mounts out of the host's table; setsid -f: no zombie stays with the caller.
            "setsid", "-f", "unshare", "--mount", "--propagation", "slave",
            "dockerd", "--data-root", str(self.root / "data"), "--exec-root", str(self.exec_root),
            "--pidfile", str(self.pidfile), "-H", self.host, "--storage-driver", "overlay2",
            "--bridge=none", "--iptables=false", "--ip-forward=false", "--ip-masq=false",
            "--userland-proxy=false", "--log-level", "warn",
        ]
        with open(self.log_path, "ab") as log:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, check=True, timeout=30)
        if not poll_until(lambda: ping(self.host, timeout=5), bool, timeout_s=START_TIMEOUT_S, every_s=0.5).done:
            raise EngineError(f"the team's dockerd did not answer within {START_TIMEOUT_S:.0f} s "
                              f"(log: {self.log_path})") from None
        return self.host

    def stop(self) -> bool:
        """TERM (dockerd stops its containers), then KILL after the grace. True if it was running."""
        pid = self.pid()
        if pid is None:
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and self.pid() == pid:
            time.sleep(0.2)
        if self.pid() == pid:
            os.kill(pid, signal.SIGKILL)
        return True
