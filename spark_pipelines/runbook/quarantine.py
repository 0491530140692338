"""Quarantine: a node kept out of the gateway until someone (or a good deploy) releases it.

The record lives OFF the node (a quarantined node may be SSH-dead or rebooting): a small JSON
file next to the gateway config on the gateway host, `<config>.quarantine.json`, node ->
{verdict, reason, since, by}. It is read and changed through the gateway host's one protocol for
the files beside its config (`GatewayHost.read_sidecar` / `change_sidecar`: under `<config>.lock`,
never interleaved with a config change, written only if unchanged since read, atomic rename).
`runbook.rotation.promotion` reads it: a gateway_job rerun does not put a quarantined node back.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core.fleet import Node
from spark_pipelines.core.healing import NOTE_PREFIX
from spark_pipelines.resources.gateway import GatewayError, GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.resources import engine
from spark_pipelines.core.errors import RunbookError

SUFFIX = ".quarantine.json"
LOCK_WAIT_S = 20
# Verdicts a healthy deploy (its preflight passed) proves over; wedged and regressed need their own proof.
RELEASED_BY_DEPLOY = frozenset({"residue", "crash-loop", "engine-down"})


class QuarantineError(RunbookError):
    pass


@dataclass(frozen=True)
class Quarantined:
    node: str
    verdict: str
    reason: str
    since: str
    by: str

    def summary(self) -> str:
        return f"{self.verdict}: {self.reason} (since {self.since}, by {self.by})"


@dataclass(frozen=True)
class Outcome:
    record: Quarantined
    drained: bool
    note: str  # what happened to the gateway


def record_path(gw: GatewayHost) -> str:
    return gw.config_path + SUFFIX


def _parse(gw: GatewayHost, text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except ValueError:
        raise QuarantineError(f"gateway {gw.gw.host}: {record_path(gw)} is not JSON: fix or remove it "
                              "(it lists the quarantined nodes)") from None
    return data if isinstance(data, dict) else {}


def _read(s: FleetSession) -> dict[str, Any]:
    gw = GatewayHost(s)
    try:
        text, _ = gw.read_sidecar(SUFFIX)
    except GatewayError as e:
        raise QuarantineError(str(e)) from None
    return _parse(gw, text)


def _change(s: FleetSession, edit) -> dict[str, Any]:
    """Read, edit, write under the gateway config's lock; retried while another run changes it."""
    gw = GatewayHost(s)

    def on_text(text: str | None) -> str | None:
        data = _parse(gw, text)
        new = edit(dict(data))
        if new == data:
            return text
        return json.dumps(new, indent=2, sort_keys=True) + "\n" if new else None

    try:
        return _parse(gw, gw.change_sidecar(SUFFIX, on_text, lock_wait_s=LOCK_WAIT_S))
    except GatewayError as e:
        raise QuarantineError(str(e)) from None


def quarantined(s: FleetSession) -> dict[str, Quarantined]:
    """Every quarantined node, read from the gateway host."""
    data = _read(s)
    out = {}
    for node, rec in data.items():
        if isinstance(rec, dict):
            out[node] = Quarantined(node, str(rec.get("verdict", "?")), str(rec.get("reason", "")),
                                    str(rec.get("since", "?")), str(rec.get("by", "?")))
    return out


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def quarantine(s: FleetSession, node: str | Node, verdict: str, reason: str, by: str,
               gw: GatewayHost | None = None) -> Outcome:
    """Record the quarantine on the gateway host first (so no gateway step puts the node back even
    if the drain below fails), then take the node out of every pool: dead=True only when its
    vLLM does not answer (a serving node is never drained below gateway.min_in_rotation)."""
    name = node if isinstance(node, str) else node.name
    n = s.fleet.node(name)
    rec = Quarantined(name, verdict, reason, _now(), by)

    def edit(data: dict[str, Any]) -> dict[str, Any]:
        data[name] = {"verdict": verdict, "reason": reason, "since": rec.since, "by": by}
        return data

    _change(s, edit)
    gw = gw or GatewayHost(s)  # the caller's carries the proxy's master key (its /model/info confirms the drain)
    if name not in gw.rotation():
        return Outcome(rec, False, f"{name} is not in the gateway")
    serving = engine.healthy(s.fleet, n)
    try:
        gw.drain(name, reason=f"{NOTE_PREFIX}quarantined ({verdict})", wait_s=0, dead=not serving)
    except gateway_core.RotationRefused as e:
        return Outcome(rec, False, f"{name} stays in the gateway for now: {e}")
    return Outcome(rec, True, f"{name} taken out of the gateway" + ("" if serving else " (not serving)"))


def release(s: FleetSession, node: str | Node, by: str) -> Quarantined | None:
    """End a node's quarantine (the record it had, or None). The node goes back into the gateway
    with the next gateway_job or gateway_reconcile_job once it is healthy and promoted."""
    name = node if isinstance(node, str) else node.name
    s.fleet.node(name)  # a FleetError names the known nodes
    before = quarantined(s).get(name)
    if before is None:
        return None
    _change(s, lambda data: {k: v for k, v in data.items() if k != name})
    s.log.info(f"[{name}] quarantine released by {by} (was {before.summary()})")
    return before


def release_after_deploy(s: FleetSession, node: Node) -> str | None:
    """Called by a deploy that committed (its preflight passed, it serves): a quarantine for a
    verdict the deploy proves over ends. Returns what happened, None when nothing did."""
    rec = quarantined(s).get(node.name)
    if rec is None or rec.verdict not in RELEASED_BY_DEPLOY:
        return None if rec is None else f"still quarantined ({rec.summary()}): a deploy does not prove it over"
    release(s, node, by="a healthy deploy (preflight passed)")
    return f"quarantine ({rec.verdict}) released: the deploy's preflight passed and it serves"
