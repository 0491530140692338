"""The JIT cache of each node as an artifact: backed up on the build host after a healthy boot.

The deploy switches a node's cache mounts to the slot of its key (runbook/jit_cache.py) and
restores it from this archive when the node has none; this asset makes the archive: once per
key, from the first node whose boot on that key was healthy.
"""

import dagster as dg

from spark_pipelines.assets import node_partitions, fail, retry_unreachable
from spark_pipelines.core.artifacts import Deployment, NodeArtifacts
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.core.jit_cache import key_for
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.runbook import jit_cache as jit_steps
from spark_pipelines.core.errors import RunbookError


def jit_cache_definitions(fleet: Fleet) -> dg.Definitions:
    @dg.asset(
        group_name="3_nodes",
        kinds={"ssh"},
        partitions_def=node_partitions(fleet),
        ins={"node_artifacts": dg.AssetIn(), "node_deployment": dg.AssetIn()},
        description="The node's compiled kernels (~/.cache/vllm, ~/.cache/flashinfer, ~/.triton), keyed by image "
                    "id, checkpoint architecture and the kernel-shaping launch flags, archived on the build host "
                    "with a manifest of its files after the first healthy boot on that key; a deploy ships it, "
                    "verified, so a node new to the key boots warm (7-10 min, not 25-45).",
    )
    @retry_unreachable(fleet.ssh)
    def jit_cache(context: dg.AssetExecutionContext, ssh: FleetSSH, node_artifacts: NodeArtifacts,
                          node_deployment: Deployment):
        s = ssh.session
        node = s.fleet.node(context.partition_key)
        spec = launch_spec(s.fleet, node)
        key = key_for(node_artifacts, spec)
        if key is None:
            fail(RunbookError(f"{node.name}: node_artifacts recorded no image id or checkpoint digest; rerun "
                              f"node_artifacts for {node.name}"))
        with node_lease(s, node.name, "jit-cache back-up", run_id=context.run.run_id):
            done = jit_steps.back_up(s, node, spec, key)
        context.log.info(f"[{node.name}] JIT cache {key}: {done['action']} ({done.get('why') or done['archive']})")
        meta = {"key": key, "action": done["action"], "archive": dg.MetadataValue.path(done["archive"]),
                "build_host": s.fleet.build_node.name}
        if "size_mib" in done:
            meta["size (MiB)"] = dg.MetadataValue.float(done["size_mib"])
            meta["seconds"] = dg.MetadataValue.float(done["seconds"])
        if "why" in done:
            meta["why"] = done["why"]
        return dg.MaterializeResult(metadata=meta, data_version=dg.DataVersion(f"{key}-{done['action']}"))

    return dg.Definitions(assets=[jit_cache])
