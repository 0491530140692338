"""Node pairs (Phase 4-alt, TP=2 over two nodes): the fleet file's pair profile, its launch rendered
as the runbook writes it, `plan`, the pair's preflight verdicts, diagnosis, health and bench."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest
import yaml

from spark_pipelines.core import diagnosis
from spark_pipelines.core import pair as core
from spark_pipelines.core.fleet import FleetError, load_fleet, parse_fleet
from spark_pipelines.core.health import NodeVerdict
from spark_pipelines.core.pair_launch import pair_launch
from spark_sim import runtime_shim

SEED = "fleets/seed.yaml"

# The runbook's Phase 4-alt, as written there (worker, then head), SPARK1_IP being the head's link address.
RUNBOOK_WORKER = """docker run -d --name vllm-qwen35-v2 \\
--gpus all --privileged --network host --ipc host --shm-size 64g \\
--ulimit memlock=-1 --ulimit stack=67108864 \\
--device /dev/infiniband:/dev/infiniband \\
-v ~/models:/models \\
-v ~/.cache/huggingface:/root/.cache/huggingface \\
-v ~/.cache/vllm:/root/.cache/vllm \\
-v ~/.cache/flashinfer:/root/.cache/flashinfer \\
-v ~/.triton:/root/.cache/triton \\
vllm-qwen35-v2 \\
serve /models/qwen35-122b-hybrid-int4fp8 \\
--served-model-name qwen35-hybrid-v2 \\
--host 0.0.0.0 \\
--port 8000 \\
--tensor-parallel-size 2 \\
--max-model-len 262144 \\
--gpu-memory-utilization 0.85 \\
--reasoning-parser qwen3 \\
--attention-backend FLASHINFER \\
--speculative-config '{"method":"mtp","num_speculative_tokens":2}' \\
--distributed-executor-backend mp \\
--nnodes 2 --node-rank 1 \\
--master-addr SPARK1_IP --master-port 29501 \\
--headless"""
RUNBOOK_HEAD = RUNBOOK_WORKER.replace("--node-rank 1", "--node-rank 0").replace(" \\\n--headless", "")


def seed_data() -> dict:
    return yaml.safe_load(open(SEED))


def turned_on(**link) -> dict:
    d = seed_data()
    d["pairs"][0]["enabled"] = True
    d["pairs"][0]["link"] = {"head_address": "192.168.100.1", "worker_address": "192.168.100.2", **link}
    return d


# ------------------------------------------------------------------------------- the fleet file


def test_the_seed_fleet_has_the_pair_off_with_the_runbooks_reason():
    (p,) = load_fleet(SEED).pairs
    assert (p.name, p.head, p.worker, p.enabled, p.link, p.master_port) == ("tp2", "spark1", "spark2", False, None, 29501)
    assert "not DAC-connected" in p.reason


def test_turning_the_pair_on_without_a_link_is_refused_naming_the_field_and_the_reason():
    d = seed_data()
    d["pairs"][0]["enabled"] = True
    with pytest.raises(FleetError) as e:
        parse_fleet(d, "fleet.yaml")
    msg = str(e.value)
    assert msg.startswith("fleet.yaml: pairs[0] (tp2).link: the pair cannot be turned on")
    assert "not DAC-connected" in msg and "add link:" in msg and "\n" not in msg and "= None" not in msg


@pytest.mark.parametrize("change, said", [
    (lambda d: d["pairs"][0]["link"].update(worker_address="192.168.100.1"), "both 192.168.100.1"),
    (lambda d: d["pairs"][0].update(worker="spark1"), "head and worker are both spark1"),
    (lambda d: d["pairs"][0].update(worker="spark9"), "pairs[0] (tp2).worker: no node named 'spark9'"),
    (lambda d: d["nodes"][1].update(roles=["build"]) or d["nodes"][0].update(roles=["serve"]), "has no 'serve' role"),
    (lambda d: d["pairs"].append({**d["pairs"][0], "name": "tp2b"}), "spark1 is in pair tp2 already"),
    (lambda d: d["pairs"][0]["link"].update(mtu=576), "greater than or equal to 1280"),
    (lambda d: d["pairs"][0]["link"].update(head_address="256.1.1.1"), "head_address"),
])
def test_a_pair_that_is_on_is_refused_in_one_line_naming_its_field(change, said):
    d = turned_on()
    change(d)
    with pytest.raises(FleetError) as e:
        parse_fleet(d, "fleet.yaml")
    assert said in str(e.value) and "\n" not in str(e.value)


def test_an_off_pair_may_name_nodes_a_smaller_fleet_left_out():
    d = seed_data()
    d["nodes"] = [d["nodes"][0]]
    assert parse_fleet(d).pairs[0].worker == "spark2"


# ------------------------------------------------------------------------------------ the launch


def test_both_ranks_render_exactly_as_phase_4_alt_with_the_profiles_env():
    f = parse_fleet(turned_on())
    launch = pair_launch(f, f.pairs[0])
    assert [s.node for s in launch.specs] == ["spark2", "spark1"]  # the worker first
    for spec, text in ((launch.worker, RUNBOOK_WORKER), (launch.head, RUNBOOK_HEAD)):
        want = shlex.split(text.replace("\\\n", " ").replace("SPARK1_IP", "192.168.100.1").replace("~", "/home/operator"))
        got = spec.docker_run_argv()
        env = [a for i, a in enumerate(got) if a == "-e" or (i and got[i - 1] == "-e")]
        assert [a for a in got if a not in env] == want
        # The 2026-06-18 fix's six variables stay (Phase 4-alt predates them; founders requires them).
        assert len(env) == 12 and "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1" in env
    assert launch.head.fingerprint != launch.worker.fingerprint


def test_a_phase4_launch_keeps_its_fingerprint():
    """run_flags only enter a pair's fingerprint: every TP=1 deployment keeps the label it has."""
    import hashlib

    from spark_pipelines.core.launch import launch_spec

    f = load_fleet(SEED)
    spec = launch_spec(f, f.node("spark1"))
    assert spec.docker_run_argv()[5:9] == ["--gpus", "all", "--net=host", "--ipc=host"]
    blob = json.dumps({"image": spec.image, "env": spec.env, "mounts": spec.mounts, "args": spec.serve_args},
                      sort_keys=True)
    assert spec.fingerprint == hashlib.sha256(blob.encode()).hexdigest()[:16]


def test_plan_on_the_seed_shows_the_pair_off_with_its_reason_and_its_launch():
    out = subprocess.run([sys.executable, "-m", "spark_pipelines.cli", "plan", "--fleet", SEED],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "== node pair tp2 (Phase 4-alt, TP=2): spark1 head (rank 0) + spark2 worker (rank 1): OFF: not DAC-connected" in text
    assert "link: none; to turn it on, add link:" in text
    assert "--nnodes 2 --node-rank 1 --master-addr '<link.head_address>' --master-port 29501 --headless" in text
    js = subprocess.run([sys.executable, "-m", "spark_pipelines.cli", "plan", "--fleet", SEED, "--format", "json"],
                        capture_output=True, text=True, timeout=120)
    pair = json.loads(js.stdout)["pairs"]["tp2"]
    assert pair["enabled"] is False and "not DAC-connected" in pair["reason"]
    assert [x["node"] for x in pair["launch"]] == ["spark2", "spark1"]


# ------------------------------------------------------------------------------------ preflight


def obs(**kw) -> core.PairObservations:
    base = dict(
        probe=core.LinkProbe(True, None, 9000, True, None),
        listen=core.MasterListen(True, None, True),
        image_ids={"spark2": "sha256:" + "a" * 64, "spark1": "sha256:" + "a" * 64},
        checkpoints={"spark2": "d" * 64, "spark1": "d" * 64},
        nccl={n: core.NcclReport("2.30.4", None, None, None, None) for n in ("spark2", "spark1")},
    )
    return core.PairObservations(**{**base, **kw})


def failed(report) -> dict[str, str]:
    return {c.name: f"{c.detail} -> {c.fix}" for c in report.failures()}


def pair():
    return parse_fleet(turned_on()).pairs[0]


def test_a_healthy_pair_passes_its_preflight():
    r = core.evaluate(pair(), obs())
    assert r.passed and [c.name for c in r.checks] == ["link", "master-port", "image", "checkpoint", "nccl", "nccl"]


@pytest.mark.parametrize("change, check, said", [
    (dict(probe=core.LinkProbe(False, "no echo of a 8972-byte datagram (timed out)", 1500, True, None)), "link",
     "the worker's path MTU is 1500"),
    (dict(listen=core.MasterListen(False, "192.168.100.1: Cannot assign requested address", False, "address")), "link",
     "spark1 has no address 192.168.100.1"),
    (dict(listen=core.MasterListen(False, "port 29501: Address already in use", True, "in-use")), "master-port",
     "port 29501 is not free on spark1"),
    (dict(probe=core.LinkProbe(True, None, 9000, False, "Connection timed out")), "master-port",
     "check the firewall for port 29501"),
    (dict(image_ids={"spark2": None, "spark1": "sha256:" + "a" * 64}), "image", "run node_artifacts for both"),
    (dict(checkpoints={"spark2": "e" * 64, "spark1": "d" * 64}), "checkpoint", "differs between the nodes"),
    (dict(nccl={"spark2": core.NcclReport("2.30.4", "2.30.4", "1" * 64, "2.30.4", "2" * 64),
                "spark1": core.NcclReport("2.30.4", None, None, None, None)}), "nccl",
     "same version but different builds"),
    (dict(nccl={"spark2": core.NcclReport("2.27.3", "2.27.3", None, "2.30.4", None),
                "spark1": core.NcclReport("2.30.4", None, None, None, None)}), "nccl", "pip NCCL 2.27.3 and system NCCL 2.30.4"),
    (dict(nccl={"spark2": core.NcclReport("2.28.9", None, None, None, None),
                "spark1": core.NcclReport("2.30.4", None, None, None, None)}), "nccl", "not the validated 2.30.4"),
    (dict(probe=None, listen=None, probe_error="python3: not found"), "link", "python3: not found"),
])
def test_each_preflight_check_blocks_with_its_reason_and_fix(change, check, said):
    r = core.evaluate(pair(), obs(**change))
    assert not r.passed and check in failed(r) and said in failed(r)[check], failed(r)


def test_the_master_port_held_by_the_pairs_own_running_head_is_no_refusal():
    held = core.MasterListen(False, "port 29501: Address already in use", True, "in-use", held_by_pair=True)
    assert core.evaluate(pair(), obs(listen=held, probe=core.LinkProbe(True, None, 9000, False, "refused"))).passed


def test_probe_outputs_parse_from_their_last_json_line():
    assert core.NcclReport.parse('warning\n{"loaded": "2.30.4", "pip": null}').loaded == "2.30.4"
    assert core.LinkProbe.parse("garbage").tcp_ok is False
    assert core.MasterListen.parse('{"listened": false, "error_kind": "address"}').error_kind == "address"


# ------------------------------------------------------------------------------------ diagnosis

HEAD_ALONE = ("(EngineCore_DP0 pid=2) ERROR 12-07 04:48:16 [core.py:708] EngineCore failed to start.\n"
              "torch.distributed.DistStoreError: Timed out after 601 seconds waiting for clients. 1/2 clients joined.\n"
              "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}")
WORKER_CANNOT = ("[W socket.cpp:755] [c10d] The client socket has failed to connect to [10.0.0.9]:29501 (errno: 110).\n"
                 "torch.distributed.DistNetworkError: The client socket has timed out after 600000ms while trying to "
                 "connect to (10.0.0.9, 29501).")


def test_the_three_pair_signatures_carry_the_runbooks_advice():
    assert [f.signature.id for f in diagnosis.diagnose(HEAD_ALONE)][0] == "pair-head-alone"
    (w,) = diagnosis.diagnose(WORKER_CANNOT)
    assert w.signature.id == "pair-worker-never-connects" and w.values == {"master_addr": "10.0.0.9", "master_port": "29501"}
    (n,) = diagnosis.diagnose("[rank0]:[E ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation timeout")
    assert n.signature.id == "nccl-timeout"
    for sig in ("pair-head-alone", "pair-worker-never-connects", "nccl-timeout"):
        s = diagnosis.signature(sig)
        assert "NCCL timeout on worker connect" in s.runbook_ref and "29501" in s.fix and "master-addr" in s.fix


def test_the_pairs_diagnosis_names_the_cause_first():
    p = pair()
    alone = core.diagnose(p, HEAD_ALONE, "", worker_running=False)
    assert alone.headline.startswith("spark1: the head was started alone: no worker ran on spark2 -> start the worker first")
    both = core.diagnose(p, HEAD_ALONE, WORKER_CANNOT, worker_running=False)
    assert both.headline.startswith("spark2: the worker (rank 1) could not reach") and len(both.findings) == 3
    waiting = core.diagnose(p, HEAD_ALONE, "", worker_running=True)
    assert "running on spark2, never joined" in waiting.headline


# ------------------------------------------------------------------------------- health, bench


def v(node, verdict):
    return NodeVerdict(node, verdict, ("e",), "a")


def test_the_sweep_judges_a_pair_as_one_engine():
    p = pair()
    h, w = core.judge_pair(p, v("spark1", "healthy"), v("spark2", "engine-down"), head_running=True, worker_running=True)
    assert (h.verdict, w.verdict) == ("healthy", "healthy") and "rank 1 of pair tp2" in w.evidence[0]
    h, w = core.judge_pair(p, v("spark1", "healthy"), v("spark2", "engine-down"), head_running=True, worker_running=False)
    assert h.verdict == "engine-down" and "the pair is down" in h.evidence[0] and w.verdict == "engine-down"
    assert core.pair_health(True, False) == (False, "the worker's container is not running: the pair is down "
                                                    "(TP=2 needs both nodes)")


def test_the_pairs_bench_beside_the_runbooks_rows():
    runbook = core.PairBench(56.3, 56.0)
    assert runbook.tp1_two_streams_tok_s == 95.0 and runbook.better == "tp1"
    lines = runbook.lines()
    assert lines[0] == "pair, 1 stream: 56.3 tok/s (runbook TP=2 ~56: x1.01)"
    assert "the runbook's ~95" in lines[1] and "x1.70 more at 2 streams" in lines[2]
    measured = core.PairBench(56.0, 56.0, {"spark1": 52.0, "spark2": 53.0})
    assert measured.tp1_two_streams_tok_s == 105.0 and "measured 52.0 + 53.0" in measured.lines()[1]
    assert "the pair is x1.07 per request" in measured.lines()[2]
    assert core.PairBench(60.0, 120.0, {"spark1": 52.0, "spark2": 53.0}).better == "pair"


# ------------------------------------------------------------------------------- sim runtime shim


def test_the_sims_runtime_clamps_a_privileged_containers_spec_to_this_machine(monkeypatch):
    monkeypatch.setattr(runtime_shim, "_bounding_caps", lambda: {"CAP_CHOWN", "CAP_NET_RAW"})
    spec = {"process": {"capabilities": {"bounding": ["CAP_CHOWN", "CAP_SYS_RESOURCE"]},
                        "rlimits": [{"type": "RLIMIT_MEMLOCK", "hard": 2**64 - 1, "soft": 2**64 - 1}]},
            "linux": {"devices": [{"path": "/dev/null"}, {"path": "/dev/sda"}]}}
    said = runtime_shim.clamp(spec)
    assert spec["process"]["capabilities"]["bounding"] == ["CAP_CHOWN"]
    assert spec["linux"]["devices"] == [{"path": "/dev/null"}]
    import resource

    hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
    if hard != resource.RLIM_INFINITY:
        assert spec["process"]["rlimits"][0]["hard"] == hard
    assert said and runtime_shim.clamp(spec) == []


def test_the_link_probe_leaves_the_master_port_free_for_the_heads_store():
    """The pair's preflight listens on the master port for the worker's connection; the head's
    store (SO_REUSEADDR, as torch's) binds it right after. A probe connection the listener closed
    first sat in TIME_WAIT on the head for a minute and the head died with EADDRINUSE."""
    import socket
    import time

    from spark_pipelines.runbook.pair import LINK_LISTEN

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    listener = subprocess.Popen([sys.executable, "-c", LINK_LISTEN, "127.0.0.1", str(port), "10"],
                                stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                c = socket.create_connection(("127.0.0.1", port), timeout=1)
                break
            except OSError:
                assert time.monotonic() < deadline, "the listener never listened"
                time.sleep(0.05)
        time.sleep(0.3)  # the worker's probe holds the connection a moment: the listener may close first
        c.close()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.settimeout(2)
            u.sendto(b"x", ("127.0.0.1", port))
            assert u.recvfrom(16)[0] == b"x"
        out, _ = listener.communicate(timeout=15)
    finally:
        listener.kill()
    assert json.loads(out)["listened"] is True
    with socket.socket() as store:
        store.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        store.bind(("0.0.0.0", port))  # EADDRINUSE on the old listener
        store.listen(1)
