"""The whole chain through a real Dagster instance, on the simulated fleet (real sshd, dockerd,
LiteLLM proxy; GB10 and vLLM stand-ins).

Order matters inside this module: one fleet, one instance, one history.
"""

import json
import os
import time

import dagster as dg
import httpx
import pytest
import yaml
from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest

from spark_pipelines.core.checkpoint import EXPECTED_FP8_SCALES
from spark_pipelines.cli.demo import run_chain
from spark_pipelines.definitions import build_definitions
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.resources.ssh import read_command_log

pytestmark = pytest.mark.slow

# What "heavy remote work" looks like in the command log.
HEAVY_SCRIPTS = ("build-hybrid-checkpoint.py", "add-mtp-weights.py", "build-and-copy.sh")
HEAVY_PHRASES = ("hf download", "docker build", "docker save", "docker load", "docker run -d", "arrivals.py send")


def is_heavy(argv) -> bool:
    joined = " ".join(argv)
    return (any(a == "rsync" or a.endswith("/rsync") for a in argv)
            or any(a.endswith(x) for a in argv for x in HEAVY_SCRIPTS)
            or any(p in joined for p in HEAVY_PHRASES))


@pytest.fixture(scope="module")
def chain(chain_console):
    """The session's instance and console (tests/e2e/conftest.py); in-process runs here log their
    commands to the same file as the runs the console launches."""
    os.environ["SPARK_COMMAND_LOG"] = str(chain_console["log"])
    try:
        yield chain_console
    finally:
        os.environ.pop("SPARK_COMMAND_LOG", None)


def variant(chain, name, change) -> str:
    data = yaml.safe_load(open(chain["fleet"]))
    change(data)
    path = chain["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def heavy_commands(log_path, since: int) -> list[str]:
    return [" ".join(r.argv) for r in read_command_log(log_path)[since:] if is_heavy(r.argv)]


def latest(instance, asset, partition=None):
    recs = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition] if partition else None), limit=1
    ).records
    return {k: v.value for k, v in recs[0].asset_materialization.metadata.items()} if recs else {}


def test_low_memory_node_fails_alone(chain, sim_gpu):
    """First deploy ever: spark2 lacks memory, spark1 deploys regardless."""
    sim_gpu("spark2", "low-memory")
    defs = build_definitions(chain["fleet"])
    assert defs.resolve_job_def("build_job").execute_in_process(instance=chain["instance"], raise_on_error=False).success
    job = defs.resolve_job_def("deploy_node_job")
    bad = job.execute_in_process(instance=chain["instance"], partition_key="spark2", raise_on_error=False)
    ok = job.execute_in_process(instance=chain["instance"], partition_key="spark1", raise_on_error=False)
    assert ok.success and not bad.success
    # spark2 got its checkpoint and image streamed from the build host before its preflight failed.
    art = latest(chain["instance"], "node_artifacts", "spark2")
    assert art["copied"] is True and art["image_copied"] is True and art["bytes_sent"] > 0
    why = " ".join(e.step_failure_data.user_failure_data.description for e in bad.all_events
                   if e.is_step_failure and e.step_failure_data.user_failure_data)
    assert "preflight blocked spark2" in why and "memory" in why and "reboot" in why
    assert "lower GMU to 0.80" not in why.replace("do NOT lower GMU to 0.80", "")
    fleet = load_fleet(chain["fleet"])
    assert httpx.get(f"http://{fleet.node('spark1').host}:8000/health", timeout=5).status_code == 200
    # spark1's first boot compiled its kernels; the same run archived them on the build host.
    dep = latest(chain["instance"], "node_deployment", "spark1")
    assert dep["jit_cache"] == "cold" and "first boot" in dep["jit_cache_why"]
    assert "Compiling a graph for dynamic shape" in container_log(fleet, "spark1")
    jit = latest(chain["instance"], "jit_cache", "spark1")
    assert jit["action"] == "archived" and jit["key"] == dep["jit_cache_key"]


def container_log(fleet, node: str) -> str:
    from spark_pipelines.resources.ssh import FleetSession

    with FleetSession(fleet) as s:
        r = s.run(node, ["docker", "logs", "vllm-qwen35-v2"], log=False)
        return r.stdout + r.stderr


def test_materialize_all(chain):
    failures = run_chain(chain["fleet"], chain["instance"], log=lambda *_: None, console=chain["console"])
    assert failures == {}
    inst = chain["instance"]
    # Every run was launched through the code location: it names the job's location and repository
    # (what the job page and the Overview timeline select on) and is not an in-process run.
    runs = inst.get_runs(dg.RunsFilter(tags={"dagster/partition": "spark2"}), limit=2)
    assert {r.job_name for r in runs} == {"bench_job", "deploy_node_job"}
    for r in runs:
        assert r.remote_job_origin is not None
        assert r.remote_job_origin.location_name == "spark_pipelines"
        assert r.remote_job_origin.repository_origin.repository_name == "__repository__"
    fleet = load_fleet(chain["fleet"])
    for node in ("spark1", "spark2"):
        dep = latest(inst, "node_deployment", node)
        assert dep["kv_cache_tokens"] == 268224 and dep["max_concurrency"] == pytest.approx(3.81)
        bench = latest(inst, "bench_results", node)
        assert bench["mean_tok_s"] >= fleet.bench_floor(fleet.node(node))
        # The gate read MTP acceptance too (the stand-in's spec-decode counters, ~95% like MTP-2).
        assert bench["spec_acceptance_rate"] >= fleet.bench.floor_mtp_acceptance and "MTP acceptance" in bench["gate"]
        assert "Q&A" in bench["report"]
        # The bench table shows inline (a table, not markdown); every number rounded.
        prompts = [r.data["prompt"] for r in bench["table"].records]
        assert "Q&A" in prompts and "mean" in prompts
        assert bench["mean_tok_s"] == round(bench["mean_tok_s"], 2)
        assert bench["endpoint"].startswith("http://") and bench["history_chart_png"].endswith(".png")
        # What makes the bench comparable: the deployed image, checkpoint and launch spec, the driver
        # the stand-in's nvidia-smi reports, clocks and power under load; isolated, so it counts.
        rec = bench["bench_record"]
        art = latest(inst, "node_artifacts", node)
        assert rec["identity"]["image_id"] == art["image_id"] and rec["identity"]["checkpoint_digest"]
        assert rec["identity"]["checkpoint_digest"].startswith(art["checkpoint"])
        assert rec["identity"]["launch_spec_hash"] and rec["identity"]["driver_version"] == "580.159.04"
        assert rec["conditions"]["sm_clock_mhz_p50"] and rec["conditions"]["isolation_verified"]
        assert bench["void"] == "no" and rec["void"] == []
    # The second node's bench sits beside the first one's and the fleet's baseline (same image,
    # checkpoint, launch spec on both: comparable).
    last = latest(inst, "bench_results", "spark2")
    assert "spark1" in last["fleet_baseline"] and "spark2" in last["fleet_baseline"]
    rows = {r.data["node"]: r.data for r in last["vs_fleet"].records}
    assert set(rows) == {"spark1", "spark2"} and all(r["counts"] == "yes" for r in rows.values()), rows
    assert 0.5 < last["vs_fleet_baseline_x"] < 2.0
    # The check history of the gate holds one row per node, each naming its node.
    history = inst.event_log_storage.get_asset_check_execution_history(
        dg.AssetCheckKey(dg.AssetKey("bench_results"), "above_floor"), limit=10)
    by_node = {r.partition: r for r in history}
    assert {"spark1", "spark2"} <= set(by_node)
    for node in ("spark1", "spark2"):
        evaluation = by_node[node].event.dagster_event.event_specific_data
        assert evaluation.passed and evaluation.description.startswith(f"{node}: ")
    # After the benches the gateway carries each drain and restore, with the rotation after it.
    obs = inst.fetch_observations(dg.AssetKey("gateway"), limit=10).records
    events = [r.event_log_entry.asset_observation.metadata["event"].value for r in obs]
    assert any(e == "drain spark1" for e in events) and any(e == "restore spark2" for e in events)
    newest = obs[0].event_log_entry.asset_observation.metadata
    assert set(newest["rotation"].value.split(", ")) == {"spark1", "spark2"}
    # A successful deploy does not log docker's "No such container" for the absent rollback point.
    for run in inst.get_runs():
        if run.is_success:
            assert not [e.user_message for e in inst.all_logs(run.run_id)
                        if "No such container" in (e.user_message or "")], run.job_name
    dep = latest(inst, "node_deployment", "spark1")
    assert dep["endpoint"].startswith("http://") and dep["container_id"] != "none" and dep["image_id"].startswith("sha256:")
    assert latest(inst, "mtp_weights")["fp8_scales"] == EXPECTED_FP8_SCALES
    # The build host was already built by the previous test: every step reused its verified output.
    assert all(latest(inst, a)["skipped"] is True for a in ("base_model", "hybrid_checkpoint", "mtp_weights",
                                                             "base_image", "serving_image"))
    assert latest(inst, "base_image")["torch"] == "2.12.0+cu130"
    art = latest(inst, "node_artifacts", "spark2")
    assert art["image_id"] == latest(inst, "serving_image")["image_id"]
    # spark2's first deploy got spark1's archived kernels (same image, checkpoint, kernel flags):
    # a warm boot, not a first boot.
    dep2 = latest(inst, "node_deployment", "spark2")
    assert dep2["jit_cache"] == "restore" and dep2["jit_cache_key"] == latest(inst, "jit_cache", "spark1")["key"]
    log2 = container_log(fleet, "spark2")
    assert "Directly load the compiled graph(s)" in log2 and "Compiling a graph" not in log2
    assert latest(inst, "jit_cache", "spark2")["action"] == "present"
    # Both nodes are back in the gateway after their benches, and the real proxy routes to both.
    gw = chain["sim"].gateway
    key = os.environ["LITELLM_MASTER_KEY"]
    bases = set()
    for _ in range(12):
        with httpx.stream("POST", f"http://{gw.ip}:{fleet.gateway.proxy_port}/v1/chat/completions",
                          headers={"Authorization": f"Bearer {key}"},
                          json={"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            body = "".join(r.iter_text())
            assert "data: [DONE]" in body
            bases.add(r.headers.get("x-litellm-model-api-base"))
    assert {f"http://{fleet.node(n).host}:8000/v1" for n in ("spark1", "spark2")} <= bases


def test_second_run_does_no_heavy_work(chain):
    since = len(read_command_log(chain["log"]))
    assert run_chain(chain["fleet"], chain["instance"], log=lambda *_: None, console=chain["console"]) == {}
    assert heavy_commands(chain["log"], since) == []
    assert latest(chain["instance"], "node_deployment", "spark1")["skipped"] is True
    # Same rotation, same config: the live proxy is not restarted under its users.
    assert latest(chain["instance"], "gateway")["reloaded"] is False


def test_fresh_jit_cache_relaunches_cold_and_wipes_the_stale_cache(chain):
    """The runbook's stale torch_compile cache fix, as a deploy option: the key's cache is set
    aside on the node (a rollback would boot on it) and deleted from the build host's archive, the
    boot compiles afresh, the new cache is archived, and after the commit the stale slot (root's
    files) is wiped."""
    fleet = load_fleet(chain["fleet"])
    key = latest(chain["instance"], "jit_cache", "spark1")["key"]
    res = build_definitions(chain["fleet"]).resolve_job_def("deploy_node_job").execute_in_process(
        instance=chain["instance"], partition_key="spark2", raise_on_error=False,
        run_config={"ops": {"node_deployment": {"config": {"fresh_jit_cache": True}}}})
    assert res.success
    dep = latest(chain["instance"], "node_deployment", "spark2")
    assert dep["skipped"] is False and dep["jit_cache"] == "cold" and dep["jit_cache_key"] == key
    assert "Compiling a graph for dynamic shape" in container_log(fleet, "spark2")
    assert latest(chain["instance"], "jit_cache", "spark2")["action"] == "archived"  # the fresh one
    from spark_pipelines.resources.ssh import FleetSession

    with FleetSession(fleet) as s:
        home = fleet.node("spark2").home_dir
        listing = s.run("spark2", ["ls", "-a", f"{home}/.cache"], log=False).stdout.split()
        store = s.run("spark1", ["ls", s.expand("spark1", fleet.launch.jit_cache_store)], log=False).stdout.split()
        link = s.run("spark2", ["readlink", f"{home}/.cache/vllm"], log=False).stdout.strip()
    assert link == f"vllm.jit-{key}"
    assert f"vllm.jit-{key}" in listing and not [n for n in listing if ".stale-" in n], listing
    assert key in store and not [n for n in store if ".stale-" in n], store
    wiped = [e.user_message for e in chain["instance"].all_logs(res.run_id) if "stale JIT caches wiped" in e.user_message]
    assert wiped and f"vllm.jit-{key}.stale-" in wiped[0]


# -- compile caches shipped: never another key's, and one that fails the boot is dropped --------

FOREIGN = "f0f0f0f0f0"  # a stand-in kernel hash of another configuration
# Where the stand-in keeps a kernel hash's entries in each archived cache (sim/spark_sim/standin_jit.py).
FOREIGN_ENTRIES = (f"0_vllm/torch_compile_cache/{FOREIGN}/rank_0_0/backbone",
                   f"1_flashinfer/90a/cached_ops/fused_moe_sm121_{FOREIGN}", f"2_triton/{FOREIGN}")


def archive_of_other_kernels(s, key: str, manifest_key: str) -> None:
    """An archive under `key` whose kernels were compiled for another configuration, with a
    manifest that names `manifest_key` (each file hashed as a back-up hashes it)."""
    from spark_pipelines.runbook import jit_cache

    build = s.fleet.build_node.name
    d = jit_cache.archived_dir(s, key)
    s.run(build, ["rm", "-rf", d], log=False)
    for entry in FOREIGN_ENTRIES:
        s.run(build, ["mkdir", "-p", f"{d}/{entry}"], log=False)
        s.put_text(build, f"{d}/{entry}/cache_key", FOREIGN + "\n")
        s.put_text(build, f"{d}/{entry.split('/')[0]}/.spark-jit-sealed", "")
    entries = [e.split("/")[0] for e in FOREIGN_ENTRIES]
    files = jit_cache.archive_digests(s, key, entries)
    s.put_text(build, f"{d}/{jit_cache.MANIFEST}", json.dumps({"format": jit_cache.ARCHIVE_FORMAT, "key": manifest_key,
                                                               "source": "spark1", "entries": files}))
    s.run(build, ["touch", f"{d}/{jit_cache.COMPLETE}"], log=False)


def lose_cache(s, fleet, node: str) -> None:
    """The node rebooted and lost its compile cache (a new disk, a tmpfs home): its slots are gone
    and its engine is down, so its next deploy boots on whatever it gets."""
    from spark_pipelines.core.launch import launch_spec
    from spark_pipelines.runbook import jit_cache

    spec = launch_spec(fleet, fleet.node(node))
    s.run(node, ["docker", "stop", spec.container_name], log=False, timeout=120)
    for m in jit_cache.cache_mounts(spec):
        target = s.run(node, ["readlink", "-f", m], log=False).stdout.strip()
        s.run(node, ["mv", "-T", target, f"{target}.lost-{int(time.time() * 1000)}"], log=False)


def kernel_hashes(s, fleet, node: str) -> set[str]:
    """The stand-in kernel hashes in the node's torch.compile cache as it mounts it now."""
    home = fleet.node(node).home_dir
    r = s.run(node, ["ls", f"{home}/.cache/vllm/torch_compile_cache"], check=False, log=False)
    return set(r.stdout.split())


def redeploy(chain, node: str):
    res = build_definitions(chain["fleet"]).resolve_job_def("deploy_node_job").execute_in_process(
        instance=chain["instance"], partition_key=node, raise_on_error=False)
    return res, latest(chain["instance"], "node_deployment", node)


def test_a_shipped_cache_of_another_key_is_never_mounted(chain):
    """An archive filed under the key spark2 needs holds another key's cache (its manifest says
    so): the deploy refuses it before a byte is copied, marks the archive bad, and spark2 boots
    cold on its own compile; the other kernels are never in what it mounts."""
    from spark_pipelines.resources.ssh import FleetSession
    from spark_pipelines.runbook import jit_cache

    fleet = load_fleet(chain["fleet"])
    key = latest(chain["instance"], "jit_cache", "spark1")["key"]
    with FleetSession(fleet) as s:
        d = jit_cache.archived_dir(s, key)
        s.run("spark1", ["mv", "-T", d, f"{d}.kept"], log=False)
        try:
            archive_of_other_kernels(s, key, manifest_key="0123456789abcdef")
            lose_cache(s, fleet, "spark2")
            res, dep = redeploy(chain, "spark2")
            assert res.success, dep
            assert dep["jit_cache"] == "cold" and "holds the cache of key '0123456789abcdef'" in dep["jit_cache_why"]
            assert FOREIGN not in kernel_hashes(s, fleet, "spark2") and kernel_hashes(s, fleet, "spark2")
            log = container_log(fleet, "spark2")
            assert "Compiling a graph for dynamic shape" in log and "stale" not in log
            assert jit_cache.archive_state(s, key) == "bad"
            assert "another key's cache is never mounted" in jit_cache.bad_reason(s, key)
        finally:
            s.run("spark1", ["rm", "-rf", d], log=False)
            s.run("spark1", ["mv", "-T", f"{d}.kept", d], log=False)


def test_a_shipped_cache_that_fails_the_boot_is_dropped_and_the_node_serves_after_a_cold_boot(chain):
    """The archive of spark2's key verifies (its manifest is right about its files) but its
    kernels are another configuration's, as a key that missed a kernel-shaping input would
    ship: the boot on it fails as the runbook's stale-cache rows describe, the deploy drops the
    cache and boots cold, spark2 serves, and the key's archive is never shipped again."""
    from spark_pipelines.resources.ssh import FleetSession
    from spark_pipelines.runbook import jit_cache

    fleet = load_fleet(chain["fleet"])
    key = latest(chain["instance"], "jit_cache", "spark1")["key"]
    with FleetSession(fleet) as s:
        d = jit_cache.archived_dir(s, key)
        s.run("spark1", ["mv", "-T", d, f"{d}.kept"], log=False)
        try:
            archive_of_other_kernels(s, key, manifest_key=key)
            lose_cache(s, fleet, "spark2")
            res, dep = redeploy(chain, "spark2")
            assert res.success, dep
            assert dep["jit_cache"] == "cold" and "failed the boot" in dep["jit_cache_why"], dep["jit_cache_why"]
            assert "stale torch_compile cache" in dep["jit_cache_why"]
            assert FOREIGN not in kernel_hashes(s, fleet, "spark2")
            assert "Compiling a graph for dynamic shape" in container_log(fleet, "spark2")
            assert jit_cache.archive_state(s, key) == "bad"
            assert "a cold boot served" in jit_cache.bad_reason(s, key)
            # Never shipped again: the next node that loses its cache compiles too.
            lose_cache(s, fleet, "spark2")
            res, dep = redeploy(chain, "spark2")
            assert res.success and dep["jit_cache"] == "cold" and "marked bad" in dep["jit_cache_why"], dep
        finally:
            s.run("spark1", ["rm", "-rf", d], log=False)
            s.run("spark1", ["mv", "-T", f"{d}.kept", d], log=False)


def test_vllm_ref_change_makes_exactly_images_and_downstream_stale(chain):
    path = variant(chain, "newref", lambda d: d["pins"].__setitem__("vllm_ref", "3b5f1c2d0"))
    graph = build_definitions(path).get_repository_def().asset_graph
    resolver = CachingStaleStatusResolver(chain["instance"], graph, LoadingContextForTest(chain["instance"]))
    status = {}
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        parts = node.partitions_def.get_partition_keys() if node.partitions_def else [None]
        status[key.to_user_string()] = {resolver.get_status(key, p) for p in parts}
    # Dagster marks the step whose code version moved; everything downstream of it must follow.
    roots = {k for k, v in status.items() if StaleStatus.STALE in v}
    assert roots == {"base_image"}
    follow = {k.to_user_string() for k in graph.get(dg.AssetKey("base_image")).child_keys}
    frontier = set(follow)
    while frontier:
        frontier = {c.to_user_string() for k in frontier for c in graph.get(dg.AssetKey(k)).child_keys} - follow
        follow |= frontier
    assert roots | follow == {"base_image", "serving_image", "node_artifacts", "artifact_distribution",
                              "node_deployment", "jit_cache", "gateway", "bench_results", "fleet_summary",
                              "fleet_rollout", "node_join"}
    assert status["base_model"] == status["hybrid_checkpoint"] == status["mtp_weights"] == {StaleStatus.FRESH}


def test_dying_launch_is_diagnosed_and_previous_keeps_serving(chain, sim_gpu):
    def drop_fix_var(d):
        # An operator who declared founders nodes exempt from the 2026-06-18 fix: validation
        # passes, the GB10 does not forgive it.
        d["hardware_profiles"] = {"founders": {"name": "founders", "cuda_total_gib": 121.69, "max_gmu": 0.85,
                                               "requires_fix_env": False, "clean_boot_free_gib": 117.5}}
        del d["launch"]["env"]["VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"]

    path = variant(chain, "nofix", drop_fix_var)
    fleet = load_fleet(path)
    from spark_pipelines.resources.ssh import FleetSession

    with FleetSession(fleet) as s:
        before = json.loads(s.run("spark1", ["docker", "inspect", "vllm-qwen35-v2"], log=False).stdout)[0]["Id"]
    res = build_definitions(path).resolve_job_def("deploy_node_job").execute_in_process(
        instance=chain["instance"], partition_key="spark1", raise_on_error=False)
    assert not res.success
    fail = next(e for e in res.all_events if e.is_step_failure).step_failure_data.user_failure_data
    assert "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS" in fail.description or "num_gpu_blocks" in fail.description
    assert "previous deployment put back on spark1 (healthy)" in fail.description
    with FleetSession(fleet) as s:
        after = json.loads(s.run("spark1", ["docker", "inspect", "vllm-qwen35-v2"], log=False).stdout)[0]
    assert after["Id"] == before and after["State"]["Running"]
    assert httpx.get(f"http://{fleet.node('spark1').host}:8000/health", timeout=5).status_code == 200
    # The rollback pointed the cache mounts back: the previous deployment restarted warm.
    assert "Directly load the compiled graph(s)" in container_log(fleet, "spark1").rsplit("non-default args", 1)[-1]


def test_ab_experiment_mtp2_vs_mtp3_restores_production(chain):
    fleet = load_fleet(chain["fleet"])
    defs = build_definitions(chain["fleet"])
    res = defs.resolve_job_def("ab_experiment_job").execute_in_process(
        instance=chain["instance"], raise_on_error=False,
        run_config={"ops": {"ab_experiment": {"config": {"node": "spark2", "repeats": 2, "suite": "recipe"}}}})
    assert res.success
    out = res.output_for_node("ab_experiment")
    assert out["node"] == "spark2" and out["verdicts"]
    assert all(("better" in v) or ("cannot be told apart" in v) for v in out["verdicts"])
    mat = chain["instance"].fetch_materializations(dg.AssetKey(["ab_experiments", "spark2"]), limit=1).records[0]
    assert "mtp2" in mat.asset_materialization.metadata["comparison"].value
    # Production launch (MTP-2) is back and serving, and spark2 is back in the gateway.
    from spark_pipelines.resources.ssh import FleetSession

    with FleetSession(fleet) as s:
        args = json.loads(s.run("spark2", ["docker", "inspect", "vllm-qwen35-v2"], log=False).stdout)[0]["Args"]
        rotation = __import__("spark_pipelines.resources.gateway", fromlist=["GatewayHost"]).GatewayHost(s).rotation()
    assert '{"method":"mtp","num_speculative_tokens":2}' in args
    assert "spark2" in rotation


def test_wedged_gx10_is_kept_out_of_the_gateway_until_cold_drained(chain, sim_gpu):
    """The runbook's first check for a slow node, done by the bench itself: nvidia-smi sampled
    under load shows the PD-firmware wedge, so spark2 stays drained and the check says what to do."""
    from spark_pipelines.resources.gateway import GatewayHost
    from spark_pipelines.resources.ssh import FleetSession

    fleet = load_fleet(chain["fleet"])
    job = build_definitions(chain["fleet"]).resolve_job_def("bench_job")

    def bench_spark2():
        res = job.execute_in_process(instance=chain["instance"], partition_key="spark2", raise_on_error=False)
        (check,) = res.get_asset_check_evaluations()
        with FleetSession(fleet) as s:
            rotation = GatewayHost(s).rotation()
        return check, latest(chain["instance"], "bench_results", "spark2"), rotation, res

    sim_gpu("spark2", "wedged")
    check, meta, rotation, res = bench_spark2()
    assert meta["gpu_under_load"] == "wedged" and meta["gpu_samples"] >= 2
    # The gate blocks: the run fails for spark2 alone, its check recorded for spark2. (This run, not
    # the instance's newest: the console's daemon launches fleet_summary refreshes meanwhile.)
    run = chain["instance"].get_run_by_id(res.run_id)
    assert not run.is_success and check.partition == "spark2"
    # The bench is not silent: drain, progress and keep-out lines, and the ssh lines, on the step.
    on_step = [e.user_message for e in chain["instance"].all_logs(run.run_id) if e.step_key == "bench_results"]
    assert any(m.startswith("drain spark2") for m in on_step)
    assert any(m.startswith("bench spark2: recipe run") for m in on_step)
    assert any(m.startswith("keep out spark2") for m in on_step)
    assert any(m.startswith("[spark2]") for m in on_step)
    assert not check.passed and "PD-firmware wedge" in check.description and "90-120 s" in check.description
    assert "spark2" not in rotation and "spark1" in rotation

    sim_gpu("spark2", "healthy")  # after the cold drain
    check, meta, rotation, _ = bench_spark2()
    assert meta["gpu_under_load"] == "healthy" and check.passed
    assert "spark2" in rotation


def test_wedge_watch_requests_the_capture_for_a_node_wedged_under_live_traffic(chain, sim_gpu):
    """Between benches the wedge shows only under load: the sensor judges a gateway node's GPU
    while vLLM reports live requests, and asks for the evidence capture after consecutive wedged
    ticks, once per episode."""
    import threading

    fleet = load_fleet(chain["fleet"])
    defs = build_definitions(chain["fleet"])
    watch = defs.get_repository_def().get_sensor_def("wedge_watch")

    def tick(cursor):
        with dg.build_sensor_context(cursor=cursor, definitions=defs, instance=chain["instance"],
                                     resources={"ssh": defs.resources["ssh"]}) as context:
            return watch(context)

    idle = tick(None)  # no traffic anywhere: nothing judged, nothing requested
    assert not idle.run_requests and "GPU not judged" in idle.skip_reason.skip_message

    sim_gpu("spark2", "wedged")
    stop = threading.Event()
    url = f"http://{fleet.node('spark2').host}:8000/v1/chat/completions"
    model = fleet.launch_for(fleet.node("spark2")).served_model_name

    def traffic():
        while not stop.is_set():
            httpx.post(url, json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 2048}, timeout=60)

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    try:
        # The tick judges only under live requests: wait until vLLM reports the first one running
        # (the sensor's /metrics read can otherwise beat the traffic thread's first request).
        from spark_pipelines.core.diagnosis import METRIC_RUNNING
        from spark_pipelines.core.polling import poll_until
        from spark_pipelines.resources.engine import engine_metrics

        assert poll_until(lambda: (engine_metrics(fleet, fleet.node("spark2")) or {}).get(METRIC_RUNNING, 0),
                          bool, timeout_s=30, every_s=0.2).done
        first = tick(idle.cursor)
        assert not first.run_requests and "spark2: wedged" in first.skip_reason.skip_message
        second = tick(first.cursor)
    finally:
        stop.set()
        worker.join(timeout=60)
    (request,) = second.run_requests
    assert request.partition_key == "spark2" and request.tags["reason"] == "wedge-suspected"
    assert request.job_name == "wedge_capture_job" and request.run_key.startswith("wedge-spark2-")
    assert json.loads(second.cursor)["spark2"]["requested"] is True  # one request per episode
