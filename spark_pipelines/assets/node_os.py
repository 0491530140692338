"""Phase 0 of one node (node_os_job): short wiring around `runbook.node_os` (facts, changes with
their undo, the drained and bounded reboot, the verify and memcheck); `core.node_os` holds the
runbook's values and the diff."""


import dagster as dg
from pydantic import Field

from spark_pipelines.assets import node_partitions, fail, retry_unreachable, step_session
from spark_pipelines.assets.metadata import node_os_metadata
from spark_pipelines.core import node_os as p0
from spark_pipelines.core import steps
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.ssh import FleetSSH, RemoteError
from spark_pipelines.runbook import node_os
from spark_pipelines.runbook.run_limits import tags as max_runtime


class NodeOsConfig(dg.Config):
    # The check is the default (the launchpad and the asset page's Materialize start from it): the
    # changing run, which may drain and reboot the node, is a choice someone writes down.
    check: bool = Field(default=True, description="true (default): only read the node and list what Phase 0 "
                                                  "would change and whether it would reboot; touches nothing and "
                                                  "records an observation, not a materialization. false: apply "
                                                  "the changes (the node may be drained and rebooted).")


def recorded(p: node_os.Provisioned) -> dg.AssetObservation | dg.MaterializeResult:
    """A check is an observation of the node (it looks provisioned only once a run applied Phase 0);
    an applying run is the materialization."""
    if p.check_only:
        what = f"{len(p.planned)} setting(s) differ" if p.planned else "every setting as the runbook says"
        return dg.AssetObservation(asset_key=steps.NODE_OS, partition=p.node, metadata=node_os_metadata(p),
                                   description=f"check (nothing changed): {what}")
    return dg.MaterializeResult(metadata=node_os_metadata(p))


def node_os_definitions(fleet: Fleet) -> dg.Definitions:
    partitions = node_partitions(fleet)

    @dg.asset(
        name=steps.NODE_OS,
        group_name="3_nodes",
        kinds={"ssh", "systemd"},
        partitions_def=partitions,
        code_version=p0.version(),
        pool=steps.DRAIN_POOL,  # a reboot drains its node: never beside a bench or another reboot
        output_required=False,  # a check records an observation, no materialization
        description="The runbook's Phase 0 on one node: headless target, its service lists disabled and masked, the "
                    "nine memory sysctls, swap off, earlyoom purged; a reboot (drained, engine stopped and started "
                    "again) when a mask or the target needs one; then the clean-boot verify and the memcheck "
                    "recorded as the node's own baseline. Changes only what differs. By default (`check: true`) it "
                    "only reads and records an observation; `check: false` applies.",
    )
    @retry_unreachable(fleet.ssh)
    def node_os_step(context: dg.AssetExecutionContext, config: NodeOsConfig, ssh: FleetSSH, litellm: LiteLLMGateway):
        s = step_session(context, ssh, litellm)
        node = s.fleet.node(context.partition_key)
        try:
            done = node_os.provision(s, node, litellm.host(), context.log.info, check_only=config.check,
                                     run_id=context.run.run_id)
        except RunbookError as e:
            fail(e)
        except RemoteError as e:
            raise dg.Failure(description=f"{node.name}: Phase 0 stopped: {e}; run node_os_job again once it "
                                         "answers (every change made is re-read, none repeated)") from None
        verb = "would change" if done.check_only else "changed"
        context.log.info(f"[{node.name}] Phase 0 {verb} {len(done.planned)} setting(s)"
                         + ("; rebooted and verified clean" if done.rebooted else "")
                         + ("; set check: false to apply" if done.check_only and done.planned else ""))
        yield recorded(done)

    job = dg.define_asset_job(
        steps.NODE_OS_JOB, selection=dg.AssetSelection.assets(steps.NODE_OS), tags=max_runtime(fleet, steps.NODE_OS_JOB),
        # Shown in the launchpad as it will run: the check, until someone writes check: false.
        config={"ops": {steps.NODE_OS: {"config": {"check": True}}}},
        description="Phase 0 of one node (a partition). As launched, `check: true`: lists what differs from the "
                    "runbook and whether a reboot would follow, touches nothing (an observation on node_os). "
                    "Write `check: false` to apply: what differs changes, a reboot follows when needed (drained, "
                    "bounded: a node that does not come back is quarantined).")
    return dg.Definitions(assets=[node_os_step], jobs=[job])
