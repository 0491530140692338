"""The deploy as a transaction, on the simulated fleet (real sshd + dockerd, vLLM stand-in, LiteLLM).

Both nodes are built and deployed once (through Dagster) and put in the gateway; each test then
breaks a deploy of spark1 in one way and asserts the transaction's promise: the previous
deployment serves again (same container, image tag back, step marker consistent) and the gateway
still routes to it, or the node is out of the gateway with the reason recorded. spark2 keeps the
rotation's floor meanwhile: a deploy drains its node first. Order matters inside this module:
one fleet, one instance, one history.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import dagster as dg
import httpx
import pytest
import yaml

from spark_pipelines.core import layout, remote
from spark_pipelines.core.artifacts import NodeArtifacts
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.launch import DEPLOY_LABEL, expand_home, launch_spec
from spark_pipelines.definitions import build_definitions
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.lease import NodeBusy, node_lease
from spark_pipelines.resources.ssh import GATEWAY_KEY, FleetSession, FleetSSH, SshSettings
from spark_pipelines.state import markers
from spark_pipelines.runbook.deploy import DEPLOY_MARKER, deploy
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.state import ledger

pytestmark = pytest.mark.slow

NODE = "spark1"
OTHER = "spark2"  # serves while spark1's deploys drain it
EXPORTER = "node_exporter"
EXPORTER_UNIT = "prometheus-node-exporter"
LOG = logging.getLogger("test.deploy")


@pytest.fixture(scope="module")
def env(sim_fleet, tmp_path_factory):
    root = tmp_path_factory.mktemp("txn")
    (root / "dagster").mkdir()
    instance = dg.DagsterInstance.local_temp(str(root / "dagster"))
    fleet_path = str(sim_fleet.fleet_file)
    defs = build_definitions(fleet_path)
    for job, part in (("build_job", None), ("deploy_node_job", NODE), ("deploy_node_job", OTHER),
                      ("gateway_job", None)):
        res = defs.resolve_job_def(job).execute_in_process(instance=instance, partition_key=part, raise_on_error=False)
        assert res.success, f"{job} failed while setting up the module"
    try:
        yield {"instance": instance, "fleet_path": fleet_path, "root": root, "fleet": load_fleet(fleet_path)}
    finally:
        instance.dispose()
        # The modules after this one meet the fleet as the sim made it: no deployment anywhere.
        fleet = load_fleet(fleet_path)
        with FleetSession(fleet, SshSettings(connect_retries=1)) as s:
            for n in (NODE, OTHER):
                name = launch_spec(fleet, fleet.node(n)).container_name
                for c in (name, remote.previous_container_name(name)):
                    s.run(n, ["docker", "rm", "-f", c], check=False, log=False)
            # spark2 received its copies here (only for the drain tests): e2e's first deploy streams them.
            other = fleet.node(OTHER)
            image = launch_spec(fleet, other).image
            for ref in (image, remote.previous_image_tag(image)):
                s.run(OTHER, ["docker", "rmi", "-f", ref], check=False, log=False)
        # Its checkpoint versions and the runbook's link to the serving one.
        models = os.path.dirname(layout.hybrid_dir(fleet, other))
        for p in glob.glob(glob.escape(models) + "/*") + glob.glob(glob.escape(models) + "/.*"):
            if os.path.islink(p) or os.path.isfile(p):
                os.unlink(p)
            else:
                shutil.rmtree(p, ignore_errors=True)
        shutil.rmtree(os.path.dirname(layout.marker_path(other, "node_artifacts")), ignore_errors=True)
        forget_jit_caches(fleet)


def forget_jit_caches(fleet) -> None:
    """No compiled kernels anywhere, as the sim made the fleet: e2e's first deploy is a cold boot.
    The sim's node homes are folders of this machine; the slots hold root's files, so the test
    (root) removes them here rather than as the node's user."""
    for node in fleet.serve_nodes:
        for host, _ in launch_spec(fleet, node).mounts:
            if host.startswith(node.home_dir + "/") and "/models" not in host:
                for p in glob.glob(glob.escape(host) + "*"):  # the link and its keyed slots beside it
                    if os.path.islink(p) or os.path.isfile(p):
                        os.unlink(p)
                    else:
                        shutil.rmtree(p, ignore_errors=True)
    shutil.rmtree(expand_home(fleet.launch.jit_cache_store, fleet.build_node.home_dir), ignore_errors=True)


@pytest.fixture()
def s(env):
    with FleetSession(env["fleet"], SshSettings(connect_retries=1)) as session:
        yield session


def variant(env, name, change) -> str:
    data = yaml.safe_load(open(env["fleet_path"]))
    change(data)
    path = env["root"] / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def snapshot(s: FleetSession) -> dict:
    """What the transaction promises to keep: container, image tag, marker, gateway, health."""
    f = s.fleet
    node = f.node(NODE)
    spec = launch_spec(f, node)
    d = NodeDocker(s)
    live = d.inspect_container(NODE, spec.container_name) or {}
    return {
        "id": live.get("Id"),
        "running": bool(live.get("State", {}).get("Running")),
        "image": live.get("Image"),
        "tag": d.image_id(NODE, spec.image),
        "previous": d.inspect_container(NODE, remote.previous_container_name(spec.container_name)),
        "previous_tag": d.image_id(NODE, remote.previous_image_tag(spec.image)),
        "marker": markers.read(s, node, DEPLOY_MARKER),
        "in_gateway": NODE in GatewayHost(s).rotation(),
        "healthy": httpx.get(f"http://{node.host}:{f.launch_for(node).port}/health", timeout=5).status_code == 200,
    }


def assert_previous_serves(before: dict, after: dict) -> None:
    assert after["id"] == before["id"] and after["running"]
    assert after["tag"] == before["tag"] == after["image"]
    assert after["previous"] is None and after["previous_tag"] is None
    assert after["marker"] == before["marker"] and after["marker"]["container_id"] == after["id"]
    assert after["in_gateway"] and after["healthy"]


def failure_of(res) -> str:
    return " ".join(e.step_failure_data.user_failure_data.description for e in res.all_events
                    if e.is_step_failure and e.step_failure_data.user_failure_data)


def bad_mount(d):
    # A cache mount onto a file of the image: validation accepts it, `docker run` exits 125.
    d["launch"]["cache_mounts"].append({"host": "~/.cache/spark-test-bad-mount", "container": "/etc/os-release"})


def test_deploy_labels_the_container(env, s):
    node = s.fleet.node(NODE)
    live = NodeDocker(s).inspect_container(NODE, launch_spec(s.fleet, node).container_name)
    labels = live["Config"]["Labels"]
    assert labels[DEPLOY_LABEL] == launch_spec(s.fleet, node).fingerprint
    assert labels["org.spark-pipelines.image"] == live["Image"]


def test_a_deploy_drains_its_node_while_the_other_keeps_serving(env, s):
    """Redeploy spark1: it leaves the rotation before its old container stops and comes back
    after the commit; spark2 is in the rotation at every sample."""
    node = s.fleet.node(NODE)
    samples: list[list[str]] = []
    stop = threading.Event()

    def watch():
        with FleetSession(s.fleet, SshSettings(connect_retries=1)) as w:
            gw = GatewayHost(w)
            while not stop.is_set():
                samples.append(gw.rotation())
                stop.wait(0.5)

    t = threading.Thread(target=watch)
    t.start()
    try:
        done = deploy(s, node, launch_spec(s.fleet, node), LOG, run_id="drain-test")
    finally:
        stop.set()
        t.join(30)
    assert done.container_id
    assert any(NODE not in r for r in samples), "spark1 never left the rotation during its deploy"
    assert all(OTHER in r for r in samples), samples
    assert NODE in GatewayHost(s).rotation() and GatewayHost(s).read().drains == {}
    # The container changed behind Dagster's back: a run records it again.
    assert build_definitions(env["fleet_path"]).resolve_job_def("deploy_node_job").execute_in_process(
        instance=env["instance"], partition_key=NODE, raise_on_error=False).success


def test_a_deploy_waits_its_turn_and_is_refused_touching_nothing(env, s):
    """spark2 is out of the gateway for a deploy: taking spark1 out too would leave no backend.
    The deploy waits rollout.deploy_wait_s, then is refused with both reasons; spark1 still serves."""
    path = variant(env, "shortwait", lambda d: d.setdefault("rollout", {}).__setitem__("deploy_wait_s", 3))
    before = snapshot(s)
    gw = GatewayHost(s)
    gw.drain(OTHER, reason="deploying (run another)")
    try:
        fleet = load_fleet(path)
        with FleetSession(fleet, SshSettings(connect_retries=1)) as other:
            with pytest.raises(RunbookError) as e:
                deploy(other, fleet.node(NODE), launch_spec(fleet, fleet.node(NODE)), LOG, run_id="refused")
            assert not [c for c in other.commands if c.argv[:2] == ("docker", "stop")]
        assert "spark1 not drained" in str(e.value) and "spark2 is out (deploying (run another)" in str(e.value)
    finally:
        gw.restore(OTHER)
    after = snapshot(s)
    assert after["id"] == before["id"] and after["running"] and after["in_gateway"] and after["healthy"]
    assert sorted(GatewayHost(s).rotation()) == [NODE, OTHER]


def test_docker_run_exit_125_rolls_back(env, s):
    before = snapshot(s)
    assert before["healthy"] and before["in_gateway"]
    path = variant(env, "badmount", bad_mount)
    res = build_definitions(path).resolve_job_def("deploy_node_job").execute_in_process(
        instance=env["instance"], partition_key=NODE, raise_on_error=False)
    assert not res.success
    why = failure_of(res)
    assert "status 125" in why and f"previous deployment put back on {NODE} (healthy)" in why
    assert_previous_serves(before, snapshot(s))
    # The failed launch's container is gone, not parked as a rollback point.
    names = s.run(NODE, ["docker", "ps", "-a", "--format", "{{.Names}}"], log=False).stdout.split()
    assert names.count(launch_spec(s.fleet, s.fleet.node(NODE)).container_name) == 1


def test_rerun_after_a_crashed_deploy_keeps_the_previous(env, s):
    """A run that died between `docker run` (exit 125: a `Created` container) and its rollback
    leaves the good container as `-previous`; a rerun must not delete it."""
    before = snapshot(s)
    node = s.fleet.node(NODE)
    spec = launch_spec(s.fleet, node)
    d = NodeDocker(s)
    prev_name = remote.previous_container_name(spec.container_name)
    d.stop(NODE, spec.container_name, timeout_s=10)
    d.rename(NODE, spec.container_name, prev_name)
    s.run(NODE, ["docker", "create", "--name", spec.container_name, spec.image, "true"], log=False)
    path = variant(env, "badmount2", bad_mount)
    res = build_definitions(path).resolve_job_def("deploy_node_job").execute_in_process(
        instance=env["instance"], partition_key=NODE, raise_on_error=False)
    assert not res.success and "put back on spark1 (healthy)" in failure_of(res)
    assert_previous_serves(before, snapshot(s))


def test_interrupted_deploy_rolls_back_and_reraises(env, s):
    """A KeyboardInterrupt (what a Dagster run termination looks like in the step) after the
    set-aside and the preflight: rolled back, exporters started again, then re-raised."""
    before = snapshot(s)
    node = s.fleet.node(NODE)
    # An exporter that preflight stops (it holds a CUDA context on a real node) and must restart,
    # and the host's node exporter the runbook stops during a deploy (a systemd unit).
    s.run(NODE, ["docker", "run", "-d", "--name", EXPORTER, "--entrypoint", "sleep",
                 launch_spec(s.fleet, node).image, "3600"], log=False)
    s.run(NODE, ["sudo", "-n", "systemctl", "start", EXPORTER_UNIT], log=False)
    during: list[str] = []

    def unit_state() -> str:
        return s.run(NODE, ["systemctl", "is-active", EXPORTER_UNIT], check=False, log=False).stdout.strip()

    class Interrupting:
        def info(self, msg):
            during.append(unit_state())
            raise KeyboardInterrupt  # the first line deploy logs: the preflight report, after the set-aside

        warning = staticmethod(LOG.warning)

    try:
        with pytest.raises(KeyboardInterrupt):
            deploy(s, node, launch_spec(s.fleet, node), Interrupting())
        assert_previous_serves(before, snapshot(s))
        running = s.run(NODE, ["docker", "ps", "--format", "{{.Names}}"], log=False).stdout.split()
        assert EXPORTER in running
        assert during == ["inactive"] and unit_state() == "active"
    finally:
        s.run(NODE, ["docker", "rm", "-f", EXPORTER], check=False, log=False)
        s.run(NODE, ["sudo", "-n", "systemctl", "stop", EXPORTER_UNIT], check=False, log=False)


def test_two_deploys_of_one_node_at_once(env):
    fleet = env["fleet"]
    node = fleet.node(NODE)
    start = threading.Barrier(2)
    outcome: dict[int, object] = {}
    sessions = [FleetSession(fleet, SshSettings(connect_retries=1)) for _ in range(2)]

    def one(i):
        start.wait()
        try:
            outcome[i] = deploy(sessions[i], node, launch_spec(fleet, node), LOG, run_id=f"thread-{i}")
        except Exception as e:  # noqa: BLE001 - the assertion below says which
            outcome[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        busy = [o for o in outcome.values() if isinstance(o, NodeBusy)]
        done = [o for o in outcome.values() if not isinstance(o, Exception)]
        assert len(busy) == 1 and len(done) == 1, outcome
        assert f"node {NODE} is busy" in str(busy[0]) and "deploy (run thread-" in str(busy[0])
        runs = [c for sess in sessions for c in sess.commands if list(c.argv[:3]) == ["docker", "run", "-d"]]
        assert len(runs) == 1
    finally:
        for sess in sessions:
            sess.close()
    # The deploy outside Dagster left a new container: a Dagster run records it (and deploys again,
    # since the step marker names the old container).
    res = build_definitions(env["fleet_path"]).resolve_job_def("deploy_node_job").execute_in_process(
        instance=env["instance"], partition_key=NODE, raise_on_error=False)
    assert res.success


HOLDER = """
import sys, time
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSession
with FleetSession(load_fleet(sys.argv[1])) as s, node_lease(s, sys.argv[2], "bench", run_id="doomed"):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("target", [NODE, GATEWAY_KEY])
def test_lease_of_a_killed_run_is_free_again_within_seconds(env, s, target):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, env["fleet_path"], target], stdout=subprocess.PIPE, text=True,
                         cwd=os.getcwd())
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(NodeBusy, match=rf"busy: bench \(run doomed, pid {p.pid} on .*since .*UTC\)"):
            with node_lease(s, target, "deploy"):
                pass
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        killed = time.monotonic()
        while True:
            try:
                with node_lease(s, target, "deploy") as lease:
                    assert not lease.lost
                break
            except NodeBusy:
                assert time.monotonic() - killed < 10, "the lease of a killed run was still held after 10 s"
                time.sleep(0.5)
    finally:
        if p.poll() is None:
            p.kill()
    # Re-entrant in one session and thread; released at the end of the block.
    with node_lease(s, target, "experiment") as outer, node_lease(s, target, "deploy") as inner:
        assert inner is outer
    with node_lease(s, target, "deploy"):
        pass


def test_serving_check_fails_when_a_rollback_left_the_old_image(env, s):
    """node_artifacts recorded a new image, the node runs the old one (a rollback moved the tag
    back): the serving check fails naming the node and the fix, nothing is launched, and once the
    new image is there the next deploy does not skip."""
    fleet = env["fleet"]
    node = fleet.node(NODE)
    spec = launch_spec(fleet, node)
    d = NodeDocker(s)
    before = snapshot(s)
    old_image = before["image"]
    s.run(NODE, ["docker", "commit", "--change", "LABEL org.spark-pipelines.test-new=1", before["id"],
                 "spark-test-new:1"], log=False)
    new_image = d.image_id(NODE, "spark-test-new:1")
    assert new_image != old_image
    defs = build_definitions(env["fleet_path"])
    deployment = defs.get_assets_def("node_deployment")
    art = env["instance"].fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("node_artifacts"), asset_partitions=[NODE]), limit=1).records
    assert art

    def materialize(recorded):
        @dg.asset(name="node_artifacts", partitions_def=deployment.partitions_def)
        def recorded_artifacts():
            return NodeArtifacts(node=NODE, path="-", image=spec.image, image_id=recorded, index="-")

        res = dg.materialize([recorded_artifacts, deployment], partition_key=NODE, instance=env["instance"],
                             resources={"ssh": FleetSSH(fleet_path=env["fleet_path"])}, raise_on_error=False)
        check = next(e for e in res.get_asset_check_evaluations() if e.check_name == "serving")
        assert res.success == check.passed  # the check is blocking
        meta = next(m.materialization.metadata for m in res.get_asset_materialization_events()
                    if m.materialization.asset_key == dg.AssetKey("node_deployment"))
        return check, meta

    try:
        check, meta = materialize(new_image)
        assert not check.passed
        assert check.description.startswith(f"{NODE}: ") and "rerun node_artifacts for spark1" in check.description
        after = snapshot(s)
        assert after["id"] == before["id"] and after["image"] == old_image and after["marker"] == before["marker"]
        assert meta["image_id"].value == old_image and meta["endpoint"].value.endswith(":8000")

        # node_artifacts copies the new image again: the next deploy launches it, no skip.
        d.tag(NODE, new_image, spec.image)
        check, meta = materialize(new_image)
        assert check.passed and meta["skipped"].value is False
        now = snapshot(s)
        assert now["image"] == new_image and now["id"] != before["id"] and now["healthy"]
        assert meta["container_id"].value == now["id"][:12]
    finally:
        d.tag(NODE, old_image, spec.image)
        check, _ = materialize(old_image)
        d.untag(NODE, "spark-test-new:1")  # its container went with the commit above
        assert check.passed and snapshot(s)["image"] == old_image


def test_rollback_that_cannot_serve_drains_the_node_with_the_reason(env, s, sim_gpu):
    """Preflight blocks (GPU memory taken) and the restored previous deployment cannot start
    either: the node leaves the gateway, the reason is recorded where promotion reads it."""
    path = variant(env, "short-health", lambda d: d["launch"].__setitem__("health_timeout_s", 15))
    sim_gpu(NODE, "low-memory")
    res = build_definitions(path).resolve_job_def("deploy_node_job").execute_in_process(
        instance=env["instance"], partition_key=NODE, raise_on_error=False)
    assert not res.success
    why = failure_of(res)
    assert "preflight blocked spark1" in why and "NOT healthy" in why and "spark1 taken out of the gateway" in why
    assert NODE not in GatewayHost(s).rotation()
    held = ledger.read(s).entry(NODE).holds
    assert list(held) == [ledger.BY_DEPLOY] and "NOT healthy" in held[ledger.BY_DEPLOY].reason
    from spark_pipelines.runbook.rotation import promotion

    rotation, out = promotion(s)
    assert NODE not in rotation
    # Memory back: a healthy deploy ends the hold-out, and the gateway takes the node again.
    sim_gpu(NODE, "healthy")
    defs = build_definitions(env["fleet_path"])
    for job, part in (("deploy_node_job", NODE), ("gateway_job", None)):
        assert defs.resolve_job_def(job).execute_in_process(instance=env["instance"], partition_key=part,
                                                            raise_on_error=False).success
    assert ledger.read(s).promoted(NODE)
    assert NODE in GatewayHost(s).rotation()


def test_a_deploy_whose_lease_ended_changes_nothing_more_and_the_next_holder_finishes_it(env, s, monkeypatch):
    """Issue 34 item 7: the deploy's connection drops right after its `docker run` (so its lease
    on the node ends) and another run takes the node (the sweep's repair). Before, the session
    reconnected silently and the old run rolled back and put the node back in the gateway beside
    the new owner. Now its next command raises LeaseLost: no command on the node after the loss,
    no restore in the gateway, the journal left for the new owner, who finishes it and deploys."""
    from contextlib import ExitStack

    from spark_pipelines.resources.lease import LeaseLost

    fleet = env["fleet"]
    node = fleet.node(NODE)
    spec = launch_spec(fleet, node)
    before = snapshot(s)
    assert before["in_gateway"] and before["healthy"]
    owner = ExitStack()
    new_owner = FleetSession(fleet, SshSettings(connect_retries=1))
    seen: dict = {}
    original = NodeDocker.run_container

    def run_then_drop(self, n, argv):
        out = original(self, n, argv)
        if n == NODE and "lost" not in seen:
            seen["lost"] = len(self.session.commands)
            self.session._conns[NODE].close()  # the connection drops: the lease's channel with it
            deadline = time.monotonic() + 15
            while True:  # the node's flock is free once sshd sees the channel gone
                try:
                    owner.enter_context(node_lease(new_owner, NODE, "repair", run_id="new-owner"))
                    break
                except NodeBusy:
                    assert time.monotonic() < deadline, "the lost lease was still held on the node after 15 s"
                    time.sleep(0.2)
        return out

    monkeypatch.setattr(NodeDocker, "run_container", run_then_drop)
    lost_run = FleetSession(fleet, SshSettings(connect_retries=1))
    try:
        with pytest.raises(RunbookError) as err:
            deploy(lost_run, node, spec, LOG, run_id="lost-run")
        assert "lost" in seen
        assert "ended under it" in str(err.value) and "rolled nothing back" in str(err.value), str(err.value)
        assert isinstance(err.value.__cause__, LeaseLost) or "LeaseLost" in repr(err.value.__cause__)
        after_loss = [c for c in lost_run.commands[seen["lost"]:] if c.node == NODE]
        assert after_loss == [], [c.argv for c in after_loss]  # nothing more on the node, no rollback
        assert NODE not in GatewayHost(s).rotation()  # not put back beside the new owner
        journal = markers.read_journal(s, node)
        assert journal is not None and journal.run_id == "lost-run"
    finally:
        monkeypatch.undo()
        owner.close()
        lost_run.close()
    # The new owner (a repair run) finishes the dead deploy from its journal, then deploys.
    try:
        done = deploy(new_owner, node, spec, LOG, run_id="new-owner")
        assert done.container_id
    finally:
        new_owner.close()
    after = snapshot(s)
    assert after["running"] and after["healthy"] and after["in_gateway"]
    assert markers.read_journal(s, node) is None and after["previous"] is None


def test_deploy_of_a_node_held_by_another_run_is_one_clear_line(env, s):
    node = s.fleet.node(NODE)
    with node_lease(s, NODE, "bench", run_id="other-run"), FleetSession(s.fleet) as other:
        with pytest.raises(NodeBusy, match=r"node spark1 is busy: bench \(run other-run, pid \d+"):
            deploy(other, node, launch_spec(s.fleet, node), LOG)
        assert not [c for c in other.commands if c.argv[:2] == ("docker", "run")]


def test_health_sensor_reads_the_container_start_over_ssh(env):
    """node_health's sweep over real SSH: a node deployed minutes ago is healthy, its container's
    start (read with `docker container inspect`) is remembered in the cursor, nothing is requested."""
    import dagster as dg

    from spark_pipelines.definitions import build_definitions

    defs = build_definitions(env["fleet_path"])
    sensor = defs.get_repository_def().get_sensor_def("node_health")
    with dg.build_sensor_context(instance=env["instance"], definitions=defs,
                                 resources={"ssh": defs.resources["ssh"]}) as context:
        res = sensor(context)
    now = time.time()
    memory = json.loads(res.cursor)["nodes"][NODE]
    assert memory["verdict"] == "healthy" and now - 3600 < memory["earlier"]["started_at"] <= now + 5
    assert not [r for r in res.run_requests if r.partition_key == NODE]
    assert f"{NODE}: healthy" in str(res.skip_reason) or res.run_requests
