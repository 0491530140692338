"""The wedge's evidence and post-drain verdicts (core.wedge) on real captures: the H200 ones as
captured, and the GB10 faces the sim builds from them (the same text nvidia-smi -q lays out)."""

import datetime as dt
import hashlib
from pathlib import Path

import pytest

from spark_pipelines.core.fleet import FleetError, parse_fleet
from spark_pipelines.core.gpu import combine, parse_q, parse_query_csv, parse_reading
from spark_pipelines.core.wedge import (
    PERSISTS,
    RESOLVED,
    bios_string,
    evidence_path,
    judge_evidence,
    judge_lock_test,
    kernel_triggers,
    manifest,
    post_drain_verdict,
)
from spark_sim.gpu_states import SimGpu, render_q

H200 = Path("/work/shared/fixtures/nvidia-smi/h200")
NOW = dt.datetime(2026, 6, 18, 9, 5, 1)
PERF = ["PERFORMANCE", "CLOCK", "POWER", "UTILIZATION"]
LOCK = (2418, 3003)


def gb10(state: str, *, loaded: bool = True, locked: bool = False, profile: str = "gx10"):
    sim = SimGpu(state=state, profile=profile, under_load=loaded, locked_clocks=LOCK if locked else None)
    return parse_reading(render_q(sim, NOW, PERF))


def h200_load():
    return combine([parse_query_csv((H200 / "query-load.csv").read_text())[0],
                    parse_q((H200 / "nvidia-smi-q-perf-load.txt").read_text())[0]])


def test_lock_ignored_on_a_wedged_gx10():
    v = judge_lock_test(True, [gb10("wedged", locked=True)] * 3)
    assert v.state == "ignored" and "708 MHz" in v.reason and "firmware" in v.reason


def test_lock_enforced_on_a_healthy_gb10():
    v = judge_lock_test(True, [gb10("healthy", locked=True, profile="founders")] * 2)
    assert v.state == "enforced" and "2450 MHz" in v.reason


def test_lock_test_needs_load_and_an_accepted_lock():
    assert judge_lock_test(True, [gb10("wedged", loaded=False, locked=True)]).state == "unknown"
    refused = judge_lock_test(False, [gb10("wedged", locked=True)], refusal="Insufficient Permissions")
    assert refused.state == "unknown" and "Insufficient Permissions" in refused.reason


def test_real_h200_under_load_is_neither_pinned_nor_at_gb10_full_clock():
    v = judge_lock_test(True, [h200_load()])  # 1515 MHz at 693 W: throttled by power, not pinned
    assert v.state == "unknown" and "1515" in v.reason


def test_evidence_confirms_only_signature_plus_lock_ignored():
    wedged = [gb10("wedged")] * 3
    ignored = judge_lock_test(True, [gb10("wedged", locked=True)])
    ev = judge_evidence(wedged, ignored, "kernel: Out of memory: Killed process 4242 (python3)\n", "GX10DGX.0104")
    assert ev.confirmed and ev.gpu.state == "wedged" and ev.bios == "GX10DGX.0104"
    assert any("1 OOM kill" in line for line in ev.summary) and "CONFIRMED" in ev.summary[2]
    healthy = judge_evidence([gb10("healthy")] * 3, judge_lock_test(True, [gb10("healthy", locked=True)]))
    assert not healthy.confirmed and "NOT confirmed" in healthy.summary[2]
    # The whole signature without the lock test (refused) is not confirmed either: all must match.
    assert not judge_evidence(wedged, judge_lock_test(False, [])).confirmed


def test_post_drain_resolved_when_every_check_holds():
    v = post_drain_verdict([gb10("healthy")] * 3, judge_lock_test(True, [gb10("healthy", locked=True)]), 53.3, 40.0)
    assert v.verdict == RESOLVED and v.resolved
    assert any("2520 MHz" in r for r in v.reasons) and any("42.1 W" in r for r in v.reasons)
    assert any("640000000 us" in r for r in v.reasons)  # the SW power-cap counter: positive evidence
    assert v.text().startswith("WEDGE RESOLVED\n")


def test_post_drain_persists_with_the_asus_ticket_advice():
    v = post_drain_verdict([gb10("wedged")] * 3, judge_lock_test(True, [gb10("wedged", locked=True)]), 34.1, 40.0,
                           bios="GX10DGX.0104.2026.0326.1657")
    assert v.verdict == PERSISTS and not v.resolved
    assert v.reasons[0].startswith("the wedge signature is still complete")
    assert any("34.1 tok/s < the node's floor 40" in r for r in v.reasons)
    assert "ASUS support ticket" in v.advice and "GX10DGX.0104.2026.0326.1657" in v.advice
    assert "PD firmware >= 5.8" in v.advice and "combined SoC+BIOS+EC capsule" in v.advice


def test_post_drain_slow_bench_at_full_clock_persists():
    v = post_drain_verdict([gb10("healthy")] * 3, judge_lock_test(True, [gb10("healthy", locked=True)]), 30.0, 40.0)
    assert v.verdict == PERSISTS and v.reasons == ["bench 30.0 tok/s < the node's floor 40"] + v.reasons[1:]


def test_post_drain_without_readings_under_load_is_not_resolved():
    v = post_drain_verdict([gb10("healthy", loaded=False)], judge_lock_test(True, []), None, 40.0)
    assert v.verdict == PERSISTS and "could not show the GPU at full clock" in v.advice
    assert "ASUS" not in v.advice


def test_kernel_triggers_and_bios():
    log = ("[ 1.0] usb 1-1: new device\n[ 9.1] PM: suspend entry (s2idle)\n"
           "[ 9.9] PM: suspend exit\n[12.0] python3 invoked oom-killer: gfp_mask=0x140cca\n")
    found = kernel_triggers(log)
    assert found[0].startswith("1 OOM kill") and found[1].startswith("2 sleep/wake")
    assert kernel_triggers("nothing here\n") == []
    assert bios_string("\nGX10DGX.0104.2026.0326.1657\n03/26/2026\n") == "GX10DGX.0104.2026.0326.1657"
    assert bios_string("cat: /sys/class/dmi/id/bios_version: Permission denied\n") is None


def test_manifest_and_dated_path():
    (e,) = manifest({"nvidia-smi-q.txt": b"abc"})
    assert (e.name, e.size, e.sha256) == ("nvidia-smi-q.txt", 3, hashlib.sha256(b"abc").hexdigest())
    when = dt.datetime(2026, 6, 16, 7, 8, 9)
    assert evidence_path("spark2", "pre-drain", when) == \
        "~/wedge-evidence/2026-06-16/spark2-wedge-evidence-pre-drain-20260616T070809Z.tar.gz"


def _with_cold_drain(seed_data, cold_drain):
    return {**seed_data, "cold_drain": cold_drain}


def test_smart_plug_in_the_fleet_file(seed_data):
    plug = {"off_command": ["kasa", "--host", "10.0.0.50", "off"], "on_command": ["/usr/local/bin/kasa", "on"]}
    f = parse_fleet(_with_cold_drain(seed_data, {"smart_plugs": {"spark2": plug}}), "f.yaml")
    assert f.cold_drain.smart_plugs["spark2"].off_command[0] == "kasa" and f.cold_drain.off_s == 120
    assert parse_fleet(seed_data, "f.yaml").cold_drain.smart_plugs == {}


@pytest.mark.parametrize("cold_drain, needles", [
    ({"smart_plugs": {"spark9": {"off_command": ["kasa"], "on_command": ["kasa"]}}}, ["spark9", "unknown node"]),
    ({"smart_plugs": {"spark2": {"off_command": ["kasa off; reboot"], "on_command": ["kasa"]}}},
     ["off_command", "without a shell"]),
    ({"smart_plugs": {"spark2": {"off_command": [], "on_command": ["kasa"]}}}, ["off_command", "empty"]),
    ({"off_s": 30}, ["off_s", "60"]),
])
def test_bad_cold_drain_settings_are_one_line(seed_data, cold_drain, needles):
    with pytest.raises(FleetError) as e:
        parse_fleet(_with_cold_drain(seed_data, cold_drain), "f.yaml")
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles), msg
