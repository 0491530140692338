"""Phase 4 on one node, as a transaction: set aside -> launch -> verify -> commit, or roll back.

- drain first: a node the gateway routes to leaves its rotation before its old container stops
  and comes back after the commit or the rollback (`rotation.drained`). The drain keeps
  gateway.min_in_rotation, and at most rollout.max_unavailable nodes are out for a deploy at once:
  a deploy waits up to rollout.deploy_wait_s for its turn, then is refused, nothing changed. A node
  whose /health is down is drained at once (a dead backend is no backend).

- set aside: the last good deployment is stopped and kept as `<name>-previous` (by container id,
  image id and launch-spec label, `resources.docker.PreviousDeploy`); the step marker is read.
- launch: preflight (exporters stopped, page cache flushed, memory gate), `docker run`, readiness
  (vLLM milestones + log diagnosis).
- verify: /health, the smoke test, the container runs the image we meant.
- commit: the kept deployment is dropped; in a rollout (`keep_previous`) it stays, stopped, and
  the node's ROLLOUT_POINT marker says what to put back (`runbook.rollout.revert`) until the
  rollout finishes with it (`runbook.rollout.finish`). A version that must pass a gate first (a
  rollout's, a newcomer's: `gated`) stays out of the gateway after its commit, its drain kept and
  a `gate` hold-out in the ledger, until its bench promotes it: it serves no request before.

Every other way out, a blocked preflight, an unhealthy launch, a `docker run` that exits 125, an
SSH drop, a dockerd error, a timeout, and a BaseException such as KeyboardInterrupt or a Dagster
run termination, ends in the rollback: container, image tag and step marker put back together.
If the previous deployment does not answer /health after it, the node is taken out of the gateway
and the reason recorded (a hold-out in the ledger the gateway's promotion reads), and DeployFailed
says so. The exporters preflight stopped are started again on every path. The whole transaction
holds the node's run lease (`resources.lease`): one run per node at a time.

The transaction outlives its process: before it changes anything (its drain included) the deploy
writes its journal on the node (`state.markers.DeployJournal`), updates it at each phase (what it
set aside, by id; the exporters it stops; the cache links it repoints; the container it verified)
and removes it once it committed or rolled back and the gateway has the node back. A run killed in
between (kill -9, a lost host) leaves the journal, and its node lease ends with its connection. The
next run that takes the lease finds a journal no live transaction of its own wrote, so its owner no
longer holds the node, and `finish_interrupted` finishes it before anything else: the rollback (or,
when the new deployment had been verified and still serves, the commit), the exporters, and the
dead run's drain undone once the node serves again. The health sweep sees the same journal with
the lease free and requests the repair (`deploy_node_job`), so no hand step is needed.
"""

from __future__ import annotations

import os
import posixpath
import secrets
import socket
import time
from dataclasses import dataclass, replace
from typing import Any

from spark_pipelines.core import diagnosis
from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core import jit_cache as jit_core
from spark_pipelines.core import record_keys as keys
from spark_pipelines.core.fleet import Node
from spark_pipelines.core import remote
from spark_pipelines.core import versions as versions_core
from spark_pipelines.core.launch import (CHECKPOINT_LABEL, CHECKPOINT_VERSION_LABEL, DEPLOY_LABEL, IMAGE_LABEL,
                                         KERNELS_LABEL, LaunchSpec, launch_spec)
from spark_pipelines.core.polling import poll_until
from spark_pipelines.resources.docker import NodeDocker, PreviousDeploy, container_labels
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources import lease
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook import jit_cache, preflight, quarantine, versions
from spark_pipelines.resources import engine
from spark_pipelines.state import ledger, markers
from spark_pipelines.state.markers import DeployMarker, RolloutPoint
from spark_pipelines.core.errors import DeployFailed, RunbookError, first_line
from spark_pipelines.runbook.rotation import Drain, drained, put_back

READY_LINE = "Application startup complete"
DEPLOY_MARKER = markers.DEPLOY  # the step marker node_deployment skips on
ROLLOUT_POINT = markers.ROLLOUT_POINT  # what a rollout's revert puts back on the node (kept until it finishes)
# The previous deployment restarts warm (kernels cached): the runbook's warm boot is 7-10 min.
ROLLBACK_HEALTH_S = 600


def diagnosis_md(findings: list[diagnosis.Finding]) -> str:
    if not findings:
        return "no known failure signature matched; read the container log"
    return "\n".join(
        f"- **{f.signature.id}** (runbook: {f.signature.runbook_ref}) line {f.line_number}: `{f.line.strip()[:200]}`"
        f"\n  - cause: {f.signature.cause}\n  - fix: {f.signature.fix}"
        for f in findings
    )


def labels_of(container: dict[str, Any] | None, marker: DeployMarker | None) -> dict[str, str]:
    """The container's spark-pipelines labels. A container adopted from a hand deploy has none
    (labels cannot be added to a running container): while it is the one its deploy marker names,
    the labels recorded there stand for them."""
    labels = container_labels(container)
    if (DEPLOY_LABEL not in labels and container is not None and marker is not None and marker.adopted
            and marker.container_id == container.get("Id")):
        return {**labels, **marker.labels}
    return labels


def serving_mismatch(node: str, container: dict[str, Any] | None, image_id: str | None, fingerprint: str,
                     marker: DeployMarker | None = None, checkpoint: str | None = None) -> str | None:
    """Why the running container is not the deployment node_artifacts and the fleet file ask for
    (None when it is): the image id and the launch-spec label must both match (`labels_of`), and
    with `checkpoint` (a manifest digest) the checkpoint version it mounts."""
    if container is None or not container.get("State", {}).get("Running"):
        return f"{node}: the serving container is not running; rerun node_deployment for {node}"
    running = str(container.get("Image", ""))
    if image_id and running != image_id:
        return (f"{node} runs image {running[7:19]} but node_artifacts recorded {image_id[7:19]} (a rollback "
                f"put the previous image back); rerun node_artifacts for {node} to copy the image again, "
                f"then node_deployment deploys it")
    labels = labels_of(container, marker)
    label = labels.get(DEPLOY_LABEL)
    if label != fingerprint:
        return (f"{node} runs launch spec {label or '(unlabelled, deployed by an older version)'} but the fleet "
                f"file gives {fingerprint}; rerun node_deployment for {node}")
    if checkpoint and not versions_core.same(labels.get(CHECKPOINT_VERSION_LABEL), checkpoint):
        running_version = labels.get(CHECKPOINT_VERSION_LABEL) or "(unknown: deployed before checkpoint versions)"
        return (f"{node} runs checkpoint version {running_version} but node_artifacts recorded "
                f"{versions_core.short(checkpoint)}; rerun node_deployment for {node}")
    return None


def launch_and_wait(s: FleetSession, node: Node, spec: LaunchSpec, timeout_s: float) -> tuple[bool, str, diagnosis.Readiness]:
    docker = NodeDocker(s)
    s.run(node.name, ["mkdir", "-p", *spec.host_dirs], log=False, timeout=60)
    docker.run_container(node.name, spec.docker_run_argv())
    watch = docker.follow_logs(node.name, spec.container_name, until=lambda line: READY_LINE in line, timeout=timeout_s)
    log_text = docker.logs(node.name, spec.container_name, tail="all")
    ready = diagnosis.milestones(log_text)
    ok = bool(watch.matched) and engine.wait_healthy(s.fleet, node, 60)
    return ok, log_text, ready


@dataclass
class Deployed:
    container_id: str
    metadata: dict[str, Any]
    preflight: str
    findings: list[diagnosis.Finding]
    smoke_tokens: int
    image_id: str = ""
    spec: LaunchSpec | None = None  # as launched, labels included


class _NotServing(RunbookError):
    """The launch ran but did not serve (blocked preflight, unhealthy, no smoke tokens)."""


def restore_deploy_marker(s: FleetSession, node: Node, marker: DeployMarker | None, restored_id: str) -> None:
    """The step marker must describe what runs after a rollback: the one read before the deploy
    when the restored container is the one it names, else a marker no skip can match."""
    if marker and marker.container_id == restored_id:
        markers.write_deploy(s, node, marker)
    else:
        markers.write_deploy(s, node, DeployMarker(signature="rolled-back", container_id=restored_id))


# The journals of the transactions this process runs now: never "finished" as a dead run's.
_LIVE: set[str] = set()


class _Journal:
    """One deploy's journal on its node (see the module doc). Each write is atomic (a temp file
    renamed into place). A write that fails before a change fails the deploy with nothing done; one
    that fails later fails it into its rollback: a change no journal describes is one no later run
    could finish."""

    def __init__(self, s: FleetSession, node: Node, entry: markers.DeployJournal) -> None:
        self.s, self.node, self.entry = s, node, entry

    @classmethod
    def begin(cls, s: FleetSession, node: Node, spec: LaunchSpec, run_id: str, *, keep_previous: bool,
              drain_reason: str | None, gated: bool = False) -> _Journal:
        entry = markers.DeployJournal(
            run_id=run_id, token=secrets.token_hex(8), owner=f"pid {os.getpid()} on {socket.gethostname()}",
            started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), phase="draining",
            container_name=spec.container_name, image=spec.image, keep_previous=keep_previous, gated=gated,
            drain_reason=drain_reason)
        j = cls(s, node, entry)
        _LIVE.add(entry.token)
        markers.write_typed(s, node, markers.DEPLOY_JOURNAL, entry)
        return j

    @property
    def phase(self) -> str:
        return self.entry.phase

    def update(self, **fields: Any) -> None:
        self.entry = self.entry.model_copy(update=fields)
        markers.write_typed(self.s, self.node, markers.DEPLOY_JOURNAL, self.entry)

    def try_update(self, **fields: Any) -> None:
        """On the way out (rollback): a journal that cannot be written must not stop the undo."""
        try:
            self.update(**fields)
        except Exception as e:
            self.s.log.warning(f"[{self.node.name}] the deploy journal was not updated ({first_line(e)}): "
                               f"the next run on {self.node.name} finishes from phase {self.entry.phase}")

    def end(self) -> None:
        """Remove it once the deploy ended (or never changed anything); otherwise (a rollback cut
        short) it stays for the next run on the node."""
        _LIVE.discard(self.entry.token)
        if self.entry.phase not in ("draining", "ending"):
            self.s.log.warning(f"[{self.node.name}] the deploy ended in phase {self.entry.phase}: its journal stays "
                               f"on the node and the next run there finishes it")
            return
        try:
            markers.clear(self.s, self.node, markers.DEPLOY_JOURNAL)
        except Exception as e:  # the next run on the node finds it ended and only removes it
            self.s.log.warning(f"[{self.node.name}] the deploy journal was not removed ({first_line(e)}); the next "
                               f"run on {self.node.name} removes it")


class _Transaction:
    """The state one deploy keeps for its rollback."""

    def __init__(self, s: FleetSession, node: Node, spec: LaunchSpec, log: Any, drain: Drain | None = None,
                 keep_previous: bool = False, gated: bool = False) -> None:
        self.s, self.node, self.spec, self.log = s, node, spec, log
        self.keep_previous = keep_previous  # a rollout's deploy: the rollback point outlives the commit
        self.gated = gated  # the new version stays out of the gateway until its bench promotes it
        self.drain = drain  # the deploy's own drain: a node that cannot serve is kept out by it
        self.docker = NodeDocker(s)
        self.before: dict[str, Any] | None = None  # the live container before anything changed
        self.kept: PreviousDeploy | None = None
        self.marker: DeployMarker | None = None
        self.prepared: preflight.Prepared | None = None
        self.jit: jit_cache.Switch | None = None  # the cache mounts as switched for this launch
        self.checkpoint: versions.Pointed | None = None  # the runbook's path as pointed for this launch
        self.committed = False
        self.journal: _Journal | None = None

    def note(self, **fields: Any) -> None:
        if self.journal is not None:
            self.journal.update(**fields)

    @classmethod
    def from_journal(cls, s: FleetSession, node: Node, j: markers.DeployJournal, log: Any) -> _Transaction:
        """The transaction a dead run left, as its journal describes it (container name and image
        as it ran them, not as the fleet file says now)."""
        spec = launch_spec(s.fleet, node)
        spec = replace(spec, container_name=j.container_name or spec.container_name, image=j.image or spec.image)
        txn = cls(s, node, spec, log, keep_previous=j.keep_previous, gated=j.gated)
        txn.before = {"Id": j.before_container_id} if j.before_container_id else None
        if j.kept_container_id:
            txn.kept = PreviousDeploy(remote.previous_container_name(spec.container_name), j.kept_image_id or "",
                                      remote.previous_image_tag(spec.image), j.kept_container_id,
                                      j.kept_fingerprint or "")
        txn.marker = j.deploy_marker
        txn.prepared = (preflight.Prepared(list(j.exporters), list(j.exporter_units))
                        if j.exporters or j.exporter_units else None)
        if j.jit_key and j.jit_before:
            txn.jit = jit_cache.Switch(
                node.name, jit_core.Plan(j.jit_key, "recovered", "as the interrupted deploy switched it"),
                [jit_core.MountState(path, kind, target) for path, kind, target in j.jit_before], list(j.jit_slots),
                set_aside=[tuple(p) for p in j.jit_set_aside], retired=[tuple(p) for p in j.jit_retired],
                linked=[path for path, _, _ in j.jit_before], fresh=j.jit_fresh)
        if j.checkpoint_after:
            txn.checkpoint = versions.Pointed(node.name, j.checkpoint_before, j.checkpoint_after)
        return txn

    def set_aside(self) -> None:
        n, name = self.node.name, self.spec.container_name
        if self.keep_previous:  # a point exists only once this deploy committed (an older one is superseded)
            markers.clear(self.s, self.node, ROLLOUT_POINT)
        self.marker = markers.read_deploy(self.s, self.node)
        self.before = self.docker.inspect_container(n, name)
        serving = engine.healthy(self.s.fleet, self.node) if self.before else None
        self.note(phase="setting-aside", before_container_id=str(self.before["Id"]) if self.before else None,
                  deploy_marker=self.marker)
        self.kept = self.docker.keep_previous(n, name, self.spec.image, serving=serving)
        k = self.kept
        self.note(phase="launching", kept_container_id=k.container_id if k else None,
                  kept_image_id=k.image_id if k else None, kept_fingerprint=k.fingerprint if k else None)

    def prepare(self) -> None:
        containers, units = running = preflight.running_exporters(self.s, self.node)
        self.note(exporters=containers, exporter_units=units)
        try:
            self.prepared = preflight.prepare(self.s, self.node, running)
        except BaseException:
            # Half-way: start again whatever exporter ran before (starting a running one is a no-op).
            self.prepared = preflight.Prepared(containers, units)
            raise

    def restore_exporters(self) -> None:
        if not self.prepared or not self.prepared.stopped_any:
            return
        try:
            preflight.restore_exporters(self.s, self.node, self.prepared)
        except Exception as e:  # monitoring, not serving: say so, do not mask the deploy's outcome
            p = self.prepared
            self.s.log.warning(f"[{self.node.name}] could not start the exporters again "
                               f"({', '.join((*p.stopped_exporters, *p.stopped_units))}): {first_line(e)}; "
                               "start them by hand (`docker start`, `sudo systemctl start`)")

    def switch_jit_cache(self, key: str, fresh: bool) -> None:
        def noted(sw: jit_cache.Switch) -> None:
            self.note(jit_key=sw.plan.key, jit_slots=list(sw.slots), jit_fresh=sw.fresh,
                      jit_before=[(st.path, st.kind, st.target) for st in sw.before],
                      jit_set_aside=list(sw.set_aside), jit_retired=list(sw.retired))

        self.jit = jit_cache.switch(self.s, self.node, self.spec, key, self.log, fresh=fresh, noted=noted)

    def point_checkpoint(self, name: str) -> None:
        """The runbook's path at the version this launch mounts (journaled before the link moves)."""
        self.checkpoint = versions.point(self.s, self.node, name,
                                         noted=lambda before, after: self.note(checkpoint_before=before,
                                                                               checkpoint_after=after))

    def commit(self) -> None:
        if self.keep_previous:
            # Written before the deploy counts as committed: a point that could not be written
            # (SSH dropped here) is a failed deploy, rolled back, never a committed node no
            # revert could find.
            self._keep_rollout_point()
        if self.gated:  # after the point, which keeps the hold-outs from before this deploy
            self._hold_until_benched()
        self.committed = True
        if self.gated and self.drain is not None:
            self.drain.keep_out = True  # out until its bench promotes it, whatever happens next
        if self.keep_previous:
            return
        if self.jit is not None:
            self._seal()
            try:
                wiped = jit_cache.prune(self.s, self.jit, self.spec)
                if wiped:
                    self.s.log.info(f"[{self.node.name}] stale JIT caches wiped: {', '.join(wiped)}")
            except Exception as e:  # serving; the stale slots are never mounted and the next deploy retries
                self.s.log.warning(f"[{self.node.name}] healthy, but stale JIT caches were not wiped: "
                                   f"{first_line(e)}; the next deploy tries again")
        try:
            self.docker.drop_previous(self.node.name, self.spec.container_name, self.spec.image, self.kept)
            markers.clear(self.s, self.node, ROLLOUT_POINT)  # an unfinished rollout's point is gone with it
        except Exception as e:  # the new deployment serves; a stale rollback point is superseded next time
            self.s.log.warning(f"[{self.node.name}] healthy, but the rollback point was not removed: {first_line(e)}")
        self._clear_deploy_gate()

    def _seal(self) -> None:
        if self.jit is None:
            return
        try:
            gone = jit_cache.seal(self.s, self.jit)
            if gone:
                self.s.log.info(f"[{self.node.name}] the stale JIT cache's archive was deleted: {', '.join(gone)}")
        except Exception as e:  # serving; only the back-up of this cache waits for the next deploy
            self.s.log.warning(f"[{self.node.name}] healthy, but its JIT cache was not marked sealed: "
                               f"{first_line(e)}; it is backed up after the next healthy deploy")

    def _keep_rollout_point(self) -> None:
        """A rollout's commit: seal the new cache, keep the previous deployment and its cache
        slots (not pruned), and say on the node what a revert puts back."""
        self._seal()
        k = self.kept
        links = {st.path: st.target for st in (self.jit.before if self.jit else []) if st.kind == "link" and st.target}
        holds = ledger.read(self.s).entry(self.node.name).holds
        c = self.checkpoint
        markers.write_typed(self.s, self.node, ROLLOUT_POINT, RolloutPoint(
            container_id=k.container_id if k else None, image_id=k.image_id if k else None,
            fingerprint=k.fingerprint if k else None, jit_links=links,
            jit_set_aside=list(self.jit.set_aside if self.jit else []), deploy_marker=self.marker,
            holds_before={by: h.model_dump() for by, h in holds.items() if by not in ledger.LIFTED_BY_DEPLOY},
            checkpoint_link=c.before if c else None, checkpoint_now=c.after if c else None))
        self._clear_deploy_gate()

    def _hold_until_benched(self) -> None:
        """Held out (`gate`) until a bench promotes it, also if this run dies first: no gateway_job
        or reconcile routes an unjudged version. Before the commit counts: else it is rolled back."""
        run = (self.journal.entry.run_id[:8] if self.journal is not None else "") or "-"
        ledger.hold(self.s, self.node.name, ledger.BY_GATE, f"not benched yet on the version deployed by run {run}: "
                    "out of the gateway until its bench promotes it", **{ledger.AGAINST_BASELINE: True})

    def roll_back(self) -> tuple[bool, str]:
        """Put the previous deployment back; (healthy again, what happened). Never raises an
        Exception: each failure is part of the answer (a BaseException still propagates)."""
        n, name, f = self.node.name, self.spec.container_name, self.s.fleet
        restored: str | None = None
        if self.gated:  # the version awaiting its gate is gone with this rollback
            try:
                ledger.lift(self.s, n, ledger.BY_GATE)
            except Exception as e:
                self.s.log.warning(f"[{n}] its gate hold-out was not lifted: {first_line(e)}; bench_job lifts it")
        if self.keep_previous:  # a point written just before a failure describes nothing now
            try:
                markers.clear(self.s, self.node, ROLLOUT_POINT)
            except Exception as e:
                self.s.log.warning(f"[{n}] the rollout point was not cleared: {first_line(e)}")
        if self.jit is not None:  # first: the previous deployment restarts on its own cache
            try:
                jit_cache.undo(self.s, self.jit, self.log)
            except Exception as e:  # a cold cache costs a slow boot; the container still goes back
                self.s.log.warning(f"[{n}] JIT cache mounts not put back: {first_line(e)}")
        checkpoint_said = ""
        if self.checkpoint is not None and self.checkpoint.before != self.checkpoint.after:
            # Before the previous container restarts: one that mounts the whole models directory
            # (a hand deploy's) reads the checkpoint through the runbook's path.
            try:
                checkpoint_said = "; " + versions.point_back(self.s, self.node, self.checkpoint.before, self.log)
            except Exception as e:
                checkpoint_said = f"; the checkpoint link was NOT put back to {self.checkpoint.before} ({first_line(e)})"
        try:
            kept = self.kept or self.docker.find_previous(n, name, self.spec.image)
            if kept is not None:
                restored = self.docker.restore_previous(n, name, self.spec.image, kept)
                self._restore_marker(restored)
            else:
                live = self.docker.inspect_container(n, name)
                if live is not None and self.before is not None and live.get("Id") == self.before.get("Id"):
                    # The set-aside failed before the rename: the old container is still the live one.
                    if not live.get("State", {}).get("Running"):
                        self.docker.start(n, str(live["Id"]))
                    restored = str(live["Id"])
                elif live is not None:
                    self.docker.remove(n, str(live["Id"]), force=True)  # ours, and nothing to put back
        except Exception as e:
            return False, f"the rollback on {n} failed ({first_line(e)}){checkpoint_said}"
        if restored is None:
            return False, f"no previous deployment on {n} to put back{checkpoint_said}"
        limit = min(ROLLBACK_HEALTH_S, f.launch_for(self.node).health_timeout_s)

        def probe() -> str | None:
            if engine.healthy(f, self.node):
                return "healthy"
            try:
                c = self.docker.inspect_container(n, restored)
            except Exception:  # an unanswered inspect decides nothing: keep waiting for /health
                return None
            return None if c and c.get("State", {}).get("Running") else "exited"

        # A restored container that exits again will not get healthy: stop waiting at once.
        waited = poll_until(probe, lambda v: v is not None, timeout_s=limit, every_s=2.0)
        if waited.value == "healthy":
            return True, f"previous deployment put back on {n} (healthy){checkpoint_said}"
        how = "it exited again" if waited.value == "exited" else f"after {limit:.0f} s"
        return False, f"previous deployment put back on {n} but NOT healthy ({how}){checkpoint_said}"

    def _restore_marker(self, restored_id: str) -> None:
        if self.marker is not None:
            restore_deploy_marker(self.s, self.node, self.marker, restored_id)

    def take_out_of_gateway(self, why: str) -> str:
        """The node does not serve: out of every pool, and the reason where promotion reads it."""
        n = self.node.name
        said = []
        try:
            ledger.hold(self.s, n, ledger.BY_DEPLOY, f"held out by a failed deploy: {why}")
        except Exception as e:
            said.append(f"the hold-out reason could not be recorded for {n} ({first_line(e)})")
        try:
            gw = GatewayHost(self.s)
            if self.drain is not None and self.drain.was_in:
                self.drain.keep_out = True  # the deploy's drain is not undone
                gw.note(n, "failed deploy: " + (why.splitlines() or [""])[0][:160])
                said.insert(0, f"{n} taken out of the gateway (its deploy drained it; it stays out)")
            elif n in gw.rotation():
                gw.drain(n, reason="failed deploy: " + (why.splitlines() or [""])[0][:160], dead=True)
                said.insert(0, f"{n} taken out of the gateway")
            else:
                said.insert(0, f"{n} is not in the gateway")
        except Exception as e:
            said.insert(0, f"{n} could NOT be taken out of the gateway ({first_line(e)}); drain it by hand")
        return "; ".join(said)

    def _clear_deploy_gate(self) -> None:
        """The hold-outs a failed deploy or a rollout's revert recorded end with a healthy deploy
        (a bench's stays: only a bench lifts it)."""
        # A gated deploy's own `gate` hold-out stays: only its bench lifts it.
        lifted = [by for by in ledger.LIFTED_BY_DEPLOY if not (self.gated and by == ledger.BY_GATE)]
        try:
            ledger.lift(self.s, self.node.name, *lifted)
        except Exception as e:
            self.s.log.warning(f"[{self.node.name}] a failed deploy's hold-out was not lifted: {first_line(e)}; "
                               f"the gateway keeps the node out until its next deploy or a release")


def deploy(s: FleetSession, node: Node, spec: LaunchSpec, log: Any, *, run_id: str = "",
           jit_key: str | None = None, fresh_jit_cache: bool = False, checkpoint: str | None = None,
           keep_previous: bool = False, version: str | None = None, gated: bool = False) -> Deployed:
    """Replace whatever runs on the node by `spec` as a transaction (see the module doc). Raises
    DeployFailed with the diagnosis and what the rollback left, NodeBusy when another run holds
    the node, and re-raises a BaseException after the rollback. `jit_key` (core.jit_cache): the
    cache mounts are switched to that key's slots before the launch, and back on a rollback;
    `fresh_jit_cache` sets that key's cache aside first (the runbook's stale-cache fix);
    `checkpoint` (the index digest) is labelled on the container, for the benches' identity.
    `keep_previous`: a rollout's deploy; the commit keeps the rollback point (ROLLOUT_POINT).
    `version`: the checkpoint version to launch on (its directory, core/versions.py): the runbook's
    path is pointed at it and back on a rollback, and the container mounts it itself; None: the
    version the path names now (a plain directory becomes one).
    `gated`: the new version stays out of the gateway after the commit (its drain kept, a `gate`
    hold-out in the ledger) until its bench promotes it (runbook.bench.bench_node).
    A deploy a dead run left on the node is finished first (`finish_interrupted`); when what
    serves after that is already this launch spec, it is not launched again."""
    with node_lease(s, node.name, "deploy", run_id=run_id):
        recovered = finish_interrupted(s, node, log, run_id=run_id)
        if recovered is not None and recovered.serving and not fresh_jit_cache:
            done = _serving_as_launched(s, node, spec, checkpoint, version, log)
            if done is not None:
                return done
        gw = _gateway(s, node)
        reason = f"{gateway_core.DEPLOY_DRAIN} (run {run_id[:8] or '-'})"
        journal = _Journal.begin(s, node, spec, run_id, keep_previous=keep_previous,
                                 drain_reason=reason if gw is not None else None, gated=gated)
        try:
            if gw is None:  # no gateway config written yet (the first deploy ever): nothing routes here
                return _deploy(s, node, spec, log, jit_key, fresh_jit_cache, checkpoint=checkpoint,
                               keep_previous=keep_previous, journal=journal, version=version, gated=gated)
            # Out of the gateway before the old container stops, back after the commit or the
            # rollback. A node that does not answer /health serves nobody: its drain skips the floor.
            dead = not engine.healthy(s.fleet, node)
            with drained(gw, node.name, reason=reason, wait_s=s.fleet.rollout.deploy_wait_s, dead=dead,
                         deploying=not dead) as drain:
                return _deploy(s, node, spec, log, jit_key, fresh_jit_cache, drain, checkpoint=checkpoint,
                               keep_previous=keep_previous, journal=journal, version=version, gated=gated)
        finally:
            journal.end()


@dataclass(frozen=True)
class Recovered:
    """What finishing a dead run's deploy did."""

    run_id: str
    phase: str
    outcome: str
    serving: bool  # the node answers /health after it

    def line(self) -> str:
        return f"the deploy of run {self.run_id[:8] or '-'} (died in phase {self.phase}) finished: {self.outcome}"


def finish_interrupted(s: FleetSession, node: Node, log: Any, *, run_id: str = "") -> Recovered | None:
    """Finish the deploy whose journal a run that is gone left on `node` (None: there was none).
    The caller holds the node's lease, so the journal's owner does not: it died, or lost its
    connection to the node. From the journal's phase: nothing to do on the node (draining), the
    commit (the new deployment was verified and still serves) or the rollback to the kept
    deployment by id (cache links, image tag, step marker), the exporters started again; then
    the dead run's drain is undone when the node serves, or replaced by a failed-deploy hold-out
    when it does not. Raises DeployFailed (the journal stays) when the node cannot be worked on."""
    n = node.name
    j = markers.read_journal(s, node)
    if j is None or j.token in _LIVE:
        return None
    who = f"deploy run {j.run_id[:8] or '-'} ({j.owner or 'owner unknown'}, started {j.started})"
    log.warning(f"[{n}] the {who} did not finish: its journal says phase {j.phase} and its run no longer holds "
                f"the node's lease; finishing it before this run's own work")
    try:
        txn = _Transaction.from_journal(s, node, j, log)
        gw = GatewayHost(s)
        snap = gw.read()
        note = snap.drains.get(n, "")
        ours = snap.config is not None and bool(j.drain_reason) and note.startswith(j.drain_reason or "")
        txn.drain = Drain(n, was_in=ours, keep_out=ours)
        if j.phase in ("draining", "ending"):
            outcome = j.outcome or "nothing on the node had changed"
            serving = engine.healthy(s.fleet, node)
            if ours and not serving:
                outcome += "; " + txn.take_out_of_gateway(f"{n} does not serve after the {who} was interrupted")
        elif j.phase == "committing" and _still_serves(txn, j):
            txn.commit()
            _release_quarantine(s, node, log)
            outcome, serving = "committed: the deployment it had verified serves", True
        else:
            log.warning(f"[{n}] rolling back what the {who} changed")
            serving, outcome = txn.roll_back()
            if not serving:
                outcome += "; " + txn.take_out_of_gateway(f"the {who} was interrupted; {outcome}")
        txn.restore_exporters()
        if ours and serving and j.gated and outcome.startswith("committed"):
            outcome += f"; {n} stays out of the gateway until its bench promotes the new version"
        elif ours and serving:
            put_back(gw, n)
            outcome += f"; its drain undone: {n} is back in the gateway"
    except Exception as e:
        raise DeployFailed(f"node {n}: the {who} was interrupted in phase {j.phase} and could not be finished "
                           f"({first_line(e)}); its journal stays on {n}: retry once the node answers") from e
    markers.clear(s, node, markers.DEPLOY_JOURNAL)
    done = Recovered(j.run_id, j.phase, outcome, serving)
    log.warning(f"[{n}] {done.line()}")
    return done


def _still_serves(txn: _Transaction, j: markers.DeployJournal) -> bool:
    """The container the dead run verified is the live one, running and answering /health."""
    live = txn.docker.inspect_container(txn.node.name, txn.spec.container_name)
    return (live is not None and bool(j.new_container_id) and live.get("Id") == j.new_container_id
            and bool(live.get("State", {}).get("Running")) and engine.healthy(txn.s.fleet, txn.node))


def _labelled(spec: LaunchSpec, image_id: str, checkpoint: str | None, version: str | None = None) -> LaunchSpec:
    """The labels a deploy puts on its container; `version`: the checkpoint version's directory,
    which the container then mounts (LaunchSpec.model_source)."""
    model_dir = posixpath.basename(spec.model_path)
    digest = versions_core.digest_of(model_dir, version) if version else None
    return replace(spec, model_source=version if digest else None,
                   labels={DEPLOY_LABEL: spec.fingerprint, IMAGE_LABEL: image_id,
                           KERNELS_LABEL: jit_core.launch_hash(spec.serve_args, spec.env),
                           **({CHECKPOINT_LABEL: checkpoint} if checkpoint else {}),
                           **({CHECKPOINT_VERSION_LABEL: digest} if digest else {})})


def _version_to_launch(s: FleetSession, node: Node, version: str | None) -> str | None:
    """The checkpoint version directory this deploy mounts: the one asked for, else the one the
    runbook's path names now (None: a plain directory or nothing there; the launch then mounts the
    models directory as the runbook does, and the path becomes a version at its next copy)."""
    if version and versions_core.digest_of(posixpath.basename(versions.serving_path(s, node)), version):
        return version
    held = versions.read(s, node)
    found = held.holds(held.serving) if held.serving else None
    return f"{posixpath.dirname(held.serving_path)}/{found.name}" if found else None


def _serving_as_launched(s: FleetSession, node: Node, spec: LaunchSpec, checkpoint: str | None,
                         version: str | None, log: Any) -> Deployed | None:
    """After a dead run's deploy was finished: the deployment that serves, when it is exactly what
    this deploy would launch (every label, the image, /health, the smoke test); else None."""
    docker = NodeDocker(s)
    image_id = docker.image_id(node.name, spec.image)
    if image_id is None:
        return None
    want = _labelled(spec, image_id, checkpoint, _version_to_launch(s, node, version))
    live = docker.inspect_container(node.name, spec.container_name)
    if (live is None or not live.get("State", {}).get("Running") or live.get("Image") != image_id
            or any(container_labels(live).get(k) != v for k, v in want.labels.items())
            or not engine.healthy(s.fleet, node)):
        return None
    try:
        smoke = engine.smoke_test(s.fleet, node)
    except (engine.EngineError, ValueError, KeyError):
        return None
    log.info(f"[{node.name}] it serves this launch spec already ({str(live['Id'])[:12]}): not launched again")
    return Deployed(str(live["Id"]), {"finished_interrupted_deploy": True}, "not run: the deployment serving after "
                    "the interrupted deploy was finished is this launch spec", [],
                    int(smoke.get("completion_tokens", 0)), image_id, want)


def _gateway(s: FleetSession, node: Node) -> GatewayHost | None:
    """The gateway host, or None when it has no config yet. One that cannot be read refuses the
    deploy: stopping a node the gateway may still route to, unseen, is what this must not do."""
    gw = GatewayHost(s)
    try:
        return gw if gw.read().config is not None else None
    except Exception as e:
        raise DeployFailed(f"node {node.name}: the gateway host {s.fleet.gateway.host} could not be read "
                           f"({first_line(e)}), so {node.name} cannot be taken out of rotation before its old "
                           f"container stops; nothing was changed: bring the gateway host back, then deploy again") from None


def _deploy(s: FleetSession, node: Node, spec: LaunchSpec, log: Any, jit_key: str | None = None,
            fresh_jit_cache: bool = False, drain: Drain | None = None, checkpoint: str | None = None,
            keep_previous: bool = False, journal: _Journal | None = None, version: str | None = None,
            gated: bool = False) -> Deployed:
    f = s.fleet
    docker = NodeDocker(s)
    started = time.monotonic()
    image_id = docker.image_id(node.name, spec.image)
    if image_id is None:
        raise DeployFailed(f"node {node.name}: image {spec.image} is not there; run node_artifacts for {node.name} first")
    spec = _labelled(spec, image_id, checkpoint, _version_to_launch(s, node, version))
    txn = _Transaction(s, node, spec, log, drain, keep_previous, gated)
    txn.journal = journal
    if journal is not None:
        journal.update(new_fingerprint=spec.fingerprint, new_image_id=image_id)
    try:
        held = _quarantine_of(s, node, log)
        txn.set_aside()
        txn.prepare()
        assert txn.prepared is not None
        report = preflight.evaluate(s, node, preflight.observe(s, node, spec.image, txn.prepared),
                                    spec.gpu_memory_utilization, residue_quarantine=held == "residue")
        log.info(report.explain())
        if not report.passed:
            raise _NotServing(f"preflight blocked {node.name}: " + "; ".join(
                f"{c.name}: {c.detail} -> {c.fix}" for c in report.failures()), {"preflight": report.explain()})
        if jit_key:
            txn.switch_jit_cache(jit_key, fresh_jit_cache)
        if spec.model_source:
            txn.point_checkpoint(posixpath.basename(spec.model_source))

        booting = time.monotonic()
        ok, log_text, ready = launch_and_wait(s, node, spec, f.launch_for(node).health_timeout_s)
        if not ok and txn.jit is not None and txn.jit.plan.restore:  # once more, cold, without the shipped cache
            ok, log_text, ready = jit_cache.boot_cold_after_shipped(s, node, spec, txn.jit, log_text, log, lambda: (
                launch_and_wait(s, node, spec, f.launch_for(node).health_timeout_s)))
        boot_s = time.monotonic() - booting
        findings = diagnosis.diagnose(log_text)
        smoke: dict[str, Any] = {}
        if ok:
            try:
                smoke = engine.smoke_test(f, node)
            except (engine.EngineError, ValueError, KeyError) as e:
                ok, smoke = False, {"error": first_line(e)}
        container = docker.inspect_container(node.name, spec.container_name) or {}
        if ok and container.get("Image") != image_id:
            ok = False  # something else was launched than what we labelled
        if not ok:
            first = findings[0] if findings else None
            why = f"launch on {node.name} did not become healthy"
            if first:
                why += (f". Diagnosis: {first.signature.cause} -> {first.signature.fix} "
                        f"(runbook: {first.signature.runbook_ref})")
            raise _NotServing(why, {
                "diagnosis": diagnosis_md(findings),
                "log_tail": "```\n" + "\n".join(log_text.splitlines()[-40:]) + "\n```",
            })
        txn.note(phase="committing", new_container_id=str(container.get("Id", "")))
        txn.commit()
        _release_quarantine(s, node, log)
        if journal is not None:
            journal.try_update(phase="ending", outcome="committed")
    except BaseException as e:
        if txn.committed:
            raise
        gone = lease.lost(s, node.name)
        if gone is not None:
            # Another run may hold the node now: the rollback is the journal's, finished by the
            # next run that takes the lease; from here it would fight that run.
            txn.prepared = None  # nor the exporters: that run starts them again with the rollback
            phase = journal.phase if journal is not None else "unknown"
            raise DeployFailed(f"deploy on {node.name} stopped in phase {phase}: {first_line(gone.error())}; "
                               f"this run rolled nothing back on {node.name}: the next run there finishes it "
                               f"from the deploy journal") from e
        why = e.description if isinstance(e, _NotServing) else f"deploy on {node.name} failed: {first_line(e)}"
        log.warning(f"[{node.name}] {why}; rolling back")
        if journal is not None and journal.phase != "draining":
            journal.try_update(phase="rolling-back")
        back, outcome = txn.roll_back()
        if not back:
            outcome += "; " + txn.take_out_of_gateway(f"{why}; {outcome}")
        if journal is not None:
            journal.try_update(phase="ending", outcome=outcome)
        details = e.details if isinstance(e, _NotServing) else {"error": "```\n" + str(e)[-3000:] + "\n```"}
        if not isinstance(e, Exception):
            log.warning(f"[{node.name}] interrupted ({type(e).__name__}); {outcome}")
            raise  # run termination / KeyboardInterrupt: rolled back, now let it end the run
        raise DeployFailed(_headline(why, outcome), details) from (None if isinstance(e, _NotServing) else e)
    finally:
        txn.restore_exporters()  # after the commit or the rollback: the serving vLLM claims its memory first

    meta = {
        keys.KV_CACHE_TOKENS: ready.kv_tokens or 0,
        "max_concurrency": ready.concurrency or 0.0,
        keys.STARTUP_SECONDS: round(time.monotonic() - started, 1),
        keys.BOOT_SECONDS: round(boot_s, 1),
        keys.FREE_GIB_AT_PREFLIGHT: report.memory.free_gib if report.memory else 0.0,
        "graph_mode": ready.graph_mode or "unknown",
    }
    if txn.jit is not None:
        meta.update(jit_cache=txn.jit.plan.verdict, jit_cache_key=txn.jit.plan.key, jit_cache_why=txn.jit.plan.why)
        if txn.jit.shipped:
            meta.update(jit_cache_shipped_from=txn.jit.shipped["source"], jit_cache_shipped_bytes=txn.jit.shipped["bytes"],
                        jit_cache_ship_seconds=txn.jit.shipped["seconds"])
    if txn.checkpoint is not None:
        meta.update(checkpoint_version=txn.checkpoint.after, checkpoint_version_before=txn.checkpoint.before or "none")
    return Deployed(str(container.get("Id", "")), meta, report.explain(), findings,
                    int(smoke.get("completion_tokens", 0)), image_id, spec)


def _quarantine_of(s: FleetSession, node: Node, log: Any) -> str | None:
    """The verdict the node is quarantined for (None: not quarantined, or the record unreadable:
    the gateway host is not the node, and the deploy must not depend on it)."""
    try:
        rec = quarantine.quarantined(s).get(node.name)
    except RunbookError as e:
        log.warning(f"[{node.name}] quarantine record not read ({e}); deploying without it")
        return None
    if rec is not None:
        log.info(f"[{node.name}] quarantined ({rec.summary()}): a committed deploy releases a "
                 f"{'/'.join(sorted(quarantine.RELEASED_BY_DEPLOY))} quarantine")
    return None if rec is None else rec.verdict


def _release_quarantine(s: FleetSession, node: Node, log: Any) -> None:
    """After the commit: the node serves, so a quarantine its deploy proves over ends (a failure
    to say so is a warning: the deployment itself stands)."""
    try:
        said = quarantine.release_after_deploy(s, node)
    except RunbookError as e:
        log.warning(f"[{node.name}] healthy, but its quarantine record was not updated: {e}; "
                    f"run release_quarantine_job for {node.name}")
        return
    if said:
        log.info(f"[{node.name}] {said}")


def _headline(why: str, outcome: str) -> str:
    # The e2e and operators read "<what failed>; <what the rollback left>. Diagnosis: ..."
    head, sep, diag = why.partition(". Diagnosis: ")
    return f"{head}; {outcome}" + (f". Diagnosis: {diag}" if sep else "")
