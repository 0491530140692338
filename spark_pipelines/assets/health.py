"""Keeping the fleet serving: quarantine a node, release it, reconcile the gateway's rotation, and
the per-node `health` check on node_deployment (the node_health sensor reports it every sweep; run
it from the UI for one node at any time).

Short wiring around runbook.quarantine, runbook.reconcile and runbook.sweep."""



import dagster as dg

from spark_pipelines.assets import node_partitions, one_line_failures, record_rotation
from spark_pipelines.core import healing, steps
from spark_pipelines.core import record_keys as keys
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.runbook import quarantine as quarantine_rb
from spark_pipelines.runbook import reconcile, sweep
from spark_pipelines.state import records


class QuarantineConfig(dg.Config):
    verdict: str = "manual"
    reason: str = "quarantined by an operator"


class MoveConfig(dg.Config):
    node: str
    reason: str = ""
    dead: bool = False


class ReconcileConfig(dg.Config):
    take_out: list[MoveConfig] = []
    put_back: list[MoveConfig] = []


def _by(context: dg.OpExecutionContext) -> str:
    reason = context.run.tags.get(steps.REASON_TAG)
    return f"run {context.run_id[:8]}" + (f" ({reason})" if reason else "")


def _record(context: dg.OpExecutionContext, node: str, quarantined: str, what: str) -> None:
    """The health history per node shows quarantines and releases next to the sweeps' verdicts."""
    records.observe(context, steps.NODE_DEPLOYMENT, node, description=what,
                    metadata={keys.QUARANTINED: dg.MetadataValue.text(quarantined or "no"),
                              keys.POLICY: dg.MetadataValue.text(what)})


def checked_nodes(fleet: Fleet, partition: str | None) -> list | None:
    """The nodes the `health` check judges: the run's own node in a node's deploy run (a deploy of
    spark1 must not go red because spark2 is not deployed yet), else every serve node (None)."""
    return [fleet.node(partition)] if partition in fleet.node_names else None


def health_definitions(fleet: Fleet) -> dg.Definitions:
    partitions = node_partitions(fleet)

    @dg.op(name=steps.QUARANTINE_OP, description="Record the quarantine on the gateway host, then drain the node.")
    @one_line_failures
    def quarantine_node(context: dg.OpExecutionContext, config: QuarantineConfig, ssh: FleetSSH,
                        litellm: LiteLLMGateway) -> None:
        node = context.partition_key
        gw = litellm.host()  # one host for the drain and the record of the rotation after it
        out = quarantine_rb.quarantine(ssh.session, node, config.verdict, config.reason, by=_by(context), gw=gw)
        context.log.info(f"{node} quarantined ({out.record.summary()}); {out.note}")
        _record(context, node, out.record.summary(), f"quarantined; {out.note}")
        record_rotation(context, gw, f"quarantine {node}", {node: f"quarantined: {out.record.summary()}"})

    @dg.op(name=steps.RELEASE_OP, description="End a node's quarantine (the gateway takes it back once healthy).")
    @one_line_failures
    def release_quarantine(context: dg.OpExecutionContext, ssh: FleetSSH) -> None:
        node = context.partition_key
        was = quarantine_rb.release(ssh.session, node, by=_by(context))
        what = (f"released (was {was.summary()}); gateway_job or the next reconcile puts it back once healthy"
                if was else "was not quarantined")
        context.log.info(f"{node}: {what}")
        _record(context, node, "", what)

    @dg.op(name=steps.RECONCILE_OP, description="Apply a reconcile plan (or plan one now), each move re-checked.")
    @one_line_failures
    def reconcile_gateway(context: dg.OpExecutionContext, config: ReconcileConfig, ssh: FleetSSH,
                          litellm: LiteLLMGateway) -> None:
        s = ssh.session
        gw = litellm.host()
        if config.take_out or config.put_back:
            plan = healing.ReconcilePlan(
                tuple(healing.Move(m.node, m.reason, m.dead) for m in config.take_out),
                tuple(healing.Move(m.node, m.reason, m.dead) for m in config.put_back))
        else:  # launched by a person: plan from a sweep now
            plan = reconcile.plan_now(s, context.log)
        context.log.info(f"plan: {plan.describe()}")
        done = reconcile.apply(s, gw, plan)
        for line in done:
            context.log.info(line)
        if done:
            record_rotation(context, gw, f"reconcile: {plan.describe()}",
                            {m.node: m.reason for m in plan.take_out})

    @dg.job(name=steps.QUARANTINE_JOB, partitions_def=partitions, tags={steps.HEALTH_TAG: "quarantine"},
            description="Quarantine one node (a partition): recorded off the node on the gateway host (verdict, "
                        "reason, since, by) and drained from the gateway; no gateway step puts it back until it "
                        "is released (release_quarantine_job, or a healthy deploy for residue / crash-loop / "
                        "engine-down).")
    def quarantine_job():
        quarantine_node()

    @dg.job(name=steps.RELEASE_JOB, partitions_def=partitions,
            description="End one node's quarantine; gateway_job or the next reconcile puts it back once healthy.")
    def release_quarantine_job():
        release_quarantine()

    @dg.job(name=steps.RECONCILE_JOB,
            description="The gateway's rotation made exactly the healthy, promoted, not-quarantined nodes: a node "
                        "failing two sweeps in a row out, a healthy node drained longer than a bench takes back, "
                        "never below gateway.min_in_rotation (a dead node excepted).")
    def gateway_reconcile_job():
        reconcile_gateway()

    @dg.asset_check(asset=steps.NODE_DEPLOYMENT, name=steps.HEALTH_CHECK,
                    description="The health sweep's verdict per node (node_health reports one result per node "
                                "each sweep, the node named in its metadata). In a node's deploy run it judges "
                                "that node only; run on its own, every serve node. Passes when each is healthy "
                                "or starting.")
    def health_check(context: dg.AssetCheckExecutionContext, ssh: FleetSSH) -> dg.AssetCheckResult:
        fleet = ssh.session.fleet
        nodes = checked_nodes(fleet, context.run.tags.get("dagster/partition"))
        with sweep.open_session(fleet, context.log) as s:
            verdicts = {n: r.verdict for n, r in sweep.sweep(s, nodes).items()}
        return dg.AssetCheckResult(
            passed=not any(v.needs_action for v in verdicts.values()), severity=dg.AssetCheckSeverity.WARN,
            description="; ".join(f"{n}: {v.verdict} -> {v.advice[:120]}" for n, v in verdicts.items()),
            metadata={"nodes": ", ".join(verdicts), **{n: v.verdict for n, v in verdicts.items()}})

    return dg.Definitions(jobs=[quarantine_job, release_quarantine_job, gateway_reconcile_job],
                          asset_checks=[health_check])
