"""`spark-pipelines doctor`: the health sweep for a person at a terminal. Reads, never changes.

One line per node: verdict, the evidence that decided it, the runbook's advice, and when the node
is out of the gateway's rotation, why (the ledger beside the LiteLLM config on the gateway host:
quarantine, hold-outs by bench, deploy or rollout; or the config's drain note) and what puts it back.
`--format json` prints {"fleet_file", "nodes": {NAME: {"verdict", "evidence", "advice", "gateway":
{"in", "why_out"}}}}. The node's bench history (for `regressed`) comes from the Dagster instance:
$DAGSTER_HOME, else the demo's. Exit status 0 when every node is healthy or starting and in the
gateway, 1 when some node needs action or is held out of the gateway, 2 for bad input (one line,
no traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from spark_pipelines.core import health, steps
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.core.fleet import Fleet, FleetError, Node, load_fleet
from spark_pipelines.resources.ssh import RemoteError
from spark_pipelines.resources.ssh.connection import key_path_problem
from spark_pipelines.runbook import sweep
from spark_pipelines.state import ledger

PROG = "spark-pipelines doctor"


class DoctorUsageError(Exception):
    """Bad input: one line on stderr, exit status 2."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The doctor's arguments, on its subparser of `spark_pipelines.cli`'s one parser."""
    from spark_pipelines.cli.console import FLEET_HELP

    p.add_argument("--fleet", default=None, help=FLEET_HELP)
    p.add_argument("--node", metavar="NAME", help="probe only this serve node (default: every serve node)")
    p.add_argument("--format", choices=["text", "json"], default="text",
                   help="text for a person, json for a program (default: text)")


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


@dataclass(frozen=True)
class Doctored:
    """One node's verdict and its place in the gateway (None: the gateway could not be read)."""

    verdict: health.NodeVerdict
    in_gateway: bool | None = None
    why_out: tuple[str, ...] = ()

    @property
    def needs_action(self) -> bool:
        return self.verdict.needs_action or self.in_gateway is False

    def advice(self) -> str:
        if self.in_gateway is not False:
            return self.verdict.advice
        return f"{self.verdict.advice}; out of the gateway: {'; '.join(self.why_out)} -> {back_in(self.why_out)}"


def back_in(reasons: tuple[str, ...]) -> str:
    """What puts a node back: the strongest of its reasons decides (a quarantine's own drain note
    says "drained: health: quarantined", and only the release ends it)."""
    said = " ".join(reasons)
    if "quarantined" in said:
        return (f"once the cause is fixed, {steps.RELEASE_JOB} for the node (a healthy {steps.DEPLOY_JOB} also "
                "releases residue, crash-loop and engine-down); the next reconcile or gateway_job takes it back")
    if "held out by its bench" in said:
        return f"a {steps.BENCH_JOB} that passes its gate promotes it"
    if "held out by its deploy" in said or "held out by its rollout" in said:
        return f"a {steps.DEPLOY_JOB} that serves again lifts it"
    if said.startswith("drained"):
        return (f"its bench or deploy puts it back when it ends; {steps.RECONCILE_JOB} does after "
                "health.bench_max_s")
    return f"{steps.GATEWAY_JOB} (or {steps.RECONCILE_JOB}) puts a healthy node back"


def render_text(nodes: dict[str, Doctored]) -> str:
    width = max((len(n) for n in nodes), default=0)
    lines = []
    for name, d in nodes.items():
        evidence = "; ".join(d.verdict.evidence) or "no evidence"
        lines.append(f"{name:<{width}}  {d.verdict.verdict:<11}  {evidence}  -> {d.advice()}")
    return "\n".join(lines)


def render_json(nodes: dict[str, Doctored], fleet_file: str | None = None) -> str:
    body = {name: {**d.verdict.to_dict(), "advice": d.advice(),
                   "gateway": {"in": d.in_gateway, "why_out": list(d.why_out)}} for name, d in nodes.items()}
    return json.dumps({**({"fleet_file": fleet_file} if fleet_file else {}), "nodes": body}, indent=2)


def run(fleet: Fleet, only: str | None = None, instance: Any = None) -> dict[str, Doctored]:
    targets = _targets(fleet, only)
    _check_credentials(targets)
    from spark_pipelines.state.records import bench_histories  # the instance in DAGSTER_HOME, when set

    history = bench_histories([n.name for n in targets], instance)
    quiet = logging.getLogger("spark_pipelines.cli.doctor")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    with sweep.open_session(fleet, logger=quiet) as s:
        reports = sweep.sweep(s, targets, bench=history)
        try:  # the answer to "why is this node out?" sits on the gateway host, off the nodes
            out: dict[str, list[str]] | None = ledger.why_out(s)
        except (RunbookError, RemoteError, ValueError) as e:
            out, unread = None, first_line(e)
    if out is None:  # said in the evidence; the verdicts stand without it
        return {name: Doctored(replace(r.verdict, evidence=(*r.verdict.evidence, f"gateway not read: {unread[:200]}")))
                for name, r in reports.items()}
    return {name: Doctored(r.verdict, name not in out, tuple(out.get(name, ()))) for name, r in reports.items()}


def doctor_run(args: argparse.Namespace) -> int:
    """The doctor on parsed arguments (spark_pipelines.cli parses them)."""
    from spark_pipelines.cli.console import find_fleet, instance_home, read_hint

    # paramiko reports every failed connect on stderr; the verdict already says it.
    logging.getLogger("paramiko").setLevel(logging.CRITICAL)
    choice = find_fleet(args.fleet)
    if choice.warning:
        print(f"{PROG}: {choice.warning}", file=sys.stderr)
    home, how = instance_home()
    if home is not None and not os.environ.get("DAGSTER_HOME"):
        os.environ["DAGSTER_HOME"] = str(home)  # the demo's bench history, for `regressed`
    try:
        fleet = load_fleet(choice.path)
        nodes = run(fleet, args.node)
    except FleetError as e:
        print("; ".join(line.strip() for line in str(e).splitlines() if line.strip()), file=sys.stderr)
        return 2
    except DoctorUsageError as e:
        print(f"{e} ({read_hint(choice)})", file=sys.stderr)
        return 2
    fleet_file = str(Path(choice.path).resolve())
    if args.format == "json":
        print(render_json(nodes, fleet_file))
    else:
        print(f"# fleet file: {fleet_file} ({choice.how}); bench history: "
              + (f"{home} ({how})" if home is not None else "none (no Dagster instance: regressed is not judged)"))
        print(render_text(nodes))
    return 1 if any(d.needs_action for d in nodes.values()) else 0
