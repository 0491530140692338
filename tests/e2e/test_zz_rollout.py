"""rollout_job against the simulated fleet (real sshd, dockerd, vLLM stand-ins, a real LiteLLM
proxy) with a real Dagster instance: a new launch spec reaches both nodes canary first, every
node deployed, benched (speed and quality) against the fleet's baseline and finished; a slower
version (no FLASHINFER), one without MTP and one that answers fast but wrong (the unpatched
image) each stop at the canary on their gate (baseline, MTP acceptance, quality), the canary goes
back to its previous container while the other node is never touched; the gateway keeps a node
throughout, and no node's new version is in the running proxy's routes before its gate passed;
a last rollout brings the fleet back."""

from __future__ import annotations

import _thread
import re
import threading
import time
from pathlib import Path

import httpx

import dagster as dg
import pytest
import yaml
from dagster._core.definitions.data_version import CachingStaleStatusResolver
from dagster._core.loader import LoadingContextForTest

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.launch import DEPLOY_LABEL, launch_spec
from spark_pipelines.definitions import build_definitions
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.resources import engine
from spark_pipelines.state import ledger, markers
from spark_pipelines.runbook import versions
from spark_pipelines.runbook.deploy import ROLLOUT_POINT
from tests.e2e.test_zz_doctor import inspect

pytestmark = pytest.mark.slow


def variant(base: str, dest: Path, **launch) -> str:
    doc = yaml.safe_load(Path(base).read_text())
    for k, v in launch.items():
        if k == "env":
            doc["launch"]["env"] = {**doc["launch"]["env"], **v}
        else:
            doc["launch"][k] = v
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(dest)


@pytest.fixture(scope="module")
def env(sim_fleet, tmp_path_factory):
    """Both serve nodes deployed, in the gateway and benched (the baseline) on the sim's fleet file."""
    path = str(sim_fleet.fleet_file)
    fleet = load_fleet(path)
    root = tmp_path_factory.mktemp("rollout")
    (root / "dagster").mkdir()
    instance = dg.DagsterInstance.local_temp(str(root / "dagster"))
    defs = build_definitions(path)
    try:
        assert defs.resolve_job_def("build_job").execute_in_process(instance=instance).success
        for n in fleet.serve_nodes:
            assert defs.resolve_job_def("deploy_node_job").execute_in_process(
                instance=instance, partition_key=n.name).success
        assert defs.resolve_job_def("gateway_job").execute_in_process(instance=instance).success
        for n in fleet.serve_nodes:
            assert defs.resolve_job_def("bench_job").execute_in_process(instance=instance, partition_key=n.name).success
        yield {"instance": instance, "fleet": fleet, "path": path, "root": root}
    finally:
        instance.dispose()


class RotationWatch:
    """Samples the proxy's rotation while a rollout runs: its config as the gateway host holds it
    (`sizes`, every 0.5 s) and what the running proxy routes to (`serving`: wall clock, nodes;
    its /model/info every 0.1 s)."""

    def __init__(self, fleet):
        self.fleet, self.sizes, self.serving, self._stop = fleet, [], [], threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        with FleetSession(self.fleet) as s:
            gw = GatewayHost(s)
            i = 0
            while not self._stop.wait(0.1):
                try:
                    self.serving.append((time.time(), tuple(gw.serving_nodes())))
                    if i % 5 == 0:
                        self.sizes.append(len(gw.rotation()))
                except Exception:
                    pass
                i += 1

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=30)


def roll_out(env, path: str) -> tuple[dg.ExecuteInProcessResult, list[int]]:
    defs = build_definitions(path)
    with RotationWatch(env["fleet"]) as watch:
        res = defs.resolve_job_def("rollout_job").execute_in_process(instance=env["instance"], raise_on_error=False)
    env["serving"] = watch.serving
    return res, watch.sizes


def routed_before_its_gate(env, run_id: str) -> dict[str, str]:
    """Per node of the rollout run: how the running proxy's routes to it went from the event
    "deploying <node>" to its gate's verdict ("<node> passed" / "failed" / "rolled back"). The
    node must leave the routes once (its deploy's drain) and come back only after its gate: a
    second time out means it was routed in between, its new version serving before its gate
    (issue 34.3: back for 1.5-6.5 s after each deploy). Returns node -> the sequence, for those
    that came back early."""
    recs = env["instance"].fetch_observations(dg.AssetKey("fleet_rollout"), limit=400).records
    events = sorted((r.timestamp, r.asset_observation.metadata["event"].value) for r in recs if r.run_id == run_id)
    early: dict[str, str] = {}
    for t0, said in events:
        if ": deploying " not in said:
            continue
        node = said.rsplit(" ", 1)[1]
        ends = [t for t, e in events if t > t0 and e.split(": ", 1)[-1].startswith(f"{node} ")
                and e.split(": ", 1)[-1].split(" ")[1] in ("passed", "failed", "rolled")]
        if not ends:
            continue
        seen = [node in nodes for t, nodes in env["serving"] if t0 <= t <= ends[0]]
        runs = "".join("i" if x else "o" for i, x in enumerate(seen) if i == 0 or seen[i - 1] != x)
        assert "o" in runs, f"{node} never left the routes between its deploy and its gate: {runs}"
        if runs.count("o") > 1:
            early[node] = runs
    return early


def state(env, path: str) -> dict:
    """node -> (container id, its launch-spec label, the spec the file asks for, leftovers)."""
    fleet = load_fleet(path)
    out = {}
    with FleetSession(fleet) as s:
        for n in fleet.serve_nodes:
            spec = launch_spec(fleet, n)
            c = inspect(s, n.name, spec.container_name)
            names = s.run(n.name, ["docker", "ps", "-a", "--format", "{{.Names}}"], log=False, timeout=30).stdout.split()
            out[n.name] = {"id": c["Id"], "label": c["Config"]["Labels"].get(DEPLOY_LABEL), "wanted": spec.fingerprint,
                           "previous_left": [x for x in names if x.endswith("-previous")],
                           "point": markers.read(s, n, ROLLOUT_POINT), "healthy": engine.healthy(fleet, n)}
        out["rotation"] = GatewayHost(s).rotation()
    return out


def observations(env, run_id: str) -> list[dict]:
    """fleet_rollout's progress observations of one rollout run, oldest first."""
    recs = env["instance"].fetch_observations(dg.AssetKey("fleet_rollout"), limit=200).records
    return [r.asset_observation.metadata for r in reversed(recs) if r.run_id == run_id]


def stale(env, path: str) -> dict[str, str]:
    """node -> node_deployment's stale status as Dagster's UI computes it for the fleet at `path`."""
    graph = build_definitions(path).get_repository_def().asset_graph
    resolver = CachingStaleStatusResolver(env["instance"], graph, LoadingContextForTest(env["instance"]))
    return {n: resolver.get_status(dg.AssetKey("node_deployment"), n).value for n in ("spark1", "spark2")}


def pins_tick(env, path: str):
    """One pins_changed evaluation on the definitions of `path`; its observations stored as the daemon does."""
    defs = build_definitions(path)
    res = defs.get_repository_def().get_sensor_def("pins_changed")(
        dg.build_sensor_context(instance=env["instance"], definitions=defs))
    for event in res.asset_events:
        env["instance"].report_runless_asset_event(event)
    return res


def test_an_override_on_spark2_rolls_out_spark2_alone_and_spark1_stays_fresh(env):
    """A node's launch is its data: the real node_deployment runs recorded each node's launch, so
    the sensor's first tick marks nothing stale; spark2's override alone makes spark2 stale and
    asks a rollout for it; the rollout (its configured canary spark1 already on its version) deploys
    spark2 alone; spark1 keeps its container and its skip marker, and its next deploy skips."""
    assert stale(env, env["path"]) == {"spark1": "FRESH", "spark2": "FRESH"}
    first = pins_tick(env, env["path"])
    assert not first.run_requests and not first.asset_events
    with FleetSession(env["fleet"]) as s:
        marker1 = markers.read_deploy(s, env["fleet"].node("spark1"))
    before = state(env, env["path"])

    doc = yaml.safe_load(Path(env["path"]).read_text())
    doc["nodes"][[n["name"] for n in doc["nodes"]].index("spark2")]["overrides"] = {"env": {"SPARK_LAUNCH_NOTE": "spark2-only"}}
    doc.setdefault("rollout", {})["canary"] = "spark1"
    path = str(env["root"] / "fleet-spark2.yaml")
    Path(path).write_text(yaml.safe_dump(doc, sort_keys=False))
    [req] = pins_tick(env, path).run_requests
    assert req.job_name == "rollout_job" and req.tags["nodes"] == "spark2"
    assert stale(env, path) == {"spark1": "FRESH", "spark2": "STALE"}

    res, sizes = roll_out(env, path)
    assert res.success, res.all_events
    after = state(env, path)
    assert after["spark1"]["id"] == before["spark1"]["id"]  # left as it is
    assert after["spark2"]["id"] != before["spark2"]["id"] and after["spark2"]["label"] == after["spark2"]["wanted"]
    rows = {r.data["node"]: r.data for r in res.asset_materializations_for_node("fleet_rollout")[-1]
            .metadata["nodes"].value.records}
    assert rows["spark2"]["wave"] == "canary" and rows["spark2"]["state"] == "passed", rows
    assert stale(env, path) == {"spark1": "FRESH", "spark2": "FRESH"}
    assert not pins_tick(env, path).run_requests
    with FleetSession(env["fleet"]) as s:
        assert markers.read_deploy(s, env["fleet"].node("spark1")).signature == marker1.signature
    dep = build_definitions(path).resolve_job_def("deploy_node_job").execute_in_process(
        instance=env["instance"], partition_key="spark1")
    assert dep.success and dep.asset_materializations_for_node("node_deployment")[0].metadata["skipped"].value is True


def test_a_new_launch_spec_rolls_out_canary_first_gated_and_finished(env):
    new = variant(env["path"], env["root"] / "fleet-v2.yaml", env={"VLLM_LOGGING_LEVEL": "INFO"})
    started = time.monotonic()
    res, sizes = roll_out(env, new)
    took = time.monotonic() - started
    assert res.success, res.all_events
    after = state(env, new)
    for n in ("spark1", "spark2"):
        assert after[n]["label"] == after[n]["wanted"] and after[n]["healthy"]
        assert after[n]["previous_left"] == [] and after[n]["point"] is None  # finished: nothing kept
    assert sorted(after["rotation"]) == ["spark1", "spark2"]
    assert sizes and min(sizes) >= 1, sizes  # max_unavailable 1 of 2: the gateway always kept one
    # Out from its deploy until its gate passed: no request reached a version before its gate.
    assert routed_before_its_gate(env, res.run_id) == {}
    mat = res.asset_materializations_for_node("fleet_rollout")[-1].metadata
    rows = {r.data["node"]: r.data for r in mat["nodes"].value.records}
    assert rows["spark1"]["wave"] == "canary" and rows["spark2"]["wave"] == "wave 1"
    assert {r["state"] for r in rows.values()} == {"passed"}
    assert all("vs baseline" in r["why"] for r in rows.values()), rows  # judged against the fleet's benches
    assert all("quality 100/100" in r["why"] for r in rows.values()), rows  # the quality gate passed too
    events = [o["event"].value for o in observations(env, res.run_id)]
    assert events[0].startswith("canary starts: spark1") and "wave 1: deploying spark2" in events
    assert events.index("canary: spark1 passed") < events.index("wave 1: deploying spark2")
    # each node's deploy and bench are on its own partitions too
    for asset in ("node_deployment", "bench_results"):
        for n in ("spark1", "spark2"):
            rec = env["instance"].fetch_materializations(dg.AssetRecordsFilter(
                asset_key=dg.AssetKey(asset), asset_partitions=[n]), limit=1).records[0]
            assert rec.asset_materialization.metadata["rollout_run"].value == res.run_id
            if asset == "bench_results":  # the quality figures, per node
                meta = rec.asset_materialization.metadata
                assert meta["quality_score"].value == 100 and meta["quality_checks"].value == "all passed"
                assert meta["quality_sequential"].value == meta["quality_parallel4"].value == 100
                assert meta["bench_protocol"].value.startswith("v1|forced|server usage")
    print(f"rollout of 2 nodes: {took:.0f} s; rotation sizes seen {sorted(set(sizes))}")


def stopped_at_the_canary(env, path: str, gate: str) -> dict:
    """Roll `path` out; it must stop at the canary on `gate`, spark1 back on its container, spark2
    never touched, both serving in the gateway. Returns the failure's metadata."""
    v2 = str(env["root"] / "fleet-v2.yaml")
    before = state(env, v2)
    res, sizes = roll_out(env, path)
    assert not res.success
    failure = next(e for e in res.all_events if e.event_type_value == "STEP_FAILURE")
    info = failure.step_failure_data.user_failure_data
    assert info.metadata["failed_gate"].value == gate and info.metadata["failed_node"].value == "spark1", info.description
    assert "stopped at the canary: spark1" in info.description and "not started: spark2" in info.description
    after = state(env, v2)
    # The canary runs its previous container again; spark2 was never touched.
    assert after["spark1"]["id"] == before["spark1"]["id"] and after["spark1"]["label"] == before["spark1"]["wanted"]
    assert after["spark1"]["healthy"] and after["spark1"]["point"] is None and after["spark1"]["previous_left"] == []
    assert after["spark2"]["id"] == before["spark2"]["id"]
    assert sorted(after["rotation"]) == ["spark1", "spark2"]
    assert sizes and min(sizes) >= 1, sizes
    # The version that failed its gate was never in the proxy's routes (the canary's is the one deployed).
    assert routed_before_its_gate(env, res.run_id) == {}
    rows = {r.data["node"]: r.data for r in info.metadata["nodes"].value.records}
    assert rows["spark1"]["state"] == "rolled back" and rows["spark2"]["state"] == "not started"
    return {k: v.value for k, v in info.metadata.items() if k != "nodes"}


def test_a_slower_version_fails_the_baseline_gate_at_the_canary_and_goes_back(env):
    # Without FLASHINFER: the runbook's "only ~17 tok/s" of 52; above the floor, far below the fleet.
    slow = variant(str(env["root"] / "fleet-v2.yaml"), env["root"] / "fleet-triton.yaml", attention_backend="TRITON_ATTN")
    info = stopped_at_the_canary(env, slow, "baseline")
    assert "below the fleet's baseline" in info["why"]
    # Judged while drained for its bench: the slower version never went back into the gateway.
    rec = env["instance"].fetch_materializations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey("bench_results"), asset_partitions=["spark1"]), limit=1).records[0]
    meta = rec.asset_materialization.metadata
    assert meta["promoted"].value is False and meta["mean_tok_s"].value >= env["fleet"].bench.floor_tok_s
    assert "the baseline gate failed" in meta["gate"].value, meta["gate"].value


def test_a_version_without_mtp_fails_the_acceptance_gate_at_the_canary_and_goes_back(env):
    nospec = variant(str(env["root"] / "fleet-v2.yaml"), env["root"] / "fleet-nospec.yaml", speculative=None)
    info = stopped_at_the_canary(env, nospec, "MTP acceptance")
    assert "--speculative-config" in info["why"]


def test_an_image_that_answers_fast_but_wrong_fails_the_quality_gate_at_the_canary_and_goes_back(env):
    # The unpatched image of the runbook's troubleshooting table ("Garbage output"): as fast, with
    # MTP accepting as before, so only the quality phase can tell.
    garbage = variant(str(env["root"] / "fleet-v2.yaml"), env["root"] / "fleet-garbage.yaml",
                      env={"SIM_ANSWERS": "garbage"})
    info = stopped_at_the_canary(env, garbage, "quality")
    assert "smoke answer" in info["why"] and "patched image" in info["why"], info["why"]
    rec = env["instance"].fetch_materializations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey("bench_results"), asset_partitions=["spark1"]), limit=1).records[0]
    meta = rec.asset_materialization.metadata
    assert meta["quality_score"].value == 0 and meta["promoted"].value is False
    assert meta["mean_tok_s"].value >= env["fleet"].bench.floor_tok_s  # fast: the speed gates passed
    assert "smoke answer" in meta["quality_checks"].value


def test_a_rollout_terminated_once_the_canary_committed_puts_the_canary_back(env):
    """The interrupt (what a run termination is in the step) lands once the canary's deploy has
    committed (its rollout point exists: the deploy's last steps or its bench run), before its
    gate judged it: the canary goes back to its previous container, the interrupt propagates,
    spark2 is never touched."""
    v2 = str(env["root"] / "fleet-v2.yaml")
    before = state(env, v2)
    seen = threading.Event()

    def interrupt_when_committed():
        with FleetSession(env["fleet"]) as s:
            node = env["fleet"].node("spark1")
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                if markers.read(s, node, ROLLOUT_POINT) is not None:
                    seen.set()
                    _thread.interrupt_main()
                    return
                time.sleep(0.2)

    watcher = threading.Thread(target=interrupt_when_committed, daemon=True)
    watcher.start()
    defs = build_definitions(env["path"])
    try:
        res = defs.resolve_job_def("rollout_job").execute_in_process(instance=env["instance"], raise_on_error=False)
        interrupted = not res.success
    except KeyboardInterrupt:
        interrupted = True
    watcher.join(10)
    assert seen.is_set() and interrupted
    after = state(env, v2)
    assert after["spark1"]["id"] == before["spark1"]["id"] and after["spark1"]["healthy"]
    assert after["spark1"]["point"] is None and after["spark1"]["previous_left"] == []
    assert after["spark2"]["id"] == before["spark2"]["id"]
    assert sorted(after["rotation"]) == ["spark1", "spark2"]


def with_base_revision(base: str, dest: Path, revision: str) -> str:
    doc = yaml.safe_load(Path(base).read_text())
    doc["pins"]["base_model"]["revision"] = revision
    dest.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(dest)


def loaded_checkpoint(fleet, node: str) -> str | None:
    """Which checkpoint content the engine says it loaded (the stand-in's own metric): asked of the
    engine, not of a marker or a link."""
    n = fleet.node(node)
    text = httpx.get(f"{engine.api_root(fleet, n)}/metrics", timeout=10).text
    m = re.search(r'spark_sim:checkpoint_loaded\{[^}]*digest="([0-9a-f]+)"', text)
    return m.group(1) if m else None


def mounted_versions(s, node: str, container: str) -> list[str]:
    c = inspect(s, node, container)
    return [m["Source"] for m in c.get("Mounts", []) if ".v-" in m["Source"]]


class MountWatch:
    """Samples, every half second, which checkpoint version spark2's container mounts and which
    content its engine reports, while a rollout runs (the wave node must not move before its turn)."""

    def __init__(self, fleet, node: str):
        self.fleet, self.node, self.mounts, self.loaded = fleet, node, set(), set()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        name = launch_spec(self.fleet, self.fleet.node(self.node)).container_name
        with FleetSession(self.fleet) as s:
            while not self._stop.wait(0.5):
                try:
                    self.mounts.update(mounted_versions(s, self.node, name))
                    self.loaded.add(loaded_checkpoint(self.fleet, self.node))
                except Exception:
                    pass

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=30)


def build(env, path: str) -> dict:
    defs = build_definitions(path)
    res = defs.resolve_job_def("build_job").execute_in_process(instance=env["instance"], raise_on_error=False)
    assert res.success, [e.message for e in res.all_events if e.is_failure]
    return {k: v.value for k, v in res.asset_materializations_for_node("mtp_weights")[-1].metadata.items()}


def test_a_checkpoint_that_fails_its_gate_is_reverted_and_the_canary_serves_the_old_weights(env, monkeypatch):
    """Issue 33: new weights (the sim hub's BROKEN revision: same architecture, a tokenizer config
    that makes the engine answer garbage) stop at the canary on the quality gate; the canary's engine
    then reports the old checkpoint, also after its container restarts, and spark2 never mounted
    or loaded the new one."""
    from spark_sim.upstream import INTEL_REVISION_BROKEN

    fleet = env["fleet"]
    v2 = str(env["root"] / "fleet-v2.yaml")
    broken = with_base_revision(v2, env["root"] / "fleet-broken-weights.yaml", INTEL_REVISION_BROKEN)
    old = {n: loaded_checkpoint(fleet, n) for n in ("spark1", "spark2")}
    assert old["spark1"] and old["spark1"] == old["spark2"]
    built = build(env, broken)
    new = built["manifest"]
    assert built["skipped"] is False and new != old["spark1"]
    before = state(env, v2)
    from spark_pipelines.runbook import rollout as node_rollout

    timed, revert = [], node_rollout.revert

    def timed_revert(*args, **kw):
        t0 = time.monotonic()
        try:
            return revert(*args, **kw)
        finally:
            timed.append(time.monotonic() - t0)

    monkeypatch.setattr(node_rollout, "revert", timed_revert)
    with MountWatch(fleet, "spark2") as watch:
        res, sizes = roll_out(env, broken)
    assert not res.success
    failure = next(e for e in res.all_events if e.event_type_value == "STEP_FAILURE")
    info = failure.step_failure_data.user_failure_data
    assert info.metadata["failed_gate"].value == "quality" and info.metadata["failed_node"].value == "spark1"
    # The revert says what it put back, on the canary's node_deployment partition.
    said = env["instance"].fetch_observations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey("node_deployment"), asset_partitions=["spark1"]), limit=1).records[0]
    assert "checkpoint put back" in said.asset_observation.description, said.asset_observation.description
    started = time.monotonic()
    after = state(env, v2)
    assert after["spark1"]["id"] == before["spark1"]["id"] and after["spark1"]["healthy"]
    assert after["spark2"]["id"] == before["spark2"]["id"] and sorted(after["rotation"]) == ["spark1", "spark2"]
    assert loaded_checkpoint(fleet, "spark1") == old["spark1"]  # the engine serves the old weights
    # The wave node never mounted nor loaded the new weights (they were copied there, unmounted).
    assert watch.loaded - {None} == {old["spark2"]} and not any(new[:16] in m for m in watch.mounts), watch.mounts
    with FleetSession(fleet) as s:
        held = {n: versions.read(s, fleet.node(n)) for n in ("spark1", "spark2")}
        assert all(h.holds(new) is not None and h.serving == old["spark1"][:16] for h in held.values()), held
        # A crash-restart of the reverted canary: the container mounts its own version, so it
        # comes back on the old weights whatever was copied since.
        name = launch_spec(fleet, fleet.node("spark1")).container_name
        s.run("spark1", ["docker", "restart", "-t", "5", name], log=False, timeout=120)
        assert engine.wait_healthy(fleet, fleet.node("spark1"), 120)
    assert loaded_checkpoint(fleet, "spark1") == old["spark1"]
    # The rejected version never reaches a node by a deploy without a gate (a healing redeploy is
    # a deploy_node_job): refused on spark2, which the rollout never reached, nothing changed there.
    ungated = build_definitions(broken).resolve_job_def("deploy_node_job").execute_in_process(
        instance=env["instance"], partition_key="spark2", raise_on_error=False)
    assert not ungated.success
    refused = next(e for e in ungated.all_events if e.event_type_value == "STEP_FAILURE")
    words = refused.step_failure_data.user_failure_data.description
    assert "rejected this version" in words and "quality gate" in words and "allow_rejected" in words, words
    assert state(env, v2)["spark2"]["id"] == before["spark2"]["id"] and loaded_checkpoint(fleet, "spark2") == old["spark2"]
    print(f"checkpoint revert of the canary: {timed[0]:.1f} s (drain, link back, kept container started, "
          f"/health, back in the gateway); state read {time.monotonic() - started:.1f} s; rotation sizes "
          f"{sorted(set(sizes))}")


def test_a_good_checkpoint_rolls_out_and_leaves_the_previous_version_as_the_way_back(env):
    from spark_sim.upstream import INTEL_REVISION_NEXT

    fleet = env["fleet"]
    v2 = str(env["root"] / "fleet-v2.yaml")
    good = with_base_revision(v2, env["root"] / "fleet-next-weights.yaml", INTEL_REVISION_NEXT)
    old = loaded_checkpoint(fleet, "spark1")
    new = build(env, good)["manifest"]
    res, sizes = roll_out(env, good)
    assert res.success and min(sizes) >= 1
    assert {loaded_checkpoint(fleet, n) for n in ("spark1", "spark2")} == {new[:16]}
    rows = {r.data["node"]: r.data for r in res.asset_materializations_for_node("fleet_rollout")[-1]
            .metadata["nodes"].value.records}
    assert all(f"checkpoint {new[:16]}" in r["now"] for r in rows.values()), rows
    with FleetSession(fleet) as s:
        for n in ("spark1", "spark2"):
            held = versions.read(s, fleet.node(n))
            assert held.serving == new[:16] and held.holds(old) is not None  # the way back stays on disk
            good_marker = markers.read_known_good(s, fleet.node(n))
            assert good_marker is not None and good_marker.checkpoint == new[:16]
            kib = held.total_kib
            print(f"{n}: {len(held.versions)} checkpoint versions kept, {kib / 1024:.1f} MiB together "
                  f"(shared files hard-linked), {sum(v.kib for v in held.versions) / 1024:.1f} MiB counted apart")
    # Garbage collection's check lists, keeps the two newest and removes nothing.
    gc = build_definitions(good).resolve_job_def("checkpoint_gc_job").execute_in_process(instance=env["instance"])
    assert gc.success
    out = gc.output_for_node("collect_checkpoint_versions")
    assert any("keep" in ln and new[:16] in ln and "serving" in ln for ln in out["lines"]), out["lines"]
    with FleetSession(fleet) as s:
        assert all(versions.read(s, fleet.node(n)).holds(old) is not None for n in ("spark1", "spark2"))
    # Back to the pinned revision: the rebuild reproduces the old checkpoint, which the build host
    # holds: it IS that version (nothing renamed over, nothing to copy to the nodes).
    again = build(env, env["path"])
    assert again["same_as_held_version"] is True and again["manifest"] == old, again


def test_rolling_back_to_the_original_file_is_a_rollout_too(env):
    res, sizes = roll_out(env, env["path"])
    assert res.success
    after = state(env, env["path"])
    assert all(after[n]["label"] == after[n]["wanted"] and after[n]["healthy"] for n in ("spark1", "spark2"))
    assert sorted(after["rotation"]) == ["spark1", "spark2"] and min(sizes) >= 1
    # Judged against what the rotation ran (v2 on both nodes), not against the newest bench (the
    # failed canary's, on a version that runs nowhere).
    base = res.asset_materializations_for_node("fleet_rollout")[-1].metadata["baseline"].value
    assert "over spark1, spark2" in base, base
    # A second rollout of the same version touches nothing.
    again = build_definitions(env["path"]).resolve_job_def("rollout_job").execute_in_process(instance=env["instance"])
    assert again.success
    assert again.asset_materializations_for_node("fleet_rollout")[-1].metadata["outcome"].value == "nothing to roll out"
    assert state(env, env["path"])["spark1"]["id"] == after["spark1"]["id"]


def test_a_node_its_bench_held_below_the_fleets_baseline_is_judged_against_it_again(env):
    """A node held out by a bench judged against the fleet's baseline (the hold add_node leaves on
    a slow newcomer, arranged here on spark1 running the slower version) is not promoted by a
    plain bench_job on its floors: the nightly bench judges it against the baseline again. Back on
    the fleet's version, the same job promotes it."""
    instance, node = env["instance"], "spark1"
    slow = variant(env["path"], env["root"] / "fleet-slow.yaml", attention_backend="TRITON_ATTN")

    def run(path: str, job: str) -> dg.ExecuteInProcessResult:
        return build_definitions(path).resolve_job_def(job).execute_in_process(
            instance=instance, partition_key=node, raise_on_error=False)

    def latest_bench() -> dict:
        rec = instance.fetch_materializations(dg.AssetRecordsFilter(
            asset_key=dg.AssetKey("bench_results"), asset_partitions=[node]), limit=1).records[0]
        return {k: v.value for k, v in rec.asset_materialization.metadata.items()}

    try:
        assert run(slow, "deploy_node_job").success
        with FleetSession(env["fleet"]) as s:
            gw = GatewayHost(s)
            gw.drain(node, reason="add_node: baseline", wait_s=0)
            ledger.hold(s, node, ledger.BY_BENCH, "below the fleet's baseline", **{ledger.AGAINST_BASELINE: True})
        assert not run(slow, "bench_job").success
        meta = latest_bench()
        assert meta["promoted"] is False and meta["mean_tok_s"] >= env["fleet"].bench.floor_tok_s, meta["gate"]
        assert "the baseline gate failed" in meta["gate"], meta["gate"]
        with FleetSession(env["fleet"]) as s:
            assert node not in GatewayHost(s).rotation()
            assert ledger.read(s).entry(node).holds[ledger.BY_BENCH].against_baseline
    finally:
        assert run(env["path"], "deploy_node_job").success
        assert run(env["path"], "bench_job").success
    meta = latest_bench()
    assert meta["promoted"] is True, meta["gate"]
    with FleetSession(env["fleet"]) as s:
        assert sorted(GatewayHost(s).rotation()) == ["spark1", "spark2"]
        assert ledger.read(s).promoted(node)
