"""A node pair (Phase 4-alt, TP=2 over two nodes) on the simulated fleet: real sshd, dockerd, LiteLLM
and nginx; the engine stand-in as the two ranks, over the sim's link between spark1 and spark2.

Both nodes serve TP=1 first (Dagster: build, deploy each, gateway). The fleet file then turns the
pair on (the sim's link, gateway.min_in_rotation 0) and an operator's own backend (a stand-in on
the gateway host, an entry no fleet node owns) keeps clients served while both nodes are out of
the rotation: a two-node fleet has no other backend during the pair's transitions. In order:
a wrong master address is refused by the pair's preflight with the runbook's advice, nothing
changed; a head started alone fails with the runbook's advice and rolls both nodes back to TP=1 (a
worker that cannot reach the head is diagnosed in tests/unit/test_pair.py); the pair deployed through node_deployment (worker first)
serves as one backend, is benched against the runbook's TP=2 row and the two nodes' TP=1
figures, and is judged one engine by the health sweep; turned off again, both nodes serve TP=1
with no client request failed.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import subprocess
import threading
import time

import dagster as dg
import pytest
import yaml

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core import layout
from spark_pipelines.core.errors import DeployFailed
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.launch import DEPLOY_LABEL, expand_home, launch_spec
from spark_pipelines.core.pair_launch import pair_launch
from spark_pipelines.definitions import build_definitions
from spark_pipelines.resources import engine
from spark_pipelines.resources.bench_client import run_bench
from spark_pipelines.resources.docker import NodeDocker, container_labels
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession, SshSettings
from spark_pipelines.runbook import pair as pair_runbook
from spark_pipelines.runbook import sweep
from spark_sim.servers import MANDATORY_ENV, RECIPE_FLAGS, STANDIN, SYSTEM_PYTHON, start_server, standin_env
from spark_sim.traffic import Clients

pytestmark = pytest.mark.slow

HEAD, WORKER = "spark1", "spark2"
LOG = logging.getLogger("test.pair")
# The stand-in's store timeout (torch's 600 s on a GB10): long enough for the head to come up after
# the worker's milestone on a loaded 2-core machine, short enough for a failed pair in seconds.
RENDEZVOUS_S = 12
OPERATOR_PORT = 8100
FAST = 4


def _pair_fleet(sim_fleet, root, **pair) -> str:
    data = yaml.safe_load(open(sim_fleet.fleet_file))
    data["pairs"][0].update(enabled=True, **pair)
    data["gateway"]["min_in_rotation"] = 0  # the pair's transitions take both nodes out at once
    path = root / f"pair-{len(list(root.glob('pair-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _gpu_state(sim_fleet, node: str, **change) -> None:
    f = sim_fleet.node(node).gpu_state_file
    doc = json.loads(f.read_text())
    doc.update(change)
    doc = {k: v for k, v in doc.items() if v is not None}
    f.write_text(json.dumps(doc))


def _docker(sim_fleet, node: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], env={**os.environ, "DOCKER_HOST": sim_fleet.node(node).docker_host},
                          capture_output=True, text=True, timeout=60)


def _operator_entries(base: str) -> list[dict]:
    return [{"model_name": pool, "litellm_params": {"model": "openai/qwen35-hybrid-v2", "api_base": base,
                                                    "api_key": "dummy"},
             "model_info": {"id": f"operator-standby-{pool}"}} for pool in ("fast", "reasoning", "code")]


@pytest.fixture(scope="module")
def env(sim_fleet, tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    (root / "dagster").mkdir()
    instance = dg.DagsterInstance.local_temp(str(root / "dagster"))
    fleet_path = str(sim_fleet.fleet_file)
    # Every engine of this module decodes FAST times the sim's rate (read at its start): the bench
    # compares ratios (pair vs TP=1), and the module's benches and clients take a quarter of the time.
    rates = {n: json.loads(sim_fleet.node(n).gpu_state_file.read_text()).get("tokens_per_second") for n in (HEAD, WORKER)}
    for n in (HEAD, WORKER):
        _gpu_state(sim_fleet, n, rendezvous_timeout_s=RENDEZVOUS_S, tokens_per_second=FAST * (rates[n] or 52.0))
    defs = build_definitions(fleet_path)
    for job, part in (("build_job", None), ("deploy_node_job", HEAD), ("deploy_node_job", WORKER),
                      ("gateway_job", None)):
        res = defs.resolve_job_def(job).execute_in_process(instance=instance, partition_key=part, raise_on_error=False)
        assert res.success, f"{job} failed while setting up the module"
    tp1 = load_fleet(fleet_path)
    gw_member = sim_fleet.gateway
    # The operator's standby backend: no fleet node, never touched by the gateway step or a drain.
    base = f"http://{gw_member.ip}:{OPERATOR_PORT}"
    standby = start_server(
        ["ip", "netns", "exec", gw_member.netns, SYSTEM_PYTHON, str(STANDIN), "serve", "/models/standby",
         "--served-model-name", "qwen35-hybrid-v2", "--host", gw_member.ip, "--port", str(OPERATOR_PORT), *RECIPE_FLAGS],
        env=standin_env(root / "standby-gpu.json", {"state": "healthy", "profile": "gx10", "free_gib": 107.0,
                                                    "total_gib": 121.69, "tokens_per_second": 1000},
                        {**MANDATORY_ENV, "SIM_STARTUP_SECONDS": "0.2"}),
        log_path=root / "standby.log", ready_url=base + "/health", base_url=base, model="qwen35-hybrid-v2", timeout=60)
    key = os.environ["LITELLM_MASTER_KEY"]
    with FleetSession(tp1, SshSettings(connect_retries=1)) as s:
        host = GatewayHost(s, master_key=key, poll_s=0.5)

        def with_standby(snap):
            config = yaml.safe_load(snap.text)
            config["model_list"] = [*config["model_list"], *_operator_entries(base + "/v1")]
            return gateway_core.parse(gateway_core.dump_yaml(config))

        assert host.change(with_standby, rollback=True)[2]
    try:
        yield {"instance": instance, "root": root, "tp1": tp1, "key": key, "fleet_path": _pair_fleet(sim_fleet, root)}
    finally:
        for n in (HEAD, WORKER):
            _gpu_state(sim_fleet, n, rendezvous_timeout_s=None, tokens_per_second=rates[n])
        with FleetSession(tp1, SshSettings(connect_retries=1)) as s:
            def without_standby(snap):
                config = yaml.safe_load(snap.text)
                config["model_list"] = [e for e in config["model_list"]
                                        if not str(e.get("model_info", {}).get("id", "")).startswith("operator-standby")]
                return gateway_core.parse(gateway_core.dump_yaml(config))

            GatewayHost(s, master_key=key, poll_s=0.5).change(without_standby, rollback=True)
        standby.stop()
        instance.dispose()
        _as_the_sim_made_it(tp1)


def _as_the_sim_made_it(fleet) -> None:
    """The modules after this one meet the fleet as the sim made it: no deployment anywhere, no
    copy on spark2, no compiled kernels (e2e's first deploy is a cold boot that streams them)."""
    with FleetSession(fleet, SshSettings(connect_retries=1)) as s:
        for n in (HEAD, WORKER):
            name = launch_spec(fleet, fleet.node(n)).container_name
            for c in (name, f"{name}-previous"):
                s.run(n, ["docker", "rm", "-f", c], check=False, log=False)
        image = launch_spec(fleet, fleet.node(WORKER)).image
        for ref in (image, f"{image}:previous"):
            s.run(WORKER, ["docker", "rmi", "-f", ref], check=False, log=False)
    other = fleet.node(WORKER)
    models = os.path.dirname(layout.hybrid_dir(fleet, other))
    for p in glob.glob(glob.escape(models) + "/*") + glob.glob(glob.escape(models) + "/.*"):
        if os.path.islink(p) or os.path.isfile(p):
            os.unlink(p)
        else:
            shutil.rmtree(p, ignore_errors=True)
    shutil.rmtree(os.path.dirname(layout.marker_path(other, "node_artifacts")), ignore_errors=True)
    for node in fleet.serve_nodes:
        for host, _ in [*launch_spec(fleet, node).mounts, (f"{node.home_dir}/.cache/huggingface", "")]:
            if host.startswith(node.home_dir + "/") and "/models" not in host:
                for p in glob.glob(glob.escape(host) + "*"):
                    if os.path.islink(p) or os.path.isfile(p):
                        os.unlink(p)
                    else:
                        shutil.rmtree(p, ignore_errors=True)
    shutil.rmtree(expand_home(fleet.launch.jit_cache_store, fleet.build_node.home_dir), ignore_errors=True)


def _serving_tp1(s: FleetSession, fleet, node: str) -> bool:
    live = NodeDocker(s).inspect_container(node, launch_spec(fleet, fleet.node(node)).container_name)
    return (live is not None and live["State"]["Running"] and engine.healthy(fleet, fleet.node(node))
            and container_labels(live).get(DEPLOY_LABEL) == launch_spec(fleet, fleet.node(node)).fingerprint)


def _assert_both_back_at_tp1(env, key: str) -> None:
    tp1 = env["tp1"]
    with FleetSession(tp1, SshSettings(connect_retries=1)) as s:
        for n in (HEAD, WORKER):
            assert _serving_tp1(s, tp1, n), f"{n} does not serve its TP=1 launch after the rollback"
        assert set(GatewayHost(s, master_key=key).rotation()) == {HEAD, WORKER}


def _when_the_worker_is_up(sim_fleet, then) -> threading.Thread:
    """Run `then()` once the worker's pair container said its headless milestone (a fault)."""
    def watch() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            r = _docker(sim_fleet, WORKER, "logs", "vllm-qwen35-v2")
            if pair_runbook.WORKER_MILESTONE in r.stdout + r.stderr:
                then()
                return
            time.sleep(0.2)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_a_wrong_master_address_is_refused_by_the_pair_preflight_with_the_runbooks_advice(env, sim_fleet):
    wrong = _pair_fleet(sim_fleet, env["root"], link={**yaml.safe_load(open(env["fleet_path"]))["pairs"][0]["link"],
                                                      "head_address": sim_fleet.layout.link_address(9)})
    fleet = load_fleet(wrong)
    with FleetSession(fleet, SshSettings(connect_retries=1)) as s:
        with pytest.raises(DeployFailed) as e:
            pair_runbook.deploy_pair(s, fleet.pairs[0], LOG, run_id="wrongaddr")
    said = str(e.value)
    assert "preflight blocked, nothing was changed" in said
    assert f"spark1 has no address {sim_fleet.layout.link_address(9)}" in said
    assert "verify --master-addr" in said and "29501" in said and "NCCL timeout on worker connect" in said
    _assert_both_back_at_tp1(env, env["key"])


def test_a_head_started_alone_fails_with_the_runbooks_advice_and_rolls_back_both(env, sim_fleet):
    fleet = load_fleet(env["fleet_path"])
    # The worker's container dies right after its milestone: the head then starts with no worker.
    fault = _when_the_worker_is_up(sim_fleet, lambda: _docker(sim_fleet, WORKER, "kill", "vllm-qwen35-v2"))
    with FleetSession(fleet, SshSettings(connect_retries=1)) as s:
        with pytest.raises(DeployFailed) as e:
            pair_runbook.deploy_pair(s, fleet.pairs[0], LOG, run_id="alone")
    fault.join(5)
    said = str(e.value)
    assert "the head was started alone: no worker ran on spark2" in said, said
    assert "start the worker first" in said and "WORKER (rank 1) FIRST" in said and "29501" in said
    assert "pair-head-alone" in e.value.details["diagnosis"]
    assert "previous deployment put back on spark1 (healthy)" in said and "previous deployment put back on spark2" in said
    _assert_both_back_at_tp1(env, env["key"])


def test_the_pair_deploys_worker_first_serves_as_one_backend_and_is_benched(env, sim_fleet):
    tp1, key = env["tp1"], env["key"]
    tp1_tok_s = {}
    for n in (HEAD, WORKER):  # each node's own TP=1 single stream, before the pair
        r = run_bench(f"{engine.api_root(tp1, tp1.node(n))}/v1", "qwen35-hybrid-v2", suite="recipe", repeats=1,
                      ignore_eos=True)
        tp1_tok_s[n] = r.recipe_mean_tok_s.median
    fleet = load_fleet(env["fleet_path"])
    defs = build_definitions(env["fleet_path"])
    with Clients(sim_fleet, key, every_s=0.5, max_tokens=32) as traffic:
        res = defs.resolve_job_def("deploy_node_job").execute_in_process(
            instance=env["instance"], partition_key=HEAD, raise_on_error=False)
    assert res.success, [e.message for e in res.all_events if e.is_failure]
    assert traffic.failed == [], traffic.failed
    launch = pair_launch(fleet, fleet.pairs[0])
    with FleetSession(fleet, SshSettings(connect_retries=1)) as s:
        docker = NodeDocker(s)
        live = {n: docker.inspect_container(n, "vllm-qwen35-v2") for n in (HEAD, WORKER)}
        assert container_labels(live[WORKER])[DEPLOY_LABEL] == launch.worker.fingerprint
        assert container_labels(live[HEAD])[DEPLOY_LABEL] == launch.head.fingerprint
        assert live[WORKER]["HostConfig"]["Privileged"] and live[HEAD]["HostConfig"]["ShmSize"] == 64 * 2**30
        assert live[WORKER]["State"]["StartedAt"] < live[HEAD]["State"]["StartedAt"]  # the worker first
        host = GatewayHost(s, master_key=key)
        assert host.rotation() == [HEAD]  # one backend: the head; the worker is headless
        assert set(host.serving_routes()["fast"]) == {HEAD}
        # The sweep judges the pair as one engine: the worker answers no /health of its own.
        verdicts = {n: r.verdict for n, r in sweep.sweep(s).items()}
        assert verdicts[HEAD].verdict == "healthy" and verdicts[WORKER].verdict == "healthy", verdicts
        assert "rank 1 of pair tp2" in verdicts[WORKER].evidence[0]
        # A second deploy of the pair's node skips: the pair serves its launch already.
        again = defs.resolve_job_def("deploy_node_job").execute_in_process(
            instance=env["instance"], partition_key=WORKER, raise_on_error=False)
        assert again.success
        assert docker.inspect_container(HEAD, "vllm-qwen35-v2")["Id"] == live[HEAD]["Id"]
        bench, report = pair_runbook.bench_pair(s, fleet.pairs[0], LOG, tp1_tok_s=tp1_tok_s, repeats=1)
    # The stand-in's TP=2 is the runbook's: 56/52 of a node per request, ~56 in all at 2 streams.
    per_request = bench.pair_tok_s / (sum(tp1_tok_s.values()) / 2)
    assert 0.95 < per_request < 1.25, (bench, tp1_tok_s)
    assert bench.pair_two_streams_tok_s < 0.7 * bench.tp1_two_streams_tok_s
    assert bench.better == "tp1"
    lines = "\n".join(bench.lines())
    assert "runbook TP=2 ~56" in lines and "measured" in lines and "the runbook's choice (TP=1) stands" in lines
    print("pair bench:", *bench.lines(), sep="\n  ")


def test_the_pair_turned_off_returns_both_nodes_to_tp1_without_a_failed_request(env, sim_fleet):
    fleet = load_fleet(env["fleet_path"])
    key = env["key"]
    with Clients(sim_fleet, key, every_s=0.5, max_tokens=32) as traffic:
        with FleetSession(fleet, SshSettings(connect_retries=1)) as s:
            done = pair_runbook.separate(s, fleet.pairs[0], LOG, run_id="off")
    assert [d.spec.node for d in done] == [WORKER, HEAD]
    assert traffic.failed == [], traffic.failed
    assert len(traffic.streams.results) >= 10
    _assert_both_back_at_tp1(env, key)
