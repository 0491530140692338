"""The e2e modules share one Dagster instance and one console on it (code server, webserver,
daemon: spark_pipelines/cli/console.py) for the session: test_chain runs the chain through it, the
browser tests open its UI on the same history."""

from __future__ import annotations


import dagster as dg
import pytest

from spark_pipelines.cli.console import Console
from spark_pipelines.cli.demo import prepare_instance_home


@pytest.fixture(scope="session")
def chain_console(sim_fleet, tmp_path_factory):
    """{"instance", "console", "log", "fleet", "root", "sim"}: the console starts at first use and
    stops at the end of the session. Runs it launches write the command log at `log`."""
    root = tmp_path_factory.mktemp("chain")
    home = prepare_instance_home(root / "dagster")  # the demo's dagster.yaml: run_queue limits per node
    log = root / "commands.jsonl"
    fleet = str(sim_fleet.fleet_file)
    instance = dg.DagsterInstance.from_config(str(home))
    console = Console(home, fleet, env={"SPARK_COMMAND_LOG": str(log)}, log=lambda *_: None)
    console.start()
    try:
        yield {"instance": instance, "console": console, "log": log, "fleet": fleet, "root": root, "sim": sim_fleet}
    finally:
        console.stop()
        instance.dispose()
