"""Phase 0's diff (core/node_os.py): a fresh DGX OS node gets every change with its undo, a
provisioned one none, and the clean-boot verify names what came back."""

import re

from spark_pipelines.core import node_os as p0
from spark_pipelines.core import preflight

FRESH_FSTAB = "UUID=abc / ext4 defaults 0 1\n/swap.img none swap sw 0 0\n"
KERNEL = {"vm.min_free_kbytes": "67584", "vm.vfs_cache_pressure": "100", "vm.swappiness": "60",
          "vm.dirty_background_ratio": "10", "vm.dirty_ratio": "20", "vm.panic_on_oom": "0",
          "vm.max_map_count": "65530", "vm.zone_reclaim_mode": "0", "vm.overcommit_memory": "0"}
UNITS = sorted({p0.unit_name(u) for u in (*p0.DISABLE, *p0.MASK)} | {p0.TAILSCALE})


def fresh() -> p0.OsFacts:
    return p0.OsFacts(default_target="graphical.target", enablement={u: "enabled" for u in UNITS},
                      running=frozenset(UNITS) | {"docker", "containerd"}, sysctl_file=None, sysctl_live=dict(KERNEL),
                      swap_active=("/swap.img",), fstab=FRESH_FSTAB, earlyoom_installed=True, used_gib=15)


def provisioned(choices: p0.Choices = p0.Choices()) -> p0.OsFacts:
    wanted = p0.wanted_units(choices)
    return p0.OsFacts(default_target=p0.HEADLESS_TARGET, enablement={u: wanted.get(u, "enabled") for u in UNITS},
                      running=frozenset({*p0.EXPECTED_RUNNING, p0.TAILSCALE}), sysctl_file=p0.sysctl_file_text(),
                      sysctl_live=dict(p0.SYSCTLS), swap_active=(), fstab="UUID=abc / ext4 defaults 0 1\n",
                      earlyoom_installed=False, used_gib=3)


def test_the_runbooks_values_are_carried_exactly():
    assert p0.sysctl_file_text().splitlines() == [
        "vm.min_free_kbytes = 5242880", "vm.vfs_cache_pressure = 200", "vm.swappiness = 1",
        "vm.dirty_background_ratio = 2", "vm.dirty_ratio = 5", "vm.panic_on_oom = 0",
        "vm.max_map_count = 2097152", "vm.zone_reclaim_mode = 0", "vm.overcommit_memory = 1"]
    assert len(p0.DISABLE) == 29 and len(p0.MASK) == 22
    assert set(p0.COMES_BACK) <= set(p0.MASK)  # what comes back is masked, not only disabled


def test_a_fresh_node_gets_every_change_each_with_its_undo():
    changes = p0.plan(fresh(), p0.Choices())
    by = {c.setting: c for c in changes}
    assert by["default target"].argvs == (("systemctl", "set-default", "multi-user.target"),)
    assert by["default target"].undo == (("systemctl", "set-default", "graphical.target"),)
    assert by["service gdm3"].argvs == (("systemctl", "mask", "gdm3"),)
    assert by["service gdm3"].undo == (("systemctl", "unmask", "gdm3"), ("systemctl", "enable", "gdm3"))
    assert by["service cups"].argvs == (("systemctl", "disable", "cups"),)  # disable list only
    assert "service tailscaled" not in by  # kept unless the fleet says so
    assert by[f"file {p0.SYSCTL_PATH}"].argvs == (p0.write_sysctl_file(),)
    assert by[f"file {p0.SYSCTL_PATH}"].undo == (("rm", "-f", p0.SYSCTL_PATH),)
    assert by["live sysctls"].undo[:2] == (("sysctl", "-w", "vm.min_free_kbytes=67584"),
                                           ("sysctl", "-w", "vm.vfs_cache_pressure=100"))  # one key each
    assert by["swap"].argvs == (("swapoff", "-a"),) and by["swap"].undo == (("swapon", "-a"),)
    # the runbook's sed, the operator's fstab kept aside by root for the undo (no content we send)
    assert by[f"file {p0.FSTAB}"].argvs == (("cp", "/etc/fstab", "/etc/fstab.before-phase0"),
                                            ("sed", "-i", "/swap/d", "/etc/fstab"))
    assert by[f"file {p0.FSTAB}"].undo == (("cp", "/etc/fstab.before-phase0", "/etc/fstab"),)
    assert by["package earlyoom"].argvs == (("apt-get", "purge", "-y", "earlyoom"),)
    assert all(c.undo for c in changes)
    assert p0.needs_reboot(changes, fresh(), p0.Choices())
    # the runbook's order: target, services, sysctls, swap, fstab, earlyoom
    order = [c.setting.split()[0] for c in changes]
    assert order.index("default") < order.index("service") < order.index("file") < order.index("swap") < order.index("package")


def test_a_provisioned_node_changes_nothing_and_needs_no_reboot():
    facts = provisioned()
    assert p0.plan(facts, p0.Choices()) == []
    assert not p0.needs_reboot([], facts, p0.Choices())
    assert p0.verify(facts, p0.Choices()).clean


def test_choices_from_the_fleet_file():
    keep = p0.Choices(keep_services=frozenset({"dgx-dashboard-admin"}), disable_tailscale=True)
    changes = {c.setting for c in p0.plan(fresh(), keep)}
    assert "service dgx-dashboard-admin" not in changes and "service tailscaled" in changes
    assert p0.plan(provisioned(keep), keep) == []


def test_a_masked_unit_still_running_needs_the_reboot():
    facts = provisioned()
    running = p0.OsFacts(**{**facts.__dict__, "running": facts.running | {"gdm3"}})
    assert p0.plan(running, p0.Choices()) == []
    assert p0.needs_reboot([], running, p0.Choices())


def test_verify_names_what_came_back_and_masks_the_socket_activated_again():
    facts = provisioned()
    back = p0.OsFacts(**{**facts.__dict__, "running": facts.running | {"rpcbind", "cups"}, "used_gib": 9.0,
                          "sysctl_live": {**p0.SYSCTLS, "vm.swappiness": "60"}})
    v = p0.verify(back, p0.Choices())
    assert v.remask == ["rpcbind"]
    assert any("cups is running" in p for p in v.problems)
    assert any("vm.swappiness is 60, not 1" in p for p in v.problems)
    assert any("9 GB used" in p for p in v.problems)
    (remask,) = p0.remask_changes(v.remask)
    assert remask.argvs == (("systemctl", "mask", "rpcbind"), ("systemctl", "stop", "rpcbind"))


def test_fstab_keeps_everything_but_swap_like_the_runbooks_sed():
    text = "# swap was on /swap.img\nUUID=1 / ext4 defaults 0 1\n/swap.img none swap sw 0 0\nUUID=2 /home ext4 defaults 0 2\n"
    assert p0.fstab_without_swap(text) == "UUID=1 / ext4 defaults 0 1\nUUID=2 /home ext4 defaults 0 2\n"


def test_parsers():
    assert p0.parse_running("gdm3.service loaded active running GNOME\ndocker.service loaded active running D\n") \
        == {"gdm3", "docker"}
    assert p0.parse_free_used_gib("              total        used\nMem:            119          15         100\n") == 15
    assert p0.parse_enablement(["a", "b"], "enabled\nmasked\n") == {"a": "enabled", "b": "masked"}
    try:
        p0.parse_enablement(["a", "b"], "enabled\n")
    except ValueError as e:
        assert "1 states for 2 units" in str(e)
    else:
        raise AssertionError("a short answer must not pass")


def obs(free: float) -> preflight.Observations:
    return preflight.Observations(free_gib=free, total_gib=121.69, gpu_state="healthy", gpu_holder_pids=[],
                                  persistenced_pids=[], earlyoom_installed=False, running_exporters=[],
                                  disk_free_gib=500, page_cache_flushed=True)


def test_a_drop_below_the_measured_clean_boot_is_a_verdict():
    kw = dict(gmu=0.85, max_gmu=0.85, profile_total_gib=121.69, min_disk_gib=100)
    low = preflight.evaluate("spark1", obs(110.0), measured_baseline_gib=117.4, **kw)
    (c,) = [c for c in low.checks if c.name == preflight.CLEAN_BOOT_CHECK]
    assert c.status == "warn" and "7.40 GiB below this node's measured clean boot 117.40" in c.detail
    ok = preflight.evaluate("spark1", obs(117.0), measured_baseline_gib=117.4, **kw)
    assert [c.status for c in ok.checks if c.name == preflight.CLEAN_BOOT_CHECK] == ["ok"]
    none = preflight.evaluate("spark1", obs(117.0), **kw)
    assert not [c for c in none.checks if c.name == preflight.CLEAN_BOOT_CHECK]


def test_the_sudoers_file_lists_each_root_argv_exactly_and_nothing_else():
    text = p0.sudoers_text("operator", p0.Choices())
    lines = [ln.strip().rstrip(", \\") for ln in text.splitlines()[2:-1]]
    assert "/usr/bin/systemctl mask gdm3" in lines and '/usr/sbin/reboot ""' in lines  # "": no arguments
    assert "/usr/bin/apt-get purge -y earlyoom" in lines and "/usr/bin/sed -i /swap/d /etc/fstab" in lines
    assert not any("tee" in ln for ln in lines)  # a root tee of /etc/fstab or sysctl.d is root itself
    assert not any("*" in ln for ln in lines)  # no glob: sudoers' * matches across spaces
    assert "/usr/sbin/sysctl ^-w vm\\.swappiness\\=[0-9]+$" in lines  # one regex per key, digits only
    assert sum(ln.startswith("/usr/sbin/sysctl ^") for ln in lines) == 9
    write = next(ln for ln in lines if ln.startswith("/usr/bin/sh -c "))
    assert write.endswith(f"> {p0.SYSCTL_PATH}") and "vm.swappiness \\= 1;" in write  # = escaped for sudoers
    assert text.splitlines()[-1] == "operator ALL=(root) NOPASSWD: SPARK_PHASE0"
    # every change and undo a fresh node's plan runs is covered, argv for argv
    allowed = {" ".join(a) for a in p0.root_argvs(p0.Choices())}
    undo = [re.compile(p.replace("\\=", "=")) for p in p0.sysctl_undo_patterns()]
    for c in p0.plan(fresh(), p0.Choices()):
        for argv in (*c.argvs, *c.undo):
            shown = " ".join(argv)
            assert shown in allowed or any(r.fullmatch(" ".join(argv[1:])) for r in undo), shown


def test_the_sysctl_undo_patterns_admit_one_of_the_nine_keys_with_a_number_only():
    undo = [re.compile(p.replace("\\=", "=")) for p in p0.sysctl_undo_patterns()]

    def admitted(args: str) -> bool:
        return any(r.fullmatch(args) for r in undo)

    assert admitted("-w vm.swappiness=60") and admitted("-w vm.max_map_count=65530")
    for bad in ("-w kernel.modprobe=/tmp/x", "-w vm.swappiness=60 kernel.modprobe=/tmp/x", "-w vm.swappiness=1x",
                "-w vm.swappinessX=1", "-p /tmp/evil.conf", "-w vm.swappiness=60 vm.dirty_ratio=5"):
        assert not admitted(bad), bad


def test_the_gb10_exporter_panic_fix_is_said_not_applied():
    assert p0.gpu_exporter_advice(None) is None  # no exporter container
    assert p0.gpu_exporter_advice(["--web.listen-address=:9835", "--query-field-names=timestamp,name"]) is None
    said = p0.gpu_exporter_advice(["--web.listen-address=:9835"])
    assert said and "--query-field-names=timestamp,name,uuid," in said and "panics" in said


def test_node_os_job_starts_from_the_check_and_a_check_is_an_observation(tmp_path):
    """Issue 35, items 2-3: the launchpad pre-filled `check: false` (the run that changes settings
    and may reboot a node), and a check-only run recorded a materialization, so the node looked
    provisioned."""
    import dagster as dg
    import yaml

    from spark_pipelines.assets.node_os import NodeOsConfig, recorded
    from spark_pipelines.definitions import build_definitions
    from spark_pipelines.runbook.node_os import Provisioned

    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(yaml.safe_load(open("fleets/seed.yaml")), sort_keys=False))
    job = build_definitions(str(fleet)).resolve_job_def("node_os_job")
    # What the launchpad shows and what a launch without config (the asset page's Materialize) runs.
    assert job.get_run_config_for_partition_key("spark2") == {"ops": {"node_os": {"config": {"check": True}}}}
    assert NodeOsConfig().check is True
    checked = recorded(Provisioned(node="spark2", planned=["service gdm3: enabled -> masked"], check_only=True))
    assert isinstance(checked, dg.AssetObservation)
    assert checked.partition == "spark2" and checked.asset_key == dg.AssetKey("node_os")
    assert checked.metadata["mode"].value == "check (nothing changed)"
    applied = recorded(Provisioned(node="spark2", planned=["service gdm3: enabled -> masked"],
                                   applied=["service gdm3: enabled -> masked"]))
    assert isinstance(applied, dg.MaterializeResult) and applied.metadata["mode"] == "applied"
