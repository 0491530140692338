"""How numbers reach the UI: rounded, typed, the unit in the key or the column name.

Markdown metadata hides behind "[Show Markdown]" in the UI; tables, urls, paths, ints and floats
show inline. So what an operator reads first is a `table` (with a schema), the rest md.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from spark_pipelines.core import bench as bench_core
from spark_pipelines.core.summary import ratio
from spark_pipelines.core.fleet import Fleet, Node
from spark_pipelines.core.launch import LaunchSpec
from spark_pipelines.resources.engine import api_root
from spark_pipelines.runbook.deploy import NodeDeployed, diagnosis_md
from spark_pipelines.runbook.node_os import Provisioned
from spark_pipelines.core import record_keys as keys


def num(value: float | int | None, digits: int = 2) -> dg.MetadataValue:
    """A float rounded for reading (a 15-digit float says nothing more); None reads as null."""
    if value is None:
        return dg.MetadataValue.null()
    return dg.MetadataValue.float(round(float(value), digits))


def count(value: int | None) -> dg.MetadataValue:
    return dg.MetadataValue.null() if value is None else dg.MetadataValue.int(int(value))


def table(columns: Sequence[tuple[str, str, str]], rows: Sequence[Mapping[str, Any]]) -> dg.MetadataValue:
    """Rows as an inline table; columns are (name, type, description) with type string|number|bool."""
    schema = dg.TableSchema(columns=[dg.TableColumn(name, type=kind, description=desc)
                                     for name, kind, desc in columns])
    records = [dg.TableRecord({name: _cell(row.get(name)) for name, _, _ in columns}) for row in rows]
    return dg.MetadataValue.table(records=records, schema=schema)


def rounded_json(value: Any, digits: int = 4) -> Any:
    """A JSON value for the UI with floats rounded (0.9465, not 0.9465020576131687)."""
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: rounded_json(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded_json(v, digits) for v in value]
    return value


def _cell(value: Any) -> str | int | float | bool | None:
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, float):
        return round(value, 2)
    return str(value)


# The bench rows in two tables (speed, latency), each whole in the asset pane at 1600 px.
BENCH_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("prompt", "string", "the recipe's prompt (single stream), mean, or the loaded phase's request count x concurrency"),
    ("tok/s", "number", "output tokens per second per request (median); loaded: aggregate"),
    ("reference tok/s", "number", "the recipe's figure for this prompt"),
    ("vs reference", "string", "tok/s / reference (x, two decimals)"),
)
LATENCY_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("prompt", "string", "the recipe's prompt, or the loaded phase's request count x concurrency"),
    ("measured", "number", "requests that count (warm-up and failures excluded)"),
    ("TTFT ms", "number", "time to first token (median)"),
    ("TPOT ms", "number", "time per output token (median)"),
    ("failures", "number", "requests that failed"),
)


def _ms(spread: bench_core.Spread | None) -> float | None:
    return None if spread is None else round(spread.median * 1000, 1)


def _median(spread: bench_core.Spread | None, digits: int = 1) -> float | None:
    return None if spread is None else round(spread.median, digits)


def bench_rows(report: bench_core.BenchReport) -> list[dict[str, Any]]:
    """One row per recipe prompt, a mean row, one row per loaded phase: the bench table, inline."""
    rows: list[dict[str, Any]] = []
    for p in report.prompts:
        if p.phase != bench_core.PHASE_RECIPE:
            continue
        tok = _median(p.tok_s)
        rows.append({"phase": p.phase, "prompt": p.prompt, "max tokens": p.max_tokens, "measured": p.measured,
                     "tok/s": tok, "reference tok/s": p.reference_tok_s,
                     "vs reference": ratio(tok / p.reference_tok_s if tok and p.reference_tok_s else None),
                     "TTFT ms": _ms(p.ttft_s), "TPOT ms": _ms(p.tpot_s), "failures": p.failures})
    mean = report.recipe_mean_tok_s
    if mean is not None:
        ref = report.reference_mean_tok_s
        rows.append({"phase": bench_core.PHASE_RECIPE, "prompt": "mean", "tok/s": _median(mean),
                     "reference tok/s": ref, "vs reference": ratio(mean.median / ref if ref else None)})
    for ph in report.phases:
        if ph.phase == bench_core.PHASE_RECIPE:
            continue
        rows.append({"phase": ph.phase, "prompt": f"{ph.requests_per_repeat} requests, {ph.concurrency} at once",
                     "measured": ph.requests_per_repeat, "tok/s": _median(ph.aggregate_tok_s),
                     "TTFT ms": _ms(ph.ttft_s), "TPOT ms": _ms(ph.tpot_s)})
    return rows


def bench_table(report: bench_core.BenchReport) -> dict[str, dg.MetadataValue]:
    """`table` (speed against the reference) and `latency`, from the same rows."""
    rows = bench_rows(report)
    return {"table": table(BENCH_COLUMNS, rows), "latency": table(LATENCY_COLUMNS, [r for r in rows if "TTFT ms" in r])}


def readable(meta: Mapping[str, Any], digits: int = 2) -> dict[str, Any]:
    """The same metadata with every plain float rounded (keys unchanged: readers keep working)."""
    return {k: num(v, digits) if isinstance(v, float) else v for k, v in meta.items()}


def where(fleet: Fleet, node: Node, spec: LaunchSpec, container: dict | None) -> dict[str, Any]:
    """What runs: image id, container id, endpoint."""
    c = container or {}
    return {"image_id": str(c.get("Image") or "none"), "container_id": str(c.get("Id") or "none")[:12],
            "container": spec.container_name, "endpoint": dg.MetadataValue.url(api_root(fleet, node))}


def deploy_metadata(fleet: Fleet, node: Node, d: NodeDeployed) -> dict[str, Any]:
    """A node_deployment materialization's fields (its own run, a rollout's deploy, add_node's)."""
    done = d.done
    return readable({
        "skipped": False,
        **done.metadata,
        **where(fleet, node, d.spec, d.running),
        "docker_run": dg.MetadataValue.text(shlex.join((done.spec or d.spec).docker_run_argv())),
        "preflight": dg.MetadataValue.md(done.preflight),
        "warnings": dg.MetadataValue.md(diagnosis_md(done.findings) if done.findings else "none"),
        "smoke_completion_tokens": done.smoke_tokens,
    })


def _bullets(lines: list[str], empty: str) -> dg.MetadataValue:
    return dg.MetadataValue.md("\n".join(f"- {line}" for line in lines) if lines else empty)


def node_os_metadata(p: Provisioned) -> dict[str, Any]:
    """A Phase 0 run's fields on node_os (its own run, add_node's)."""
    return {
        "mode": "check (nothing changed)" if p.check_only else "applied",
        "changes": len(p.planned),
        "planned": _bullets(p.planned, "nothing differs from the runbook's Phase 0"),
        "applied": _bullets(p.applied, "nothing changed"),
        "rebooted": p.rebooted,
        "masked_again": _bullets(p.remasked, "none came back"),
        "steps": _bullets(p.steps, "none"),
        "notes": _bullets(p.notes, "none"),
        keys.CLEAN_BOOT_FREE_GIB: num(p.clean_boot_free_gib),  # null: not measured in this run
    }

