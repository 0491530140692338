"""node_health: the sweep every tick, each verdict recorded in the instance (an observation and a
partitioned `health` check per node), the policies' run requests once per episode, a cursor that
survives its older format.

/health is a real HTTP server on loopback and SSH a real connect to a closed loopback port (the
node is unreachable); the policy wiring is driven by sweep reports the test writes (the sim-fleet
tests in tests/e2e/test_zz_healing.py drive the same sensor through real states)."""

import json
import socket

import dagster as dg
import paramiko
import pytest
import yaml

from spark_pipelines.core import health, steps
from spark_pipelines.definitions import build_definitions
from spark_pipelines.resources.gateway import Snapshot
from spark_pipelines.runbook import reconcile, sweep
from spark_pipelines.sensors import health as sensor_mod
from tests.unit.test_sensors import vllm_health  # noqa: F401  (fixture)

KEYS = {"verdict", "evidence", "advice", "in_gateway", "quarantined"}


@pytest.fixture()
def defs(tmp_path, seed_data, vllm_health):  # noqa: F811
    port, state = vllm_health
    so = socket.socket()
    so.bind(("127.0.0.1", 0))
    closed = so.getsockname()[1]
    so.close()
    key = tmp_path / "id_rsa"
    paramiko.RSAKey.generate(1024).write_private_key_file(str(key))
    (tmp_path / "known_hosts").write_text("")
    for target in [*seed_data["nodes"], seed_data["gateway"]]:
        target.update(host="127.0.0.1", port=closed, key_path=str(key), known_hosts=str(tmp_path / "known_hosts"))
    seed_data["launch"]["port"] = port
    p = tmp_path / "fleet.yaml"
    p.write_text(yaml.safe_dump(seed_data, sort_keys=False))
    return build_definitions(str(p)), state


def tick(defs, instance, cursor=None):
    """One evaluation, its asset events stored the way the sensor daemon stores them."""
    s = defs.get_repository_def().get_sensor_def("node_health")
    with dg.build_sensor_context(instance=instance, cursor=cursor, definitions=defs,
                                 resources={"ssh": defs.resources["ssh"]}) as context:
        res = s(context)
    for event in res.asset_events:
        instance.report_runless_asset_event(event)
    return res


def observations(instance, node):
    return [r.asset_observation.metadata for r in instance.fetch_observations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("node_deployment"), asset_partitions=[node]), limit=20).records]


def test_unreachable_nodes_are_recorded_not_acted_on(defs):
    defs, state = defs
    with dg.instance_for_test() as instance:
        res = tick(defs, instance)
        assert not res.run_requests
        skip = str(res.skip_reason)
        assert "spark1: unreachable" in skip and "spark2: unreachable" in skip and "gateway not read" in skip
        obs = observations(instance, "spark2")
        assert len(obs) == 1 and KEYS <= set(obs[0])
        assert obs[0]["verdict"].value == "unreachable" and obs[0]["evidence"].value.startswith("SSH: NodeUnreachable")
        assert obs[0]["quarantined"].value == "no" and obs[0]["in_gateway"].value is False
        state["up"] = False
        res = tick(defs, instance, res.cursor)
        cursor = json.loads(res.cursor)
        assert cursor["nodes"]["spark2"]["failing"] == 2 and cursor["nodes"]["spark2"]["streak"] == 2
        assert len(res.cursor) < 600, res.cursor  # two nodes' memory, shown on the sensor's page
        latest = observations(instance, "spark2")[0]
        assert "SSH dead for" in latest["evidence"].value  # the first sweep's time carried over
        history = instance.event_log_storage.get_asset_check_execution_history(
            dg.AssetCheckKey(dg.AssetKey("node_deployment"), "health"), limit=10)
        nodes = [r.event.dagster_event.event_specific_data.metadata["node"].value for r in history]
        assert sorted(nodes) == ["spark1", "spark1", "spark2", "spark2"]
        assert all(r.event.dagster_event.event_specific_data.passed is False for r in history)


def test_an_old_cursor_is_read(defs):
    defs, _ = defs
    with dg.instance_for_test() as instance:
        res = tick(defs, instance, json.dumps({"spark1": {"failures": 2, "since": 1000, "requested": True}, "spark2": 3}))
        assert set(json.loads(res.cursor)["nodes"]) == {"spark1", "spark2"}
        res = tick(defs, instance, "not json")
        assert json.loads(res.cursor)["nodes"]["spark1"]["streak"] == 1


def report(node, verdict, health_ok=False):
    obs = health.Observation(node=node, probed_at=0.0, ssh_ok=True, health_ok=health_ok,
                             container=health.ContainerState(exists=True, status="exited"))
    return sweep.NodeReport(obs, health.NodeVerdict(node, verdict, (f"{verdict} evidence",), health.ADVICE[verdict]))


@pytest.fixture()
def scripted(monkeypatch):
    """The sweep's verdicts and the gateway's state as the test says (the policy wiring under test)."""
    verdicts = {"spark1": "healthy", "spark2": "engine-down"}
    rotation = ["spark1", "spark2"]

    def fake_sweep(s, nodes=None, **kw):
        return {n: report(n, v, health_ok=v == "healthy") for n, v in verdicts.items()}

    def fake_view(s, healthy):
        cfg = {"model_list": [{"model_name": "fast", "model_info": {"spark_pipelines_node": n}} for n in rotation]}
        return reconcile.View(Snapshot(cfg), {}, {n: True for n in healthy})

    monkeypatch.setattr(sweep, "sweep", fake_sweep)
    monkeypatch.setattr(reconcile, "read_view", fake_view)
    return verdicts


def test_engine_down_is_redeployed_once_per_episode_and_the_gateway_reconciled(defs, scripted):
    defs, _ = defs
    with dg.instance_for_test() as instance:
        first = tick(defs, instance)
        assert not first.run_requests and "engine-down on 1 of 2 sweeps" in str(first.skip_reason)
        second = tick(defs, instance, first.cursor)
        by_job = {r.job_name: r for r in second.run_requests}
        assert set(by_job) == {"deploy_node_job", "gateway_reconcile_job"}
        redeploy = by_job["deploy_node_job"]
        assert redeploy.partition_key == "spark2" and redeploy.run_key.startswith("heal-spark2-")
        assert redeploy.run_key.endswith("-redeploy1") and redeploy.tags["reason"] == "health-engine-down"
        plan = by_job["gateway_reconcile_job"].run_config["ops"]["reconcile_gateway"]["config"]
        assert plan == {"take_out": [{"node": "spark2", "reason": "engine-down on 2 sweeps in a row", "dead": True}],
                        "put_back": []}
        job = defs.resolve_job_def("gateway_reconcile_job")
        assert dg.validate_run_config(job, by_job["gateway_reconcile_job"].run_config)
        # Later ticks of the same episode: no second redeploy (backoff), no second reconcile request.
        cursor = second.cursor
        for _ in range(3):
            res = tick(defs, instance, cursor)
            cursor = res.cursor
            assert not res.run_requests, res.run_requests
        assert "backoff" in str(res.skip_reason)
        obs = observations(instance, "spark2")
        assert len(obs) == 5 and obs[0]["policy"].value.startswith("engine-down on 5 sweeps: backoff")


def test_a_failed_reconcile_is_asked_again_after_a_short_doubling_wait(defs, scripted, monkeypatch):
    defs, _ = defs
    clock = [2_000_000_000.0]
    monkeypatch.setattr(sensor_mod.time, "time", lambda: clock[0])

    @dg.op
    def refused():
        raise RuntimeError("the proxy reload failed (simulated)")

    @dg.job
    def failed_reconcile():
        refused()

    def fail(request):  # its run failed (the reload refused while the gateway-reload fault held)
        assert not failed_reconcile.execute_in_process(instance=instance, raise_on_error=False,
                                                       tags={steps.RUN_KEY_TAG: request.run_key}).success

    def reconciles(res):
        return [r for r in res.run_requests if r.job_name == "gateway_reconcile_job"]

    def at(seconds, cursor):
        clock[0] = 2_000_000_000.0 + seconds
        return tick(defs, instance, cursor)

    with dg.instance_for_test() as instance:
        res = at(0, at(0, None).cursor)
        (asked,) = reconciles(res)
        res = at(5, res.cursor)
        assert not reconciles(res)  # its run not ended (here: not even started): not asked again
        fail(asked)
        res = at(10, res.cursor)
        assert not reconciles(res)  # failed, but 15 s have not passed since it was asked
        res = at(16, res.cursor)
        (retry,) = reconciles(res)  # the same plan, asked again in seconds, not after 10 minutes
        plans = [r.run_config["ops"]["reconcile_gateway"]["config"] for r in (asked, retry)]
        assert retry.run_key != asked.run_key and [[t["node"] for t in p["take_out"]] for p in plans] == [["spark2"]] * 2
        fail(retry)
        res = at(40, res.cursor)
        assert not reconciles(res)  # the second failure waits 30 s
        res = at(47, res.cursor)
        (third,) = reconciles(res)
        assert len({asked.run_key, retry.run_key, third.run_key}) == 3
        res = at(300, res.cursor)
        assert not reconciles(res)  # not failed (not ended): the 10-minute wait
        (later,) = reconciles(at(700, res.cursor))
        assert later.run_key.endswith("-4")


def test_crash_loop_requests_a_quarantine_with_a_valid_run_config(defs, scripted):
    defs, _ = defs
    scripted["spark2"] = "crash-loop"
    with dg.instance_for_test() as instance:
        res = tick(defs, instance, tick(defs, instance).cursor)
        q = next(r for r in res.run_requests if r.job_name == "quarantine_job")
        assert q.partition_key == "spark2" and q.run_key.endswith("-quarantine")
        config = q.run_config["ops"]["quarantine_node"]["config"]
        assert config["verdict"] == "crash-loop" and "relaunching cannot help" in config["reason"]
        assert dg.validate_run_config(defs.resolve_job_def("quarantine_job"), q.run_config)
        again = tick(defs, instance, res.cursor)
        assert not [r for r in again.run_requests if r.job_name == "quarantine_job"]


def test_recovery_ends_the_episode_and_the_next_one_has_its_own_key(defs, scripted, monkeypatch):
    defs, _ = defs
    clock = [2_000_000_000.0]
    monkeypatch.setattr(sensor_mod.time, "time", lambda: clock[0])
    with dg.instance_for_test() as instance:
        res = tick(defs, instance, tick(defs, instance).cursor)
        first = {r.run_key for r in res.run_requests if r.job_name == "deploy_node_job"}
        assert first == {"heal-spark2-2000000000-redeploy1"}
        scripted["spark2"] = "healthy"
        res = tick(defs, instance, res.cursor)
        assert json.loads(res.cursor)["nodes"]["spark2"].get("since") is None  # a fresh memory keeps no since
        clock[0] += 3600  # past the 10 min backoff
        scripted["spark2"] = "engine-down"
        res = tick(defs, instance, tick(defs, instance, res.cursor).cursor)
        second = [r for r in res.run_requests if r.job_name == "deploy_node_job"]
        assert [r.run_key for r in second] == ["heal-spark2-2000003600-redeploy1"]
        assert json.loads(res.cursor)["nodes"]["spark2"]["redeploys"] == [2_000_000_000.0, 2_000_003_600.0]


def test_a_regressed_redeploy_runs_with_a_fresh_jit_cache(defs):
    """The request the regressed flow issues carries the deploy's config, valid for deploy_node_job
    (a plain redeploy of a serving node would skip)."""
    defs, _ = defs
    action = health_core_action("deploy_node_job", {"fresh_jit_cache": True})
    req = sensor_mod._request("spark2", action, "regressed")
    # ... and never the rejected-version override: a healing redeploy does not deploy it knowingly.
    assert req.run_config["ops"] == {"node_deployment": {"config": {"fresh_jit_cache": True, "allow_rejected": False}}}
    assert dg.validate_run_config(defs.resolve_job_def("deploy_node_job"), req.run_config)
    plain = sensor_mod._request("spark2", health_core_action("deploy_node_job", {}), "engine-down")
    assert not plain.run_config


def test_a_dead_phase0_is_finished_by_a_node_os_run_that_applies(defs):
    """node_os_job only reads by default (check: true); the run that finishes a dead Phase 0 applies,
    as the dead run did, and its config is valid for the job (a check would leave the node stopped)."""
    from spark_pipelines.core import healing, steps

    defs, _ = defs
    u = healing.Unfinished(steps.PROC_NODE_OS, "abcdef1234", "rebooting", "the node os of run abcdef12")
    action = healing.finish_action("spark2", "engine-down", u)
    req = sensor_mod._request("spark2", action, "engine-down")
    assert req.job_name == "node_os_job" and req.run_config["ops"] == {"node_os": {"config": {"check": False}}}
    assert dg.validate_run_config(defs.resolve_job_def("node_os_job"), req.run_config)


def health_core_action(job, config):
    from spark_pipelines.core.healing import Action

    return Action("redeploy", job, "heal-spark2-1-redeploy1", "test", config)


def test_a_dead_deploys_journal_requests_its_repair_on_the_first_sweep(defs, monkeypatch):
    """The sweep saw a deploy journal on spark2 and nobody holding its lease: one deploy_node_job
    for spark2, keyed by the dead run (Dagster then never requests it twice), valid as it is."""
    defs, _ = defs
    dead = health.DeployInFlight("0123456789abcdef", "launching", "2026-01-01T00:00:00Z", "pid 1 on h", False)

    def fake_sweep(s, nodes=None, **kw):
        out = {"spark1": report("spark1", "healthy", health_ok=True)}
        obs = health.Observation(node="spark2", probed_at=0.0, ssh_ok=True, health_ok=False,
                                 container=health.ContainerState(exists=False), deploy_journal=dead)
        out["spark2"] = sweep.NodeReport(obs, health.judge(obs))
        return out

    monkeypatch.setattr(sweep, "sweep", fake_sweep)
    monkeypatch.setattr(reconcile, "read_view", lambda s, healthy: reconcile.View(Snapshot({"model_list": []}), {}, {}))
    with dg.instance_for_test() as instance:
        res = tick(defs, instance)
        repair = [r for r in res.run_requests if r.job_name == "deploy_node_job"]
        assert [(r.partition_key, r.run_key) for r in repair] == [("spark2", "repair-spark2-01234567")]
        assert repair[0].run_config in (None, {}) or dg.validate_run_config(
            defs.resolve_job_def("deploy_node_job"), repair[0].run_config)
        latest = observations(instance, "spark2")[0]
        assert latest["verdict"].value == "engine-down" and "died in phase launching" in latest["evidence"].value


def test_a_dead_procedures_journal_in_the_ledger_requests_a_run_of_its_own_job(defs, monkeypatch):
    """The ledger holds a journal on each node: spark1's bench while a run holds spark1's lease (in
    progress: nothing), spark2's cold drain that powered it off, past the time its run would wait
    (dead: cold_drain_job, whose rerun turns the plug back on); and the reconcile leaves both out."""
    from spark_pipelines.state.ledger import Procedure

    defs, _ = defs
    bench = Procedure(procedure="bench", run_id="aaaaaaaa11111111", token="b", phase="drained", was_in=True,
                      drain_reason="bench (run aaaaaaaa)")
    cold = Procedure(procedure="cold_drain", run_id="0123456789abcdef", token="c", phase="power-off",
                     down_until=1.0, engine="vllm-qwen35-v2")

    def fake_sweep(s, nodes=None, **kw):
        up = health.Observation(node="spark1", probed_at=0.0, ssh_ok=True, health_ok=True, lease_held=True,
                                container=health.ContainerState(exists=True, status="running", running=True))
        down = health.Observation(node="spark2", probed_at=0.0, ssh_ok=False, ssh_error="timed out")
        return {"spark1": sweep.NodeReport(up, health.judge(up)), "spark2": sweep.NodeReport(down, health.judge(down))}

    monkeypatch.setattr(sweep, "sweep", fake_sweep)
    monkeypatch.setattr(reconcile, "read_view", lambda s, healthy: reconcile.View(
        Snapshot({"model_list": []}), {}, {n: True for n in healthy}, {"spark1": [bench], "spark2": [cold]}))
    with dg.instance_for_test() as instance:
        res = tick(defs, instance)
        assert [(r.job_name, r.partition_key, r.run_key) for r in res.run_requests] == [
            ("cold_drain_job", "spark2", "finish-spark2-cold_drain-01234567")], res.run_requests
        note = observations(instance, "spark2")[0]["policy"].value
        assert "the cold drain of run 01234567" in note and "cold_drain_job finishes it" in note
