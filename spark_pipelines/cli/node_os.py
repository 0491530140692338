"""Phase 0 from the terminal: what `node_os_job` would change on each node (part of `plan --live`),
and `spark-pipelines sudoers`, the exact sudoers lines Phase 0 needs on a node."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from spark_pipelines.core import node_os as p0
from spark_pipelines.core.fleet import load_fleet


@dataclass
class NodePlan:
    node: str
    changes: list[str]
    reboot: bool
    error: str | None = None

    def to_dict(self) -> dict:
        return {"node": self.node, "changes": self.changes, "reboot": self.reboot, "error": self.error}


def check(fleet_path: str, nodes: list[str] | None = None) -> list[NodePlan]:
    """Read each serve node's Phase 0 facts and plan against them; touches nothing."""
    from spark_pipelines.core.errors import RunbookError, first_line
    from spark_pipelines.resources.ssh import FleetSession, RemoteError
    from spark_pipelines.runbook import node_os

    fleet = load_fleet(fleet_path)
    choices = node_os.choices(fleet)
    out = []
    from spark_pipelines.cli.adopt import quiet_log

    with FleetSession(fleet, logger=quiet_log()) as s:
        for node in fleet.serve_nodes:
            if nodes and node.name not in nodes:
                continue
            try:
                facts = node_os.read_facts(s, node)
            except (RemoteError, RunbookError) as e:
                out.append(NodePlan(node.name, [], False, first_line(e)))
                continue
            changes = p0.plan(facts, choices)
            out.append(NodePlan(node.name, [c.line for c in changes], p0.needs_reboot(changes, facts, choices)))
    return out


def render_text(plans: list[NodePlan]) -> str:
    lines = []
    for p in plans:
        if p.error:
            lines.append(f"{p.node}: not read ({p.error})")
            continue
        head = "current" if not p.changes and not p.reboot else (
            f"{len(p.changes)} change(s)" + (", then a drained reboot" if p.reboot else ", no reboot"))
        lines.append(f"{p.node}: {head}")
        lines += [f"  {c}" for c in p.changes]
    return "\n".join(lines)


def add_sudoers_arguments(ap: argparse.ArgumentParser) -> None:
    from spark_pipelines.cli.console import FLEET_HELP

    ap.add_argument("--fleet", default=None, help=FLEET_HELP)


def sudoers_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from spark_pipelines.cli.console import find_fleet
    from spark_pipelines.runbook.node_os import choices

    choice = find_fleet(args.fleet)
    fleet = load_fleet(choice.path)
    print(f"# fleet file: {Path(choice.path).resolve()} ({choice.how})")  # a comment in sudoers too
    users = sorted({n.user for n in fleet.serve_nodes})
    for user in users:
        print(p0.sudoers_text(user, choices(fleet)), end="")
    return 0
