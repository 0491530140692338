"""A simulated node's operating system, as the runbook's Phase 0 meets it: systemd units (default
target, enablement, running state), sysctls, swap, /etc/fstab and /etc/sysctl.d, the earlyoom
package, `free` and `reboot`.

State lives under the node's dir: os/state.json (target, enablement, live sysctls, active swap,
packages, reboot knobs), services/<unit> (active|inactive, the file other code already reads) and
etc/ (the node's own /etc/fstab and /etc/sysctl.d/90-dgx-spark-memory.conf). The node's stand-in
programs (node_host writes them) run `python -m spark_sim.node_os NODE_DIR PROGRAM ARGS...`;
`reboot` is reboot.py's. Only stdlib here: it runs on the node side, from the sim's lib copy.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# --- what a DGX OS 7 install has (the sim models one) ------------------------------------------
# Runbook Phase 0, copied exactly: the units it disables, then the units it masks.
DISABLE_LIST = ("gdm3 plymouth snapd snapd.socket snapd.service snap.firmware-updater.firmware-notifier cups "
                "cups-browsed avahi-daemon bluetooth ModemManager gnome-remote-desktop NetworkManager-wait-online "
                "dgx-dashboard-admin dgx-dashboard fwupd lldpd multipathd rasdaemon rdma-ndd rtkit-daemon "
                "smartmontools wpa_supplicant rpc-statd rpcbind udisks2 upower pulse-agent rsyslog").split()
MASK_LIST = ("gdm3 plymouth snapd snapd.socket dgx-dashboard dgx-dashboard-admin rdma-ndd rpcbind rpcbind.socket "
             "rpc-statd rtkit-daemon smartd smartmontools wpa_supplicant rsyslog fwupd lldpd multipathd rasdaemon "
             "udisks2 upower pulse-agent").split()
# "If any of rdma-ndd, rpcbind, rpc-statd, rtkit-daemon, smartd, wpa_supplicant, rsyslog come back
# after reboot, mask them again - they have socket-activated triggers that bypass disable."
COME_BACK = frozenset({"rdma-ndd", "rpcbind", "rpc-statd", "rtkit-daemon", "smartd", "wpa_supplicant", "rsyslog"})
# "After reboot, verify ONLY these services are running."
BASE_UNITS = ("containerd", "docker", "NetworkManager", "nvidia-persistenced")
EXTRA_UNITS = ("tailscaled", "prometheus-node-exporter")  # Phase 0 stops/disables them too
EARLYOOM = "earlyoom"
# Kernel defaults of the nine keys the runbook's sysctl file sets (what /proc/sys shows without it).
KERNEL_SYSCTLS = {
    "vm.min_free_kbytes": "67584", "vm.vfs_cache_pressure": "100", "vm.swappiness": "60",
    "vm.dirty_background_ratio": "10", "vm.dirty_ratio": "20", "vm.panic_on_oom": "0",
    "vm.max_map_count": "65530", "vm.zone_reclaim_mode": "0", "vm.overcommit_memory": "0",
}
# The runbook's /etc/sysctl.d/90-dgx-spark-memory.conf, as Phase 0 writes it.
RUNBOOK_SYSCTLS = {
    "vm.min_free_kbytes": "5242880", "vm.vfs_cache_pressure": "200", "vm.swappiness": "1",
    "vm.dirty_background_ratio": "2", "vm.dirty_ratio": "5", "vm.panic_on_oom": "0",
    "vm.max_map_count": "2097152", "vm.zone_reclaim_mode": "0", "vm.overcommit_memory": "1",
}
SYSCTL_FILE = "/etc/sysctl.d/90-dgx-spark-memory.conf"
FSTAB = "/etc/fstab"
ETC_FILES = (SYSCTL_FILE, FSTAB)
# The copies Phase 0 keeps for its undo (`cp` between these and the files above).
BACKUPS = (f"{SYSCTL_FILE}.before-phase0", f"{FSTAB}.before-phase0")
SWAP_LINE = "/swap.img\tnone\tswap\tsw\t0\t0\n"
FSTAB_BASE = ("# /etc/fstab: static file system information.\n"
              "/dev/disk/by-uuid/5c1f0e6a-2c4e-4b7b-9c1e-6f0e2d7a9b11 / ext4 defaults 0 1\n"
              "/dev/disk/by-uuid/A1B2-C3D4 /boot/efi vfat defaults 0 1\n")
MEM_TOTAL_GIB, BASE_USED_GIB, CACHE_GIB, SWAP_GIB = 119, 3, 2, 16  # a GB10 at idle, headless
DEFAULT_BOOT_DELAY_S = 3.0
NON_SERVICE_SUFFIXES = (".socket", ".target", ".timer", ".mount", ".path")


def unit(name: str) -> str:
    """One name per unit: "x" and "x.service" are the same unit, "x.socket" is its own."""
    return name[: -len(".service")] if name.endswith(".service") else name


def _full(u: str) -> str:
    return u if u.endswith(NON_SERVICE_SUFFIXES) else f"{u}.service"


def dgx_units() -> list[str]:
    out: list[str] = []
    for u in (*BASE_UNITS, *map(unit, DISABLE_LIST + MASK_LIST), *EXTRA_UNITS):
        if u not in out:
            out.append(u)
    return out


# --- the node's state ---------------------------------------------------------------------------

class NodeOs:
    """One node's OS state under its dir."""

    def __init__(self, node_dir: Path | Any) -> None:
        self.dir = Path(getattr(node_dir, "dir", node_dir))  # a Member or its dir
        self.state_file = self.dir / "os" / "state.json"
        self.services = self.dir / "services"
        self.etc = self.dir / "etc"

    def etc_path(self, path: str) -> Path:
        return self.etc / path.lstrip("/")

    def load(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return provisioned_state()

    def save(self, st: dict[str, Any]) -> None:
        _write(self.state_file, json.dumps(st, indent=1, sort_keys=True) + "\n")

    @contextmanager
    def change(self) -> Iterator[dict[str, Any]]:
        """Read-modify-write under the node's lock (two sudo commands may run at once)."""
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        with open(self.state_file.parent / "lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            st = self.load()
            yield st
            self.save(st)

    def active(self, u: str) -> bool:
        try:
            return (self.services / u).read_text().strip() == "active"
        except OSError:
            return False

    def set_active(self, u: str, on: bool) -> None:
        _write(self.services / u, "active\n" if on else "inactive\n")

    def read_etc(self, path: str) -> str | None:
        try:
            return self.etc_path(path).read_text()
        except OSError:
            return None

    def write_etc(self, path: str, text: str | None) -> None:
        if text is None:
            self.etc_path(path).unlink(missing_ok=True)
        else:
            _write(self.etc_path(path), text)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.chmod(tmp, 0o644)
    tmp.replace(path)  # readers (the node user's programs) never see half a file


def provisioned_state() -> dict[str, Any]:
    units = {u: "enabled" for u in dgx_units()}
    for u in DISABLE_LIST:
        units[unit(u)] = "disabled"
    for u in EXTRA_UNITS:  # an operator who ran Phase 0 left the exporter and tailscale off
        units[u] = "disabled"
    premask = {}
    for u in MASK_LIST:
        premask[unit(u)] = units.get(unit(u), "not-found")
        units[unit(u)] = "masked"
    return {"default_target": "multi-user.target", "units": units, "premask": premask,
            "sysctl": {**KERNEL_SYSCTLS, **RUNBOOK_SYSCTLS}, "swaps": [], "packages": {EARLYOOM: False},
            "boot_delay": DEFAULT_BOOT_DELAY_S, "reboot_hangs": False}


def _sysctl_text(values: dict[str, str]) -> str:
    return "".join(f"{k} = {v}\n" for k, v in values.items())


def provision(node_dir: Path | Any) -> None:
    """The node as `sim up` makes it: Phase 0 done and rebooted (what every existing test expects)."""
    n = NodeOs(node_dir)
    st = provisioned_state()
    keep = n.load() if n.state_file.exists() else {}
    st.update({k: keep[k] for k in ("boot_delay", "reboot_hangs") if k in keep})
    n.save(st)
    n.write_etc(FSTAB, FSTAB_BASE)
    n.write_etc(SYSCTL_FILE, _sysctl_text(RUNBOOK_SYSCTLS))
    _start_units(n, st)


def fresh(node_dir: Path | Any) -> dict[str, Any]:
    """DGX OS out of the box: graphical target, every unit enabled and running, swap on, kernel
    sysctls and no sysctl file, earlyoom installed and running. Returns the new state."""
    n = NodeOs(node_dir)
    with n.change() as st:
        keep = {k: st.get(k) for k in ("boot_delay", "reboot_hangs")}
        st.clear()
        st.update(default_target="graphical.target", units={u: "enabled" for u in [*dgx_units(), EARLYOOM]},
                  premask={}, sysctl=dict(KERNEL_SYSCTLS), swaps=["/swap.img"], packages={EARLYOOM: True},
                  boot_delay=keep["boot_delay"] or DEFAULT_BOOT_DELAY_S, reboot_hangs=bool(keep["reboot_hangs"]))
        n.write_etc(FSTAB, FSTAB_BASE + SWAP_LINE)
        n.write_etc(SYSCTL_FILE, None)
        _start_units(n, st)
    return show(node_dir)


def _start_units(n: NodeOs, st: dict[str, Any]) -> None:
    for u, state in st["units"].items():
        n.set_active(u, state == "enabled")


def show(node_dir: Path | Any) -> dict[str, Any]:
    """The node's OS state as one JSON-able dict (for tests and `sim os NODE show`)."""
    n = NodeOs(node_dir)
    st = n.load()
    units = sorted(set(st["units"]) | {p.name for p in n.services.glob("*") if not p.name.startswith(".")})
    return {**st, "active": {u: n.active(u) for u in units},
            "etc": {p: n.read_etc(p) for p in ETC_FILES}}


def set_reboot_hangs(node_dir: Path | Any, hangs: bool) -> None:
    with NodeOs(node_dir).change() as st:
        st["reboot_hangs"] = bool(hangs)


def set_boot_delay(node_dir: Path | Any, seconds: float) -> None:
    if not 0 <= seconds <= 600:
        raise ValueError(f"boot delay {seconds} s: choose between 0 and 600 seconds")
    with NodeOs(node_dir).change() as st:
        st["boot_delay"] = float(seconds)


def fstab_swaps(text: str | None) -> list[str]:
    out = []
    for line in (text or "").splitlines():
        f = line.split()
        if len(f) >= 3 and not f[0].startswith("#") and f[2] == "swap":
            out.append(f[0])
    return out


def _sysctl_file_values(text: str) -> list[tuple[str, str, bool]]:
    """(key, value, ignore_errors) per setting line of a sysctl.d file."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;" or "=" not in line:
            continue
        k, _, v = line.partition("=")
        k = k.strip()
        out.append((k.lstrip("-"), v.strip(), k.startswith("-")))
    return out


def boot(node_dir: Path | Any) -> None:
    """What a boot does to the OS: units by enablement (masked stay down, enabled start, the
    runbook's socket-activated ones start even when only disabled), kernel sysctls then the
    sysctl.d file, swap per fstab. The GPU is the caller's (power.on, reboot)."""
    n = NodeOs(node_dir)
    with n.change() as st:
        for u in set(st["units"]) | {p.name for p in n.services.glob("*") if not p.name.startswith(".")}:
            e = st["units"].get(u, "not-found")
            n.set_active(u, e == "enabled" or (e == "disabled" and u in COME_BACK))
        live = dict(KERNEL_SYSCTLS)
        for k, v, _ in _sysctl_file_values(n.read_etc(SYSCTL_FILE) or ""):
            if k in live:
                live[k] = v
        st["sysctl"] = live
        st["swaps"] = fstab_swaps(n.read_etc(FSTAB))


# --- the programs ---------------------------------------------------------------------------------

class Out:
    def __init__(self) -> None:
        self.out: list[str] = []
        self.err: list[str] = []

    def o(self, line: str) -> None:
        self.out.append(line + "\n")

    def e(self, line: str) -> None:
        self.err.append(line + "\n")


ROOT_VERBS = {"set-default", "disable", "enable", "mask", "unmask", "stop", "start", "restart"}


def systemctl(n: NodeOs, argv: list[str], o: Out, root: bool) -> int:
    flags = {a for a in argv if a.startswith("-")}
    args = [a for a in argv if not a.startswith("-")]
    if not args:
        o.e("sim systemctl: give a verb")
        return 1
    verb, names = args[0], args[1:]
    quiet = bool(flags & {"-q", "--quiet"})
    if verb == "get-default":
        o.o(n.load()["default_target"])
        return 0
    if verb == "is-active":
        rc = 0
        for name in names:
            a = n.active(unit(name))
            if not quiet:
                o.o("active" if a else "inactive")
            rc = rc if a else 3
        return rc
    if verb == "is-enabled":
        st, rc = n.load(), 0
        for name in names:
            e = st["units"].get(unit(name), "not-found")
            if not quiet:
                o.o(e)
            rc = rc if e == "enabled" else 1
        return rc
    if verb == "list-units":
        if "--type=service" not in flags or "--state=running" not in flags:
            o.e(f"sim systemctl: only `list-units --type=service --state=running` is simulated: {' '.join(argv)}")
            return 1
        for u in sorted(show(n.dir)["active"].items()):
            if u[1] and not u[0].endswith(NON_SERVICE_SUFFIXES):
                o.o(f"{u[0]}.service loaded active running {u[0]}")
        return 0
    if verb not in ROOT_VERBS:
        o.e(f"sim systemctl: unsupported: {' '.join(argv)}")
        return 1
    if not root:
        o.e(f"Failed to {verb}: Access denied")
        return 1
    if not names:
        o.e("Too few arguments.")
        return 1
    with n.change() as st:
        return _change_units(n, st, verb, [unit(x) for x in names], "--now" in flags, o)


def _change_units(n: NodeOs, st: dict[str, Any], verb: str, names: list[str], now: bool, o: Out) -> int:
    units, premask, rc = st["units"], st["premask"], 0
    if verb == "set-default":
        st["default_target"] = names[0]
        o.e(f"Created symlink /etc/systemd/system/default.target → /lib/systemd/system/{names[0]}.")
        return 0
    for u in names:
        e = units.get(u, "not-found")
        if verb in ("start", "restart"):
            if e == "masked":
                o.e(f"Failed to {verb} {_full(u)}: Unit {_full(u)} is masked.")
                rc = max(rc, 1)
            elif e == "not-found":
                o.e(f"Failed to {verb} {_full(u)}: Unit {_full(u)} not found.")
                rc = 5
            else:
                n.set_active(u, True)
        elif verb == "stop":
            if e == "not-found" and not (n.services / u).exists():
                o.e(f"Failed to stop {_full(u)}: Unit {_full(u)} not loaded.")
                rc = 5
            else:
                n.set_active(u, False)
        elif verb == "disable":
            if e == "masked":
                premask[u] = "disabled"
            else:
                if e == "enabled":
                    o.e(f'Removed "/etc/systemd/system/multi-user.target.wants/{_full(u)}".')
                units[u] = "disabled"  # an unknown unit is recorded too (the product's contract)
            if now:
                n.set_active(u, False)
        elif verb == "enable":
            if e == "masked":
                o.e(f"Failed to enable unit: Unit file /etc/systemd/system/{_full(u)} is masked.")
                return 1
            if e == "not-found":
                o.e(f"Failed to enable unit: Unit file {_full(u)} does not exist.")
                return 1
            if e != "enabled":
                o.e(f"Created symlink /etc/systemd/system/multi-user.target.wants/{_full(u)} → "
                    f"/lib/systemd/system/{_full(u)}.")
            units[u] = "enabled"
            if now:
                n.set_active(u, True)
        elif verb == "mask":
            if e != "masked":
                premask[u] = e
                units[u] = "masked"
                o.e(f"Created symlink /etc/systemd/system/{_full(u)} → /dev/null.")
            if now:
                n.set_active(u, False)
        elif verb == "unmask":
            if e == "masked":
                before = premask.pop(u, "disabled")
                if before == "not-found":
                    units.pop(u, None)
                else:
                    units[u] = before
                o.e(f'Removed "/etc/systemd/system/{_full(u)}".')
    return rc


def sysctl(n: NodeOs, argv: list[str], o: Out, root: bool) -> int:
    if argv and argv[0] == "-p":
        if len(argv) != 2 or argv[1] != SYSCTL_FILE:
            o.e(f"sim: only `sysctl -p {SYSCTL_FILE}`, `sysctl -w KEY=VALUE...` and `sysctl -n KEY...` are simulated")
            return 1
        if not root:
            o.e("sysctl: permission denied on key \"vm.min_free_kbytes\"")
            return 1
        text = n.read_etc(SYSCTL_FILE)
        if text is None:
            o.e(f'sysctl: cannot open "{SYSCTL_FILE}": No such file or directory')
            return 255
        rc = 0
        with n.change() as st:
            for k, v, ignore in _sysctl_file_values(text):
                if k not in st["sysctl"]:
                    if not ignore:
                        o.e(f"sysctl: cannot stat /proc/sys/{k.replace('.', '/')}: No such file or directory")
                        rc = 255
                    continue
                st["sysctl"][k] = v
                o.o(f"{k} = {v}")
        return rc
    if argv and argv[0] == "-w":
        return _sysctl_write(n, argv[1:], o, root)
    names = [a for a in argv if not a.startswith("-")]
    if "-n" not in argv or not names or len(names) + 1 != len(argv):
        o.e(f"sim: only `sysctl -n KEY...` and `sysctl -p {SYSCTL_FILE}` are simulated")
        return 1
    live, rc = n.load()["sysctl"], 0
    for k in names:
        if k in live:
            o.o(live[k])
        else:
            o.e(f"sysctl: cannot stat /proc/sys/{k.replace('.', '/')}: No such file or directory")
            rc = 255
    return rc


def _sysctl_write(n: NodeOs, settings: list[str], o: Out, root: bool) -> int:
    """`sysctl -w K=V...` (the product's undo of `sysctl -p`): sets each live value, prints "k = v"."""
    if not settings or not all("=" in a for a in settings):
        o.e("sim: `sysctl -w` takes KEY=VALUE arguments")
        return 1
    if not root:
        o.e(f'sysctl: permission denied on key "{settings[0].partition("=")[0]}"')
        return 1
    rc = 0
    with n.change() as st:
        for a in settings:
            k, _, v = a.partition("=")
            if k not in st["sysctl"]:
                o.e(f"sysctl: cannot stat /proc/sys/{k.replace('.', '/')}: No such file or directory")
                rc = 255
                continue
            st["sysctl"][k] = v
            o.o(f"{k} = {v}")
    return rc


def tee(n: NodeOs, argv: list[str], o: Out, stdin: str) -> int:
    if len(argv) != 1 or argv[0] not in ETC_FILES:
        o.e(f"sim: tee writes only {' or '.join(ETC_FILES)} on a simulated node")
        return 1
    n.write_etc(argv[0], stdin)
    o.out.append(stdin)
    return 0


def sh_script(n: NodeOs, argv: list[str], o: Out, root: bool) -> int:
    """`sh -c '{ echo K = V; ...; } > FILE'`: the shape Phase 0 writes the sysctl file in (what the
    node's sudoers allows decides which script runs; this is what the shell does with it)."""
    m = re.fullmatch(r"\{ ((?:echo [^;{}>]*; )+)\} > (\S+)", argv[1]) if len(argv) == 2 and argv[0] == "-c" else None
    if m is None or m.group(2) != SYSCTL_FILE:
        o.e(f"sim: sh runs only `sync; echo 3 > /proc/sys/vm/drop_caches` and `{{ echo ...; }} > {SYSCTL_FILE}` "
            "on a simulated node")
        return 1
    if not root:
        o.e(f"sh: 1: cannot create {SYSCTL_FILE}: Permission denied")
        return 2
    lines = [cmd[len("echo "):] for cmd in m.group(1).split("; ") if cmd]
    n.write_etc(SYSCTL_FILE, "".join(" ".join(line.split()) + "\n" for line in lines))
    return 0


def cp(n: NodeOs, argv: list[str], o: Out, root: bool) -> int:
    """`cp FILE COPY` between Phase 0's files and their undo copies."""
    known = (*ETC_FILES, *BACKUPS)
    if len(argv) != 2 or argv[0] not in known or argv[1] not in known or argv[0] == argv[1]:
        o.e(f"sim: cp copies only between {', '.join(known)} on a simulated node")
        return 1
    if not root:
        o.e(f"cp: cannot create regular file '{argv[1]}': Permission denied")
        return 1
    text = n.read_etc(argv[0])
    if text is None:
        o.e(f"cp: cannot stat '{argv[0]}': No such file or directory")
        return 1
    n.write_etc(argv[1], text)
    return 0


def sed(n: NodeOs, argv: list[str], o: Out, root: bool) -> int:
    """The runbook's `sed -i '/swap/d' /etc/fstab`, only."""
    if argv != ["-i", "/swap/d", FSTAB]:
        o.e(f"sim: only `sed -i /swap/d {FSTAB}` is simulated")
        return 1
    if not root:
        o.e("sed: couldn't open temporary file /etc/sedXXXXXX: Permission denied")
        return 4
    text = n.read_etc(FSTAB) or ""
    n.write_etc(FSTAB, "".join(line for line in text.splitlines(keepends=True) if "swap" not in line))
    return 0


def rm(n: NodeOs, argv: list[str], o: Out) -> int:
    if argv != ["-f", SYSCTL_FILE]:
        o.e(f"sim: rm removes only {SYSCTL_FILE} (with -f) on a simulated node")
        return 1
    n.write_etc(SYSCTL_FILE, None)
    return 0


def swapon(n: NodeOs, argv: list[str], o: Out, root: bool) -> int:
    if argv == ["--show=NAME", "--noheadings"]:
        for s in n.load()["swaps"]:
            o.o(s)
        return 0
    if argv == ["-a"]:
        if not root:
            o.e("swapon: /swap.img: swapon failed: Operation not permitted")
            return 1
        with n.change() as st:
            st["swaps"] = sorted(set(st["swaps"]) | set(fstab_swaps(n.read_etc(FSTAB))))
        return 0
    o.e("sim: only `swapon --show=NAME --noheadings` and `swapon -a` are simulated")
    return 1


def swapoff(n: NodeOs, argv: list[str], o: Out, root: bool) -> int:
    if argv != ["-a"] or not root:
        o.e("sim: only `sudo swapoff -a` is simulated")
        return 1
    with n.change() as st:
        st["swaps"] = []
    return 0


def dpkg_query(n: NodeOs, argv: list[str], o: Out) -> int | None:
    """None: not ours, the real dpkg-query answers."""
    if argv != ["-W", "-f", "${Status}", EARLYOOM]:
        return None
    if n.load()["packages"].get(EARLYOOM):
        o.out.append("install ok installed")
        return 0
    o.e(f"dpkg-query: no packages found matching {EARLYOOM}")
    return 1


def apt_get(n: NodeOs, argv: list[str], o: Out, root: bool) -> int:
    if argv not in (["purge", "-y", EARLYOOM], ["install", "-y", EARLYOOM]) or not root:
        o.e(f"sim: only `sudo apt-get purge -y {EARLYOOM}` and `sudo apt-get install -y {EARLYOOM}` are simulated")
        return 1
    install = argv[0] == "install"
    with n.change() as st:
        had = bool(st["packages"].get(EARLYOOM))
        o.o("Reading package lists...\nBuilding dependency tree...\nReading state information...")
        if had == install:
            o.o(f"{EARLYOOM} is already the newest version." if install else
                f"Package '{EARLYOOM}' is not installed, so not removed")
            o.o("0 upgraded, 0 newly installed, 0 to remove and 0 not upgraded.")
            return 0
        st["packages"][EARLYOOM] = install
        if install:
            st["units"][EARLYOOM] = "enabled"
            o.o(f"The following NEW packages will be installed:\n  {EARLYOOM}\n"
                "0 upgraded, 1 newly installed, 0 to remove and 0 not upgraded.\n"
                f"Setting up {EARLYOOM} ...")
        else:
            st["units"].pop(EARLYOOM, None)
            st["premask"].pop(EARLYOOM, None)
            o.o(f"The following packages will be REMOVED:\n  {EARLYOOM}*\n"
                "0 upgraded, 0 newly installed, 1 to remove and 0 not upgraded.\n"
                f"Removing {EARLYOOM} ...\nPurging configuration files for {EARLYOOM} ...")
        n.set_active(EARLYOOM, install)
    return 0


def desktop_gib(n: NodeOs) -> float:
    """Memory the desktop holds: only while gdm3 runs (gpu_states.DESKTOP_GIB, the runbook's figure)."""
    if not n.active("gdm3"):
        return 0.0
    from spark_sim.gpu_states import DESKTOP_GIB

    return DESKTOP_GIB


def free(n: NodeOs, argv: list[str], o: Out) -> int:
    if argv != ["-g"]:
        o.e("sim: only `free -g` is simulated")
        return 1
    used = BASE_USED_GIB + round(desktop_gib(n))
    swap = SWAP_GIB if n.load()["swaps"] else 0

    def row(label: str, cells: list[object]) -> str:
        return f"{label:<9}" + f"{cells[0]!s:>11}" + "".join(f" {c!s:>11}" for c in cells[1:])

    o.o(row("", ["total", "used", "free", "shared", "buff/cache", "available"]))
    o.o(row("Mem:", [MEM_TOTAL_GIB, used, MEM_TOTAL_GIB - used - CACHE_GIB, 0, CACHE_GIB, MEM_TOTAL_GIB - used]))
    o.o(row("Swap:", [swap, 0, swap]))
    return 0


# --- reboot -------------------------------------------------------------------------------------

def reboot_started(node_dir: Path | Any) -> str:
    """`sudo reboot` on the node: mark the power file with a token the background boot checks (an
    AC cut meanwhile wins), and return the token."""
    token = secrets.token_hex(6)
    _write(Path(getattr(node_dir, "dir", node_dir)) / "power", f"rebooting {token}\n")
    return token


def power_token(node_dir: Path) -> str | None:
    try:
        words = (node_dir / "power").read_text().split()
    except OSError:
        return None
    return words[1] if len(words) == 2 and words[0] == "rebooting" else None


OS_ACTIONS = ("fresh", "show", "reboot-hangs", "boot-delay")


def bad_input(action: str, value: str | None) -> str | None:
    """What is wrong with `sim os NODE ACTION [VALUE]`, or None."""
    if action not in OS_ACTIONS:
        return f"unknown action {action!r}; use one of {', '.join(OS_ACTIONS)}"
    if action == "reboot-hangs" and value not in ("on", "off"):
        return f"reboot-hangs {value or ''}: give on or off"
    if action == "boot-delay":
        try:
            if 0 <= float(value or "") <= 600:
                return None
        except ValueError:
            pass
        return f"boot-delay {value or ''}: give seconds between 0 and 600"
    if action in ("fresh", "show") and value is not None:
        return f"{action} takes no value (got {value!r})"
    return None


def command(fleet: Any, node: str, action: str, value: str | None) -> str:
    """`sim os NODE fresh | show | reboot-hangs on|off | boot-delay SECONDS` (host side)."""
    from spark_sim.layout import SimError

    m = fleet.node(node)
    if action == "fresh":
        fresh(m)
        return f"{node}: DGX OS out of the box (graphical target, desktop and every unit running, swap on, earlyoom)"
    if action == "show":
        return json.dumps(show(m), indent=1, sort_keys=True)
    if action == "reboot-hangs":
        if value not in ("on", "off"):
            raise SimError(f"os {node} reboot-hangs: give on or off, not {value!r}")
        set_reboot_hangs(m, value == "on")
        return f"{node}: a reboot {'hangs (until sim power off, on)' if value == 'on' else 'comes back by itself'}"
    if action == "boot-delay":
        try:
            set_boot_delay(m, float(value or ""))
        except ValueError as e:
            raise SimError(f"os {node} boot-delay {value!r}: give seconds between 0 and 600 ({e})") from None
        return f"{node}: a reboot takes {float(value or 0):g} s to boot"
    raise SimError(f"os {action!r}: use one of {', '.join(OS_ACTIONS)}")


# --- entry point ----------------------------------------------------------------------------------

def run(node_dir: Path, program: str, argv: list[str], stdin: str = "", root: bool | None = None) -> tuple[int | None, str, str]:
    """Run one stand-in program against a node dir: (rc or None for "not ours", stdout, stderr)."""
    n, o = NodeOs(node_dir), Out()
    root = os.geteuid() == 0 if root is None else root
    rc: int | None
    if program == "systemctl":
        rc = systemctl(n, argv, o, root)
    elif program == "sysctl":
        rc = sysctl(n, argv, o, root)
    elif program == "tee":
        rc = tee(n, argv, o, stdin)
    elif program == "rm":
        rc = rm(n, argv, o)
    elif program == "sh":
        rc = sh_script(n, argv, o, root)
    elif program == "cp":
        rc = cp(n, argv, o, root)
    elif program == "sed":
        rc = sed(n, argv, o, root)
    elif program == "swapon":
        rc = swapon(n, argv, o, root)
    elif program == "swapoff":
        rc = swapoff(n, argv, o, root)
    elif program == "dpkg-query":
        rc = dpkg_query(n, argv, o)
    elif program == "apt-get":
        rc = apt_get(n, argv, o, root)
    elif program == "free":
        rc = free(n, argv, o)
    else:
        o.e(f"sim: no stand-in named {program}")
        rc = 1
    return rc, "".join(o.out), "".join(o.err)


REAL = {"dpkg-query": "/usr/bin/dpkg-query"}


def main(argv: list[str]) -> int:
    """`python -m spark_sim.node_os NODE_DIR PROGRAM ARGS...` (the node's stand-ins)."""
    if len(argv) < 2:
        sys.stderr.write("usage: python -m spark_sim.node_os NODE_DIR PROGRAM [ARGS...]\n")
        return 2
    node_dir, program, rest = Path(argv[0]), argv[1], argv[2:]
    stdin = sys.stdin.read() if program == "tee" else ""
    rc, out, err = run(node_dir, program, rest, stdin)
    if rc is None:
        os.execv(REAL[program], [program, *rest])
    sys.stdout.write(out)
    sys.stderr.write(err)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
