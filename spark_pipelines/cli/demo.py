"""`spark-pipelines demo`: the simulated fleet, the whole chain through Dagster, a bench table.

Runs on the instance in DAGSTER_HOME (the Makefile sets .dagster-home) through the code location
(spark_pipelines/cli/console.py: code server, webserver, daemon, stopped at the end), so `make ui`
shows every run under its job, materialization, check and bench chart afterwards. The fleet
stays up for the UI; `spark-pipelines sim down` removes it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from spark_pipelines.cli import metrics as metrics_command
from spark_pipelines.cli.console import (  # noqa: F401  (the demo's records, re-exported for its callers)
    DEMO_FLEET_RECORD,
    DEMO_KEY_RECORD,
    FLEET_HELP,
    Console,
    ConsoleError,
    FleetChoice,
    demo_gateway_key,
    find_fleet,
    instance_home,
    read_hint,
    stop_leftovers,
)
from spark_pipelines.core import record_keys as keys
from spark_pipelines.core import steps, summary
from spark_pipelines.core.fleet import load_fleet

UI_PORT = 3000  # `make ui`'s default port (PORT= to change)

def bench_table(instance: Any, nodes: list[str], failures: dict[str, str]) -> str:
    from spark_pipelines.state.records import latest_metadata

    rows = [("node", "deploy", "KV tokens", "startup s", "mean tok/s", "vs reference", "loaded tok/s", "GPU under load", "gateway")]
    for n in nodes:
        dep = latest_metadata(instance, steps.NODE_DEPLOYMENT, n)
        b = latest_metadata(instance, steps.BENCH_RESULTS, n)
        deploy = "FAILED" if n in failures else ("ok" if dep else "-")
        rows.append((
            n,
            deploy,
            f"{dep.get(keys.KV_CACHE_TOKENS, '-')}",
            f"{dep.get(keys.STARTUP_SECONDS, '-')}",
            f"{b[keys.MEAN_TOK_S]:.1f}" if keys.MEAN_TOK_S in b else "-",
            summary.ratio_text(b[keys.VS_REFERENCE]) if keys.VS_REFERENCE in b else "-",
            f"{b[keys.LOADED_AGGREGATE_TOK_S]:.1f}" if keys.LOADED_AGGREGATE_TOK_S in b else "-",
            b.get(keys.GPU_UNDER_LOAD, "-"),
            ("in" if b.get(keys.PROMOTED) else "out") if b else "-",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = [line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows[1:]]
    for n, why in failures.items():
        out.append(f"{n}: {why}")
    return "\n".join(out)


def run_chain(fleet_path: str, instance: Any, log: Any = print, log_level: str = "INFO",
              console: Console | None = None, run_timeout_s: float = 3600.0) -> dict[str, str]:
    """Materialize build -> distribution tree -> per-node deploy -> gateway -> per-node bench, each run submitted through
    the code location (`console`; one is started on the instance's home for the call when none is
    given) and followed to its end. Returns node -> failure ("*" for a failed unpartitioned job)."""
    if console is None:
        with Console(Path(instance.root_directory), fleet_path, log=log) as own:
            return run_chain(fleet_path, instance, log, log_level, own, run_timeout_s)
    if Path(console.fleet_path).resolve() != Path(fleet_path).resolve():
        raise ConsoleError(f"the console's code location serves {console.fleet_path}, not {fleet_path}")
    fleet = load_fleet(fleet_path)
    nodes = [n.name for n in fleet.serve_nodes]
    failures: dict[str, str] = {}
    # INFO keeps every remote command and its output line; DEBUG adds Dagster's engine chatter.
    run_config = {"loggers": {"console": {"config": {"log_level": log_level}}}}

    def run(job: str, partition: str | None = None) -> bool:
        where = f"{job}[{partition}]" if partition else job
        log(f"  {where}")
        out = console.run(instance, job, partition, run_config, timeout_s=run_timeout_s, progress=log)
        if out.success:
            log(f"  {where}: ok ({out.seconds:.0f} s)")
            return True
        log(f"  {where}: FAILED ({out.seconds:.0f} s): {out.why}")
        failures[partition or "*"] = out.why
        return False

    log("build host: model download, hybrid checkpoint, MTP weights, images")
    if not run(steps.BUILD_JOB):
        return failures
    log("nodes: checkpoint + image along the distribution tree (each holder serves the next)")
    if not run(steps.DISTRIBUTE_JOB):
        # Not fatal: each node's deploy copies what it still lacks from the build host.
        failures.pop("*", None)
        log("  distribute_job failed: each node's deploy_node_job copies what is missing from the build host")
    log("nodes: artifacts verified + deployment")
    for n in nodes:
        run(steps.DEPLOY_JOB, n)
    log("gateway")
    if not run(steps.GATEWAY_JOB):
        return failures
    log("bench (each node drained from the gateway while measured)")
    for n in nodes:
        if n not in failures:
            run(steps.BENCH_JOB, n)
    # Last, so the page opened first shows the fleet as the chain left it (every node restored
    # after its bench), not as the automation last saw it before the console stopped.
    log("fleet summary")
    if not run(steps.SUMMARY_JOB):
        failures.pop("*", None)  # a summary that failed says nothing about the fleet
    return failures


# The first line of the dagster.yaml the demo writes: such a file is the demo's to rewrite.
WRITTEN_BY = "# written by spark-pipelines demo (spark_pipelines/cli/demo.py); edit it and it is left as it is"
# The same line before the commands moved into cli/: a home an older demo wrote is still its own
# (brought up to date, its launcher module path with it).
WRITTEN_BEFORE = ("# written by spark-pipelines demo (spark_pipelines/demo.py); edit it and it is left as it is",)
MONITOR_POLL_S = 15  # a dead run is failed within about this long (plus the daemon's own tick)


def instance_config() -> str:
    """The embedded instance's dagster.yaml: the team template's telemetry, concurrency (one run per
    node; one slot in each pool: one drain, one image build at a time) and run monitoring, on the
    default SQLite storage and the local launcher that tells the monitoring whether a run's process
    still lives (spark_pipelines/cli/console_launcher.py): a run whose process died is failed within
    about MONITOR_POLL_S, the node's next run leaves the queue, and a pool slot it held is freed."""
    from spark_pipelines.cli.team.instance import TEMPLATE  # imports dagster: not for every command's --help

    cfg = yaml.safe_load(TEMPLATE.read_text())
    out = {k: cfg[k] for k in ("telemetry", "concurrency")}
    out["run_launcher"] = {"module": "spark_pipelines.cli.console_launcher", "class": "LocalRunLauncher"}
    out["run_monitoring"] = {**cfg["run_monitoring"], "poll_interval_seconds": MONITOR_POLL_S,
                             "free_slots_after_run_end_seconds": MONITOR_POLL_S,
                             "max_resume_run_attempts": 0}  # a dead run is never resumed: its undo ran or the next run finishes it
    return WRITTEN_BY + "\n" + yaml.safe_dump(out, sort_keys=False)


def _ours(text: str) -> bool:
    """Written by the demo: now (its first line) or by an older version (telemetry and run queue only)."""
    if text.startswith((WRITTEN_BY, *WRITTEN_BEFORE)):
        return True
    try:
        old = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    return isinstance(old, dict) and set(old) == {"telemetry", "run_queue"} and old["telemetry"] == {"enabled": False}


def prepare_instance_home(home: Path | None = None) -> Path:
    """DAGSTER_HOME (default ./.dagster-home), or `home`, with instance_config() as its dagster.yaml.
    An operator's own dagster.yaml is left as it is; one the demo wrote is brought up to date."""
    if home is None:
        home = Path(os.environ.setdefault("DAGSTER_HOME", str(Path(".dagster-home").resolve())))
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    want = instance_config()
    if not config.exists() or (config.read_text() != want and _ours(config.read_text())):
        config.write_text(want)
    return home


def ui_fleet(home: Path, environ: dict[str, str] | None = None) -> tuple[str, str | None]:
    """The fleet file `make ui` opens on the demo's instance, and a warning when it is not the one
    the instance's runs were made with (find_fleet's order)."""
    choice = find_fleet(None, environ, home)
    return choice.path, choice.warning


def ui_command(port: str | None = None) -> int:
    """`make ui [PORT=3000]`: `dg dev` on the demo's instance and fleet file, with the simulator's
    gateway key when the fleet is the demo's (a bench launched from the UI drains through it)."""
    from spark_pipelines.cli.console import stop_leftovers

    port = port or os.environ.get("PORT") or str(UI_PORT)
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        print(f"make ui: PORT={port}: give a TCP port, 1-65535", file=sys.stderr)
        return 2
    home = prepare_instance_home()
    stop_leftovers(home)
    choice = find_fleet(None, None, home)
    if choice.warning:
        bar = "!" * 78
        print(f"{bar}\nmake ui: {choice.warning}\n{bar}", file=sys.stderr)
    print(f"make ui: fleet file {choice.named()}")
    key_env = load_fleet(choice.path).gateway.master_key_env
    said = demo_gateway_key(choice.path, key_env)
    if said:
        print(f"make ui: gateway key {said}")
    elif not os.environ.get(key_env):
        print(f"make ui: ${key_env} is not set: a step that reads the gateway (bench, gateway_job) fails at its "
              f"first read if the proxy has a master key; set it to the proxy's key")
    print(f"make ui: Dagster instance {home}; UI on http://127.0.0.1:{port}")
    venv = Path(sys.executable).parent
    # VIRTUAL_ENV: dg then uses this venv for the project, quietly.
    env = {**os.environ, "SPARK_FLEET": choice.path, "DAGSTER_HOME": str(home), "VIRTUAL_ENV": str(venv.parent)}
    sys.stdout.flush()
    os.execve(str(venv / "dg"), [str(venv / "dg"), "dev", "-h", "127.0.0.1", "-p", port], env)
    return 0  # not reached


def _node_count(text: str) -> int:
    """--nodes, checked while parsing: a bad value is refused before any fleet is touched."""
    from spark_sim.layout import MAX_NODES

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of nodes; choose 1 to {MAX_NODES}") from None
    if not 1 <= n <= MAX_NODES:
        raise argparse.ArgumentTypeError(f"{n}: choose between 1 and {MAX_NODES} nodes")
    return n


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--nodes", type=_node_count, default=2,
                    help="simulated nodes, 1-32 (spark1 founders + build host, the others gx10); default 2")
    ap.add_argument("--fleet-out", default="sim-fleet.yaml", metavar="FILE",
                    help="where the simulated fleet's fleet file is written (default: sim-fleet.yaml)")
    ap.add_argument("--stop", action="store_true",
                    help="only stop a Dagster console (webserver, daemon, code server) a killed demo left running")


def demo_command(args: argparse.Namespace) -> int:
    """`spark-pipelines demo` (arguments parsed by spark_pipelines.cli)."""
    if args.stop:
        home = prepare_instance_home()
        if not stop_leftovers(home):
            print(f"no Dagster console running on {home}")
        return 0
    if os.geteuid() != 0:
        print("spark-pipelines demo: the simulated fleet needs root (network namespaces, users, dockerd)", file=sys.stderr)
        return 2
    import warnings

    import dagster as dg

    from spark_sim.fleet import SimFleet
    from spark_sim.layout import SimError

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
        try:
            fleet_path = str(sim.up(nodes=args.nodes, fleet_out=args.fleet_out))
        except SimError as e:  # e.g. another fleet's leftovers on this slot: one line, no traceback
            print(f"spark-pipelines demo: the simulated fleet did not come up: {e} (slot {sim.layout.slot}, root "
                  f"{sim.layout.root}: `spark-pipelines sim down` with the same SPARK_SIM_SLOT and SPARK_SIM_ROOT "
                  "removes what a fleet left there, or choose another SPARK_SIM_SLOT)", file=sys.stderr)
            return 1
    print(f"fleet file: {fleet_path}")
    if "LITELLM_MASTER_KEY" not in os.environ and sim.master_key_file.exists():
        os.environ["LITELLM_MASTER_KEY"] = sim.master_key_file.read_text().strip()
    os.environ["SPARK_FLEET"] = fleet_path
    home = prepare_instance_home()
    (home / DEMO_FLEET_RECORD).write_text(str(Path(fleet_path).resolve()) + "\n")
    # The path only: plan, doctor, adopt and `make ui` read the key from it for this fleet file.
    (home / DEMO_KEY_RECORD).write_text(f"{sim.master_key_file}\n" if sim.master_key_file.exists() else "")
    print(f"Dagster instance: {home}")
    instance = dg.DagsterInstance.get()
    # Stopped at the end (see docs/commands.md, `make ui`): `make ui` then serves the same code location, so
    # the runs stay on their jobs' pages, and no daemon is left to compete with a second daemon or
    # the test suite.
    console = Console(home, fleet_path, log=print)
    print(f"Dagster console: starting code server, webserver and daemon (logs: {console.logs}) ...")
    try:
        with console:
            print(f"Dagster UI while the chain runs: {console.url}")
            failures = run_chain(fleet_path, instance, console=console)
    except ConsoleError as e:
        print(f"spark-pipelines demo: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("spark-pipelines demo: interrupted; the Dagster console is stopped", file=sys.stderr)
        return 130
    fleet = load_fleet(fleet_path)
    print()
    print(bench_table(instance, [n.name for n in fleet.serve_nodes], {k: v for k, v in failures.items() if k != "*"}))
    print()
    print("The console is stopped. Dagster UI on this instance (these runs under their jobs): make ui [PORT=3000]"
          "   |   remove the simulated fleet: make sim-down")
    print(f"From here on, plan --live, doctor, adopt --check, metrics and make ui read this fleet file, the "
          f"simulator's gateway key and this instance (recorded in {home}); each names what it read.")
    print(f"Metrics: .venv/bin/spark-pipelines metrics serve -> http://127.0.0.1:{metrics_command.DEFAULT_PORT}"
          f"/metrics; Prometheus targets and alert rules: .venv/bin/spark-pipelines metrics scrape-config --out DIR")
    return 1 if failures else 0
