"""node_health's policies against the simulated fleet (real sshd, dockerd, vLLM and GB10 stand-ins,
a real LiteLLM proxy) with a real Dagster instance: the verdicts, the run requests and their keys,
the restart budget, quarantine out of the real rotation, the reconcile back, the observations in
the instance, the cursor. The jobs the sensor asks for are executed in process where the test
needs their effect. Each test leaves both nodes serving and in the gateway.
"""

from __future__ import annotations

import json
import subprocess
import time

import dagster as dg
import pytest

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.definitions import build_definitions
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.core import healing
from spark_pipelines.runbook import quarantine, rotation as rotation_rb
from spark_pipelines.resources import engine
from tests.e2e.test_zz_doctor import inspect, production_aside, wait_serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def env(sim_fleet, tmp_path_factory):
    """Both serve nodes deployed and in the gateway; one instance for the module's jobs and sensor."""
    path = str(sim_fleet.fleet_file)
    fleet = load_fleet(path)
    root = tmp_path_factory.mktemp("healing-dagster")
    instance = dg.DagsterInstance.local_temp(str(root))
    defs = build_definitions(path)
    try:
        # Always, even when the nodes serve already (the modules before left them so): a deploy run
        # of this instance loads the checkpoint and image it recorded. Cheap: every step reuses
        # the build host's verified output.
        assert defs.resolve_job_def("build_job").execute_in_process(instance=instance).success
        if not all(engine.healthy(fleet, n) for n in fleet.serve_nodes):
            for n in fleet.serve_nodes:
                if not engine.healthy(fleet, n):
                    assert defs.resolve_job_def("deploy_node_job").execute_in_process(
                        instance=instance, partition_key=n.name).success
        assert defs.resolve_job_def("gateway_job").execute_in_process(instance=instance).success
        yield {"defs": defs, "instance": instance, "fleet": fleet, "sim": sim_fleet}
    finally:
        instance.dispose()


def tick(env, cursor=None):
    defs = env["defs"]
    sensor = defs.get_repository_def().get_sensor_def("node_health")
    with dg.build_sensor_context(instance=env["instance"], cursor=cursor, definitions=defs,
                                 resources={"ssh": defs.resources["ssh"]}) as context:
        started = time.monotonic()
        res = sensor(context)
        took = time.monotonic() - started
    assert took < 45, f"a node_health tick took {took:.0f} s (Dagster's limit is 60 s)"
    for event in res.asset_events:  # as the sensor daemon stores them
        env["instance"].report_runless_asset_event(event)
    return res


def run(env, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
    job = env["defs"].resolve_job_def(request.job_name)
    return job.execute_in_process(instance=env["instance"], partition_key=request.partition_key,
                                  run_config=request.run_config or None, tags=request.tags, raise_on_error=False)


def rotation(env) -> list[str]:
    with FleetSession(env["fleet"]) as s:
        return GatewayHost(s).rotation()


def latest_observation(env, node):
    recs = env["instance"].fetch_observations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey("node_deployment"), asset_partitions=[node]), limit=1).records
    return recs[0].asset_observation.metadata


def requests_of(res, job):
    return [r for r in res.run_requests if r.job_name == job]


def back_in_gateway(env, cursor):
    """Tick until the reconcile asks to put every node back, run it; both serve again."""
    for _ in range(5):
        res = tick(env, cursor)
        cursor = res.cursor
        asks = requests_of(res, "gateway_reconcile_job")
        if asks:
            assert run(env, asks[0]).success
        if set(rotation(env)) == {"spark1", "spark2"}:
            return cursor
        time.sleep(2)
    raise AssertionError(f"not back in the gateway: {rotation(env)}")


def test_healthy_fleet_is_recorded_with_figures_and_nothing_requested(env):
    res = tick(env)
    assert not res.run_requests, res.run_requests
    assert "spark1: healthy" in str(res.skip_reason) and "spark2: healthy" in str(res.skip_reason)
    res = tick(env, res.cursor)
    meta = latest_observation(env, "spark2")
    assert meta["verdict"].value == "healthy" and meta["in_gateway"].value is True
    assert meta["quarantined"].value == "no" and "/health 200" in meta["evidence"].value
    assert meta["requests_running"].value == 0 and meta["requests_waiting"].value == 0
    # A node nobody has sent a request since its start has drafted nothing: no rate, not a zero.
    assert "mtp_acceptance_pct" not in meta or 0 <= meta["mtp_acceptance_pct"].value <= 100
    assert "generation_tok_s" in meta and "tok/s generated over the last" in meta["engine"].value  # two reads


def test_a_reconcile_a_person_launches_plans_from_a_sweep_and_puts_a_healthy_node_back(env):
    """gateway_reconcile_job with no plan (launched from the UI): a sweep now decides."""
    with FleetSession(env["fleet"]) as s:
        gw = GatewayHost(s)
        rotation_rb.take_out(gw, "spark2", f"{healing.NOTE_PREFIX}engine-down on 2 sweeps in a row")
        try:
            assert gw.rotation() == ["spark1"]
            res = env["defs"].resolve_job_def("gateway_reconcile_job").execute_in_process(
                instance=env["instance"], raise_on_error=False)
            assert res.success, [e.message for e in res.all_events if e.is_failure]
            said = " ".join(r.user_message for r in env["instance"].all_logs(res.run_id))
            assert "spark2 put back" in said, said[-2000:]
            assert set(gw.rotation()) == {"spark1", "spark2"}
        finally:
            if "spark2" not in gw.rotation():
                rotation_rb.admit(gw, "spark2")


def test_killed_engine_is_redeployed_once_taken_out_and_reconciled_back(env):
    fleet = env["fleet"]
    name = fleet.launch_for(fleet.node("spark2")).container_name
    with FleetSession(fleet) as s:
        s.run("spark2", ["docker", "kill", name], log=False, timeout=60)
        try:
            first = tick(env)
            assert not requests_of(first, "deploy_node_job")  # one sweep is not enough
            assert latest_observation(env, "spark2")["verdict"].value == "engine-down"
            second = tick(env, first.cursor)
            redeploy = requests_of(second, "deploy_node_job")
            assert [r.partition_key for r in redeploy] == ["spark2"]
            assert redeploy[0].run_key.startswith("heal-spark2-") and redeploy[0].run_key.endswith("-redeploy1")
            out = requests_of(second, "gateway_reconcile_job")
            plan = out[0].run_config["ops"]["reconcile_gateway"]["config"]
            assert plan["take_out"] == [{"node": "spark2", "reason": "engine-down on 2 sweeps in a row", "dead": True}]
            assert run(env, out[0]).success
            assert rotation(env) == ["spark1"]  # the REAL proxy config
            # The same cursor again: the same run key (Dagster drops it), and from the new cursor none.
            again = tick(env, first.cursor)
            assert {r.run_key for r in requests_of(again, "deploy_node_job")} == {redeploy[0].run_key}
            third = tick(env, second.cursor)
            assert not requests_of(third, "deploy_node_job") and "backoff" in str(third.skip_reason)
            cursor = third.cursor
        finally:
            s.run("spark2", ["docker", "start", name], log=False, timeout=60)  # the redeploy, quickly
    wait_serving(fleet, "spark2")
    cursor = back_in_gateway(env, cursor)
    # The episode ended (the cursor keeps only what is set).
    assert json.loads(cursor)["nodes"].get("spark2", {}).get("since") is None


def test_the_fourth_failure_in_the_window_quarantines_and_gateway_job_keeps_it_out(env):
    fleet = env["fleet"]
    name = fleet.launch_for(fleet.node("spark2")).container_name
    # Three redeploys already in the window (the cursor is the sensor's memory).
    now = time.time()
    cursor = json.loads(tick(env).cursor)
    cursor["nodes"]["spark2"]["redeploys"] = [now - 3 * 3600, now - 2 * 3600, now - 3600]
    with FleetSession(fleet) as s:
        s.run("spark2", ["docker", "kill", name], log=False, timeout=60)
        try:
            res = tick(env, tick(env, json.dumps(cursor)).cursor)
            assert not requests_of(res, "deploy_node_job")
            q = requests_of(res, "quarantine_job")
            assert [r.partition_key for r in q] == ["spark2"]
            reason = q[0].run_config["ops"]["quarantine_node"]["config"]["reason"]
            assert "restart budget spent: 3 redeploy(s) in the last 6 h" in reason
            assert run(env, q[0]).success
            held = quarantine.quarantined(s)
            assert held["spark2"].verdict == "engine-down" and "restart budget" in held["spark2"].reason
            assert "spark2" not in rotation(env)
        finally:
            s.run("spark2", ["docker", "start", name], log=False, timeout=60)
        wait_serving(fleet, "spark2")
        # Healthy again, but quarantined: neither gateway_job nor the reconcile puts it back.
        assert env["defs"].resolve_job_def("gateway_job").execute_in_process(instance=env["instance"]).success
        assert "spark2" not in rotation(env)
        res = tick(env, res.cursor)
        assert not requests_of(res, "gateway_reconcile_job")
        meta = latest_observation(env, "spark2")
        assert meta["verdict"].value == "healthy" and "restart budget" in meta["quarantined"].value
        # Released by the operator's job: the reconcile takes it back.
        rel = env["defs"].resolve_job_def("release_quarantine_job").execute_in_process(
            instance=env["instance"], partition_key="spark2")
        assert rel.success and "spark2" not in quarantine.quarantined(s)
    back_in_gateway(env, res.cursor)


def test_crash_loop_is_quarantined_never_relaunched(env):
    fleet = env["fleet"]
    with production_aside(fleet) as (s, spec):
        argv = spec.docker_run_argv()
        s.run("spark2", argv[:3] + ["--restart", "on-failure:50"] + argv[3:] + ["--enable-prefix-caching"],
              log=False, timeout=120)
        deadline = time.monotonic() + 90
        while inspect(s, "spark2", spec.container_name)["RestartCount"] < 2 and time.monotonic() < deadline:
            time.sleep(1)
        res = tick(env, tick(env).cursor)
        assert latest_observation(env, "spark2")["verdict"].value == "crash-loop"
        assert not requests_of(res, "deploy_node_job")
        q = requests_of(res, "quarantine_job")
        assert [r.partition_key for r in q] == ["spark2"]
        assert q[0].run_config["ops"]["quarantine_node"]["config"]["verdict"] == "crash-loop"
        assert run(env, q[0]).success and "spark2" not in rotation(env)
        again = tick(env, res.cursor)
        assert not requests_of(again, "quarantine_job") and not requests_of(again, "deploy_node_job")
        quarantine.release(s, "spark2", by="test")
    back_in_gateway(env, again.cursor)


def test_residue_quarantine_blocks_the_deploy_until_memory_is_back(env):
    """The sim's residue leaves 96.5 GiB free (GX10 clean boot 106): the verdict quarantines; the
    deploy's preflight refuses with "reboot the node" while it lasts; after the "reboot" a deploy
    passes and releases the quarantine."""
    fleet, sim = env["fleet"], env["sim"]
    name = fleet.launch_for(fleet.node("spark2")).container_name
    with FleetSession(fleet) as s:
        sim.set_gpu("spark2", "residue")
        try:
            s.run("spark2", ["docker", "restart", "-t", "5", name], log=False, timeout=60)
            deadline = time.monotonic() + 60
            while inspect(s, "spark2", name)["State"]["Running"] and time.monotonic() < deadline:
                time.sleep(0.5)
            res = tick(env, tick(env).cursor)
            assert latest_observation(env, "spark2")["verdict"].value == "residue"
            q = requests_of(res, "quarantine_job")
            assert [r.partition_key for r in q] == ["spark2"] and not requests_of(res, "deploy_node_job")
            assert run(env, q[0]).success
            assert quarantine.quarantined(s)["spark2"].verdict == "residue"
            blocked = env["defs"].resolve_job_def("deploy_node_job").execute_in_process(
                instance=env["instance"], partition_key="spark2", raise_on_error=False)
            assert not blocked.success
            failure = " ".join(str(e.event_specific_data.error) for e in blocked.all_events if e.is_step_failure)
            assert "reboot the node" in failure and "clean-boot baseline" in failure, failure
            assert "spark2" in quarantine.quarantined(s)
        finally:
            sim.set_gpu("spark2", "healthy")  # the reboot
        done = env["defs"].resolve_job_def("deploy_node_job").execute_in_process(
            instance=env["instance"], partition_key="spark2", raise_on_error=False)
        assert done.success
        assert "spark2" not in quarantine.quarantined(s)  # a deploy whose preflight passed released it
    wait_serving(fleet, "spark2")
    back_in_gateway(env, res.cursor)


def test_unreachable_is_recorded_and_taken_out_after_two_sweeps(env):
    fleet, sim = env["fleet"], env["sim"]
    netns = sim.node("spark2").netns
    subprocess.run(["ip", "-n", netns, "link", "set", "eth0", "down"], check=True)
    try:
        first = tick(env)
        second = tick(env, first.cursor)
    finally:
        subprocess.run(["ip", "-n", netns, "link", "set", "eth0", "up"], check=True)
    meta = latest_observation(env, "spark2")
    assert meta["verdict"].value == "unreachable" and "hard-reset" in meta["advice"].value
    assert not [r for r in second.run_requests if r.job_name != "gateway_reconcile_job"]
    plan = requests_of(second, "gateway_reconcile_job")[0].run_config["ops"]["reconcile_gateway"]["config"]
    assert plan["take_out"] == [{"node": "spark2", "reason": "unreachable on 2 sweeps in a row", "dead": True}]
    wait_serving(fleet, "spark2", 60)


def test_regressed_requests_one_confirming_bench(env):
    for mean in (51.2, 52.0, 51.6, 41.0):
        env["instance"].report_runless_asset_event(dg.AssetMaterialization(
            "bench_results", partition="spark2",
            metadata={"mean_tok_s": mean, "gpu_under_load": "healthy", "spec_acceptance_rate": 0.95}))
    first = tick(env)
    res = tick(env, first.cursor)
    assert latest_observation(env, "spark2")["verdict"].value == "regressed"
    bench = requests_of(res, "bench_job")
    assert [r.partition_key for r in bench] == ["spark2"] and bench[0].run_key.endswith("-bench-confirm")
    later = tick(env, res.cursor)
    assert not requests_of(later, "bench_job") and "waiting for the confirming bench" in str(later.skip_reason)
    # A bench back at the node's level ends the episode.
    env["instance"].report_runless_asset_event(dg.AssetMaterialization(
        "bench_results", partition="spark2", metadata={"mean_tok_s": 51.8, "gpu_under_load": "healthy"}))
    final = tick(env, later.cursor)
    assert json.loads(final.cursor)["nodes"].get("spark2", {}).get("stage") is None
