"""How numbers reach the UI: rounded, typed, the unit in the key or the column name.

Markdown metadata hides behind "[Show Markdown]" in the UI; tables, urls, paths, ints and floats
show inline. So what an operator reads first is a `table` (with a schema), the rest md.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg

from spark_pipelines.core import bench as bench_core
from spark_pipelines.core.summary import ratio


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
