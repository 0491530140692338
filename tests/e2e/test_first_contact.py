"""First contact with a build host built by hand: a simulated fleet brought to the runbook's
hand-run state with the runbook's own commands (sim/spark_sim/hand.py), its base model then moved
into ~/models by a plain copy (no huggingface_hub metadata: its revision cannot be proven), then
adoption of the build host and of spark2's copy, then build_job through Dagster: nothing heavy
runs but the base model's proof by content, no checkpoint file is rewritten, no JIT file lost, no
container restarted; each node's plain checkpoint directory becomes a version by a rename. Then a
recipe pin change builds a new version beside the serving one while spark1 serves from it, and a
shard damaged in place on the build host is found and rebuilt.

Its own fleet on a free slot (the session's sim_fleet expects a fleet never deployed); one fleet,
one instance, one history for the module: order matters.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import dagster as dg
import httpx
import pytest
import yaml

from dagster._core.definitions.data_version import CachingStaleStatusResolver, StaleStatus
from dagster._core.loader import LoadingContextForTest

from spark_pipelines.cli import main as cli
from spark_pipelines.core.adoption import ADOPT, CURRENT, DIFFERS
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.core.checkpoint import INDEX_NAME
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.pins import code_versions
from spark_pipelines.definitions import build_definitions
from spark_pipelines.resources.ssh import FleetSession, read_command_log
from spark_pipelines.runbook.adoption_build import adopt_build_host, adopt_node_artifacts, asset_value
from spark_sim.hand import Hand, build_by_hand, quick_relaunch_script, spark_pipelines_traces, wait_healthy
from spark_sim.traffic import Clients
from tests.e2e.test_chain import is_heavy
from tests.plugins.distribution import sim_fleet_of

pytestmark = pytest.mark.slow

BUILD_STEPS = ("base_model", "hybrid_checkpoint", "mtp_weights", "base_image", "serving_image")
MODEL_STEPS = ("base_model", "hybrid_checkpoint", "mtp_weights")


@pytest.fixture(scope="module")
def hand(tmp_path_factory):
    root = tmp_path_factory.mktemp("hand")
    log = root / "commands.jsonl"
    os.environ["SPARK_COMMAND_LOG"] = str(log)
    try:
        with sim_fleet_of(2, root) as sim, dg.instance_for_test() as instance:
            t0 = time.monotonic()
            built = build_by_hand(sim, base_model_copied=True)
            built.seconds["total"] = round(time.monotonic() - t0, 1)
            yield {"sim": sim, "built": built, "fleet": str(sim.fleet_file), "instance": instance, "log": log,
                   "root": root}
    finally:
        os.environ.pop("SPARK_COMMAND_LOG", None)


def checkpoint_dir(sim, node: str) -> Path:
    return sim.node(node).home / "models" / "qwen35-122b-hybrid-int4fp8"


def file_states(sim, node: str) -> dict[str, tuple[int, int, int]]:
    """(inode, mtime, size) of every checkpoint file: a rewrite or a re-copy changes one of them."""
    d = checkpoint_dir(sim, node)
    return {p.relative_to(d).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(d.rglob("*")) if p.is_file()}


def jit_files(sim, node: str) -> dict[str, int]:
    """(mount/relative path -> inode) of every compiled-kernel file under the node's cache mounts
    (followed through their links once adoption keyed them)."""
    home = sim.node(node).home
    out = {}
    for mount in (".cache/vllm", ".cache/flashinfer", ".triton"):
        root = home / mount
        for f in sorted(root.rglob("*")) if root.exists() else []:
            if f.is_file() and f.name != ".spark-jit-sealed":
                out[f"{mount}/{f.relative_to(root).as_posix()}"] = f.stat().st_ino
    return out


def docker_id(sim, node: str, *args: str) -> str:
    m = sim.node(node)
    return subprocess.run(["docker", *args], capture_output=True, text=True,
                          env={**os.environ, "DOCKER_HOST": m.docker_host}).stdout.strip()


def run_job(hand, job: str, fleet: str | None = None, **kw):
    return build_definitions(fleet or hand["fleet"]).resolve_job_def(job).execute_in_process(
        instance=hand["instance"], raise_on_error=False, **kw)


def materialized(res) -> dict[str, dict]:
    out = {}
    for e in res.all_events:
        if e.event_type_value == "ASSET_MATERIALIZATION":
            m = e.event_specific_data.materialization
            out[m.asset_key.to_user_string()] = {k: v.value for k, v in m.metadata.items()}
    return out


def failures(res) -> str:
    return "\n".join((e.step_failure_data.user_failure_data.description if e.step_failure_data.user_failure_data
                      else e.step_failure_data.error.message) for e in res.all_events if e.is_step_failure)


def heavy_since(hand, since: int) -> list[str]:
    return [" ".join(r.argv)[:200] for r in read_command_log(hand["log"])[since:] if is_heavy(r.argv)]


def commands_so_far(hand) -> int:
    return len(read_command_log(hand["log"])) if hand["log"].exists() else 0


def adopt(hand, *, check: bool):
    fleet = load_fleet(hand["fleet"])
    cv = code_versions(fleet)
    with FleetSession(fleet) as s:
        found = adopt_build_host(s, cv, check=check)
        by = {f.step: f for f in found}
        mtp, serving = asset_value(by["mtp_weights"]), asset_value(by["serving_image"])
        nodes = [adopt_node_artifacts(s, n, mtp, serving, cv, check=check) for n in fleet.serve_nodes] if mtp else []
    return by, {f.node: f for f in nodes}


def test_the_hand_built_fleet_serves_and_carries_nothing_of_ours(hand):
    sim, built = hand["sim"], hand["built"]
    assert spark_pipelines_traces(sim) == []
    assert set(built.containers) == {"spark1", "spark2"} and built.image_id.startswith("sha256:")
    # The base model lies where a plain copy put it, without the metadata that names its revision.
    assert built.snapshot.endswith("/models/Intel--Qwen3.5-122B-A10B-int4-AutoRound"), built.snapshot
    assert not (Path(built.snapshot) / ".cache" / "huggingface").exists()
    key = os.environ["LITELLM_MASTER_KEY"]
    r = httpx.post(f"http://{sim.gateway.ip}:4000/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                   json={"model": "fast", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    config = yaml.safe_load(Path(built.gateway_config).read_text())
    assert len(config["model_list"]) == 6
    print(f"hand build: {built.seconds}")


def test_check_mode_writes_nothing_and_would_adopt_everything(hand):
    sim = hand["sim"]
    before = {n: file_states(sim, n) for n in ("spark1", "spark2")}
    t0 = time.monotonic()
    by, nodes = adopt(hand, check=True)
    seconds = time.monotonic() - t0
    assert {s: f.action for s, f in by.items()} == {s: ADOPT for s in BUILD_STEPS}, {s: f.why for s, f in by.items()}
    # Adopted although its revision cannot be proven, and said so.
    assert by["base_model"].facts["provenance"] == "unknown" and "provenance unknown" in by["base_model"].why
    assert nodes["spark2"].action == ADOPT, nodes["spark2"]
    assert spark_pipelines_traces(sim) == []  # no marker, no manifest
    assert {n: file_states(sim, n) for n in ("spark1", "spark2")} == before
    # What the lead records on the instance: the steps' own outputs and data versions.
    mtp = asset_value(by["mtp_weights"])
    assert by["mtp_weights"].facts["data_version"] == f"{mtp.index}-{mtp.manifest[:16]}"
    assert asset_value(by["base_image"]).torch == "2.12.0+cu130"
    assert asset_value(by["serving_image"]).image_id == hand["built"].image_id
    print(f"adopt --check (build host + 2 node copies): {seconds:.1f} s")


def streaming(hand, every_s: float = 0.4) -> Clients:
    """Clients streaming through the hand-built gateway for the whole of a block."""
    return Clients(hand["sim"], os.environ["LITELLM_MASTER_KEY"], every_s=every_s)


def not_checkpoint_heavy(hand, since: int) -> list[str]:
    """Heavy commands but the JIT cache's back-up (an rsync of compiled kernels to the build host's
    archive, which the chain's jit_cache step makes once per key): no rebuild, no copy of the
    checkpoint or the image, no docker run."""
    return [c for c in heavy_since(hand, since) if ".jit-" not in c and "jit-cache" not in c]


def stale_status(hand, fleet_path: str) -> dict[str, set]:
    graph = build_definitions(fleet_path).get_repository_def().asset_graph
    resolver = CachingStaleStatusResolver(hand["instance"], graph, LoadingContextForTest(hand["instance"]))
    out = {}
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        parts = node.partitions_def.get_partition_keys() if node.partitions_def else [None]
        out[key.to_user_string()] = {resolver.get_status(key, p) for p in parts}
    return out


def stale_causes(hand, step: str) -> list:
    graph = build_definitions(hand["fleet"]).get_repository_def().asset_graph
    resolver = CachingStaleStatusResolver(hand["instance"], graph, LoadingContextForTest(hand["instance"]))
    node = graph.get(dg.AssetKey(step))
    parts = node.partitions_def.get_partition_keys() if node.partitions_def else [None]
    return [c.reason for p in parts for c in resolver.get_stale_causes(dg.AssetKey(step), p)]


def adopt_fleet_check(hand, fleet: str | None = None, *args: str) -> tuple[int, dict]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["adopt", "--check", "--fleet", fleet or hand["fleet"], "--format", "json", *args])
    return rc, json.loads(buf.getvalue())


def actions(report: dict) -> dict[tuple[str, str], str]:
    return {(f["node"], f["step"]): f["action"] for f in report["findings"]}


def test_adopt_check_reads_the_whole_fleet_and_changes_nothing(hand):
    sim = hand["sim"]
    config = Path(hand["built"].gateway_config).read_bytes()
    t0 = time.monotonic()
    rc, report = adopt_fleet_check(hand)
    seconds = time.monotonic() - t0
    found = actions(report)
    assert rc == 0, report
    for node in ("spark1", "spark2"):
        assert found[(node, "node_deployment")] == ADOPT and found[(node, "jit_cache")] == ADOPT, report
    # spark1 holds the build host's own checkpoint: nothing to record for its copy
    assert found[("spark2", "node_artifacts")] == ADOPT and found[("spark1", "node_artifacts")] in (ADOPT, CURRENT)
    assert found[("gateway", "gateway")] == ADOPT
    assert spark_pipelines_traces(sim) == [] and Path(hand["built"].gateway_config).read_bytes() == config
    print(f"adopt --check, 2 nodes: {seconds:.1f} s")


def test_adoption_then_the_whole_chain_changes_nothing_that_serves(hand):
    """Issue 21, done when: adopt, then the whole chain, with clients streaming through the gateway
    all along: no container id changed, no checkpoint file or image rebuilt or re-copied, no
    client request failed, each node once per pool, every step current on the instance."""
    sim, built = hand["sim"], hand["built"]
    states = {n: file_states(sim, n) for n in ("spark1", "spark2")}
    kernels = {n: jit_files(sim, n) for n in states}
    assert all(kernels.values()), kernels  # the hand boots compiled kernels into the runbook's mounts
    images = {n: docker_id(sim, n, "image", "inspect", "--format", "{{.Id}}", "vllm-qwen35-v2") for n in states}
    since = commands_so_far(hand)
    with streaming(hand) as traffic:
        t0 = time.monotonic()
        res = run_job(hand, "adopt_job")
        adopt_seconds = time.monotonic() - t0
        assert res.success, failures(res)
        adopted = materialized(res)
        assert adopted["fleet_adoption"]["changes_nothing_that_serves"] is True
        assert "differs" not in adopted["fleet_adoption"]["summary"], adopted["fleet_adoption"]["findings"]
        assert "node_deployment[spark2]" in adopted["fleet_adoption"]["recorded"]
        # The instance shows every adopted step current before anything else ran.
        status = stale_status(hand, hand["fleet"])
        for step in (*BUILD_STEPS, "node_artifacts", "node_deployment", "gateway"):
            assert status[step] == {StaleStatus.FRESH}, (step, status[step], stale_causes(hand, step))
        sensor = build_definitions(hand["fleet"]).resolve_sensor_def("pins_changed")
        tick = sensor(dg.build_sensor_context(instance=hand["instance"]))
        assert not tick.run_requests, tick.run_requests
        # Then the chain as the README says: every step skips.
        res = run_job(hand, "build_job")
        assert res.success, failures(res)
        mats = materialized(res)
        # The base model of unknown provenance is proven by content (hf download fetches nothing
        # that matches); every other step skips.
        assert mats["base_model"]["provenance"].startswith("proven (by content"), mats["base_model"]
        rest = [s for s in BUILD_STEPS if s != "base_model"]
        assert all(mats[s]["skipped"] is True for s in rest), {s: mats[s].get("skipped") for s in rest}
        for node in ("spark1", "spark2"):
            dep = run_job(hand, "deploy_node_job", partition_key=node)
            assert dep.success, failures(dep)
            got = materialized(dep)
            assert got["node_artifacts"]["copied"] is False and got["node_deployment"]["skipped"] is True, got
            assert got["node_deployment"]["adopted"] is True
        gw = run_job(hand, "gateway_job")
        assert gw.success, failures(gw)
        for node in ("spark1", "spark2"):
            bench = run_job(hand, "bench_job", partition_key=node)
            assert bench.success, failures(bench)
            b = materialized(bench)["bench_results"]
            # The drain emptied every route to the node: the bench measured it alone.
            assert b["void"] == "no" and b["isolation"].startswith("verified idle"), (b["void"], b["isolation"])
    assert not traffic.failed, traffic.failed
    assert len(traffic.streams.results) > 40 and {s.node for s in traffic.streams.results} == {"spark1", "spark2"}
    assert [c for c in not_checkpoint_heavy(hand, since) if "hf download" not in c] == []
    after = {n: file_states(sim, n) for n in states}
    # Each node's checkpoint became a version by a rename: the runbook's path is a link to it.
    for n in states:
        link = checkpoint_dir(sim, n)
        assert link.is_symlink() and ".v-" in os.readlink(link), (n, link)
    # No compiled kernel lost: every file is there, the same inode (keyed by a rename, not copied).
    for n, files in kernels.items():
        now = jit_files(sim, n)
        assert {f: now.get(f) for f in files} == files, n
    # Every file the hand build wrote is the very same file (inode, mtime, size): nothing rebuilt
    # or re-copied. Adoption's one addition is the manifest it hashed from those files.
    assert {n: {f: st for f, st in files.items() if f in states[n]} for n, files in after.items()} == states
    assert {n: sorted(set(after[n]) - set(states[n])) for n in states} == {n: [".spark-manifest.json"] for n in states}
    assert {n: docker_id(sim, n, "image", "inspect", "--format", "{{.Id}}", "vllm-qwen35-v2") for n in states} == images
    for node, cid in built.containers.items():
        assert docker_id(sim, node, "inspect", "--format", "{{.Id}} {{.State.Running}}", "vllm-qwen35-v2") == f"{cid} true"
    config = yaml.safe_load(Path(built.gateway_config).read_text())
    pairs = [(e["model_name"], e["litellm_params"]["api_base"]) for e in config["model_list"]]
    assert len(pairs) == len(set(pairs)) == 6  # each node once per pool
    assert "# spark1 entries" in Path(built.gateway_config).read_text()  # the operator's comments kept
    print(f"adopt_job, 2 nodes: {adopt_seconds:.1f} s; client requests {len(traffic.streams.results)}, failed 0, "
          f"resent before any answer {len(traffic.resent)} {traffic.resent}; containers restarted 0; checkpoint "
          f"files rewritten 0 of {sum(len(s) for s in states.values())}; JIT files lost 0 of "
          f"{sum(len(k) for k in kernels.values())}")


def test_a_changed_launch_profile_rolls_out_through_drains_that_empty_the_node(hand):
    path = relaunch_variant(hand, "fleet-v2.yaml", env={"VLLM_LOGGING_LEVEL": "INFO"})
    with streaming(hand) as traffic:
        res = run_job(hand, "rollout_job", fleet=path)
    assert res.success, failures(res)
    assert not traffic.failed, traffic.failed
    print(f"rollout: client requests {len(traffic.streams.results)}, failed 0, resent {len(traffic.resent)}")
    fleet = load_fleet(path)
    with FleetSession(fleet) as s:
        for n in fleet.serve_nodes:
            c = s.run(n.name, ["docker", "inspect", "--format", '{{index .Config.Labels "org.spark-pipelines.deploy"}}',
                               "vllm-qwen35-v2"], log=False).stdout.strip()
            assert c == launch_spec(fleet, n).fingerprint, (n.name, c)


def test_one_node_unlike_the_fleet_file_is_reported_and_moved_only_by_the_rollout(hand):
    """spark2 relaunched by hand with the runbook's quick-relaunch script (MAX_JOBS and
    FLASHINFER_NVCC_THREADS only): adoption lists the difference field by field and changes
    nothing; the next rollout moves spark2 through a real drain and leaves spark1 alone."""
    sim = hand["sim"]
    path = str(hand["root"] / "fleet-v2.yaml")
    Hand(sim, lambda _: None).run(sim.node("spark2"), quick_relaunch_script(), "quick relaunch")
    wait_healthy([sim.node("spark2")])
    cid = docker_id(sim, "spark2", "inspect", "--format", "{{.Id}}", "vllm-qwen35-v2")
    spark1 = docker_id(sim, "spark1", "inspect", "--format", "{{.Id}}", "vllm-qwen35-v2")
    rc, report = adopt_fleet_check(hand, path)
    assert rc == 1
    diff = next(f for f in report["findings"] if f["node"] == "spark2" and f["step"] == "node_deployment")
    assert diff["action"] == DIFFERS and any(d.startswith("env VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS: not set")
                                             for d in diff["differences"]), diff
    res = run_job(hand, "adopt_job", fleet=path)
    assert res.success, failures(res)
    assert docker_id(sim, "spark2", "inspect", "--format", "{{.Id}}", "vllm-qwen35-v2") == cid  # left as it is
    with streaming(hand) as traffic:
        res = run_job(hand, "rollout_job", fleet=path)
    assert res.success, failures(res)
    assert not traffic.failed, traffic.failed
    print(f"rollout of the unlike node: client requests {len(traffic.streams.results)}, failed 0, "
          f"resent {len(traffic.resent)}")
    assert docker_id(sim, "spark2", "inspect", "--format", "{{.Id}}", "vllm-qwen35-v2") != cid
    assert docker_id(sim, "spark1", "inspect", "--format", "{{.Id}}", "vllm-qwen35-v2") == spark1
    rc, report = adopt_fleet_check(hand, path)
    assert rc == 0 and actions(report)[("spark2", "node_deployment")] == CURRENT, report


def relaunch_variant(hand, name: str, **launch) -> str:
    data = yaml.safe_load(open(hand["fleet"]))
    for k, v in launch.items():
        if k == "env":
            data["launch"]["env"].update(v)
        else:
            data["launch"][k] = v
    path = hand["root"] / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def _bump_recipe(hand) -> str:
    """A new commit of the sim's recipe repository and a fleet file pinning it."""
    repo = hand["sim"].layout.root / "upstream" / "recipe"
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    (repo / "CHANGELOG.md").write_text("a newer recipe commit\n")
    for argv in (["add", "-A"], ["commit", "-qm", "newer recipe"]):
        subprocess.run(["git", "-C", str(repo), *argv], env=env, check=True)
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    doc = yaml.safe_load(open(hand["fleet"]))
    doc["pins"]["recipe_repo"]["commit"] = sha
    path = hand["root"] / "newer-recipe.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    hand["bumped"] = str(path)
    return str(path)


def test_a_recipe_pin_change_rebuilds_beside_and_finds_the_version_that_serves(hand):
    sim = hand["sim"]
    serving = checkpoint_dir(sim, "spark1")
    fleet = _bump_recipe(hand)
    seen = {"polls": 0, "problems": [], "health": 0}
    stop = threading.Event()
    m = sim.node("spark1")

    def watch():
        while not stop.is_set():
            try:
                wm = json.loads((serving / INDEX_NAME).read_text())["weight_map"]
                if not any(k.startswith("mtp.") and v == "model_extra_tensors.safetensors" for k, v in wm.items()):
                    seen["problems"].append("index without MTP keys")
            except (OSError, ValueError, KeyError) as e:
                seen["problems"].append(f"{type(e).__name__}: {e}")
            seen["polls"] += 1
            if seen["polls"] % 50 == 0:
                with urllib.request.urlopen(f"http://{m.ip}:8000/health", timeout=5) as r:
                    seen["health"] += r.status == 200

    watcher = threading.Thread(target=watch, daemon=True)
    target = os.readlink(serving)
    files = {p.name: p.stat().st_ino for p in serving.iterdir() if p.is_file()}
    # What serves now (the rollout tests above relaunched the hand containers): the rebuild must
    # leave exactly it running, on the same files.
    serving_container = docker_id(sim, "spark1", "inspect", "--format", "{{.Id}} {{.State.Running}}", "vllm-qwen35-v2")
    assert serving_container.endswith(" true")
    watcher.start()
    try:
        res = run_job(hand, "build_job", fleet, asset_selection=[dg.AssetKey(k) for k in MODEL_STEPS])
    finally:
        stop.set()
        watcher.join(10)
    assert res.success, failures(res)
    mats = materialized(res)
    assert mats["hybrid_checkpoint"]["skipped"] is False and mats["hybrid_checkpoint"]["staged"] is True
    # The newer recipe commit changes nothing the builder reads: the rebuild, made beside, hashes to
    # the very version that serves, so it IS that version (issue 33): the staging copy goes,
    # nothing is renamed over it, nothing is left to copy to the nodes or to restart.
    assert mats["mtp_weights"]["same_as_held_version"] is True and mats["mtp_weights"]["version"] == target
    assert seen["problems"] == [] and seen["polls"] > 100 and seen["health"] > 0, seen
    assert os.readlink(serving) == target and {p.name: p.stat().st_ino for p in serving.iterdir() if p.is_file()} == files
    built = serving.parent / mats["mtp_weights"]["version"]
    assert built.is_dir() and not (serving.parent / f".{serving.name}.staging").exists()
    assert sorted(p.name for p in serving.parent.iterdir() if p.name.startswith(serving.name)) == [serving.name, target]
    assert docker_id(sim, "spark1", "inspect", "--format", "{{.Id}} {{.State.Running}}", "vllm-qwen35-v2") == serving_container
    hand["bumped_version"] = str(built)


def test_a_shard_damaged_in_place_on_the_build_host_is_found_and_rebuilt(hand):
    """Issue 22.7: same size, same mtime. The build host's own node_artifacts refuses it (naming the
    file) before a deploy uses it; build_job's mtp_weights finds it on its skip and rebuilds beside."""
    sim = hand["sim"]
    fleet = hand.get("bumped") or _bump_recipe(hand)
    # The version mtp_weights built last: the one node_artifacts would copy and a deploy launch.
    version = Path(hand.get("bumped_version") or checkpoint_dir(sim, "spark1"))
    victim = version / "model-00003-of-00014.safetensors"
    good = hashlib.sha256(victim.read_bytes()).hexdigest()
    st = victim.stat()
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF
    with victim.open("r+b") as fh:
        fh.write(bytes(data))
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    deploy = run_job(hand, "deploy_node_job", fleet, partition_key="spark1",
                     asset_selection=[dg.AssetKey("node_artifacts")])
    assert not deploy.success
    why = failures(deploy)
    assert victim.name in why and "content differs, same size" in why and "rerun build_job" in why, why
    res = run_job(hand, "build_job", fleet, asset_selection=[dg.AssetKey(k) for k in MODEL_STEPS])
    assert res.success, failures(res)
    mtp = materialized(res)["mtp_weights"]
    assert mtp["skipped"] is False and victim.name in mtp["rebuilt_because"] and mtp["rebuilt"] == "steps 1 and 2"
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == good
    again = run_job(hand, "deploy_node_job", fleet, partition_key="spark1",
                    asset_selection=[dg.AssetKey("node_artifacts")])
    assert again.success, failures(again)


def test_adoption_reports_what_differs_from_the_fleet_file_and_writes_nothing(hand):
    """After the rebuild at the newer recipe commit, the original fleet file pins the older one:
    adoption says so field by field and changes nothing (the next build_job rebuilds beside)."""
    sim = hand["sim"]
    hand.get("bumped") or _bump_recipe(hand)
    state = sim.node("spark1").home / ".cache" / "spark-pipelines" / "markers"
    before = {p.name: p.read_bytes() for p in state.iterdir()}
    files = file_states(sim, "spark1")
    by, _ = adopt(hand, check=False)
    assert by["hybrid_checkpoint"].action == "differs", by["hybrid_checkpoint"]
    assert any(d.startswith("recipe checkout: ") and "pins.recipe_repo.commit" in d
               for d in by["hybrid_checkpoint"].differences), by["hybrid_checkpoint"].differences
    assert by["mtp_weights"].action == "differs"
    assert by["base_model"].action == CURRENT and by["base_image"].action == CURRENT
    assert {p.name: p.read_bytes() for p in state.iterdir()} == before
    assert file_states(sim, "spark1") == files
