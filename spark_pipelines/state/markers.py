"""Markers on nodes: what a step last produced and from which inputs, and what a deploy or a
rollout left for the next run to finish or undo.

A step marker is written only after the step's output was verified, so "marker matches + cheap
check passes" is a safe reason to skip the heavy remote work on a rerun with unchanged pins.

The deploy's and the rollout's markers are typed (`DeployMarker`, `RolloutPoint`,
`DeployJournal`): they are read by other runs than the one that wrote them (the next deploy, a
rollout's revert, the health sweep), so their fields are one declaration, not dict keys kept in
sync by hand. A torn or unreadable marker reads as absent: the step is redone, never skipped.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from spark_pipelines.core.fleet import Node
from spark_pipelines.core.layout import marker_path
from spark_pipelines.resources.ssh import FleetSession

# The step names of the typed markers (files under core.layout.STATE_DIR/markers/).
DEPLOY = "node_deployment"  # what node_deployment skips on: the container that serves the launch spec
ROLLOUT_POINT = "rollout_point"  # what a rollout's revert puts back (kept until the rollout finishes)
CLEAN_BOOT = "clean_boot"  # the node's memcheck after its Phase 0 reboot (node_os)
DEPLOY_JOURNAL = "deploy_journal"  # a deploy in flight: what it set aside, for whoever finds it dead
KNOWN_GOOD = "known_good"  # the versions the bench last promoted the node on (never garbage-collected)
REJECTED = "rejected_version"  # a version a rollout's gate stopped: no ungated deploy puts it on the node


def signature(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def deploy_signature(code_version: str, fingerprint: str, image_id: str | None, index: str) -> str:
    """The node_deployment marker's signature: what the step skips on (assets/nodes.py), what
    adoption and a rollout record for a node that serves already."""
    return signature(code_version, fingerprint, image_id, index)


def read(session: FleetSession, node: Node, step: str) -> dict[str, Any] | None:
    path = marker_path(node, step)
    if not session.exists(node.name, path):
        return None
    try:
        data = json.loads(session.read_text(node.name, path))
    except ValueError:
        return None  # a torn marker means "not done": redo the step
    return data if isinstance(data, dict) else None


def write(session: FleetSession, node: Node, step: str, sig: str, **facts: Any) -> None:
    session.put_text(node.name, marker_path(node, step), json.dumps({"signature": sig, **facts}, sort_keys=True))


def matches(session: FleetSession, node: Node, step: str, sig: str) -> dict[str, Any] | None:
    m = read(session, node, step)
    return m if m and m.get("signature") == sig else None


def clear(session: FleetSession, node: Node, step: str) -> None:
    session.run(node.name, ["rm", "-f", "--", marker_path(node, step)], log=False, timeout=60)


# ------------------------------------------------------------------------------ typed markers


class Marker(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


M = TypeVar("M", bound=Marker)


def read_typed(session: FleetSession, node: Node, step: str, model: type[M]) -> M | None:
    data = read(session, node, step)
    if data is None:
        return None
    try:
        return model.model_validate(data)
    except ValidationError:
        return None  # written by another version, or torn: absent (the step is redone, nothing skipped)


def write_typed(session: FleetSession, node: Node, step: str, marker: Marker) -> None:
    session.put_text(node.name, marker_path(node, step), marker.model_dump_json(exclude_defaults=True))


class DeployMarker(Marker):
    """What serves on the node, as node_deployment recorded it: the step skips while the running
    container is this one. `adopted`: a container spark-pipelines did not launch (a hand deploy
    of the runbook) found equal to the launch spec; it carries no labels (they cannot be added to
    a running container), so `labels` holds those a deploy would have put on it (launch spec,
    image, kernels, checkpoint) and stand for them while that container runs."""

    signature: str
    container_id: str | None = None
    adopted: bool = False
    labels: dict[str, str] = {}
    metadata: dict[str, Any] = {}


class CleanBoot(Marker):
    """The node's own clean-boot baseline: the runbook's memcheck right after a Phase 0 reboot,
    engine stopped. The memory gate and the residue verdict use it over the profile's figure."""

    free_gib: float
    measured_at: str


def read_clean_boot(session: FleetSession, node: Node) -> CleanBoot | None:
    return read_typed(session, node, CLEAN_BOOT, CleanBoot)


def write_clean_boot(session: FleetSession, node: Node, marker: CleanBoot) -> None:
    write_typed(session, node, CLEAN_BOOT, marker)


class RolloutPoint(Marker):
    """What a rollout's revert puts back on the node after its deploy committed: the kept
    container, its image and launch spec, the cache links and set-aside folders, the deploy
    marker from before, and the node's hold-outs from before (so a revert also undoes the bench)."""

    container_id: str | None = None
    image_id: str | None = None
    fingerprint: str | None = None
    jit_links: dict[str, str] = {}
    jit_set_aside: list[tuple[str, str]] = []
    deploy_marker: DeployMarker | None = None
    holds_before: dict[str, dict[str, Any]] = {}
    # The checkpoint version the runbook's path pointed at before the deploy (core/versions.py:
    # a version's name beside it); the revert points it back before the kept container restarts.
    checkpoint_link: str | None = None
    checkpoint_now: str | None = None  # the version the rollout's deploy pointed it at
    passed: str | None = None  # the rollout run whose gate the new version passed (None: not judged yet)


# The phases of a deploy's journal, in order. Whoever finds the journal of a run that is gone
# finishes from the phase it names (runbook.deploy.finish_interrupted):
# - draining: nothing on the node changed yet (the gateway drain may have been made);
# - setting-aside / launching / rolling-back: the previous deployment is (or may be) set aside:
#   roll back to it (by container id), cache links, image tag and step marker included;
# - committing: the new deployment was verified; committed if it still serves, else rolled back;
# - ending: committed or rolled back; only the deploy's gateway drain may remain to undo.
JOURNAL_PHASES = ("draining", "setting-aside", "launching", "committing", "rolling-back", "ending")


class DeployJournal(Marker):
    """A deploy in flight, written before it changes anything (its drain included), updated at
    each phase and removed when it committed or rolled back and the gateway is restored: a run
    that died between the two (kill -9, a lost host) leaves it, and the next run that takes the
    node's lease (or the health sweep's repair) finishes what it describes. `token` names the
    transaction (a process never finishes its own live one); `owner` is who wrote it, for the log."""

    run_id: str
    token: str = ""
    owner: str = ""  # "pid N on HOST"
    started: str
    phase: str  # one of JOURNAL_PHASES
    container_name: str = ""  # the launch profile's, as the deploy ran: recovery never relies on the fleet file
    image: str = ""  # the image reference it launched (`<repo>:previous` is derived from it)
    new_fingerprint: str | None = None  # the launch-spec label of the deployment it launched
    new_image_id: str | None = None
    new_container_id: str | None = None  # known once it passed its verification (phase committing)
    before_container_id: str | None = None  # the live container before anything changed
    kept_container_id: str | None = None  # the previous deployment, set aside as `<name>-previous`
    kept_image_id: str | None = None
    kept_fingerprint: str | None = None
    keep_previous: bool = False  # a rollout's deploy: its commit keeps the previous deployment
    gated: bool = False  # the new version stays out of the gateway until its bench promotes it
    drain_reason: str | None = None  # the drain note's reason this deploy writes (its run named in it)
    exporters: list[str] = []  # the exporters running before preflight stopped them
    exporter_units: list[str] = []  # the exporter systemd units active before preflight stopped them
    jit_key: str | None = None
    jit_slots: list[str] = []
    jit_before: list[tuple[str, str, str | None]] = []  # (mount, kind, link target) before the switch
    jit_set_aside: list[tuple[str, str]] = []
    jit_retired: list[tuple[str, str]] = []
    jit_fresh: bool = False
    deploy_marker: DeployMarker | None = None  # the step marker before the deploy
    # The checkpoint versions (names beside the runbook's path): what it pointed at before this
    # deploy, and what the deploy points it at. Written before the link moves.
    checkpoint_before: str | None = None
    checkpoint_after: str | None = None
    outcome: str | None = None  # phase ending: what the commit or the rollback left


class KnownGood(Marker):
    """What the node last served when its bench promoted it: image, checkpoint version (short
    manifest digest) and JIT key. Garbage collection never removes them; a rollout's note names
    them as the version to go back to."""

    image_id: str | None = None
    checkpoint: str | None = None
    jit_key: str | None = None
    since: str = ""
    run_id: str = ""


def read_deploy(session: FleetSession, node: Node) -> DeployMarker | None:
    return read_typed(session, node, DEPLOY, DeployMarker)


def write_deploy(session: FleetSession, node: Node, marker: DeployMarker) -> None:
    write_typed(session, node, DEPLOY, marker)


class RejectedVersion(Marker):
    """A version a rollout's gate stopped (on `node`, at `gate`), written on every serve node: the
    healing redeploy or a deploy_node_job (which deploy the newest build without a gate) refuse to
    put exactly it (image, checkpoint version, this node's launch spec) on the node. Cleared by a
    rollout that finishes on the node, or a deploy told to allow it."""

    image_id: str
    checkpoint: str | None = None  # short manifest digest
    fingerprint: str = ""
    node: str = ""  # where its gate failed
    gate: str = ""
    why: str = ""
    run_id: str = ""
    since: str = ""

    def matches(self, image_id: str | None, checkpoint: str | None, fingerprint: str) -> bool:
        return (self.image_id == image_id and self.fingerprint == fingerprint
                and (self.checkpoint or "")[:16] == (checkpoint or "")[:16])


def read_known_good(session: FleetSession, node: Node) -> KnownGood | None:
    return read_typed(session, node, KNOWN_GOOD, KnownGood)


def read_journal(session: FleetSession, node: Node) -> DeployJournal | None:
    return read_typed(session, node, DEPLOY_JOURNAL, DeployJournal)
