"""A node new to the fleet file, from nothing to benched and in the gateway (add_node_job):
Phase 0 and its reboot, the checkpoint and image from the nearest verified holder, the deploy, the
isolated bench against the floors and the fleet's baseline, then the gateway.

Under its journal until its bench promoted it: a run that dies before leaves the newcomer held
out (never routed unbenched), and add_node_job again redoes nothing it finished. The serving nodes
are only read from (a holder sends the copy); the gateway changes only by the new node's own routes.
The Dagster side records each step on its own asset through `JoinRecords`.
"""

from __future__ import annotations

from typing import Any, Protocol

from spark_pipelines.core import baseline, layout
from spark_pipelines.core import steps
from spark_pipelines.core.artifacts import BuiltImage, Checkpoint, NodeArtifacts
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.core.fleet import Node
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook import journal, node_os
from spark_pipelines.runbook.bench import Benched, bench_node
from spark_pipelines.runbook.deploy import NodeDeployed, deploy_artifacts, serves_as_marked
from spark_pipelines.runbook.distribution import DistributionReport, Payload, distribute
from spark_pipelines.runbook.journal import JOIN_BENCHED
from spark_pipelines.state import ledger


class JoinRecords(Protocol):
    """What add_node's step keeps of each phase (assets/node_join.py records them)."""

    def provisioned(self, node: str, done: node_os.Provisioned) -> None: ...

    def artifacts(self, node: str, image_id: str, copied: DistributionReport) -> None: ...

    def deployed(self, node: str, d: NodeDeployed) -> None: ...

    def benched(self, node: str, b: Benched) -> None:
        """The bench and what it did to the gateway (b.rotation)."""


def join(session: FleetSession, gw: GatewayHost, node: Node, checkpoint: Checkpoint, image: BuiltImage,
         payload: Payload, deploy_code_version: str, against: baseline.Baseline | None, records: JoinRecords,
         log: Any, *, run_id: str, done: list[str]) -> None:
    """Bring `node` from nothing to benched and in the gateway; each phase finished is appended to
    `done` (the caller says them when a later phase fails). Raises RunbookError or
    DistributionFailed: the node stays held out."""
    fleet, name = session.fleet, node.name
    with journal.journaled(session, name, steps.PROC_JOIN, run_id, phase="phase0") as j:
        provisioned = node_os.provision(session, node, gw, log.info, run_id=run_id)
        records.provisioned(name, provisioned)
        done.append(f"Phase 0: {len(provisioned.applied)} change(s)" + (", rebooted" if provisioned.rebooted else "")
                    + "".join(f"; {line}" for line in provisioned.steps if "finished:" in line))

        j.update(phase="artifacts")
        copied = distribute(session, [node], payload, log=log, run_id=run_id)
        image_id = NodeDocker(session).image_id(name, image.ref)
        if image_id != image.image_id:
            raise RunbookError(f"{name} holds image {(image_id or 'none')[7:19]} after the copy, not the build "
                               f"host's {image.image_id[7:19]}: run add_node_job again")
        records.artifacts(name, image_id, copied)
        done.append("artifacts: " + ("; ".join(copied.lines()) or "already held"))
        artifacts = NodeArtifacts(node=name, path=layout.checkpoint_version_path(fleet, node, checkpoint),
                                  image=image.ref, image_id=image_id, index=checkpoint.index,
                                  manifest=checkpoint.manifest, architecture=checkpoint.architecture)

        j.update(phase="deploying")
        # Held out until its bench promotes it: no gateway_job or reconcile routes an unbenched
        # newcomer, whatever happens to this run (the bench's promotion lifts it).
        ledger.hold(session, name, ledger.BY_BENCH, f"not benched yet: joining the fleet (add_node_job run "
                                                    f"{run_id[:8]}); its bench promotes it",
                    **{ledger.AGAINST_BASELINE: True})
        running = NodeDocker(session).inspect_container(name, launch_spec(fleet, node).container_name)
        if serves_as_marked(session, node, artifacts, deploy_code_version, running) is not None:
            done.append("deployed: it serves this launch spec already (an earlier run's deploy): not redeployed")
        else:
            d = deploy_artifacts(session, node, artifacts, deploy_code_version, log, run_id=run_id, gated=True)
            records.deployed(name, d)
            if d.mismatch:
                raise RunbookError(d.mismatch)
            done.append("deployed: " + d.check_text)

        # The fleet's baseline judged inside the bench: a newcomer below it never serves a request.
        j.update(phase="benching")
        b = bench_node(session, gw, node, log, run_id=run_id, against=against)
        j.try_update(phase=JOIN_BENCHED)  # judged: its bench's verdict stands, whatever happens next
        records.benched(name, b)
        if not b.promoted:
            raise RunbookError(f"{name} joined the fleet but not the gateway: {b.reason}; held out by its bench: "
                               "add_node_job again or bench_job promotes it once it passes its floors "
                               "and the fleet's baseline")
        done.append(f"bench: {b.mean:.1f} tok/s ({b.reason}); in the gateway")
