"""add_node_job: a node new to the fleet file, from nothing to benched and in the gateway, in one
run (the procedure: runbook/node_join.py). Each step is recorded on its own asset (node_os,
node_artifacts, node_deployment, bench_results) as if that asset had run, so the UI and the pins
sensor read the new node like any other."""

from typing import Any

import dagster as dg

from spark_pipelines.assets import fail, node_partitions, record_bench_rotation, retry_unreachable, step_session
from spark_pipelines.assets.bench_metadata import bench_metadata
from spark_pipelines.assets.metadata import deploy_metadata, node_os_metadata
from spark_pipelines.core import steps
from spark_pipelines.core import node_os as p0
from spark_pipelines.core.artifacts import BuiltImage, Checkpoint
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.core.pins import code_versions
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.runbook.node_join import join as join_fleet
from spark_pipelines.runbook.bench import Benched
from spark_pipelines.runbook.deploy import NodeDeployed
from spark_pipelines.runbook.node_os import Provisioned
from spark_pipelines.runbook.distribution import DistributionFailed, DistributionReport, distribution_payload
from spark_pipelines.runbook.run_limits import tags as max_runtime
from spark_pipelines.state import records


def node_join_definitions(fleet: Fleet) -> dg.Definitions:
    cv = code_versions(fleet)
    partitions = node_partitions(fleet)

    @dg.asset(
        name=steps.NODE_JOIN,
        group_name="3_nodes",
        kinds={"ssh", "docker", "vllm"},
        partitions_def=partitions,
        pool=steps.DRAIN_POOL,  # its Phase 0 reboot and its bench count as the one drain, as its run tag does
        description="A node added to the fleet file joins it in one run: Phase 0 (and its reboot), the "
                    "checkpoint and image from the nearest verified holder, the deploy, the isolated bench "
                    "(floors, then the fleet's baseline), the gateway. Refused for a node that already serves "
                    "in the gateway (deploy_node_job and rollout_job change those).",
    )
    @retry_unreachable(fleet.ssh)
    def node_join(context: dg.AssetExecutionContext, ssh: FleetSSH, litellm: LiteLLMGateway,
                  mtp_weights: Checkpoint, serving_image: BuiltImage):
        s = step_session(context, ssh, litellm)
        f, log, run_id = s.fleet, context.log, context.run.run_id
        node = f.node(context.partition_key)
        n = node.name
        gw = litellm.host()
        if n in gw.rotation():
            fail(RunbookError(f"{n} already serves in the gateway: add_node_job brings a node new to the fleet "
                              "file; deploy_node_job or rollout_job change a serving one"))
        # The baseline the newcomer is judged against: the other nodes' benches, read before its own.
        base = records.baseline_of_others(context.instance, f, n)
        done: list[str] = []
        try:
            join_fleet(s, gw, node, mtp_weights, serving_image, distribution_payload(cv, mtp_weights, serving_image),
                       cv[steps.NODE_DEPLOYMENT], base, _Records(context, gw, cv, mtp_weights), log,
                       run_id=run_id, done=done)
        except DistributionFailed as e:
            fail(e)
        except RunbookError as e:
            if done:
                e.description = f"{e.description} (done before: {'; '.join(done)})"
                e.args = (e.description,)
            fail(e)
        meta: dict[str, Any] = {
            "steps": dg.MetadataValue.md("\n".join(f"1. {line}" for line in done)),
            "baseline": base.text() if base else "none (no other node's bench counts)",
            "in_gateway": n in gw.rotation(),
        }
        return dg.MaterializeResult(metadata=meta)

    job = dg.define_asset_job(
        steps.ADD_NODE_JOB, selection=dg.AssetSelection.assets(steps.NODE_JOIN),
        tags={steps.BENCH_TAG: "add_node", **max_runtime(fleet, steps.ADD_NODE_JOB)},
        description="Bring one node added to the fleet file (a partition) from nothing to benched and in the "
                    "gateway: Phase 0, artifacts from the nearest holder, deploy, bench, gateway. Reload the code "
                    "location after editing the fleet file so the new node is a partition.")
    return dg.Definitions(assets=[node_join], jobs=[job])


class _Records:
    """runbook.node_join.JoinRecords on the instance: each phase recorded on its own asset's
    partition as if that asset had run, so the UI and the pins sensor read the newcomer like any
    other node; its bench's drain and restore on the gateway."""

    def __init__(self, context: dg.AssetExecutionContext, gw, cv: dict[str, str], mtp_weights: Checkpoint) -> None:
        self.context, self.gw, self.cv, self.mtp_weights = context, gw, cv, mtp_weights

    def provisioned(self, node: str, done: Provisioned) -> None:
        records.record_step(self.context, steps.NODE_OS, node, p0.version(), None, node_os_metadata(done))

    def artifacts(self, node: str, image_id: str, copied: DistributionReport) -> None:
        w = self.mtp_weights
        records.record_step(
            self.context, steps.NODE_ARTIFACTS, node, self.cv[steps.NODE_ARTIFACTS],
            f"{w.index}-{(w.manifest or 'none')[:12]}-{image_id[7:19]}",
            {"image_id": image_id, "copied_by": self.context.run.run_id,
             "tree": "; ".join(copied.lines()) or "already held"},
            inputs={steps.MTP_WEIGHTS: None, steps.SERVING_IMAGE: None})

    def deployed(self, node: str, d: NodeDeployed) -> None:
        fleet = self.gw.fleet
        records.record_deploy(self.context, node, self.cv[steps.NODE_DEPLOYMENT], d.data_version,
                              deploy_metadata(fleet, fleet.node(node), d), launch=d.deployment.fingerprint)

    def benched(self, node: str, b: Benched) -> None:
        record_bench_rotation(self.context, self.gw, b)
        records.record_bench(self.context, node, self.cv[steps.BENCH_RESULTS],
                             bench_metadata(self.context, self.gw.fleet, node, b))
