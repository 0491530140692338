"""A killed run of every procedure that takes a node out, stops its engine, reboots it or sets
something aside (issue 40): each run is its own process (the job executed in-process in a
subprocess, on the fault suite's instance), SIGKILLed at its riskiest point, while clients stream
through the real LiteLLM proxy. The next run on the node, or the health sweep's request, brings the
node back serving and routed (or held out with the step and the advice); no client request fails
by the pipeline's own action; the killed run is marked failed, not left STARTED. Each test prints
the seconds from the kill to the node serving and routed again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from spark_sim import node_os as sim_os
from spark_sim.traffic import Clients
from tests.faults.conftest import Chain, failure_text
from tests.plugins import faults as fx

pytestmark = pytest.mark.slow

NODE = "spark2"
APPLY = {"ops": {"node_os": {"config": {"check": False}}}}  # node_os_job only reads by default
RUN = """
import json, sys
import dagster as dg
from spark_pipelines.definitions import build_definitions
fleet, home, job, node, config = sys.argv[1:6]
instance = dg.DagsterInstance.local_temp(home)
res = build_definitions(fleet).resolve_job_def(job).execute_in_process(
    instance=instance, partition_key=node or None, raise_on_error=False, run_config=json.loads(config))
print("finished", res.success, flush=True)
"""


# -- what the fleet says -----------------------------------------------------------------------


def ledger(c: Chain) -> dict[str, Any]:
    path = Path(str(fx.gateway_config_path(c.sim)) + ".ledger.json")
    try:
        return (json.loads(path.read_text()) or {}).get("nodes", {})
    except (OSError, ValueError):
        return {}


def procedures(c: Chain, node: str = NODE) -> list[dict[str, Any]]:
    return ledger(c).get(node, {}).get("procedures", [])


def journal_phase(c: Chain, procedure: str, node: str = NODE) -> str | None:
    return next((p.get("phase") for p in procedures(c, node) if p["procedure"] == procedure), None)


def deploy_journal(c: Chain, node: str = NODE) -> dict[str, Any] | None:
    try:
        return json.loads((c.sim.node(node).home / ".cache" / "spark-pipelines" / "markers" /
                           "deploy_journal.json").read_text())
    except (OSError, ValueError):
        return None


def drains(c: Chain) -> dict[str, str]:
    from spark_pipelines.core.gateway import load_drains

    return load_drains(fx.gateway_config_path(c.sim).read_text())


def routed(c: Chain, node: str = NODE) -> bool:
    try:
        return node in fx.rotation(fx.gateway_config(c.sim))
    except Exception:  # mid-write
        return False


def assert_back(c: Chain, node: str = NODE) -> None:
    """Serving, in the gateway with no drain note, no hold-out, no journal left."""
    fx.assert_serving(c.sim, node)
    assert routed(c, node), f"{node} is not in the gateway: drains {drains(c)}, ledger {ledger(c).get(node)}"
    assert node not in drains(c), drains(c)
    entry = ledger(c).get(node, {})
    assert not entry.get("holds") and not entry.get("quarantine") and not entry.get("procedures"), entry
    assert deploy_journal(c, node) is None
    fx.assert_gateway_has_backend(c.sim)


def clean_ledger(c: Chain, node: str) -> None:
    """After a test, whatever it asserted: the node's quarantine, hold-outs and journals gone, so a
    failure here does not keep the node out for the tests after it (the fixture redeploys it)."""
    from spark_pipelines.core.fleet import load_fleet
    from spark_pipelines.resources.ssh import FleetSession
    from spark_pipelines.state import ledger as ledger_mod

    with FleetSession(load_fleet(c.fleet)) as s:
        ledger_mod.end_quarantine(s, node)
        entry = ledger_mod.read(s).entry(node)
        ledger_mod.lift(s, node, *entry.holds)
        for p in entry.procedures:
            ledger_mod.end_procedure(s, node, p.token)


def status(c: Chain, run_id: str) -> dg.DagsterRunStatus:
    return c.instance.get_run_by_id(run_id).status


# -- killing a run -----------------------------------------------------------------------------


class Killed:
    """A job run in its own process, SIGKILLed the moment `when()` holds; then the seconds until
    the node serves and is routed again are measured in the background."""

    def __init__(self, c: Chain, job: str, node: str = NODE, *, fleet: str | None = None,
                 config: dict[str, Any] | None = None, partitioned: bool = True) -> None:
        self.c, self.node = c, node
        self.before = {r.run_id for r in c.instance.get_runs()}
        self.p = subprocess.Popen([sys.executable, "-c", RUN, fleet or c.fleet, str(c.root / "dagster"), job,
                                   node if partitioned else "", json.dumps(config or {})], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, cwd=os.getcwd())
        self.killed_at: float | None = None
        self.back_at: float | None = None
        self.run_id = ""  # the killed run's
        self._stop = threading.Event()

    def kill_when(self, when: Callable[[], bool], what: str, bound_s: float = 300) -> Killed:
        deadline = time.monotonic() + bound_s
        try:
            while time.monotonic() < deadline:
                if when():
                    os.kill(self.p.pid, signal.SIGKILL)
                    self.p.wait(10)
                    self.killed_at = time.monotonic()
                    new = [r.run_id for r in self.c.instance.get_runs() if r.run_id not in self.before]
                    assert len(new) == 1, new
                    self.run_id = new[0]
                    threading.Thread(target=self._watch, daemon=True).start()
                    return self
                if self.p.poll() is not None:
                    pytest.fail(f"the run ended before {what}: {self.p.stdout.read()[-3000:]}", pytrace=False)
                time.sleep(0.05)
            pytest.fail(f"the run did not reach {what} within {bound_s:.0f} s", pytrace=False)
        finally:
            if self.p.poll() is None and self.killed_at is None:
                self.p.kill()
                self.p.wait(10)
        raise AssertionError("unreachable")

    def _watch(self) -> None:
        m = self.c.sim.node(self.node)
        while not self._stop.is_set():
            if fx.engine_healthy(m, timeout=2) and routed(self.c, self.node) and self.node not in drains(self.c):
                self.back_at = time.monotonic()
                return
            self._stop.wait(0.2)

    def seconds_back(self, what: str) -> float:
        deadline = time.monotonic() + 30
        while self.back_at is None and time.monotonic() < deadline:
            time.sleep(0.2)
        self._stop.set()
        assert self.back_at is not None and self.killed_at is not None, f"{self.node} never came back ({what})"
        took = round(self.back_at - self.killed_at, 1)
        print(f"\n[dead runs] {what}: kill -> {self.node} serving and routed again in {took} s")
        return took


@contextmanager
def clients(c: Chain) -> Iterator[Clients]:
    """Clients streaming through the gateway; none may fail by the pipeline's own action."""
    with Clients(c.sim, os.environ["LITELLM_MASTER_KEY"], every_s=0.5, max_tokens=32) as traffic:
        yield traffic
    assert traffic.failed == [], traffic.failed
    assert len(traffic.streams.results) >= 5


def sweep_requests(c: Chain, node: str = NODE, fleet: str | None = None, tries: int = 5) -> list[dg.RunRequest]:
    """The health sweep's requests for `node` (a few ticks: the dead run's lease ends with its
    connection, a moment after the kill)."""
    defs = c.defs(fleet)
    sensor = defs.get_repository_def().get_sensor_def("node_health")
    for _ in range(tries):
        with dg.build_sensor_context(instance=c.instance, definitions=defs,
                                     resources={"ssh": defs.resources["ssh"]}) as ctx:
            got = [r for r in sensor(ctx).run_requests or [] if r.partition_key == node]
        if got:
            return got
        time.sleep(1)
    return []


def run_request(c: Chain, req: dg.RunRequest, fleet: str | None = None) -> Any:
    return c.run(req.job_name, req.partition_key, fleet=fleet, run_config=req.run_config or {}, tags=req.tags)


# -- Phase 0 -----------------------------------------------------------------------------------


@pytest.fixture()
def needs_reboot(fleet: Chain) -> Iterator[Chain]:
    """spark2 with one unit unmasked and enabled by hand: Phase 0 masks it again and reboots."""
    from spark_pipelines.core.fleet import load_fleet
    from spark_pipelines.resources.ssh import FleetSession

    m = fleet.sim.node(NODE)
    with FleetSession(load_fleet(fleet.fleet)) as s:
        s.run(NODE, ["systemctl", "unmask", "gdm3"], sudo=True, timeout=30)
        s.run(NODE, ["systemctl", "enable", "gdm3"], sudo=True, timeout=30)
    sim_os.set_boot_delay(m.dir, 6)  # a window to kill the run in while the node is down
    try:
        yield fleet
    finally:
        sim_os.set_boot_delay(m.dir, sim_os.DEFAULT_BOOT_DELAY_S)


def test_phase0_killed_while_waiting_for_the_reboot_is_finished_by_the_next_node_os_run(needs_reboot):
    """The issue's first case: the rerun of node_os_job starts the engine the dead run stopped,
    undoes its drain and verifies; it used to end SUCCESS with the node exited and drained."""
    c = needs_reboot
    m = c.sim.node(NODE)
    with clients(c):
        k = Killed(c, "node_os_job", config=APPLY).kill_when(lambda: not fx._banner(m.ip), "the reboot wait")
        assert journal_phase(c, "node_os") == "rebooting", procedures(c)
        fx.wait_for(lambda: fx._banner(m.ip), 60, f"{NODE} back from its reboot")
        assert not routed(c) and not fx.engine_healthy(m), "the dead run's node is not as the issue found it"
        res = c.run("node_os_job", NODE, run_config=APPLY)
        assert res.success, failure_text(res)
        k.seconds_back("Phase 0 killed during the reboot wait, node_os_job again")
    assert_back(c)
    assert status(c, k.run_id) == dg.DagsterRunStatus.FAILURE  # the next run marked the killed one failed
    mat = c.instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=dg.AssetKey("node_os"),
                                                                  asset_partitions=[NODE]), limit=1).records[0]
    said = mat.asset_materialization.metadata["steps"].value
    assert "did not finish" not in said and "finished:" in said and "docker start" in said, said


def test_phase0_killed_after_the_reboot_before_the_engine_start_is_finished_by_the_sweep(needs_reboot):
    """Killed once the node is back, before vLLM starts: the sweep sees the journal with nobody
    holding the node and requests node_os_job, which finishes it and verifies."""
    c = needs_reboot
    m = c.sim.node(NODE)
    went_down: list[bool] = []

    def back_from_reboot() -> bool:
        if not fx._banner(m.ip):
            went_down.append(True)
            return False
        return bool(went_down)

    with clients(c):
        k = Killed(c, "node_os_job", config=APPLY).kill_when(back_from_reboot, "the verify after the reboot")
        assert not fx.engine_healthy(m), "vLLM had started already: not the case under test"
        reqs = sweep_requests(c)
        assert [(r.job_name, r.run_key) for r in reqs] == [("node_os_job", f"finish-{NODE}-node_os-{k.run_id[:8]}")], reqs
        # The finisher applies, as the dead run did (a check would leave the node as the issue found it).
        assert reqs[0].run_config["ops"]["node_os"]["config"]["check"] is False, reqs[0].run_config
        res = run_request(c, reqs[0])
        assert res.success, failure_text(res)
        k.seconds_back("Phase 0 killed after the reboot, before the engine start; the sweep's node_os_job")
    assert_back(c)
    assert status(c, k.run_id) == dg.DagsterRunStatus.FAILURE


# -- a newcomer, a bench -----------------------------------------------------------------------


def test_add_node_killed_after_its_deploy_before_its_bench_is_never_routed_unbenched(fleet):
    """spark2 taken out of the gateway stands for a node new to the fleet: add_node_job deploys a
    new launch spec and is killed before its bench. The newcomer stays out with the reason (no
    gateway_job routes it unbenched); add_node_job again redoes nothing done and benches it in."""
    from spark_pipelines.core.fleet import load_fleet
    from spark_pipelines.core.launch import DEPLOY_LABEL, launch_spec
    from spark_pipelines.resources.gateway import GatewayHost
    from spark_pipelines.resources.ssh import FleetSession

    c = fleet
    path = c.variant("join", lambda d: d["launch"]["env"].__setitem__("SPARK_FAULT_SUITE", "join"))
    with FleetSession(load_fleet(c.fleet)) as s:
        GatewayHost(s, master_key=os.environ["LITELLM_MASTER_KEY"]).drain(NODE, reason="a newcomer")
    launched = len(c.commands())
    want = launch_spec(load_fleet(path), load_fleet(path).node(NODE)).fingerprint

    def deployed() -> bool:  # the new container recorded as the node's deployment: committed
        live = fx.container(c.sim.node(NODE))
        marker = c.sim.node(NODE).home / ".cache" / "spark-pipelines" / "markers" / "node_deployment.json"
        try:
            recorded = json.loads(marker.read_text()).get("container_id")
        except (OSError, ValueError):
            return False
        return bool(live and live["Config"]["Labels"].get(DEPLOY_LABEL) == want and recorded == live["Id"])

    with clients(c):
        k = Killed(c, "add_node_job", fleet=path).kill_when(deployed, "the bench after the deploy")
        held = ledger(c).get(NODE, {}).get("holds", {}).get("bench", {})
        assert "not benched yet" in held.get("reason", ""), ledger(c)
        res = c.run("gateway_job", fleet=path)  # what used to route an unbenched newcomer
        assert res.success, failure_text(res)
        assert not routed(c), "gateway_job routed a newcomer its bench never promoted"
        since = len(c.commands())
        res = c.run("add_node_job", NODE, fleet=path)
        assert res.success, failure_text(res)
        k.seconds_back("add_node killed after the deploy, before the bench; add_node_job again")
    assert_back(c)
    runs = [r for r in c.commands(launched) if r.node == NODE and list(r.argv[:3]) == ["docker", "run", "-d"]]
    assert len(runs) == 1, "the rerun deployed again what the dead run had deployed"
    assert not [r for r in c.commands(since) if r.node == NODE and list(r.argv[:3]) == ["docker", "run", "-d"]]
    assert status(c, k.run_id) == dg.DagsterRunStatus.FAILURE


def test_a_bench_killed_while_its_node_is_drained_is_put_back_by_the_sweeps_bench(fleet):
    c = fleet
    with clients(c):
        k = Killed(c, "bench_job").kill_when(lambda: not routed(c), "the drained bench")
        assert journal_phase(c, "bench") == "draining", procedures(c)
        reqs = sweep_requests(c)
        assert [(r.job_name, r.run_key) for r in reqs] == [("bench_job", f"finish-{NODE}-bench-{k.run_id[:8]}")], reqs
        res = run_request(c, reqs[0])
        assert res.success, failure_text(res)
        k.seconds_back("bench killed while drained; the sweep's bench_job")
    assert_back(c)


# -- the cold drain ----------------------------------------------------------------------------


def test_a_cold_drain_killed_while_the_node_is_powered_off_is_finished_by_the_sweeps_cold_drain(fleet):
    """The smart plug is off when the run dies: nothing on the node can say so. The sweep reads the
    journal in the ledger, the killed run failed, and requests cold_drain_job: it keeps the AC off
    for the rest of cold_drain.off_s (the dead run's cycle, not a new one), turns it on, starts vLLM
    and validates: WEDGE RESOLVED, back in the gateway."""
    from spark_pipelines.core.fleet import load_fleet
    from spark_pipelines.resources.gateway import GatewayHost
    from spark_pipelines.resources.ssh import FleetSession
    from spark_pipelines.runbook import wedge
    from spark_sim import power

    c = fleet
    f = load_fleet(c.fleet)
    m = c.sim.node(NODE)
    c.sim.set_gpu(NODE, "wedged")
    try:
        with FleetSession(f) as s:
            wedge.quarantine_node(s, f.node(NODE), "wedged", "test", GatewayHost(s, master_key=os.environ["LITELLM_MASTER_KEY"]))
        with clients(c):
            k = Killed(c, "cold_drain_job").kill_when(lambda: ac_off(m), "the AC off", bound_s=400)
            fx.wait_for(lambda: journal_phase(c, "cold_drain") == "power-off", 10, "the journal of the AC off")
            off_at = next(p for p in procedures(c) if p["procedure"] == "cold_drain")["facts"]["ac_off_at"]
            assert power.is_off(m) and not fx._banner(m.ip)
            reqs = sweep_requests(c)
            assert [(r.job_name, r.run_key) for r in reqs] == [
                ("cold_drain_job", f"finish-{NODE}-cold_drain-{k.run_id[:8]}")], reqs
            res = run_request(c, reqs[0])
            assert res.success, failure_text(res)
            k.seconds_back("cold drain killed while powered off; the sweep's cold_drain_job")
        meta = {key: v.value for key, v in c.instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=dg.AssetKey("cold_drain"), asset_partitions=[NODE]), limit=1).records[0]
            .asset_materialization.metadata.items()}
        assert meta["verdict"] == "WEDGE RESOLVED", meta
        assert "the power cycle of the cold drain of run" in meta["steps"] and "not repeated" in meta["steps"], meta
        assert time.time() - off_at >= f.cold_drain.off_s
        assert_back(c)
    finally:
        c.sim.set_gpu(NODE, "healthy")
        if power.is_off(m):
            power.on(m)
        clean_ledger(c, NODE)


def ac_off(m: Any) -> bool:
    """The smart plug cut the AC (the sim's power file; `halted` is the OS down with AC on)."""
    try:
        return (m.dir / "power").read_text().strip() == "off"
    except OSError:
        return False


# -- a rollout ---------------------------------------------------------------------------------


NO_BENCH = {"ops": {"fleet_rollout": {"config": {"bench_gate": False}}}}  # health gates: the rerun is under test


def point(c: Chain, node: str) -> Path:
    return c.sim.node(node).home / ".cache" / "spark-pipelines" / "markers" / "rollout_point.json"


def test_a_rollout_killed_in_wave_1_is_finished_by_its_rerun_dead_canary_included(fleet):
    """Killed while wave 1 deploys spark2 (the canary spark1 passed): the rerun finishes spark2's
    dead deploy first (no wait behind its drain), rolls out to it, and finishes every node that
    passed, the dead run's canary included: no `-previous` container, no rollout point left."""
    from spark_pipelines.core.launch import DEPLOY_LABEL, launch_spec
    from spark_pipelines.core.fleet import load_fleet

    c = fleet
    path = c.variant("rollout-v2", lambda d: (d["launch"]["env"].__setitem__("SPARK_FAULT_SUITE", "rollout-v2"),
                                               d.setdefault("rollout", {}).__setitem__("deploy_wait_s", 60)))
    f = load_fleet(path)
    with clients(c):
        k = Killed(c, "rollout_job", fleet=path, partitioned=False, config=NO_BENCH).kill_when(
            lambda: (deploy_journal(c) or {}).get("phase") == "launching" and point(c, "spark1").exists(),
            "wave 1's deploy of spark2", bound_s=400)
        assert fx.container(c.sim.node("spark1"), f"{fx.CONTAINER}-previous") is not None  # the canary kept it
        started = time.monotonic()
        res = c.run("rollout_job", fleet=path, run_config=NO_BENCH)
        took = time.monotonic() - started
        assert res.success, failure_text(res)
        k.seconds_back("rollout killed in wave 1; rollout_job again")
    print(f"[dead runs] the rerun of the rollout took {took:.0f} s")
    for n in ("spark1", "spark2"):
        assert_back(c, n)
        live = fx.container(c.sim.node(n))
        assert live["Config"]["Labels"].get(DEPLOY_LABEL) == launch_spec(f, f.node(n)).fingerprint
        assert fx.container(c.sim.node(n), f"{fx.CONTAINER}-previous") is None, n
        assert not point(c, n).exists(), n
    waited = [e.user_message for e in c.instance.all_logs(res.run_id) if "waiting to drain" in e.user_message]
    assert not waited, waited[0]
    assert status(c, k.run_id) == dg.DagsterRunStatus.FAILURE


def test_a_wedged_canary_stays_out_after_the_rollouts_revert(fleet):
    """Issue 34 item 9: the canary's GPU wedged, its gate fails on the wedge; the revert puts the
    previous version back but keeps the node out: quarantined (wedged) with its bench's hold-out,
    as a bench_job leaves a wedged node; the other node is never touched."""
    c = fleet
    path = c.variant("rollout-wedged", lambda d: d["launch"]["env"].__setitem__("SPARK_FAULT_SUITE", "wedged-canary"))
    before = fx.container(c.sim.node("spark1"))["Id"]
    other = fx.container(c.sim.node("spark2"))["Id"]
    c.sim.set_gpu("spark1", "wedged")
    try:
        res = c.run("rollout_job", fleet=path)
        assert not res.success
        why = failure_text(res)
        assert "spark1" in why and "wedge" in why.lower(), why
        fx.assert_serving(c.sim, "spark1", before)  # the previous version back
        fx.assert_serving(c.sim, "spark2", other)  # never touched
        assert not routed(c, "spark1") and routed(c, "spark2")
        entry = ledger(c).get("spark1", {})
        assert entry.get("quarantine", {}).get("verdict") == "wedged", entry
        assert "cold_drain_job" in entry["quarantine"]["reason"] and "wedge" in entry["holds"]["bench"]["reason"]
        res = c.run("gateway_job")  # no gateway step puts it back
        assert res.success and not routed(c, "spark1")
    finally:
        c.sim.set_gpu("spark1", "healthy")
        clean_ledger(c, "spark1")
