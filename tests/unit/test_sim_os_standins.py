"""The simulated node OS (spark_sim.node_os) driven directly on a temp node dir: systemd's
enablement semantics, what a boot does, sysctl, swap, the /etc files, earlyoom, free, and the
desktop's share of the GPU memory a container sees."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spark_pipelines.core import node_os as p0
from spark_sim import gpu_hook, gpu_states, node_os
from spark_sim.cli import sim_command
from spark_sim.node_os import SYSCTL_FILE

RUNNING = ["list-units", "--type=service", "--state=running", "--no-legend", "--plain"]


def sh(d: Path, program: str, *argv: str, stdin: str = "", root: bool = True) -> tuple[int | None, str, str]:
    return node_os.run(d, program, list(argv), stdin, root=root)


def running(d: Path) -> set[str]:
    rc, out, _ = sh(d, "systemctl", *RUNNING)
    assert rc == 0
    lines = [line.split() for line in out.splitlines()]
    assert all(f[1:4] == ["loaded", "active", "running"] for f in lines)
    return {f[0] for f in lines}


@pytest.fixture()
def fresh(tmp_path: Path) -> Path:
    node_os.provision(tmp_path)
    node_os.fresh(tmp_path)
    return tmp_path


def phase0(d: Path) -> None:
    """The runbook's Phase 0 as the product runs it (before the reboot)."""
    assert sh(d, "systemctl", "set-default", "multi-user.target")[0] == 0
    assert sh(d, "systemctl", "disable", *node_os.DISABLE_LIST)[0] == 0
    assert sh(d, "systemctl", "mask", *node_os.MASK_LIST)[0] == 0
    sh(d, "systemctl", "stop", "prometheus-node-exporter")
    assert sh(d, "systemctl", "disable", "tailscaled")[0] == 0
    assert sh(d, "systemctl", "stop", "tailscaled")[0] == 0
    assert sh(d, *p0.write_sysctl_file())[0] == 0
    assert sh(d, "sysctl", "-p", SYSCTL_FILE)[0] == 0
    assert sh(d, "swapoff", "-a")[0] == 0
    assert sh(d, "cp", "/etc/fstab", "/etc/fstab.before-phase0")[0] == 0
    assert sh(d, *p0.STRIP_SWAP)[0] == 0
    assert sh(d, "apt-get", "purge", "-y", "earlyoom")[0] == 0


def test_sim_up_node_is_provisioned(tmp_path: Path) -> None:
    node_os.provision(tmp_path)
    assert sh(tmp_path, "systemctl", "get-default")[1] == "multi-user.target\n"
    assert running(tmp_path) == {f"{u}.service" for u in node_os.BASE_UNITS}
    assert sh(tmp_path, "systemctl", "is-enabled", "gdm3", "cups") == (1, "masked\ndisabled\n", "")
    assert sh(tmp_path, "sysctl", "-n", "vm.min_free_kbytes", "vm.overcommit_memory")[1] == "5242880\n1\n"
    assert sh(tmp_path, "swapon", "--show=NAME", "--noheadings") == (0, "", "")
    assert sh(tmp_path, "dpkg-query", "-W", "-f", "${Status}", "earlyoom")[0] == 1
    assert "swap" not in (node_os.NodeOs(tmp_path).read_etc("/etc/fstab") or "x swap")


def test_fresh_node_is_dgx_os_out_of_the_box(fresh: Path) -> None:
    assert sh(fresh, "systemctl", "get-default")[1] == "graphical.target\n"
    up = running(fresh)
    assert {"gdm3.service", "rpcbind.service", "earlyoom.service", "tailscaled.service",
            "prometheus-node-exporter.service", "snap.firmware-updater.firmware-notifier.service"} <= up
    assert "rpcbind.socket" not in up  # a socket is no service
    assert sh(fresh, "systemctl", "is-enabled", "snapd", "snapd.service", "rpcbind.socket") == \
        (0, "enabled\nenabled\nenabled\n", "")
    assert sh(fresh, "sysctl", "-n", "vm.swappiness", "vm.min_free_kbytes")[1] == "60\n67584\n"
    assert sh(fresh, "swapon", "--show=NAME", "--noheadings")[1] == "/swap.img\n"
    assert sh(fresh, "dpkg-query", "-W", "-f", "${Status}", "earlyoom") == (0, "install ok installed", "")
    assert node_os.NodeOs(fresh).read_etc(SYSCTL_FILE) is None


def test_disable_and_mask_do_not_stop_and_mask_blocks_start(fresh: Path) -> None:
    assert sh(fresh, "systemctl", "disable", "cups.service")[0] == 0
    assert sh(fresh, "systemctl", "is-active", "cups") == (0, "active\n", "")
    assert sh(fresh, "systemctl", "is-enabled", "cups") == (1, "disabled\n", "")
    assert sh(fresh, "systemctl", "mask", "rpcbind")[0] == 0
    assert sh(fresh, "systemctl", "is-active", "rpcbind.service")[1] == "active\n"
    assert sh(fresh, "systemctl", "stop", "rpcbind")[0] == 0
    assert sh(fresh, "systemctl", "start", "rpcbind") == \
        (1, "", "Failed to start rpcbind.service: Unit rpcbind.service is masked.\n")
    assert sh(fresh, "systemctl", "is-active", "rpcbind", "docker") == (3, "inactive\nactive\n", "")
    rc, _, err = sh(fresh, "systemctl", "enable", "rpcbind")
    assert rc == 1 and "masked" in err
    # "x.socket" is its own unit: masking rpcbind left it alone.
    assert sh(fresh, "systemctl", "is-enabled", "rpcbind.socket")[1] == "enabled\n"


def test_unmask_restores_the_enablement_before_the_mask(fresh: Path) -> None:
    sh(fresh, "systemctl", "disable", "smartd")
    sh(fresh, "systemctl", "mask", "smartd", "gdm3")
    sh(fresh, "systemctl", "unmask", "smartd", "gdm3")
    assert sh(fresh, "systemctl", "is-enabled", "smartd", "gdm3")[1] == "disabled\nenabled\n"
    # masking a unit that does not exist works, as in systemd, and unmasking forgets it again
    sh(fresh, "systemctl", "mask", "ghost")
    assert sh(fresh, "systemctl", "is-enabled", "ghost")[1] == "masked\n"
    sh(fresh, "systemctl", "unmask", "ghost")
    assert sh(fresh, "systemctl", "is-enabled", "ghost") == (1, "not-found\n", "")


def test_unknown_units_and_unprivileged_changes_fail_like_systemd(fresh: Path) -> None:
    assert sh(fresh, "systemctl", "start", "ghost") == (5, "", "Failed to start ghost.service: Unit ghost.service not found.\n")
    assert sh(fresh, "systemctl", "stop", "ghost")[0] == 5
    assert sh(fresh, "systemctl", "disable", "ghost")[0] == 0
    assert sh(fresh, "systemctl", "is-enabled", "ghost")[1] == "disabled\n"
    rc, _, err = sh(fresh, "systemctl", "mask", "gdm3", root=False)
    assert rc == 1 and "Access denied" in err
    assert sh(fresh, "systemctl", "is-enabled", "gdm3")[1] == "enabled\n"


def test_boot_after_phase0_runs_only_the_runbook_services(fresh: Path) -> None:
    phase0(fresh)
    node_os.boot(fresh)
    # Phase 0 only stops the exporter ("re-enable after"): still enabled, it starts at boot.
    assert running(fresh) == {f"{u}.service" for u in (*node_os.BASE_UNITS, "prometheus-node-exporter")}
    assert sh(fresh, "systemctl", "get-default")[1] == "multi-user.target\n"
    values = sh(fresh, "sysctl", "-n", *node_os.RUNBOOK_SYSCTLS)[1].split()
    assert values == list(node_os.RUNBOOK_SYSCTLS.values())


def test_disabled_socket_activated_units_come_back_at_boot_masked_ones_do_not(fresh: Path) -> None:
    sh(fresh, "systemctl", "disable", "rpcbind", "cups", "smartd")
    sh(fresh, "systemctl", "mask", "smartd")
    sh(fresh, "systemctl", "stop", "rpcbind", "cups", "smartd")
    node_os.boot(fresh)
    assert sh(fresh, "systemctl", "is-active", "rpcbind", "cups", "smartd")[1] == "active\ninactive\ninactive\n"


def test_boot_resets_sysctls_to_the_kernel_then_applies_the_file(fresh: Path) -> None:
    sh(fresh, "tee", SYSCTL_FILE, stdin="vm.swappiness = 1\n-vm.nosuch = 3\n")
    assert sh(fresh, "sysctl", "-p", SYSCTL_FILE) == (0, "vm.swappiness = 1\n", "")
    node_os.boot(fresh)
    assert sh(fresh, "sysctl", "-n", "vm.swappiness", "vm.dirty_ratio")[1] == "1\n20\n"
    assert sh(fresh, "rm", "-f", SYSCTL_FILE)[0] == 0  # the undo
    node_os.boot(fresh)
    assert sh(fresh, "sysctl", "-n", "vm.swappiness")[1] == "60\n"
    rc, _, err = sh(fresh, "sysctl", "-p", SYSCTL_FILE)
    assert rc == 255 and "cannot open" in err


def test_sysctl_w_is_the_undo_of_sysctl_p(fresh: Path) -> None:
    sh(fresh, "tee", SYSCTL_FILE, stdin="vm.swappiness = 1\n")
    sh(fresh, "sysctl", "-p", SYSCTL_FILE)
    assert sh(fresh, "sysctl", "-w", "vm.swappiness=60") == (0, "vm.swappiness = 60\n", "")
    assert sh(fresh, "sysctl", "-n", "vm.swappiness")[1] == "60\n"
    assert sh(fresh, "sysctl", "-w", "vm.nosuch=1")[0] == 255
    assert sh(fresh, "sysctl", "-w", "vm.swappiness=1", root=False)[0] == 1


def test_sysctl_unknown_key_errors_like_sysctl(fresh: Path) -> None:
    sh(fresh, "tee", SYSCTL_FILE, stdin="vm.nosuch = 1\nvm.swappiness = 5\n")
    assert sh(fresh, "sysctl", "-p", SYSCTL_FILE) == \
        (255, "vm.swappiness = 5\n", "sysctl: cannot stat /proc/sys/vm/nosuch: No such file or directory\n")
    assert sh(fresh, "sysctl", "-n", "vm.nosuch", "vm.swappiness")[:2] == (255, "5\n")


def test_swap_follows_fstab_at_boot_and_swapon_a(fresh: Path) -> None:
    n = node_os.NodeOs(fresh)
    assert sh(fresh, "swapoff", "-a")[0] == 0
    assert sh(fresh, "swapon", "--show=NAME", "--noheadings")[1] == ""
    sh(fresh, "swapon", "-a")
    assert sh(fresh, "swapon", "--show=NAME", "--noheadings")[1] == "/swap.img\n"
    no_swap = "".join(line + "\n" for line in (n.read_etc("/etc/fstab") or "").splitlines() if "swap" not in line)
    sh(fresh, "tee", "/etc/fstab", stdin=no_swap)
    node_os.boot(fresh)
    assert sh(fresh, "swapon", "--show=NAME", "--noheadings")[1] == ""
    sh(fresh, "tee", "/etc/fstab", stdin=no_swap + node_os.SWAP_LINE)
    node_os.boot(fresh)
    assert sh(fresh, "swapon", "--show=NAME", "--noheadings")[1] == "/swap.img\n"


def test_the_sysctl_file_script_cp_and_sed_do_what_phase0_runs_and_nothing_else(fresh: Path) -> None:
    n = node_os.NodeOs(fresh)
    assert sh(fresh, *p0.write_sysctl_file()) == (0, "", "")
    assert n.read_etc(SYSCTL_FILE) == p0.sysctl_file_text()  # the shell's output of the product's script
    assert sh(fresh, "sh", "-c", "{ echo kernel.modprobe = /tmp/x; } > /etc/sysctl.d/99-evil.conf")[0] == 1
    assert sh(fresh, "sh", "-c", "id")[0] == 1
    assert sh(fresh, *p0.write_sysctl_file(), root=False)[0] == 2
    before = n.read_etc("/etc/fstab")
    assert "swap" in before
    assert sh(fresh, "cp", "/etc/fstab", "/etc/fstab.before-phase0")[0] == 0
    assert sh(fresh, "sed", "-i", "/swap/d", "/etc/fstab")[0] == 0
    assert n.read_etc("/etc/fstab") == p0.fstab_without_swap(before)
    assert sh(fresh, "cp", "/etc/fstab.before-phase0", "/etc/fstab")[0] == 0  # the undo
    assert n.read_etc("/etc/fstab") == before
    assert sh(fresh, "cp", "/etc/passwd", "/etc/fstab")[0] == 1
    assert sh(fresh, "sed", "-i", "/swap/d", "/etc/passwd")[0] == 1
    assert sh(fresh, "cp", "/etc/sysctl.d/90-dgx-spark-memory.conf.before-phase0", SYSCTL_FILE) == \
        (1, "", "cp: cannot stat '/etc/sysctl.d/90-dgx-spark-memory.conf.before-phase0': No such file or directory\n")


def test_tee_rm_and_apt_get_take_only_their_argvs(fresh: Path) -> None:
    assert sh(fresh, "tee", "/etc/passwd", stdin="x")[0] == 1
    assert sh(fresh, "rm", "-rf", "/")[0] == 1
    assert sh(fresh, "apt-get", "purge", "-y", "vim")[0] == 1
    assert not (fresh / "etc" / "passwd").exists()


def test_earlyoom_purge_and_install(fresh: Path) -> None:
    assert sh(fresh, "apt-get", "purge", "-y", "earlyoom")[0] == 0
    assert sh(fresh, "dpkg-query", "-W", "-f", "${Status}", "earlyoom") == \
        (1, "", "dpkg-query: no packages found matching earlyoom\n")
    assert sh(fresh, "systemctl", "is-active", "earlyoom")[1] == "inactive\n"
    assert sh(fresh, "systemctl", "is-enabled", "earlyoom")[1] == "not-found\n"
    assert sh(fresh, "apt-get", "install", "-y", "earlyoom")[0] == 0
    assert sh(fresh, "systemctl", "is-active", "earlyoom")[1] == "active\n"
    assert sh(fresh, "dpkg-query", "-W", "-f", "${Status}", "earlyoom")[0] == 0
    assert sh(fresh, "dpkg-query", "-W", "-f", "${Status}", "bash")[0] is None  # the real one answers


def test_free_shows_the_desktop_while_gdm3_runs(fresh: Path) -> None:
    def used() -> int:
        rows = {r.split()[0]: r.split()[1:] for r in sh(fresh, "free", "-g")[1].splitlines()[1:]}
        assert rows["Mem:"][0] == "119"
        return int(rows["Mem:"][1])

    with_desktop = used()
    sh(fresh, "systemctl", "stop", "gdm3")
    assert with_desktop - used() == round(gpu_states.DESKTOP_GIB) and used() < 8  # the runbook's "<8GB used"


def test_container_sees_less_free_gpu_memory_while_gdm3_runs(fresh: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    state = fresh / "gpu" / "state.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"state": "healthy", "profile": "founders"}))
    out = tmp_path_factory.mktemp("rootfs") / "state.json"
    gpu_hook.write_container_state(state, out)
    with_desktop = json.loads(out.read_text())["free_gib"]
    sh(fresh, "systemctl", "stop", "gdm3")
    gpu_hook.write_container_state(state, out)
    headless = json.loads(out.read_text())["free_gib"]
    assert headless == gpu_states.CLEAN_FREE_GIB["founders"]
    assert headless - with_desktop == pytest.approx(gpu_states.DESKTOP_GIB)


def test_reboot_knobs_and_show(tmp_path: Path) -> None:
    node_os.provision(tmp_path)
    node_os.set_reboot_hangs(tmp_path, True)
    node_os.set_boot_delay(tmp_path, 0.5)
    shown = node_os.show(tmp_path)
    assert (shown["reboot_hangs"], shown["boot_delay"]) == (True, 0.5)
    assert shown["active"]["nvidia-persistenced"] and not shown["active"]["gdm3"]
    with pytest.raises(ValueError, match="boot delay"):
        node_os.set_boot_delay(tmp_path, -1)
    node_os.fresh(tmp_path)
    assert node_os.show(tmp_path)["reboot_hangs"] is True  # fresh keeps the knobs


@pytest.mark.parametrize(("argv", "needle"), [
    (["os", "spark1", "melt"], "unknown action 'melt'"),
    (["os", "spark1", "reboot-hangs", "maybe"], "give on or off"),
    (["os", "spark1", "boot-delay", "-3"], "between 0 and 600"),
    (["os", "spark1", "boot-delay"], "between 0 and 600"),
    (["os", "spark1", "show"], "no simulated fleet is up"),
])
def test_sim_os_bad_input_exits_2_with_one_line(argv: list[str], needle: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SPARK_SIM_ROOT", str(tmp_path / "sim-root"))
    assert sim_command(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err


def test_sim_os_command_drives_a_node(tmp_path: Path) -> None:
    class Fleet:
        def node(self, name: str) -> Path:
            assert name == "spark2"
            return tmp_path

    node_os.provision(tmp_path)
    assert "out of the box" in node_os.command(Fleet(), "spark2", "fresh", None)
    node_os.command(Fleet(), "spark2", "boot-delay", "7.5")
    node_os.command(Fleet(), "spark2", "reboot-hangs", "on")
    shown = json.loads(node_os.command(Fleet(), "spark2", "show", None))
    assert (shown["default_target"], shown["boot_delay"], shown["reboot_hangs"]) == ("graphical.target", 7.5, True)
    assert shown["active"]["gdm3"] and shown["etc"][SYSCTL_FILE] is None
