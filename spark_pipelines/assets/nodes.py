"""Per-node steps (partitioned by node): the node's launch (observed), artifacts on the node, then
the deployment.

Short wiring around `runbook.deploy` (preflight, launch, readiness, smoke test, rollback) and
`resources.transfer` (node-to-node copies, verified on the receiver).
"""

import shlex
import warnings
from typing import Any

import dagster as dg
from dagster._core.definitions.external_asset import create_external_asset_from_source_asset
from pydantic import Field

from spark_pipelines.assets import fail, node_check, node_partitions, retry_unreachable, step_session
from spark_pipelines.assets.metadata import deploy_metadata, readable, where
from spark_pipelines.core import steps
from spark_pipelines.core import layout
from spark_pipelines.core.artifacts import BuiltImage, Checkpoint, Deployment, NodeArtifacts
from spark_pipelines.core.fleet import Fleet, Node, NodePair
from spark_pipelines.core import versions as versions_core
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.core.pair_launch import enabled_pair_of, pair_launch
from spark_pipelines.core.pins import code_versions, launch_versions
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.ssh import FleetSession, FleetSSH
from spark_pipelines.resources.transfer import NodeStreams
from spark_pipelines.state import markers, records
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.runbook import rollout as node_rollout
from spark_pipelines.runbook import journal, versions
from spark_pipelines.runbook.model import verify_build_host_copy
from spark_pipelines.runbook.distribution import DistributionFailed, distribute, distribution_payload
from spark_pipelines.runbook.deploy import deploy_artifacts, serves_as_marked
from spark_pipelines.runbook.pair import deploy_pair, pair_serves
from spark_pipelines.runbook.run_limits import tags as max_runtime
from spark_pipelines.core.errors import RunbookError


class DeployConfig(dg.Config):
    fresh_jit_cache: bool = Field(
        default=False,
        description="Relaunch on an empty JIT cache: this launch's cached kernels are set aside on the node and on "
                    "the build host (the runbook's fix for a stale torch_compile or Triton cache). The boot is a "
                    "first boot, 25-45 min.")
    allow_rejected: bool = Field(
        default=False,
        description="Deploy a version a rollout's gate rejected (its node_deployment otherwise refuses it: this "
                    "job has no gate). Only to deploy it knowingly, e.g. to reproduce the failure on one node.")


def pair_deployment(context: dg.AssetExecutionContext, session: FleetSession, node: Node, pair: NodePair,
                    launched: dict[str, str]):
    """node_deployment of a node in a pair that is on: skipped while the pair serves as deployed
    (runbook.pair.pair_serves), else the pair's deploy (runbook.pair: both nodes, worker first)."""
    fleet = session.fleet
    launch = pair_launch(fleet, pair)
    spec = launch.head if node.name == pair.head else launch.worker
    serving, live = pair_serves(session, pair)
    meta: dict[str, Any] = {"pair": pair.name, "rank": 0 if node.name == pair.head else 1, "skipped": serving}
    if not serving:
        done = deploy_pair(session, pair, context.log, run_id=context.run.run_id)
        live[node.name] = NodeDocker(session).inspect_container(node.name, spec.container_name)
        meta.update(preflight=dg.MetadataValue.md("```\n" + done.preflight + "\n```"),
                    smoke_completion_tokens=done.smoke_tokens, startup_seconds=done.seconds)
    meta["docker_run"] = dg.MetadataValue.text(shlex.join(spec.docker_run_argv()))
    yield dg.Output(Deployment(node=node.name, container_id=(live[node.name] or {}).get("Id"), fingerprint=spec.fingerprint),
                    data_version=dg.DataVersion(f"pair-{pair.name}-{spec.fingerprint}"), tags=launched,
                    metadata=readable({**meta, **where(fleet, node, spec, live[node.name])}))
    yield dg.AssetCheckResult(check_name="serving", passed=True, metadata={"node": node.name},
                              description=f"{node.name}: rank {meta['rank']} of pair {pair.name}, the pair serves "
                                          f"through {pair.head}")


def node_definitions(fleet: Fleet) -> dg.Definitions:
    cv = code_versions(fleet)
    launch = launch_versions(fleet)
    partitions = node_partitions(fleet)

    with warnings.catch_warnings():
        # Observable sources are beta in 1.13, and Dagster's own conversion of one into an asset
        # reads a property it deprecated: converted here, where both warnings are said once.
        warnings.filterwarnings("ignore", category=dg.BetaWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)

        @dg.observable_source_asset(
            name=steps.NODE_LAUNCH,
            group_name="3_nodes",
            partitions_def=partitions,
            description="Each node's launch as the loaded fleet file gives it (the launch profile with the node's "
                        "overrides): its data version is the launch spec's fingerprint, read from the fleet file "
                        "alone (no SSH). Observed by pins_changed and by every deploy; a node whose launch changed "
                        "makes its own node_deployment stale, no other node's.",
        )
        def node_launch() -> dg.DataVersionsByPartition:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=dg.BetaWarning)
                return dg.DataVersionsByPartition({n: dg.DataVersion(v) for n, v in launch.items()})

        node_launch_asset = create_external_asset_from_source_asset(node_launch)

    @dg.asset(
        group_name="3_nodes",
        kinds={"ssh", "docker"},
        partitions_def=partitions,
        code_version=cv[steps.NODE_ARTIFACTS],
        check_specs=[node_check(
            "same_image_as_build_host", steps.NODE_ARTIFACTS, partitions,
            "Blocking, per node: the serving image id on the node is the one the build host built "
            "(docker save | docker load arrived whole); a failure stops that node's deployment only.")],
        description="Checkpoint and serving image on the node, streamed node-to-node from the build host.",
    )
    @retry_unreachable(fleet.ssh)
    def node_artifacts(context: dg.AssetExecutionContext, ssh: FleetSSH, mtp_weights: Checkpoint,
                       serving_image: BuiltImage):
        s = step_session(context, ssh)
        f = s.fleet
        node = f.node(context.partition_key)
        build = f.build_node
        src_dir = mtp_weights.path
        # Each node holds the checkpoint as a version of its own (core/versions.py): the build
        # host's is what mtp_weights made; another node's is copied beside its serving one.
        if node.name != build.name and not mtp_weights.manifest:
            fail(RunbookError("mtp_weights recorded no content manifest for the checkpoint (an output from before "
                              "manifests): rematerialize mtp_weights (build_job), then node_artifacts"))
        dst_dir = layout.checkpoint_version_path(f, node, mtp_weights)
        image = serving_image.ref
        manifest = mtp_weights.manifest
        meta: dict[str, Any] = {}
        if node.name == build.name:
            # The build host's own copy is what it serves and what every copy starts from: hashed
            # against the manifest (a shard damaged in place, its size and mtime kept, stops here).
            meta.update(verify_build_host_copy(s, node, dst_dir, manifest))
            meta["copied"] = False
        else:
            streams = NodeStreams(s)
            sig = markers.signature(cv[steps.NODE_ARTIFACTS], mtp_weights.index, manifest)
            # The skip re-hashes the node's copy (content, not just sizes): a shard rewritten in place
            # with the same size is found and re-sent by copy_tree.
            if (markers.matches(s, node, steps.NODE_ARTIFACTS, sig) and s.exists(node.name, dst_dir)
                    and streams.verify_tree(build.name, node.name, src_dir, dst_dir, manifest=manifest).ok):
                meta["copied"] = False
            else:
                with node_lease(s, node.name, "checkpoint copy", run_id=context.run.run_id):
                    got = versions.receive(s, streams, build.name, node, src_dir, manifest or "")
                copy = got.copy
                markers.write(s, node, steps.NODE_ARTIFACTS, sig, manifest=manifest, path=dst_dir)
                meta.update(copied=True, bytes_sent=copy.bytes_sent, copy_seconds=copy.seconds,
                            files=copy.verification.files, repaired=len(copy.repaired),
                            hard_linked_from=got.linked_from or "none")
            img = streams.copy_image(build.name, node.name, image)
            meta.update(image_copied=not img.skipped, image_copy_seconds=img.seconds)
        node_image = NodeDocker(s).image_id(node.name, image)
        same = node_image == serving_image.image_id
        yield dg.Output(
            NodeArtifacts(node=node.name, path=dst_dir, image=image, image_id=node_image, index=mtp_weights.index,
                          manifest=manifest, architecture=mtp_weights.architecture),
            data_version=dg.DataVersion(f"{mtp_weights.index}-{(manifest or 'none')[:12]}-{(node_image or 'none')[7:19]}"),
            metadata=readable({"image_id": node_image or "missing", "checkpoint": (mtp_weights.index or "none")[:12],
                               "checkpoint_version": versions_core.short(manifest) or "none",
                               "path": dg.MetadataValue.path(dst_dir), **meta}),
        )
        yield dg.AssetCheckResult(
            check_name="same_image_as_build_host",
            passed=same,
            severity=dg.AssetCheckSeverity.ERROR,
            metadata={"node": node.name, "image_id": node_image or "missing"},
            description=(f"{node.name}: image id identical to the build host's" if same else
                         f"{node.name} holds {node_image} but the build host built {serving_image.image_id}; "
                         "rerun node_artifacts for this node"),
        )

    @dg.asset(
        group_name="3_nodes",
        kinds={"ssh", "docker"},
        code_version=cv[steps.NODE_ARTIFACTS],
        description="The checkpoint and serving image pipelined down a tree: each node passes every shard (and "
                    "each part of the image) on to the next as soon as it verified it; node_artifacts then verifies "
                    "each node and skips.",
    )
    @retry_unreachable(fleet.ssh)
    def artifact_distribution(context: dg.AssetExecutionContext, ssh: FleetSSH, mtp_weights: Checkpoint,
                              serving_image: BuiltImage) -> dg.MaterializeResult:
        # Fleet-wide (not partitioned): a tree spans nodes, so it runs in one step.
        s = ssh.session
        payload = distribution_payload(cv, mtp_weights, serving_image)
        try:
            report = distribute(s, s.fleet.serve_nodes, payload, log=context.log, run_id=context.run.run_id)
        except DistributionFailed as e:
            fail(e)
        return dg.MaterializeResult(metadata={
            "transfers": len(report.transfers), "seconds": report.seconds, **report.figures,
            "verified": ", ".join(report.verified) or "none", "already_holding": ", ".join(report.already_holding) or "none",
            "tree": dg.MetadataValue.md("\n".join(f"- {ln}" for ln in report.lines()) or "nothing to copy"),
        })

    @dg.asset(
        group_name="3_nodes",
        kinds={"docker", "vllm"},
        partitions_def=partitions,
        code_version=cv[steps.NODE_DEPLOYMENT],  # the procedure; the node's launch is node_launch's data
        deps=[steps.NODE_LAUNCH],
        check_specs=[node_check(
            "serving", steps.NODE_DEPLOYMENT, partitions,
            "Blocking, per node: after Phase 4 the container runs the image node_artifacts recorded "
            "with the expected launch-spec label, answers /health and the smoke test.")],
        description="Phase 4 on one node: preflight, launch, readiness + diagnosis, smoke test; rollback on failure. "
                    "Records the image id, container id and endpoint it serves.",
    )
    @retry_unreachable(fleet.ssh)
    def node_deployment(context: dg.AssetExecutionContext, config: DeployConfig, ssh: FleetSSH,
                        node_artifacts: NodeArtifacts):
        s = step_session(context, ssh)
        f = s.fleet
        node = f.node(context.partition_key)
        docker = NodeDocker(s)
        spec = launch_spec(f, node)
        # Every output points at the node_launch observation of the launch it ran for.
        launched = records.launch_input_tags(context, node.name, spec.fingerprint)

        pair = enabled_pair_of(f, node.name)
        if pair is not None:  # Phase 4-alt: this node serves in a pair, deployed as one (both nodes)
            yield from pair_deployment(context, s, node, pair, launched)
            return

        recorded = node_artifacts.image_id
        # What dead runs left on the node first (a bench's, Phase 0's journal): the skip below then
        # judges what serves after it. A dead deploy's journal is the deploy's own to finish (the
        # skip refuses while it is there): it then does not launch again what serves after it.
        with journal.claimed(s, node, "deploy: finishing dead runs", context.log, run_id=context.run.run_id,
                             deploys=False) as finished:
            for done in finished:
                context.log.warning(f"[{node.name}] {done.line}")
        current = docker.inspect_container(node.name, spec.container_name)
        marker = serves_as_marked(s, node, node_artifacts, cv[steps.NODE_DEPLOYMENT], current)
        if not config.fresh_jit_cache and marker is not None and current is not None:
            yield dg.Output(
                Deployment(node=node.name, container_id=current["Id"], fingerprint=spec.fingerprint),
                data_version=dg.DataVersion(marker.signature), tags=launched,
                metadata=readable({"skipped": True, "adopted": marker.adopted, **marker.metadata,
                                   **where(f, node, spec, current)}),
            )
            yield dg.AssetCheckResult(check_name="serving", passed=True, metadata={"node": node.name},
                                      description=f"{node.name}: already serving this launch spec")
            return

        refused = node_rollout.refusal(s, node, recorded, node_artifacts.manifest, spec.fingerprint)
        if refused and not config.allow_rejected:
            fail(RunbookError(refused))
        if refused:
            context.log.warning(f"{refused} (allow_rejected: deploying it anyway)")
            markers.clear(s, node, markers.REJECTED)

        tagged = docker.image_id(node.name, spec.image)
        if tagged is not None and tagged != recorded:
            # Launching the tag would start another image than node_artifacts verified; say so.
            why = (f"{node.name}: {spec.image} there is image {tagged[7:19]} but node_artifacts recorded "
                   f"{(recorded or 'none')[7:19]} (a rollback put the previous image back); rerun node_artifacts "
                   f"for {node.name} to copy the image again, then node_deployment deploys it")
            yield dg.Output(
                Deployment(node=node.name, container_id=(current or {}).get("Id"), fingerprint=spec.fingerprint),
                data_version=dg.DataVersion(f"mismatch-{tagged[7:19]}"), tags=launched,
                metadata={"skipped": False, "deployed": False, **where(f, node, spec, current)},
            )
            yield dg.AssetCheckResult(check_name="serving", passed=False, severity=dg.AssetCheckSeverity.ERROR,
                                      metadata={"node": node.name}, description=why)
            return

        d = deploy_artifacts(s, node, node_artifacts, cv[steps.NODE_DEPLOYMENT], context.log, run_id=context.run.run_id,
                             fresh_jit_cache=config.fresh_jit_cache)
        yield dg.Output(d.deployment, data_version=dg.DataVersion(d.data_version), metadata=deploy_metadata(f, node, d), tags=launched)
        yield dg.AssetCheckResult(check_name="serving", passed=d.mismatch is None,
                                  severity=dg.AssetCheckSeverity.ERROR, metadata={"node": node.name},
                                  description=d.check_text)

    deploy_node_job = dg.define_asset_job(
        steps.DEPLOY_JOB, selection=dg.AssetSelection.assets(steps.NODE_ARTIFACTS, steps.NODE_DEPLOYMENT, steps.JIT_CACHE),
        tags=max_runtime(fleet, steps.DEPLOY_JOB),
        description="Artifacts and deployment on one node (a partition): copy, preflight, launch, verify, "
                    "or roll back to the previous deployment; after a healthy boot, the node's compiled kernels "
                    "are archived on the build host (jit_cache).")
    distribute_job = dg.define_asset_job(
        steps.DISTRIBUTE_JOB, selection=dg.AssetSelection.assets(steps.ARTIFACT_DISTRIBUTION),
        tags=max_runtime(fleet, steps.DISTRIBUTE_JOB),
        description="Fan the checkpoint and image out to every serve node along a tree (run before deploy_node_job).")
    return dg.Definitions(assets=[node_launch_asset, node_artifacts, artifact_distribution, node_deployment],
                          jobs=[deploy_node_job, distribute_job])
