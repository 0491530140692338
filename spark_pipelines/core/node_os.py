"""The runbook's Phase 0 ("run once on each node"), as facts read and changes made only where they
differ, the way idempotent configuration tools work: `plan` turns what a node reports into the
changes that bring it to the runbook's state, each with its command and its undo; `verify` judges
a node after the reboot. Pure: the runbook/node_os.py procedure reads the facts and runs the argv.

Every value here is the runbook's, copied exactly; the fleet file holds only the choices an
operator makes per fleet (keep tailscale, services kept running, the reboot's bounds).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

# "Switch to headless multi-user target (no graphical login)"; "avoid sleep/wake cycles".
HEADLESS_TARGET = "multi-user.target"

# "Disable services we don't want" (the runbook's list, in its order).
DISABLE: tuple[str, ...] = (
    "gdm3", "plymouth", "snapd", "snapd.socket", "snapd.service", "snap.firmware-updater.firmware-notifier",
    "cups", "cups-browsed", "avahi-daemon", "bluetooth", "ModemManager", "gnome-remote-desktop",
    "NetworkManager-wait-online", "dgx-dashboard-admin", "dgx-dashboard", "fwupd", "lldpd", "multipathd",
    "rasdaemon", "rdma-ndd", "rtkit-daemon", "smartmontools", "wpa_supplicant", "rpc-statd", "rpcbind",
    "udisks2", "upower", "pulse-agent", "rsyslog",
)
# "MASK services that re-enable on boot via socket activation or wants (CRITICAL - disable alone
# does NOT prevent these from re-starting)".
MASK: tuple[str, ...] = (
    "gdm3", "plymouth", "snapd", "snapd.socket", "dgx-dashboard", "dgx-dashboard-admin", "rdma-ndd", "rpcbind",
    "rpcbind.socket", "rpc-statd", "rtkit-daemon", "smartd", "smartmontools", "wpa_supplicant", "rsyslog", "fwupd",
    "lldpd", "multipathd", "rasdaemon", "udisks2", "upower", "pulse-agent",
)
# "If any of rdma-ndd, rpcbind, rpc-statd, rtkit-daemon, smartd, wpa_supplicant, rsyslog come back
# after reboot, mask them again".
COMES_BACK: tuple[str, ...] = ("rdma-ndd", "rpcbind", "rpc-statd", "rtkit-daemon", "smartd", "wpa_supplicant", "rsyslog")
# "After reboot, verify ONLY these services are running (anything else is unwanted)".
EXPECTED_RUNNING: tuple[str, ...] = ("containerd", "docker", "NetworkManager", "nvidia-persistenced")
TAILSCALE = "tailscaled"  # "Disable tailscale if not needed": the fleet file says whether it is

# "Apply memory sysctls (reserve 5GB from page cache starvation)", the file and its nine values.
SYSCTL_PATH = "/etc/sysctl.d/90-dgx-spark-memory.conf"
SYSCTLS: dict[str, str] = {
    "vm.min_free_kbytes": "5242880",
    "vm.vfs_cache_pressure": "200",
    "vm.swappiness": "1",
    "vm.dirty_background_ratio": "2",
    "vm.dirty_ratio": "5",
    "vm.panic_on_oom": "0",
    "vm.max_map_count": "2097152",
    "vm.zone_reclaim_mode": "0",
    "vm.overcommit_memory": "1",
}
FSTAB = "/etc/fstab"
# The copies a change keeps for its undo (root's, beside the file; sysctl reads only *.conf): the
# undo is then `cp` between two fixed paths, never a root write of content the caller chooses.
SYSCTL_BACKUP = f"{SYSCTL_PATH}.before-phase0"
FSTAB_BACKUP = f"{FSTAB}.before-phase0"
# Hazard (1): "earlyoom (if installed) SIGKILLs EngineCore during warmup memory spike - apt purge earlyoom".
EARLYOOM = "earlyoom"
# Troubleshooting table: "nvidia_gpu_exporter panic (invalid metric name): GB10 has non-standard
# clocks_event_reasons fields. Add --query-field-names=..." (the exporter is the operator's container).
GPU_EXPORTER = "nvidia_gpu_exporter"
GPU_EXPORTER_FIELDS = ("timestamp,name,uuid,utilization.gpu,utilization.memory,temperature.gpu,temperature.memory,"
                       "power.draw,power.limit,clocks.current.sm,clocks.current.memory,fan.speed,pstate")
# "free -g ... Should show <8GB used (no GPU-holding desktop processes)".
MAX_USED_GIB = 8

Argv = tuple[str, ...]


def version() -> str:
    """node_os's code version: these values, hashed (an edited list or sysctl is a new Phase 0)."""
    text = repr((HEADLESS_TARGET, DISABLE, MASK, COMES_BACK, sorted(SYSCTLS.items()), EARLYOOM, MAX_USED_GIB))
    return "phase0-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def sudo(*argv: str) -> Argv:
    """Every change of Phase 0 is root's; the session runs it as `sudo -n argv` (one sudoers line each)."""
    return argv


def unit_name(unit: str) -> str:
    """systemd's own short form: `x.service` and `x` are one unit, `x.socket` is another."""
    return unit[: -len(".service")] if unit.endswith(".service") else unit


def sysctl_file_text() -> str:
    return "".join(f"{k} = {v}\n" for k, v in SYSCTLS.items())


def write_sysctl_file() -> Argv:
    """The file's nine values written by one fixed script: its sudoers line allows exactly this
    content (a `tee` of the file would let its caller set any sysctl at boot, kernel.modprobe too)."""
    echoes = "; ".join(f"echo {k} = {v}" for k, v in SYSCTLS.items())
    return sudo("sh", "-c", f"{{ {echoes}; }} > {SYSCTL_PATH}")


# The runbook's `sudo sed -i '/swap/d' /etc/fstab`, as its argv.
STRIP_SWAP = ("sed", "-i", "/swap/d", FSTAB)


def fstab_without_swap(fstab: str) -> str:
    """The runbook's `sed -i '/swap/d' /etc/fstab`: every line naming swap goes (comments too)."""
    return "".join(line for line in fstab.splitlines(keepends=True) if "swap" not in line)


@dataclass(frozen=True)
class OsFacts:
    """What a node reports; every field is read, nothing is assumed."""

    default_target: str
    enablement: dict[str, str]  # unit -> enabled | disabled | masked | static | not-found | ...
    running: frozenset[str]  # running services, short names
    sysctl_file: str | None  # SYSCTL_PATH's text, None when absent
    sysctl_live: dict[str, str]
    swap_active: tuple[str, ...]
    fstab: str
    earlyoom_installed: bool
    used_gib: float | None = None


@dataclass(frozen=True)
class Choices:
    """The fleet file's say (NodeOsSettings): what an operator keeps."""

    disable_tailscale: bool = False
    keep_services: frozenset[str] = frozenset()


@dataclass(frozen=True)
class OsChange:
    """One setting that differs: what it is, what it should be, the commands and their undo."""

    setting: str
    current: str
    wanted: str
    argvs: tuple[Argv, ...]
    undo: tuple[Argv, ...]
    needs_reboot: bool = False  # takes full effect only at the next boot

    @property
    def line(self) -> str:
        return f"{self.setting}: {self.current} -> {self.wanted}"


def wanted_units(choices: Choices) -> dict[str, str]:
    """unit -> the enablement Phase 0 leaves it in."""
    wanted = {unit_name(u): "disabled" for u in DISABLE}
    wanted.update({unit_name(u): "masked" for u in MASK})
    if choices.disable_tailscale:
        wanted[TAILSCALE] = "disabled"
    for kept in choices.keep_services:
        wanted.pop(unit_name(kept), None)
    return wanted


def unwanted_running(facts: OsFacts, choices: Choices) -> list[str]:
    return sorted(u for u in wanted_units(choices) if u in facts.running)


def plan(facts: OsFacts, choices: Choices) -> list[OsChange]:
    """The changes that bring the node to Phase 0, in the runbook's order; [] on a provisioned node."""
    changes: list[OsChange] = []
    if facts.default_target != HEADLESS_TARGET:
        changes.append(OsChange(
            "default target", facts.default_target, HEADLESS_TARGET,
            (sudo("systemctl", "set-default", HEADLESS_TARGET),),
            (sudo("systemctl", "set-default", facts.default_target),), needs_reboot=True))
    for unit, wanted in wanted_units(choices).items():
        have = facts.enablement.get(unit, "not-found")
        if have in ("not-found", wanted) or (wanted == "disabled" and have in ("masked", "static")):
            continue
        if wanted == "masked":
            do, undo = [sudo("systemctl", "mask", unit)], [sudo("systemctl", "unmask", unit)]
            if have == "enabled":
                undo.append(sudo("systemctl", "enable", unit))
        else:
            do, undo = [sudo("systemctl", "disable", unit)], [sudo("systemctl", "enable", unit)]
        changes.append(OsChange(f"service {unit}", have, wanted, tuple(do), tuple(undo), needs_reboot=True))
    if facts.sysctl_file != sysctl_file_text():
        if facts.sysctl_file is None:
            do, undo = (write_sysctl_file(),), (sudo("rm", "-f", SYSCTL_PATH),)
        else:  # the operator's file kept aside, put back by the undo
            do = (sudo("cp", SYSCTL_PATH, SYSCTL_BACKUP), write_sysctl_file())
            undo = (sudo("cp", SYSCTL_BACKUP, SYSCTL_PATH),)
        changes.append(OsChange(
            f"file {SYSCTL_PATH}", "absent" if facts.sysctl_file is None else "differs", "the runbook's nine values",
            do, undo))
    live = {k: facts.sysctl_live.get(k, "?") for k in SYSCTLS if facts.sysctl_live.get(k) != SYSCTLS[k]}
    if live:
        # The undo sets each key back alone: one `sysctl -w vm.KEY=NUMBER` each, as sudoers allows.
        changes.append(OsChange(
            "live sysctls", ", ".join(f"{k}={v}" for k, v in live.items()),
            ", ".join(f"{k}={SYSCTLS[k]}" for k in live),
            (sudo("sysctl", "-p", SYSCTL_PATH),),
            tuple(sudo("sysctl", "-w", f"{k}={v}") for k, v in live.items() if v.isdigit())))
    if facts.swap_active:
        changes.append(OsChange("swap", "on (" + ", ".join(facts.swap_active) + ")", "off",
                                (sudo("swapoff", "-a"),), (sudo("swapon", "-a"),)))
    if fstab_without_swap(facts.fstab) != facts.fstab:
        changes.append(OsChange(f"file {FSTAB}", "has swap lines", "no swap line",
                                (sudo("cp", FSTAB, FSTAB_BACKUP), sudo(*STRIP_SWAP)),
                                (sudo("cp", FSTAB_BACKUP, FSTAB),)))
    if facts.earlyoom_installed:
        changes.append(OsChange("package earlyoom", "installed", "purged", (sudo("apt-get", "purge", "-y", EARLYOOM),),
                                (sudo("apt-get", "install", "-y", EARLYOOM),)))
    return changes


def most_commands(choices: Choices) -> int:
    """The commands Phase 0 can run on one node, changes and undos: its plan for a node out of the
    box (graphical, every unit enabled, no sysctl file, swap on and in fstab, earlyoom)."""
    units = wanted_units(choices)
    fresh = OsFacts("graphical.target", {u: "enabled" for u in units}, frozenset(units), None, {}, ("/swap.img",),
                    "/swap.img none swap sw 0 0\n", True)
    changes = plan(fresh, choices) + remask_changes(list(COMES_BACK))
    return sum(len(c.argvs) + len(c.undo) for c in changes)


def needs_reboot(changes: list[OsChange], facts: OsFacts, choices: Choices) -> bool:
    """A mask or a target only holds after a boot; a unit still running though masked needs one too."""
    return any(c.needs_reboot for c in changes) or bool(unwanted_running(facts, choices))


@dataclass
class Verdict:
    """The runbook's "after reboot, verify clean baseline", one problem per line."""

    problems: list[str] = field(default_factory=list)
    remask: list[str] = field(default_factory=list)  # came back through socket activation

    @property
    def clean(self) -> bool:
        return not self.problems


def verify(facts: OsFacts, choices: Choices) -> Verdict:
    v = Verdict()
    if facts.default_target != HEADLESS_TARGET:
        v.problems.append(f"default target is {facts.default_target}, not {HEADLESS_TARGET}")
    for unit in unwanted_running(facts, choices):
        if unit in COMES_BACK:
            v.remask.append(unit)
        v.problems.append(f"{unit} is running after the reboot"
                          + (" (socket-activated: mask it again)" if unit in COMES_BACK else ""))
    for k, want in SYSCTLS.items():
        if facts.sysctl_live.get(k) != want:
            v.problems.append(f"{k} is {facts.sysctl_live.get(k, '?')}, not {want}")
    if facts.swap_active:
        v.problems.append("swap is on: " + ", ".join(facts.swap_active))
    if facts.earlyoom_installed:
        v.problems.append("earlyoom is installed")
    if facts.used_gib is not None and facts.used_gib >= MAX_USED_GIB:
        v.problems.append(f"free -g shows {facts.used_gib:g} GB used (runbook: < {MAX_USED_GIB} GB with no desktop)")
    return v


def gpu_exporter_advice(args: list[str] | None) -> str | None:
    """The GB10 panic fix, said (never applied: the exporter container is the operator's)."""
    if args is None or any(a.startswith("--query-field-names") for a in args):
        return None
    return (f"{GPU_EXPORTER} runs without --query-field-names: on GB10 it panics (invalid metric name); "
            f"recreate it with --query-field-names={GPU_EXPORTER_FIELDS}")


def remask_changes(units: list[str]) -> list[OsChange]:
    """"mask them again": mask and stop, no reboot needed for a unit that is masked and stopped."""
    return [OsChange(f"service {u}", "came back", "masked and stopped",
                     (sudo("systemctl", "mask", u), sudo("systemctl", "stop", u)),
                     (sudo("systemctl", "unmask", u),)) for u in units]


# -- sudoers -----------------------------------------------------------------------------------

# Where DGX OS 7 (Ubuntu 24.04) keeps the programs Phase 0 runs as root: sudoers wants absolute paths.
PROGRAMS: dict[str, str] = {
    "systemctl": "/usr/bin/systemctl", "rm": "/usr/bin/rm", "sysctl": "/usr/sbin/sysctl", "sh": "/usr/bin/sh",
    "cp": "/usr/bin/cp", "sed": "/usr/bin/sed", "swapoff": "/usr/sbin/swapoff", "swapon": "/usr/sbin/swapon",
    "apt-get": "/usr/bin/apt-get", "reboot": "/usr/sbin/reboot",
}


def root_argvs(choices: Choices) -> list[Argv]:
    """Every argv Phase 0 and its undo can run as root with a value known before it reads a node,
    each exact; the live sysctls' undo (the node's own values) is `sysctl_undo_patterns`."""
    out: list[Argv] = [("systemctl", "set-default", HEADLESS_TARGET), ("systemctl", "set-default", "graphical.target")]
    for unit, wanted in wanted_units(choices).items():
        verbs = ("mask", "unmask", "enable", "stop") if wanted == "masked" else ("disable", "enable")
        out += [("systemctl", v, unit) for v in verbs]
    out += [write_sysctl_file(), ("cp", SYSCTL_PATH, SYSCTL_BACKUP), ("cp", SYSCTL_BACKUP, SYSCTL_PATH),
            ("rm", "-f", SYSCTL_PATH), ("sysctl", "-p", SYSCTL_PATH),
            ("swapoff", "-a"), ("swapon", "-a"), ("cp", FSTAB, FSTAB_BACKUP), STRIP_SWAP, ("cp", FSTAB_BACKUP, FSTAB),
            ("apt-get", "purge", "-y", EARLYOOM), ("apt-get", "install", "-y", EARLYOOM), ("reboot",)]
    return out


def sysctl_undo_patterns() -> list[str]:
    """The live sysctls' undo sets one of the nine keys back to the node's own number, known only
    once the node is read: one sudoers regular expression per key (sudo >= 1.9.10, DGX OS 7 has
    1.9.15), `-w` and that key with digits and nothing else (a glob's `*` would match any sysctl)."""
    return [f"^-w {k.replace('.', chr(92) + '.')}\\=[0-9]+$" for k in SYSCTLS]


def sudoers_arg(arg: str) -> str:
    """One argument as sudoers reads it: its special characters and glob characters escaped."""
    return "".join("\\" + c if c in "\\,:=*?[]!#" else c for c in arg)


def sudoers_commands(choices: Choices, programs: dict[str, str] | None = None) -> list[str]:
    """Each command of the Phase 0 sudoers file (`programs`: where the node keeps each program)."""
    where = programs or PROGRAMS
    exact = [" ".join((where[a[0]], *map(sudoers_arg, a[1:])) if len(a) > 1 else (where[a[0]], '""'))
             for a in root_argvs(choices)]
    return exact + [f"{where['sysctl']} {p}" for p in sysctl_undo_patterns()]


def sudoers_text(user: str, choices: Choices) -> str:
    """The sudoers file for `user` that Phase 0 needs, nothing more (visudo -f /etc/sudoers.d/spark-phase0)."""
    body = ", \\\n    ".join(sudoers_commands(choices))
    return (f"# spark-pipelines Phase 0 (node_os_job): each command exact; the live sysctls' undo one regex a key\n"
            f"Cmnd_Alias SPARK_PHASE0 = \\\n    {body}\n{user} ALL=(root) NOPASSWD: SPARK_PHASE0\n")


# -- parsing what the node prints ----------------------------------------------------------------


def parse_enablement(units: list[str], stdout: str) -> dict[str, str]:
    """`systemctl is-enabled U...` prints one state per unit, in order."""
    states = [line.strip() for line in stdout.splitlines() if line.strip()]
    if len(states) != len(units):
        raise ValueError(f"systemctl is-enabled printed {len(states)} states for {len(units)} units")
    return dict(zip(units, states))


def parse_running(stdout: str) -> frozenset[str]:
    """`systemctl list-units --type=service --state=running --no-legend --plain`."""
    return frozenset(unit_name(line.split()[0]) for line in stdout.splitlines() if line.split())


def parse_sysctls(keys: list[str], stdout: str) -> dict[str, str]:
    values = [line.strip() for line in stdout.splitlines()]
    return {k: v for k, v in zip(keys, values)}


def parse_free_used_gib(stdout: str) -> float | None:
    """`free -g`: the Mem: row's used column."""
    for line in stdout.splitlines():
        cols = line.split()
        if cols and cols[0] == "Mem:" and len(cols) > 2:
            try:
                return float(cols[2])
            except ValueError:
                return None
    return None
