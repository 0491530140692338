"""The fleet's recorded state as Prometheus metric families: what the alert rules and dashboards read.

Pure: the shell (metrics_command.py over state/records.py) hands in each node's latest recorded facts (the same
`summary.NodeFacts` the fleet summary reads), the restart budget each node has used, the last
good bench, and fleet-wide facts; this decides every sample. A fact never recorded is no sample
(an absent series, never a made-up 0), so an alert on it cannot fire on missing data.

Names follow Prometheus' conventions (unit suffix, `_ratio` for 0..1, timestamps in seconds).
Label values are bounded: `verdict` is one of core.health.VERDICTS, `reason` one of REASONS.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import health, summary
from spark_pipelines.core import record_keys as keys

PREFIX = "spark"

# Why a node is out of the gateway's rotation, as the `reason` label (bounded: a free-text
# reason stays in the fleet summary and the ledger). First match wins.
REASONS: tuple[str, ...] = ("quarantined", "drained", "bench_gate", "health", "unknown")


@dataclass(frozen=True)
class Sample:
    labels: Mapping[str, str]
    value: float


@dataclass(frozen=True)
class Family:
    name: str
    help: str
    samples: tuple[Sample, ...]
    kind: str = "gauge"


@dataclass(frozen=True)
class NodeExtra:
    """What a node's metrics need beyond the fleet summary's facts."""

    redeploys_in_window: int | None = None  # healing redeploys in health.restart_window_s; None: not read
    last_good_bench_at: float | None = None  # epoch seconds of its newest promoted bench with a mean
    clean_boot_free_gib: float | None = None  # node_os's measured clean boot, else its hardware profile's
    out_since: float | None = None  # since when the sweeps find it out of the gateway (None: in)


@dataclass(frozen=True)
class FleetFacts:
    nodes: Sequence[summary.NodeFacts]
    rotation: summary.Rotation
    min_in_rotation: int
    restart_budget: int
    bench_max_s: float | None = None  # health.bench_max_s: a drain longer than a bench is undone
    extra: Mapping[str, NodeExtra] = field(default_factory=dict)
    rollout_in_progress: bool | None = None  # None: not read
    now: float = 0.0


def _truthy(value: Any) -> bool:
    return value not in (None, False, "", "false", "False", "no", 0)


def verdict_of(f: summary.NodeFacts) -> str | None:
    """The sweep's verdict, or healthy when a deploy (which verified the node itself) is newer."""
    said = summary.health_of(f)
    if said == summary.HEALTHY_AT_DEPLOY:
        return "healthy"
    return said if said in health.VERDICTS else None


def in_rotation(f: summary.NodeFacts, rotation: summary.Rotation) -> bool | None:
    """The newest word on it: the health sweep reads the live gateway config each minute, a gateway
    event (write, drain, restore, reconcile) records the rotation after it; None: neither recorded."""
    swept = (f.health or {}).get(keys.IN_GATEWAY)
    if swept is not None and (not rotation.known or (f.health_at or 0) >= rotation.at):
        return _truthy(swept)
    if rotation.known:
        return f.node in rotation.nodes
    return None


def out_reason(f: summary.NodeFacts, rotation: summary.Rotation) -> str:
    """One of REASONS for a node out of the rotation."""
    h = f.health or {}
    why = str(rotation.left_out.get(f.node) or "").lower()
    if _truthy(h.get(keys.QUARANTINED)) or why.startswith("quarantine"):
        return "quarantined"
    if "drain" in why:
        return "drained"
    if (f.bench or {}).get(keys.PROMOTED) is False:
        return "bench_gate"
    if verdict_of(f) not in (None, *health.NO_ACTION):
        return "health"
    return "unknown"


def _num(value: Any) -> float | None:
    try:
        return None if value is None or isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        return None


class _Families:
    def __init__(self) -> None:
        self.found: dict[str, tuple[str, list[Sample]]] = {}

    def add(self, name: str, help_: str, value: float | None, **labels: str) -> None:
        entry = self.found.setdefault(f"{PREFIX}_{name}", (help_, []))
        if value is not None:
            entry[1].append(Sample(labels, float(value)))

    def families(self) -> list[Family]:
        return [Family(n, h, tuple(s)) for n, (h, s) in self.found.items()]


def families(facts: FleetFacts) -> list[Family]:
    """Every metric family, one sample per node (or fleet) where the fact was recorded."""
    out = _Families()
    inside, known = 0, False
    for f in facts.nodes:
        n = f.node
        extra = facts.extra.get(n, NodeExtra())
        verdict = verdict_of(f)
        for v in health.VERDICTS:
            out.add("node_verdict", "the latest health verdict (1 for the node's current verdict)",
                    None if verdict is None else float(v == verdict), node=n, verdict=v)
        out.add("node_verdict_timestamp_seconds", "when the health sweep recorded the verdict", f.health_at, node=n)
        rot = in_rotation(f, facts.rotation)
        inside += bool(rot)
        known = known or rot is not None
        out.add("node_in_rotation", "1 while the LiteLLM gateway routes to the node", None if rot is None else float(rot),
                node=n)
        reason = out_reason(f, facts.rotation) if rot is False else None
        for r in REASONS:  # samples only while the node is out
            out.add("node_out_of_rotation", "1 for why the node is out of the rotation (bounded reasons)",
                    None if reason is None else float(r == reason), node=n, reason=r)
        out.add("node_out_of_rotation_seconds", "how long the health sweeps have found the node out of the gateway",
                None if rot is not False or extra.out_since is None else max(0.0, facts.now - extra.out_since), node=n)
        if f.health is not None:
            out.add("node_quarantined", "1 while a quarantine keeps the node out until released",
                    float(_truthy(f.health.get(keys.QUARANTINED))), node=n)
        used = extra.redeploys_in_window
        out.add("node_restart_budget_remaining", "healing redeploys left in the restart window (health.restart_budget)",
                None if used is None else max(0, facts.restart_budget - used), node=n)
        bench = f.bench or {}
        out.add("node_bench_tok_s", "last bench: recipe mean output tok/s (single stream)",
                _num(bench.get(keys.MEAN_TOK_S)) or None, node=n)
        floor = f.floor_tok_s if f.floor_tok_s is not None else _num(bench.get(keys.FLOOR_TOK_S))
        out.add("node_bench_floor_tok_s", "the node's promotion floor (fleet file)", floor, node=n)
        earlier = [m for m in f.bench_means[:-1] if m > 0]
        out.add("node_bench_baseline_tok_s", "median of the node's earlier bench means (its own baseline)",
                _median(earlier[-health.MIN_BENCH_HISTORY * 4:]) if len(earlier) >= health.MIN_BENCH_HISTORY else None,
                node=n)
        out.add("node_mtp_acceptance_ratio", "last bench: MTP speculative-token acceptance (0..1)",
                _num(bench.get(keys.SPEC_ACCEPTANCE_RATE)), node=n)
        cond = (bench.get(keys.BENCH_RECORD) or {}).get("conditions") or {} \
            if isinstance(bench.get(keys.BENCH_RECORD), Mapping) else {}
        out.add("node_bench_sm_clock_mhz", "last bench: median SM clock under load (nvidia-smi; < 1000 MHz: wedge)",
                _num(cond.get("sm_clock_mhz_p50")), node=n)
        out.add("node_bench_power_watts", "last bench: median GPU power under load (nvidia-smi)",
                _num(cond.get("power_w_p50")), node=n)
        out.add("node_quality_score", "last bench: quality phase score, when the bench recorded one",
                _num(bench.get(keys.QUALITY_SCORE)), node=n)
        out.add("node_preflight_free_gib", "free CUDA memory the last deploy's preflight read",
                _num((f.deployment or {}).get(keys.FREE_GIB_AT_PREFLIGHT)), node=n)
        out.add("node_clean_boot_free_gib", "free CUDA memory after a clean boot: the node's own memcheck after its Phase 0 reboot (node_os), "
                "else its hardware profile's figure",
                extra.clean_boot_free_gib, node=n)
        out.add("node_last_good_bench_timestamp_seconds", "when the node's newest promoted bench was recorded",
                extra.last_good_bench_at, node=n)
        out.add("node_seconds_since_good_bench", "seconds since the node's newest promoted bench",
                None if extra.last_good_bench_at is None else max(0.0, facts.now - extra.last_good_bench_at), node=n)
    out.add("fleet_serve_nodes", "serve nodes in the fleet file", len(facts.nodes))
    out.add("fleet_rotation_size", "nodes the gateway routes to (no sample before any sweep or gateway record)",
            inside if known else None)
    out.add("fleet_min_in_rotation", "gateway.min_in_rotation: the floor a drain or reconcile never goes below",
            facts.min_in_rotation)
    out.add("fleet_bench_max_seconds", "health.bench_max_s: longer out than a bench takes is an alert",
            facts.bench_max_s)
    out.add("fleet_restart_budget", "health.restart_budget: healing redeploys per node per window", facts.restart_budget)
    out.add("fleet_rollout_in_progress", "1 while a fleet_rollout run is queued or running",
            None if facts.rollout_in_progress is None else float(facts.rollout_in_progress))
    sweeps = [f.health_at for f in facts.nodes if f.health_at is not None]
    out.add("fleet_last_sweep_timestamp_seconds", "the newest health-sweep verdict recorded for any node",
            max(sweeps) if sweeps else None)
    return out.families()


def _median(values: Sequence[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def exposition(fams: Iterable[Family]) -> str:
    """The text format (version 0.0.4), for a textfile or a test; the exporter serves the same
    families through prometheus_client."""
    lines = []
    for fam in fams:
        lines += [f"# HELP {fam.name} {fam.help}", f"# TYPE {fam.name} {fam.kind}"]
        for s in fam.samples:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels.items())
            lines.append(f"{fam.name}{{{labels}}} {s.value:g}" if labels else f"{fam.name} {s.value:g}")
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
