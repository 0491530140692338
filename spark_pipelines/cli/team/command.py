"""`spark-pipelines team up | down | status`: the team instance on this machine.

up      PostgreSQL, the Dagster daemon and UI (http://127.0.0.1:3000 unless --port), the code location
        in its image, every run in its own container, all on loopback; returns once the UI answers
down    stops the processes and run containers; the database (runs, history) is kept
status  what runs, where, and the UI's address

The state lives under --root (default $SPARK_TEAM_ROOT or /var/lib/spark-pipelines/team). Needs root
for the team's own dockerd, unless DOCKER_HOST names an engine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from spark_pipelines.cli.console import ConsoleError
from spark_pipelines.cli.team.engine import EngineError
from spark_pipelines.cli.team.instance import WEB_PORT, Team, default_root
from spark_pipelines.cli.team.postgres import PostgresError
from spark_pipelines.resources.rootfs import RootfsError


def default_fleet() -> str:
    """The fleet file every command finds (spark_pipelines.cli.demo.find_fleet): $SPARK_FLEET, the
    demo's, a simulated fleet's file here, the runbook's."""
    from spark_pipelines.cli.console import find_fleet

    choice = find_fleet(None)
    print(f"spark-pipelines team: fleet file {choice.named()}", file=sys.stderr)
    return choice.path


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("action", choices=("up", "down", "status"), help="up | down | status (see above)")
    ap.add_argument("--fleet", default=None, help="fleet file (default: $SPARK_FLEET, else the demo's recorded one "
                                                  "while it exists, else sim-fleet.yaml here, else fleets/seed.yaml)")
    ap.add_argument("--root", default=None, help=f"the team's state (default: ${'{'}SPARK_TEAM_ROOT{'}'} or {default_root()})")
    ap.add_argument("--port", type=int, default=WEB_PORT, help=f"the UI's port on 127.0.0.1 (default {WEB_PORT})")


def team_command(args: argparse.Namespace) -> int:
    team = Team(Path(args.root) if args.root else default_root(), web_port=args.port)
    try:
        if args.action == "up":
            if os.geteuid() != 0 and not os.environ.get("DOCKER_HOST"):
                print("spark-pipelines team up: the team's own dockerd needs root (or set DOCKER_HOST)", file=sys.stderr)
                return 2
            team.up(args.fleet or default_fleet())
        elif args.action == "down":
            team.down()
        else:
            state = team.state()
            print(json.dumps({k: state.get(k) for k in ("url", "image", "image_size_bytes", "fleet", "pg_port")}
                             | {"postgres_running": team.postgres.running()},
                             indent=1))
    except (PostgresError, EngineError, RootfsError, ConsoleError) as e:
        hint = "; `make team-down` stops whatever did start" if args.action == "up" else ""
        print(f"spark-pipelines team {args.action}: {e}{hint}", file=sys.stderr)
        return 1
    return 0
