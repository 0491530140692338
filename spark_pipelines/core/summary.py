"""The fleet summary an operator opens first: one row per node, from what the steps recorded.

Pure: the shell hands in each node's latest recorded facts (deployment, artifacts, bench, health
sweep, gateway rotation) as plain values; this decides the row. A fact never recorded reads "-".
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import record_keys as keys

MISSING = "-"
BLOCKS = "▁▂▃▄▅▆▇█"
TREND_POINTS = 12

# (column, type, what it says): the table schemas the UI shows under the column headers. Each
# table is narrow enough to be whole in the asset pane at 1600 px (a column that grows with its
# text gets a table of its own, next to the node's name only): who serves and how fast; why a
# node is out and what the sweep saw; the bench against the reference; what runs, since when.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("node", "string", "serve node (partition)"),
    ("health", "string", "latest verdict: the health sweep's (healthy, starting, engine-down, crash-loop, residue, "
                         "wedged, regressed, unreachable, unknown), or the deploy's own check when newer"),
    ("gateway", "string", "in or out of the LiteLLM rotation, and who put it out (bench, quarantine, drain, health, "
                          "deploy, rollout); the reason is in the detail table"),
    ("mean tok/s", "number", "last bench: recipe mean output tok/s (single stream)"),
    ("floor tok/s", "number", "the node's promotion floor"),
)
DETAIL_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("node", "string", "serve node (partition)"),
    ("why", "string", "out of the gateway: why (the gateway's, the bench gate's or the quarantine's own words); "
                      "then what the last health sweep saw and the runbook's advice"),
)
BENCH_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("node", "string", "serve node (partition)"),
    ("trend", "string", f"the last {TREND_POINTS} bench means, oldest first, scaled from 0 (the chart at a glance)"),
    ("vs reference", "string", "last bench mean / the recipe's reference (x)"),
    ("MTP acceptance (%)", "number", "last bench: speculative-token acceptance"),
    ("quality (/100)", "number", "last bench: quality phase score (the lower of sequential and parallel 4); "
                                 "a failed deterministic check is named in the detail table"),
)
VERSION_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("node", "string", "serve node (partition)"),
    ("image id", "string", "serving image id the node runs (sha256, first 12)"),
    ("checkpoint", "string", "checkpoint version on the node (safetensors index digest, first 12)"),
)
WHEN_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("node", "string", "serve node (partition)"),
    ("last bench (UTC)", "string", "when the last bench was recorded (FAILED: its newest bench run failed after it)"),
    ("last deploy (UTC)", "string", "when node_deployment was last recorded"),
)
# A committed (or adopted) deploy verified /health, readiness and a smoke answer itself.
HEALTHY_AT_DEPLOY = "healthy (deploy)"


@dataclass(frozen=True)
class NodeFacts:
    """The latest recorded facts about one node; None where nothing was recorded yet."""

    node: str
    deployment: Mapping[str, Any] | None = None
    deployed_at: float | None = None
    artifacts: Mapping[str, Any] | None = None
    bench: Mapping[str, Any] | None = None
    benched_at: float | None = None
    health: Mapping[str, Any] | None = None
    health_at: float | None = None  # when the newest sweep verdict was recorded
    floor_tok_s: float | None = None
    bench_means: Sequence[float] = ()  # every recorded bench mean, oldest first
    reference_tok_s: float | None = None
    bench_failed_at: float | None = None  # its newest bench run failed (after the last recorded bench)
    bench_failure: str | None = None  # that run's failure, first line


@dataclass(frozen=True)
class Rotation:
    """The gateway's rotation as last recorded (its materialization or a later drain/restore)."""

    nodes: Sequence[str] = ()
    left_out: Mapping[str, str] = field(default_factory=dict)
    known: bool = False
    at: float = 0.0  # when it was recorded (epoch seconds)


def when(ts: float | None) -> str:
    if ts is None:
        return MISSING
    return dt.datetime.fromtimestamp(ts, tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M")


def short_id(value: Any) -> str:
    """An image id or digest as the UI shows it: 12 hex digits (sha256: prefix dropped)."""
    if not value or str(value) in ("none", "missing"):
        return MISSING
    text = str(value)
    return (text.split(":", 1)[1] if text.startswith("sha256:") else text)[:12]


def rounded(value: Any, digits: int = 1) -> float | None:
    try:
        return None if value is None else round(float(value), digits)
    except (TypeError, ValueError):
        return None


# Who put a node out, from the words of its reason: the narrow table's short state.
_WHO = (("quarantin", "quarantined"), ("held out by its bench", "bench"), ("bench", "bench"), ("floor", "bench"),
        ("held out by its deploy", "deploy"), ("held out by its rollout", "rollout"), ("rollout", "rollout"),
        ("health: ", "health"), ("/health", "down"), ("drain", "drained"), ("deploy", "deploy"))


def gateway_short(state: str) -> str:
    """'in', or 'out (who)': what fits the narrow table whatever the reason's length."""
    if state in ("in", MISSING, "out"):
        return state
    why = state.removeprefix("out: ").lower()
    return next((f"out ({who})" for words, who in _WHO if words in why), "out")


def gateway_state(facts: NodeFacts, rotation: Rotation) -> str:
    """'in' or 'out: why'. The health sweep's quarantine and the bench gate say why a node is out
    when the gateway did not record a reason itself."""
    health = facts.health or {}
    if rotation.known:
        if facts.node in rotation.nodes:
            return "in"
        why = rotation.left_out.get(facts.node)
    else:
        in_gw = health.get(keys.IN_GATEWAY)
        if in_gw is None:
            return MISSING
        if in_gw in (True, "true", "True", "yes"):
            return "in"
        why = None
    if not why and health.get(keys.QUARANTINED) not in (None, False, "false", "False", "no", ""):
        why = f"quarantined: {health.get(keys.QUARANTINED)}" if isinstance(health.get(keys.QUARANTINED), str) \
            else "quarantined by the health sweep"
    if not why and facts.bench and facts.bench.get(keys.PROMOTED) is False:
        why = str(facts.bench.get(keys.GATE) or "below its bench floor")
    return f"out: {why}" if why else "out"


def ratio(value: float | None) -> str:
    """A ratio as people read one: two decimals and an x (1.00x, not 1)."""
    return MISSING if value is None else f"{value:.2f}x"


def ratio_text(recorded: Any) -> str:
    """A recorded ratio as `ratio` says it: the text itself, or an older record's bare float."""
    if isinstance(recorded, str):
        return recorded
    return ratio(rounded(recorded, 2))


def trend(values: Sequence[float], points: int = TREND_POINTS) -> str:
    """The last `points` bench means as a sparkline, oldest first, scaled from 0 like the chart
    (a 0.1 tok/s wobble stays flat; a node at a third of its speed reads low at a glance)."""
    tail = [float(v) for v in values][-points:]
    if not tail:
        return MISSING
    top = max(tail) or 1.0
    return "".join(BLOCKS[min(len(BLOCKS) - 1, int(v / top * (len(BLOCKS) - 1) + 0.5))] for v in tail)


def health_of(facts: NodeFacts) -> str:
    """The sweep's verdict, unless the node's deploy is newer: then the deploy's own health check."""
    verdict = (facts.health or {}).get(keys.VERDICT)
    if facts.deployment is not None and facts.deployed_at is not None and (
            verdict is None or facts.health_at is None or facts.deployed_at > facts.health_at):
        return HEALTHY_AT_DEPLOY
    return str(verdict or MISSING)


def summary_row(facts: NodeFacts, rotation: Rotation) -> dict[str, Any]:
    """One node's row, keyed by the COLUMNS and DETAIL_COLUMNS names."""
    dep = facts.deployment or {}
    art = facts.artifacts or {}
    bench = facts.bench or {}
    health = facts.health or {}
    said = "; ".join(line.strip() for line in str(health.get(keys.EVIDENCE) or "").splitlines() if line.strip())
    evidence = " -> ".join(t for t in (said, str(health.get(keys.ADVICE) or "")) if t) or MISSING
    mean = rounded(bench.get(keys.MEAN_TOK_S), 1) if bench else None
    reference = facts.reference_tok_s or rounded(bench.get(keys.REFERENCE_TOK_S))
    floor = facts.floor_tok_s if facts.floor_tok_s is not None else rounded(bench.get(keys.FLOOR_TOK_S))
    acceptance = bench.get(keys.SPEC_ACCEPTANCE_RATE)
    gateway = gateway_state(facts, rotation)
    out = gateway.removeprefix("out: ") if gateway.startswith("out") else ""
    return {
        "node": facts.node,
        "health": health_of(facts),
        "gateway": gateway_short(gateway),
        "mean tok/s": mean,
        "floor tok/s": rounded(floor),
        "why": (f"out of the gateway: {out}. " if out and out != "out" else "out of the gateway. " if out else "")
               + (f"Last bench run FAILED {when(facts.bench_failed_at)}: {facts.bench_failure or 'see its run'}. "
                  if facts.bench_failed_at else "")
               + (f"Quality checks failed: {bench.get(keys.QUALITY_CHECKS)}. "
                  if bench.get(keys.QUALITY_CHECKS) not in (None, "all passed") else "")
               + (f"Health: {evidence}" if evidence != MISSING else
                  "Health: no sweep recorded (node_health off)" + ("; its deploy verified it"
                                                                   if facts.deployment is not None else "")),
        "evidence": evidence,
        "trend": trend(facts.bench_means),
        "vs reference": ratio(mean / reference if mean is not None and reference else None),
        "MTP acceptance (%)": rounded(float(acceptance) * 100, 1) if acceptance is not None else None,
        "quality (/100)": rounded(bench.get(keys.QUALITY_SCORE)),
        "quality checks": str(bench.get(keys.QUALITY_CHECKS) or MISSING),
        "image id": short_id(dep.get(keys.IMAGE_ID) or art.get(keys.IMAGE_ID)),
        "checkpoint": short_id(art.get(keys.CHECKPOINT)),
        "last bench (UTC)": when(facts.benched_at) + (f" (FAILED {when(facts.bench_failed_at)})"
                                                      if facts.bench_failed_at else ""),
        "last deploy (UTC)": when(facts.deployed_at),
    }


def summary_rows(facts: Sequence[NodeFacts], rotation: Rotation) -> list[dict[str, Any]]:
    return [summary_row(f, rotation) for f in facts]



def headline(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line for the asset's description of this materialization: how many serve, who is out."""
    inside = [r["node"] for r in rows if r["gateway"] == "in"]
    out = [f"{r['node']} {r['gateway'].removeprefix('out ')}".rstrip() for r in rows
           if r["gateway"] not in ("in", MISSING)]
    text = f"{len(inside)} of {len(rows)} node(s) in the gateway"
    return text + (f"; out: {', '.join(out)}" if out else "")
