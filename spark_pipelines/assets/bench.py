"""Bench results per node, measured in isolation: drained from the gateway, zero requests running
(read from vLLM's /metrics), then restored in every outcome except a completed bench below the
node's floor, which keeps the node out of rotation and says why."""


import time

import dagster as dg

from spark_pipelines.assets import node_check, node_partitions, record_bench_rotation, retry_unreachable, step_session
from spark_pipelines.assets.metadata import num
from spark_pipelines.assets.bench_metadata import bench_metadata
from spark_pipelines.core import steps
from spark_pipelines.core import baseline
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.core.pins import code_versions
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.ssh import FleetSession, FleetSSH
from spark_pipelines.runbook.bench import Benched, bench_node
from spark_pipelines.runbook.run_limits import tags as max_runtime
from spark_pipelines.state import ledger, records


GROUP = "5_bench"

ABOVE_FLOOR_DESCRIPTION = (
    "The promotion gate (blocking): the node's recipe mean tok/s is at or above its bench floor, its GPU "
    "showed no PD-firmware wedge under load, and its quality phase ran with every deterministic check passed "
    "(smoke answer, reasoning parser, tool call) and scored at or above bench.floor_quality when set. A failed gate keeps the node out of the gateway and fails "
    "the bench run for that node only; the check says why and what the runbook does next.")


def above_floor(fleet: Fleet, node: str, b: Benched) -> dict:
    """The above_floor check's fields for this bench."""
    # The check history's own time is when its run was planned (Dagster plans a run's checks at
    # its start, before the bench it judges is recorded): the judgement's time is said here.
    judged = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    return {"passed": b.promoted, "description": f"{node}: {b.reason} (judged {judged} UTC, after the bench)",
            "metadata": {"node": node, "judged (UTC)": judged, "mean_tok_s": num(float(b.mean or 0.0), 1),
                         "floor_tok_s": num(fleet.bench_floor(fleet.node(node)), 1),
                         "gpu_under_load": b.gpu_verdict.state}}


def bench_events(context: dg.AssetExecutionContext, fleet: Fleet, node: str, b: Benched):
    yield dg.Output(b.report.to_dict(), metadata=bench_metadata(context, fleet, node, b))
    yield dg.AssetCheckResult(check_name=steps.ABOVE_FLOOR_CHECK, severity=dg.AssetCheckSeverity.ERROR,
                              **above_floor(fleet, node, b))


def held_against(context: dg.AssetExecutionContext, s: FleetSession, fleet: Fleet,
                 node: str) -> baseline.Baseline | None:
    """The fleet's baseline when the node's bench hold-out was judged against it (a newcomer, a
    rollout's canary): its next bench is too, so a nightly bench never promotes it on its floors
    alone. None otherwise (the floors, the GPU and the quality floor judge it)."""
    holds = ledger.read(s).entry(node).holds
    # Its bench's hold-out, or the gate a rollout's or newcomer's version awaits.
    if not any(h.against_baseline for by, h in holds.items() if by in (ledger.BY_BENCH, ledger.BY_GATE)):
        return None
    base = records.baseline_of_others(context.instance, fleet, node)
    context.log.info(f"{node} is held out by a bench judged against the fleet's baseline: judged against it "
                     f"again ({base.text() if base else 'none recorded now: its floors only'})")
    return base


def bench_definitions(fleet: Fleet) -> dg.Definitions:
    cv = code_versions(fleet)
    partitions = node_partitions(fleet)

    @dg.asset(
        group_name=GROUP,
        kinds={"vllm"},
        partitions_def=partitions,
        code_version=cv[steps.BENCH_RESULTS],
        pool=steps.DRAIN_POOL,  # one bench at a time however it is launched: the gateway loses one node
        # The bench drains the node through the gateway (and keeps a node below its floor out of it):
        # it needs the deployed node and a gateway that holds it.
        deps=[steps.NODE_DEPLOYMENT, steps.GATEWAY],
        check_specs=[node_check(steps.ABOVE_FLOOR_CHECK, steps.BENCH_RESULTS, partitions, ABOVE_FLOOR_DESCRIPTION)],
        description="The recipe's suite (+ loaded phase) on one node in isolation: drained from the gateway, zero "
                    "requests in flight, nvidia-smi sampled under load, then restored; a node below its floor "
                    "stays out (above_floor says why). Each node's trend over time is history_chart (and the "
                    "summary's trend column): the Plots tab puts one point per node side by side, its line "
                    "joins different nodes, not one node's benches.",
    )
    @retry_unreachable(fleet.ssh)
    def bench_results(context: dg.AssetExecutionContext, ssh: FleetSSH, litellm: LiteLLMGateway):
        s = step_session(context, ssh, litellm)
        f = s.fleet
        node = f.node(context.partition_key)
        gw = litellm.host()
        # A bench that raised recorded nothing: its drain's exit put the node back where it was
        # (a read of the rotation here would wait on the gateway host that may be why it failed).
        b = bench_node(s, gw, node, context.log, run_id=context.run.run_id,
                       against=held_against(context, s, f, node.name))
        record_bench_rotation(context, gw, b)
        yield from bench_events(context, f, node.name, b)

    bench_job = dg.define_asset_job(
        steps.BENCH_JOB, selection=dg.AssetSelection.assets(steps.BENCH_RESULTS), tags={steps.BENCH_TAG: "bench", **max_runtime(fleet, steps.BENCH_JOB)},
        description="Isolated bench of one node (a partition): drain it from the gateway, wait for zero requests in "
                    "flight, run the recipe suite + loaded phase with nvidia-smi sampled, restore it (or keep it out "
                    "below its floor: the above_floor gate fails the run for that node only).")
    return dg.Definitions(assets=[bench_results], jobs=[bench_job])
