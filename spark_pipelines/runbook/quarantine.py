"""Quarantine: a node kept out of the gateway until someone (or a good deploy) releases it.

The record lives OFF the node (a quarantined node may be SSH-dead or rebooting): a small JSON
file next to the gateway config on the gateway host, `<config>.quarantine.json`, node ->
{verdict, reason, since, by}. It is changed like the config itself: one bounded remote command
under `flock` on `<config>.lock` (so it never interleaves with a config change), written only if
the file still has the digest this process read (else re-read and retry), through a temp file
renamed into place (atomic). `runbook.rotation.promotion` reads it: a gateway_job rerun does not
put a quarantined node back.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core.fleet import Node
from spark_pipelines.core.healing import NOTE_PREFIX
from spark_pipelines.resources.gateway import EXIT_CHANGED, EXIT_LOCK, GatewayHost
from spark_pipelines.resources.ssh import GATEWAY_KEY, FleetSession, RemoteError
from spark_pipelines.resources import engine
from spark_pipelines.core.errors import RunbookError

SUFFIX = ".quarantine.json"
TIMEOUT_S = 30.0
LOCK_WAIT_S = 20
RETRIES = 5
# Verdicts a healthy deploy (its preflight passed) proves over; wedged and regressed need their own proof.
RELEASED_BY_DEPLOY = frozenset({"residue", "crash-loop", "engine-down"})

_READ = r'''f=$1
if [ -f "$f" ]; then sha256sum < "$f" | cut -c1-64; cat -- "$f"; else echo absent; fi'''

# $1 file  $2 digest expected.  stdin: the new content ("" removes the file).
_WRITE = r'''set -u
f=$1 want=$2 tmp="$1.tmp-$$"
cat > "$tmp" || { rm -f "$tmp"; exit 70; }
have=absent; [ -f "$f" ] && have=$(sha256sum < "$f" | cut -c1-64)
if [ "$have" != "$want" ]; then rm -f "$tmp"; echo "changed since read" >&2; exit 75; fi
if [ ! -s "$tmp" ]; then rm -f "$tmp" "$f"; echo removed; exit 0; fi
chmod 600 "$tmp" && mv -f "$tmp" "$f" || { rm -f "$tmp"; exit 70; }
echo written'''


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


def _read(s: FleetSession) -> tuple[dict[str, Any], str]:
    gw = GatewayHost(s)
    try:
        r = s.run(GATEWAY_KEY, ["sh", "-c", _READ, "quarantine-read", record_path(gw)], log=False, timeout=TIMEOUT_S)
    except RemoteError as e:
        raise QuarantineError(f"gateway {gw.gw.host}: reading {record_path(gw)} failed: "
                              f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    head, _, text = r.stdout.partition("\n")
    if head.strip() == "absent":
        return {}, "absent"
    try:
        data = json.loads(text)
    except ValueError:
        raise QuarantineError(f"gateway {gw.gw.host}: {record_path(gw)} is not JSON: fix or remove it "
                              "(it lists the quarantined nodes)") from None
    return (data if isinstance(data, dict) else {}), head.strip()


def _change(s: FleetSession, edit) -> dict[str, Any]:
    """Read, edit, write under the gateway config's lock; retried while another run changes it."""
    gw = GatewayHost(s)
    path = record_path(gw)
    for _ in range(RETRIES):
        data, digest = _read(s)
        new = edit(dict(data))
        if new == data:
            return data
        text = json.dumps(new, indent=2, sort_keys=True) + "\n" if new else ""
        argv = ["flock", "-w", str(LOCK_WAIT_S), "-E", str(EXIT_LOCK), f"{gw.config_path}.lock",
                "sh", "-c", _WRITE, "quarantine-write", path, digest]
        try:
            r = s.run(GATEWAY_KEY, argv, stdin=text, check=False, log=False, timeout=LOCK_WAIT_S + TIMEOUT_S)
        except RemoteError as e:
            raise QuarantineError(f"gateway {gw.gw.host}: writing {path} failed: "
                                  f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        if r.exit_status == 0:
            return new
        if r.exit_status == EXIT_CHANGED:
            continue
        if r.exit_status == EXIT_LOCK:
            raise QuarantineError(f"gateway {gw.gw.host}: {gw.config_path}.lock held for more than {LOCK_WAIT_S} s "
                                  f"(a config change or reload in progress); {path} not changed, retry")
        raise QuarantineError(f"gateway {gw.gw.host}: writing {path} exited {r.exit_status}: {r.tail.strip()[-200:]}")
    raise QuarantineError(f"gateway {gw.gw.host}: {path} kept changing under this run; not changed, retry")


def quarantined(s: FleetSession) -> dict[str, Quarantined]:
    """Every quarantined node, read from the gateway host."""
    data, _ = _read(s)
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
