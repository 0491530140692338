"""A/B experiments: one node benchmarked under two launch-profile variants, honestly compared.

The runbook's MTP-2 vs MTP-3 and env-var verdicts were once contaminated by gateway traffic. Here
the node leaves the gateway for the whole experiment, each variant is deployed with the same
rollback-safe procedure as production, benched `repeats` times, and compared with
`core.bench.compare`, which declines to name a winner when the spreads overlap. The node's
production launch is put back in every outcome.
"""

from typing import Any

import dagster as dg
from pydantic import Field

from spark_pipelines.assets import fail
from spark_pipelines.resources.bench_client import run_bench
from spark_pipelines.core import steps
from spark_pipelines.core import bench as bench_core
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.core.fleet import Fleet, FleetError, parse_fleet
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.runbook.bench import wait_idle
from spark_pipelines.runbook.deploy import deploy
from spark_pipelines.resources.engine import api_root
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.runbook.rotation import drained
from spark_pipelines.state import records


class Variant(dg.Config):
    name: str
    num_speculative_tokens: int | None = Field(default=None, description="MTP tokens per step")
    gpu_memory_utilization: float | None = None
    env: dict[str, str] = Field(default_factory=dict, description="env vars to set (or override)")
    unset_env: list[str] = Field(default_factory=list, description="env vars to remove")


class ABConfig(dg.Config):
    node: str | None = Field(default=None, description="serve node to experiment on (default: the first serve node)")
    a: Variant = Variant(name="mtp2", num_speculative_tokens=2)
    b: Variant = Variant(name="mtp3", num_speculative_tokens=3)
    repeats: int = Field(default=3, ge=2, le=20, description="measured repeats per variant (+1 warm-up)")
    suite: str = "all"


def variant_fleet(fleet: Fleet, node: str, v: Variant) -> Fleet:
    """The fleet with this node's launch changed by the variant, validated like any fleet file
    (a variant cannot smuggle --enable-prefix-caching or a GMU the hardware refuses)."""
    data = fleet.model_dump(mode="json")
    n = next(x for x in data["nodes"] if x["name"] == node)
    # A fleet of this node alone: the variant's launch must validate for its hardware, not others'.
    n["roles"] = ["build", "serve"]
    data["nodes"] = [n]
    # Settings that name the other nodes do not apply to a fleet of this node alone.
    data["cold_drain"]["smart_plugs"] = {k: p for k, p in data["cold_drain"]["smart_plugs"].items() if k == node}
    data["gateway"]["api_host_overrides"] = {k: h for k, h in data["gateway"]["api_host_overrides"].items() if k == node}
    if data["rollout"]["canary"] not in (None, node):
        data["rollout"]["canary"] = None
    launch = fleet.launch_for(fleet.node(node))
    over: dict[str, Any] = dict(n.get("overrides") or {})
    env = {k: val for k, val in launch.env.items() if k not in v.unset_env}
    env.update(v.env)
    data["launch"]["env"] = env
    over["env"] = {}
    if v.num_speculative_tokens is not None:
        over["speculative"] = {"method": launch.speculative.method if launch.speculative else "mtp",
                               "num_speculative_tokens": v.num_speculative_tokens}
    if v.gpu_memory_utilization is not None:
        over["gpu_memory_utilization"] = v.gpu_memory_utilization
    n["overrides"] = over
    return parse_fleet(data, f"variant {v.name!r}")


def comparison_md(node: str, reports: dict[str, bench_core.BenchReport], verdicts: list[str]) -> str:
    lines = [f"### A/B on {node}", "", "| variant | recipe mean tok/s (min-max) | loaded aggregate tok/s | acceptance |",
             "|---|---|---|---|"]
    for name, r in reports.items():
        loaded = next((p.aggregate_tok_s for p in r.phases if p.phase != bench_core.PHASE_RECIPE and p.aggregate_tok_s), None)
        acc = r.counters.acceptance_rate if r.counters and r.counters.acceptance_rate is not None else None
        lines.append(f"| {name} | {r.recipe_mean_tok_s.text(2) if r.recipe_mean_tok_s else '-'} | "
                     f"{loaded.text(2) if loaded else '-'} | {f'{acc:.1%}' if acc is not None else '-'} |")
    lines += ["", *[f"- {v}" for v in verdicts]]
    return "\n".join(lines)


@dg.op(name=steps.AB_OP, description="Drain the node, deploy variant A and bench it, deploy variant B and bench it, compare the "
                   "two honestly, then put the production launch back and restore the node.")
def ab_experiment(context: dg.OpExecutionContext, config: ABConfig, ssh: FleetSSH, litellm: LiteLLMGateway) -> dict:
    s = ssh.session
    s.log = context.log  # the session's lines attached to this step
    fleet = s.fleet
    name = config.node or fleet.serve_nodes[0].name
    try:
        node = fleet.node(name)
        variants = {v.name: variant_fleet(fleet, name, v) for v in (config.a, config.b)}
    except FleetError as e:
        raise dg.Failure(description=f"A/B config refused: {e}") from None
    if len(variants) != 2:
        raise dg.Failure(description="the two variants need different names")
    reports: dict[str, bench_core.BenchReport] = {}
    try:
        with node_lease(s, node.name, "experiment", run_id=context.run.run_id), drained(litellm.host(), node.name):
            try:
                for name, vf in variants.items():
                    vnode = vf.node(node.name)
                    context.log.info(f"variant {name}: deploying")
                    deploy(s, vnode, launch_spec(vf, vnode), context.log, run_id=context.run.run_id)
                    wait_idle(vf, vnode)
                    reports[name] = run_bench(api_root(vf, vnode), vf.launch_for(vnode).served_model_name,
                                              suite=config.suite, concurrency=fleet.bench.loaded_concurrency,
                                              repeats=config.repeats + 1)
            finally:
                context.log.info(f"restoring the production launch on {node.name}")
                deploy(s, node, launch_spec(fleet, node), context.log, run_id=context.run.run_id)
    except RunbookError as e:
        fail(e)
    (na, ra), (nb, rb) = reports.items()
    verdicts = []
    if ra.recipe_mean_tok_s and rb.recipe_mean_tok_s:
        verdicts.append("single-stream: " + bench_core.compare(ra.recipe_mean_tok_s, rb.recipe_mean_tok_s, names=(na, nb)).text)
    la = next((p.aggregate_tok_s for p in ra.phases if p.phase != bench_core.PHASE_RECIPE and p.aggregate_tok_s), None)
    lb = next((p.aggregate_tok_s for p in rb.phases if p.phase != bench_core.PHASE_RECIPE and p.aggregate_tok_s), None)
    if la and lb:
        verdicts.append(f"loaded N={fleet.bench.loaded_concurrency}: " + bench_core.compare(la, lb, names=(na, nb)).text)
    table = comparison_md(node.name, reports, verdicts)
    records.record_experiment(context, node.name, description=f"{na} vs {nb} on {node.name}",
                              metadata={"comparison": dg.MetadataValue.md(table),
                                        "verdicts": dg.MetadataValue.json(verdicts)})
    return {"node": node.name, "verdicts": verdicts}


AB_JOB_DESCRIPTION = ("A/B two launch-profile variants on one node (default MTP-2 vs MTP-3) in isolation: the node "
                      "leaves the gateway, each variant is deployed with rollback and benched, the comparison names "
                      "a winner only when the spreads do not overlap, and production is put back.")


def ab_job(fleet: Fleet | None = None) -> dg.JobDefinition:
    """The A/B job; with a fleet its launchpad starts from the first serve node and names the others."""
    config = None
    description = AB_JOB_DESCRIPTION
    if fleet is not None and fleet.serve_nodes:
        names = [n.name for n in fleet.serve_nodes]
        config = dg.RunConfig(ops={steps.AB_OP: ABConfig(node=names[0])})
        description += f" Nodes: {', '.join(names)} (config ops.ab_experiment.config.node)."

    @dg.job(name=steps.AB_JOB, description=description, config=config)
    def ab_experiment_job():
        ab_experiment()

    return ab_experiment_job


def experiment_definitions(fleet: Fleet | None = None) -> dg.Definitions:
    return dg.Definitions(jobs=[ab_job(fleet)])
