"""Benches that can be compared: identity, void rules, the fleet's baseline, the acceptance floor."""

import datetime as dt
from pathlib import Path

import pytest

from spark_pipelines.core import gpu
from spark_pipelines.core.bench import acceptance_gate
from spark_pipelines.core.baseline import (
    BenchIdentity,
    BenchRecord,
    LoadConditions,
    fleet_baseline,
    history,
    identity_of,
    load_conditions,
    record,
    side_by_side,
    void_reasons,
)
from spark_sim.gpu_states import SimGpu, run

H200 = Path("/work/shared/fixtures/nvidia-smi/h200")
IMG_A = BenchIdentity("sha256:" + "a" * 64, "ckpt-1", "spec-1", "580.95.05")
IMG_B = BenchIdentity("sha256:" + "b" * 64, "ckpt-1", "spec-1", "580.95.05")
CLEAN = LoadConditions(gpu_state="healthy", sm_clock_mhz_p50=2418, power_w_p50=90, samples=20,
                       isolation_verified=True, counters_match=True, acceptance_rate=0.95)
FIELDS = "name,utilization.gpu,clocks.current.sm,clocks.max.sm,power.draw,clocks_event_reasons.active,clocks_event_reasons_counters.sw_power_cap"


def gb10(state: str, under_load: bool) -> gpu.GpuReading:
    result, _ = run([f"--query-gpu={FIELDS}", "--format=csv"], SimGpu(state=state, profile="gx10", under_load=under_load),
                    dt.datetime(2026, 6, 18, 9, 5, 1))
    return gpu.parse_reading(result.stdout)


def test_load_conditions_take_medians_over_busy_samples_of_the_real_capture() -> None:
    loaded = gpu.parse_query_csv((H200 / "query-load.csv").read_text())
    idle = gpu.parse_query_csv((H200 / "query-idle.csv").read_text())
    c = load_conditions(loaded + idle + idle, "healthy", isolation_verified=True, counters_match=True,
                        acceptance_rate=0.95)
    # Idle samples between requests must not drag the clock median down.
    assert c.sm_clock_mhz_p50 == pytest.approx(loaded[0].sm_clock_mhz)
    assert c.power_w_p50 == pytest.approx(loaded[0].power_draw_w)
    assert c.samples == len(loaded) + 2 * len(idle)


def test_a_wedged_bench_is_void_and_never_the_baseline() -> None:
    wedged = [gb10("wedged", True)] * 5
    verdict = gpu.judge_under_load(wedged)
    assert verdict.state == "wedged"
    cond = load_conditions(wedged, verdict.state, isolation_verified=True, counters_match=True, acceptance_rate=0.95)
    assert cond.sm_clock_mhz_p50 is not None and cond.sm_clock_mhz_p50 < 1000
    slow = record("spark2", 200.0, 31.0, IMG_A, cond)
    assert slow.void and "wedge" in slow.void[0]
    good = record("spark1", 100.0, 51.5, IMG_A, CLEAN)
    base = fleet_baseline([good, slow])
    assert base is not None and base.nodes == ("spark1",) and base.tok_s == 51.5
    # The node's own history (the health sweep's `regressed` rule) leaves it out too.
    assert history([slow], "spark2").tok_s == ()
    assert history([slow], "spark2").latest_gpu_state == "wedged"


@pytest.mark.parametrize(("change", "word"), [
    ({"isolation_verified": False}, "isolation"),
    ({"counters_match": False}, "foreign requests"),
])
def test_contaminated_benches_are_void(change: dict, word: str) -> None:
    cond = LoadConditions(**{**CLEAN.__dict__, **change})
    assert any(word in r for r in void_reasons(cond))
    assert void_reasons(CLEAN) == ()
    # Unreadable counters are not evidence of foreign requests.
    assert void_reasons(LoadConditions(**{**CLEAN.__dict__, "counters_match": None})) == ()


def test_baseline_compares_like_with_like_and_takes_each_nodes_latest() -> None:
    recs = [
        record("spark1", 1.0, 50.0, IMG_A, CLEAN),
        record("spark1", 5.0, 52.0, IMG_A, CLEAN),  # newer on the same image: replaces the first
        record("spark2", 2.0, 49.0, IMG_A, CLEAN),
        record("spark3", 3.0, 60.0, IMG_B, CLEAN),  # another image: not comparable with IMG_A
    ]
    a = fleet_baseline(recs, IMG_A)
    assert a is not None
    assert a.nodes == ("spark1", "spark2") and a.tok_s == pytest.approx(50.5) and (a.low, a.high) == (49.0, 52.0)
    assert "49.0-52.0" in a.text() and "95.0%" in a.text()
    # Default identity: the newest valid bench's (spark1 at t=5, IMG_A).
    assert fleet_baseline(recs).nodes == ("spark1", "spark2")
    b = fleet_baseline(recs, IMG_B)
    assert b is not None and b.nodes == ("spark3",)
    assert fleet_baseline([record("spark1", 1.0, None, IMG_A, CLEAN)]) is None
    assert IMG_A.differences(IMG_B) and "image id" in IMG_A.differences(IMG_B)[0]
    assert IMG_A.differences(BenchIdentity()) == []  # unknown is not a difference


def test_records_round_trip_and_old_records_read_as_unknown() -> None:
    r = record("spark1", 10.0, 51.2, IMG_A, CLEAN)
    assert BenchRecord.from_dict(r.to_dict()) == r
    old = BenchRecord.from_dict({"node": "spark1", "at": 3, "tok_s": 40, "retired_field": 1})
    assert old.identity == BenchIdentity() and old.conditions.gpu_state == "unknown"
    assert old.valid  # an old record without conditions is shown, and counts only by its own void list


def test_acceptance_floor() -> None:
    assert acceptance_gate(0.95, None)[0]
    assert acceptance_gate(0.95, 0.8) == (True, "MTP acceptance 95.0% >= floor 80%")
    ok, why = acceptance_gate(0.42, 0.8)
    assert not ok and "mtp_keys_mapped" in why
    ok, why = acceptance_gate(None, 0.8)
    assert not ok and "--speculative-config" in why


def test_identity_comes_from_the_container_its_labels_and_the_driver_nvidia_smi_reports() -> None:
    readings = gpu.parse_q((H200 / "nvidia-smi-q-perf-load.txt").read_text())
    assert readings[0].driver_version == "580.159.04"  # the real capture's "Driver Version" header
    labels = {"spec": "spec-1", "ckpt": "ckpt-1"}
    ident = identity_of({"Image": IMG_A.image_id}, labels, readings, launch_label="spec", checkpoint_label="ckpt")
    assert ident == BenchIdentity(IMG_A.image_id, "ckpt-1", "spec-1", "580.159.04")
    # An unlabelled container (deployed before the labels) is unknown, not a guess.
    assert identity_of(None, {}, [], launch_label="spec", checkpoint_label="ckpt") == BenchIdentity()


def test_side_by_side_marks_void_not_comparable_and_missing_benches() -> None:
    a1 = record("spark1", 1.0, 50.0, IMG_A, CLEAN)
    a2 = record("spark2", 2.0, 55.0, IMG_A, CLEAN)
    wedged = record("spark3", 3.0, 20.0, IMG_A, LoadConditions(**{**CLEAN.__dict__, "gpu_state": "wedged"}))
    other = record("spark4", 4.0, 60.0, IMG_B, CLEAN)
    base = fleet_baseline([a1, a2, wedged, other], identity=IMG_A)
    assert base is not None and base.tok_s == 52.5 and base.nodes == ("spark1", "spark2")
    rows = {r["node"]: r for r in side_by_side({"spark1": a1, "spark2": a2, "spark3": wedged, "spark4": other,
                                                "spark5": None}, base)}
    assert rows["spark1"]["counts"] == "yes" and rows["spark1"]["vs baseline (x)"] == round(50 / 52.5, 3)
    assert rows["spark3"]["counts"].startswith("void: the GPU showed the PD-firmware wedge")
    assert rows["spark3"]["vs baseline (x)"] == pytest.approx(20 / 52.5, abs=1e-3)
    assert rows["spark4"]["counts"].startswith("not comparable: image id")
    assert rows["spark4"]["vs baseline (x)"] is None
    assert rows["spark5"] == {"node": "spark5", "counts": "no bench recorded"}
    assert side_by_side({"spark1": a1}, None)[0]["counts"] == "yes (no baseline yet)"
