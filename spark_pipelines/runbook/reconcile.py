"""Gateway reconcile: read what the rotation is and should be, and apply core.healing's plan.

`read_view` gathers the plan's inputs besides the sweep's verdicts: the gateway config (its
rotation and drain notes) and the ledger (quarantines and each node's hold-outs). `apply`
makes the plan's changes one node at a time, each re-checked right before it is made (a put-back
node must still answer /health and not be quarantined; a serving node is never drained below
gateway.min_in_rotation: the gateway code refuses, and that refusal is reported, not raised).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core import healing
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.gateway import GatewayHost, Snapshot
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.resources import engine
from spark_pipelines.runbook import rotation, sweep
from spark_pipelines.state import ledger
from spark_pipelines.state.ledger import Procedure, Quarantine


@dataclass(frozen=True)
class View:
    snapshot: Snapshot
    quarantined: dict[str, Quarantine]
    promoted: dict[str, bool]
    procedures: dict[str, list[Procedure]] = field(default_factory=dict)  # in flight, or a dead run's


def read_view(session: FleetSession, healthy: list[str]) -> View:
    """The gateway config and the ledger: quarantines, whether each `healthy` node is free of
    hold-outs (the others are not put back whatever the ledger says), and the procedures in
    flight on each node (their journals)."""
    snap = GatewayHost(session).read()
    led = ledger.read(session)
    return View(snap, led.quarantined(), {name: not led.entry(name).holds for name in healthy},
                {name: e.procedures for name, e in led.nodes.items() if e.procedures})


def states(verdicts: Mapping[str, str], failing: Mapping[str, int], serving: Mapping[str, bool],
           view: View) -> dict[str, healing.NodeState]:
    return {name: healing.NodeState(
        verdict=verdict, failing=failing.get(name, 0), serving=serving.get(name, False),
        promoted=view.promoted.get(name, verdict != "healthy"),
        quarantined=view.quarantined[name].summary() if name in view.quarantined else None,
        busy=view.procedures[name][-1].describe() if view.procedures.get(name) else None)
        for name, verdict in verdicts.items()}


def plan(fleet: Fleet, reports: Mapping[str, sweep.NodeReport], failing: Mapping[str, int], view: View, *,
         now: float) -> healing.ReconcilePlan:
    """core.healing's plan for the gateway from one sweep's reports, each node's failing streak
    and the view (the health sensor's, and a person's reconcile)."""
    st = states({n: r.verdict.verdict for n, r in reports.items()}, failing,
                {n: bool(r.observation.health_ok) for n, r in reports.items()}, view)
    return healing.reconcile(st, view.snapshot.rotation, view.snapshot.drains, settings=fleet.health,
                             min_in_rotation=fleet.gateway.min_in_rotation, now=now)


def plan_now(session: FleetSession, log: Any) -> healing.ReconcilePlan:
    """A reconcile launched by a person: a sweep now, which counts as the confirming sweep (a
    failing node is taken as failing for health.failed_sweeps sweeps already)."""
    with sweep.open_session(session.fleet, log) as probe:
        reports = sweep.sweep(probe)
        view = read_view(probe, [n for n, r in reports.items() if r.verdict.verdict == "healthy"])
    failing = {n: session.fleet.health.failed_sweeps if r.verdict.verdict in healing.FAILING else 0
               for n, r in reports.items()}
    return plan(session.fleet, reports, failing, view, now=time.time())


def apply(session: FleetSession, gw: GatewayHost, plan: healing.ReconcilePlan) -> list[str]:
    """Make the plan's changes; returns one line per node saying what was done or why not."""
    said: list[str] = []
    held = ledger.quarantined(session) if plan.put_back else {}
    for m in plan.take_out:
        try:
            rotation.take_out(gw, m.node, f"{healing.NOTE_PREFIX}{m.reason[:100]}", dead=m.dead)
            said.append(f"{m.node} taken out: {m.reason}")
        except gateway_core.RotationRefused as e:
            said.append(f"{m.node} stays in: {e}")
    for m in plan.put_back:
        if m.node in held:
            said.append(f"{m.node} not put back: quarantined ({held[m.node].summary()})")
        elif not engine.healthy(session.fleet, session.fleet.node(m.node)):
            said.append(f"{m.node} not put back: /health no longer answers")
        else:
            rotation.admit(gw, m.node)
            said.append(f"{m.node} put back: {m.reason}")
    return said


__all__ = ["View", "apply", "plan", "plan_now", "read_view", "states"]
