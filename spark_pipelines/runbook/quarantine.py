"""Quarantine: a node kept out of the gateway until someone (or a good deploy) releases it.

The record is the node's quarantine in the ledger on the gateway host (`state.ledger`: off the
node, which may be SSH-dead or rebooting; changed under the gateway config's lock). It is recorded
first, then the node is drained, so no gateway step puts it back even if the drain fails:
`runbook.rotation.promotion` reads the ledger.
"""

from __future__ import annotations

from dataclasses import dataclass

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core.fleet import Node
from spark_pipelines.core.healing import NOTE_PREFIX
from spark_pipelines.resources import engine
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook import rotation
from spark_pipelines.state import ledger
from spark_pipelines.state.ledger import RELEASED_BY_DEPLOY, Quarantine


@dataclass(frozen=True)
class Outcome:
    record: Quarantine
    drained: bool
    note: str  # what happened to the gateway


def quarantined(session: FleetSession) -> dict[str, Quarantine]:
    """Every quarantined node, read from the gateway host."""
    return ledger.quarantined(session)


def quarantine(session: FleetSession, node: str | Node, verdict: str, reason: str, by: str,
               gw: GatewayHost | None = None) -> Outcome:
    """Record the quarantine on the gateway host first (so no gateway step puts the node back even
    if the drain below fails), then take the node out of every pool: dead=True only when its
    vLLM does not answer (a serving node is never drained below gateway.min_in_rotation)."""
    name = node if isinstance(node, str) else node.name
    n = session.fleet.node(name)
    rec = ledger.record_quarantine(session, name, verdict, reason, by)
    gw = gw or GatewayHost(session)  # the caller's carries the proxy's master key (its /model/info confirms the drain)
    if name not in gw.rotation():
        return Outcome(rec, False, f"{name} is not in the gateway")
    serving = engine.healthy(session.fleet, n)
    try:
        rotation.take_out(gw, name, f"{NOTE_PREFIX}quarantined ({verdict})", dead=not serving)
    except gateway_core.RotationRefused as e:
        return Outcome(rec, False, f"{name} stays in the gateway for now: {e}")
    return Outcome(rec, True, f"{name} taken out of the gateway" + ("" if serving else " (not serving)"))


def release(session: FleetSession, node: str | Node, by: str) -> Quarantine | None:
    """End a node's quarantine (the record it had, or None). The node goes back into the gateway
    with the next gateway_job or gateway_reconcile_job once it is healthy and promoted."""
    name = node if isinstance(node, str) else node.name
    session.fleet.node(name)  # a FleetError names the known nodes
    before = ledger.end_quarantine(session, name)
    if before is None:
        return None
    session.log.info(f"[{name}] quarantine released by {by} (was {before.summary()})")
    return before


def release_after_deploy(session: FleetSession, node: Node) -> str | None:
    """Called by a deploy that committed (its preflight passed, it serves): a quarantine for a
    verdict the deploy proves over ends. Returns what happened, None when nothing did."""
    rec = quarantined(session).get(node.name)
    if rec is None or rec.verdict not in RELEASED_BY_DEPLOY:
        return None if rec is None else f"still quarantined ({rec.summary()}): a deploy does not prove it over"
    release(session, node, by="a healthy deploy (preflight passed)")
    return f"quarantine ({rec.verdict}) released: the deploy's preflight passed and it serves"
