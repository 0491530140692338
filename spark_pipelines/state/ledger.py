"""Why a node is out of the gateway: one ledger, on the gateway host.

A node leaves the rotation for one of three reasons, each recorded here or in the config itself:
- a drain: the LiteLLM config's own header notes (`core.gateway`), written with the config;
- a quarantine: out until released by an operator, or by a healthy deploy for the verdicts a
  deploy proves over (residue, crash-loop, engine-down); a wedge is released only by its
  cold-drain validation;
- a hold-out by a gate that judged the node: its bench (below the floor, wedged under load, a
  void bench), a failed deploy whose previous version did not serve again, a rollout's revert,
  a Phase 0 reboot after which the node is not clean or does not serve, and a version deployed to
  await its gate (`gate`: a rollout's or a newcomer's, until its bench promotes it).
  Hold-outs stack by who put them: each actor lifts only its own, and a node is promoted when it
  has no hold-out and no quarantine.

Beside them, each procedure in flight on a node (Phase 0's reboot, a newcomer joining, a bench's
drain, a cold drain, an adoption's cache renames) keeps its journal here (`Procedure`): what it
took out, stopped or set aside, written before the change and removed when it is done, so the next
run on the node or the health sweep finishes what a dead run left (runbook/journal.py). Off the
node, because a reboot or a cold drain takes the node itself away: a run killed while the node is
powered off must still be found. (A deploy's journal stays on the node, beside its containers.)

The ledger lives OFF the nodes (a node held out may be SSH-dead or rebooting) in one JSON file
next to the gateway config, `<config>.ledger.json`, and is changed like the config: one bounded
remote command under `flock` on `<config>.lock` (never interleaved with a config change),
written only if the file still has the digest this process read (else re-read and retry),
through a temp file renamed into place. `why_out` answers "why is this node out?" from one read
of both files.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from spark_pipelines.core.errors import RunbookError
from spark_pipelines.resources.gateway import GatewayError, GatewayHost
from spark_pipelines.resources.ssh import FleetSession

SUFFIX = ".ledger.json"
LEGACY_SUFFIX = ".quarantine.json"  # quarantines recorded before the ledger (read while no ledger exists)

# Who puts a hold-out on a node (each lifts only its own).
BY_BENCH, BY_DEPLOY, BY_ROLLOUT, BY_GATE = "bench", "deploy", "rollout", "gate"
# Phase 0 that left its node not clean or not serving after its reboot: lifted by its next run.
BY_NODE_OS = "node_os"
# The fact on a bench's hold-out judged against the fleet's baseline (a rollout's canary, a
# newcomer): the node's next bench is judged against it again, not on its floors alone.
AGAINST_BASELINE = "against_baseline"
# A healthy deploy proves over these hold-outs (the node serves its launch spec again).
LIFTED_BY_DEPLOY = (BY_DEPLOY, BY_ROLLOUT, BY_GATE)
# Quarantine verdicts a healthy deploy (its preflight passed) proves over; wedged and regressed
# need their own proof (a cold drain's validation, a bench).
RELEASED_BY_DEPLOY = frozenset({"residue", "crash-loop", "engine-down"})

class LedgerError(RunbookError):
    pass


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class Hold(_Model):
    by: str
    reason: str
    since: str = ""
    facts: dict[str, Any] = {}

    def summary(self) -> str:
        return f"held out by its {self.by}: {self.reason}"

    @property
    def against_baseline(self) -> bool:
        return bool(self.facts.get(AGAINST_BASELINE))


class Quarantine(_Model):
    node: str = ""
    verdict: str
    reason: str
    since: str = ""
    by: str = ""

    def summary(self) -> str:
        return f"{self.verdict}: {self.reason} (since {self.since}, by {self.by})"


class Procedure(_Model):
    """One procedure in flight on a node: its journal (see the module doc and runbook/journal.py).
    `token` names this run of it (a process never finishes its own live one); `phase` says how far
    it got; `was_in` / `drain_reason`: the node was in the gateway and this procedure's drain note
    starts with that reason; `engine`: the container it stopped; `down_until`: while the node is
    down (rebooting, powered off) the live run waits for it until then, and only a run known to
    have ended is finished before; `facts`: what else its undo needs."""

    procedure: str
    run_id: str = ""
    token: str = ""
    owner: str = ""  # "pid N on HOST"
    started: str = ""
    phase: str = ""
    was_in: bool = False
    drain_reason: str | None = None
    engine: str | None = None
    down_until: float | None = None
    facts: dict[str, Any] = {}

    def describe(self) -> str:
        what = {"node_os": "Phase 0 reboot", "node_join": "add_node"}.get(self.procedure, self.procedure.replace("_", " "))
        return (f"the {what} of run {self.run_id[:8] or '-'} "
                f"({self.owner or 'owner unknown'}, started {self.started or '?'}, phase {self.phase or '?'})")


class NodeEntry(_Model):
    quarantine: Quarantine | None = None
    holds: dict[str, Hold] = {}
    procedures: list[Procedure] = []  # in the order they began (an add_node's Phase 0 after its own)

    @property
    def empty(self) -> bool:
        return self.quarantine is None and not self.holds and not self.procedures


class Ledger(_Model):
    nodes: dict[str, NodeEntry] = {}
    digest: str = "absent"  # the file's digest as read (not stored)

    def entry(self, node: str) -> NodeEntry:
        return self.nodes.get(node) or NodeEntry()

    def promoted(self, node: str) -> bool:
        e = self.entry(node)
        return e.quarantine is None and not e.holds

    def quarantined(self) -> dict[str, Quarantine]:
        return {n: e.quarantine for n, e in self.nodes.items() if e.quarantine is not None}

    def why_held(self, node: str) -> str | None:
        """The reason a gate keeps the node out (None: promoted)."""
        e = self.entry(node)
        if e.quarantine is not None:
            return f"quarantined: {e.quarantine.summary()}"
        if e.holds:
            return "; ".join(h.summary() for h in e.holds.values())
        return None

    def procedures(self, node: str) -> list[Procedure]:
        return list(self.entry(node).procedures)

    def with_entry(self, node: str, entry: NodeEntry) -> Ledger:
        nodes = {k: v for k, v in self.nodes.items() if k != node}
        if not entry.empty:
            nodes[node] = entry
        return Ledger(nodes=dict(sorted(nodes.items())), digest=self.digest)

    def text(self) -> str:
        body = {n: e.model_dump(exclude_defaults=True) for n, e in self.nodes.items()}
        return json.dumps({"nodes": body}, indent=2, sort_keys=True) + "\n"


def _parse(text: str, legacy: str | None) -> dict[str, NodeEntry]:
    if text:
        data = json.loads(text)
        nodes = data.get("nodes") if isinstance(data, dict) else None
        if not isinstance(data, dict) or not isinstance(nodes, (dict, type(None))):
            raise ValueError("not a ledger object")  # valid JSON, but no {"nodes": {...}}
        return {n: NodeEntry.model_validate(e) for n, e in (nodes or {}).items()}
    if legacy:  # node -> {verdict, reason, since, by}
        data = json.loads(legacy)
        if not isinstance(data, dict):
            raise ValueError("not a quarantine record object")
        return {n: NodeEntry(quarantine=Quarantine(node=n, **{k: str(v) for k, v in rec.items()
                                                                if k in ("verdict", "reason", "since", "by")}))
                for n, rec in data.items() if isinstance(rec, dict)}
    return {}


def _load(gw: GatewayHost, text: str | None) -> dict[str, NodeEntry]:
    legacy = None
    if text is None:  # no ledger yet: the quarantines an older version recorded are its start
        legacy, _ = gw.read_sidecar(LEGACY_SUFFIX)
    try:
        return _parse(text or "", legacy)
    except (ValueError, ValidationError):
        raise LedgerError(f"gateway {gw.gw.host}: {gw.sidecar_path(SUFFIX)} is not a ledger spark-pipelines can "
                          f"read: fix it, or put back its last good copy (it lists the quarantined and held-out "
                          f"nodes)") from None


def read(session: FleetSession) -> Ledger:
    """The ledger as the gateway host holds it (one remote read)."""
    gw = GatewayHost(session)
    try:
        text, digest = gw.read_sidecar(SUFFIX)
        return Ledger(nodes=_load(gw, text), digest=digest)
    except GatewayError as e:
        raise LedgerError(str(e)) from None


def change(session: FleetSession, edit: Callable[[Ledger], Ledger]) -> Ledger:
    """Read, edit, write under the gateway config's lock (the gateway's one sidecar protocol:
    digest compare-and-swap, temp file renamed into place), retried while another run changes it."""
    gw = GatewayHost(session)
    done: list[Ledger] = []

    def on_text(text: str | None) -> str | None:
        before = Ledger(nodes=_load(gw, text), digest="absent" if text is None else "read")
        after = edit(before)
        done[:] = [after]
        if after.nodes == before.nodes and text is not None:
            return text  # nothing changed: nothing written
        return after.text()

    try:
        gw.change_sidecar(SUFFIX, on_text)
    except GatewayError as e:
        raise LedgerError(str(e)) from None
    return done[0]


# ------------------------------------------------------------------------------ hold-outs


def hold(session: FleetSession, node: str, by: str, reason: str, **facts: Any) -> Ledger:
    """Hold `node` out of the gateway for `by`'s reason (replacing `by`'s earlier hold-out)."""
    h = Hold(by=by, reason=reason, since=now(), facts=facts)

    def edit(led: Ledger) -> Ledger:
        e = led.entry(node)
        return led.with_entry(node, e.model_copy(update={"holds": {**e.holds, by: h}}))

    return change(session, edit)


def lift(session: FleetSession, node: str, *by: str) -> Ledger:
    """End the hold-outs `by` put on `node` (the others stay)."""

    def edit(led: Ledger) -> Ledger:
        e = led.entry(node)
        return led.with_entry(node, e.model_copy(update={"holds": {k: v for k, v in e.holds.items() if k not in by}}))

    return change(session, edit)


def set_holds(session: FleetSession, node: str, holds: dict[str, Hold]) -> Ledger:
    """Put `node`'s hold-outs back to exactly `holds` (a rollout's revert); its quarantine stays."""

    def edit(led: Ledger) -> Ledger:
        return led.with_entry(node, led.entry(node).model_copy(update={"holds": dict(holds)}))

    return change(session, edit)


# ------------------------------------------------------------------------------ quarantine


def record_quarantine(session: FleetSession, node: str, verdict: str, reason: str, by: str) -> Quarantine:
    q = Quarantine(node=node, verdict=verdict, reason=reason, since=now(), by=by)

    def edit(led: Ledger) -> Ledger:
        return led.with_entry(node, led.entry(node).model_copy(update={"quarantine": q}))

    change(session, edit)
    return q


def end_quarantine(session: FleetSession, node: str) -> Quarantine | None:
    """End `node`'s quarantine; returns the one it had."""
    had: list[Quarantine | None] = [None]

    def edit(led: Ledger) -> Ledger:
        e = led.entry(node)
        had[0] = e.quarantine
        return led.with_entry(node, e.model_copy(update={"quarantine": None}))

    change(session, edit)
    return had[0]


def quarantined(session: FleetSession) -> dict[str, Quarantine]:
    return read(session).quarantined()


# ------------------------------------------------------------------------------ procedures


def begin_procedure(session: FleetSession, node: str, p: Procedure) -> Ledger:
    """Add `p` to the node's procedures in flight (one write, under the lock)."""

    def edit(led: Ledger) -> Ledger:
        e = led.entry(node)
        kept = [q for q in e.procedures if q.token != p.token]
        return led.with_entry(node, e.model_copy(update={"procedures": [*kept, p]}))

    return change(session, edit)


def update_procedure(session: FleetSession, node: str, token: str, **fields: Any) -> Procedure | None:
    """Change the fields of the node's procedure `token`; returns it as written (None: it is gone,
    another run finished it)."""
    out: list[Procedure | None] = [None]

    def edit(led: Ledger) -> Ledger:
        e = led.entry(node)
        procs = []
        for q in e.procedures:
            if q.token == token:
                q = q.model_copy(update=fields)
                out[0] = q
            procs.append(q)
        return led.with_entry(node, e.model_copy(update={"procedures": procs}))

    change(session, edit)
    return out[0]


def end_procedure(session: FleetSession, node: str, token: str) -> Ledger:
    """Remove the node's procedure `token` (done, or finished by the next run)."""

    def edit(led: Ledger) -> Ledger:
        e = led.entry(node)
        return led.with_entry(node, e.model_copy(update={"procedures": [q for q in e.procedures if q.token != token]}))

    return change(session, edit)


# ------------------------------------------------------------------------------ the answer


def why_out(session: FleetSession, snapshot: Any = None) -> dict[str, list[str]]:
    """Every serve node out of the gateway's rotation, with every reason recorded for it: its
    drain note, its quarantine, its hold-outs (or that nothing records why)."""
    snap = snapshot or GatewayHost(session).read()
    led = read(session)
    rotation = set(snap.rotation)
    out: dict[str, list[str]] = {}
    for node in session.fleet.serve_nodes:
        if node.name in rotation:
            continue
        reasons = []
        if node.name in snap.drains:
            reasons.append(f"drained: {snap.drains[node.name]}")
        held = led.why_held(node.name)
        if held:
            reasons.append(held)
        reasons += [f"in flight: {p.describe()}" for p in led.procedures(node.name)]
        out[node.name] = reasons or ["not in the gateway config: left out by the last gateway step"]
    return out

