"""nvidia-smi output -> GpuReading -> healthy | idle | wedged | unknown.

Pure parsing and judgement, no process calls: the caller runs nvidia-smi (on a
node, over SSH, or the simulated stand-in) and hands the text here.

Two input shapes are understood:
- ``nvidia-smi --query-gpu=F1,F2,... --format=csv[,nounits]`` *with* its header
  line (the header names the fields, so no field order is assumed);
- ``nvidia-smi -q`` text, full or narrowed with ``-d PERFORMANCE,CLOCK,POWER``.

A GB10 answers "[N/A]" / "Not Supported" for memory (unified memory), so every
field of a reading is optional and a missing field is ``None``, never 0.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

# --- thresholds of the PD-firmware wedge (runbook "Known Firmware Issues") ---
# "nvidia-smi shows 90%+ GPU utilization under sustained load"
WEDGE_MIN_UTILIZATION_PCT = 90.0
# "SM clock pinned at 611 MHz or 708 MHz under load (vs. expected 2400-2600 MHz)"; the performance
# table also saw 702 MHz, so not those values but the cold-drain check's "<1000 MHz" decides.
WEDGE_CLOCK_CEILING_MHZ = 1000.0
# "Power draw <15W under sustained load (vs. expected 35-45W)"
WEDGE_POWER_CEILING_W = 15.0
# "SW Power Capping counter near zero on the wedged node (vs. spark1's hundreds of
# millions of µs)". One second of capping is far below any healthy node that has
# seen load (the H200 capture gained 5.3 s in ~12 s of load) and far above zero.
SW_POWER_CAP_NEAR_ZERO_US = 1_000_000
# Below this a GPU is doing nothing useful; "idle" in the verdict.
IDLE_MAX_UTILIZATION_PCT = 10.0

# Canonical names of NVML clock event reasons, as --query-gpu spells them, with the
# bit of each in clocks_event_reasons.active (nvml.h nvmlClocksEventReason*).
REASON_BITS: dict[str, int] = {
    "gpu_idle": 0x001,
    "applications_clocks_setting": 0x002,
    "sw_power_cap": 0x004,
    "hw_slowdown": 0x008,
    "sync_boost": 0x010,
    "sw_thermal_slowdown": 0x020,
    "hw_thermal_slowdown": 0x040,
    "hw_power_brake_slowdown": 0x080,
    "display_clock_setting": 0x100,
}
# The labels `nvidia-smi -q` prints under "Clocks Event Reasons".
_Q_REASON_LABELS: dict[str, str] = {
    "Idle": "gpu_idle",
    "Applications Clocks Setting": "applications_clocks_setting",
    "SW Power Cap": "sw_power_cap",
    "HW Slowdown": "hw_slowdown",
    "HW Thermal Slowdown": "hw_thermal_slowdown",
    "HW Power Brake Slowdown": "hw_power_brake_slowdown",
    "Sync Boost": "sync_boost",
    "SW Thermal Slowdown": "sw_thermal_slowdown",
    "Display Clock Setting": "display_clock_setting",
}
# Older drivers said "throttle" where 580 says "event".
_Q_REASON_SECTIONS = ("Clocks Event Reasons", "Clocks Throttle Reasons")
_Q_COUNTER_SECTIONS = ("Clocks Event Reasons Counters", "Clocks Throttle Reasons Counters")

# What nvidia-smi prints when it has no value for a field.
_ABSENT = {
    "n/a",
    "[n/a]",
    "not supported",
    "[not supported]",
    "not found",
    "unknown error",
    "[unknown error]",
    "",
}


class GpuFormatError(ValueError):
    """The text is not nvidia-smi output this module understands."""


class GpuReading(BaseModel):
    """One GPU as nvidia-smi reported it. ``None`` = not reported / not supported."""

    model_config = ConfigDict(frozen=True)

    name: str | None = None
    utilization_pct: float | None = None
    sm_clock_mhz: float | None = None
    max_sm_clock_mhz: float | None = None
    power_draw_w: float | None = None
    memory_total_mib: float | None = None
    memory_used_mib: float | None = None
    memory_free_mib: float | None = None
    # Active clock event reasons *except* "gpu_idle": idling is not a throttle.
    # None when the output carried no reasons at all (cannot say "none active").
    throttle_reasons_active: frozenset[str] | None = None
    idle_reason_active: bool | None = None
    sw_power_cap_counter_us: int | None = None
    persistence_mode: bool | None = None
    pstate: str | None = None
    driver_version: str | None = None  # what a bench ran on (core/baseline.py)

    def combined_with(self, other: GpuReading) -> GpuReading:
        """Fill this reading's gaps from ``other`` (e.g. a CSV read + `-q -d PERFORMANCE`)."""
        mine = self.model_dump()
        theirs = other.model_dump()
        merged = {key: mine[key] if mine[key] is not None else theirs[key] for key in mine}
        return GpuReading(**merged)


GpuState = Literal["healthy", "idle", "wedged", "unknown"]


class GpuVerdict(BaseModel):
    model_config = ConfigDict(frozen=True)

    state: GpuState
    reasons: list[str]


# ----------------------------------------------------------------- value parsing


def _absent(raw: str) -> bool:
    return raw.strip().lower() in _ABSENT


def _number(raw: str, field: str) -> float | None:
    """'405 MHz' / '122.25 W' / '0 %' / '405' -> float; N/A forms -> None."""
    if _absent(raw):
        return None
    match = re.match(r"\s*([-+]?\d+(?:\.\d+)?)", raw)
    if match is None:
        raise GpuFormatError(f"field {field!r}: expected a number, got {raw.strip()!r}")
    return float(match.group(1))


def _enabled(raw: str) -> bool | None:
    value = raw.strip().lower()
    if value in ("enabled", "on", "1", "yes"):
        return True
    if value in ("disabled", "off", "0", "no"):
        return False
    return None


def _active(raw: str) -> bool | None:
    value = raw.strip().lower()
    if value == "active":
        return True
    if value == "not active":
        return False
    return None


def _reasons_from_mask(raw: str, field: str) -> set[str] | None:
    if _absent(raw):
        return None
    try:
        mask = int(raw.strip(), 16)
    except ValueError as exc:
        raise GpuFormatError(f"field {field!r}: expected a hex bitmask, got {raw.strip()!r}") from exc
    return {name for name, bit in REASON_BITS.items() if mask & bit}


# ------------------------------------------------------------------- CSV parsing


def _csv_cells(line: str) -> list[str]:
    # nvidia-smi separates with ", " and never quotes; GPU names hold no commas.
    return [cell.strip() for cell in line.split(",")]


def _field_name(header_cell: str) -> str:
    """'utilization.gpu [%]' -> 'utilization.gpu'."""
    return re.sub(r"\s*\[[^\]]*\]\s*$", "", header_cell.strip())


def _reading_from_row(row: dict[str, str]) -> GpuReading:
    def get(*names: str) -> str | None:
        for name in names:
            if name in row:
                return row[name]
        return None

    values: dict[str, object] = {}
    if (raw := get("name", "gpu_name")) is not None:
        values["name"] = None if _absent(raw) else raw.strip()
    numeric = {
        "utilization_pct": ("utilization.gpu",),
        "sm_clock_mhz": ("clocks.current.sm", "clocks.sm"),
        "max_sm_clock_mhz": ("clocks.max.sm", "clocks.max.sm_clock"),
        "power_draw_w": ("power.draw", "power.draw.average", "power.draw.instant"),
        "memory_total_mib": ("memory.total",),
        "memory_used_mib": ("memory.used",),
        "memory_free_mib": ("memory.free",),
    }
    for attr, names in numeric.items():
        for name in names:
            if name in row:
                values[attr] = _number(row[name], name)
                break
    for counter in (
        "clocks_event_reasons_counters.sw_power_cap",
        "clocks_throttle_reasons_counters.sw_power_cap",
    ):
        if counter in row:
            number = _number(row[counter], counter)
            values["sw_power_cap_counter_us"] = None if number is None else int(number)
    if (raw := get("persistence_mode")) is not None:
        values["persistence_mode"] = _enabled(raw)
    if (raw := get("pstate")) is not None:
        values["pstate"] = None if _absent(raw) else raw.strip()
    if (raw := get("driver_version")) is not None:
        values["driver_version"] = None if _absent(raw) else raw.strip()

    reasons: set[str] | None = None
    for mask_field in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        if mask_field in row:
            decoded = _reasons_from_mask(row[mask_field], mask_field)
            if decoded is not None:
                reasons = (reasons or set()) | decoded
    for prefix in ("clocks_event_reasons.", "clocks_throttle_reasons."):
        for reason in REASON_BITS:
            field = prefix + reason
            if field in row:
                flag = _active(row[field])
                if flag is not None:
                    reasons = reasons or set()
                    if flag:
                        reasons.add(reason)
    if reasons is not None:
        values["idle_reason_active"] = "gpu_idle" in reasons
        values["throttle_reasons_active"] = frozenset(reasons - {"gpu_idle"})
    return GpuReading(**values)


def parse_query_csv(text: str, fields: Sequence[str] | None = None) -> list[GpuReading]:
    """Parse ``--query-gpu=... --format=csv[,nounits]`` output, one reading per GPU row.

    The header names the fields. For ``noheader`` output pass ``fields`` (the same
    list given to --query-gpu). Reading stops at the first line whose column count
    differs from the header, so a capture with other output appended still parses.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if fields is None:
        if not lines:
            raise GpuFormatError("empty nvidia-smi CSV output: expected a header line")
        names = [_field_name(cell) for cell in _csv_cells(lines[0])]
        body = lines[1:]
    else:
        names = [name.strip() for name in fields]
        body = lines
    if not any("." in name or name in ("name", "pstate", "timestamp") for name in names):
        raise GpuFormatError(
            f"first line {lines[0][:80]!r} is not a --query-gpu CSV header; "
            "run with --format=csv (not noheader) or pass fields="
        )
    readings: list[GpuReading] = []
    for line in body:
        cells = _csv_cells(line)
        if len(cells) != len(names):
            break
        readings.append(_reading_from_row(dict(zip(names, cells, strict=True))))
    if not readings:
        raise GpuFormatError("nvidia-smi CSV output has a header but no GPU rows")
    return readings


# ------------------------------------------------------------- `-q` text parsing

_Q_VALUE_LINE = re.compile(r"^(?P<prefix>(?P<indent> *)(?P<key>\S.*?)\s+:)(?: (?P<value>.*))?$")
_Q_HEADER_LINE = re.compile(r"^(?P<indent> *)(?P<key>\S.*?)\s*$")
_Q_GPU_HEADER = re.compile(r"^GPU [0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-9A-Fa-f]$")


@dataclass(frozen=True)
class QLine:
    """One line of `nvidia-smi -q` text with its place in the key tree."""

    text: str
    gpu: int  # index of the "GPU <bus id>" block it is in; -1 in the preamble
    path: tuple[str, ...] | None = None  # key path, relative to the GPU block; None: not a key line
    prefix: str | None = None  # "<indent><key> <padding>:" of a value line; None for a section header
    value: str | None = None  # what follows "<prefix> ", stripped; None when nothing does


def q_lines(lines: Iterable[str]) -> Iterator[QLine]:
    """Walk `nvidia-smi -q` text by indentation: the one parser of its layout (this module reads
    values through `q_tree`; the simulator's stand-in rewrites values of a real capture)."""
    gpu = -1
    stack: list[tuple[int, str]] = []
    for line in lines:
        if not line.strip() or line.startswith("="):
            yield QLine(line, gpu)
            continue
        if _Q_GPU_HEADER.match(line.strip()) and not line.startswith(" "):
            gpu += 1
            stack = []
            yield QLine(line, gpu)
            continue
        if gpu >= 0 and not line.startswith(" "):
            yield QLine(line, gpu)  # not part of a GPU block's tree
            continue
        match = _Q_VALUE_LINE.match(line) or _Q_HEADER_LINE.match(line)
        if match is None:
            yield QLine(line, gpu)
            continue
        indent = len(match.group("indent"))
        key = match.group("key").strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = tuple(name for _, name in stack) + (key,)
        stack.append((indent, key))
        if match.re is _Q_VALUE_LINE:
            value = match.group("value")
            yield QLine(line, gpu, path, match.group("prefix"), None if value is None else value.strip())
        else:
            yield QLine(line, gpu, path)


def q_tree(text: str) -> list[dict[tuple[str, ...], str]]:
    """`nvidia-smi -q` text -> one {key path: value} dict per "GPU <bus id>" block.

    Paths are relative to the GPU block, e.g. ("Clocks", "SM") or
    ("Clocks Event Reasons", "HW Slowdown", "HW Thermal Slowdown").
    """
    gpus: list[dict[tuple[str, ...], str]] = []
    for q in q_lines(text.splitlines()):
        while len(gpus) <= q.gpu:
            gpus.append({})
        if q.gpu >= 0 and q.path is not None and q.value is not None:
            gpus[q.gpu][q.path] = q.value
    return gpus


def _reading_from_q(tree: dict[tuple[str, ...], str]) -> GpuReading:
    def first(*paths: tuple[str, ...]) -> str | None:
        for path in paths:
            if path in tree:
                return tree[path]
        return None

    def num(field: str, *paths: tuple[str, ...]) -> float | None:
        raw = first(*paths)
        return None if raw is None else _number(raw, field)

    values: dict[str, object] = {
        "utilization_pct": num("Utilization/GPU", ("Utilization", "GPU")),
        "sm_clock_mhz": num("Clocks/SM", ("Clocks", "SM")),
        "max_sm_clock_mhz": num("Max Clocks/SM", ("Max Clocks", "SM")),
        "power_draw_w": num(
            "Power Draw",
            ("GPU Power Readings", "Average Power Draw"),
            ("GPU Power Readings", "Power Draw"),
            ("GPU Power Readings", "Instantaneous Power Draw"),
            ("Power Readings", "Power Draw"),
        ),
        "memory_total_mib": num("FB Memory Usage/Total", ("FB Memory Usage", "Total")),
        "memory_used_mib": num("FB Memory Usage/Used", ("FB Memory Usage", "Used")),
        "memory_free_mib": num("FB Memory Usage/Free", ("FB Memory Usage", "Free")),
    }
    if (raw := first(("Product Name",))) is not None:
        values["name"] = None if _absent(raw) else raw
    if (raw := first(("Persistence Mode",))) is not None:
        values["persistence_mode"] = _enabled(raw)
    if (raw := first(("Performance State",))) is not None:
        values["pstate"] = None if _absent(raw) else raw
    counter = num(
        "SW Power Capping",
        *((section, "SW Power Capping") for section in _Q_COUNTER_SECTIONS),
    )
    values["sw_power_cap_counter_us"] = None if counter is None else int(counter)

    reasons: set[str] | None = None
    for path, raw in tree.items():
        if path[0] in _Q_REASON_SECTIONS and path[-1] in _Q_REASON_LABELS:
            flag = _active(raw)
            if flag is None:
                continue
            reasons = reasons or set()
            if flag:
                reasons.add(_Q_REASON_LABELS[path[-1]])
    if reasons is not None:
        values["idle_reason_active"] = "gpu_idle" in reasons
        values["throttle_reasons_active"] = frozenset(reasons - {"gpu_idle"})
    return GpuReading(**values)


_Q_DRIVER = re.compile(r"^Driver Version\s*:\s*(\S.*)$")


def parse_q(text: str) -> list[GpuReading]:
    """Parse ``nvidia-smi -q`` (optionally ``-d PERFORMANCE,CLOCK,POWER``) text."""
    trees = q_tree(text)
    if not trees:
        raise GpuFormatError(
            "no 'GPU <bus id>' block found: not `nvidia-smi -q` output "
            "(or the GPU is not visible to nvidia-smi)"
        )
    # "Driver Version" heads the report, before any GPU block: it holds for every GPU.
    driver = next((m.group(1).strip() for m in map(_Q_DRIVER.match, text.splitlines()) if m), None)
    return [_reading_from_q(tree).model_copy(update={"driver_version": None if _absent(driver or "N/A") else driver})
            for tree in trees]


def parse_reading(text: str) -> GpuReading:
    """Auto-detect CSV (with header) or `-q` text; exactly one GPU expected (a GB10 has one)."""
    readings = parse_q(text) if "NVSMI LOG" in text or _has_gpu_block(text) else parse_query_csv(text)
    if len(readings) != 1:
        raise GpuFormatError(f"expected exactly one GPU in the output, found {len(readings)}")
    return readings[0]


def _has_gpu_block(text: str) -> bool:
    return any(_Q_GPU_HEADER.match(line) for line in text.splitlines())


def combine(readings: Iterable[GpuReading]) -> GpuReading:
    """Merge readings of the same GPU taken with different commands."""
    merged = GpuReading()
    for reading in readings:
        merged = merged.combined_with(reading)
    return merged


# ---------------------------------------------------------------- classification


def _wedge_symptoms(reading: GpuReading) -> dict[str, bool | None]:
    """Each wedge symptom: True present, False absent, None not reported."""
    clock = reading.sm_clock_mhz
    power = reading.power_draw_w
    reasons = reading.throttle_reasons_active
    counter = reading.sw_power_cap_counter_us
    util = reading.utilization_pct
    return {
        "utilization >= 90%": None if util is None else util >= WEDGE_MIN_UTILIZATION_PCT,
        "SM clock pinned < 1000 MHz": None if clock is None else clock < WEDGE_CLOCK_CEILING_MHZ,
        "power < 15 W": None if power is None else power < WEDGE_POWER_CEILING_W,
        "no throttle reasons active": None if reasons is None else not reasons,
        "SW power capping counter near zero": None
        if counter is None
        else counter < SW_POWER_CAP_NEAR_ZERO_US,
    }


def _describe(reading: GpuReading) -> str:
    parts = []
    if reading.utilization_pct is not None:
        parts.append(f"util {reading.utilization_pct:g}%")
    if reading.sm_clock_mhz is not None:
        parts.append(f"SM {reading.sm_clock_mhz:g} MHz")
    if reading.power_draw_w is not None:
        parts.append(f"{reading.power_draw_w:g} W")
    if reading.throttle_reasons_active is not None:
        parts.append("reasons " + (",".join(sorted(reading.throttle_reasons_active)) or "none"))
    if reading.sw_power_cap_counter_us is not None:
        parts.append(f"SW power cap counter {reading.sw_power_cap_counter_us} us")
    return ", ".join(parts) or "no fields"


def classify(reading: GpuReading, under_load: bool) -> GpuVerdict:
    """Judge one reading.

    ``under_load`` says the caller is driving sustained inference load right now;
    the PD-firmware wedge is only visible then, and only when EVERY symptom of the
    runbook's signature is present ("no single symptom is diagnostic alone").
    """
    seen = _describe(reading)
    util = reading.utilization_pct
    if util is None:
        return GpuVerdict(state="unknown", reasons=[f"utilization not reported ({seen})"])

    symptoms = _wedge_symptoms(reading)
    present = [name for name, flag in symptoms.items() if flag is True]
    absent = [name for name, flag in symptoms.items() if flag is False]
    missing = [name for name, flag in symptoms.items() if flag is None]

    if not under_load:
        if util < IDLE_MAX_UTILIZATION_PCT:
            return GpuVerdict(state="idle", reasons=[f"no load requested and GPU idle ({seen})"])
        reasons = [f"busy without requested load ({seen})"]
        if not absent and not missing:
            reasons.append("all wedge symptoms present: confirm under sustained load")
        return GpuVerdict(state="healthy", reasons=reasons)

    if util < IDLE_MAX_UTILIZATION_PCT:
        return GpuVerdict(
            state="idle",
            reasons=[f"load requested but the GPU is idle: load is not reaching it ({seen})"],
        )
    if not absent and not missing:
        return GpuVerdict(
            state="wedged",
            reasons=[
                f"PD firmware wedge signature complete ({seen})",
                "capture evidence, then AC cold drain (unplug at the wall 90-120 s)",
            ],
        )
    if not absent:
        return GpuVerdict(
            state="unknown",
            reasons=[
                f"wedge cannot be ruled out: {', '.join(missing)} not reported ({seen})",
                "read `nvidia-smi -q -d PERFORMANCE,CLOCK,POWER` together with --query-gpu",
            ],
        )
    reasons = [f"under load ({seen})"]
    if present and symptoms["SM clock pinned < 1000 MHz"]:
        # A low clock with a reason set (thermal, HW slowdown, ...) is a real
        # throttle, which the runbook separates from the silent firmware wedge.
        reasons.append(f"low clock but not the wedge: {', '.join(absent)} does not hold")
    return GpuVerdict(state="healthy", reasons=reasons)


def judge_under_load(readings: Sequence[GpuReading]) -> GpuVerdict:
    """Judge the samples taken while a bench drove load (runbook: "Run nvidia-smi ... during
    load -- if <1000 MHz, cold-drain is required").

    Idle samples (between requests) are set aside. A wedge is pinned, not intermittent, so it
    is reported only when at least half the loaded samples show the whole signature and none
    is healthy at full clock; one healthy loaded sample rules it out.
    """
    verdicts = [classify(r, under_load=True) for r in readings]
    loaded = [v for v in verdicts if v.state != "idle"]
    if not loaded:
        return GpuVerdict(
            state="unknown",
            reasons=[f"none of {len(readings)} sample(s) caught the GPU under load"],
        )
    wedged = [v for v in loaded if v.state == "wedged"]
    healthy = [v for v in loaded if v.state == "healthy"]
    summary = f"{len(wedged)} wedged, {len(healthy)} healthy of {len(loaded)} loaded sample(s)"
    if wedged and not healthy and 2 * len(wedged) >= len(loaded):
        return GpuVerdict(state="wedged", reasons=[summary, *wedged[0].reasons])
    if healthy:
        return GpuVerdict(state="healthy", reasons=[summary, *healthy[-1].reasons])
    return GpuVerdict(state="unknown", reasons=[summary, *loaded[0].reasons])
