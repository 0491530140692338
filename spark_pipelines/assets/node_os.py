"""Phase 0 of one node (node_os_job): short wiring around `runbook.node_os` (facts, changes with
their undo, the drained and bounded reboot, the verify and memcheck); `core.node_os` holds the
runbook's values and the diff."""

from typing import Any

import dagster as dg
from pydantic import Field

from spark_pipelines.assets import fail, retry_unreachable, step_session
from spark_pipelines.assets.metadata import num
from spark_pipelines.assets.nodes import node_partitions
from spark_pipelines.core import node_os as p0
from spark_pipelines.core import record_keys as keys
from spark_pipelines.core import steps
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.ssh import FleetSSH, RemoteError
from spark_pipelines.runbook import node_os
from spark_pipelines.runbook.run_limits import tags as max_runtime


class NodeOsConfig(dg.Config):
    check: bool = Field(default=False, description="Only read the node and list what Phase 0 would change (and "
                                                   "whether it would reboot); touches nothing.")


def _bullets(lines: list[str], empty: str) -> dg.MetadataValue:
    return dg.MetadataValue.md("\n".join(f"- {line}" for line in lines) if lines else empty)


def metadata(p: node_os.Provisioned) -> dict[str, Any]:
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


def node_os_definitions(fleet: Fleet) -> dg.Definitions:
    partitions = node_partitions(fleet)

    @dg.asset(
        name=steps.NODE_OS,
        group_name="3_nodes",
        kinds={"ssh", "systemd"},
        partitions_def=partitions,
        code_version=p0.version(),
        description="The runbook's Phase 0 on one node: headless target, its service lists disabled and masked, the "
                    "nine memory sysctls, swap off, earlyoom purged; a reboot (drained, engine stopped and started "
                    "again) when a mask or the target needs one; then the clean-boot verify and the memcheck "
                    "recorded as the node's own baseline. Changes only what differs; `check` only reads.",
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
                         + ("; rebooted and verified clean" if done.rebooted else ""))
        return dg.MaterializeResult(metadata=metadata(done))

    job = dg.define_asset_job(
        steps.NODE_OS_JOB, selection=dg.AssetSelection.assets(steps.NODE_OS), tags=max_runtime(fleet, steps.NODE_OS_JOB),
        description="Phase 0 of one node (a partition): what differs from the runbook changes, a reboot follows "
                    "when needed (drained, bounded: a node that does not come back is quarantined). Config "
                    "`check: true` only lists the changes.")
    return dg.Definitions(assets=[node_os_step], jobs=[job])
