"""The fault suite's shared state: one deployed fleet (build, both nodes, gateway) on the session's
sim fleet, one Dagster instance, and a fixture that puts the fleet back after every fault.

Bounds: a fault that would hang a run must end it within BOUND_S (the issue: every remote call
has a timeout, a dead peer is detected both ways); a sensor tick within TICK_BOUND_S.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml

from spark_sim.fleet import SimFleet
from tests.plugins import faults as fx

BOUND_S = float(os.environ.get("SPARK_FAULT_BOUND_S", "90"))
TICK_BOUND_S = float(os.environ.get("SPARK_FAULT_TICK_BOUND_S", "30"))
NODES = ("spark1", "spark2")


@dataclass
class Chain:
    sim: SimFleet
    instance: dg.DagsterInstance
    fleet: str
    root: Path
    log: Path

    def defs(self, fleet: str | None = None) -> dg.Definitions:
        from spark_pipelines.definitions import build_definitions

        return build_definitions(fleet or self.fleet)

    def run(self, job: str, partition: str | None = None, *, fleet: str | None = None, **kw: Any) -> Any:
        return self.defs(fleet).resolve_job_def(job).execute_in_process(
            instance=self.instance, partition_key=partition, raise_on_error=False, **kw)

    def variant(self, name: str, change: Callable[[dict[str, Any]], None]) -> str:
        data = yaml.safe_load(open(self.fleet))
        change(data)
        path = self.root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return str(path)

    def commands(self, since: int = 0) -> list[Any]:
        from spark_pipelines.resources.ssh import read_command_log

        return read_command_log(self.log)[since:] if self.log.exists() else []


def failure_text(result: Any) -> str:
    """Everything a failed run said: step failure descriptions, error classes and messages (with
    their causes), so a test can ask whether the node and the reason are named."""
    parts: list[str] = []
    for e in result.all_events:
        if not e.is_step_failure:
            continue
        data = e.step_failure_data
        if data.user_failure_data and data.user_failure_data.description:
            parts.append(data.user_failure_data.description)
        err = data.error
        while err is not None:
            parts.append(f"{err.cls_name}: {err.message}")
            err = err.cause or getattr(err, "context", None)
    return "\n".join(parts)


def error_classes(result: Any) -> set[str]:
    out: set[str] = set()
    for e in result.all_events:
        if e.is_step_failure:
            err = e.step_failure_data.error
            while err is not None:
                out.add(err.cls_name)
                err = err.cause or getattr(err, "context", None)
    return out


@pytest.fixture(scope="session")
def chain(sim_fleet: SimFleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chain]:
    """Build once, deploy both nodes, write the gateway: the deployment every fault starts from."""
    root = tmp_path_factory.mktemp("faults")
    (root / "dagster").mkdir()
    instance = dg.DagsterInstance.local_temp(str(root / "dagster"))
    log = root / "commands.jsonl"
    previous_log = os.environ.get("SPARK_COMMAND_LOG")
    os.environ["SPARK_COMMAND_LOG"] = str(log)
    c = Chain(sim_fleet, instance, str(sim_fleet.fleet_file), root, log)
    try:
        res = c.run("build_job")
        assert res.success, f"the fault suite's build failed:\n{failure_text(res)}"
        for node in NODES:
            res = c.run("deploy_node_job", node)
            assert res.success, f"the fault suite's deploy of {node} failed:\n{failure_text(res)}"
        res = c.run("gateway_job")
        assert res.success, f"the fault suite's gateway step failed:\n{failure_text(res)}"
        yield c
    finally:
        if previous_log is None:
            os.environ.pop("SPARK_COMMAND_LOG", None)
        else:
            os.environ["SPARK_COMMAND_LOG"] = previous_log
        instance.dispose()
        # The next modules of the session (tests/e2e) start from a fleet whose serve node has
        # never been deployed: give spark2 back as it came out of `sim up`.
        fresh_serve_node(sim_fleet, "spark2")


def fresh_serve_node(sim: SimFleet, node: str) -> None:
    m = sim.node(node)
    for name in (fx.CONTAINER, f"{fx.CONTAINER}-previous"):
        fx.docker(m, "rm", "-f", name, check=False, timeout=60)
    images = fx.docker(m, "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", check=False).stdout.split()
    for ref in images:
        if ref.startswith("vllm-qwen35-v2:"):
            fx.docker(m, "image", "rm", "-f", ref, check=False, timeout=60)
    for d in (m.home / "models", m.home / ".cache" / "spark-pipelines"):
        shutil.rmtree(d, ignore_errors=True)


def restore_fleet(c: Chain) -> list[str]:
    """Put the shared fleet back as the chain fixture left it; returns what had to be repaired."""
    sim = c.sim
    repaired: list[str] = []
    if not fx.proxy_ready(sim) or fx.ask_proxy(sim).status_code != 200:
        # Dead, or alive on a stale config (a reload lost in a race): what the operator does.
        fx.restart_proxy(sim)
        repaired.append("proxy restarted")
    for node in NODES:
        # The base spec again: skips when it is already what serves, redeploys after a variant.
        res = c.run("deploy_node_job", node)
        if not res.success:
            res = c.run("deploy_node_job", node)
            repaired.append(f"{node} needed a second deploy")
        assert res.success, f"restoring {node} after the fault failed:\n{failure_text(res)}"
    if sorted(fx.rotation(fx.gateway_config(sim))) != sorted(NODES):
        for node in NODES:  # a bench gate a fault's bench left must not keep a node out
            bench_gate(sim, node).unlink(missing_ok=True)
        res = c.run("gateway_job")
        assert res.success, f"restoring the gateway after the fault failed:\n{failure_text(res)}"
        repaired.append("gateway rewritten")
    return repaired


def bench_gate(sim: SimFleet, node: str) -> Path:
    return sim.node(node).home / ".cache" / "spark-pipelines" / "markers" / "bench_gate.json"


@pytest.fixture()
def fleet(chain: Chain) -> Iterator[Chain]:
    """The deployed fleet, healthy before the fault and made healthy again after it."""
    for node in NODES:
        fx.assert_serving(chain.sim, node)
    yield chain
    restore_fleet(chain)
    for node in NODES:
        fx.assert_serving(chain.sim, node)
    fx.assert_gateway_has_backend(chain.sim)


def deployed_id(sim: SimFleet, node: str) -> str:
    c = fx.container(sim.node(node))
    assert c and c["State"]["Running"], f"{node}: nothing is serving before the fault"
    return c["Id"]

