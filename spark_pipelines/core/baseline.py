"""Benches that can be compared: what a bench ran on, whether it counts, and the fleet's baseline.

A tok/s figure means something only next to what produced it. Each bench records its identity
(image id, checkpoint digest, launch-spec hash, driver version) and its conditions under load
(GPU clocks and power, the GPU verdict, isolation evidence, spec-decode acceptance). A bench
taken while the GPU was wedged or while foreign requests ran measures the fault, not the node:
it is void, shown, and never a baseline. Baselines compare like with like: the latest valid
bench of each node on the same image, checkpoint and launch spec.
"""

from __future__ import annotations

import datetime as dt
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from spark_pipelines.core import gpu
from spark_pipelines.core.health import BenchHistory

# What must match for two benches to be compared (the driver is recorded and shown, but a
# driver difference is a finding to report, not a reason to refuse the comparison).
IDENTITY_KEYS = ("image_id", "checkpoint_digest", "launch_spec_hash")


@dataclass(frozen=True)
class BenchIdentity:
    image_id: str | None = None
    checkpoint_digest: str | None = None
    launch_spec_hash: str | None = None
    driver_version: str | None = None

    def differences(self, other: BenchIdentity) -> list[str]:
        """What differs from `other`, in words (unknown on either side is not a difference)."""
        out = []
        for key in (*IDENTITY_KEYS, "driver_version"):
            mine, theirs = getattr(self, key), getattr(other, key)
            if mine and theirs and mine != theirs:
                out.append(f"{key.replace('_', ' ')} {_short(mine)} vs {_short(theirs)}")
        return out

    def comparable_with(self, other: BenchIdentity) -> bool:
        return all(getattr(self, k) == getattr(other, k) for k in IDENTITY_KEYS)


@dataclass(frozen=True)
class LoadConditions:
    """What the node was doing while the bench measured it."""

    gpu_state: str = "unknown"  # core.gpu state judged over the loaded samples
    sm_clock_mhz_p50: float | None = None  # over the samples taken under load
    power_w_p50: float | None = None
    samples: int = 0
    isolation_verified: bool = False  # num_requests_running == 0 read before the bench started
    # Server-side token counters equal to what the bench itself received (None: not readable).
    # More on the server side means somebody else's requests ran during the bench.
    counters_match: bool | None = None
    acceptance_rate: float | None = None  # spec-decode accepted / drafted over the bench


def load_conditions(readings: Sequence[gpu.GpuReading], gpu_state: str, *, isolation_verified: bool,
                    counters_match: bool | None, acceptance_rate: float | None) -> LoadConditions:
    """Conditions from the bench's nvidia-smi samples: idle samples (between requests) do not
    describe the load, so the medians are over the samples the GPU was busy in."""
    busy = [r for r in readings if gpu.classify(r, under_load=True).state != "idle"]
    clocks = [r.sm_clock_mhz for r in busy if r.sm_clock_mhz is not None]
    power = [r.power_draw_w for r in busy if r.power_draw_w is not None]
    return LoadConditions(
        gpu_state=gpu_state,
        sm_clock_mhz_p50=statistics.median(clocks) if clocks else None,
        power_w_p50=statistics.median(power) if power else None,
        samples=len(readings),
        isolation_verified=isolation_verified,
        counters_match=counters_match,
        acceptance_rate=acceptance_rate,
    )


def void_reasons(c: LoadConditions) -> tuple[str, ...]:
    """Why a bench does not measure the node (empty: it counts)."""
    why = []
    if c.gpu_state == "wedged":
        why.append("the GPU showed the PD-firmware wedge under load: the figure measures the wedge")
    if not c.isolation_verified:
        why.append("isolation not verified (num_requests_running was not read as 0 before the start)")
    if c.counters_match is False:
        why.append("the server counted more tokens than the bench received: foreign requests ran during it")
    return tuple(why)


@dataclass(frozen=True)
class BenchRecord:
    """One bench as kept for comparison (the bench asset writes it as metadata, reads it back)."""

    node: str
    at: float  # epoch seconds
    tok_s: float | None
    identity: BenchIdentity = BenchIdentity()
    conditions: LoadConditions = LoadConditions()
    void: tuple[str, ...] = field(default=())
    protocol: str | None = None  # core.protocol key; None: recorded before protocols were
    quality: float | None = None  # the quality phase's score /100 (core.quality)
    quality_suite: str | None = None

    @property
    def valid(self) -> bool:
        return not self.void and self.tok_s is not None

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "at": self.at, "tok_s": self.tok_s, "identity": asdict(self.identity),
                "conditions": asdict(self.conditions), "void": list(self.void), "protocol": self.protocol,
                "quality": self.quality, "quality_suite": self.quality_suite}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchRecord:
        """Tolerant of records written before a field existed (missing -> unknown), and of `at` as
        the UTC text `readable` writes or the epoch seconds written before."""
        ident = {k: v for k, v in dict(data.get("identity") or {}).items() if k in BenchIdentity.__dataclass_fields__}
        cond = {k: v for k, v in dict(data.get("conditions") or {}).items() if k in LoadConditions.__dataclass_fields__}
        tok = data.get("tok_s")
        at = data.get("at") or 0.0
        if isinstance(at, str):
            at = dt.datetime.strptime(at, READABLE_TIME).replace(tzinfo=dt.timezone.utc).timestamp()
        return cls(node=str(data["node"]), at=float(at),
                   tok_s=float(tok) if tok is not None else None,
                   identity=BenchIdentity(**ident), conditions=LoadConditions(**cond),
                   void=tuple(str(v) for v in data.get("void") or ()),
                   protocol=data.get("protocol"), quality=float(q) if (q := data.get("quality")) is not None else None,
                   quality_suite=data.get("quality_suite"))


READABLE_TIME = "%Y-%m-%d %H:%M:%S UTC"


def readable(data: Any, digits: int = 2) -> Any:
    """A record as the UI shows it (BenchRecord.from_dict reads it back): `at` as UTC text, not
    epoch seconds; floats rounded to `digits`."""
    if isinstance(data, dict):
        return {k: (dt.datetime.fromtimestamp(v, tz=dt.timezone.utc).strftime(READABLE_TIME)
                    if k == "at" and isinstance(v, (int, float)) else readable(v, digits)) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [readable(v, digits) for v in data]
    return round(data, digits) if isinstance(data, float) else data


def record(node: str, at: float, tok_s: float | None, identity: BenchIdentity, conditions: LoadConditions, *,
           protocol: str | None = None, quality: float | None = None, quality_suite: str | None = None) -> BenchRecord:
    return BenchRecord(node, at, tok_s, identity, conditions, void_reasons(conditions), protocol, quality, quality_suite)


@dataclass(frozen=True)
class Baseline:
    """The fleet's reference for one identity: the latest valid bench of each node on it."""

    identity: BenchIdentity
    tok_s: float  # median over nodes
    low: float
    high: float
    acceptance: float | None
    nodes: tuple[str, ...]
    protocol: str | None = None  # every bench in it was made under this protocol
    quality: float | None = None  # the lowest quality score over the nodes (the band's bottom)
    quality_suite: str | None = None

    def text(self) -> str:
        spread = f" ({self.low:.1f}-{self.high:.1f})" if len(self.nodes) > 1 else ""
        acc = f", MTP acceptance {self.acceptance:.1%}" if self.acceptance is not None else ""
        qual = f", quality >= {self.quality:g}/100" if self.quality is not None else ""
        return f"{self.tok_s:.1f} tok/s{spread} over {', '.join(self.nodes)}{acc}{qual}"


def latest_valid(records: Iterable[BenchRecord]) -> dict[str, BenchRecord]:
    """Each node's latest bench that counts."""
    out: dict[str, BenchRecord] = {}
    for r in sorted(records, key=lambda r: r.at):
        if r.valid:
            out[r.node] = r
    return out


def fleet_baseline(records: Iterable[BenchRecord], identity: BenchIdentity | None = None) -> Baseline | None:
    """The median of each node's latest valid bench, among benches comparable with `identity`
    (default: the identity of the newest valid bench) and made under one bench protocol (the
    newest such bench's: benches under different protocols are never compared). None when no
    bench counts."""
    pool = list(records)
    valid = [r for r in pool if r.valid]
    if not valid:
        return None
    ident = identity or max(valid, key=lambda r: r.at).identity
    same = [r for r in valid if r.identity.comparable_with(ident)]
    if not same:
        return None
    proto = max(same, key=lambda r: r.at).protocol
    latest = latest_valid(r for r in same if r.protocol == proto)
    figs = [r.tok_s for r in latest.values() if r.tok_s is not None]
    accs = [r.conditions.acceptance_rate for r in latest.values() if r.conditions.acceptance_rate is not None]
    suites = {r.quality_suite for r in latest.values() if r.quality is not None}
    quals = [r.quality for r in latest.values() if r.quality is not None]
    one_suite = len(suites) == 1  # scores of different suite versions are not pooled
    return Baseline(ident, statistics.median(figs), min(figs), max(figs),
                    statistics.median(accs) if accs else None, tuple(sorted(latest)), proto,
                    min(quals) if quals and one_suite else None, suites.pop() if one_suite else None)


def history(records: Iterable[BenchRecord], node: str) -> BenchHistory:
    """The node's valid benches, oldest first, as the health sweep's `regressed` rule reads them:
    void benches (wedged, contaminated) are left out, so a wedge never becomes the reference."""
    mine = sorted((r for r in records if r.node == node), key=lambda r: r.at)
    valid = [r for r in mine if r.valid]
    return BenchHistory(
        tok_s=tuple(float(r.tok_s) for r in valid if r.tok_s is not None),
        acceptance=tuple(r.conditions.acceptance_rate for r in valid if r.conditions.acceptance_rate is not None),
        latest_gpu_state=mine[-1].conditions.gpu_state if mine else None,
    )


def _short(v: str) -> str:
    return v.split(":", 1)[-1][:12] if v.startswith("sha256:") else v[:24]


def identity_of(container: Mapping[str, Any] | None, labels: Mapping[str, str], readings: Sequence[gpu.GpuReading],
                *, launch_label: str, checkpoint_label: str) -> BenchIdentity:
    """What the bench ran on: the serving container's image and its deploy labels (the hash of
    the launch flags that shape kernels, alike across nodes launched alike; the checkpoint
    digest), the driver nvidia-smi reported during the bench."""
    driver = next((r.driver_version for r in readings if r.driver_version), None)
    return BenchIdentity(image_id=str((container or {}).get("Image") or "") or None,
                         checkpoint_digest=labels.get(checkpoint_label) or None,
                         launch_spec_hash=labels.get(launch_label) or None, driver_version=driver)


SIDE_BY_SIDE_COLUMNS = (
    ("node", "string", "serve node"),
    ("mean tok/s", "number", "its latest bench"),
    ("vs baseline (x)", "number", "mean / the fleet's baseline (comparable benches only)"),
    ("MTP acceptance %", "number", "spec-decode accepted / drafted during the bench"),
    ("SM MHz p50", "number", "GPU clock under load"),
    ("power W p50", "number", "GPU power under load"),
    ("image", "string", "serving image id"),
    ("checkpoint", "string", "checkpoint index digest"),
    ("launch spec", "string", "launch-spec hash"),
    ("driver", "string", "NVIDIA driver"),
    ("counts", "string", "yes, or why the bench is void / not comparable"),
)


def side_by_side(latest: Mapping[str, BenchRecord | None], base: Baseline | None) -> list[dict[str, Any]]:
    """Each node's latest bench next to the fleet's baseline: the table the bench asset shows."""
    rows = []
    for node, r in latest.items():
        if r is None:
            rows.append({"node": node, "counts": "no bench recorded"})
            continue
        c, i = r.conditions, r.identity
        comparable = base is not None and i.comparable_with(base.identity)
        if r.void:
            counts = "void: " + "; ".join(r.void)
        elif base is None:
            counts = "yes (no baseline yet)"
        elif not comparable:
            counts = "not comparable: " + ", ".join(i.differences(base.identity))
        else:
            counts = "yes"
        vs = round(r.tok_s / base.tok_s, 3) if (comparable and r.tok_s is not None and base and base.tok_s) else None
        rows.append({
            "node": node, "mean tok/s": None if r.tok_s is None else round(r.tok_s, 2), "vs baseline (x)": vs,
            "MTP acceptance %": None if c.acceptance_rate is None else round(c.acceptance_rate * 100, 1),
            "SM MHz p50": c.sm_clock_mhz_p50, "power W p50": None if c.power_w_p50 is None else round(c.power_w_p50, 1),
            "image": _short(i.image_id or "-"), "checkpoint": _short(i.checkpoint_digest or "-"),
            "launch spec": _short(i.launch_spec_hash or "-"), "driver": i.driver_version or "-", "counts": counts,
        })
    return rows
