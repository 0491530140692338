"""A bench as bench_results records it: the figures, the gate, every node's latest, the fleet's
baseline beside it, the history chart. Shared by the assets that record a bench (bench_results,
a rollout's gate, add_node's first bench): rendering only, no procedure."""

import base64
import re
import time
from pathlib import Path

import dagster as dg

from spark_pipelines.assets.metadata import bench_table, count, num, table
from spark_pipelines.core import steps
from spark_pipelines.core import baseline
from spark_pipelines.core import record_keys as keys
from spark_pipelines.core import bench as bench_core
from spark_pipelines.core import quality as quality_core
from spark_pipelines.core import summary
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.retention import prune
from spark_pipelines.runbook.bench import Benched
from spark_pipelines.state import records
from spark_pipelines.resources.engine import api_root
from spark_pipelines.core.errors import first_line


CHART_NAME = re.compile(r"bench-history-\d{8}T\d{6}-[A-Za-z0-9._-]+\.png")  # the charts chart_metadata writes


# Every node's latest bench in two tables, each whole in the asset pane at 1600 px.
LATEST_COLUMNS = (
    ("node", "string", "serve node"),
    ("mean tok/s", "number", "recipe mean output tok/s"),
    ("vs reference", "string", "mean / the recipe's reference (x, two decimals)"),
    ("floor tok/s", "number", "the node's promotion floor"),
    ("promoted", "bool", "passed above_floor"),
)


LATEST_MORE_COLUMNS = (
    ("node", "string", "serve node"),
    ("benched (UTC)", "string", "when its last bench was recorded"),
    ("trend", "string", f"the last {summary.TREND_POINTS} bench means, oldest first, scaled from 0"),
    ("quality (/100)", "number", "quality phase score (the lower of sequential and parallel 4)"),
)


def latest_by_node(context: dg.AssetExecutionContext | dg.OpExecutionContext, fleet: Fleet, this: dict,
                   history: dict[str, list[tuple[float, float]]]) -> list[dict]:
    """Every node's last bench, this one's from this run: the asset's Overview shows the latest
    materialization of any partition, so each one carries every node's latest figures by name."""
    rows = []
    for n in fleet.serve_nodes:
        if n.name == this["node"]:
            rows.append(this)
            continue
        rec = records.latest(context.instance, steps.BENCH_RESULTS, n.name)
        if rec is None or rec.asset_materialization is None:
            rows.append({"node": n.name, "benched (UTC)": summary.MISSING})
            continue
        m = records.values(rec.asset_materialization)
        rows.append({"node": n.name, "benched (UTC)": summary.when(rec.timestamp),
                     "mean tok/s": summary.rounded(m.get(keys.MEAN_TOK_S), 1),
                     "trend": summary.trend([v for _, v in history[n.name]]),
                     "vs reference": summary.ratio_text(m.get(keys.VS_REFERENCE)),
                     "floor tok/s": summary.rounded(m.get(keys.FLOOR_TOK_S)),
                     "quality (/100)": summary.rounded(m.get(keys.QUALITY_SCORE)), "promoted": m.get(keys.PROMOTED)})
    return rows


def vs_fleet(context: dg.AssetExecutionContext | dg.OpExecutionContext, fleet: Fleet, rec: baseline.BenchRecord) -> dict:
    """This bench next to every node's latest and the fleet's baseline on the same image, checkpoint
    and launch spec (void benches never count); read back from each node's recorded bench_record."""
    benches, latest = [rec], {}
    for n in fleet.serve_nodes:
        if n.name == rec.node:
            latest[n.name] = rec
            continue
        mine = records.recorded_benches(context.instance, n.name)
        benches += mine
        latest[n.name] = mine[0] if mine else None
    base = baseline.fleet_baseline(benches, identity=rec.identity)
    meta: dict = {"fleet_baseline": base.text() if base else "none yet (no comparable bench that counts)",
                  **side_by_side_tables(baseline.side_by_side(latest, base))}
    if base and rec.valid and rec.tok_s is not None:
        meta["vs_fleet_baseline_x"] = num(rec.tok_s / base.tok_s, 3)
    return meta


def side_by_side_tables(rows: list[dict]) -> dict:
    """baseline.SIDE_BY_SIDE_COLUMNS in three tables, each whole in the asset pane: the figures and
    whether each bench counts, the GPU under load, what the bench ran (image, checkpoint, spec)."""
    cols = {c[0]: c for c in baseline.SIDE_BY_SIDE_COLUMNS}
    pick = lambda *names: [cols[n] for n in ("node", *names)]  # noqa: E731
    return {"vs_fleet": table(pick("mean tok/s", "vs baseline (x)", "MTP acceptance %", "counts"), rows),
            "vs_fleet_gpu": table(pick("SM MHz p50", "power W p50"), rows),
            "vs_fleet_versions": table(pick("image", "checkpoint", "launch spec", "driver"), rows)}


def chart_metadata(context: dg.AssetExecutionContext | dg.OpExecutionContext, fleet: Fleet, node: str,
                   history: dict[str, list[tuple[float, float]]]) -> dict:
    """The fleet's bench history: a PNG file (path, inline) and the same image as markdown."""
    from spark_pipelines.assets.bench_chart import render_fleet_history_png

    series = {k: v for k, v in history.items() if v}
    if not series:
        return {}
    png = render_fleet_history_png(series, floors={n.name: fleet.bench_floor(n) for n in fleet.serve_nodes
                                                    if n.name in series},
                                   reference=fleet.bench.reference_tok_s)
    meta: dict = {"history_chart": dg.MetadataValue.md(
        f"![bench history](data:image/png;base64,{base64.b64encode(png).decode()})")}
    try:
        directory = Path(context.instance.storage_directory()) / "bench-charts"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"bench-history-{time.strftime('%Y%m%dT%H%M%S')}-{node}.png"
        path.write_bytes(png)
        meta["history_chart_png"] = dg.MetadataValue.path(str(path))
        prune(directory, CHART_NAME, max_age_days=fleet.retention.max_age_days, max_files=fleet.retention.bench_charts)
    except OSError as e:
        context.log.warning(f"bench history chart not saved to a file: {first_line(e)}")
    return meta


def bench_metadata(context: dg.AssetExecutionContext | dg.OpExecutionContext, fleet: Fleet, node: str,
                   b: Benched) -> dict:
    """What a bench_results materialization carries (the asset's and a rollout's bench gate)."""
    f = fleet
    floor = f.bench_floor(f.node(node))
    mean_v = float(b.mean or 0.0)
    vs_ref = round(mean_v / f.bench.reference_tok_s, 2)
    meta: dict = {
        # The keys other code reads back (demo table, doctor, history chart, summary): core/record_keys.py.
        # tok/s at one decimal on every page (the summary, the demo's table, this one).
        keys.MEAN_TOK_S: num(mean_v, 1),
        keys.VS_REFERENCE: summary.ratio(vs_ref),  # "1.00x", as every table says it
        keys.REFERENCE_TOK_S: num(f.bench.reference_tok_s, 1),
        keys.FLOOR_TOK_S: num(floor, 1),
        keys.PROMOTED: b.promoted,
        keys.GATE: b.reason,
        "drain_wait_s": num(b.waited_s, 1),
        keys.GPU_UNDER_LOAD: b.gpu_verdict.state,
        "gpu_samples": count(b.samples),
        "gpu_verdict": "; ".join(b.gpu_verdict.reasons) or "-",
        "isolation": b.report.isolation,
        # What makes it comparable (core/baseline.py); a void bench is never a baseline.
        keys.BENCH_RECORD: dg.MetadataValue.json(baseline.readable(b.record.to_dict())),
        "void": "; ".join(b.record.void) or "no",
        "endpoint": dg.MetadataValue.url(api_root(f, f.node(node))),
        **bench_table(b.report),
        "report": dg.MetadataValue.md(bench_core.render_markdown(b.report)
                                      + ("\n" + quality_core.render_markdown(b.quality) if b.quality else "")),
        keys.BENCH_PROTOCOL: (b.report.protocol or {}).get("key") or "not recorded",
    }
    meta.update(quality_metadata(b.quality, f.bench.floor_quality))
    if b.loaded is not None:
        meta[keys.LOADED_AGGREGATE_TOK_S] = num(b.loaded, 1)
    if b.acceptance is not None:
        meta[keys.SPEC_ACCEPTANCE_RATE] = num(b.acceptance, 3)
        meta["mtp_acceptance_pct"] = num(b.acceptance * 100, 1)
    # Every node's bench history read once, oldest first, this bench last on its own node.
    history = {n.name: list(reversed(records.bench_points(context.instance, n.name))) for n in f.serve_nodes}
    history[node] = history.get(node, []) + ([(time.time(), mean_v)] if mean_v > 0 else [])
    this = {"node": node, "benched (UTC)": summary.when(time.time()), "mean tok/s": round(mean_v, 1),
            "trend": summary.trend([v for _, v in history[node]]),
            "vs reference": summary.ratio(vs_ref), "floor tok/s": floor,
            "quality (/100)": b.quality.score if b.quality is not None else None, "promoted": b.promoted}
    # First: the asset's Overview shows the newest materialization of any node, so every node's
    # latest figures head it (one node's own page is the Partitions tab with that node selected).
    latest = latest_by_node(context, f, this, history)
    meta = {"latest_by_node": table(LATEST_COLUMNS, latest), "latest_by_node_more": table(LATEST_MORE_COLUMNS, latest),
            **meta}
    meta.update(vs_fleet(context, f, b.record))
    try:
        meta.update(chart_metadata(context, f, node, history))
    except Exception as e:  # a chart must never fail a bench
        context.log.warning(f"bench history chart not rendered: {first_line(e)}")
    return meta


def quality_metadata(q: quality_core.QualityReport | None, floor: float | None) -> dict:
    """The quality phase's figures on bench_results (per node: each partition is one node)."""
    if q is None:
        return {}
    meta: dict = {"quality_suite": q.suite, "quality": q.text(),
                  keys.QUALITY_CHECKS: "; ".join(f"{k}: {v}" for k, v in q.failed_checks().items()) or "all passed",
                  "quality_s": num(q.seconds, 2)}
    if q.score is not None:
        meta[keys.QUALITY_SCORE] = num(q.score, 1)
    for r in q.runs:
        meta[f"quality_{r.mode.replace(' ', '')}"] = num(r.score, 1)  # quality_sequential, quality_parallel4
    if floor is not None:
        meta["floor_quality"] = num(floor, 1)
    return meta

