"""A seeded chaos soak of a simulated fleet under client traffic (issue 37; spark_sim/soak.py).

    .venv/bin/python benchmarks/soak.py [--nodes 4] [--minutes 60] [--seed 1] [--tick 15] [--out docs/soak]

Brings up a simulated fleet (SPARK_SIM_SLOT / SPARK_SIM_ROOT, default slot 26,
/var/lib/spark-sim-soak-26; the stand-in at 1000 tok/s so a bench takes seconds), runs the chain on
a throwaway Dagster instance (build, deploy each node, gateway, bench each node), then soaks for
--minutes: the node_health, wedge_watch and pins_changed sensors ticking every --tick seconds with
the fleet file's budgets and their runs executed, clients streaming through the gateway, a fault
from the catalogue every --gap seconds (seeded), an operator action (rollout, bench, fleet-file
edit and reload) every --every seconds. Writes <out>/soak-<nodes>n-<minutes>m-seed<seed>.{md,png,json}
and exits 1 when the verdict is FAIL. The same seed gives the same faults, nodes and times.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg

from spark_sim import soak_report
from spark_sim.fleet import SimFleet
from spark_sim.soak import FAULTS, Soak, SoakConfig


def chain(soak_path: str, instance: dg.DagsterInstance, nodes: list[str]) -> None:
    from spark_pipelines.definitions import build_definitions

    defs = build_definitions(soak_path)
    for job, part in [("build_job", None), *[("deploy_node_job", n) for n in nodes], ("gateway_job", None),
                      *[("bench_job", n) for n in nodes]]:
        t = time.monotonic()
        res = defs.resolve_job_def(job).execute_in_process(instance=instance, partition_key=part,
                                                           raise_on_error=False)
        print(f"chain: {job}{f'[{part}]' if part else ''} {'ok' if res.success else 'FAILED'} "
              f"({time.monotonic() - t:.0f} s)", flush=True)
        if not res.success:
            raise SystemExit(f"the chain failed at {job} {part or ''}: the soak needs a deployed fleet")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tick", type=float, default=15, help="seconds between sensor ticks")
    ap.add_argument("--gap", type=float, nargs=2, default=(60, 120), metavar=("MIN", "MAX"),
                    help="seconds between two faults (seeded uniform)")
    ap.add_argument("--every", type=float, default=300, help="seconds between operator actions")
    ap.add_argument("--actions", default="rollout,bench,reload,add_node,bench",
                    help="operator actions in turn: rollout, bench, reload (a fleet-file edit), add_node")
    ap.add_argument("--faults", default="", help=f"comma-separated kinds (default all: {', '.join(FAULTS)})")
    ap.add_argument("--out", default="docs/soak")
    ap.add_argument("--keep", action="store_true", help="leave the simulated fleet up afterwards")
    args = ap.parse_args()
    # A SIGTERM (timeout, kill) unwinds like Ctrl-C: every fault's undo and `sim down` run.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    os.environ.setdefault("SPARK_SIM_SLOT", "26")
    os.environ.setdefault("SPARK_SIM_ROOT", f"/var/lib/spark-sim-soak-{os.environ['SPARK_SIM_SLOT']}")
    os.environ.setdefault("LITELLM_MASTER_KEY", "sk-soak-" + secrets.token_urlsafe(12))
    key = os.environ["LITELLM_MASTER_KEY"]
    cfg = SoakConfig(seed=args.seed, duration_s=args.minutes * 60, tick_s=args.tick, fault_gap_s=tuple(args.gap),
                     action_every_s=args.every, actions=tuple(args.actions.split(",")), faults=tuple(f for f in args.faults.split(",") if f))
    sim = SimFleet()
    sim.down()
    t0 = time.monotonic()
    path = str(sim.up(nodes=args.nodes, fleet_out=sim.layout.root.parent / f"{sim.layout.root.name}.yaml",
                      tokens_per_second=1000))
    print(f"sim up: {args.nodes} nodes + gateway in {time.monotonic() - t0:.0f} s", flush=True)
    name = f"soak-{args.nodes}n-{args.minutes:g}m-seed{args.seed}"
    command = " ".join(["benchmarks/soak.py", *sys.argv[1:]])
    soak: Soak | None = None
    interrupted = False
    try:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "dagster").mkdir()
            # No compute-log capture: it points the whole process's stdout at one run's file,
            # and the soak runs several at once beside its own output.
            instance = dg.DagsterInstance.local_temp(str(Path(tmp) / "dagster"), overrides={"compute_logs": {
                "module": "dagster._core.storage.noop_compute_log_manager", "class": "NoOpComputeLogManager"}})
            try:
                from spark_pipelines.core.fleet import load_fleet

                chain(path, instance, [n.name for n in load_fleet(path).serve_nodes])
                soak = Soak(sim, path, instance, cfg, key)
                soak.run_soak()
                result = soak.check()
                md = soak_report.write(soak, result, Path(args.out), name, command)
            finally:
                instance.dispose()
    except KeyboardInterrupt:
        interrupted = True
        if soak is not None:
            soak.stop.set()  # the sensors' and samplers' loops end
        print("soak: interrupted: tearing the simulated fleet down (no report)", flush=True)
    finally:
        if not args.keep:
            sim.down()
    if interrupted:
        # The Dagster runs in flight run in the soak's thread pool, which the interpreter would join
        # at exit: with the fleet gone each would wait out its SSH timeouts. Nothing is left to undo.
        sys.stdout.flush()
        os._exit(130)
    print(md.read_text())
    return 0 if result["verdict"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
