"""The deploy transaction on one node: the state it keeps for its rollback and its journal.

`Transaction` holds what a deploy set aside (the previous container by id, the step marker, the
JIT cache links, the checkpoint link, the exporters it stopped) and undoes it in reverse on every
way out (`roll_back`); `TransactionJournal` is that state written on the node before each change
(`state.markers.DeployJournal`), so a run killed in between leaves what the next run needs to finish
it (`runbook.deploy.finish_interrupted`). The procedure that drives both, with its drain, is
`runbook.deploy.deploy`.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from dataclasses import dataclass, replace
from typing import Any

from spark_pipelines.core import diagnosis
from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core import jit_cache as jit_core
from spark_pipelines.core.fleet import Node
from spark_pipelines.core import remote
from spark_pipelines.core.launch import (LaunchSpec, launch_spec)
from spark_pipelines.core.polling import poll_until
from spark_pipelines.resources.docker import NodeDocker, PreviousDeploy
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook import jit_cache, preflight, rotation, versions
from spark_pipelines.resources import engine
from spark_pipelines.state import ledger, markers
from spark_pipelines.state.markers import DeployMarker, RolloutPoint
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.runbook.rotation import Drain

READY_LINE = "Application startup complete"
ROLLBACK_HEALTH_S = 600


def launch_and_wait(session: FleetSession, node: Node, spec: LaunchSpec, timeout_s: float) -> tuple[bool, str, diagnosis.Readiness]:
    docker = NodeDocker(session)
    session.run(node.name, ["mkdir", "-p", *spec.host_dirs], log=False, timeout=60)
    docker.run_container(node.name, spec.docker_run_argv())
    watch = docker.follow_logs(node.name, spec.container_name, until=lambda line: READY_LINE in line, timeout=timeout_s)
    log_text = docker.logs(node.name, spec.container_name, tail="all")
    ready = diagnosis.milestones(log_text)
    ok = bool(watch.matched) and engine.wait_healthy(session.fleet, node, 60)
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


class NotServing(RunbookError):
    """The launch ran but did not serve (blocked preflight, unhealthy, no smoke tokens)."""


def restore_deploy_marker(session: FleetSession, node: Node, marker: DeployMarker | None, restored_id: str) -> None:
    """The step marker must describe what runs after a rollback: the one read before the deploy
    when the restored container is the one it names, else a marker no skip can match."""
    if marker and marker.container_id == restored_id:
        markers.write_deploy(session, node, marker)
    else:
        markers.write_deploy(session, node, DeployMarker(signature="rolled-back", container_id=restored_id))


# The journals of the transactions this process runs now: never "finished" as a dead run's.
_LIVE: set[str] = set()


def is_live(token: str) -> bool:
    """Whether the journal with `token` belongs to a transaction this process runs now."""
    return token in _LIVE


class TransactionJournal:
    """One deploy's journal on its node (see the module doc). Each write is atomic (a temp file
    renamed into place). A write that fails before a change fails the deploy with nothing done; one
    that fails later fails it into its rollback: a change no journal describes is one no later run
    could finish."""

    def __init__(self, session: FleetSession, node: Node, entry: markers.DeployJournal) -> None:
        self.s, self.node, self.entry = session, node, entry

    @classmethod
    def begin(cls, session: FleetSession, node: Node, spec: LaunchSpec, run_id: str, *, keep_previous: bool,
              drain_reason: str | None, gated: bool = False) -> TransactionJournal:
        entry = markers.DeployJournal(
            run_id=run_id, token=secrets.token_hex(8), owner=f"pid {os.getpid()} on {socket.gethostname()}",
            started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), phase="draining",
            container_name=spec.container_name, image=spec.image, keep_previous=keep_previous, gated=gated,
            drain_reason=drain_reason)
        j = cls(session, node, entry)
        _LIVE.add(entry.token)
        markers.write_typed(session, node, markers.DEPLOY_JOURNAL, entry)
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


class Transaction:
    """The state one deploy keeps for its rollback."""

    def __init__(self, session: FleetSession, node: Node, spec: LaunchSpec, log: Any, drain: Drain | None = None,
                 keep_previous: bool = False, gated: bool = False) -> None:
        self.s, self.node, self.spec, self.log = session, node, spec, log
        self.keep_previous = keep_previous  # a rollout's deploy: the rollback point outlives the commit
        self.gated = gated  # the new version stays out of the gateway until its bench promotes it
        self.drain = drain  # the deploy's own drain: a node that cannot serve is kept out by it
        self.docker = NodeDocker(session)
        self.before: dict[str, Any] | None = None  # the live container before anything changed
        self.kept: PreviousDeploy | None = None
        self.marker: DeployMarker | None = None
        self.prepared: preflight.Prepared | None = None
        self.jit: jit_cache.Switch | None = None  # the cache mounts as switched for this launch
        self.checkpoint: versions.Pointed | None = None  # the runbook's path as pointed for this launch
        self.committed = False
        self.journal: TransactionJournal | None = None
        self.run_id = ""  # the deploy's run: its drain and keep-out notes name it

    def note(self, **fields: Any) -> None:
        if self.journal is not None:
            self.journal.update(**fields)

    @classmethod
    def from_journal(cls, session: FleetSession, node: Node, j: markers.DeployJournal, log: Any) -> Transaction:
        """The transaction a dead run left, as its journal describes it (container name and image
        as it ran them, not as the fleet file says now)."""
        spec = launch_spec(session.fleet, node)
        spec = replace(spec, container_name=j.container_name or spec.container_name, image=j.image or spec.image)
        txn = cls(session, node, spec, log, keep_previous=j.keep_previous, gated=j.gated)
        txn.run_id = j.run_id
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
            markers.clear(self.s, self.node, markers.ROLLOUT_POINT)
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
            markers.clear(self.s, self.node, markers.ROLLOUT_POINT)  # an unfinished rollout's point is gone with it
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
        markers.write_typed(self.s, self.node, markers.ROLLOUT_POINT, RolloutPoint(
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
                markers.clear(self.s, self.node, markers.ROLLOUT_POINT)
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
        # The note names the run: the next run that finishes this deploy knows the drain is its own.
        note = f"{gateway_core.FAILED_DEPLOY} (run {self.run_id[:8] or '-'}): " + (why.splitlines() or [""])[0][:160]
        try:
            gw = GatewayHost(self.s)
            if self.drain is not None and self.drain.was_in:
                self.drain.keep_out = True  # the deploy's drain is not undone
                rotation.note_out(gw, n, note)
                said.insert(0, f"{n} taken out of the gateway (its deploy drained it; it stays out)")
            elif n in gw.rotation():
                rotation.take_out(gw, n, note, None, dead=True)
                said.insert(0, f"{n} taken out of the gateway")
            else:
                said.insert(0, f"{n} is not in the gateway")
        except Exception as e:
            said.insert(0, f"{n} could NOT be taken out of the gateway ({first_line(e)}); drain it by hand")
        return "; ".join(said)

    def _clear_deploy_gate(self, *by: str) -> None:
        """The hold-outs a failed deploy or a rollout's revert recorded end with a healthy deploy
        (a bench's stays: only a bench lifts it)."""
        # A gated deploy's own `gate` hold-out stays: only its bench lifts it.
        lifted = by or [b for b in ledger.LIFTED_BY_DEPLOY if not (self.gated and b == ledger.BY_GATE)]
        try:
            ledger.lift(self.s, self.node.name, *lifted)
        except Exception as e:
            self.s.log.warning(f"[{self.node.name}] a failed deploy's hold-out was not lifted: {first_line(e)}; "
                               f"the gateway keeps the node out until its next deploy or a release")
