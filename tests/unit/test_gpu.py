"""nvidia-smi parsing and the wedge verdict, on the real H200 captures and GB10 shapes."""

from pathlib import Path

import pytest

from spark_pipelines.core.gpu import (
    GpuFormatError,
    GpuReading,
    classify,
    combine,
    judge_under_load,
    parse_q,
    parse_query_csv,
    parse_reading,
)

H200 = Path("/work/shared/fixtures/nvidia-smi/h200")


def h200(name: str) -> str:
    return (H200 / name).read_text()


def test_csv_with_units_and_nounits_rows() -> None:
    rows = parse_query_csv(h200("query-idle.csv"))
    assert len(rows) == 2
    units, nounits = rows
    assert units.name == "NVIDIA H200" and units.utilization_pct == 0
    assert units.sm_clock_mhz == 405 and units.max_sm_clock_mhz == 1980
    assert units.power_draw_w == 122.25 and nounits.power_draw_w == 121.40
    assert units.memory_total_mib == 143771 and units.memory_free_mib == 143156
    assert units.throttle_reasons_active == frozenset() and units.idle_reason_active is True
    assert units.pstate == "P0"


def test_csv_under_load_decodes_sw_power_cap_and_stops_at_appended_output() -> None:
    (row,) = parse_query_csv(h200("query-load.csv"))  # the capture has compute-apps output appended
    assert row.utilization_pct == 100 and row.sm_clock_mhz == 1515
    assert row.throttle_reasons_active == frozenset({"sw_power_cap"})


def test_q_full_and_performance_views() -> None:
    (full,) = parse_q(h200("nvidia-smi-q.txt"))
    assert full.name == "NVIDIA H200" and full.persistence_mode is True
    assert full.utilization_pct == 0 and full.memory_total_mib == 143771
    (perf,) = parse_q(h200("nvidia-smi-q-perf-load.txt"))
    assert perf.sw_power_cap_counter_us == 5_268_785
    assert perf.throttle_reasons_active == frozenset({"sw_power_cap"})
    assert perf.power_draw_w == 693.00 and perf.sm_clock_mhz == 1515
    assert perf.utilization_pct is None  # -d PERFORMANCE,CLOCK,POWER has no utilization


def test_real_h200_idle_and_load_verdicts() -> None:
    load = combine([parse_query_csv(h200("query-load.csv"))[0], parse_q(h200("nvidia-smi-q-perf-load.txt"))[0]])
    assert classify(load, under_load=True).state == "healthy"
    idle = combine([parse_query_csv(h200("query-idle.csv"))[0], parse_q(h200("nvidia-smi-q-perf-idle.txt"))[0]])
    assert classify(idle, under_load=False).state == "idle"
    assert classify(idle, under_load=True).state == "idle"  # load requested but not reaching it


def test_perf_view_alone_is_unknown() -> None:
    (perf,) = parse_q(h200("nvidia-smi-q-perf-load.txt"))
    verdict = classify(perf, under_load=True)
    assert verdict.state == "unknown" and "utilization" in verdict.reasons[0]


GB10_HEADER = (
    "name, utilization.gpu [%], clocks.current.sm [MHz], clocks.max.sm [MHz], power.draw [W], "
    "memory.total [MiB], memory.used [MiB], memory.free [MiB], clocks_event_reasons.active, "
    "clocks_event_reasons_counters.sw_power_cap [us], pstate, persistence_mode"
)


def gb10(util: str, clock: str, power: str, mask: str, counter: str) -> GpuReading:
    row = f"NVIDIA GB10, {util} %, {clock} MHz, 3003 MHz, {power} W, [N/A], [N/A], [N/A], {mask}, {counter} us, P0, Enabled"
    return parse_reading(GB10_HEADER + "\n" + row + "\n")


HEALTHY = dict(util="96", clock="2450", power="40.30", mask="0x0000000000000004", counter="1170000000")
WEDGED = dict(util="97", clock="708", power="10.20", mask="0x0000000000000000", counter="1204")


def test_gb10_memory_is_none_not_zero() -> None:
    reading = gb10(**HEALTHY)
    assert reading.memory_total_mib is None and reading.memory_free_mib is None
    assert reading.persistence_mode is True and reading.max_sm_clock_mhz == 3003


def test_gb10_full_wedge_signature() -> None:
    verdict = classify(gb10(**WEDGED), under_load=True)
    assert verdict.state == "wedged"
    assert any("cold drain" in reason for reason in verdict.reasons)
    for pinned in ("611", "708", "702"):
        assert classify(gb10(**{**WEDGED, "clock": pinned}), under_load=True).state == "wedged"


def test_wedge_is_invisible_without_load() -> None:
    assert classify(gb10(**{**WEDGED, "util": "0"}), under_load=False).state == "idle"


@pytest.mark.parametrize("symptom", ["util", "clock", "power", "mask", "counter"])
def test_a_single_symptom_alone_is_not_wedged(symptom: str) -> None:
    reading = gb10(**{**HEALTHY, symptom: WEDGED[symptom]})
    assert classify(reading, under_load=True).state != "wedged"


@pytest.mark.parametrize("symptom", ["util", "clock", "power", "mask", "counter"])
def test_all_but_one_symptom_is_not_wedged(symptom: str) -> None:
    healthy_value = {**HEALTHY, "util": "60"}[symptom]  # 60% is below the 90% bar
    reading = gb10(**{**WEDGED, symptom: healthy_value})
    assert classify(reading, under_load=True).state != "wedged"


def test_real_throttle_is_told_apart_from_the_wedge() -> None:
    # HW slowdown (0x8) at a low clock: a throttle with a reason, not the silent wedge.
    verdict = classify(gb10(**{**WEDGED, "mask": "0x0000000000000008"}), under_load=True)
    assert verdict.state == "healthy"
    assert any("not the wedge" in reason for reason in verdict.reasons)


def test_missing_counter_under_load_is_unknown_not_wedged() -> None:
    header = "name, utilization.gpu [%], clocks.current.sm [MHz], power.draw [W], clocks_event_reasons.active"
    reading = parse_reading(header + "\nNVIDIA GB10, 97 %, 611 MHz, 9.8 W, 0x0000000000000000\n")
    verdict = classify(reading, under_load=True)
    assert verdict.state == "unknown"
    assert "SW power capping counter" in verdict.reasons[0]


def test_noheader_csv_needs_fields() -> None:
    (reading,) = parse_query_csv("611, 97\n", fields=["clocks.current.sm", "utilization.gpu"])
    assert reading.sm_clock_mhz == 611 and reading.utilization_pct == 97
    with pytest.raises(GpuFormatError, match="header"):
        parse_query_csv("611, 97\n")


def test_bad_values_name_the_field() -> None:
    with pytest.raises(GpuFormatError, match="clocks.current.sm"):
        parse_query_csv("clocks.current.sm [MHz]\nfast MHz\n")
    with pytest.raises(GpuFormatError, match="GPU <bus id>"):
        parse_q("hello\n")
    with pytest.raises(GpuFormatError, match="no GPU rows"):
        parse_query_csv("name, pstate\n")


IDLE_BETWEEN_REQUESTS = dict(util="0", clock="1200", power="4.1", mask="0x0000000000000001", counter="1170000000")


def test_samples_under_load_report_a_pinned_wedge() -> None:
    samples = [gb10(**IDLE_BETWEEN_REQUESTS), gb10(**WEDGED), gb10(**{**WEDGED, "clock": "702"})]
    verdict = judge_under_load(samples)
    assert verdict.state == "wedged"
    assert verdict.reasons[0].startswith("2 wedged, 0 healthy of 2 loaded")
    assert any("cold drain" in reason for reason in verdict.reasons)


def test_one_healthy_loaded_sample_rules_the_wedge_out() -> None:
    verdict = judge_under_load([gb10(**WEDGED), gb10(**HEALTHY), gb10(**WEDGED)])
    assert verdict.state == "healthy"


def test_samples_that_never_caught_load_say_so() -> None:
    verdict = judge_under_load([gb10(**IDLE_BETWEEN_REQUESTS)] * 3)
    assert verdict.state == "unknown" and "none of 3" in verdict.reasons[0]
    assert judge_under_load([]).state == "unknown"


def test_real_h200_load_capture_is_healthy_over_samples() -> None:
    loaded = combine([parse_query_csv(h200("query-load.csv"))[0], parse_q(h200("nvidia-smi-q-perf-load.txt"))[0]])
    idle = combine([parse_query_csv(h200("query-idle.csv"))[0], parse_q(h200("nvidia-smi-q-perf-idle.txt"))[0]])
    assert judge_under_load([idle, loaded, loaded]).state == "healthy"
