"""Who is in the gateway's rotation: the one procedure that writes it, and taking one node out
for a while.

The ledger decides (quarantines, hold-outs, bench verdicts; `promotion` reads it); the functions
here are the only callers of the gateway host's membership writes (`write_promotion`, `take_out`,
`note_out`, `admit`, through `drained` and `put_back`): the bench, the deploy, the rollout, the
health sweep, the wedge's cold drain and the gateway asset ask them (tests/unit/test_layers.py
holds every other module to it).

`drained(gw, node)` is the drain / try / restore block of the deploy, the bench, the experiment
and Phase 0's reboot: the node leaves every pool, its requests in flight end (`wait_idle`), and it
is put back in every outcome unless the body decides to keep it out.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core import pair as pair_core
from spark_pipelines.core.pair_launch import enabled_pair_of
from spark_pipelines.resources import lease
from spark_pipelines.core.diagnosis import METRIC_RUNNING, METRIC_WAITING
from spark_pipelines.core.fleet import Fleet, Node
from spark_pipelines.core.polling import poll_until
from spark_pipelines.resources.gateway import GatewayError, GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.resources import engine
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.state import ledger


def promotion(session: FleetSession) -> tuple[list[str], dict[str, str]]:
    """Nodes to put in rotation, and the reason each other node is left out: quarantined or held
    out by a gate (the ledger), or its vLLM does not answer /health."""
    fleet = session.fleet
    rotation: list[str] = []
    out: dict[str, str] = {}
    led = ledger.read(session)
    for node in fleet.serve_nodes:
        held = led.why_held(node.name)
        pair = enabled_pair_of(fleet, node.name)
        if held:
            out[node.name] = held
        elif pair is not None and pair.worker == node.name:  # headless: the pair is its head's backend
            out[node.name] = pair_core.WORKER_OUT.format(pair=pair.name, head=pair.head)
        elif not engine.healthy(fleet, node):
            out[node.name] = "vLLM /health does not answer"
        else:
            rotation.append(node.name)
    return rotation, out


def write_promotion(gw: GatewayHost) -> tuple[list[str], dict[str, str], dict, bool]:
    """The gateway config for `promotion`'s rotation, written and reloaded (refused below
    gateway.min_in_rotation, at least 1: the proxy keeps its current pools). Returns the rotation,
    who is left out and why, the config and whether the proxy reloaded. Raises RunbookError."""
    rotation, left_out = promotion(gw.session)
    floor = max(1, gw.fleet.gateway.min_in_rotation)
    why_out = "; ".join(f"{k}: {v}" for k, v in left_out.items())
    if not rotation:
        raise RunbookError("no node is healthy and promoted: the gateway config was NOT rewritten (the proxy "
                           f"keeps its current pools). {why_out}")
    if len(rotation) < floor:
        raise RunbookError(f"only {len(rotation)} node(s) healthy and promoted ({', '.join(rotation)}), below "
                           f"gateway.min_in_rotation={floor}: the gateway config was NOT rewritten (the proxy keeps "
                           f"its current pools). {why_out}")
    try:
        config, reloaded = gw.set_rotation(rotation, floor)
    except (gateway_core.RotationRefused, ValueError) as e:
        raise RunbookError(f"gateway not changed: {e}") from None
    return rotation, left_out, config, reloaded


def take_out(gw: GatewayHost, node: str, reason: str, wait_s: float | None = 0, *, dead: bool = False,
             deploying: bool = False) -> None:
    """Out of every pool, confirmed, with `reason` as its note (GatewayHost.drain: refused with
    RotationRefused below gateway.min_in_rotation unless `dead`)."""
    gw.drain(node, reason=reason, wait_s=wait_s, dead=dead, deploying=deploying)


def note_out(gw: GatewayHost, node: str, reason: str) -> None:
    """A node that is out already keeps `reason` as the note of why (the next run reads it)."""
    gw.note(node, reason)


def admit(gw: GatewayHost, node: str) -> None:
    """Back in every pool. The caller has asked the ledger (`put_back` does it for a drain's end;
    a reconcile and a lifted quarantine checked already)."""
    gw.restore(node)


# After the drain, the node's vLLM must read zero requests this long (two reads): a request the
# proxy's old worker had accepted just before the reload may still be on its way to the node.
IDLE_CONFIRM_S = 1.0


def wait_idle(fleet: Fleet, node: Node, timeout_s: float | None = None, *, drained: bool = True) -> float:
    """Wait until the node's vLLM reports no request running or waiting (num_requests_running +
    num_requests_waiting) on two reads IDLE_CONFIRM_S apart, up to `timeout_s` (default
    gateway.in_flight_wait_s). Returns the seconds waited. An engine that answers neither /metrics
    nor /health serves nothing: done. Raises RunbookError naming what is still in flight."""
    limit = fleet.gateway.in_flight_wait_s if timeout_s is None else timeout_s
    zero_since: list[float] = []

    def in_flight() -> float | None:
        m = engine.engine_metrics(fleet, node)
        if m is None:
            return None if engine.healthy(fleet, node) else 0.0
        return m.get(METRIC_RUNNING, 0) + m.get(METRIC_WAITING, 0)

    def idle(busy: float | None) -> bool:
        if busy != 0:
            zero_since.clear()
            return False
        zero_since.append(time.monotonic())
        return zero_since[-1] - zero_since[0] >= IDLE_CONFIRM_S

    polled = poll_until(in_flight, idle, timeout_s=limit, every_s=IDLE_CONFIRM_S / 2)
    if not polled.done:
        busy = "an unknown number of" if polled.value is None else f"{polled.value:g}"
        why = ("a long stream through the gateway, or a client talking to the node directly" if drained
               else "it is out of the gateway: something talks to it directly")
        raise RunbookError(f"{node.name} still has {busy} requests in flight {limit:.0f} s after leaving the gateway "
                           f"({why}); nothing was stopped: wait for them or raise gateway.in_flight_wait_s")
    return round(polled.waited_s, 1)


@dataclass
class Drain:
    node: str
    was_in: bool
    # After a clean exit the node is put back unless keep_out. It starts as "where it was": a
    # node that was out stays out, unless the body clears it (a bench that promotes it).
    keep_out: bool = False
    waited_s: float | None = None  # how long its requests in flight took to end (None: not waited for)


@contextmanager
def drained(gw: GatewayHost, node: str, reason: str = "drained", wait_s: float | None = None, *,
            dead: bool = False, deploying: bool = False, idle: bool | None = None) -> Iterator[Drain]:
    """Take `node` out of every pool for the block, confirmed (the reloaded proxy no longer lists
    it), then wait for its requests in flight to end (`wait_idle`, gateway.in_flight_wait_s)
    before the block runs: nothing the block does to the node (docker stop, a bench, a reboot)
    cuts a client's request. `idle`: None waits when this drain took the node out and it serves
    (not `dead`); True waits whatever (a bench's isolation), False never. A drain that would leave
    fewer than gateway.min_in_rotation nodes waits up to `wait_s` for others to come back, then is
    refused (RotationRefused, nothing changed); `dead` and `deploying` as for GatewayHost.drain.
    On an exception, including a drain whose reload failed, requests that did not end in time and
    a run terminated mid-block, the node goes back where it was unless the body set `keep_out`
    (it found the node cannot serve); after a clean exit, unless `keep_out`."""
    was_in = node in gw.rotation()
    d = Drain(node, was_in, keep_out=not was_in)
    if was_in:
        try:
            gw.readable()
        except GatewayError as e:  # a drain that could not be confirmed is not written
            raise RunbookError(f"{node} not drained, nothing was changed: {e}") from None
        try:
            take_out(gw, node, reason, wait_s, dead=dead, deploying=deploying)
        except gateway_core.RotationRefused as e:  # nothing was changed
            raise RunbookError(f"{node} not drained, the block did not run: {e}") from None
        except BaseException as e:  # the write or the reload may have happened
            _restore_after(gw, node, e)
            raise
    if idle or (idle is None and was_in and not dead):
        try:
            d.waited_s = wait_idle(gw.fleet, gw.fleet.node(node), drained=was_in)
        except BaseException as e:
            if was_in:
                _restore_after(gw, node, e)
            raise
    try:
        yield d
    except BaseException as e:
        if was_in and not d.keep_out:
            _restore_after(gw, node, e)
        raise
    if not d.keep_out:
        put_back(gw, node)


def put_back(gw: GatewayHost, node: str) -> None:
    """Restore, unless the node was quarantined while it was out (a health sweep's policy acted
    meanwhile): the quarantine keeps it out until an operator or a healthy deploy releases it.
    Nor when this run's lease on the node ended under it: the run that holds the node now (or
    the next one) decides where it goes, and a restore from here could route to a node it is
    changing."""
    session = getattr(gw, "session", None)
    gone = lease.lost(session, node) if session is not None else None
    if gone is not None:
        session.log.warning(f"{node} is not put back in the gateway by this run: {gone.error()}")
        return
    try:
        held = ledger.quarantined(gw.session).get(node)
    except Exception:  # an unreadable record decides nothing: the drain's promise is the restore
        held = None
    if held is not None:
        gw.session.log.warning(f"{node} stays out of the gateway: quarantined while it was drained "
                               f"({held.summary()})")
        return
    admit(gw, node)


def _restore_after(gw: GatewayHost, node: str, cause: BaseException) -> None:
    """Put the node back after `cause`; a restore that fails too is told with the cause, so
    neither error hides the other."""
    try:
        put_back(gw, node)
    except Exception as e:
        if isinstance(cause, RunbookError):
            cause.description = f"{cause.description}; and putting {node} back in the gateway failed too: {e}"
            cause.args = (cause.description,)
        else:
            cause.add_note(f"putting {node} back in the gateway failed too: {e}")
