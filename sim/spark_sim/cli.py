"""`spark-pipelines sim up|down|status|set|power|os|hand`: the simulated fleet's command line."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from spark_pipelines.core.fleet import FleetError
from spark_sim import base_image, node_os, power
from spark_sim.fleet import SimFleet
from spark_sim.layout import DEFAULT_FLEET_OUT, DEFAULT_TOKENS_PER_SECOND, GPU_STATES, MAX_NODES, SimError


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="spark-pipelines sim", description="the simulated GB10 fleet")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    up = sub.add_parser("up", help="start the simulated nodes and write a fleet file for them")
    up.add_argument("--nodes", type=int, default=2,
                    help=f"number of nodes, 1-{MAX_NODES} (spark1 founders+build, spark2.. gx10)")
    up.add_argument("--fleet-out", default=DEFAULT_FLEET_OUT, help="fleet file to write (default: sim-fleet.yaml)")
    up.add_argument("--tokens-per-second", type=float, default=DEFAULT_TOKENS_PER_SECOND,
                    help="stand-in engine's single-stream rate on a healthy node (default 52, the runbook's)")
    up.add_argument("--link-mbit", type=float, default=None,
                    help="rate-limit every node's link to this many Mbit/s each way (tc; default: unlimited)")
    sub.add_parser("down", help="remove every process, namespace, user and file the sim made")
    sub.add_parser("status", help="show each node's namespace, sshd, dockerd, GPU state and containers")
    st = sub.add_parser("set", help="set a node's simulated GPU state")
    st.add_argument("node")
    st.add_argument("state", help=" | ".join(GPU_STATES))
    pw = sub.add_parser("power", help="AC at the wall of a node (the sim's smart plug): off, or on (boot)")
    pw.add_argument("node")
    pw.add_argument("action", help="off | on")
    pw.add_argument("--keep-wedged", action="store_true", help="on: the wedge survives the drain (WEDGE PERSISTS)")
    os_ = sub.add_parser("os", help="a node's OS (runbook Phase 0): fresh (DGX OS out of the box), show (JSON), "
                                    "reboot-hangs on|off, boot-delay SECONDS")
    os_.add_argument("node")
    os_.add_argument("action", help=" | ".join(node_os.OS_ACTIONS))
    os_.add_argument("value", nargs="?", help="reboot-hangs: on|off; boot-delay: seconds")
    hd = sub.add_parser("hand", help="build the fleet that is up by hand, with the runbook's own commands "
                                     "(no spark-pipelines marker, label or manifest)")
    hd.add_argument("--quick-relaunch", action="append", default=[], metavar="NODE",
                    help="launch NODE with the runbook's base64 quick-relaunch script (only MAX_JOBS and "
                         "FLASHINFER_NVCC_THREADS; a GX10 tolerates it)")
    hd.add_argument("--gmu", action="append", default=[], metavar="NODE=VALUE",
                    help="launch NODE with another --gpu-memory-utilization, e.g. spark2=0.80")
    return p


def _print_status(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("no simulated fleet is up (run `spark-pipelines sim up`)")
        return
    for r in rows:
        parts = [
            f"{r['name']:<9}", f"{r['ip']:<12}",
            f"netns {r['netns']} {'up' if r['netns_up'] else 'MISSING'}",
            f"sshd {r['sshd_pid'] or '-'} {'alive' if r['sshd_alive'] else 'DEAD'}",
        ]
        if "dockerd_alive" in r:
            gpu = r["gpu"] or {}
            parts += [
                f"dockerd {'alive' if r['dockerd_alive'] else 'DEAD'}",
                f"gpu {gpu.get('state', '?')} ({gpu.get('profile', '?')})",
                f"containers: {'; '.join(r['containers']) or 'none'}",
            ]
        elif "litellm_alive" in r:
            parts.append(f"litellm {r['litellm_pid']} alive" if r["litellm_alive"] else "litellm not running")
        print("  ".join(parts))


def sim_command(argv: list[str]) -> int:
    """`spark-pipelines sim up [--nodes N] [--fleet-out FILE] | down | status | set NODE STATE | power NODE off|on
    | os NODE fresh|show|reboot-hangs on|off|boot-delay SECONDS | hand [--quick-relaunch NODE] [--gmu NODE=VALUE]`."""
    try:
        args = _parser().parse_args(argv)
    except _UsageError as e:
        print(f"spark-pipelines sim: {e}", file=sys.stderr)
        return 2
    try:
        if args.cmd == "set" and args.state not in GPU_STATES:
            print(f"spark-pipelines sim set: unknown GPU state {args.state!r}; use one of {', '.join(GPU_STATES)}",
                  file=sys.stderr)
            return 2
        fleet = SimFleet()
        if args.cmd == "up":
            if not 1 <= args.nodes <= MAX_NODES:
                print(f"spark-pipelines sim up: --nodes {args.nodes}: choose between 1 and {MAX_NODES}", file=sys.stderr)
                return 2
            t0 = time.monotonic()
            path = fleet.up(args.nodes, args.fleet_out, args.tokens_per_second, args.link_mbit)
            print(f"simulated fleet up: {args.nodes} nodes in {time.monotonic() - t0:.1f} s under {fleet.layout.root}")
            _print_status(fleet.status())
            print(f"fleet file: {path}")
        elif args.cmd == "down":
            for line in fleet.down():
                print(line)
            print("simulated fleet down")
        elif args.cmd == "hand":
            from spark_sim.hand import build_by_hand

            if not fleet.state:
                print("spark-pipelines sim hand: no simulated fleet is up (run `spark-pipelines sim up`)", file=sys.stderr)
                return 2
            gmu: dict[str, float] = {}
            for item in args.gmu:
                name, sep, value = item.partition("=")
                try:
                    gmu[name] = float(value)
                except ValueError:
                    sep = ""
                if not sep or not 0 < gmu[name] <= 1:
                    print(f"spark-pipelines sim hand: --gmu {item!r}: give NODE=VALUE with 0 < VALUE <= 1",
                          file=sys.stderr)
                    return 2
            t0 = time.monotonic()
            done = build_by_hand(fleet, quick_relaunch=args.quick_relaunch, gmu=gmu, log=print)
            print(f"built by hand in {time.monotonic() - t0:.1f} s: serving image {done.image_id[7:19]} on "
                  f"{', '.join(done.containers)}; gateway config {done.gateway_config}")
        elif args.cmd == "status":
            _print_status(fleet.status())
        elif args.cmd == "power":
            if args.action not in ("off", "on"):
                print(f"spark-pipelines sim power: unknown action {args.action!r}; use off or on", file=sys.stderr)
                return 2
            if not fleet.state:
                print("spark-pipelines sim power: no simulated fleet is up (run `spark-pipelines sim up`)", file=sys.stderr)
                return 2
            print(power.command(fleet, args.node, args.action, args.keep_wedged))
        elif args.cmd == "os":
            bad = node_os.bad_input(args.action, args.value)
            if bad:
                print(f"spark-pipelines sim os: {bad}", file=sys.stderr)
                return 2
            if not fleet.state:
                print("spark-pipelines sim os: no simulated fleet is up (run `spark-pipelines sim up`)", file=sys.stderr)
                return 2
            print(node_os.command(fleet, args.node, args.action, args.value))
        elif args.cmd == "set":
            if not fleet.state:
                print("spark-pipelines sim set: no simulated fleet is up (run `spark-pipelines sim up`)", file=sys.stderr)
                return 2
            try:
                fleet.node(args.node)
            except SimError as e:
                print(f"spark-pipelines sim set: {e}", file=sys.stderr)
                return 2
            refreshed = fleet.set_gpu(args.node, args.state)
            print(f"{args.node}: GPU state {args.state}" + (f" (refreshed {len(refreshed)} running containers)" if refreshed else ""))
        return 0
    except (SimError, FleetError, base_image.BaseImageError) as e:
        print(f"spark-pipelines sim {args.cmd}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(sim_command(sys.argv[1:]))
