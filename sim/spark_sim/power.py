"""A simulated node's power: `sudo poweroff` on the node and AC at the wall (the smart plug).

- `poweroff` (a root stand-in on the node, see node_host): the node halts a second later: its
  containers stop, its sshd and every session end.
- `sim power NODE off`: AC cut at the wall; a node that was not halted loses power as it runs.
- `sim power NODE on [--keep-wedged]`: AC back, the node boots: the brick re-negotiates its PD power
  class, so the GPU state is clean (locks reset, persistence on) unless --keep-wedged (the runbook's
  "WEDGE PERSISTS" case); sshd starts, nvidia-persistenced is active, containers stay exited (as
  after a real boot: the runbook starts vLLM with `docker start`).
The fleet file `sim up` writes names `<root>/client/smart-plug NODE off|on` as every node's plug.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from spark_sim import node_os
from spark_sim.effects import alive, kill_all, pid_from, run, ssh_banner, user_pids, wait_until, write
from spark_sim.layout import Layout, Member, SimError

SMART_PLUG = "smart-plug"


def power_file(m: Member) -> Path:
    return m.dir / "power"


def is_off(m: Member) -> bool:
    try:
        return power_file(m).read_text().strip() in ("halted", "off")
    except OSError:
        return False


def halt(m: Member) -> None:
    """What poweroff (and an AC cut) does to the node: containers stopped, sshd and sessions gone."""
    env = {**os.environ, "DOCKER_HOST": m.docker_host}
    ps = run(["docker", "ps", "-q"], env=env, check=False, timeout=30)
    if ps.stdout.split():
        run(["docker", "stop", "-t", "10", *ps.stdout.split()], env=env, check=False, timeout=60)
    sshd = pid_from(m.sshd_pidfile)
    kill_all([p for p in [sshd, *user_pids(m.user)] if p])


def off(m: Member) -> str:
    was = "halted" if is_off(m) else "rebooting" if node_os.power_token(m.dir) else "running"
    if was != "halted" or alive(pid_from(m.sshd_pidfile)):
        halt(m)
    write(power_file(m), "off\n")
    return f"{m.name}: AC off (the node was {was})"


def on(m: Member, keep_wedged: bool = False) -> str:
    """Boot: the GPU state after a full PD re-negotiation, then sshd and nvidia-persistenced."""
    from spark_sim.node_host import start_sshd  # the one way sshd of a node is started

    if not is_off(m):
        return f"{m.name}: AC already on (not powered off: nothing to do)"
    try:
        doc = json.loads(m.gpu_state_file.read_text())
    except (OSError, ValueError):
        doc = {"profile": m.hardware}
    wedged = doc.get("state") == "wedged" and keep_wedged
    doc.update(state="wedged" if wedged else "healthy", locked_clocks=None, persistence_mode=True)
    write(m.gpu_state_file, json.dumps(doc), 0o664, owner=m.user)
    node_os.boot(m.dir)  # units by enablement (nvidia-persistenced is enabled), sysctls, swap
    start_sshd(m)
    wait_until(f"sshd of {m.name} after power on", lambda: ssh_banner(m.ip), 15, m.dir / "ssh" / "sshd.log")
    power_file(m).unlink(missing_ok=True)
    return f"{m.name}: AC on, booted, GPU {'still WEDGED' if wedged else 'clean'}"


def write_smart_plug(lay: Layout) -> Path:
    """The plug command the sim's fleet file names (it runs where the pipeline runs, as root here)."""
    path = lay.client_dir / SMART_PLUG
    write(path, (
        "#!/bin/sh\n"
        "# the simulated fleet's smart plug: smart-plug NODE off|on [--keep-wedged]\n"
        f"SPARK_SIM_ROOT={lay.root} SPARK_SIM_SLOT={lay.slot} exec {sys.executable} -m spark_sim.cli power \"$@\"\n"
    ), 0o755)
    return path


def command(fleet: object, node: str, action: str, keep_wedged: bool) -> str:
    m = fleet.node(node)  # type: ignore[attr-defined]
    if action == "off":
        return off(m)
    if action == "on":
        return on(m, keep_wedged)
    raise SimError(f"power {action!r}: use off or on")


def _member_of(directory: Path) -> Member:
    """The member whose dir this is, from the sim's state file (the node side has no yaml, no SimFleet)."""
    state = json.loads((directory.parent / "state.json").read_text())
    for raw in state.get("members", []):
        if Path(raw["dir"]) == directory:
            return Member(**{**raw, "dir": Path(raw["dir"])})
    raise SimError(f"{directory} is not a simulated node's directory")


def main(argv: list[str]) -> int:
    """`python -m spark_sim.power halt NODE_DIR`: the node side of the poweroff stand-in (root)."""
    if len(argv) != 2 or argv[0] != "halt":
        sys.stderr.write("usage: python -m spark_sim.power halt NODE_DIR\n")
        return 2
    halt(_member_of(Path(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
