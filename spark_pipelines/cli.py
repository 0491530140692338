"""`spark-pipelines`: the same core as the Dagster assets, for a terminal.

plan   what a deploy would do, touching nothing
sim    the simulated GB10 fleet (up | down | status | set)
bench  the benchmark harness against any OpenAI-compatible endpoint
demo   sim up + materialize the whole chain through Dagster + per-node bench table

Bad input exits with status 2 and one clear message on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.core.memory import memory_gate
from spark_pipelines.core.fleet import Fleet, FleetError, load_fleet

DEFAULT_FLEET = "fleets/seed.yaml"


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage + exit 2; keep one clear line
        raise UsageError(f"{self.prog}: {message}")


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
            "steps": [
                "GPU state not wedged (nvidia-smi)",
                "only nvidia-persistenced holds /dev/nvidia* (fuser)",
                "earlyoom absent",
                "exporters stopped (nvidia_gpu_exporter, node_exporter)",
                "page cache flushed (sync; echo 3 > /proc/sys/vm/drop_caches)",
                "disk space in $HOME",
                "free CUDA memory >= GMU x total",
            ],
        },
        "env": spec.env,
        "mounts": [f"{h}:{c}" for h, c in spec.mounts],
        "docker_run_argv": argv,
        "docker_run": shlex.join(argv),
        "launch_fingerprint": spec.fingerprint,
    }


def build_plan(fleet: Fleet, only: str | None) -> dict[str, Any]:
    names = [only] if only else [n.name for n in fleet.serve_nodes]
    for n in names:
        fleet.node(n)  # unknown node -> FleetError naming the known ones
    config = gateway_core.render_config(fleet, [n.name for n in fleet.serve_nodes])
    return {
        "nodes": {n: node_plan(fleet, n) for n in names},
        "gateway": {
            "host": fleet.gateway.host,
            "config_path": fleet.gateway.config_path,
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
    gw = plan["gateway"]
    out.append(f"== gateway {gw['host']}: {gw['config_path']} then `{shlex.join(gw['reload_command'])}`")
    out.append(gateway_core.dump(gw["config"]).rstrip())
    return "\n".join(out)


def cmd_plan(argv: list[str]) -> int:
    ap = _Parser(prog="spark-pipelines plan", description="render what a deploy would do, touching nothing")
    ap.add_argument("--fleet", default=DEFAULT_FLEET)
    ap.add_argument("--node")
    ap.add_argument("--format", choices=["text", "json"], default="text")
    args = ap.parse_args(argv)
    fleet = load_fleet(args.fleet)
    plan = build_plan(fleet, args.node)
    print(json.dumps(plan, indent=2) if args.format == "json" else render_plan_text(plan))
    return 0


def _delegate(module: str, func: str, argv: list[str]) -> int:
    import importlib

    return int(getattr(importlib.import_module(module), func)(argv))


COMMANDS = {
    "plan": cmd_plan,
    "sim": lambda a: _delegate("spark_sim.cli", "sim_command", a),
    "bench": lambda a: _delegate("spark_pipelines.bench_client", "bench_command", a),
    "demo": lambda a: _delegate("spark_pipelines.demo", "demo_command", a),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"spark-pipelines: unknown command {cmd!r}; use one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[cmd](rest)
    except (UsageError, FleetError) as e:
        print(str(e), file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse --help
        return int(e.code or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `spark-pipelines plan | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
