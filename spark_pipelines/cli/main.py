"""`spark-pipelines`: the same core as the Dagster assets, for a terminal.

Usage: spark-pipelines COMMAND [options]   (spark-pipelines COMMAND --help; --version)

plan   what a deploy would do, touching nothing (--live: what the chain would do to the live fleet)
adopt  first contact with a fleet built by hand: adopt what serves, change nothing (--check: only say)
sim    the simulated GB10 fleet (up | down | status | set)
bench  the benchmark harness against any OpenAI-compatible endpoint
demo   sim up + materialize the whole chain through Dagster + per-node bench table
doctor the health sweep: one verdict per node with its evidence and the runbook's advice (read-only)
sudoers the exact sudoers lines Phase 0 (node_os_job) needs on each node
gateway-front the nginx site of the gateway's front before LiteLLM (fleet file gateway.front)
metrics the fleet exporter for Prometheus (serve | show) and its targets + alert rules (scrape-config)
team   the team instance here: PostgreSQL, Dagster daemon + UI, each run in a container (up | down | status)

Bad input exits with status 2 and one clear message on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shlex
import sys
import textwrap
from pathlib import Path
from typing import Any, NoReturn

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core import rollout as rollout_core
from spark_pipelines.core import preflight
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.core.memory import memory_gate
from spark_pipelines.core.fleet import Fleet, FleetError, NodePair, load_fleet
from spark_pipelines.core import pair as pair_core
from spark_pipelines.core.pair_launch import pair_launch



class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


class Help(argparse.HelpFormatter):
    """Descriptions read as written: a paragraph of prose is re-wrapped to the terminal; a table (a
    docstring's list of commands: an entry, two spaces, what it does, continued on indented lines)
    keeps one entry per line, its text wrapped under its column."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        def wrap(words: str, first: str, rest: str) -> list[str]:
            return textwrap.wrap(words, width, initial_indent=indent + first, subsequent_indent=indent + rest,
                                 break_on_hyphens=False)

        out: list[str] = []
        for para in re.split(r"\n\s*\n", text.strip("\n")):
            lines = para.splitlines()
            margin = min(len(line) - len(line.lstrip()) for line in lines)
            if all(len(line) - len(line.lstrip()) == margin for line in lines) and \
                    not any(re.search(r"\S  +\S", line) for line in lines):
                out += wrap(" ".join(line.strip() for line in lines), " " * margin, " " * margin)
                out.append("")
                continue
            entries: list[list[str]] = []
            for line in lines:  # an entry starts at the paragraph's margin; deeper lines continue it
                if len(line) - len(line.lstrip()) == margin or not entries:
                    entries.append([line])
                else:
                    entries[-1].append(line)
            for head, *more in entries:
                gap = re.search(r"\S  +(?=\S)", head)
                column = gap.end() if gap else (len(more[0]) - len(more[0].lstrip()) if more else margin + 4)
                hang = " " * min(column, width // 3)
                said = " ".join(m.strip() for m in more)
                if gap and gap.end() <= width // 3:
                    out += wrap(f"{head[:gap.end()]}{head[gap.end():]} {said}".rstrip(), "", hang)
                    continue
                out += wrap(head[:gap.end()].rstrip() if gap else head.rstrip(), "", " " * (margin + 4))
                said = f"{head[gap.end():]} {said}".strip() if gap else said
                if said:
                    out += wrap(said, hang, hang)
            out.append("")
        return "\n".join(out).rstrip("\n")


def _did_you_mean(word: str, known: list[str]) -> str:
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    return f": did you mean {close[0]}?" if close else ""


class Parser(argparse.ArgumentParser):
    """The parser of every subcommand (subparsers inherit the class): argparse would print its usage
    and exit 2 itself; this keeps bad input to one clear line, with the nearest name when one is close
    (Python 3.11's argparse has no suggest_on_error)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", Help)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        bad = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if bad:
            message += _did_you_mean(bad.group(1), re.findall(r"'([^']*)'", bad.group(2)))
        raise UsageError(f"{self.prog}: {message}")


def chosen(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The innermost (sub)parser `argv` selects: `metrics serve ...` -> the serve parser."""
    p = ap
    while True:
        subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        nxt = next((subs[0].choices[w] for w in argv if subs and w in subs[0].choices), None)
        if nxt is None:
            return p
        p, argv = nxt, argv[argv.index(next(w for w in argv if w in subs[0].choices)) + 1:]


def unrecognized(ap: argparse.ArgumentParser, argv: list[str], extra: list[str]) -> str:
    """One line for arguments no parser took, naming the nearest option of the command given."""
    p = chosen(ap, argv)
    known = [o for a in p._actions for o in a.option_strings if o.startswith("--")]
    word = extra[0].split("=", 1)[0]
    hint = _did_you_mean(word, known) if word.startswith("-") else ""
    return f"{p.prog}: unrecognized argument{'s' if len(extra) > 1 else ''}: {' '.join(extra)}{hint}"


def node_plan(fleet: Fleet, name: str) -> dict[str, Any]:
    node = fleet.node(name)
    profile = fleet.profile_of(node)
    launch = fleet.launch_for(node)
    spec = launch_spec(fleet, node, launch)
    gate = memory_gate(profile.clean_boot_free_gib, profile.cuda_total_gib, launch.gpu_memory_utilization, profile.max_gmu)
    argv = spec.docker_run_argv()
    return {
        "host": node.host,
        "hardware": profile.name,
        "roles": list(node.roles),
        "preflight": {
            "cuda_total_gib": profile.cuda_total_gib,
            "gpu_memory_utilization": launch.gpu_memory_utilization,
            "max_gmu": profile.max_gmu,
            "required_gib": gate.required_gib,
            "expected_free_gib": profile.clean_boot_free_gib,
            "expected_margin_gib": gate.margin_gib,
            "verdict": gate.verdict,
            "advice": gate.advice,
            "note": "expected clean-boot figures; the deploy measures free memory in a fresh container "
            "(nvidia-smi reports no memory on GB10)",
            "steps": [what for _, what in preflight.CHECKS],
        },
        "env": spec.env,
        "mounts": [f"{h}:{c}" for h, c in spec.mounts],
        "docker_run_argv": argv,
        "docker_run": shlex.join(argv),
        "launch_fingerprint": spec.fingerprint,
    }


def pair_plan(fleet: Fleet, pair: NodePair) -> dict[str, Any]:
    """A node pair (Phase 4-alt): on or off and why, and its two launches in launch order."""
    out: dict[str, Any] = {"head": pair.head, "worker": pair.worker, "enabled": pair.enabled, "reason": pair.reason,
                           "link": pair.link.model_dump() if pair.link else None, "master_port": pair.master_port,
                           "preflight": [what for _, what in pair_core.CHECKS]}
    if {pair.head, pair.worker} <= set(fleet.node_names):  # an off pair may name nodes this fleet left out
        launch = pair_launch(fleet, pair)
        out["launch"] = [{"node": spec.node, "rank": 1 if spec is launch.worker else 0,
                          "docker_run_argv": spec.docker_run_argv(), "docker_run": shlex.join(spec.docker_run_argv())}
                         for spec in launch.specs]
    return out


def render_pair_text(name: str, p: dict[str, Any]) -> list[str]:
    state = "ON" if p["enabled"] else f"OFF: {p['reason'] or 'enabled: false'}"
    out = [f"== node pair {name} (Phase 4-alt, TP=2): {p['head']} head (rank 0) + {p['worker']} worker (rank 1): {state}"]
    link = p["link"]
    if link:
        out.append(f"link: {link['head_address']} ({p['head']}) <-> {link['worker_address']} ({p['worker']}), "
                   f"MTU {link['mtu']}, master port {p['master_port']}")
    else:
        out.append("link: none; to turn it on, add link: {head_address, worker_address, mtu} and enabled: true")
    if p["enabled"]:
        out.append(f"gateway: one backend, {p['head']}; {p['worker']} runs headless, out of the rotation")
    out.append("preflight of the pair:")
    out += [f"  {what}" for what in p["preflight"]]
    if "launch" in p:
        out.append("launch" + (" once on" if not p["enabled"] else "") + " (worker first, the head after its "
                   "headless milestone):")
        out += [f"  {x['node']} (rank {x['rank']}): {x['docker_run']}" for x in p["launch"]]
    out.append("")
    return out


def build_plan(fleet: Fleet, only: str | None) -> dict[str, Any]:
    names = [only] if only else [n.name for n in fleet.serve_nodes]
    for n in names:
        fleet.node(n)  # unknown node -> FleetError naming the known ones
    serving = [n.name for n in fleet.serve_nodes]
    config = gateway_core.render_config(fleet, serving)
    try:  # as if every serve node were in the gateway: the live rotation is read when it starts
        waves = rollout_core.plan_waves(serving, in_rotation=serving, max_unavailable=fleet.rollout.max_unavailable,
                                        min_in_rotation=fleet.gateway.min_in_rotation, canary=fleet.rollout.canary)
        rollout = {"waves": [list(w.nodes) for w in waves.waves], "text": waves.text()}
    except rollout_core.RolloutRefused as e:
        rollout = {"waves": [], "text": f"refused: {e}"}
    return {
        "nodes": {n: node_plan(fleet, n) for n in names},
        "pairs": {p.name: pair_plan(fleet, p) for p in fleet.pairs if not only or only in (p.head, p.worker)},
        "rollout": rollout,
        "gateway": {
            "host": fleet.gateway.host,
            "config_path": fleet.gateway.config_path,
            "reload": fleet.gateway.reload,
            "reload_command": list(fleet.gateway.reload_command),
            "config": config,
        },
    }


def render_plan_text(plan: dict[str, Any]) -> str:
    out: list[str] = []
    for name, p in plan["nodes"].items():
        pf = p["preflight"]
        out.append(f"== node {name} ({p['hardware']}, {', '.join(p['roles'])}) @ {p['host']}")
        out.append(
            f"preflight: GMU {pf['gpu_memory_utilization']:g} x {pf['cuda_total_gib']} GiB = {pf['required_gib']:.2f} GiB "
            f"needed; clean boot frees ~{pf['expected_free_gib']} GiB (margin {pf['expected_margin_gib']:+.2f}): {pf['verdict']}"
        )
        for a in pf["advice"]:
            out.append(f"  advice: {a}")
        out.append("env:")
        out += [f"  {k}={v}" for k, v in p["env"].items()]
        out.append("launch:")
        out.append("  " + p["docker_run"])
        out.append("")
    for name, p in plan.get("pairs", {}).items():
        out += render_pair_text(name, p)
    out.append("== rollout of a new image, checkpoint or launch profile (rollout_job)")
    out += ["  " + line for line in plan["rollout"]["text"].splitlines()]
    out.append("  each node: deploy (previous version kept) -> health -> bench vs floors and the fleet's baseline; "
               "the first failed gate stops the rollout and puts that node back")
    out.append("")
    gw = plan["gateway"]
    how = ("graceful: streams in flight finish" if gw["reload"] == "graceful"
           else "restart: drops every stream in flight")
    out.append(f"== gateway {gw['host']}: {gw['config_path']} then `{shlex.join(gw['reload_command'])}` ({how})")
    out.append(gateway_core.dump(gw["config"]).rstrip())
    return "\n".join(out)


PLAN_DESCRIPTION = ("Render what a deploy of the fleet file would do, touching nothing: per node the preflight "
                    "checks and the memory gate, the docker run argv, the rollout's order, the gateway config. "
                    "The first line names the fleet file read and why that one. Exit status: 0; 2 on bad input "
                    "(a refused fleet file: one line naming the field); with --live, 3 when the live fleet "
                    "could not be read (nothing was changed).")


def add_plan_arguments(ap: argparse.ArgumentParser) -> None:
    from spark_pipelines.cli.console import FLEET_HELP

    ap.add_argument("--fleet", default=None, help=FLEET_HELP)
    ap.add_argument("--node", metavar="NAME", help="one serve node (default: every serve node)")
    ap.add_argument("--live", action="store_true",
                    help="also read the live fleet and say per node and step what the chain would do "
                         "(skip / adopt / build / relaunch / differs, and why); reads only")
    ap.add_argument("--format", choices=["text", "json"], default="text",
                    help="text for a person, json for a program (default: text)")


def cmd_plan(args: argparse.Namespace) -> int:
    from spark_pipelines.cli.console import demo_gateway_key, find_fleet, read_hint

    choice = find_fleet(args.fleet)
    if choice.warning:
        print(f"spark-pipelines plan: {choice.warning}", file=sys.stderr)
    fleet = load_fleet(choice.path)
    plan = build_plan(fleet, args.node)
    live = phase0 = None
    key = None
    if args.live:
        from spark_pipelines.cli import adopt as adopt_command, node_os as node_os_command

        key = demo_gateway_key(choice.path, fleet.gateway.master_key_env)
        try:
            live = adopt_command.check(choice.path, [args.node] if args.node else None)
        except adopt_command.Unreachable as e:
            print(f"spark-pipelines plan --live: {e} ({read_hint(choice)})", file=sys.stderr)
            return adopt_command.READ_FAILED
        phase0 = node_os_command.check(choice.path, [args.node] if args.node else None)
    if args.format == "json":
        plan = {"fleet_file": str(Path(choice.path).resolve()), **plan}
        if live is not None:
            plan["live"] = [f.to_dict() for f in live]
        if phase0 is not None:
            plan["node_os"] = [p.to_dict() for p in phase0]
        print(json.dumps(plan, indent=2))
    else:
        print(f"# fleet file: {Path(choice.path).resolve()} ({choice.how})")
        if key:
            print(f"# gateway key: {key}")
        print(render_plan_text(plan))
        if live is not None:
            from spark_pipelines.core.adoption import render_text

            print("\n== live: what the chain would do to the fleet as it runs now (nothing was changed)")
            print(render_text(live))
        if phase0 is not None:
            from spark_pipelines.cli.node_os import render_text as phase0_text

            print("\n== Phase 0 (node_os_job): what it would change on each node (nothing was changed)")
            print(phase0_text(phase0))
    return 0


def cmd_metrics(args: argparse.Namespace) -> int:
    """`metrics`: the fleet file and the instance found as every command finds them, named on stderr
    (stdout is the metrics themselves)."""
    from spark_pipelines.cli import metrics as metrics_command
    from spark_pipelines.cli.console import find_fleet, instance_home

    choice = find_fleet(args.fleet)
    args.fleet = choice.path
    print(f"metrics: fleet file {choice.named()}", file=sys.stderr)
    if choice.warning:
        print(f"metrics: {choice.warning}", file=sys.stderr)
    if args.what != "scrape-config":
        home, how = instance_home()
        if home is None:
            print(f"metrics: {how}", file=sys.stderr)
            return 2
        os.environ["DAGSTER_HOME"] = str(home)
        print(f"metrics: Dagster instance {home} ({how})", file=sys.stderr)
    return metrics_command.metrics_run(args)


def version() -> str:
    """The installed distribution's version (pyproject's [project] version)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("spark-pipelines")
    except PackageNotFoundError:
        return "unknown (not installed: scripts/bootstrap.sh base)"


def _delegate(module: str, func: str, argv: list[str]) -> int:
    import importlib

    return int(getattr(importlib.import_module(module), func)(argv))


# Commands that parse their own arguments (the simulator is a harness beside the product).
DELEGATED = {
    "sim": lambda a: _delegate("spark_sim.cli", "sim_command", a),
}


def parser() -> Parser:
    """The one argument parser: a subparser per command, each module adding its own arguments."""
    from spark_pipelines.cli import adopt as adopt_command, bench as bench_command, demo, doctor, metrics as metrics_command, node_os as node_os_command
    from spark_pipelines.cli.team import command as team_command

    ap = Parser(prog="spark-pipelines", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="command")
    plan = sub.add_parser("plan", help="what a deploy would do", description=PLAN_DESCRIPTION)
    add_plan_arguments(plan)
    plan.set_defaults(run=cmd_plan)
    adopt = sub.add_parser("adopt", help="first contact: adopt a fleet built by hand, change nothing",
                           description=adopt_command.__doc__)
    adopt_command.add_arguments(adopt)
    adopt.set_defaults(run=adopt_command.adopt_run)
    bench = sub.add_parser("bench", help="the bench harness", description="Run the runbook's bench suite.")
    bench_command.add_arguments(bench)
    bench.set_defaults(run=bench_command.bench_run)
    dem = sub.add_parser("demo", help="sim up + the whole chain", description=demo.__doc__)
    demo.add_arguments(dem)
    dem.set_defaults(run=demo.demo_command)
    doc = sub.add_parser("doctor", help="the health sweep: one verdict per node, read-only",
                         description=doctor.__doc__)
    doctor.add_arguments(doc)
    doc.set_defaults(run=doctor.doctor_run)
    sudoers = sub.add_parser("sudoers", help="the exact sudoers lines Phase 0 (node_os_job) needs on a node",
                             description=node_os_command.__doc__)
    node_os_command.add_sudoers_arguments(sudoers)
    sudoers.set_defaults(run=node_os_command.sudoers_run)
    front = sub.add_parser("gateway-front", help="the nginx site of the gateway's front (gateway.front)",
                           description="Print the nginx site of the gateway's front: clients on gateway.proxy_port, "
                                       "LiteLLM behind it on 127.0.0.1:gateway.front.litellm_port (put it in "
                                       "/etc/nginx/conf.d/ on the gateway host; core/gateway_front.py says why).")
    from spark_pipelines.cli.console import FLEET_HELP

    front.add_argument("--fleet", default=None, help=FLEET_HELP)
    front.set_defaults(run=cmd_gateway_front)
    met = sub.add_parser("metrics", help="the fleet exporter for Prometheus, its scrape config and alert rules",
                         description=metrics_command.__doc__)
    metrics_command.add_arguments(met)
    met.set_defaults(run=cmd_metrics)
    team = sub.add_parser("team", help="the team instance: PostgreSQL, daemon, runs in containers",
                          description=team_command.__doc__)
    team_command.add_arguments(team)
    team.set_defaults(run=team_command.team_command)
    for name in DELEGATED:
        sub.add_parser(name, help="see `spark-pipelines sim --help`", add_help=False)
    return ap


def cmd_gateway_front(args: argparse.Namespace) -> int:
    from spark_pipelines.core.gateway_front import nginx_site

    from spark_pipelines.cli.console import find_fleet

    args.fleet = find_fleet(args.fleet).path
    fleet = load_fleet(args.fleet)
    gw = fleet.gateway
    if gw.front is None:
        raise UsageError(f"{args.fleet}: gateway.front is not set (LiteLLM itself on port {gw.proxy_port}); add "
                         "`front: {litellm_port: 4001}` under gateway and move LiteLLM to 127.0.0.1:4001")
    print(nginx_site(proxy_port=gw.proxy_port, litellm_port=gw.front.litellm_port,
                     idle_timeout_s=gw.front.idle_timeout_s, source=args.fleet), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"spark-pipelines {version()}")
        return 0
    try:
        if argv[0] in DELEGATED:
            return DELEGATED[argv[0]](argv[1:])
        ap = parser()
        args, extra = ap.parse_known_args(argv)
        if extra:
            raise UsageError(unrecognized(ap, argv, extra))
        return int(args.run(args))
    except (UsageError, FleetError) as e:
        print(str(e), file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse --help
        return int(e.code or 0)
    except KeyboardInterrupt:  # before the command's own handler (still importing): the same line
        print(f"spark-pipelines {argv[0]}: interrupted" if argv[0].isidentifier() else "interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `spark-pipelines plan | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0

