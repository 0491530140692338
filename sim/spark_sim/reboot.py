"""`sudo reboot` on a simulated node (the m.sbin/reboot stand-in runs this as root):
`python -m spark_sim.reboot NODE_DIR start` marks the node rebooting and prints a token;
`python -m spark_sim.reboot NODE_DIR run TOKEN` (in the background) halts the node a second later
as poweroff does, waits its boot delay and boots it: node_os.boot, then sshd, as power.on does.
A node marked reboot-hangs stays down until `sim power NODE off` then `on`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from spark_sim import node_os, power
from spark_sim.effects import ssh_banner, wait_until, write
from spark_sim.node_host import start_sshd


def reboot_run(node_dir: Path, token: str, halt_after_s: float = 1.0) -> int:
    """The background half of `reboot`: halt as poweroff does, wait the boot delay, boot. A node
    marked reboot-hangs stays down until `sim power NODE off` then `on`."""
    n = node_os.NodeOs(node_dir)
    time.sleep(halt_after_s)
    m = power._member_of(n.dir)
    power.halt(m)
    for p in n.services.glob("*"):
        if not p.name.startswith("."):
            n.set_active(p.name, False)
    st = n.load()
    if st.get("reboot_hangs"):
        return 0  # stuck in firmware: the power file keeps saying rebooting
    time.sleep(float(st.get("boot_delay", node_os.DEFAULT_BOOT_DELAY_S)))
    if node_os.power_token(n.dir) != token:
        return 0  # the AC was cut (or another reboot started) meanwhile: that one owns the node now
    reboot_gpu(m)
    node_os.boot(n.dir)
    start_sshd(m)
    wait_until(f"sshd of {m.name} after reboot", lambda: ssh_banner(m.ip), 15, m.dir / "ssh" / "sshd.log")
    if node_os.power_token(n.dir) == token:
        (n.dir / "power").unlink(missing_ok=True)
    return 0


def reboot_gpu(m: Any) -> None:
    """A reboot is no AC cut: residue, low memory and a wedge survive (only a PD re-negotiation
    clears them); clocks locked with -lgc do not, and nvidia-persistenced turns persistence on."""
    try:
        doc = json.loads(m.gpu_state_file.read_text())
    except (OSError, ValueError):
        doc = {"profile": m.hardware, "state": "healthy"}
    doc.update(locked_clocks=None, persistence_mode=True)
    write(m.gpu_state_file, json.dumps(doc), 0o664, owner=m.user)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[1] == "start":
        print(node_os.reboot_started(Path(argv[0])))
        return 0
    if len(argv) == 3 and argv[1] == "run":
        return reboot_run(Path(argv[0]), argv[2])
    sys.stderr.write("usage: python -m spark_sim.reboot NODE_DIR start | NODE_DIR run TOKEN\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
