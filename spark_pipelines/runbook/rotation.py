"""Who is in the gateway's rotation, and taking one node out for a while.

`drained(gw, node)` is the drain / try / restore block of the bench and the experiment: the node
leaves every pool, and is put back in every outcome unless the body decides to keep it out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook import engine, markers

BENCH_GATE = "bench_gate"  # marker the bench step leaves on a node: promoted or held out, and why


def promotion(s: FleetSession) -> tuple[list[str], dict[str, str]]:
    """Nodes to put in rotation, and the reason each other node is left out."""
    f = s.fleet
    rotation: list[str] = []
    out: dict[str, str] = {}
    for node in f.serve_nodes:
        if not engine.healthy(f, node):
            out[node.name] = "vLLM /health does not answer"
            continue
        gate = markers.read(s, node, BENCH_GATE)
        if gate and not gate.get("promoted", True):
            out[node.name] = gate.get("reason", "held out by its last bench")
            continue
        rotation.append(node.name)
    return rotation, out


@dataclass
class Drain:
    node: str
    was_in: bool
    # After a clean exit the node is put back unless keep_out. It starts as "where it was": a
    # node that was out stays out, unless the body clears it (a bench that promotes it).
    keep_out: bool = False


@contextmanager
def drained(gw: GatewayHost, node: str) -> Iterator[Drain]:
    """Take `node` out of every pool for the block. On an exception it goes back where it was
    (the drain itself may be what failed); after a clean exit it goes back unless `keep_out`."""
    was_in = node in gw.rotation()
    d = Drain(node, was_in, keep_out=not was_in)
    try:
        if was_in:
            gw.drain(node)
        yield d
    except BaseException:
        if was_in:
            gw.restore(node)
        raise
    if not d.keep_out:
        gw.restore(node)
