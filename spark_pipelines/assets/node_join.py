"""A node new to the fleet file, from nothing to benched and in the gateway, in one run
(add_node_job): Phase 0 and its reboot, the checkpoint and image from the nearest verified holder,
the deploy, the isolated bench against the floors and the fleet's baseline, then the gateway.
Each step is recorded on its own asset (node_os, node_artifacts, node_deployment, bench_results)
as if that asset had run, so the UI and the pins sensor read the new node like any other.
The serving nodes are only read from (a holder sends the copy); the gateway changes only by the
new node's own routes."""

from typing import Any

import dagster as dg

from spark_pipelines.assets import fail, retry_unreachable, step_session
from spark_pipelines.assets.bench import bench_metadata
from spark_pipelines.assets.gateway import record_rotation
from spark_pipelines.assets.node_os import metadata as node_os_metadata
from spark_pipelines.assets.nodes import (checkpoint_version_path, deploy_recorded, distribution_payload,
                                          node_partitions, serves_as_recorded)
from spark_pipelines.core import steps
from spark_pipelines.core import node_os as p0
from spark_pipelines.core.artifacts import BuiltImage, Checkpoint, NodeArtifacts
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.core.pins import code_versions
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.runbook import journal, node_os
from spark_pipelines.runbook.journal import JOIN_BENCHED
from spark_pipelines.runbook.bench import bench_node, gate_of
from spark_pipelines.runbook.distribution import DistributionFailed, distribute
from spark_pipelines.runbook.run_limits import tags as max_runtime
from spark_pipelines.state import ledger, records


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
            # Its journal until its bench promoted it: a run that dies before leaves the newcomer held
            # out (never routed unbenched) and add_node_job again redoes nothing it finished.
            with journal.journaled(s, n, steps.PROC_JOIN, run_id, phase="phase0") as j:
                os_done = node_os.provision(s, node, gw, log.info, run_id=run_id)
                records.record_step(context, steps.NODE_OS, n, p0.version(), None, node_os_metadata(os_done))
                done.append(f"Phase 0: {len(os_done.applied)} change(s)" + (", rebooted" if os_done.rebooted else "")
                            + "".join(f"; {line}" for line in os_done.steps if "finished:" in line))

                j.update(phase="artifacts")
                payload = distribution_payload(cv, mtp_weights, serving_image)
                copied = distribute(s, [node], payload, log=log, run_id=run_id)
                image_id = NodeDocker(s).image_id(n, serving_image.ref)
                if image_id != serving_image.image_id:
                    raise RunbookError(f"{n} holds image {(image_id or 'none')[7:19]} after the copy, not the build "
                                       f"host's {serving_image.image_id[7:19]}: run add_node_job again")
                artifacts = NodeArtifacts(node=n, path=checkpoint_version_path(f, node, mtp_weights),
                                          image=serving_image.ref, image_id=image_id, index=mtp_weights.index,
                                          manifest=mtp_weights.manifest, architecture=mtp_weights.architecture)
                records.record_step(
                    context, steps.NODE_ARTIFACTS, n, cv[steps.NODE_ARTIFACTS],
                    f"{mtp_weights.index}-{(mtp_weights.manifest or 'none')[:12]}-{image_id[7:19]}",
                    {"image_id": image_id, "copied_by": run_id, "tree": "; ".join(copied.lines()) or "already held"},
                    inputs={steps.MTP_WEIGHTS: None, steps.SERVING_IMAGE: None})
                done.append("artifacts: " + ("; ".join(copied.lines()) or "already held"))

                j.update(phase="deploying")
                # Held out until its bench promotes it: no gateway_job or reconcile routes an unbenched
                # newcomer, whatever happens to this run (the bench's promotion lifts it).
                ledger.hold(s, n, ledger.BY_BENCH, f"not benched yet: joining the fleet (add_node_job run "
                                                   f"{run_id[:8]}); its bench promotes it", **{ledger.AGAINST_BASELINE: True})
                running = NodeDocker(s).inspect_container(n, launch_spec(f, node).container_name)
                if serves_as_recorded(s, node, artifacts, cv[steps.NODE_DEPLOYMENT], running) is not None:
                    done.append("deployed: it serves this launch spec already (an earlier run's deploy): not redeployed")
                else:
                    # gated: held out by its bench until the bench below promotes it (no reconcile or
                    # gateway_job routes it before).
                    d = deploy_recorded(s, node, artifacts, cv[steps.NODE_DEPLOYMENT], log, run_id=run_id, gated=True)
                    records.record_deploy(context, n, cv[steps.NODE_DEPLOYMENT], d.data_version, d.metadata,
                                          launch=d.value.fingerprint)
                    if d.mismatch:
                        raise RunbookError(d.mismatch)
                    done.append("deployed: " + d.check_text)

                # The fleet's baseline judged inside the bench: a newcomer below it never serves a request.
                j.update(phase="benching")
                b = bench_node(s, gw, node, log, run_id=run_id, against=base,
                               on_rotation=lambda event, out: record_rotation(context, gw, event, out))
                j.try_update(phase=JOIN_BENCHED)  # judged: its bench's verdict stands, whatever happens next
                records.record_bench(context, n, cv[steps.BENCH_RESULTS], bench_metadata(context, f, n, b))
                gate = gate_of(f, node, b, base)
                if not gate.passed or not b.promoted:
                    raise RunbookError(f"{n} joined the fleet but not the gateway: {gate.gate} gate: "
                                       f"{gate.why if not gate.passed else b.reason}; held out by its bench: "
                                       "add_node_job again or bench_job promotes it once it passes its floors "
                                       "and the fleet's baseline")
                done.append(f"bench: {b.mean:.1f} tok/s ({gate.why}); in the gateway")
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
