"""Bench results per node, measured in isolation: drained from the gateway, zero requests running
(read from vLLM's /metrics), then restored in every outcome except a completed bench below the
node's floor, which keeps the node out of rotation and says why."""


import base64
import threading
import time

import dagster as dg

from spark_pipelines.assets import markers
from spark_pipelines.assets.gateway import BENCH_GATE
from spark_pipelines.assets.nodes import api_root, engine_metrics, node_partitions, read_gpu
from spark_pipelines.bench_client import run_bench
from spark_pipelines.core import bench as bench_core
from spark_pipelines.core import gpu
from spark_pipelines.core.pins import code_versions
from spark_pipelines.fleet import Fleet, Node
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.ssh import FleetSession, FleetSSH

DRAIN_TIMEOUT_S = 120
GPU_SAMPLE_EVERY_S = 2.0


class GpuSampler:
    """Reads the node's nvidia-smi while the bench drives load: the PD-firmware wedge only shows
    under load (runbook: "run nvidia-smi ... during load -- if <1000 MHz, cold-drain is required").
    A thread, because the bench client owns this thread's event loop."""

    def __init__(self, s: FleetSession, node: Node, every_s: float = GPU_SAMPLE_EVERY_S) -> None:
        self._s, self._node, self._every = s, node, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"gpu-sampler-{node.name}", daemon=True)
        self.readings: list[gpu.GpuReading] = []
        self.errors: list[str] = []

    def __enter__(self) -> "GpuSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.readings.append(read_gpu(self._s, self._node.name, timeout=20))
            except Exception as e:  # a sample lost must not fail the bench it watches
                self.errors.append(f"{type(e).__name__}: {e}")

    def verdict(self) -> gpu.GpuVerdict:
        v = gpu.judge_under_load(self.readings)
        if self.errors:
            v = gpu.GpuVerdict(state=v.state, reasons=[*v.reasons, f"{len(self.errors)} sample(s) unreadable: "
                                                       f"{self.errors[-1]}"])
        return v


def wait_idle(fleet: Fleet, node: Node, timeout_s: float = DRAIN_TIMEOUT_S) -> float:
    """Wait until vLLM reports no running or waiting request; returns the seconds waited."""
    started = time.monotonic()
    while True:
        m = engine_metrics(fleet, node)
        if m is None:
            raise dg.Failure(description=f"{node.name}: vLLM /metrics does not answer; is the deployment up?")
        busy = m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)
        if busy == 0:
            return round(time.monotonic() - started, 1)
        if time.monotonic() - started > timeout_s:
            raise dg.Failure(description=f"{node.name} still has {busy:g} requests in flight {timeout_s:.0f} s after "
                             "leaving the gateway; something else talks to it directly")
        time.sleep(1)


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


def build_bench_assets(fleet: Fleet) -> list[dg.AssetsDefinition]:
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
        was_in = node.name in gw.rotation()
        if was_in:
            gw.drain(node.name)
        try:
            waited = wait_idle(f, node)
            with GpuSampler(s, node) as sampler:
                report = run_bench(api_root(f, node), launch.served_model_name, suite=f.bench.suite,
                                   concurrency=f.bench.loaded_concurrency, repeats=f.bench.repeats)
        except BaseException:
            if was_in:  # nothing is lost: a failed bench puts the node back
                gw.restore(node.name)
            raise
        mean = report.recipe_mean_tok_s.median if report.recipe_mean_tok_s else None
        loaded = next((p.aggregate_tok_s.median for p in report.phases
                       if p.phase != bench_core.PHASE_RECIPE and p.aggregate_tok_s), None)
        gpu_verdict = sampler.verdict()
        promoted, reason = bench_core.promotion_gate(mean, floor, gpu_verdict)
        markers.write(s, node, BENCH_GATE, "-", promoted=promoted, reason=reason, mean_tok_s=mean)
        if promoted:  # a no-op (no reload) when the node is already in every pool
            gw.restore(node.name)
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

    return [bench_results]
