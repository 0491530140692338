"""The PD-firmware wedge policy on the simulated fleet (real sshd, dockerd, LiteLLM proxy and Dagster
instance; GB10 and vLLM stand-ins): wedge_watch requests the capture for a node wedged under live
traffic, the capture quarantines it out of the real LiteLLM rotation and stores its tarball on the
build host, the clock lock is reset on every path, and cold_drain_job with the sim's smart plug ends
in WEDGE RESOLVED (the brick re-negotiated) or WEDGE PERSISTS (kept wedged). Each test leaves the
fleet serving with both nodes in the gateway (named test_zz_ to reuse what test_chain deployed).
"""

from __future__ import annotations

import _thread
import io
import json
import os
import tarfile
import threading
import time
from datetime import UTC, datetime

import dagster as dg
import pytest
import yaml

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.definitions import build_definitions
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook import wedge
from spark_pipelines.resources import engine
from spark_pipelines.state import ledger
from tests.plugins.traffic import Traffic

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def instance():
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture(scope="module")
def fleet_file(sim_fleet, instance):
    """The sim's fleet with both nodes serving and in the gateway (deployed here when no earlier test did)."""
    path = str(sim_fleet.fleet_file)
    fleet = load_fleet(path)
    defs = build_definitions(path)
    if not all(engine.healthy(fleet, n) for n in fleet.serve_nodes):
        assert defs.resolve_job_def("build_job").execute_in_process(instance=instance).success
        for n in fleet.serve_nodes:
            if not engine.healthy(fleet, n):
                assert defs.resolve_job_def("deploy_node_job").execute_in_process(
                    instance=instance, partition_key=n.name).success
    with FleetSession(fleet) as s:
        if set(GatewayHost(s).rotation()) != {"spark1", "spark2"}:
            assert defs.resolve_job_def("gateway_job").execute_in_process(instance=instance).success
    return path


def gateway(s: FleetSession) -> GatewayHost:
    return GatewayHost(s, master_key=os.environ.get("LITELLM_MASTER_KEY"))


def gpu_state(sim_fleet, node="spark2") -> dict:
    return json.loads(sim_fleet.node(node).gpu_state_file.read_text())


def latest(instance, asset, partition="spark2"):
    rec = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]), limit=1).records[0]
    return {k: v.value for k, v in rec.asset_materialization.metadata.items()}


def put_back(fleet_file, sim_fleet, node="spark2"):
    """After a test: the GPU clean, the container serving, the hold-out lifted, the node in the gateway."""
    sim_fleet.set_gpu(node, "healthy")
    fleet = load_fleet(fleet_file)
    n = fleet.node(node)
    with FleetSession(fleet) as s:
        if not engine.healthy(fleet, n):
            s.run(node, ["docker", "start", fleet.launch_for(n).container_name], check=False, timeout=60)
            assert engine.wait_healthy(fleet, n, 120)
        ledger.end_quarantine(s, node)
        ledger.lift(s, node, *ledger.read(s).entry(node).holds)
        gw = gateway(s)
        if node not in gw.rotation():
            gw.restore(node)


def test_wedge_watch_requests_the_capture_and_the_capture_quarantines(fleet_file, instance, sim_fleet):
    fleet = load_fleet(fleet_file)
    defs = build_definitions(fleet_file)
    watch = defs.get_repository_def().get_sensor_def("wedge_watch")

    def tick(cursor):
        with dg.build_sensor_context(cursor=cursor, definitions=defs, instance=instance,
                                     resources={"ssh": defs.resources["ssh"]}) as context:
            return watch(context)

    def judged(cursor):
        """The next tick that judged spark2's GPU: one read between two requests (idle, no live
        request) decides nothing and leaves the episode as it was, so it is read again."""
        for _ in range(6):
            result = tick(cursor)
            said = result.skip_reason.skip_message if result.skip_reason else ""
            if not any(f"spark2: {s}" in said for s in ("idle", "unknown", "no live requests")):
                return result
            assert not result.run_requests, said
            cursor = result.cursor
        raise AssertionError(f"spark2 never judged under live traffic: {said}")

    sim_fleet.set_gpu("spark2", "wedged")
    try:
        with Traffic(fleet):
            first = judged(None)
            second = judged(first.cursor)
            third = judged(second.cursor)  # the same episode: never requested twice
        assert not first.run_requests and "spark2: wedged tick 1 of 2" in first.skip_reason.skip_message
        assert len(second.run_requests) == 1, second.skip_reason
        (request,) = second.run_requests
        assert request.job_name == "wedge_capture_job" and request.partition_key == "spark2"
        assert request.run_key.startswith("wedge-spark2-") and "708 MHz" in request.tags["evidence"]
        assert not third.run_requests and "already requested" in third.skip_reason.skip_message

        started = datetime.now(UTC)
        result = defs.resolve_job_def("wedge_capture_job").execute_in_process(
            instance=instance, partition_key="spark2", tags=request.tags)
        assert result.success
        meta = latest(instance, "wedge_evidence")
        with FleetSession(fleet) as s:
            gw = gateway(s)
            # The REAL proxy no longer routes to spark2 (its /model/info), and the config says why.
            assert "spark2" not in gw.serving_nodes() and "spark1" in gw.serving_nodes()
            assert "spark2" in gw.read().drains and "quarantined (wedged)" in gw.read().drains["spark2"]
            held = ledger.read(s).entry("spark2").quarantine
            tarball = s.read_bytes("spark1", meta["tarball"])  # on the build host, off the node
        assert held is not None and held.verdict == "wedged" and "708 MHz" in held.reason
        assert f"/wedge-evidence/{started:%Y-%m-%d}/spark2-wedge-evidence-pre-drain-" in meta["tarball"]
        assert meta["wedge_confirmed"] is True and meta["clock_lock_test"] == "ignored"
        assert meta["gpu_under_load"] == "wedged" and meta["stored_on"] == "spark1"

        with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
            files = {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers()}
        rows = {r.data["file"]: r.data for r in meta["manifest"].records}
        assert set(rows) | {"MANIFEST.sha256"} == set(files)
        for name, row in rows.items():  # the manifest in the metadata is the tarball's content
            assert row["bytes"] == len(files[name])
            assert f"{row['sha256']}  {name}" in files["MANIFEST.sha256"].decode()
        for name in ("nvidia-smi-q.txt", "kernel.log", "bios.txt", "container.log", "lock-test.txt", "VERDICT.txt"):
            assert name in files, sorted(files)
        assert b"Product Name" in files["nvidia-smi-q.txt"] and b"NVIDIA GB10" in files["nvidia-smi-q.txt"]
        assert b"SW Power Capping" in files["nvidia-smi-perf-load-1.txt"]
        assert b"Application startup complete" in files["container.log"]
        lock = files["lock-test.txt"].decode()
        assert "GPU clocks set to" in lock and "verdict: ignored" in lock and "708 MHz" in lock
        assert "CONFIRMED" in files["VERDICT.txt"].decode()
        commands = files["commands.txt"].decode()
        assert commands.index("nvidia-smi -q") < commands.index("-lgc 2418,3003") < commands.index("nvidia-smi -rgc")
        assert gpu_state(sim_fleet)["locked_clocks"] is None  # the lock test's undo ran
    finally:
        put_back(fleet_file, sim_fleet)


def test_the_clock_lock_is_reset_when_the_capture_is_interrupted(fleet_file, sim_fleet):
    """A run terminated in the middle of the lock test (the interrupt lands while the clocks are
    locked): -rgc still runs, and the interruption propagates."""
    fleet = load_fleet(fleet_file)
    node = fleet.node("spark2")
    seen_locked = threading.Event()

    def interrupt_when_locked():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if gpu_state(sim_fleet).get("locked_clocks"):
                seen_locked.set()
                _thread.interrupt_main()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=interrupt_when_locked, daemon=True)
    with FleetSession(fleet) as s:
        watcher.start()
        with pytest.raises(KeyboardInterrupt):
            wedge.capture_evidence(s, node)
        ran = [r.argv for r in s.commands]
    watcher.join(5)
    assert seen_locked.is_set()
    assert ("nvidia-smi", "-lgc", "2418,3003") in ran and ran[-1] == ("nvidia-smi", "-rgc")
    assert gpu_state(sim_fleet)["locked_clocks"] is None


def variant(fleet_file, tmp_path, change) -> str:
    data = yaml.safe_load(open(fleet_file))
    change(data)
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def cold_drain(path, instance):
    return build_definitions(path).resolve_job_def("cold_drain_job").execute_in_process(
        instance=instance, partition_key="spark2", raise_on_error=False)


def test_cold_drain_with_the_smart_plug_resolves_the_wedge(fleet_file, instance, sim_fleet):
    fleet = load_fleet(fleet_file)
    sim_fleet.set_gpu("spark2", "wedged")
    try:
        with FleetSession(fleet) as s:
            said = wedge.quarantine_node(s, fleet.node("spark2"), "wedged", "test", gateway(s))
            assert said == "spark2 taken out of the gateway (quarantined: wedged)", said
        result = cold_drain(fleet_file, instance)
        assert result.success
        meta = latest(instance, "cold_drain")
        assert meta["verdict"] == "WEDGE RESOLVED", meta
        assert gpu_state(sim_fleet)["state"] == "healthy"  # the brick re-negotiated: the sim's plug cycle
        assert "smart plug off" in meta["steps"] and "smart plug on" in meta["steps"]
        assert "sudo poweroff" in meta["steps"] and meta["drain_seconds"] >= fleet.cold_drain.off_s
        with FleetSession(fleet) as s:
            assert "spark2" in gateway(s).serving_nodes()  # back in the real rotation
            led = ledger.read(s)
            verdict = s.read_text("spark1", meta["verdict_file"])
            assert s.exists("spark1", meta["post_drain_tarball"])
        assert led.promoted("spark2")  # the validation ended the quarantine
        assert verdict.startswith("WEDGE RESOLVED\n") and "MHz" in verdict
        assert engine.healthy(fleet, fleet.node("spark2"))
    finally:
        put_back(fleet_file, sim_fleet)


def test_cold_drain_that_does_not_clear_the_wedge_persists(fleet_file, instance, sim_fleet, tmp_path):
    def keep_wedged(data):
        data["cold_drain"]["smart_plugs"]["spark2"]["on_command"].append("--keep-wedged")

    path = variant(fleet_file, tmp_path, keep_wedged)
    fleet = load_fleet(path)
    sim_fleet.set_gpu("spark2", "wedged")
    try:
        result = cold_drain(path, instance)  # spark2 is in the gateway: the drain quarantines it first
        assert result.success
        meta = latest(instance, "cold_drain")
        assert meta["verdict"] == "WEDGE PERSISTS", meta
        assert "ASUS support ticket" in meta["next"] and "PD firmware >= 5.8" in meta["next"]
        assert gpu_state(sim_fleet)["state"] == "wedged" and gpu_state(sim_fleet)["locked_clocks"] is None
        with FleetSession(fleet) as s:
            assert "spark2" not in gateway(s).serving_nodes() and "spark1" in gateway(s).serving_nodes()
            held = ledger.read(s).entry("spark2").quarantine
            assert s.read_text("spark1", meta["verdict_file"]).startswith("WEDGE PERSISTS\n")
        assert held is not None and "WEDGE PERSISTS" in held.reason
    finally:
        put_back(fleet_file, sim_fleet)


def test_cold_drain_without_a_plug_asks_the_operator_and_waits(fleet_file, instance, sim_fleet, tmp_path):
    """No smart plug in the fleet file: the run tells the operator to unplug at the wall and waits for
    the node to go down and come back; here the test is the operator (the sim's AC off, then on)."""
    from spark_sim import power

    def no_plug(data):
        data["cold_drain"]["smart_plugs"] = {}
        data["cold_drain"]["operator_timeout_s"] = 300

    path = variant(fleet_file, tmp_path, no_plug)
    m = sim_fleet.node("spark2")
    sim_fleet.set_gpu("spark2", "wedged")
    done = threading.Event()

    def operator():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not done.is_set():
            if power.is_off(m) and not wedge.ssh_answers(load_fleet(path).node("spark2")):
                power.off(m)
                time.sleep(2)
                power.on(m)
                return
            time.sleep(0.5)

    helper = threading.Thread(target=operator, daemon=True)
    helper.start()
    try:
        result = cold_drain(path, instance)
        done.set()
        helper.join(30)
        assert result.success
        meta = latest(instance, "cold_drain")
        assert meta["verdict"] == "WEDGE RESOLVED", meta
        assert "operator power-cycled spark2 at the wall" in meta["steps"] and "smart plug" not in meta["steps"]
        said = [e.user_message for e in instance.all_logs(result.run_id) if "OPERATOR:" in (e.user_message or "")]
        assert said and "FROM THE WALL" in said[0] and "90-120 s" in said[0]
    finally:
        done.set()
        put_back(fleet_file, sim_fleet)
