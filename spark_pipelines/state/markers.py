"""Step markers on nodes: what a heavy step last produced, and from which inputs.

A marker is written only after the step's output was verified, so "marker matches + cheap check
passes" is a safe reason to skip the heavy remote work on a rerun with unchanged pins.
"""


import hashlib
import json
from typing import Any

from spark_pipelines.core.layout import marker_path
from spark_pipelines.core.fleet import Node
from spark_pipelines.resources.ssh import FleetSession


def signature(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read(session: FleetSession, node: Node, step: str) -> dict[str, Any] | None:
    path = marker_path(node, step)
    if not session.exists(node.name, path):
        return None
    try:
        return json.loads(session.read_text(node.name, path))
    except ValueError:
        return None  # a torn marker means "not done": redo the step


def write(session: FleetSession, node: Node, step: str, sig: str, **facts: Any) -> None:
    session.put_text(node.name, marker_path(node, step), json.dumps({"signature": sig, **facts}, sort_keys=True))


def matches(session: FleetSession, node: Node, step: str, sig: str) -> dict[str, Any] | None:
    m = read(session, node, step)
    return m if m and m.get("signature") == sig else None


def clear(session: FleetSession, node: Node, step: str) -> None:
    session.run(node.name, ["rm", "-f", "--", marker_path(node, step)], log=False, timeout=60)
