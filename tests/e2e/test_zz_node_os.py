"""Phase 0 as code on the simulated fleet (real sshd, dockerd, LiteLLM proxy, Dagster; the sim's
systemd/sysctl/swap/dpkg stand-ins behave like DGX OS's): a node fresh out of the box (desktop
running, swap on, earlyoom installed) is provisioned, rebooted under a drain and verified while
clients stream through the gateway; the second run changes nothing; a node that does not come back
from its reboot within the bound is quarantined with the step and the runbook's advice. Named
test_zz_ to reuse what test_chain deployed; each test leaves the fleet serving."""

from __future__ import annotations

import os

import dagster as dg
import pytest
import yaml

from spark_pipelines.core import node_os as p0
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.definitions import build_definitions
from spark_pipelines.resources import engine
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.state import ledger, markers
from spark_sim import node_os as sim_os
from spark_sim import power
from spark_sim.gpu_states import CLEAN_FREE_GIB
from spark_sim.traffic import Clients

pytestmark = pytest.mark.slow
NODE = "spark2"
BOUND_S = 30  # node_os.reboot_ssh_timeout_s for these tests (the fleet default is the runbook's 10 min)


@pytest.fixture(scope="module")
def instance():
    with dg.instance_for_test() as inst:
        yield inst


@pytest.fixture(scope="module")
def fleet_file(sim_fleet, instance, tmp_path_factory):
    """The sim's fleet with a short reboot bound, both nodes serving and in the gateway."""
    doc = yaml.safe_load(sim_fleet.fleet_file.read_text())
    doc["node_os"] = {"reboot_ssh_timeout_s": BOUND_S}
    path = tmp_path_factory.mktemp("node_os") / "fleet.yaml"
    path.write_text(yaml.safe_dump(doc))
    fleet = load_fleet(str(path))
    defs = build_definitions(str(path))
    if not all(engine.healthy(fleet, n) for n in fleet.serve_nodes):
        assert defs.resolve_job_def("build_job").execute_in_process(instance=instance).success
        for n in fleet.serve_nodes:
            if not engine.healthy(fleet, n):
                assert defs.resolve_job_def("deploy_node_job").execute_in_process(
                    instance=instance, partition_key=n.name).success
    with FleetSession(fleet) as s:
        if set(GatewayHost(s).rotation()) != {"spark1", "spark2"}:
            assert defs.resolve_job_def("gateway_job").execute_in_process(instance=instance).success
    return str(path)


def run_node_os(fleet_file, instance, check=False):
    defs = build_definitions(fleet_file)
    return defs.resolve_job_def("node_os_job").execute_in_process(
        instance=instance, partition_key=NODE, raise_on_error=False,
        run_config={"ops": {"node_os": {"config": {"check": check}}}})


def last_metadata(instance) -> dict:
    rec = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("node_os"), asset_partitions=[NODE]), limit=1).records[0]
    return {k: v.value for k, v in rec.asset_materialization.metadata.items()}


def test_a_fresh_node_is_provisioned_rebooted_and_verified_and_a_second_run_changes_nothing(
        fleet_file, instance, sim_fleet):
    m = sim_fleet.node(NODE)
    sim_os.fresh(m.dir)
    before = sim_os.show(m.dir)
    assert before["default_target"] == "graphical.target" and before["swaps"] and before["packages"]["earlyoom"]

    checked = run_node_os(fleet_file, instance, check=True)
    assert checked.success
    # A check is an observation of the node, never a materialization (issue 35, item 3).
    assert not [e for e in checked.all_events if e.event_type_value == "ASSET_MATERIALIZATION"]
    (seen,) = [e.event_specific_data.asset_observation for e in checked.all_events
               if e.event_type_value == "ASSET_OBSERVATION"]
    plan = {k: v.value for k, v in seen.metadata.items()}
    assert plan["mode"].startswith("check") and plan["changes"] > 30 and plan["rebooted"] is False
    assert "service gdm3: enabled -> masked" in plan["planned"]
    assert "package earlyoom: installed -> purged" in plan["planned"]
    assert sim_os.show(m.dir) == before  # check mode touched nothing

    fleet = load_fleet(fleet_file)
    with Clients(sim_fleet, os.environ["LITELLM_MASTER_KEY"], every_s=0.5, max_tokens=32) as traffic:
        result = run_node_os(fleet_file, instance)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    assert traffic.failed == [], traffic.failed
    assert len(traffic.streams.results) >= 10
    print(f"node_os under traffic: {len(traffic.streams.results)} client requests, 0 failed")
    done = last_metadata(instance)
    assert done["mode"] == "applied" and done["rebooted"] is True
    after = sim_os.show(m.dir)
    assert after["default_target"] == p0.HEADLESS_TARGET
    assert not after["swaps"] and not after["packages"]["earlyoom"]
    assert after["sysctl"] == {**after["sysctl"], **p0.SYSCTLS}
    assert after["units"]["gdm3"] == "masked" and not after["active"]["gdm3"]
    # the memcheck after the reboot, the desktop's memory back: the node's own baseline
    assert done["clean_boot_free_gib"] == pytest.approx(CLEAN_FREE_GIB["gx10"], abs=0.5)
    with FleetSession(fleet) as s:
        mark = markers.read_clean_boot(s, fleet.node(NODE))
        assert mark is not None and mark.free_gib == done["clean_boot_free_gib"]
        assert NODE in GatewayHost(s, master_key=os.environ["LITELLM_MASTER_KEY"]).rotation()
    assert engine.healthy(fleet, fleet.node(NODE))

    again = run_node_os(fleet_file, instance)
    assert again.success
    second = last_metadata(instance)
    assert second["changes"] == 0 and second["rebooted"] is False


def test_a_node_that_does_not_come_back_is_quarantined_with_the_step_and_the_advice(fleet_file, instance, sim_fleet):
    m = sim_fleet.node(NODE)
    fleet = load_fleet(fleet_file)
    with FleetSession(fleet) as s:  # one unit unmasked by hand: Phase 0 must reboot again
        s.run(NODE, ["systemctl", "unmask", "gdm3"], sudo=True, timeout=30)
        s.run(NODE, ["systemctl", "enable", "gdm3"], sudo=True, timeout=30)
    sim_os.set_reboot_hangs(m.dir, True)
    try:
        result = run_node_os(fleet_file, instance)
        assert not result.success
        (failure,) = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
        message = failure.event_specific_data.error.message
        assert f"did not answer SSH within {BOUND_S} s of its Phase 0 reboot (step: reboot)" in message
        assert "hard reset" in message
        with FleetSession(fleet) as s:
            held = ledger.quarantined(s)[NODE]
            assert held.verdict == "unreachable" and held.by == "node_os"
            assert NODE not in GatewayHost(s, master_key=os.environ["LITELLM_MASTER_KEY"]).rotation()
            assert "spark1" in GatewayHost(s, master_key=os.environ["LITELLM_MASTER_KEY"]).rotation()
    finally:  # the hard reset the advice asks for, then Phase 0 again and the node serving
        sim_os.set_reboot_hangs(m.dir, False)
        power.off(m)
        power.on(m)
        with FleetSession(fleet) as s:
            ledger.end_quarantine(s, NODE)
        assert run_node_os(fleet_file, instance).success
        n = fleet.node(NODE)
        with FleetSession(fleet) as s:  # its engine was stopped for the reboot that never came back
            if not engine.healthy(fleet, n):
                s.run(NODE, ["docker", "start", fleet.launch_for(n).container_name], timeout=60)
                assert engine.wait_healthy(fleet, n, 120)
            gw = GatewayHost(s, master_key=os.environ["LITELLM_MASTER_KEY"])
            if NODE not in gw.rotation():
                gw.restore(NODE)

def test_add_node_takes_a_new_node_from_nothing_to_benched_and_in_the_gateway(fleet_file, instance, sim_fleet,
                                                                               tmp_path):
    key = os.environ["LITELLM_MASTER_KEY"]
    defs2 = build_definitions(fleet_file)
    if instance.get_latest_materialization_event(dg.AssetKey("serving_image")) is None:
        assert defs2.resolve_job_def("build_job").execute_in_process(instance=instance).success  # skips: built
    m = sim_fleet.add_node()
    sim_os.fresh(m.dir)  # out of the box: desktop running, swap on, earlyoom installed
    doc = yaml.safe_load(open(fleet_file).read())
    doc["nodes"].append({**doc["nodes"][1], "name": m.name, "host": m.ip, "user": m.user, "home": str(m.home)})
    plug = doc["cold_drain"]["smart_plugs"]["spark2"]
    doc["cold_drain"]["smart_plugs"][m.name] = {k: [*v[:-2], m.name, v[-1]] for k, v in plug.items()}
    grown = tmp_path / "fleet-grown.yaml"
    grown.write_text(yaml.safe_dump(doc))
    fleet = load_fleet(str(grown))
    defs = build_definitions(str(grown))
    with FleetSession(fleet) as s:
        serving_before = {n: engine.healthy(fleet, fleet.node(n)) for n in ("spark1", "spark2")}
        containers = {n: s.run(n, ["docker", "inspect", "--format", "{{.Id}}", fleet.launch_for(fleet.node(n)).container_name],
                               timeout=30).stdout.strip() for n in ("spark1", "spark2")}
    assert all(serving_before.values())
    try:
        with Clients(sim_fleet, key, every_s=0.5, max_tokens=32) as traffic:
            result = defs.resolve_job_def("add_node_job").execute_in_process(
                instance=instance, partition_key=m.name, raise_on_error=False)
        assert result.success, [e.message for e in result.all_events if e.is_failure]
        assert traffic.failed == [], traffic.failed
        assert len(traffic.streams.results) >= 10
        print(f"add_node under traffic: {len(traffic.streams.results)} client requests, 0 failed")
        joined = {k: v.value for k, v in instance.fetch_materializations(
            dg.AssetRecordsFilter(asset_key=dg.AssetKey("node_join"), asset_partitions=[m.name]),
            limit=1).records[0].asset_materialization.metadata.items()}
        assert joined["in_gateway"] is True
        assert "Phase 0:" in joined["steps"] and "rebooted" in joined["steps"] and "bench:" in joined["steps"]
        for asset in ("node_os", "node_artifacts", "node_deployment", "bench_results"):
            assert instance.fetch_materializations(dg.AssetRecordsFilter(
                asset_key=dg.AssetKey(asset), asset_partitions=[m.name]), limit=1).records, asset
        after = sim_os.show(m.dir)
        assert after["default_target"] == p0.HEADLESS_TARGET and not after["swaps"] and not after["packages"]["earlyoom"]
        with FleetSession(fleet) as s:
            assert set(GatewayHost(s, master_key=key).rotation()) == {"spark1", "spark2", m.name}
            # the serving nodes were not touched: same containers, never out of the gateway
            for n, cid in containers.items():
                assert s.run(n, ["docker", "inspect", "--format", "{{.Id}}",
                                 fleet.launch_for(fleet.node(n)).container_name], timeout=30).stdout.strip() == cid
        # a node already in the gateway is refused, nothing changed
        again = defs.resolve_job_def("add_node_job").execute_in_process(
            instance=instance, partition_key=m.name, raise_on_error=False)
        assert not again.success
        (failure,) = [e for e in again.all_events if e.event_type_value == "STEP_FAILURE"]
        assert "already serves in the gateway" in failure.event_specific_data.error.message
    finally:  # the session's other tests know two nodes: the newcomer leaves the gateway and stops
        assert defs2.resolve_job_def("gateway_job").execute_in_process(instance=instance).success
        with FleetSession(load_fleet(fleet_file)) as s:
            assert set(GatewayHost(s, master_key=key).rotation()) == {"spark1", "spark2"}
        power.off(m)
