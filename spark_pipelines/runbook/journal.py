"""One journal discipline for every procedure that takes a node out of the gateway, stops its
engine, reboots it or sets something aside: whoever holds the node next finishes what a dead run
left (kill -9, a lost host, a run container gone).

- A deploy keeps its journal on the node, beside its containers (runbook/deploy.py). Every other
  procedure keeps one in the ledger on the gateway host (`state.ledger.Procedure`): Phase 0's
  reboot, a newcomer joining, a bench's drain, a cold drain, an adoption's cache renames. Off the
  node, because a reboot or a cold drain takes the node away: a run killed while its node is
  powered off must still be found.
- `journaled(...)`: written before the procedure changes anything (a journal that cannot be
  written stops it with nothing done), updated at each phase, removed when it ends on any path
  that ran its own undo. A run whose lease on the node ended under it, or one killed, leaves it.
- `claimed(session, node, what, log)`: how a procedure that changes a node begins: the node's run
  lease, then `finish_dead` under it.
- `finish_dead(session, node, log)`: the one reader, called under the node's lease by every run that
  works on a node (deploy, bench, Phase 0, a rollout, a cold drain, an adoption) and by the
  health sweep's repair runs: the deploy journal first, then each procedure journal of a run that
  is gone, innermost first. The engine it stopped is started again; its drain is undone once the
  node serves (a node that does not serve stays out with a hold-out naming the step and what
  lifts it); and what each procedure owes besides: a newcomer is held out until its bench, a cold
  drain's node stays quarantined until validated. Each finish is said in the run's log and
  returned.
- A journal is a dead run's when its token is not this process's and the caller holds the node's
  lease, except while its node is down (rebooting, powered off): the live run waits for it
  without a lease, so until `down_until` only a run the instance knows to have ended counts as
  dead (`FleetSession.run_ended`).
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import steps
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.core.fleet import Node
from spark_pipelines.resources import engine, lease
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.lease import NodeBusy
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook.deploy import finish_interrupted
from spark_pipelines.runbook.transaction import ROLLBACK_HEALTH_S
from spark_pipelines.runbook.rotation import put_back
from spark_pipelines.state import ledger
from spark_pipelines.state.ledger import Procedure

# The journals of the procedures this process runs now: never finished as a dead run's.
_LIVE: set[str] = set()
# The phase a newcomer's journal reaches once its bench promoted it: nothing is owed after it.
JOIN_BENCHED = "benched"
# The bench's phase once it judged the node (facts: keep_out): its verdict stands.
BENCH_JUDGED = "judged"


class Journal:
    """One procedure's journal in the ledger (see the module doc)."""

    def __init__(self, session: FleetSession, node: str, entry: Procedure) -> None:
        self.s, self.node, self.entry = session, node, entry
        self.keep = False  # set when the procedure's own undo could not finish: the next run does

    @property
    def phase(self) -> str:
        return self.entry.phase

    def update(self, **fields: Any) -> None:
        """Before a change: a journal that cannot say it stops the procedure (into its undo)."""
        got = ledger.update_procedure(self.s, self.node, self.entry.token, **fields)
        if got is None:
            raise RunbookError(f"{self.node}: the journal of this {self.entry.procedure.replace('_', ' ')} is gone "
                               f"from the ledger: another run finished it as a dead run's; this run changes nothing "
                               f"more on {self.node}")
        self.entry = got

    def try_update(self, **fields: Any) -> None:
        """After a change, on the way out: a journal not updated must not stop the undo."""
        try:
            self.update(**fields)
        except Exception as e:
            self.s.log.warning(f"[{self.node}] the {self.entry.procedure} journal was not updated "
                               f"({first_line(e)}); the next run on {self.node} finishes from phase {self.phase}")

    def _end(self) -> None:
        _LIVE.discard(self.entry.token)
        try:
            ledger.end_procedure(self.s, self.node, self.entry.token)
        except Exception as e:  # the next run finds a journal whose work is done and says so
            self.s.log.warning(f"[{self.node}] the {self.entry.procedure} journal was not removed "
                               f"({first_line(e)}); the next run on {self.node} finishes it")

    def _leave(self, why: str) -> None:
        _LIVE.discard(self.entry.token)
        self.s.log.warning(f"[{self.node}] the {self.entry.procedure} journal stays in the ledger ({why}): the next "
                           f"run on {self.node}, or the health sweep's, finishes it from phase {self.phase}")


@contextmanager
def journaled(session: FleetSession, node: str, procedure: str, run_id: str, *, phase: str, was_in: bool = False,
              drain_reason: str | None = None, **facts: Any) -> Iterator[Journal]:
    """The procedure's journal for the block (see the module doc). Raises RunbookError, nothing
    changed, when it cannot be written."""
    entry = Procedure(procedure=procedure, run_id=run_id, token=secrets.token_hex(8),
                      owner=f"pid {os.getpid()} on {socket.gethostname()}", started=ledger.now(), phase=phase,
                      was_in=was_in, drain_reason=drain_reason, facts=facts)
    try:
        ledger.begin_procedure(session, node, entry)
    except RunbookError as e:
        raise RunbookError(f"{node}: the {procedure.replace('_', ' ')} did not start, nothing was changed: its "
                           f"journal could not be written to the ledger on the gateway host ({first_line(e)}); "
                           f"bring the gateway host back, then run it again") from None
    j = Journal(session, node, entry)
    _LIVE.add(entry.token)
    try:
        yield j
    except BaseException:
        gone = lease.lost(session, node)
        if gone is not None:
            j._leave(f"this run's lease ended under it: {first_line(gone.error())}")
        elif j.keep:
            j._leave("its undo did not finish")
        else:
            j._end()
        raise
    if j.keep:
        j._leave("its undo did not finish")
    else:
        j._end()


def is_live(procedure: Procedure) -> bool:
    """Whether `procedure` is the journal of a procedure this process runs now."""
    return procedure.token in _LIVE


def engine_timeout_s(session: FleetSession, node: Node) -> float:
    """How long a kept container started again gets to answer /health (a warm boot)."""
    return min(ROLLBACK_HEALTH_S, session.fleet.launch_for(node).health_timeout_s)


def still_waiting(session: FleetSession, procedure: Procedure, now: float | None = None) -> str | None:
    """Why `procedure` may be a live run's although the caller holds the node's lease (None: it is dead):
    the node was down for it (a reboot, a power cycle), the live run waits without a lease until
    `down_until`, and the instance does not know its run ended."""
    now = time.time() if now is None else now
    if procedure.down_until is None or now >= procedure.down_until:
        return None
    if session.run_ended is not None and session.run_ended(procedure.run_id):
        return None
    return (f"{procedure.describe()} waits for the node to come back until "
            f"{time.strftime('%H:%M:%S', time.localtime(procedure.down_until))} and its run is not known to have ended")


def dead_in_sweep(session: FleetSession, procedure: Procedure, *, reachable: bool, lease_held: bool | None,
                  now: float | None = None) -> bool:
    """The health sweep's judgement (it holds no lease, only reads it): `procedure` is a dead run's when no
    run holds the node's lease (a node that is down holds none: then only a journal that says the
    node was down for it counts), and it is not waiting for its node (`still_waiting`)."""
    if is_live(procedure) or lease_held:
        return False
    if (reachable and lease_held is None) or (not reachable and procedure.down_until is None):
        return False  # not known: the next sweep reads it again
    return still_waiting(session, procedure, now) is None


@dataclass(frozen=True)
class Finished:
    """What finishing one dead run's journal did."""

    procedure: str
    phase: str
    run_id: str
    line: str
    serving: bool
    facts: dict[str, Any] = field(default_factory=dict)


@contextmanager
def claimed(session: FleetSession, node: Node, what: str, log: Any, *, run_id: str = "",
            deploys: bool = True) -> Iterator[list[Finished]]:
    """The node's run lease (`what` names the procedure to a run that finds it taken), and what
    dead runs left on it finished first (`finish_dead`, yielded): one run touches a node at a time,
    and never on top of a dead run's half-done change. Raises NodeBusy (another run holds it)."""
    with lease.node_lease(session, node.name, what, run_id=run_id):
        yield finish_dead(session, node, log, run_id=run_id, deploys=deploys)


def finish_dead(session: FleetSession, node: Node, log: Any, *, run_id: str = "", deploys: bool = True) -> list[Finished]:
    """Finish what dead runs left on `node` (see the module doc). The caller holds the node's lease.
    `deploys=False`: not a dead deploy's journal (a deploy about to run finishes it itself, and does
    not launch again what serves after it). Raises NodeBusy when a journal may be a live run's
    waiting for the node to come back, and DeployFailed when a dead deploy cannot be finished."""
    n = node.name
    done: list[Finished] = []
    r = finish_interrupted(session, node, log, run_id=run_id) if deploys else None
    if r is not None:
        done.append(Finished("deploy", r.phase, r.run_id, r.line(), r.serving))
    try:
        procs = ledger.read(session).procedures(n)
    except RunbookError as e:
        log.warning(f"[{n}] the procedures in flight were not read from the ledger ({first_line(e)}): a dead run's "
                    f"is finished by a later run on {n}")
        return done
    for p in reversed(procs):
        if p.token in _LIVE:
            continue
        waiting = still_waiting(session, p)
        if waiting:
            raise NodeBusy(f"node {n} is busy: {waiting}; retry once it has come back (or its run ended)")
        log.warning(f"[{n}] {p.describe()} did not finish and its run no longer holds the node: finishing it "
                    f"before this run's own work")
        f = _finish(session, node, p)
        ledger.end_procedure(session, n, p.token)
        log.warning(f"[{n}] {f.line}")
        done.append(f)
    return done


def _finish(session: FleetSession, node: Node, p: Procedure) -> Finished:
    """A dead run's procedure brought to the end it promised, or to a hold-out saying why not."""
    f, n = session.fleet, node.name
    said: list[str] = []
    serving = engine.healthy(f, node)
    if p.engine and not serving:  # the engine it stopped: its kept container, as after a boot
        r = session.run(n, ["docker", "start", p.engine], check=False, timeout=120)
        if r.ok:
            limit = engine_timeout_s(session, node)
            serving = engine.wait_healthy(f, node, limit)
            said.append(f"docker start {p.engine}: " + ("/health 200" if serving else f"no /health within {limit:.0f} s"))
        else:
            said.append(f"docker start {p.engine} exited {r.exit_status} ({first_line(r.tail) or 'no output'})")
    elif p.engine:
        said.append(f"{p.engine} serves")
    if p.procedure == steps.PROC_JOIN:
        if p.phase != JOIN_BENCHED:  # deployed or not, never benched: not routed before its bench
            ledger.hold(session, n, ledger.BY_BENCH, f"not benched yet: {p.describe()} died before its bench; "
                                                f"add_node_job for {n} again benches it against the fleet's "
                                                f"baseline (what it did is not redone)", **{ledger.AGAINST_BASELINE: True})
            said.append(f"{n} held out until its bench (add_node_job for it again)")
    elif p.procedure == steps.PROC_COLD_DRAIN:
        said.append(_quarantined_after_cold_drain(session, n, p, serving))
    elif p.procedure == steps.PROC_ADOPTION:
        said.append(_renames_undone(session, n, p))
    if p.procedure == steps.PROC_NODE_OS and p.phase in ("rebooting", "verifying"):
        said.append("its verify after the reboot did not run: node_os_job for it verifies (it changes nothing)")
    if p.was_in and p.drain_reason:
        said.append(_gateway_after(session, node, p, serving))
    return Finished(p.procedure, p.phase, p.run_id, f"{p.describe()} finished: " + ("; ".join(said) or "nothing to undo"),
                    serving, dict(p.facts))


def _gateway_after(session: FleetSession, node: Node, p: Procedure, serving: bool) -> str:
    """The drain the dead run made: undone when the node serves and nothing else keeps it out;
    else the node stays out and the reason is where the gateway's promotion reads it."""
    n = node.name
    gw = GatewayHost(session)
    snap = gw.read()
    note = snap.drains.get(n)
    if n in snap.rotation:
        return f"{n} is in the gateway"
    if note is None or not note.startswith(p.drain_reason or "\0"):
        return f"{n} stays out of the gateway: " + (f"drained since by another ({note})" if note else
                                                    "not in the gateway config")
    if p.procedure == steps.PROC_BENCH and p.phase == BENCH_JUDGED and p.facts.get("keep_out"):
        return f"{n} stays out of the gateway: its bench held it out ({p.facts.get('reason', 'below its gate')})"
    if not serving:
        ledger.hold(session, n, ledger.BY_DEPLOY, f"{p.describe()} died and {n}'s vLLM does not answer /health after it: "
                                            f"deploy_node_job for {n} (a healthy deploy lifts this)")
        return f"{n} stays out of the gateway (not serving; held out: deploy_node_job for it)"
    held = ledger.read(session).why_held(n)
    if held:
        return f"{n} stays out of the gateway: {held}"
    put_back(gw, n)
    return f"its drain undone: {n} is back in the gateway"


def _quarantined_after_cold_drain(session: FleetSession, n: str, p: Procedure, serving: bool) -> str:
    """A cold drain's node stays quarantined until its validation: the record says where the dead
    run stopped and what to do."""
    rec = ledger.read(session).quarantined().get(n)
    reason = (f"{p.describe()} died; " + ("vLLM serves again" if serving else "vLLM does not serve")
              + ": the wedge is not validated: run cold_drain_job for it again")
    ledger.record_quarantine(session, n, rec.verdict if rec else "wedged", reason, by="finish of a dead cold drain")
    return f"{n} stays quarantined until a cold drain validates it ({reason})"


_UNDO_RENAME = ('if [ ! -e "$1" ] && [ ! -L "$1" ] && [ -d "$2" ]; then mv -T -- "$2" "$1" && echo undone; '
                'elif [ -L "$1" ]; then echo linked; else echo untouched; fi')


def _renames_undone(session: FleetSession, n: str, p: Procedure) -> str:
    """An adoption that renamed a cache folder into its slot and died before the link: the folder
    is renamed back (the running container's bind mount follows it either way)."""
    out = []
    for mount, slot in p.facts.get("renames", []):
        r = session.run(n, ["sh", "-c", _UNDO_RENAME, "adopt-undo", mount, slot], check=False, log=False, timeout=60)
        out.append(f"{mount}: {(r.stdout.strip() or f'exit {r.exit_status}')}")
    return "cache folders: " + ("; ".join(out) or "none renamed")
