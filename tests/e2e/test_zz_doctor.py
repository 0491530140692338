"""`spark-pipelines doctor` against the simulated fleet (real sshd, dockerd, vLLM and GB10 stand-ins),
driven through the verdicts the sim can produce: healthy, wedged under load, engine-down (container
killed), starting (right after a launch), crash-loop (the same failure on each restart), residue (a
relaunch on a residue-degraded GPU), unreachable (the node's link down). Each test leaves the
fleet healthy. Named test_zz_ so that, in a whole run, it reuses what test_chain deployed; alone it
deploys the nodes itself.
"""

from __future__ import annotations

import json
import subprocess
import time
from contextlib import contextmanager

import dagster as dg
import pytest

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.definitions import build_definitions
from spark_pipelines.cli import main as cli
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook import sweep
from spark_pipelines.resources import engine
from tests.plugins.traffic import Traffic

pytestmark = pytest.mark.slow

# What a read-only probe may run on a node.
# The sweep's one command per node is a fixed script of nvidia-smi, docker inspect and docker logs.
READ_ONLY = {("true",), ("nvidia-smi",), ("docker", "container", "inspect"), ("docker", "logs"), ("find",),
             ("sh", "-c", sweep.GATHER_SCRIPT)}


@pytest.fixture(scope="module")
def deployed(sim_fleet, tmp_path_factory):
    """The sim's fleet file with every serve node serving (deployed here when no earlier test did)."""
    path = str(sim_fleet.fleet_file)
    fleet = load_fleet(path)
    if not all(engine.healthy(fleet, n) for n in fleet.serve_nodes):
        root = tmp_path_factory.mktemp("doctor-dagster")
        with dg.DagsterInstance.local_temp(str(root)) as instance:
            defs = build_definitions(path)
            assert defs.resolve_job_def("build_job").execute_in_process(instance=instance).success
            job = defs.resolve_job_def("deploy_node_job")
            for n in fleet.serve_nodes:
                if not engine.healthy(fleet, n):
                    assert job.execute_in_process(instance=instance, partition_key=n.name).success
            # ... and in the gateway: doctor says "out of the gateway" (exit 1) for a node that is not.
            with FleetSession(fleet) as s:
                routed = set(GatewayHost(s).rotation())
            if routed != {n.name for n in fleet.serve_nodes}:
                assert defs.resolve_job_def("gateway_job").execute_in_process(instance=instance).success
    return path


def doctor(capsys, *args):
    """rc, the node lines, stderr (the text's first line names the fleet file it read: left out)."""
    rc = cli.main(["doctor", *args])
    out = capsys.readouterr()
    text = out.out
    if text.startswith("# fleet file: "):
        text = text.partition("\n")[2]
    return rc, text, out.err


def doctor_json(capsys, fleet_file, *args):
    rc, out, err = doctor(capsys, "--fleet", fleet_file, "--format", "json", *args)
    return rc, json.loads(out)["nodes"], err


def wait_serving(fleet, name, seconds=90):
    assert engine.wait_healthy(fleet, fleet.node(name), seconds), f"{name} did not come back healthy"


def test_healthy_fleet_exits_0_in_text_and_json(deployed, capsys):
    assert cli.main(["doctor", "--fleet", deployed]) == 0
    assert capsys.readouterr().out.startswith(f"# fleet file: {deployed} (--fleet)")  # names what it read
    rc, out, err = doctor(capsys, "--fleet", deployed)
    assert rc == 0, out + err
    lines = out.strip().splitlines()
    assert len(lines) == 2
    for line, name in zip(lines, ("spark1", "spark2"), strict=True):
        assert line.split()[:2] == [name, "healthy"]
        assert "/health 200" in line and "-> nothing to do" in line
    rc, nodes, _ = doctor_json(capsys, deployed)
    assert rc == 0 and set(nodes) == {"spark1", "spark2"}
    for v in nodes.values():
        assert v["verdict"] == "healthy" and v["advice"] == "nothing to do"
        assert "/health 200" in v["evidence"] and any("restart count 0" in e for e in v["evidence"])


def test_the_sweep_only_reads(deployed):
    fleet = load_fleet(deployed)
    with sweep.open_session(fleet) as s:
        started = time.monotonic()
        reports = sweep.sweep(s, max_parallel=4)
        took = time.monotonic() - started
        ran = [r.argv for r in s.commands]
    assert {n: r.verdict.verdict for n, r in reports.items()} == {"spark1": "healthy", "spark2": "healthy"}
    assert ran and all(any(tuple(a[: len(p)]) == p for p in READ_ONLY) for a in ran), ran
    obs = reports["spark2"].observation
    assert obs.gpu is not None and obs.gpu.max_sm_clock_mhz == 3003 and obs.container.running  # the GB10 stand-in
    assert obs.metrics is not None and "vllm:generation_tokens_total" in obs.metrics
    assert took < 30


def test_wedged_under_load(deployed, capsys, sim_gpu):
    fleet = load_fleet(deployed)
    sim_gpu("spark2", "wedged")
    with Traffic(fleet):
        rc, nodes, _ = doctor_json(capsys, deployed, "--node", "spark2")
        rc_text, out, _ = doctor(capsys, "--fleet", deployed)
    assert rc == 1 and list(nodes) == ["spark2"]
    v = nodes["spark2"]
    assert v["verdict"] == "wedged", v
    assert "PD firmware wedge signature complete" in v["evidence"][0] and "708 MHz" in v["evidence"][0]
    assert "90-120 s" in v["advice"]
    assert rc_text == 1
    spark1, spark2 = out.strip().splitlines()
    assert spark1.split()[1] == "healthy" and spark2.split()[1] == "wedged"
    # Wedged but without load the wedge does not show: the doctor does not guess.
    rc, nodes, _ = doctor_json(capsys, deployed, "--node", "spark2")
    assert nodes["spark2"]["verdict"] == "healthy" and rc == 0


def test_killed_container_is_engine_down(deployed, capsys):
    fleet = load_fleet(deployed)
    name = fleet.launch_for(fleet.node("spark2")).container_name
    with FleetSession(fleet) as s:
        s.run("spark2", ["docker", "kill", name], log=False, timeout=60)
        try:
            rc, nodes, _ = doctor_json(capsys, deployed)
            rc_text, out, _ = doctor(capsys, "--fleet", deployed, "--node", "spark2")
        finally:
            s.run("spark2", ["docker", "start", name], log=False, timeout=60)
    wait_serving(fleet, "spark2")
    assert rc == 1
    assert nodes["spark1"]["verdict"] == "healthy"
    v = nodes["spark2"]
    assert v["verdict"] == "engine-down", v
    assert v["evidence"][0] == "container exited, exit code 137" and "redeploy" in v["advice"]
    assert rc_text == 1 and out.split()[:2] == ["spark2", "engine-down"]
    assert "container exited, exit code 137" in out


@contextmanager
def production_aside(fleet, name="spark2"):
    """Stop the node's production container and keep it aside while a test runs its own launch under
    the production name; put it back and wait for it to serve afterwards, in every outcome."""
    spec = launch_spec(fleet, fleet.node(name))
    aside = f"{spec.container_name}-doctor-aside"
    with FleetSession(fleet) as s:
        s.run(name, ["docker", "stop", "-t", "5", spec.container_name], log=False, timeout=60)
        s.run(name, ["docker", "rename", spec.container_name, aside], log=False, timeout=60)
        try:
            yield s, spec
        finally:
            s.run(name, ["docker", "rm", "-f", spec.container_name], log=False, check=False, timeout=60)
            s.run(name, ["docker", "rename", aside, spec.container_name], log=False, timeout=60)
            s.run(name, ["docker", "start", spec.container_name], log=False, timeout=60)
    wait_serving(fleet, name)


def inspect(s, node, container):
    return json.loads(s.run(node, ["docker", "container", "inspect", container], log=False, timeout=30).stdout)[0]


def test_starting_right_after_a_launch(deployed, capsys):
    """A launch that takes a while to come up (the stand-in's start-up paced to 60 s) is starting,
    not down: exit 0."""
    fleet = load_fleet(deployed)
    with production_aside(fleet) as (s, spec):
        argv = spec.docker_run_argv()
        s.run("spark2", argv[:3] + ["-e", "SIM_STARTUP_SECONDS=60"] + argv[3:], log=False, timeout=120)
        rc, nodes, _ = doctor_json(capsys, deployed)
    v = nodes["spark2"]
    assert v["verdict"] == "starting", v
    assert rc == 0 and nodes["spark1"]["verdict"] == "healthy"
    assert any("inside the" in e and "window" in e for e in v["evidence"])
    assert "25-45 min" in v["advice"]


def test_the_same_failure_on_every_restart_is_a_crash_loop(deployed, capsys):
    """A launch that fails the same way each time docker restarts it (here --enable-prefix-caching,
    which crashes Qwen3.5's hybrid attention) is a crash loop, not one dead engine."""
    fleet = load_fleet(deployed)
    with production_aside(fleet) as (s, spec):
        argv = spec.docker_run_argv()
        s.run("spark2", argv[:3] + ["--restart", "on-failure:50"] + argv[3:] + ["--enable-prefix-caching"],
              log=False, timeout=120)
        deadline = time.monotonic() + 90
        while inspect(s, "spark2", spec.container_name)["RestartCount"] < 2 and time.monotonic() < deadline:
            time.sleep(1)
        rc, nodes, _ = doctor_json(capsys, deployed, "--node", "spark2")
    v = nodes["spark2"]
    assert rc == 1 and v["verdict"] == "crash-loop", v
    assert "consecutive starts: prefix-caching-enabled" in v["evidence"][0]
    assert any("remove --enable-prefix-caching" in e for e in v["evidence"])
    assert "stop relaunching" in v["advice"]


def test_residue_after_a_relaunch_needs_a_reboot(deployed, capsys, sim_fleet):
    """A relaunch on a node with crash-loop residue: the sim's residue leaves 96.5 GiB free, below the
    GX10's clean-boot 106 GiB, so vLLM's request_memory() refuses the start. Relaunching again cannot
    help: the verdict says reboot. (The num_gpu_blocks=0 -> silent death path is in the unit tier.)"""
    fleet = load_fleet(deployed)
    name = fleet.launch_for(fleet.node("spark2")).container_name
    with FleetSession(fleet) as s:
        sim_fleet.set_gpu("spark2", "residue")
        try:
            s.run("spark2", ["docker", "restart", "-t", "5", name], log=False, timeout=60)
            deadline = time.monotonic() + 60
            while inspect(s, "spark2", name)["State"]["Running"] and time.monotonic() < deadline:
                time.sleep(0.5)
            rc, nodes, _ = doctor_json(capsys, deployed, "--node", "spark2")
        finally:
            sim_fleet.set_gpu("spark2", "healthy")  # the reboot
            s.run("spark2", ["docker", "start", name], log=False, timeout=60)
    wait_serving(fleet, "spark2")
    v = nodes["spark2"]
    assert rc == 1 and v["verdict"] == "residue", v
    assert v["evidence"][0].startswith("free memory 96.50 GiB is below the clean-boot baseline 106.00 GiB")
    assert "Free memory on device" in v["evidence"][0]
    assert "relaunching cannot help" in v["advice"] and "reboot" in v["advice"].lower()


def test_link_down_is_unreachable(deployed, capsys, sim_fleet):
    fleet = load_fleet(deployed)
    netns = sim_fleet.node("spark2").netns
    subprocess.run(["ip", "-n", netns, "link", "set", "eth0", "down"], check=True)
    try:
        started = time.monotonic()
        rc, nodes, err = doctor_json(capsys, deployed)
        took = time.monotonic() - started
    finally:
        subprocess.run(["ip", "-n", netns, "link", "set", "eth0", "up"], check=True)
    assert rc == 1 and err == ""
    assert nodes["spark1"]["verdict"] == "healthy"
    v = nodes["spark2"]
    assert v["verdict"] == "unreachable", v
    assert v["evidence"][0].startswith("SSH: NodeUnreachable")
    assert "10 min" in v["advice"] and "hard-reset" in v["advice"]
    assert took < 30  # short per-step timeouts, no connect retries
    wait_serving(fleet, "spark2", 60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rc, nodes, _ = doctor_json(capsys, deployed, "--node", "spark2")
        if rc == 0:
            break
        time.sleep(2)
    assert nodes["spark2"]["verdict"] == "healthy"


def test_regressed_against_the_bench_history_in_dagster_home(deployed, capsys, tmp_path, monkeypatch):
    """The node's own benches come from the instance in DAGSTER_HOME: the latest one a fifth below
    the earlier ones at full clock is the runbook's stale ~/.cache/vllm case."""
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path))
    with dg.DagsterInstance.get() as instance:
        for mean in (51.2, 52.0, 51.6, 41.0):
            instance.report_runless_asset_event(dg.AssetMaterialization(
                "bench_results", partition="spark2",
                metadata={"mean_tok_s": mean, "gpu_under_load": "healthy", "spec_acceptance_rate": 0.95}))
    rc, nodes, _ = doctor_json(capsys, deployed)
    assert rc == 1 and nodes["spark1"]["verdict"] == "healthy"
    v = nodes["spark2"]
    assert v["verdict"] == "regressed", v
    assert v["evidence"][0].startswith("throughput: below its history (latest bench 41.00 vs earlier benches")
    assert "~/.cache/vllm" in v["advice"]


def test_bad_input_is_one_line_exit_2(deployed, capsys, tmp_path):
    rc, out, err = doctor(capsys, "--fleet", deployed, "--node", "spark9")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "spark9" in err and "spark1, spark2" in err
    rc, out, err = doctor(capsys, "--fleet", str(tmp_path / "nope.yaml"))
    assert rc == 2 and err.count("\n") == 1 and "does not exist" in err
