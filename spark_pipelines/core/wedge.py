"""The PD-firmware wedge (runbook "Known Firmware Issues"): what the pre-drain evidence and the
post-drain validation readings mean. Pure: the caller runs the commands and hands the text here.

- the clock-lock-ignored test: `nvidia-smi -lgc 2418,3003` is accepted, yet under load the SM clock
  stays below 1 GHz -> the cap lives below nvidia-smi (firmware): "mechanistically conclusive";
- the evidence: the whole signature under load (core.gpu) AND the lock ignored = wedge confirmed;
- the post-drain verdict, as the runbook's post-drain script prints it: "WEDGE RESOLVED" or
  "WEDGE PERSISTS", with the runbook's next step for PERSISTS (the ASUS ticket).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict

from spark_pipelines.core.gpu import (
    IDLE_MAX_UTILIZATION_PCT,
    WEDGE_CLOCK_CEILING_MHZ,
    WEDGE_POWER_CEILING_W,
    GpuReading,
    GpuVerdict,
    judge_under_load,
)

# "sudo nvidia-smi -lgc 2418,3003 # accepts on a wedged GX10": the GB10's application and max clocks.
LOCK_CLOCKS_MHZ = (2418, 3003)
# "SM clock pinned at 611 MHz or 708 MHz under load (vs. expected 2400-2600 MHz)". A healthy GB10
# under SW power capping (~40 W) may sit somewhat under 2400; 2000 is far above any pinned value.
FULL_CLOCK_MIN_MHZ = 2000.0
# "Wait 90-120 seconds. The 60s value cited in the forum thread is a minimum; multiple community
# reports cite '60s didn't take, 2 min did'."
COLD_DRAIN_OFF_S = (90, 120)
COLD_DRAIN_MIN_OFF_S = 60

RESOLVED = "WEDGE RESOLVED"
PERSISTS = "WEDGE PERSISTS"
Verdict = Literal["WEDGE RESOLVED", "WEDGE PERSISTS"]

FORUM_THREAD = "https://forums.developer.nvidia.com/t/another-asus-gx10-problem/371201"
PERSISTS_ADVICE = (
    "the cold drain did not clear the wedge: file an ASUS support ticket with the BIOS string ({bios}), "
    "the pre-drain tarball, the post-drain tarball (it proves the drain was attempted) and a reference to "
    f"the NVIDIA Developer Forum thread \"Another ASUS GX10 problem\" (2026-05-24, {FORUM_THREAD}); request "
    "PD firmware >= 5.8 for the GX10. Do NOT stage PD firmware components separately (it bricks the unit): "
    "use the combined SoC+BIOS+EC capsule only. The node stays out of the gateway"
)
UNDECIDED_ADVICE = (
    "the validation could not show the GPU at full clock under load ({why}); the node stays out of the "
    "gateway: check its engine (docker logs), then run cold_drain_job for it again"
)
OPERATOR_STEPS = (
    "unplug {node}'s power brick FROM THE WALL (the USB-C end can stay attached), wait "
    f"{COLD_DRAIN_OFF_S[0]}-{COLD_DRAIN_OFF_S[1]} s, plug it back in and power {{node}} on; this run waits "
    "for it to come back"
)
# What the kernel log can tell about the wedge's triggers: "OOM-kills during heavy memory load,
# sleep/wake cycles, or container crash-loops".
_TRIGGERS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("OOM kill", re.compile(r"Out of memory: Killed process|oom-kill:|invoked oom-killer", re.I)),
    ("sleep/wake", re.compile(r"PM: suspend entry|PM: suspend exit|ACPI: PM: Waking|PM: resume", re.I)),
    ("USB-C PD event", re.compile(r"ucsi|typec|power delivery", re.I)),
)

LockState = Literal["ignored", "enforced", "unknown"]


class LockVerdict(BaseModel):
    model_config = ConfigDict(frozen=True)

    state: LockState
    reason: str


def _loaded(readings: Sequence[GpuReading]) -> list[GpuReading]:
    return [r for r in readings if r.utilization_pct is not None and r.utilization_pct >= IDLE_MAX_UTILIZATION_PCT]


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def judge_lock_test(accepted: bool, readings: Sequence[GpuReading], lock: tuple[int, int] = LOCK_CLOCKS_MHZ,
                    refusal: str = "") -> LockVerdict:
    """The clock-lock-ignored test: `-lgc lo,hi` `accepted`, then `readings` taken under load."""
    lo, hi = lock
    if not accepted:
        return LockVerdict(state="unknown", reason=f"nvidia-smi -lgc {lo},{hi} was refused ({refusal or 'no reason given'}); "
                                                   "the lock test says nothing")
    clocks = [r.sm_clock_mhz for r in _loaded(readings) if r.sm_clock_mhz is not None]
    if not clocks:
        return LockVerdict(state="unknown", reason=f"-lgc {lo},{hi} accepted, but no sample of {len(readings)} caught "
                                                   "the GPU under load with its SM clock")
    clock = _median(clocks)
    if clock < min(lo, WEDGE_CLOCK_CEILING_MHZ):
        return LockVerdict(state="ignored", reason=f"-lgc {lo},{hi} accepted but the SM clock stayed at {clock:g} MHz "
                                                   f"under load ({len(clocks)} sample(s)): the cap lives below "
                                                   "nvidia-smi, firmware enforcement (wedge confirmed)")
    if clock >= FULL_CLOCK_MIN_MHZ:
        return LockVerdict(state="enforced", reason=f"-lgc {lo},{hi} enforced: SM {clock:g} MHz under load "
                                                    f"({len(clocks)} sample(s))")
    return LockVerdict(state="unknown", reason=f"-lgc {lo},{hi} accepted; SM {clock:g} MHz under load is neither pinned "
                                               f"below {WEDGE_CLOCK_CEILING_MHZ:g} MHz nor at full clock")


class EvidenceVerdict(BaseModel):
    """What one capture's readings say (pre-drain: is the wedge confirmed?)."""

    model_config = ConfigDict(frozen=True)

    confirmed: bool
    gpu: GpuVerdict
    lock: LockVerdict
    triggers: list[str]
    bios: str | None
    summary: list[str]


def judge_evidence(under_load: Sequence[GpuReading], lock: LockVerdict, kernel_log: str = "",
                   bios: str | None = None) -> EvidenceVerdict:
    """The whole signature under load and the lock ignored: "all must match -- no single symptom is
    diagnostic alone"; the accept-but-not-enforce behaviour is the conclusive part."""
    g = judge_under_load(under_load)
    triggers = kernel_triggers(kernel_log)
    confirmed = g.state == "wedged" and lock.state == "ignored"
    summary = [f"GPU under load: {g.state} ({'; '.join(g.reasons[:2])})", f"clock-lock test: {lock.state} ({lock.reason})",
               "wedge CONFIRMED: capture kept, cold drain next (cold_drain_job)" if confirmed
               else "wedge NOT confirmed by this capture: the readings above say what is missing"]
    if triggers:
        summary.append("kernel log: " + "; ".join(triggers))
    if bios:
        summary.append(f"BIOS {bios}")
    return EvidenceVerdict(confirmed=confirmed, gpu=g, lock=lock, triggers=triggers, bios=bios, summary=summary)


def kernel_triggers(text: str) -> list[str]:
    """Counts of the wedge's known triggers in a kernel log (dmesg / journalctl -k)."""
    out = []
    for name, pattern in _TRIGGERS:
        hits = [line for line in text.splitlines() if pattern.search(line)]
        if hits:
            out.append(f"{len(hits)} {name} line(s), last: {hits[-1].strip()[:160]}")
    return out


def bios_string(text: str) -> str | None:
    """/sys/class/dmi/id/bios_version or `dmidecode -s bios-version` -> the string (None: absent)."""
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "permission denied" not in line.lower():
            return line[:120]
    return None


class DrainVerdict(BaseModel):
    model_config = ConfigDict(frozen=True)

    verdict: Verdict
    reasons: list[str]
    advice: str

    @property
    def resolved(self) -> bool:
        return self.verdict == RESOLVED

    def text(self) -> str:
        """VERDICT.txt, as the runbook's post-drain script prints it."""
        return "\n".join([self.verdict, *(f"- {r}" for r in self.reasons), f"next: {self.advice}"]) + "\n"


def post_drain_verdict(under_load: Sequence[GpuReading], lock: LockVerdict, bench_mean_tok_s: float | None,
                       floor_tok_s: float, bios: str | None = None) -> DrainVerdict:
    """After the cold drain: RESOLVED only when every check holds (clock back at full clock under load,
    power above the firmware cap, the whole wedge signature gone, -lgc enforced, the bench at or above
    the node's floor). Anything missing or failing is PERSISTS: the node stays out."""
    g = judge_under_load(under_load)
    loaded = _loaded(under_load)
    clocks = [r.sm_clock_mhz for r in loaded if r.sm_clock_mhz is not None]
    powers = [r.power_draw_w for r in loaded if r.power_draw_w is not None]
    counters = [r.sw_power_cap_counter_us for r in loaded if r.sw_power_cap_counter_us is not None]
    ok: list[str] = []
    bad: list[str] = []
    missing: list[str] = []
    if g.state == "wedged":
        bad.append(f"the wedge signature is still complete under load ({g.reasons[0]})")
    elif g.state == "healthy":
        ok.append(f"wedge signature gone under load ({g.reasons[0]})")
    else:
        missing.append(f"GPU under load {g.state} ({g.reasons[0]})")
    if clocks:
        clock = _median(clocks)
        (ok if clock >= FULL_CLOCK_MIN_MHZ else bad).append(
            f"SM clock under load {clock:g} MHz ({'at' if clock >= FULL_CLOCK_MIN_MHZ else 'below'} full clock, "
            f">= {FULL_CLOCK_MIN_MHZ:g} MHz; expected 2400-2600)")
    else:
        missing.append("no SM clock read under load")
    if powers:
        power = _median(powers)
        (ok if power >= WEDGE_POWER_CEILING_W else bad).append(
            f"power under load {power:g} W ({'above' if power >= WEDGE_POWER_CEILING_W else 'still under'} the "
            f"wedge's {WEDGE_POWER_CEILING_W:g} W cap; expected 35-45 W)")
    else:
        missing.append("no power draw read under load")
    if counters:
        # Positive evidence, not a problem: a healthy GPU tries to draw more than its envelope.
        ok.append(f"SW power-cap counter {max(counters)} us")
    {"enforced": ok, "ignored": bad, "unknown": missing}[lock.state].append(lock.reason)
    if bench_mean_tok_s is None:
        missing.append("no bench result")
    elif bench_mean_tok_s >= floor_tok_s:
        ok.append(f"bench {bench_mean_tok_s:.1f} tok/s >= the node's floor {floor_tok_s:g}")
    else:
        bad.append(f"bench {bench_mean_tok_s:.1f} tok/s < the node's floor {floor_tok_s:g}")
    if not bad and not missing:
        return DrainVerdict(verdict=RESOLVED, reasons=ok,
                            advice="the node is back at full clock: it returns to the gateway")
    if bad:
        return DrainVerdict(verdict=PERSISTS, reasons=bad + missing + ok,
                            advice=PERSISTS_ADVICE.format(bios=bios or "read it from /sys/class/dmi/id/bios_version"))
    return DrainVerdict(verdict=PERSISTS, reasons=missing + ok, advice=UNDECIDED_ADVICE.format(why="; ".join(missing)))


# ------------------------------------------------------------------------- the tarball


class ManifestEntry(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    size: int
    sha256: str


def manifest(files: Mapping[str, bytes]) -> list[ManifestEntry]:
    return [ManifestEntry(name=n, size=len(b), sha256=hashlib.sha256(b).hexdigest()) for n, b in files.items()]


EVIDENCE_ROOT = "~/wedge-evidence"  # on the build host, one dated folder per day


def evidence_path(node: str, label: str, when: datetime) -> str:
    """`~/wedge-evidence/<YYYY-MM-DD>/<node>-wedge-evidence-<label>-<UTC stamp>.tar.gz` (the runbook's
    `spark2-wedge-evidence-*.tar.gz`, dated)."""
    return f"{EVIDENCE_ROOT}/{when:%Y-%m-%d}/{node}-wedge-evidence-{label}-{when:%Y%m%dT%H%M%SZ}.tar.gz"
