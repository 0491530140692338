"""Compile caches shipped: a newcomer's first boot and a 4-node rollout, with the cache shipped / without.

    .venv/bin/python benchmarks/jit_ship.py [--minute-s 1.0] [--keep]

Brings up a simulated fleet of 4 serve nodes (SPARK_SIM_SLOT / SPARK_SIM_ROOT, default slot 25,
/var/lib/spark-sim-bench-jit; the stand-in at 1000 tok/s so that a bench takes seconds) whose
engine stand-in boots on the runbook's timings, scaled: a warm boot 8.5 min and a first boot 35 min
(the middles of "7-10 min" and "25-45 min"), one minute = --minute-s seconds. On a throwaway Dagster
instance: build, deploy spark1 and spark2, gateway; then
  1. add_node_job spark3 with launch.ship_jit_cache off (its first boot compiles) and add_node_job
     spark4 with it on (spark1's sealed cache shipped, verified, before its first boot): the boot
     (docker run to healthy) and the shipping, and each deploy's whole time;
  2. two rollouts of a new launch spec each (a new JIT key: the canary compiles) to the 4 nodes,
     health-gated (bench_gate off: the benches are not what is measured): one with shipping off,
     every wave node compiling, one with the canary's cache archived and shipped to the waves.
Prints the ratios from this one run: newcomer (shipping + boot) / cold boot (goal <= 0.3) and
rollout wall time shipped / not.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg
import yaml

from spark_pipelines.core import record_keys as keys
from spark_pipelines.definitions import build_definitions
from spark_sim.fleet import SimFleet

WARM_MIN, COLD_MIN = 8.5, 35.0  # the runbook's warm and first boots, middles of 7-10 and 25-45 min


def run(path: str, instance: dg.DagsterInstance, job: str, partition: str | None = None,
        config: dict | None = None) -> dg.ExecuteInProcessResult:
    res = build_definitions(path).resolve_job_def(job).execute_in_process(
        instance=instance, partition_key=partition, raise_on_error=False, run_config=config or {})
    if not res.success:
        failure = next((e for e in res.all_events if e.is_step_failure), None)
        why = failure.step_failure_data.user_failure_data.description if failure and failure.step_failure_data \
            and failure.step_failure_data.user_failure_data else "see the run's events"
        raise SystemExit(f"{job}{' ' + partition if partition else ''} failed: {why}")
    return res


def variant(base: str, work: Path, name: str, *, ship: bool, level: str = "INFO", minute_s: float) -> str:
    doc = yaml.safe_load(Path(base).read_text())
    launch = doc["launch"]
    launch["env"] = {**launch["env"], "SIM_STARTUP_SECONDS": f"{WARM_MIN * minute_s:g}",
                     "SIM_COLD_BOOT_FACTOR": f"{(COLD_MIN - WARM_MIN) / WARM_MIN:.3f}", "VLLM_LOGGING_LEVEL": level}
    launch["ship_jit_cache"] = ship
    path = work / f"fleet-{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def deployed(instance: dg.DagsterInstance, node: str) -> dict:
    recs = instance.fetch_materializations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey("node_deployment"), asset_partitions=[node]), limit=1).records
    return {k: v.value for k, v in recs[0].asset_materialization.metadata.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minute-s", type=float, default=1.0, help="seconds of the stand-in per runbook minute")
    ap.add_argument("--keep", action="store_true", help="leave the simulated fleet up afterwards")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("benchmarks/jit_ship.py: run as root (the simulated fleet needs namespaces and users)", file=sys.stderr)
        return 2
    os.environ.setdefault("SPARK_SIM_SLOT", "25")
    os.environ.setdefault("SPARK_SIM_ROOT", "/var/lib/spark-sim-bench-jit")
    os.environ.setdefault("LITELLM_MASTER_KEY", "sk-bench-" + secrets.token_urlsafe(12))
    sim = SimFleet()
    sim.down()
    t0 = time.monotonic()
    base = str(sim.up(nodes=4, fleet_out=sim.layout.root.parent / f"{sim.layout.root.name}.yaml",
                      tokens_per_second=1000))
    print(f"sim up: 4 nodes + gateway in {time.monotonic() - t0:.0f} s; a warm boot {WARM_MIN * args.minute_s:g} s, "
          f"a first boot {COLD_MIN * args.minute_s:g} s", flush=True)
    out: dict[str, float] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            (work / "dagster").mkdir()
            instance = dg.DagsterInstance.local_temp(str(work / "dagster"))
            try:
                on = variant(base, work, "on", ship=True, minute_s=args.minute_s)
                off = variant(base, work, "off", ship=False, minute_s=args.minute_s)
                t0 = time.monotonic()
                run(on, instance, "build_job")
                for n in ("spark1", "spark2"):
                    run(on, instance, "deploy_node_job", n)
                run(on, instance, "gateway_job")
                print(f"chain (build, 2 deploys, gateway): {time.monotonic() - t0:.0f} s; spark2's deploy: "
                      f"{deployed(instance, 'spark2')['jit_cache']}", flush=True)

                # 1. Newcomers: spark3 compiles its own, spark4 gets spark1's cache shipped.
                run(off, instance, "add_node_job", "spark3")
                run(on, instance, "add_node_job", "spark4")
                cold, shipped = deployed(instance, "spark3"), deployed(instance, "spark4")
                ship_s = float(shipped.get("jit_cache_ship_seconds", 0.0))
                out["newcomer_cold_boot_s"] = cold[keys.BOOT_SECONDS]
                out["newcomer_shipped_boot_s"] = shipped[keys.BOOT_SECONDS]
                out["newcomer_ship_s"] = ship_s
                out["newcomer_boot_ratio"] = round((ship_s + shipped[keys.BOOT_SECONDS]) / cold[keys.BOOT_SECONDS], 3)
                out["newcomer_deploy_ratio"] = round(shipped[keys.STARTUP_SECONDS] / cold[keys.STARTUP_SECONDS], 3)
                print(f"newcomer: spark3 {cold['jit_cache']}: boot {cold[keys.BOOT_SECONDS]} s (deploy "
                      f"{cold[keys.STARTUP_SECONDS]} s); spark4 {shipped['jit_cache']} from "
                      f"{shipped.get('jit_cache_shipped_from')}: shipping {ship_s} s + boot "
                      f"{shipped[keys.BOOT_SECONDS]} s (deploy {shipped[keys.STARTUP_SECONDS]} s)", flush=True)

                # 2. Rollouts of a new key to the 4 nodes, health-gated.
                gate_off = {"ops": {"fleet_rollout": {"config": {"bench_gate": False}}}}
                for name, ship, level in (("rollout-off", False, "DEBUG"), ("rollout-on", True, "WARNING")):
                    path = variant(base, work, name, ship=ship, level=level, minute_s=args.minute_s)
                    t0 = time.monotonic()
                    run(path, instance, "rollout_job", config=gate_off)
                    took = time.monotonic() - t0
                    verdicts = {n: deployed(instance, n)["jit_cache"] for n in ("spark1", "spark2", "spark3", "spark4")}
                    out[f"{name}_s"] = round(took, 1)
                    print(f"{name}: {took:.0f} s; deploys: {verdicts}", flush=True)
                out["rollout_ratio"] = round(out["rollout-on_s"] / out["rollout-off_s"], 3)
            finally:
                instance.dispose()
    finally:
        if not args.keep:
            sim.down()
    print(json.dumps(out))
    print(f"newcomer's first boot, shipped / cold: {out['newcomer_boot_ratio']:.2f} (goal <= 0.3; whole deploy "
          f"{out['newcomer_deploy_ratio']:.2f}); 4-node rollout, canary's cache shipped to the waves / not: "
          f"{out['rollout_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
