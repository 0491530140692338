"""`spark-pipelines doctor`: the health sweep for a person at a terminal. Reads, never changes.

One line per node: verdict, the evidence that decided it, the runbook's advice. `--format json`
prints {"nodes": {NAME: {"verdict", "evidence", "advice"}}}. The node's bench history (for
`regressed`) comes from the Dagster instance in DAGSTER_HOME when one is set. Exit status 0 when every node is
healthy or starting, 1 when some node needs action, 2 for bad input (one line, no traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from spark_pipelines.core import health
from spark_pipelines.core.fleet import SEED_FLEET, Fleet, FleetError, Node, load_fleet
from spark_pipelines.resources.ssh.connection import key_path_problem
from spark_pipelines.runbook import sweep

PROG = "spark-pipelines doctor"


class DoctorUsageError(Exception):
    """Bad input: one line on stderr, exit status 2."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The doctor's arguments, on its subparser of `spark_pipelines.cli`'s one parser."""
    p.add_argument("--fleet", default=os.environ.get("SPARK_FLEET", SEED_FLEET), help="fleet file")
    p.add_argument("--node", help="probe only this node")
    p.add_argument("--format", choices=["text", "json"], default="text")


def _targets(fleet: Fleet, only: str | None) -> list[Node]:
    if only is None:
        return fleet.serve_nodes
    node = fleet.node(only)  # FleetError names the known nodes
    if "serve" not in node.roles:
        raise DoctorUsageError(f"{PROG}: node {only!r} has no 'serve' role, so nothing serves there to probe; "
                               f"serve nodes: {', '.join(n.name for n in fleet.serve_nodes)}")
    return [node]


def _check_credentials(nodes: list[Node]) -> None:
    """A missing key or known_hosts file is the operator's input, not a node being down."""
    for n in nodes:
        problem = None if n.key_path is None else key_path_problem(Path(os.path.expanduser(n.key_path)))
        if problem:
            raise DoctorUsageError(f"{PROG}: node {n.name}: {problem}")
        if not Path(os.path.expanduser(n.known_hosts)).is_file():
            raise DoctorUsageError(f"{PROG}: node {n.name}: known_hosts {n.known_hosts} does not exist; add the "
                                   "node's verified host key there (ssh-keyscan -p PORT HOST >> FILE)")


def render_text(verdicts: dict[str, health.NodeVerdict]) -> str:
    width = max((len(n) for n in verdicts), default=0)
    lines = []
    for name, v in verdicts.items():
        evidence = "; ".join(v.evidence) or "no evidence"
        lines.append(f"{name:<{width}}  {v.verdict:<11}  {evidence}  -> {v.advice}")
    return "\n".join(lines)


def render_json(verdicts: dict[str, health.NodeVerdict]) -> str:
    return json.dumps({"nodes": {name: v.to_dict() for name, v in verdicts.items()}}, indent=2)


def run(fleet: Fleet, only: str | None = None, instance: Any = None) -> dict[str, health.NodeVerdict]:
    targets = _targets(fleet, only)
    _check_credentials(targets)
    from spark_pipelines.state.records import bench_histories  # the instance in DAGSTER_HOME, when set

    history = bench_histories([n.name for n in targets], instance)
    quiet = logging.getLogger("spark_pipelines.doctor")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    with sweep.open_session(fleet, logger=quiet) as s:
        reports = sweep.sweep(s, targets, bench=history)
    return {name: r.verdict for name, r in reports.items()}


def doctor_run(args: argparse.Namespace) -> int:
    """The doctor on parsed arguments (spark_pipelines.cli parses them)."""
    # paramiko reports every failed connect on stderr; the verdict already says it.
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)
    try:
        fleet = load_fleet(args.fleet)
        verdicts = run(fleet, args.node)
    except (DoctorUsageError, FleetError) as e:
        print("; ".join(line.strip() for line in str(e).splitlines() if line.strip()), file=sys.stderr)
        return 2
    print(render_json(verdicts) if args.format == "json" else render_text(verdicts))
    return health.summary_exit_status(verdicts)

