"""`spark-pipelines demo`: the simulated fleet, the whole chain through Dagster, a bench table.

Runs on the instance in DAGSTER_HOME (the Makefile sets .dagster-home), so `make ui` shows every
run, materialization, check and bench chart afterwards. The fleet stays up for the UI;
`spark-pipelines sim down` removes it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from spark_pipelines.core.fleet import load_fleet

def latest_metadata(instance: Any, asset: str, partition: str | None) -> dict[str, Any]:
    import dagster as dg

    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition] if partition else None),
        limit=1,
    ).records
    if not records or records[0].asset_materialization is None:
        return {}
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def bench_table(instance: Any, nodes: list[str], failures: dict[str, str]) -> str:
    rows = [("node", "deploy", "KV tokens", "startup s", "mean tok/s", "vs reference", "loaded tok/s", "GPU under load", "gateway")]
    for n in nodes:
        dep = latest_metadata(instance, "node_deployment", n)
        b = latest_metadata(instance, "bench_results", n)
        deploy = "FAILED" if n in failures else ("ok" if dep else "-")
        rows.append((
            n,
            deploy,
            f"{dep.get('kv_cache_tokens', '-')}",
            f"{dep.get('startup_seconds', '-')}",
            f"{b['mean_tok_s']:.1f}" if "mean_tok_s" in b else "-",
            f"{b['vs_reference']:.2f}x" if "vs_reference" in b else "-",
            f"{b['loaded_aggregate_tok_s']:.1f}" if "loaded_aggregate_tok_s" in b else "-",
            b.get("gpu_under_load", "-"),
            ("in" if b.get("promoted") else "out") if b else "-",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = [line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows[1:]]
    for n, why in failures.items():
        out.append(f"{n}: {why}")
    return "\n".join(out)


def run_chain(fleet_path: str, instance: Any, log: Any = print, log_level: str = "INFO") -> dict[str, str]:
    """Materialize build -> per-node deploy -> gateway -> per-node bench. Returns node -> failure."""
    from spark_pipelines.definitions import build_definitions

    defs = build_definitions(fleet_path)
    fleet = load_fleet(fleet_path)
    nodes = [n.name for n in fleet.serve_nodes]
    failures: dict[str, str] = {}

    def run(job: str, partition: str | None = None) -> bool:
        started = time.monotonic()
        res = defs.resolve_job_def(job).execute_in_process(
            instance=instance, partition_key=partition, raise_on_error=False,
            # INFO keeps every remote command and its output line; DEBUG adds Dagster's engine chatter.
            run_config={"loggers": {"console": {"config": {"log_level": log_level}}}})
        where = f"{job}[{partition}]" if partition else job
        if res.success:
            log(f"  {where}: ok ({time.monotonic() - started:.0f} s)")
            return True
        why = "; ".join(
            (e.step_failure_data.user_failure_data.description if e.step_failure_data and e.step_failure_data.user_failure_data
             and e.step_failure_data.user_failure_data.description else
             (e.step_failure_data.error.message.strip().splitlines()[0] if e.step_failure_data and e.step_failure_data.error else e.message))
            for e in res.all_events if e.is_step_failure
        ) or "run failed"
        log(f"  {where}: FAILED ({time.monotonic() - started:.0f} s): {why}")
        if partition:
            failures[partition] = why
        else:
            failures["*"] = why
        return False

    log("build host: model download, hybrid checkpoint, MTP weights, images")
    if not run("build_job"):
        return failures
    log("nodes: artifacts + deployment")
    for n in nodes:
        run("deploy_node_job", n)
    log("gateway")
    if not run("gateway_job"):
        return failures
    log("bench (each node drained from the gateway while measured)")
    for n in nodes:
        if n not in failures:
            run("bench_job", n)
    return failures


def prepare_instance_home() -> Path:
    """DAGSTER_HOME (default ./.dagster-home) with a dagster.yaml that turns telemetry off (this
    tool talks only to the fleet) and runs one run per node at a time: every per-node run carries
    `dagster/partition` (its node), every bench run `spark/bench` (the gateway loses one node at
    a time, never two). An operator's own dagster.yaml is left as it is."""
    home = Path(os.environ.setdefault("DAGSTER_HOME", str(Path(".dagster-home").resolve())))
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists():
        config.write_text(
            "telemetry:\n"
            "  enabled: false\n"
            "run_queue:\n"
            "  tag_concurrency_limits:\n"
            "    - key: dagster/partition\n"
            "      value:\n"
            "        applyLimitPerUniqueValue: true\n"
            "      limit: 1\n"
            "    - key: spark/bench\n"
            "      limit: 1\n"
        )
    return home


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--fleet-out", default="sim-fleet.yaml")


def demo_command(args: argparse.Namespace) -> int:
    """`spark-pipelines demo` (arguments parsed by spark_pipelines.cli)."""
    if os.geteuid() != 0:
        print("spark-pipelines demo: the simulated fleet needs root (network namespaces, users, dockerd)", file=sys.stderr)
        return 2
    import warnings

    import dagster as dg

    from spark_sim.fleet import SimFleet

    # Output(data_version=...) is how steps skip; Dagster flags it beta on every materialization.
    warnings.filterwarnings("ignore", category=dg.BetaWarning)

    sim = SimFleet()
    if sim.is_up and sim.fleet_file and sim.fleet_file.exists() and len(sim.nodes) == args.nodes:
        # A second demo reuses the fleet: every step then finds its verified output and skips.
        fleet_path = str(sim.fleet_file)
        print(f"simulated fleet already up ({args.nodes} nodes); reusing it")
    else:
        if sim.is_up:
            sim.down()
        print(f"simulated fleet: bringing up {args.nodes} nodes ...")
        fleet_path = str(sim.up(nodes=args.nodes, fleet_out=args.fleet_out))
    print(f"fleet file: {fleet_path}")
    if "LITELLM_MASTER_KEY" not in os.environ and sim.master_key_file.exists():
        os.environ["LITELLM_MASTER_KEY"] = sim.master_key_file.read_text().strip()
    os.environ["SPARK_FLEET"] = fleet_path
    home = prepare_instance_home()
    print(f"Dagster instance: {home}")
    instance = dg.DagsterInstance.get()
    failures = run_chain(fleet_path, instance)
    fleet = load_fleet(fleet_path)
    print()
    print(bench_table(instance, [n.name for n in fleet.serve_nodes], {k: v for k, v in failures.items() if k != "*"}))
    print()
    print("Dagster UI on this instance: make ui   |   remove the simulated fleet: make sim-down")
    return 1 if failures else 0
