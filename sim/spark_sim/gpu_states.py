"""What a GB10's `nvidia-smi` prints in each simulated node state.

The texts are built by transforming the REAL captures of a H200 in
``captures/h200/`` (copied from the shared fixtures), changing only what a GB10
prints differently: its name, bus id, "[N/A]"/"Not Supported" memory (unified
memory), unreadable power limits and memory clocks, and the clock / power /
throttle figures of the state.

States: healthy, idle, wedged (ASUS GX10 PD-firmware wedge), residue (crash-loop
CUDA context residue) and low-memory. The last two look healthy to nvidia-smi -
a GB10 reports no memory - and differ only in ``free_gib``, which the vLLM
stand-in reads the way vLLM's own startup check does.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from spark_pipelines.core.gpu import REASON_BITS, q_lines  # the NVML bit table and the -q parser, kept in one place

State = Literal["healthy", "idle", "wedged", "residue", "low-memory"]
Profile = Literal["founders", "gx10"]
STATES: tuple[State, ...] = ("healthy", "idle", "wedged", "residue", "low-memory")
PROFILES: tuple[Profile, ...] = ("founders", "gx10")

CAPTURES = Path(__file__).parent / "captures" / "h200"
H200_BUS_ID = "00000000:00:06.0"
GB10_BUS_ID = "0000000F:01:00.0"  # what every public GB10 `nvidia-smi` capture shows
GB10_NAME = "NVIDIA GB10"

# --- memory, as vLLM / torch.cuda.mem_get_info() sees it (nvidia-smi cannot) ---
# Runbook "GB10 memory reality (2026-06-18)": "Total CUDA-visible: 121.69 GiB".
TOTAL_CUDA_GIB = 121.69
# Clean-boot free memory per profile. Founders: "0.90 FAILS on both nodes (107.82 GiB
# free < 109.52 needed)" and "spark1's ~107 GiB clean baseline" - passes 0.85
# (103.44 GiB), fails 0.90. GX10: "ValueError: Free memory (106.0 GiB) < desired
# (109.46 GiB). Use 0.85 GMU on spark2."
CLEAN_FREE_GIB: dict[Profile, float] = {"founders": 107.82, "gx10": 106.0}
# Residue: "Each failed launch leaves 1-9 GiB residue" and the troubleshooting row
# "If free GPU memory is still < 97 GiB after restart, reboot the node": a node in
# this state fails 0.85 and sits just under the reboot threshold.
RESIDUE_FREE_GIB = 96.5
# Low memory: lesson 11, "after 2-3 crash-loop cycles ... eventually nothing fits";
# well below even the 0.80 figure (97.35 GiB), so no GMU value rescues it.
LOW_MEMORY_FREE_GIB = 60.0
# The desktop (gdm3, gnome-shell) while gdm3 runs: runbook Phase 0, "With desktop services
# running, CUDA reports only ~105 GiB free ... Without desktop: ~118+ GiB free" (118 - 105).
DESKTOP_GIB = 13.0

# --- clocks and power (runbook "Known Firmware Issues") ---
# "sudo nvidia-smi -lgc 2418,3003" locks to the GB10's application and max clocks.
GB10_MAX_SM_MHZ = 3003
GB10_APP_CLOCK_MHZ = 2418
# Healthy under load: "expected 2400-2600 MHz", "expected 35-45W"; spark1 "gets
# SW-capped to ~40W" with a counter of "1.17B µs and climbing".
HEALTHY_LOAD_SM_MHZ: dict[Profile, int] = {"founders": 2450, "gx10": 2520}
HEALTHY_LOAD_POWER_W: dict[Profile, float] = {"founders": 40.3, "gx10": 42.1}
HEALTHY_SW_POWER_CAP_US: dict[Profile, int] = {"founders": 1_170_000_000, "gx10": 640_000_000}
# Wedged: "SM clock pinned at 611 MHz or 708 MHz", "<15W", "NO throttle reasons
# active", "SW Power Capping counter near zero".
WEDGED_SM_MHZ: dict[Profile, int] = {"founders": 611, "gx10": 708}
WEDGED_LOAD_POWER_W = 10.2
WEDGED_SW_POWER_CAP_US = 1_204
# Idle: public GB10 captures show P8 at ~4 W with 0% utilization.
IDLE_POWER_W = 4.1
IDLE_SM_MHZ = 2405
LOAD_UTILIZATION_PCT = 96
DRIVER_VERSION = "580.159.04"  # the version in the real capture this is built from


def free_gib(state: State, profile: Profile) -> float:
    """Free CUDA memory (GiB) that vLLM's startup check would see on this node."""
    _check(state, profile)
    if state == "residue":
        return RESIDUE_FREE_GIB
    if state == "low-memory":
        return LOW_MEMORY_FREE_GIB
    return CLEAN_FREE_GIB[profile]


def _check(state: str, profile: str) -> None:
    if state not in STATES:
        raise ValueError(f"unknown GPU state {state!r}; expected one of {', '.join(STATES)}")
    if profile not in PROFILES:
        raise ValueError(f"unknown node profile {profile!r}; expected one of {', '.join(PROFILES)}")


class SimGpu(BaseModel):
    """The stand-in's persisted state (the JSON file named by SIM_GPU_STATE_FILE)."""

    model_config = ConfigDict(extra="forbid")

    state: State
    profile: Profile
    under_load: bool = False
    # The port of the engine using this GPU on the node: while it reports requests running,
    # nvidia-smi shows the GPU under load, as a real one does while vLLM decodes.
    engine_port: int | None = Field(default=None, ge=1, le=65535)
    persistence_mode: bool = True
    locked_clocks: tuple[int, int] | None = None

    @field_validator("locked_clocks")
    @classmethod
    def _ordered(cls, value: tuple[int, int] | None) -> tuple[int, int] | None:
        if value is not None and not 0 < value[0] <= value[1]:
            raise ValueError("locked_clocks must be (min, max) with 0 < min <= max")
        return value


@dataclass(frozen=True)
class GpuFace:
    """The figures nvidia-smi shows for one simulated GPU at one moment."""

    utilization_pct: int
    sm_clock_mhz: int
    power_w: float
    pstate: str
    reasons_active: frozenset[str]  # NVML reason names, incl. "gpu_idle"
    sw_power_cap_us: int
    temperature_c: int
    persistence_mode: bool


def face(sim: SimGpu) -> GpuFace:
    busy = sim.under_load and sim.state != "idle"
    if sim.state == "wedged":
        # The cap lives below nvidia-smi: -lgc "accepts ... but the runtime clock is
        # unchanged", so locked_clocks is deliberately ignored here.
        return GpuFace(
            utilization_pct=97 if busy else 0,
            sm_clock_mhz=WEDGED_SM_MHZ[sim.profile],
            power_w=WEDGED_LOAD_POWER_W if busy else IDLE_POWER_W,
            pstate="P0" if busy else "P8",
            reasons_active=frozenset() if busy else frozenset({"gpu_idle"}),
            sw_power_cap_us=WEDGED_SW_POWER_CAP_US,
            temperature_c=48 if busy else 40,
            persistence_mode=sim.persistence_mode,
        )
    if busy:
        clock = HEALTHY_LOAD_SM_MHZ[sim.profile]
        if sim.locked_clocks is not None:
            clock = min(max(clock, sim.locked_clocks[0]), sim.locked_clocks[1])
        return GpuFace(
            utilization_pct=LOAD_UTILIZATION_PCT,
            sm_clock_mhz=clock,
            power_w=HEALTHY_LOAD_POWER_W[sim.profile],
            pstate="P0",
            reasons_active=frozenset({"sw_power_cap"}),
            sw_power_cap_us=HEALTHY_SW_POWER_CAP_US[sim.profile],
            temperature_c=71,
            persistence_mode=sim.persistence_mode,
        )
    return GpuFace(
        utilization_pct=0,
        sm_clock_mhz=IDLE_SM_MHZ,
        power_w=IDLE_POWER_W,
        pstate="P8",
        reasons_active=frozenset({"gpu_idle"}),
        sw_power_cap_us=HEALTHY_SW_POWER_CAP_US[sim.profile],
        temperature_c=41,
        persistence_mode=sim.persistence_mode,
    )


@cache
def _capture(name: str) -> str:
    return (CAPTURES / name).read_text(encoding="utf-8")


# ------------------------------------------------------------------ default table


def _nvsmi_date(now: dt.datetime) -> str:
    return f"{now:%a %b} {now.day:>2} {now:%H:%M:%S %Y}"


def render_table(sim: SimGpu, now: dt.datetime) -> str:
    f = face(sim)
    lines = _capture("nvidia-smi.txt").splitlines()
    out: list[str] = []
    gpu_row = 0
    for line in lines:
        if re.match(r"^\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}", line):
            old = line.rstrip()
            line = _nvsmi_date(now) + line[len(old) :]
        elif H200_BUS_ID in line:
            gpu_row = 1
            persistence = "On" if f.persistence_mode else "Off"
            cells = line.split("|")
            left = f"   0  {GB10_NAME}"
            cells[1] = left + f"{persistence}  ".rjust(len(cells[1]) - len(left))
            cells[2] = cells[2].replace(H200_BUS_ID, GB10_BUS_ID)
            cells[3] = "N/A ".rjust(len(cells[3]))
            line = "|".join(cells)
        elif gpu_row == 1:
            gpu_row = 2
            cells = line.split("|")
            left = f" N/A   {f.temperature_c}C    {f.pstate}"
            right = f"{round(f.power_w)}W /  N/A  "
            cells[1] = left + right.rjust(len(cells[1]) - len(left))
            cells[2] = " Not Supported".ljust(len(cells[2]))
            cells[3] = f"{f.utilization_pct}%".rjust(8) + "      Default ".rjust(len(cells[3]) - 8)
            line = "|".join(cells)
        elif gpu_row == 2:
            gpu_row = 3
            cells = line.split("|")
            cells[3] = "N/A ".rjust(len(cells[3]))
            line = "|".join(cells)
        out.append(line)
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------- `-q`

# `-d` display groups -> the top-level sections of a GPU block they show.
DISPLAY_SECTIONS: dict[str, tuple[str, ...]] = {
    "PERFORMANCE": (
        "Performance State",
        "Clocks Event Reasons",
        "Clocks Event Reasons Counters",
        "Sparse Operation Mode",
    ),
    "POWER": (
        "GPU Power Readings",
        "Power Samples",
        "GPU Memory Power Readings",
        "Module Power Readings",
    ),
    "CLOCK": (
        "Clocks",
        "Applications Clocks",
        "Default Applications Clocks",
        "Deferred Clocks",
        "Max Clocks",
        "Max Customer Boost Clocks",
        "SM Clock Samples",
        "Memory Clock Samples",
        "Clock Policy",
    ),
    "MEMORY": ("FB Memory Usage", "BAR1 Memory Usage", "Conf Compute Protected Memory Usage"),
    "UTILIZATION": ("Utilization",),
    "TEMPERATURE": ("Temperature",),
}
# Sections that only the -d PERFORMANCE,CLOCK,POWER capture holds (sampling blocks).
_PERF_ONLY = {"Power Samples", "SM Clock Samples", "Memory Clock Samples"}


def _q_replacements(sim: SimGpu, now: dt.datetime) -> dict[tuple[str, ...], str]:
    f = face(sim)
    watts = f"{f.power_w:.2f} W"
    mhz = f"{f.sm_clock_mhz} MHz"
    na = "N/A"
    values: dict[tuple[str, ...], str] = {
        ("Timestamp",): f"{_nvsmi_date(now)}",
        ("Driver Version",): DRIVER_VERSION,
        ("Product Name",): GB10_NAME,
        ("Product Architecture",): "Blackwell",
        ("Persistence Mode",): "Enabled" if f.persistence_mode else "Disabled",
        ("Addressing Mode",): "ATS",
        ("VBIOS Version",): na,
        ("Board Part Number",): na,
        ("GPU Part Number",): na,
        ("Inforom Version", "Image Version"): na,
        ("PCI", "Bus"): "0x01",
        ("PCI", "Device"): "0x00",
        ("PCI", "Domain"): "0x000F",
        ("PCI", "Device Id"): "0x2E1210DE",
        ("Performance State",): f.pstate,
        ("Clocks Event Reasons Counters", "SW Power Capping"): f"{f.sw_power_cap_us} us",
        ("ECC Mode", "Current"): na,
        ("ECC Mode", "Pending"): na,
        ("Utilization", "GPU"): f"{f.utilization_pct} %",
        ("Utilization", "Memory"): na,
        ("Temperature", "GPU Current Temp"): f"{f.temperature_c} C",
        ("Temperature", "Memory Current Temp"): na,
        ("GPU Power Readings", "Average Power Draw"): watts,
        ("GPU Power Readings", "Instantaneous Power Draw"): watts,
        ("GPU Memory Power Readings", "Average Power Draw"): na,
        ("Power Samples", "Max"): f"{f.power_w * 1.08:.2f} W",
        ("Power Samples", "Min"): f"{f.power_w * 0.93:.2f} W",
        ("Power Samples", "Avg"): watts,
        ("Clocks", "Graphics"): mhz,
        ("Clocks", "SM"): mhz,
        ("Clocks", "Memory"): na,
        ("Clocks", "Video"): na,
        ("Applications Clocks", "Graphics"): f"{GB10_APP_CLOCK_MHZ} MHz",
        ("Applications Clocks", "Memory"): na,
        ("Default Applications Clocks", "Graphics"): f"{GB10_APP_CLOCK_MHZ} MHz",
        ("Default Applications Clocks", "Memory"): na,
        ("Max Clocks", "Graphics"): f"{GB10_MAX_SM_MHZ} MHz",
        ("Max Clocks", "SM"): f"{GB10_MAX_SM_MHZ} MHz",
        ("Max Clocks", "Memory"): na,
        ("Max Clocks", "Video"): na,
        ("Max Customer Boost Clocks", "Graphics"): f"{GB10_MAX_SM_MHZ} MHz",
    }
    # Unified memory: nvidia-smi has no framebuffer figures on a GB10.
    for section in ("FB Memory Usage", "BAR1 Memory Usage", "Conf Compute Protected Memory Usage"):
        for item in ("Total", "Reserved", "Used", "Free"):
            values[(section, item)] = na
    for limit in ("Current", "Requested", "Default", "Min", "Max"):
        values[("GPU Power Readings", f"{limit} Power Limit")] = na
    labels = {
        "Idle": "gpu_idle",
        "Applications Clocks Setting": "applications_clocks_setting",
        "SW Power Cap": "sw_power_cap",
        "HW Slowdown": "hw_slowdown",
        "Sync Boost": "sync_boost",
        "SW Thermal Slowdown": "sw_thermal_slowdown",
        "Display Clock Setting": "display_clock_setting",
    }
    for label, reason in labels.items():
        values[("Clocks Event Reasons", label)] = (
            "Active" if reason in f.reasons_active else "Not Active"
        )
    for nested, reason in (
        ("HW Thermal Slowdown", "hw_thermal_slowdown"),
        ("HW Power Brake Slowdown", "hw_power_brake_slowdown"),
    ):
        values[("Clocks Event Reasons", "HW Slowdown", nested)] = (
            "Active" if reason in f.reasons_active else "Not Active"
        )
    return values


def _rewrite(lines: Sequence[str], values: dict[tuple[str, ...], str]) -> list[str]:
    """Replace values by key path (relative to the GPU block), keeping nvidia-smi's layout;
    the key paths come from core's `-q` parser, the same one that reads them back."""
    out: list[str] = []
    for q in q_lines(lines):
        line = q.text
        if q.prefix is not None and q.path in values:
            line = f"{q.prefix} {values[q.path]}"
        out.append(line.replace(H200_BUS_ID, GB10_BUS_ID))
    return out


def _sections(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Split `-q` text into its preamble (up to the GPU line) and top-level GPU sections."""
    preamble: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    for q in q_lines(text.splitlines()):
        if q.gpu < 0 or (not sections and q.path is None):
            preamble.append(q.text)  # up to and including the "GPU <bus id>" line
        elif not q.text.strip():
            continue
        elif q.path is not None and len(q.path) == 1:
            sections.append((q.path[0], [q.text]))
        elif sections:
            sections[-1][1].append(q.text)
    return preamble, sections


class DisplayError(ValueError):
    pass


def render_q(sim: SimGpu, now: dt.datetime, displays: Sequence[str] | None = None) -> str:
    """`nvidia-smi -q`, or `-q -d A,B` when ``displays`` is given."""
    preamble, full = _sections(_capture("nvidia-smi-q.txt"))
    if displays:
        unknown = [d for d in displays if d not in DISPLAY_SECTIONS]
        if unknown:
            raise DisplayError(", ".join(unknown))
        wanted = {name for d in displays for name in DISPLAY_SECTIONS[d]}
        _, perf = _sections(_capture("nvidia-smi-q-perf-load.txt"))
        # Order as the real -d capture does: full -q order, with the sampling blocks
        # that only -d prints placed where the perf capture has them.
        by_name = {name: body for name, body in full}
        by_name.update({name: body for name, body in perf})
        chosen = sorted(
            (name for name in by_name if name in wanted),
            key=lambda name: _position(name, full, perf),
        )
        body = [line for name in chosen for line in by_name[name]]
    else:
        body = [line for name, lines in full if name not in _PERF_ONLY for line in lines]
    lines = _rewrite(preamble + body, _q_replacements(sim, now))
    return "\n".join(lines) + "\n\n"


def _position(
    name: str,
    full: list[tuple[str, list[str]]],
    perf: list[tuple[str, list[str]]],
) -> float:
    full_names = [n for n, _ in full]
    if name in full_names:
        return float(full_names.index(name))
    # A perf-only block sits just after the section that precedes it in the perf capture.
    perf_names = [n for n, _ in perf]
    previous = perf_names[: perf_names.index(name)]
    anchors = [full_names.index(n) for n in previous if n in full_names]
    return (max(anchors) if anchors else -1) + 0.5 + perf_names.index(name) / 1000


# ---------------------------------------------------------------- --query-gpu


@cache
def valid_query_fields() -> frozenset[str]:
    """Every field name (and alias) nvidia-smi --help-query-gpu lists."""
    names: set[str] = set()
    for line in _capture("help-query-gpu.txt").splitlines():
        if line.startswith('"'):
            names.update(n for n in re.findall(r'"([^"]+)"', line) if not re.match(r"\d+:", n))
    return frozenset(names)


_UNITS = {
    "utilization.gpu": "%",
    "utilization.memory": "%",
    "power.draw": "W",
    "power.draw.average": "W",
    "power.draw.instant": "W",
    "power.limit": "W",
    "enforced.power.limit": "W",
    "power.default_limit": "W",
    "clocks.current.sm": "MHz",
    "clocks.current.graphics": "MHz",
    "clocks.current.memory": "MHz",
    "clocks.max.sm": "MHz",
    "clocks.max.graphics": "MHz",
    "clocks.max.memory": "MHz",
    "clocks.applications.graphics": "MHz",
    "memory.total": "MiB",
    "memory.reserved": "MiB",
    "memory.used": "MiB",
    "memory.free": "MiB",
    "clocks_event_reasons_counters.sw_power_cap": "us",
}
_ALIASES = {"gpu_name": "name", "gpu_uuid": "uuid", "gpu_bus_id": "pci.bus_id", "gpu_serial": "serial"}


def _query_values(sim: SimGpu, now: dt.datetime) -> dict[str, str | None]:
    """Field -> value without unit; None means nvidia-smi prints "[N/A]"."""
    f = face(sim)
    mask = 0
    for reason in f.reasons_active:
        mask |= REASON_BITS[reason]
    values: dict[str, str | None] = {
        "timestamp": f"{now:%Y/%m/%d %H:%M:%S}.{now.microsecond // 1000:03d}",
        "driver_version": DRIVER_VERSION,
        "count": "1",
        "index": "0",
        "name": GB10_NAME,
        "uuid": "GPU-00000000-0000-0000-0000-000000000000",
        "serial": None,
        "pci.bus_id": GB10_BUS_ID,
        "persistence_mode": "Enabled" if f.persistence_mode else "Disabled",
        "pstate": f.pstate,
        "fan.speed": None,
        "compute_mode": "Default",
        "temperature.gpu": str(f.temperature_c),
        "utilization.gpu": str(f.utilization_pct),
        "utilization.memory": None,
        "power.draw": f"{f.power_w:.2f}",
        "power.draw.average": f"{f.power_w:.2f}",
        "power.draw.instant": f"{f.power_w:.2f}",
        "power.limit": None,
        "enforced.power.limit": None,
        "power.default_limit": None,
        "clocks.current.sm": str(f.sm_clock_mhz),
        "clocks.current.graphics": str(f.sm_clock_mhz),
        "clocks.current.memory": None,
        "clocks.max.sm": str(GB10_MAX_SM_MHZ),
        "clocks.max.graphics": str(GB10_MAX_SM_MHZ),
        "clocks.max.memory": None,
        "clocks.applications.graphics": str(GB10_APP_CLOCK_MHZ),
        "clocks_event_reasons.active": f"0x{mask:016X}",
        "clocks_event_reasons_counters.sw_power_cap": str(f.sw_power_cap_us),
        "memory.total": None,
        "memory.reserved": None,
        "memory.used": None,
        "memory.free": None,
    }
    for reason in REASON_BITS:
        values[f"clocks_event_reasons.{reason}"] = (
            "Active" if reason in f.reasons_active else "Not Active"
        )
    return values


@dataclass(frozen=True)
class Invocation:
    """What one nvidia-smi run printed and returned."""

    stdout: str
    stderr: str
    returncode: int


def _invalid_field(field: str) -> Invocation:
    return Invocation("", f'Field "{field}" is not a valid field to query.\n\n', 2)


def render_query_gpu(
    sim: SimGpu, fields: Sequence[str], header: bool, units: bool, now: dt.datetime
) -> Invocation:
    valid = valid_query_fields()
    values = _query_values(sim, now)
    for field in fields:
        if field not in valid:
            return _invalid_field(field)
        if _ALIASES.get(field, field) not in values:
            return Invocation(
                "",
                f"nvidia-smi stand-in: field {field!r} is valid for nvidia-smi but not "
                "simulated; add it to sim/spark_sim/gpu_states.py\n",
                3,
            )
    lines = []
    if header:
        # The header keeps its units even with nounits, as the real capture shows.
        lines.append(
            ", ".join(
                f"{field} [{_UNITS[_ALIASES.get(field, field)]}]"
                if _ALIASES.get(field, field) in _UNITS
                else field
                for field in fields
            )
        )
    cells = []
    for field in fields:
        key = _ALIASES.get(field, field)
        value = values[key]
        if value is None:
            cells.append("[N/A]")
        elif units and key in _UNITS:
            cells.append(f"{value} {_UNITS[key]}")
        else:
            cells.append(value)
    lines.append(", ".join(cells))
    return Invocation("\n".join(lines) + "\n", "", 0)


_COMPUTE_APP_FIELDS = {
    "timestamp": "timestamp",
    "gpu_name": "gpu_name",
    "gpu_bus_id": "gpu_bus_id",
    "gpu_serial": "gpu_serial",
    "gpu_uuid": "gpu_uuid",
    "pid": "pid",
    "process_name": "process_name",
    "name": "process_name",
    "used_memory": "used_gpu_memory [MiB]",
    "used_gpu_memory": "used_gpu_memory [MiB]",
}


def render_query_compute_apps(fields: Sequence[str], header: bool) -> Invocation:
    """Always empty on a GB10: "returns EMPTY even when 20+ GiB is consumed" (runbook)."""
    for field in fields:
        if field not in _COMPUTE_APP_FIELDS:
            return _invalid_field(field)
    if not header:
        return Invocation("", "", 0)
    return Invocation(", ".join(_COMPUTE_APP_FIELDS[f] for f in fields) + "\n", "", 0)


# ------------------------------------------------------------------ the command

_BAD_ARGS = "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n"


def _options(argv: Sequence[str]) -> dict[str, str] | None:
    """argv -> {option: value}; '--opt=value' and '--opt value' forms; None if malformed."""
    takes_value = {
        "-d",
        "--display",
        "--query-gpu",
        "--query-compute-apps",
        "--format",
        "-pm",
        "--persistence-mode",
        "-lgc",
        "--lock-gpu-clocks",
        "-i",
        "--id",
    }
    flags = {"-q", "--query", "-rgc", "--reset-gpu-clocks"}
    options: dict[str, str] = {}
    items = list(argv)
    while items:
        item = items.pop(0)
        name, eq, value = item.partition("=")
        if name in takes_value:
            if not eq:
                if not items:
                    return None
                value = items.pop(0)
            options[name] = value
        elif item in flags:
            options[item] = ""
        else:
            return None
    return options


def run(argv: Sequence[str], sim: SimGpu, now: dt.datetime) -> tuple[Invocation, SimGpu]:
    """Run the fake nvidia-smi; returns its output and the (possibly changed) state."""
    options = _options(argv)
    if options is None:
        return Invocation("", _BAD_ARGS, 2), sim
    if options.get("-i", options.get("--id", "0")) not in ("0", GB10_BUS_ID):
        return Invocation("", "No devices were found\n", 6), sim
    fmt = options.get("--format")
    fmt_parts = set(fmt.split(",")) if fmt is not None else set()
    if fmt is not None and ("csv" not in fmt_parts or fmt_parts - {"csv", "noheader", "nounits"}):
        return Invocation("", _BAD_ARGS, 2), sim

    if "--query-gpu" in options or "--query-compute-apps" in options:
        if fmt is None:
            return Invocation("", _BAD_ARGS, 2), sim
        header = "noheader" not in fmt_parts
        if "--query-gpu" in options:
            fields = [f.strip() for f in options["--query-gpu"].split(",") if f.strip()]
            return render_query_gpu(sim, fields, header, "nounits" not in fmt_parts, now), sim
        fields = [f.strip() for f in options["--query-compute-apps"].split(",") if f.strip()]
        return render_query_compute_apps(fields, header), sim

    pm = options.get("-pm", options.get("--persistence-mode"))
    if pm is not None:
        if pm not in ("0", "1", "ENABLED", "DISABLED"):
            return Invocation("", _BAD_ARGS, 2), sim
        enable = pm in ("1", "ENABLED")
        word = "Enabled" if enable else "Disabled"
        if sim.persistence_mode == enable:
            text = f"Persistence mode is already {word} for GPU {GB10_BUS_ID}.\nAll done.\n"
        else:
            text = f"{word} persistence mode for GPU {GB10_BUS_ID}.\nAll done.\n"
        return Invocation(text, "", 0), sim.model_copy(update={"persistence_mode": enable})

    lgc = options.get("-lgc", options.get("--lock-gpu-clocks"))
    if lgc is not None:
        match = re.fullmatch(r"(\d+),(\d+)", lgc.strip())
        if match is None or int(match.group(1)) > int(match.group(2)):
            return Invocation("", _BAD_ARGS, 2), sim
        low, high = int(match.group(1)), int(match.group(2))
        text = f'GPU clocks set to "(gpuClkMin {low}, gpuClkMax {high})" for GPU {GB10_BUS_ID}\nAll done.\n'
        # Accepted on every node; on a wedged one face() ignores it (firmware cap).
        return Invocation(text, "", 0), sim.model_copy(update={"locked_clocks": (low, high)})

    if "-rgc" in options or "--reset-gpu-clocks" in options:
        return Invocation("All done.\n", "", 0), sim.model_copy(update={"locked_clocks": None})

    if "-q" in options or "--query" in options:
        display = options.get("-d", options.get("--display"))
        displays = [d.strip().upper() for d in display.split(",")] if display else None
        try:
            return Invocation(render_q(sim, now, displays), "", 0), sim
        except DisplayError:
            return Invocation("", _BAD_ARGS, 2), sim
    if options.keys() - {"-i", "--id"}:
        return Invocation("", _BAD_ARGS, 2), sim
    return Invocation(render_table(sim, now), "", 0), sim
