"""A/B experiments (`ab_experiment_job`): one node benchmarked under two launch-profile variants,
honestly compared. Short wiring around `runbook.experiment`: the config, then the comparison
recorded under ab_experiments/<node>."""

import dagster as dg
from pydantic import Field

from spark_pipelines.assets import one_line_failures
from spark_pipelines.core import steps
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.runbook.experiment import run_experiment
from spark_pipelines.runbook.run_limits import tags as max_runtime
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


@dg.op(name=steps.AB_OP, pool=steps.DRAIN_POOL,  # the node is drained for both variants: never beside a bench
       description="Drain the node, deploy variant A and bench it, deploy variant B and bench it, compare the "
                   "two honestly, then put the production launch back and restore the node.")
@one_line_failures
def ab_experiment(context: dg.OpExecutionContext, config: ABConfig, ssh: FleetSSH, litellm: LiteLLMGateway) -> dict:
    s = ssh.session
    s.log = context.log  # the session's lines attached to this step
    out = run_experiment(s, litellm.host(), config.node, [config.a, config.b], context.log, suite=config.suite,
                         repeats=config.repeats, run_id=context.run.run_id)
    na, nb = out.reports
    records.record_experiment(context, out.node, description=f"{na} vs {nb} on {out.node}",
                              metadata={"comparison": dg.MetadataValue.md(out.table),
                                        "verdicts": dg.MetadataValue.json(out.verdicts)})
    return {"node": out.node, "verdicts": out.verdicts}


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

    @dg.job(name=steps.AB_JOB, description=description, config=config,
            tags=max_runtime(fleet, steps.AB_JOB) if fleet is not None else None)
    def ab_experiment_job():
        ab_experiment()

    return ab_experiment_job


def experiment_definitions(fleet: Fleet | None = None) -> dg.Definitions:
    return dg.Definitions(jobs=[ab_job(fleet)])
