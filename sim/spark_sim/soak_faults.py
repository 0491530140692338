"""The soak's fault catalogue (spark_sim/soak.py injects them): each kind's injection on a node or
the gateway, returning its undo, built on spark_sim.faults and the simulator's own switches."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from spark_sim import faults as fx
from spark_sim import power

# `soak` below is a spark_sim.soak.Soak (not imported: soak.py imports this module).
Soak = Any


# -- the catalogue ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FaultSpec:
    inject: Callable[[Soak, str], Callable[[], None] | None]  # returns its undo (None: nothing to undo)
    hold_s: tuple[float, float] = (20.0, 60.0)
    scope: str = "node"  # node | gateway
    build_ok: bool = True  # may hit the build host (spark1) too


def _container(soak: Soak, node: str) -> str:
    return soak.fleet.launch_for(soak.fleet.node(node)).container_name


def _engine_killed(soak: Soak, node: str) -> None:
    fx.docker(soak.sim.node(node), "kill", _container(soak, node), check=False)
    return None


def _crash_loop(soak: Soak, node: str) -> None:
    """The engine's main process dies three times in a row; docker's restart policy (or the
    sweep) starts it again each time: a restart count the sweep reads as a crash loop."""
    m, name = soak.sim.node(node), _container(soak, node)
    fx.docker(m, "update", "--restart", "on-failure:50", name, check=False)
    for _ in range(3):
        pid = fx.docker(m, "inspect", "--format", "{{.State.Pid}}", name, check=False).stdout.strip()
        if pid and pid != "0":
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        time.sleep(6)
    return None


def _gpu_hook_fails(soak: Soak, node: str) -> Callable[[], None]:
    """The GPU state file the prestart hook reads is unreadable, and the engine dies: its next
    start fails at the hook until the file is back."""
    m = soak.sim.node(node)
    saved = m.gpu_state_file.read_text()
    m.gpu_state_file.write_text("{not json")
    fx.docker(m, "kill", _container(soak, node), check=False)
    return lambda: m.gpu_state_file.write_text(saved)


def _held(cm_factory: Callable[[Soak, str], Any]) -> Callable[[Soak, str], Callable[[], None]]:
    def inject(soak: Soak, node: str) -> Callable[[], None]:
        cm = cm_factory(soak, node)
        cm.__enter__()
        return lambda: cm.__exit__(None, None, None)
    return inject


def _reload_fails(soak: Soak, node: str) -> Callable[[], None]:
    """The gateway's reload command refuses (the next reloads fail) for the hold."""
    flag = soak.sim.gateway.home / "soak-reload-fails"
    flag.write_text("soak\n")
    return lambda: flag.unlink(missing_ok=True)


def _proxy_killed(soak: Soak, node: str) -> Callable[[], None]:
    fx.kill_proxy(soak.sim)
    return lambda: fx.restart_proxy(soak.sim)


def _power_off(soak: Soak, node: str) -> Callable[[], None]:
    m = soak.sim.node(node)
    power.off(m)
    return lambda: (power.on(m), None)[1]


def _reboot(soak: Soak, node: str) -> Callable[[], None]:
    m = soak.sim.node(node)
    power.off(m)
    time.sleep(3)
    power.on(m)
    return lambda: None


def _wedge(soak: Soak, node: str) -> Callable[[], None]:
    soak.sim.set_gpu(node, "wedged")
    return lambda: soak.sim.set_gpu(node, "healthy")


def _disk_full(soak: Soak, node: str) -> Any:
    m = soak.sim.node(node)
    return fx.tmpfs_over(m, m.home / ".cache" / "vllm", 64 * 1024)  # the JIT cache mount, full


def _ssh_dropped(soak: Soak, node: str) -> Callable[[], None]:
    """Armed for the hold: the SSH session of any copy to the node dies mid-copy."""
    killer = fx.SessionKiller(soak.sim.node(node))
    killer.__enter__()
    return lambda: killer.__exit__(None, None, None)


FAULTS: dict[str, FaultSpec] = {
    "engine-killed": FaultSpec(_engine_killed, (1, 2)),
    "crash-loop": FaultSpec(_crash_loop, (1, 2)),
    "gpu-hook-fails": FaultSpec(_gpu_hook_fails, (30, 60)),
    "dockerd-frozen": FaultSpec(_held(lambda s, n: fx.frozen_dockerd(s.sim.node(n))), (20, 50)),
    "sshd-frozen": FaultSpec(_held(lambda s, n: fx.frozen_sshd(s.sim.node(n))), (20, 50)),
    "ssh-dropped-mid-copy": FaultSpec(_ssh_dropped, (60, 120)),
    "gateway-reload-fails": FaultSpec(_reload_fails, (30, 60), scope="gateway"),
    "proxy-killed": FaultSpec(_proxy_killed, (5, 15), scope="gateway"),
    "node-rebooted": FaultSpec(_reboot, (1, 2)),
    "node-powered-off": FaultSpec(_power_off, (40, 90)),
    "disk-full": FaultSpec(_held(_disk_full), (30, 60)),
    "network-dropped": FaultSpec(_held(lambda s, n: fx.link_down(s.sim.node(n))), (20, 60)),
    "wedge": FaultSpec(_wedge, (40, 80)),
    "slow-node": FaultSpec(_held(lambda s, n: fx.slow_link(s.sim.node(n), "1mbit")), (30, 60)),
}


def prepare(soak: Soak) -> None:
    """The gateway's reload goes through a wrapper that refuses while the soak's flag is set
    (the gateway-reload-fails fault); the fleet file names it, and the code location reloads."""
    gw = soak.sim.gateway
    script, flag = gw.home / "soak-reload", gw.home / "soak-reload-fails"
    doc = yaml.safe_load(Path(soak.path).read_text())
    real = doc["gateway"]["reload_command"]
    if real == [str(script)]:
        return
    script.write_text("#!/bin/sh\n# soak: the reload refuses while the fault's flag is set\n"
                      f"if [ -e {flag} ]; then echo 'soak fault: reload refused (simulated)' >&2; exit 1; fi\n"
                      f"exec {' '.join(real)} \"$@\"\n")
    os.chmod(script, 0o755)
    soak.edit_fleet(lambda d: d["gateway"].__setitem__("reload_command", [str(script)]))
