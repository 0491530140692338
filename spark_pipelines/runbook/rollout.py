"""The node-side half of a rollout: the new version onto every node and who runs what
(`survey`), put a node's previous deployment back after its commit (`revert`), or let it go once
the rollout is over (`finish`).

A rollout's deploy (`deploy(..., keep_previous=True)`) commits without dropping the replaced
container, its image tag or its JIT cache slots, and writes the node's ROLLOUT_POINT marker. A
node that then fails a later gate (its bench) is reverted from that marker, which survives the
run; a node that passes its gate says so on the marker (`mark_passed`). A rollout killed half-way
is finished by its rerun: first what the dead run left on each node (`finish_dead_runs`: its
deploy's or bench's journal), so no deploy waits behind a dead drain; then each node already on
the new version is either one that passed (finished with the rest at the end, its kept version
dropped) or one never judged (`Survey.unjudged`: gated now, not deployed again).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import baseline, remote
from spark_pipelines.core.fleet import Node
from spark_pipelines.core import versions as versions_core
from spark_pipelines.core.launch import (CHECKPOINT_LABEL, CHECKPOINT_VERSION_LABEL, DEPLOY_LABEL, KERNELS_LABEL,
                                         LaunchSpec, launch_spec)
from spark_pipelines.core.polling import poll_until
from spark_pipelines.resources.docker import NodeDocker, PreviousDeploy
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSession, RemoteError
from spark_pipelines.runbook import jit_cache, quarantine, versions
from spark_pipelines.runbook.journal import claimed
from spark_pipelines.resources import engine
from spark_pipelines.state import ledger, markers
from spark_pipelines.state.markers import RolloutPoint
from spark_pipelines.runbook.deploy import ROLLOUT_POINT, labels_of
from spark_pipelines.runbook.transaction import ROLLBACK_HEALTH_S, restore_deploy_marker
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.resources.lease import NodeBusy
from spark_pipelines.runbook.distribution import DistributionFailed, Payload, distribute
from spark_pipelines.runbook.rotation import drained

_T = remote.PROBE_TIMEOUT_S


def version(image_id: str | None, fingerprint: str | None, checkpoint: str | None = None) -> str:
    """A node's version as the rollout table shows it: image id, launch spec and checkpoint
    version (core/versions.py), short."""
    return (f"image {(image_id or 'none')[7:19]}, spec {(fingerprint or 'none')[:8]}, "
            f"checkpoint {versions_core.short(checkpoint) or 'unknown'}")


NO_COPY = "no verified copy of the new version"
ALREADY_SERVES = "already serves the new version"  # its image, launch spec and checkpoint, healthy


@dataclass
class Survey:
    """Where the fleet stands before a rollout's first deploy."""

    new: dict[str, str]  # node -> the version it is to run
    before: dict[str, str]  # node -> the version it runs ("nothing")
    running: dict[str, baseline.BenchIdentity]  # node -> the identity its benches record
    rotation: list[str]  # who the gateway routes to
    skip: dict[str, str] = field(default_factory=dict)  # node -> why the rollout leaves it as it is
    # On the new version already with a rollout point a dead run left: passed its gate (finished
    # at the end with the others) or never judged (gated by this run, not deployed again).
    passed: list[str] = field(default_factory=list)
    unjudged: list[str] = field(default_factory=list)

    @property
    def already_serving(self) -> list[str]:
        """The nodes left as they are because they serve the new version, healthy, already."""
        return [n for n, why in self.skip.items() if why == ALREADY_SERVES]

    @property
    def nothing_to_do(self) -> bool:
        """Every node skipped, and none for want of a copy (that is a failure, not nothing to do)."""
        return len(self.skip) == len(self.new) and not any(why.startswith(NO_COPY) for why in self.skip.values())


def survey(session: FleetSession, gw: GatewayHost, payload: Payload, log: Any, *, run_id: str = "") -> Survey:
    """The new version onto every serve node first (the tree; holders are skipped in seconds),
    then who runs what, who already serves the new version, who is quarantined and who is in the
    gateway. Changes nothing that serves. Raises RunbookError when the gateway cannot be read: no
    plan without knowing who serves."""
    fleet = session.fleet
    skip: dict[str, str] = {}
    try:
        distribute(session, fleet.serve_nodes, payload, log=log, run_id=run_id)
    except DistributionFailed as e:
        skip.update({n: f"{NO_COPY} ({e.description[:160]})" for n in getattr(e, "report").given_up})
    docker = NodeDocker(session)
    new = {n.name: version(payload.image_id, launch_spec(fleet, n).fingerprint, payload.manifest) for n in fleet.serve_nodes}
    before: dict[str, str] = {}
    running: dict[str, baseline.BenchIdentity] = {}
    passed: list[str] = []
    unjudged: list[str] = []
    for n in fleet.serve_nodes:
        c = docker.inspect_container(n.name, launch_spec(fleet, n).container_name)
        labels = labels_of(c, markers.read_deploy(session, n)) if c else {}
        before[n.name] = (version(c.get("Image"), labels.get(DEPLOY_LABEL), labels.get(CHECKPOINT_VERSION_LABEL))
                          if c else "nothing")
        if c:
            running[n.name] = baseline.identity_of(c, labels, [], launch_label=KERNELS_LABEL,
                                                   checkpoint_label=CHECKPOINT_LABEL)
        if before[n.name] == new[n.name] and engine.healthy(fleet, n):
            point = read_point(session, n)
            if point is not None and not point.passed:
                unjudged.append(n.name)  # a dead run deployed it and never judged it: its gate is owed
            else:
                skip.setdefault(n.name, ALREADY_SERVES)
                if point is not None:
                    passed.append(n.name)
    for name, rec in quarantine.quarantined(session).items():
        skip.setdefault(name, f"quarantined: {rec.summary()}")
    try:
        rotation = gw.rotation()
    except Exception as e:
        raise RunbookError(f"rollout refused, nothing deployed: the gateway host {fleet.gateway.host} could not be "
                           f"read ({first_line(e)}); bring it back and rerun rollout_job") from None
    return Survey(new, before, running, rotation, skip, [n for n in passed if n not in unjudged],
                  [n for n in unjudged if n not in skip])


def finish_dead_runs(session: FleetSession, log: Any, *, run_id: str = "") -> list[str]:
    """Before a rollout plans: what dead runs left on each serve node (a killed rollout's deploy
    or bench: its journal), finished under the node's lease, so the node is back serving (or out
    with its reason) and no deploy of this rollout waits behind a dead drain. A node another run
    holds is left to that run. Returns what was done, one line each."""
    said = []
    for n in session.fleet.serve_nodes:
        try:
            with claimed(session, n, "rollout: finishing dead runs", log, run_id=run_id) as finished:
                said += [f"{n.name}: {x.line}" for x in finished]
        except NodeBusy as e:
            said.append(f"{n.name}: not finished here ({first_line(e)})")
        except RunbookError as e:
            said.append(f"{n.name}: what a dead run left could not be finished ({first_line(e)})")
    return said


def read_point(session: FleetSession, node: Node) -> RolloutPoint | None:
    return markers.read_typed(session, node, ROLLOUT_POINT, RolloutPoint)


def mark_passed(session: FleetSession, node: Node, run_id: str) -> None:
    """The node passed this rollout's gate on its new version: its point says so, so a rerun after
    this run died finishes it (drops the kept version) instead of judging it again."""
    try:
        point = read_point(session, node)
        if point is not None:
            markers.write_typed(session, node, ROLLOUT_POINT, point.model_copy(update={"passed": run_id or "yes"}))
    except Exception as e:  # it passed either way; a rerun after this run died would only gate it again
        session.log.warning(f"[{node.name}] its rollout point does not say it passed ({first_line(e)}): a rerun of this "
                      "rollout after a crash gates it again")


def kept(session: FleetSession, node: Node, spec: LaunchSpec, point: RolloutPoint | None = None) -> PreviousDeploy | None:
    """The deployment a rollout kept on the node (from its point, read when not given), or None."""
    point = point or read_point(session, node)
    if point is None or not point.container_id:
        return None
    return PreviousDeploy(remote.previous_container_name(spec.container_name), str(point.image_id),
                          remote.previous_image_tag(spec.image), point.container_id, point.fingerprint or "")


def revert(session: FleetSession, node: Node, spec: LaunchSpec, log: Any, *, why: str, run_id: str = "",
           wedged: bool = False) -> str:
    """Put back the deployment the rollout replaced on `node`: out of the gateway, the kept
    container (and its image tag, cache mounts and step marker) back, /health waited for, then
    back in the gateway with the bench gate it had before. `wedged`: its gate's bench saw the
    PD-firmware wedge: the GPU stays wedged whatever version runs, so the node stays out,
    quarantined (wedged) with its bench's hold-out, as a bench_job leaves it (the cold drain's
    validation releases it). Raises RunbookError when there is nothing kept or the previous
    deployment does not serve again (the node then stays out)."""
    n = node.name
    with claimed(session, node, "rollout revert", log, run_id=run_id):
        point = read_point(session, node) or RolloutPoint()
        prev = kept(session, node, spec, point)
        if prev is None:
            raise RunbookError(f"{n}: the rollout kept no previous deployment to put back (it had none, or the "
                               f"ROLLOUT_POINT marker is gone); {n} stays on the new version, out of the gateway: "
                               f"deploy a known-good version to it")
        gw = GatewayHost(session)
        # dead: a node that failed its gate is no backend to count for the rotation's floor.
        with drained(gw, n, reason=f"rollout revert: {why[:120]}", dead=True) as drain:
            drain.keep_out = True
            docker = NodeDocker(session)
            # The checkpoint first: a kept container that mounts the whole models directory (an
            # adopted hand deploy) reads it through the runbook's path when it starts again.
            checkpoint = (versions.point_back(session, node, point.checkpoint_link, log)
                          if point.checkpoint_now and point.checkpoint_link != point.checkpoint_now else "")
            # The cache mounts before the container: a bind mount resolves its symlink when the
            # container starts, and the previous version fails on the new one's kernels (stale).
            _relink_cache(session, node, point, log)
            restored = docker.restore_previous(n, spec.container_name, spec.image, prev)
            restore_deploy_marker(session, node, point.deploy_marker, restored)
            limit = min(ROLLBACK_HEALTH_S, session.fleet.launch_for(node).health_timeout_s)
            if not poll_until(lambda: engine.healthy(session.fleet, node), bool, timeout_s=limit, every_s=2.0).done:
                ledger.hold(session, n, ledger.BY_ROLLOUT, f"rollout reverted it ({why}) but the previous deployment "
                                                     f"did not answer /health within {limit:.0f} s")
                raise RunbookError(f"{n}: previous deployment put back but NOT healthy after {limit:.0f} s; {n} "
                                   f"stays out of the gateway: read its container log")
            # The hold-outs the node had before the rollout's deploy (its bench's included) come back;
            # a wedge its gate saw stays, with the quarantine the wedge policy keeps it out by.
            holds = {by: ledger.Hold.model_validate(h) for by, h in point.holds_before.items()}
            wedge_hold = ledger.read(session).entry(n).holds.get(ledger.BY_BENCH) if wedged else None
            if wedge_hold is not None:
                holds[ledger.BY_BENCH] = wedge_hold
            led = ledger.set_holds(session, n, holds)
            if wedged:
                quarantine.quarantine(session, node, "wedged", f"PD-firmware wedge under load on the rollout's gate bench "
                                                         f"({why[:200]}); the previous version is back but the GPU "
                                                         f"stays wedged: cold_drain_job for {n} (runbook: AC cold "
                                                         f"drain)", by=f"rollout revert (run {run_id[:8] or '-'})",
                                      gw=gw)
            drain.keep_out = wedged or not led.promoted(n)
        markers.clear(session, node, ROLLOUT_POINT)
    where = ("kept out of the gateway: quarantined (wedged), cold_drain_job for it" if wedged else
             "back in the gateway" if not drain.keep_out else
             "kept out of the gateway by the hold-outs it had before the rollout")
    return (f"previous deployment put back on {n} (container {restored[:12]}, healthy)"
            + (f", {checkpoint}" if checkpoint else "") + f", {where}")


def _relink_cache(session: FleetSession, node: Node, point: RolloutPoint, log: Any) -> None:
    """The cache mounts as they were before the rollout's deploy (best effort: a cold cache costs
    a slow boot, never a wrong one: slots are keyed)."""
    n, failed = node.name, []
    for mount, target in point.jit_links.items():
        try:
            session.run(n, ["ln", "-sfn", "--", target, mount], log=False, timeout=_T)
        except Exception as e:
            failed.append(f"{mount}: {first_line(e)}")
    for mount, aside in reversed(point.jit_set_aside):
        try:
            session.run(n, ["rm", "-f", "--", mount], log=False, timeout=_T)
            session.run(n, ["mv", "-T", "--", aside, mount], log=False, timeout=_T)
        except Exception as e:
            failed.append(f"{mount} (kept as {aside}): {first_line(e)}")
    if failed:
        log.warning(f"[{n}] JIT cache mounts not all put back: {'; '.join(failed)}; the next deploy re-links them")


def archive_cache(session: FleetSession, node: Node, spec: LaunchSpec, key: str | None, log: Any, *, run_id: str = "") -> str:
    """A node passed its gate (the canary first): its sealed compile cache archived on the build
    host, once per key, before the next wave deploys, so each wave node boots on it (shipped,
    verified) instead of compiling. A failure costs the waves a cold boot, never the rollout."""
    if key is None or not session.fleet.launch.ship_jit_cache:
        return "not archived (no key, or launch.ship_jit_cache is off)"
    try:
        with node_lease(session, node.name, "rollout: archive its JIT cache", run_id=run_id):
            done = jit_cache.back_up(session, node, spec, key)
    except (RunbookError, RemoteError) as e:
        log.warning(f"[{node.name}] its JIT cache was not archived for the waves: {first_line(e)}; they boot cold")
        return f"not archived: {first_line(e)}"
    said = f"JIT cache of key {key}: {done['action']}" + (f" ({done['why']})" if done.get("why") else "")
    log.info(f"[{node.name}] {said}" + (": the next waves boot on it" if done["action"] in ("archived", "present") else ""))
    return said


def reject(session: FleetSession, nodes: list[Node], image_id: str, manifest: str | None, judged: Any, *,
           run_id: str = "") -> str:
    """A version its gate stopped (`judged`: core.gate.GateResult) is recorded as rejected on
    `nodes` (those that do not run it: markers.RejectedVersion, with the node's own launch spec): a
    deploy_node_job or a healing redeploy, which deploy the newest build without a gate, then refuse
    it there. Best effort per node: one not written is said, not fatal."""
    fleet = session.fleet
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    missed = []
    for n in nodes:
        marker = markers.RejectedVersion(image_id=image_id, checkpoint=versions_core.short(manifest) or None,
                                         fingerprint=launch_spec(fleet, n).fingerprint, node=judged.node,
                                         gate=judged.gate, why=judged.why[:500], run_id=run_id, since=since)
        try:
            markers.write_typed(session, n, markers.REJECTED, marker)
        except Exception as e:  # noqa: PERF203 - each node on its own
            missed.append(f"{n.name} ({first_line(e)})")
    said = (f"version {version(image_id, None, manifest)} recorded as rejected by its {judged.gate} gate on "
            f"{judged.node}: no ungated deploy puts it on a node")
    return said + (f"; NOT recorded on {', '.join(missed)}" if missed else "")


def refusal(session: FleetSession, node: Node, image_id: str | None, manifest: str | None, fingerprint: str) -> str | None:
    """Why a deploy of this version on `node` without a gate is refused (None: it is not one a
    rollout rejected)."""
    rejected = markers.read_typed(session, node, markers.REJECTED, markers.RejectedVersion)
    if rejected is None or not rejected.matches(image_id, versions_core.short(manifest), fingerprint):
        return None
    return (f"{node.name}: rollout {rejected.run_id[:8] or '-'} rejected this version ({version(image_id, fingerprint, manifest)}) "
            f"at the {rejected.gate} gate on {rejected.node} ({rejected.since}): {rejected.why[:200]}. A deploy "
            f"without a gate would put it on {node.name} anyway: fix the build and roll it out again (rollout_job), "
            f"or launch deploy_node_job for {node.name} with allow_rejected: true to deploy it knowingly")


def finish(session: FleetSession, node: Node, spec: LaunchSpec, log: Any, *, run_id: str = "") -> str:
    """The rollout is over for `node` on its new version: drop the kept container and image tag,
    wipe cache slots nothing points at any more, clear the marker. Failures are warnings: the
    node serves either way, and the next deploy supersedes what is left."""
    n = node.name
    with claimed(session, node, "rollout finish", log, run_id=run_id):
        prev = kept(session, node, spec)
        said = []
        try:
            if prev is not None:
                NodeDocker(session).drop_previous(n, spec.container_name, spec.image, prev)
                said.append(f"previous container {prev.container_id[:12]} dropped")
            wiped = jit_cache.prune_slots(session, n, spec, jit_cache.linked_slots(session, node, spec))
            if wiped:
                said.append(f"stale JIT caches wiped: {', '.join(wiped)}")
            markers.clear(session, node, ROLLOUT_POINT)
            markers.clear(session, node, markers.REJECTED)  # a version that passed its gate here is no longer rejected
        except Exception as e:
            log.warning(f"[{n}] serving its new version, but the rollback point was not all cleared: "
                        f"{first_line(e)}; the next deploy supersedes it")
        return "; ".join(said) or "nothing kept"
