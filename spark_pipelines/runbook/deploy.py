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

import posixpath
import time
from dataclasses import dataclass, replace
from typing import Any

from spark_pipelines.core import diagnosis
from spark_pipelines.core import layout
from spark_pipelines.core.artifacts import Deployment, NodeArtifacts
from spark_pipelines.core.pair_launch import enabled_pair_of
from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core import jit_cache as jit_core
from spark_pipelines.core import record_keys as keys
from spark_pipelines.core.fleet import Node
from spark_pipelines.core import versions as versions_core
from spark_pipelines.core.launch import (CHECKPOINT_LABEL, CHECKPOINT_VERSION_LABEL, DEPLOY_LABEL, IMAGE_LABEL,
                                         KERNELS_LABEL, LaunchSpec, launch_spec)
from spark_pipelines.resources.docker import NodeDocker, container_labels
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources import lease
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook import jit_cache, preflight, quarantine, versions
from spark_pipelines.resources import engine
from spark_pipelines.state import ledger, markers
from spark_pipelines.state.markers import DeployMarker
from spark_pipelines.core.errors import DeployFailed, RunbookError, first_line
from spark_pipelines.runbook.rotation import Drain, drained, put_back
from spark_pipelines.runbook.transaction import (is_live, Deployed, NotServing, Transaction,
                                                 TransactionJournal, launch_and_wait)

DEPLOY_MARKER = markers.DEPLOY  # the step marker node_deployment skips on
ROLLOUT_POINT = markers.ROLLOUT_POINT  # what a rollout's revert puts back on the node (kept until it finishes)
# The previous deployment restarts warm (kernels cached): the runbook's warm boot is 7-10 min.


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


def deploy(session: FleetSession, node: Node, spec: LaunchSpec, log: Any, *, run_id: str = "",
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
    with node_lease(session, node.name, "deploy", run_id=run_id):
        recovered = finish_interrupted(session, node, log, run_id=run_id)
        if recovered is not None and recovered.serving and not fresh_jit_cache:
            done = _serving_as_launched(session, node, spec, checkpoint, version, log)
            if done is not None:
                return done
        gw = _gateway(session, node)
        reason = f"{gateway_core.DEPLOY_DRAIN} (run {run_id[:8] or '-'})"
        journal = TransactionJournal.begin(session, node, spec, run_id, keep_previous=keep_previous,
                                 drain_reason=reason if gw is not None else None, gated=gated)
        try:
            if gw is None:  # no gateway config written yet (the first deploy ever): nothing routes here
                return _deploy(session, node, spec, log, jit_key, fresh_jit_cache, checkpoint=checkpoint,
                               keep_previous=keep_previous, journal=journal, version=version, gated=gated)
            # Out of the gateway before the old container stops, back after the commit or the
            # rollback. A node that does not answer /health serves nobody: its drain skips the floor.
            dead = not engine.healthy(session.fleet, node)
            note = gw.read().drains.get(node.name)
            with drained(gw, node.name, reason=reason, wait_s=session.fleet.rollout.deploy_wait_s, dead=dead,
                         deploying=not dead) as drain:
                done = _deploy(session, node, spec, log, jit_key, fresh_jit_cache, drain, checkpoint=checkpoint,
                               keep_previous=keep_previous, journal=journal, version=version, gated=gated)
                if not gated and not drain.was_in and gateway_core.deploy_note(note):
                    # Out only because of an earlier deploy (a failed one's keep-out, a dead one's
                    # drain): serving its spec now, it goes back unless a hold-out keeps it out.
                    # (A gated deploy's version stays out until its bench, whatever came before.)
                    drain.keep_out = _held_out(session, node.name, log)
                return done
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


def finish_interrupted(session: FleetSession, node: Node, log: Any, *, run_id: str = "") -> Recovered | None:
    """Finish the deploy whose journal a run that is gone left on `node` (None: there was none).
    The caller holds the node's lease, so the journal's owner does not: it died, or lost its
    connection to the node. From the journal's phase: nothing to do on the node (draining), the
    commit (the new deployment was verified and still serves) or the rollback to the kept
    deployment by id (cache links, image tag, step marker), the exporters started again; then
    the dead run's drain is undone when the node serves, or replaced by a failed-deploy hold-out
    when it does not. Raises DeployFailed (the journal stays) when the node cannot be worked on."""
    n = node.name
    j = markers.read_journal(session, node)
    if j is None or is_live(j.token):
        return None
    who = f"deploy run {j.run_id[:8] or '-'} ({j.owner or 'owner unknown'}, started {j.started})"
    log.warning(f"[{n}] the {who} did not finish: its journal says phase {j.phase} and its run no longer holds "
                f"the node's lease; finishing it before this run's own work")
    try:
        txn = Transaction.from_journal(session, node, j, log)
        gw = GatewayHost(session)
        snap = gw.read()
        note = snap.drains.get(n, "")
        # Its drain, or the failed-deploy note that replaced it (a rollback that could not finish).
        ours = snap.config is not None and bool(j.drain_reason) and (
            note.startswith(j.drain_reason or "") or gateway_core.deploy_note(note, j.run_id))
        txn.drain = Drain(n, was_in=ours, keep_out=ours)
        if j.phase in ("draining", "ending"):
            outcome = j.outcome or "nothing on the node had changed"
            serving = engine.healthy(session.fleet, node)
            if ours and not serving:
                outcome += "; " + txn.take_out_of_gateway(f"{n} does not serve after the {who} was interrupted")
        elif j.phase == "committing" and _still_serves(txn, j):
            txn.commit()
            _release_quarantine(session, node, log)
            outcome, serving = "committed: the deployment it had verified serves", True
        else:
            log.warning(f"[{n}] rolling back what the {who} changed")
            serving, outcome = txn.roll_back()
            if not serving:
                outcome += "; " + txn.take_out_of_gateway(f"the {who} was interrupted; {outcome}")
        txn.restore_exporters()
        if serving:  # what the dead run's failure recorded is no longer true
            txn._clear_deploy_gate(ledger.BY_DEPLOY)
        if ours and serving and j.gated and outcome.startswith("committed"):
            outcome += f"; {n} stays out of the gateway until its bench promotes the new version"
        elif ours and serving:
            put_back(gw, n)
            outcome += f"; its drain undone: {n} is back in the gateway"
    except Exception as e:
        raise DeployFailed(f"node {n}: the {who} was interrupted in phase {j.phase} and could not be finished "
                           f"({first_line(e)}); its journal stays on {n}: retry once the node answers") from e
    markers.clear(session, node, markers.DEPLOY_JOURNAL)
    done = Recovered(j.run_id, j.phase, outcome, serving)
    log.warning(f"[{n}] {done.line()}")
    return done


def _held_out(session: FleetSession, n: str, log: Any) -> bool:
    """Whether the ledger keeps `n` out (a quarantine, a hold-out), said with what lifts it."""
    try:
        why = ledger.read(session).why_held(n)
    except RunbookError as e:  # committed either way: the next gateway_job or reconcile decides
        log.warning(f"[{n}] serves its launch spec; the ledger was not read ({first_line(e)}): it stays out of the "
                    "gateway until gateway_job or the reconcile puts it back")
        return True
    if why:
        log.warning(f"[{n}] serves its launch spec but stays out of the gateway: {why} (the actor that recorded it "
                    f"lifts it: a bench's by bench_job, a quarantine by release_quarantine_job or the cold drain)")
    return bool(why)


def _still_serves(txn: Transaction, j: markers.DeployJournal) -> bool:
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


def _version_to_launch(session: FleetSession, node: Node, version: str | None) -> str | None:
    """The checkpoint version directory this deploy mounts: the one asked for, else the one the
    runbook's path names now (None: a plain directory or nothing there; the launch then mounts the
    models directory as the runbook does, and the path becomes a version at its next copy)."""
    if version and versions_core.digest_of(posixpath.basename(versions.serving_path(session, node)), version):
        return version
    held = versions.read(session, node)
    found = held.holds(held.serving) if held.serving else None
    return f"{posixpath.dirname(held.serving_path)}/{found.name}" if found else None


def _serving_as_launched(session: FleetSession, node: Node, spec: LaunchSpec, checkpoint: str | None,
                         version: str | None, log: Any) -> Deployed | None:
    """After a dead run's deploy was finished: the deployment that serves, when it is exactly what
    this deploy would launch (every label, the image, /health, the smoke test); else None."""
    docker = NodeDocker(session)
    image_id = docker.image_id(node.name, spec.image)
    if image_id is None:
        return None
    want = _labelled(spec, image_id, checkpoint, _version_to_launch(session, node, version))
    live = docker.inspect_container(node.name, spec.container_name)
    if (live is None or not live.get("State", {}).get("Running") or live.get("Image") != image_id
            or any(container_labels(live).get(k) != v for k, v in want.labels.items())
            or not engine.healthy(session.fleet, node)):
        return None
    try:
        smoke = engine.smoke_test(session.fleet, node)
    except (engine.EngineError, ValueError, KeyError):
        return None
    log.info(f"[{node.name}] it serves this launch spec already ({str(live['Id'])[:12]}): not launched again")
    return Deployed(str(live["Id"]), {"finished_interrupted_deploy": True}, "not run: the deployment serving after "
                    "the interrupted deploy was finished is this launch spec", [],
                    int(smoke.get("completion_tokens", 0)), image_id, want)


def _gateway(session: FleetSession, node: Node) -> GatewayHost | None:
    """The gateway host, or None when it has no config yet. One that cannot be read refuses the
    deploy: stopping a node the gateway may still route to, unseen, is what this must not do."""
    gw = GatewayHost(session)
    try:
        return gw if gw.read().config is not None else None
    except Exception as e:
        raise DeployFailed(f"node {node.name}: the gateway host {session.fleet.gateway.host} could not be read "
                           f"({first_line(e)}), so {node.name} cannot be taken out of rotation before its old "
                           f"container stops; nothing was changed: bring the gateway host back, then deploy again") from None


def _deploy(session: FleetSession, node: Node, spec: LaunchSpec, log: Any, jit_key: str | None = None,
            fresh_jit_cache: bool = False, drain: Drain | None = None, checkpoint: str | None = None,
            keep_previous: bool = False, journal: TransactionJournal | None = None, version: str | None = None,
            gated: bool = False) -> Deployed:
    fleet = session.fleet
    docker = NodeDocker(session)
    started = time.monotonic()
    image_id = docker.image_id(node.name, spec.image)
    if image_id is None:
        raise DeployFailed(f"node {node.name}: image {spec.image} is not there; run node_artifacts for {node.name} first")
    spec = _labelled(spec, image_id, checkpoint, _version_to_launch(session, node, version))
    txn = Transaction(session, node, spec, log, drain, keep_previous, gated)
    txn.journal = journal
    txn.run_id = journal.entry.run_id if journal is not None else ""
    if journal is not None:
        journal.update(new_fingerprint=spec.fingerprint, new_image_id=image_id)
    try:
        held = _quarantine_of(session, node, log)
        txn.set_aside()
        txn.prepare()
        assert txn.prepared is not None
        report = preflight.evaluate(session, node, preflight.observe(session, node, spec.image, txn.prepared),
                                    spec.gpu_memory_utilization, residue_quarantine=held == "residue")
        log.info(report.explain())
        if not report.passed:
            raise NotServing(f"preflight blocked {node.name}: " + "; ".join(
                f"{c.name}: {c.detail} -> {c.fix}" for c in report.failures()), {"preflight": report.explain()})
        if jit_key:
            txn.switch_jit_cache(jit_key, fresh_jit_cache)
        if spec.model_source:
            txn.point_checkpoint(posixpath.basename(spec.model_source))

        booting = time.monotonic()
        ok, log_text, ready = launch_and_wait(session, node, spec, fleet.launch_for(node).health_timeout_s)
        if not ok and txn.jit is not None and txn.jit.plan.restore:  # once more, cold, without the shipped cache
            ok, log_text, ready = jit_cache.boot_cold_after_shipped(session, node, spec, txn.jit, log_text, log, lambda: (
                launch_and_wait(session, node, spec, fleet.launch_for(node).health_timeout_s)))
        boot_s = time.monotonic() - booting
        findings = diagnosis.diagnose(log_text)
        smoke: dict[str, Any] = {}
        if ok:
            try:
                smoke = engine.smoke_test(fleet, node)
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
            raise NotServing(why, {
                "diagnosis": diagnosis_md(findings),
                "log_tail": "```\n" + "\n".join(log_text.splitlines()[-40:]) + "\n```",
            })
        txn.note(phase="committing", new_container_id=str(container.get("Id", "")))
        txn.commit()
        _release_quarantine(session, node, log)
        if journal is not None:
            journal.try_update(phase="ending", outcome="committed")
    except BaseException as e:
        if txn.committed:
            raise
        gone = lease.lost(session, node.name)
        if gone is not None:
            # Another run may hold the node now: the rollback is the journal's, finished by the
            # next run that takes the lease; from here it would fight that run.
            txn.prepared = None  # nor the exporters: that run starts them again with the rollback
            phase = journal.phase if journal is not None else "unknown"
            raise DeployFailed(f"deploy on {node.name} stopped in phase {phase}: {first_line(gone.error())}; "
                               f"this run rolled nothing back on {node.name}: the next run there finishes it "
                               f"from the deploy journal") from e
        why = e.description if isinstance(e, NotServing) else f"deploy on {node.name} failed: {first_line(e)}"
        log.warning(f"[{node.name}] {why}; rolling back")
        if journal is not None and journal.phase != "draining":
            journal.try_update(phase="rolling-back")
        back, outcome = txn.roll_back()
        if not back:
            outcome += "; " + txn.take_out_of_gateway(f"{why}; {outcome}")
        if journal is not None:
            journal.try_update(phase="ending", outcome=outcome)
        details = e.details if isinstance(e, NotServing) else {"error": "```\n" + str(e)[-3000:] + "\n```"}
        if not isinstance(e, Exception):
            log.warning(f"[{node.name}] interrupted ({type(e).__name__}); {outcome}")
            raise  # run termination / KeyboardInterrupt: rolled back, now let it end the run
        raise DeployFailed(_headline(why, outcome), details) from (None if isinstance(e, NotServing) else e)
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


def _quarantine_of(session: FleetSession, node: Node, log: Any) -> str | None:
    """The verdict the node is quarantined for (None: not quarantined, or the record unreadable:
    the gateway host is not the node, and the deploy must not depend on it)."""
    try:
        rec = quarantine.quarantined(session).get(node.name)
    except RunbookError as e:
        log.warning(f"[{node.name}] quarantine record not read ({e}); deploying without it")
        return None
    if rec is not None:
        log.info(f"[{node.name}] quarantined ({rec.summary()}): a committed deploy releases a "
                 f"{'/'.join(sorted(quarantine.RELEASED_BY_DEPLOY))} quarantine")
    return None if rec is None else rec.verdict


def _release_quarantine(session: FleetSession, node: Node, log: Any) -> None:
    """After the commit: the node serves, so a quarantine its deploy proves over ends (a failure
    to say so is a warning: the deployment itself stands)."""
    try:
        said = quarantine.release_after_deploy(session, node)
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


@dataclass
class NodeDeployed:
    """A deploy of the node's artifacts as node_deployment records it (its own run, a rollout's
    step, add_node's): what runs, the step marker's signature (the data version) and whether what
    runs is what was meant (`mismatch` None)."""

    deployment: Deployment
    done: Deployed
    spec: LaunchSpec
    running: dict[str, Any] | None
    data_version: str
    mismatch: str | None
    check_text: str


def deploy_artifacts(session: FleetSession, node: Node, artifacts: NodeArtifacts, code_version: str, log: Any, *,
                     run_id: str, fresh_jit_cache: bool = False, keep_previous: bool = False,
                     gated: bool = False) -> NodeDeployed:
    """`deploy` of the fleet's launch spec with the node's artifacts, then the step marker
    node_deployment skips on, written only when what runs is what was meant. `gated`: the node
    stays out of the gateway until its bench promotes it. Raises RunbookError."""
    pair = enabled_pair_of(session.fleet, node.name)
    if pair is not None:
        raise RunbookError(f"{node.name} serves in node pair {pair.name} (pairs: enabled): a rollout does not move a "
                           f"pair; deploy the pair with deploy_node_job for {pair.head}, or turn it off first")
    spec = launch_spec(session.fleet, node)
    sig = markers.deploy_signature(code_version, spec.fingerprint, artifacts.image_id, artifacts.index)
    done = deploy(session, node, spec, log, run_id=run_id, jit_key=jit_core.key_for(artifacts, spec),
                  fresh_jit_cache=fresh_jit_cache, checkpoint=artifacts.index, keep_previous=keep_previous,
                  version=artifacts.path, gated=gated)
    running = NodeDocker(session).inspect_container(node.name, spec.container_name)
    mismatch = serving_mismatch(node.name, running, artifacts.image_id, spec.fingerprint,
                                checkpoint=artifacts.manifest)
    if mismatch is None:
        markers.write_deploy(session, node, DeployMarker(signature=sig, container_id=done.container_id, metadata=done.metadata))
    return NodeDeployed(Deployment(node=node.name, container_id=done.container_id, fingerprint=spec.fingerprint),
                        done, spec, running, sig if mismatch is None else f"mismatch-{sig}", mismatch,
                        mismatch or f"{node.name}: healthy; smoke test answered {done.smoke_tokens} tokens")


def serves_as_marked(session: FleetSession, node: Node, artifacts: NodeArtifacts, code_version: str,
                     current: dict[str, Any] | None) -> DeployMarker | None:
    """The node's deploy marker when the running container (`current`) IS what it says: its id, the
    image node_artifacts recorded and the launch-spec label (a rollback can put an older image back;
    an adopted hand deploy's labels are in its marker), healthy, and no deploy journal on the node
    (a dead run's deploy: the deploy finishes it first). Else None: the deploy has work to do."""
    spec = launch_spec(session.fleet, node)
    sig = markers.deploy_signature(code_version, spec.fingerprint, artifacts.image_id, artifacts.index)
    marker = markers.read_deploy(session, node)
    if (marker and marker.signature == sig and current and marker.container_id == current.get("Id")
            and not session.exists(node.name, layout.marker_path(node, markers.DEPLOY_JOURNAL))
            and serving_mismatch(node.name, current, artifacts.image_id, spec.fingerprint, marker,
                                 checkpoint=artifacts.manifest) is None
            and engine.healthy(session.fleet, node)):
        return marker
    return None


# What a node pair's deploy (runbook/pair.py) reads as a single node's deploy does; the transaction
# itself (journal, set-aside, rollback) is runbook/transaction.py's, once per node.
labelled, version_to_launch, gateway_of = _labelled, _version_to_launch, _gateway
