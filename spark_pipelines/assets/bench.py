"""Bench results per node, measured in isolation: drained from the gateway, zero requests running
(read from vLLM's /metrics), then restored in every outcome except a completed bench below the
node's floor, which keeps the node out of rotation and says why."""


import base64
import time

import dagster as dg

from spark_pipelines.assets import fail
from spark_pipelines.assets.nodes import node_partitions
from spark_pipelines.bench_client import run_bench
from spark_pipelines.core import bench as bench_core
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.core.pins import code_versions
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.runbook import markers
from spark_pipelines.runbook.bench import GpuSampler, wait_idle
from spark_pipelines.runbook.engine import api_root
from spark_pipelines.runbook.errors import RunbookError
from spark_pipelines.runbook.rotation import BENCH_GATE, drained


# Every bench run carries this tag; the instance's run queue runs one at a time (demo.prepare_instance_home).
BENCH_TAG = "spark/bench"


def history_points(context: dg.AssetExecutionContext, node: str) -> list[tuple[float, float]]:
    records = context.instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("bench_results"), asset_partitions=[node]), limit=50
    ).records
    points = []
    for rec in records:
        mat = rec.asset_materialization
        v = mat.metadata.get("mean_tok_s") if mat else None
        if v is not None:
            points.append((rec.timestamp, float(v.value)))
    return points


def bench_definitions(fleet: Fleet) -> dg.Definitions:
    cv = code_versions(fleet)

    @dg.asset(
        group_name="bench",
        kinds={"vllm"},
        partitions_def=node_partitions(fleet),
        code_version=cv["bench_results"],
        deps=["node_deployment", "gateway"],
        check_specs=[dg.AssetCheckSpec("above_floor", asset="bench_results")],
        description="The recipe's suite (+ loaded phase) on one node in isolation; gates the node's promotion.",
    )
    def bench_results(context: dg.AssetExecutionContext, ssh: FleetSSH, litellm: LiteLLMGateway):
        s = ssh.session
        f = s.fleet
        node = f.node(context.partition_key)
        launch = f.launch_for(node)
        floor = f.bench_floor(node)
        gw = litellm.host()
        try:
            with node_lease(s, node.name, "bench", run_id=context.run.run_id), drained(gw, node.name) as drain:
                waited = wait_idle(f, node)
                with GpuSampler(s, node) as sampler:
                    report = run_bench(api_root(f, node), launch.served_model_name, suite=f.bench.suite,
                                       concurrency=f.bench.loaded_concurrency, repeats=f.bench.repeats,
                                       reference_mean_tok_s=f.bench.reference_tok_s)
                mean = report.recipe_mean_tok_s.median if report.recipe_mean_tok_s else None
                loaded = next((p.aggregate_tok_s.median for p in report.phases
                               if p.phase != bench_core.PHASE_RECIPE and p.aggregate_tok_s), None)
                gpu_verdict = sampler.verdict()
                promoted, reason = bench_core.promotion_gate(mean, floor, gpu_verdict)
                markers.write(s, node, BENCH_GATE, "-", promoted=promoted, reason=reason, mean_tok_s=mean)
                drain.keep_out = not promoted
        except RunbookError as e:
            fail(e)
        meta: dict = {
            "mean_tok_s": float(mean or 0.0),
            "reference_tok_s": f.bench.reference_tok_s,
            "vs_reference": round((mean or 0.0) / f.bench.reference_tok_s, 3),
            "floor_tok_s": floor,
            "drain_wait_s": waited,
            "promoted": promoted,
            "gpu_under_load": gpu_verdict.state,
            "gpu_samples": len(sampler.readings),
            "gpu_verdict": "; ".join(gpu_verdict.reasons),
            "isolation": report.isolation,
            "table": dg.MetadataValue.md(bench_core.render_markdown(report)),
        }
        if loaded is not None:
            meta["loaded_aggregate_tok_s"] = float(loaded)
        if report.counters is not None and report.counters.acceptance_rate is not None:
            meta["spec_acceptance_rate"] = float(report.counters.acceptance_rate)
        try:
            from spark_pipelines.bench_chart import render_history_png

            png = render_history_png(history_points(context, node.name) + [(time.time(), float(mean or 0.0))],
                                     title=f"{node.name} bench history", reference=f.bench.reference_tok_s)
            meta["history"] = dg.MetadataValue.md(f"![history](data:image/png;base64,{base64.b64encode(png).decode()})")
        except Exception as e:  # a chart must never fail a bench
            context.log.warning(f"bench history chart not rendered: {e}")
        yield dg.Output(report.to_dict(), metadata=meta)
        yield dg.AssetCheckResult(
            check_name="above_floor",
            passed=promoted,
            severity=dg.AssetCheckSeverity.ERROR,
            description=reason,
            metadata={"mean_tok_s": float(mean or 0.0), "floor_tok_s": floor, "gpu_under_load": gpu_verdict.state},
        )

    bench_job = dg.define_asset_job("bench_job", selection=dg.AssetSelection.groups("bench"), tags={BENCH_TAG: "bench"},
                                    description="Isolated bench of one node (a partition): drained from the gateway, "
                                                "zero requests in flight, recipe suite + loaded phase, then restored.")
    return dg.Definitions(assets=[bench_results], jobs=[bench_job])
