"""`spark-pipelines adopt`: first contact with a fleet built by hand, from a terminal.

--check reads the live fleet and says, per node and per step, what the chain would do (current,
adopt, build, relaunch, differs, and why), touching nothing: no marker, no gateway write, no
Dagster record. Without it, `adopt_job` runs on the Dagster instance (DAGSTER_HOME, default
./.dagster-home, the one `make ui` opens): what serves as the fleet file says is recorded as
spark-pipelines' own, nothing that serves is changed, and the run shows in the UI.

The first line names the fleet file read (and the gateway key's source when it was found for the
simulated fleet); --format json carries it as "fleet_file".

Exit status: 0 when every step is current or adoptable, 1 when something differs from the fleet
file or must be built or relaunched (the chain would change it), 2 on bad input, 3 when the live
fleet could not be read (a node or the gateway did not answer: nothing was changed).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from spark_pipelines.core import adoption as core
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.pins import code_versions

READ_FAILED = 3  # exit status: the live fleet could not be read (not "the chain would change something")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from spark_pipelines.cli.console import FLEET_HELP

    p.add_argument("--fleet", default=None, help=FLEET_HELP)
    p.add_argument("--node", action="append", default=[], metavar="NAME",
                   help="a serve node to adopt (repeatable; default: every one)")
    p.add_argument("--check", action="store_true", help="say what the chain would do; change nothing")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text for a person, json for a program (default: text)")


def quiet_log() -> logging.Logger:
    """The session's log for a terminal check: its connect retries and warnings are not the answer
    (the findings are, or one line saying what could not be read)."""
    log = logging.getLogger("spark_pipelines.check")
    if not log.handlers:
        log.addHandler(logging.NullHandler())
    log.propagate = False
    return log


class Unreachable(Exception):
    """The live fleet could not be read: one line naming the node and the fix (exit READ_FAILED)."""


def check(fleet_path: str, nodes: list[str] | None = None) -> list[core.Finding]:
    """What the chain would do against the live fleet, touching nothing (also `plan --live`)."""
    from spark_pipelines.core.errors import RunbookError, first_line
    from spark_pipelines.resources.gateway import GatewayHost
    from spark_pipelines.resources.ssh import FleetSession, RemoteError
    from spark_pipelines.runbook.adoption import adopt_fleet

    fleet = load_fleet(fleet_path)
    try:
        with FleetSession(fleet, logger=quiet_log()) as s:
            return adopt_fleet(s, code_versions(fleet), check=True, nodes=nodes or None, gw=GatewayHost(s))
    except (RemoteError, RunbookError) as e:
        raise Unreachable(f"the live fleet could not be read: {first_line(e).partition(': ')[2] or first_line(e)}; "
                          f"nothing was changed") from None


def adopt(fleet_path: str, nodes: list[str] | None = None) -> tuple[bool, list[core.Finding], str]:
    """adopt_job on the instance: (run succeeded, findings, the run's id or failure)."""
    import dagster as dg

    from spark_pipelines.core import steps
    from spark_pipelines.definitions import build_definitions
    from spark_pipelines.cli.demo import prepare_instance_home

    prepare_instance_home()
    with dg.DagsterInstance.get() as instance:
        job = build_definitions(fleet_path).resolve_job_def(steps.ADOPT_JOB)
        res = job.execute_in_process(instance=instance, raise_on_error=False, run_config={
            "ops": {steps.FLEET_ADOPTION: {"config": {"check": False, "nodes": list(nodes or [])}}}})
        findings: list[core.Finding] = []
        for e in res.all_events:
            if e.event_type_value == "ASSET_MATERIALIZATION":
                m = e.event_specific_data.materialization
                if m.asset_key.to_user_string() == steps.FLEET_ADOPTION:
                    findings = [core.Finding(r["node"], r["step"], r["action"], r["why"],
                                             tuple(d for d in r["differences"].split("; ") if d))
                                for r in (row.data for row in m.metadata["findings"].value.records)]
        failure = "; ".join(e.step_failure_data.user_failure_data.description if e.step_failure_data.user_failure_data
                            else (e.step_failure_data.error.message.splitlines() or ["failed"])[0]
                            for e in res.all_events if e.is_step_failure)
        return res.success, findings, failure or f"run {res.run_id} on {instance.root_directory}"


def needs_action(findings: list[core.Finding]) -> bool:
    return any(f.action in (core.BUILD, core.RELAUNCH, core.DIFFERS) for f in findings)


def adopt_run(args: argparse.Namespace) -> int:
    from spark_pipelines.cli.console import demo_gateway_key, find_fleet, read_hint

    logging.getLogger("paramiko").setLevel(logging.CRITICAL)
    choice = find_fleet(args.fleet)
    if choice.warning:
        print(f"spark-pipelines adopt: {choice.warning}", file=sys.stderr)
    fleet = load_fleet(choice.path)  # a bad fleet file is one line (FleetError, exit 2) before anything is read
    key = demo_gateway_key(choice.path, fleet.gateway.master_key_env)
    if args.check:
        try:
            findings, ok, where = check(choice.path, args.node), True, "check: nothing was changed"
        except Unreachable as e:
            print(f"spark-pipelines adopt: {e} ({read_hint(choice)})", file=sys.stderr)
            return READ_FAILED
    else:
        ok, findings, where = adopt(choice.path, args.node)
    out: dict[str, Any] = {"fleet_file": str(Path(choice.path).resolve()), "ok": ok, "where": where,
                           "summary": core.summary(findings), "findings": [f.to_dict() for f in findings]}
    if args.format == "json":
        print(json.dumps(out, indent=2))
    else:
        print(f"# fleet file: {out['fleet_file']} ({choice.how})")
        if key:
            print(f"# gateway key: {key}")
        print(core.render_text(findings))
        print(f"\n{'adopt --check' if args.check else 'adopt'}: "
              + ", ".join(f"{a} {n}" for a, n in out["summary"].items()) + f" ({where})")
    if not ok:
        print(f"spark-pipelines adopt: {where}", file=sys.stderr)
        return 1
    return 1 if needs_action(findings) else 0
