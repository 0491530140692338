"""A simulated node's OS over real SSH and sudo, as the product's Phase 0 meets it: a node fresh out
of the box, the runbook's root argvs, `sudo -n reboot` (the node goes down and comes back after its
boot delay, or hangs until the smart plug cuts and restores AC), and what a boot brings back.
The rest of the OS behaviour is proven at the unit tier (tests/unit/test_sim_os_standins.py)."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator

import paramiko
import pytest

from spark_pipelines.core import node_os as p0
from spark_sim import gpu_states, node_os, power
from spark_sim.effects import ssh_banner
from spark_sim.fleet import Member, SimFleet

pytestmark = pytest.mark.slow

BOOT_DELAY_S = 2.0
CONF = node_os.SYSCTL_FILE
UNITS = sorted({p0.unit_name(u) for u in (*p0.DISABLE, *p0.MASK)} | {p0.TAILSCALE})


def ssh(fleet: SimFleet, node: Member, argv: list[str], stdin: str = "") -> tuple[int, str, str]:
    c = paramiko.SSHClient()
    c.load_host_keys(str(fleet.layout.known_hosts))
    c.set_missing_host_key_policy(paramiko.RejectPolicy())
    c.connect(node.ip, username=node.user, key_filename=str(fleet.layout.key_path),
              allow_agent=False, look_for_keys=False, timeout=10)
    try:
        i, out, err = c.exec_command(shlex.join(argv), timeout=60)
        if stdin:
            i.write(stdin)
        i.channel.shutdown_write()
        rc = out.channel.recv_exit_status()
        return rc, out.read().decode(), err.read().decode()
    finally:
        c.close()


def ok(fleet: SimFleet, node: Member, argv: list[str], stdin: str = "") -> str:
    rc, out, err = ssh(fleet, node, argv, stdin)
    assert rc == 0, f"{argv} on {node.name} exited {rc}: {err}"
    return out


def memcheck_free_gib(fleet: SimFleet, node: Member) -> float:
    """What a fresh GPU container sees (the runbook's memcheck)."""
    out = ok(fleet, node, ["docker", "run", "--rm", "--gpus", "all", "sim-python-base", "cat", "/run/sim-gpu/state.json"])
    return json.loads(out)["free_gib"]


def wait(what: str, cond, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, f"{what} not within {timeout_s} s"
        time.sleep(0.1)
    return time.monotonic() - t0


def reboot(fleet: SimFleet, node: Member) -> float:
    """`sudo -n reboot` over SSH; returns the seconds until SSH answers again."""
    t0 = time.monotonic()
    out = ok(fleet, node, ["sudo", "-n", "reboot"])
    assert "reboot" in out
    wait(f"{node.name} going down", lambda: not ssh_banner(node.ip), 10)
    wait(f"{node.name} coming back", lambda: ssh_banner(node.ip), BOOT_DELAY_S + 10)
    return time.monotonic() - t0


@pytest.fixture()
def fresh_node(sim_fleet: SimFleet) -> Iterator[Member]:
    """spark2 fresh out of the box; provisioned and powered again afterwards (the fleet is shared)."""
    m = sim_fleet.node("spark2")
    node_os.fresh(m)
    node_os.set_boot_delay(m, BOOT_DELAY_S)
    try:
        yield m
    finally:
        node_os.set_reboot_hangs(m, False)
        node_os.set_boot_delay(m, node_os.DEFAULT_BOOT_DELAY_S)
        if not ssh_banner(m.ip):
            power.off(m)
            power.on(m)
        node_os.provision(m)


def test_phase0_argvs_reboot_and_boot_over_ssh(sim_fleet: SimFleet, fresh_node: Member) -> None:
    f, m = sim_fleet, fresh_node
    assert ok(f, m, ["systemctl", "get-default"]) == "graphical.target\n"
    assert ok(f, m, ["swapon", "--show=NAME", "--noheadings"]) == "/swap.img\n"
    assert ok(f, m, ["dpkg-query", "-W", "-f", "${Status}", "earlyoom"]) == "install ok installed"
    used_desktop = int(ok(f, m, ["free", "-g"]).splitlines()[1].split()[2])
    with_desktop = memcheck_free_gib(f, m)

    # Phase 0, exactly the product's plan for this node and its argvs (rpcbind left disabled, not
    # masked, for the reboot below), each through the node's sudoers: the lines `spark-pipelines
    # sudoers` prints.
    facts = p0.OsFacts("graphical.target", {u: "enabled" for u in UNITS}, frozenset(), None,
                       dict(node_os.KERNEL_SYSCTLS), ("/swap.img",), ok(f, m, ["cat", "/etc/fstab"]), True)
    changes = [c for c in p0.plan(facts, p0.Choices()) if c.setting != "service rpcbind"]
    assert node_os.run(m.dir, "systemctl", ["disable", "rpcbind"], root=True)[0] == 0  # by hand, not Phase 0's
    for c in changes:
        for argv in c.argvs:
            ok(f, m, ["sudo", "-n", *argv])
    assert ok(f, m, ["systemctl", "is-active", "gdm3"]) == "active\n"  # mask does not stop
    assert ok(f, m, ["cat", CONF]) == p0.sysctl_file_text()
    assert "swap" not in ok(f, m, ["cat", "/etc/fstab"])
    live = next(c for c in changes if c.setting == "live sysctls")
    for argv in live.undo:  # the undo, one key each through its sudoers regex
        ok(f, m, ["sudo", "-n", *argv])
    assert ok(f, m, ["sysctl", "-n", "vm.swappiness"]) == "60\n"
    ok(f, m, ["sudo", "-n", "sysctl", "-p", CONF])
    # What the old lines let through is refused now: a root tee (root itself), any other sysctl.
    for argv, stdin in ((["tee", "/etc/fstab"], "x"), (["tee", "/etc/passwd"], "x"),
                        (["sysctl", "-w", "vm.swappiness=60", "kernel.modprobe=/tmp/x"], ""),
                        (["sysctl", "-w", "kernel.modprobe=/tmp/x"], ""), (["sh", "-c", "id"], ""),
                        (["systemctl", "disable", "cups", "ssh"], ""), (["reboot", "--force"], "")):
        rc, _, err = ssh(f, m, ["sudo", "-n", *argv], stdin=stdin)
        assert rc != 0 and "password is required" in err, argv
    assert ok(f, m, ["cat", "/etc/os-release"])  # any other file is the real cat's

    took = reboot(f, m)
    assert took < BOOT_DELAY_S + 6
    assert ok(f, m, ["systemctl", "get-default"]) == "multi-user.target\n"
    running = ok(f, m, ["systemctl", "list-units", "--type=service", "--state=running", "--no-legend", "--plain"])
    names = {line.split()[0] for line in running.splitlines()}
    assert "rpcbind.service" in names  # socket-activated: disable alone does not keep it down
    assert not names & {"gdm3.service", "earlyoom.service", "cups.service", "smartd.service"}
    assert ok(f, m, ["sysctl", "-n", *node_os.RUNBOOK_SYSCTLS]).split() == list(node_os.RUNBOOK_SYSCTLS.values())
    assert ok(f, m, ["swapon", "--show=NAME", "--noheadings"]) == ""
    assert int(ok(f, m, ["free", "-g"]).splitlines()[1].split()[2]) < min(8, used_desktop)
    headless = memcheck_free_gib(f, m)
    assert headless - with_desktop == pytest.approx(gpu_states.DESKTOP_GIB)

    # Masked, it stays down across a reboot.
    ok(f, m, ["sudo", "-n", "systemctl", "mask", "rpcbind"])
    reboot(f, m)
    rc, out, _ = ssh(f, m, ["systemctl", "is-active", "rpcbind"])
    assert (rc, out) == (3, "inactive\n")

    # A reboot that hangs keeps the node down until the plug cuts and restores AC.
    node_os.set_reboot_hangs(m, True)
    ok(f, m, ["sudo", "-n", "reboot"])
    wait("spark2 going down", lambda: not ssh_banner(m.ip), 10)
    time.sleep(BOOT_DELAY_S + 3)
    assert not ssh_banner(m.ip)
    power.off(m)
    power.on(m)
    assert ssh(f, m, ["systemctl", "is-active", "nvidia-persistenced", "rpcbind"])[:2] == (3, "active\ninactive\n")
