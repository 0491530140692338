"""A rollout's waves on the fleet: the plan from the survey (`plan`), then each node deployed with
its previous version kept, gated by its bench against the fleet's baseline, put back or finished
(`WaveSteps`, which core.rollout.execute drives node after node).

Each step holds the node's lease itself. What the Dagster side keeps of each step (the deploy's
and the bench's materializations, the gateway's rotation, the progress observations) it is handed
through `RolloutRecords`: the instance is read and written only on that side (pyproject's contracts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from spark_pipelines.core import baseline
from spark_pipelines.core import layout
from spark_pipelines.core import rollout as core
from spark_pipelines.core.gate import GateResult, judge
from spark_pipelines.core import jit_cache as jit_core
from spark_pipelines.core.artifacts import BuiltImage, Checkpoint, NodeArtifacts
from spark_pipelines.core.fleet import Node
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook import rollout as node_rollout
from spark_pipelines.runbook.bench import Benched, bench_node
from spark_pipelines.runbook.deploy import NodeDeployed, deploy_artifacts
from spark_pipelines.core.errors import RunbookError


class RolloutRecords(Protocol):
    """What the rollout's step keeps of each node step (assets/rollout.py records them)."""

    def deployed(self, node: str, d: NodeDeployed) -> None: ...

    def benched(self, node: str, b: Benched) -> None:
        """The bench and what it did to the gateway (b.rotation)."""

    def rotation(self, event: str) -> None: ...

    def reverted(self, node: str, said: str, why: str) -> None: ...


def plan(session: FleetSession, sv: node_rollout.Survey) -> core.RolloutPlan:
    """The waves over the serve nodes the survey left to change. A canary that serves the new
    version already has nothing to prove (one node's launch changed): the first node that changes
    goes alone instead. Raises core.RolloutRefused (nothing changed)."""
    fleet = session.fleet
    canary = None if sv.skip.get(fleet.rollout.canary or "") == node_rollout.ALREADY_SERVES else fleet.rollout.canary
    return core.plan_waves([n.name for n in fleet.serve_nodes], in_rotation=sv.rotation,
                           max_unavailable=fleet.rollout.max_unavailable, min_in_rotation=fleet.gateway.min_in_rotation,
                           canary=canary, skip=sv.skip)


@dataclass
class WaveSteps:
    """core.rollout.RolloutSteps on the fleet: deploy, gate, revert, finish, one node each."""

    s: FleetSession
    gw: GatewayHost
    records: RolloutRecords
    checkpoint: Checkpoint
    image: BuiltImage
    deploy_code_version: str  # node_deployment's code version (its step marker's signature)
    bench_gate: bool
    against: baseline.Baseline | None  # the fleet on the version most of the rotation ran
    new: dict[str, str]  # each node's new version string
    run_id: str
    log: Any
    deployed: set[str] = field(default_factory=set)  # on the new version by a dead run of this rollout: gate only
    passed: set[str] = field(default_factory=set)  # gate passed (this run's, or a dead run's of the same version)
    wedged: set[str] = field(default_factory=set)  # nodes whose gate bench saw the PD-firmware wedge

    def deploy(self, node: str) -> str:
        fleet = self.s.fleet
        target = fleet.node(node)
        if node in self.deployed:
            self.log.info(f"rollout: {node} runs the new version already (deployed by a dead run of this "
                          "rollout, never judged): not deployed again, gated")
            return self.new[node]
        artifacts = self._artifacts(target)
        # gated: out of the gateway from its deploy until its bench gate promotes it (no request
        # reaches a version before its gate); without the bench gate, back after the commit.
        d = deploy_artifacts(self.s, target, artifacts, self.deploy_code_version, self.log, run_id=self.run_id,
                             keep_previous=True, gated=self.bench_gate)
        self.records.deployed(node, d)
        if d.mismatch:  # committed, but not what was meant: back to the previous version
            said = self.revert(node, d.mismatch)
            raise RunbookError(f"{d.mismatch}; {said}")
        return self.new[node]

    def gate(self, node: str) -> GateResult:
        fleet = self.s.fleet
        target = fleet.node(node)
        if not self.bench_gate:
            node_rollout.mark_passed(self.s, target, self.run_id)
            self._archive_cache(target)
            return judge(node, healthy=True, benched=False)
        # Judged against the baseline inside the bench: a new version below it goes back to the
        # previous one without having served a request.
        b = bench_node(self.s, self.gw, target, self.log, run_id=self.run_id, against=self.against)
        self.records.benched(node, b)
        if b.gpu_verdict.state == "wedged":
            self.wedged.add(node)
        judged = b.gate
        assert judged is not None  # bench_node judges every bench it returns
        if judged.passed:
            self.passed.add(node)
            node_rollout.mark_passed(self.s, target, self.run_id)
            self._archive_cache(target)
        else:
            # Stopped by its gate: no ungated deploy (a healing redeploy, deploy_node_job) may put
            # this version on a node that does not run it; the nodes not reached would otherwise get
            # it that way. The nodes that passed keep it (and may be redeployed on it).
            said = node_rollout.reject(self.s, [m for m in fleet.serve_nodes if m.name not in self.passed],
                                       self.image.image_id, self.checkpoint.manifest, judged, run_id=self.run_id)
            self.log.info(said)
        return judged

    def _archive_cache(self, target: Node) -> None:
        """Passed (the canary first): its compile cache archived before the next wave, which boots on it."""
        spec = launch_spec(self.s.fleet, target)
        node_rollout.archive_cache(self.s, target, spec, jit_core.key_for(self._artifacts(target), spec), self.log,
                                   run_id=self.run_id)

    def _artifacts(self, target: Node) -> NodeArtifacts:
        return NodeArtifacts(node=target.name, path=layout.checkpoint_version_path(self.s.fleet, target, self.checkpoint),
                             image=self.image.ref, image_id=self.image.image_id, index=self.checkpoint.index,
                             manifest=self.checkpoint.manifest, architecture=self.checkpoint.architecture)

    def revert(self, node: str, why: str) -> str:
        target = self.s.fleet.node(node)
        spec = launch_spec(self.s.fleet, target)
        if node_rollout.kept(self.s, target, spec) is None:
            return "its deploy did not commit and had put the previous version back itself"
        said = node_rollout.revert(self.s, target, spec, self.log, why=why, run_id=self.run_id,
                                   wedged=node in self.wedged)
        self.records.rotation(f"rollout put {node} back on its previous version")
        self.records.reverted(node, said, why)
        return said

    def finish(self, node: str) -> str:
        target = self.s.fleet.node(node)
        return node_rollout.finish(self.s, target, launch_spec(self.s.fleet, target), self.log, run_id=self.run_id)
