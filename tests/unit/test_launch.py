"""The rendered launch is exactly the runbook's validated Phase 4 `docker run`."""

import json

from spark_pipelines.core.launch import docker_run_argv, expand_home, launch_spec
from spark_pipelines.core.fleet import load_fleet, parse_fleet


def runbook_argv(home: str) -> list[str]:
    # Phase 4 of the runbook, plus the six env vars of the 2026-06-18 fix, ~ expanded for the user.
    return [
        "docker", "run", "-d", "--name", "vllm-qwen35-v2",
        "--gpus", "all", "--net=host", "--ipc=host",
        "-e", "MAX_JOBS=2",
        "-e", "FLASHINFER_NVCC_THREADS=1",
        "-e", "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1",
        "-e", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        "-e", "VLLM_MARLIN_USE_ATOMIC_ADD=1",
        "-e", "VLLM_USE_FLASHINFER_SAMPLER=0",
        "-v", f"{home}/models:/models",
        "-v", f"{home}/.cache/vllm:/root/.cache/vllm",
        "-v", f"{home}/.cache/flashinfer:/root/.cache/flashinfer",
        "-v", f"{home}/.triton:/root/.cache/triton",
        "vllm-qwen35-v2",
        "serve", "/models/qwen35-122b-hybrid-int4fp8",
        "--served-model-name", "qwen35-hybrid-v2",
        "--port", "8000",
        "--max-model-len", "262144",
        "--gpu-memory-utilization", "0.85",
        "--reasoning-parser", "qwen3",
        "--attention-backend", "FLASHINFER",
        "--speculative-config", '{"method":"mtp","num_speculative_tokens":2}',
    ]


def test_seed_argv_is_the_runbook_launch_on_every_node():
    fleet = load_fleet("fleets/seed.yaml")
    for node in fleet.nodes:
        assert docker_run_argv(fleet, node) == runbook_argv("/home/operator")


def test_paths_expand_for_the_nodes_user(seed_data):
    seed_data["nodes"][1]["user"] = "ops"
    seed_data["nodes"][1]["home"] = "/srv/ops"
    fleet = parse_fleet(seed_data)
    argv = docker_run_argv(fleet, fleet.node("spark2"))
    assert "/srv/ops/models:/models" in argv and "/srv/ops/.triton:/root/.cache/triton" in argv
    assert "/home/operator/models:/models" in docker_run_argv(fleet, fleet.node("spark1"))
    assert expand_home("~", "/h") == "/h" and expand_home("/abs/~x", "/h") == "/abs/~x"


def test_speculative_config_is_compact_json(seed_data):
    seed_data["launch"]["speculative"]["num_speculative_tokens"] = 3
    fleet = parse_fleet(seed_data)
    argv = docker_run_argv(fleet, fleet.nodes[0])
    spec = argv[argv.index("--speculative-config") + 1]
    assert json.loads(spec) == {"method": "mtp", "num_speculative_tokens": 3}
    assert " " not in spec


def test_node_override_changes_only_that_node(seed_data):
    seed_data["nodes"][1]["overrides"] = {"gpu_memory_utilization": 0.87, "extra_flags": ["--enable-chunked-prefill"]}
    fleet = parse_fleet(seed_data)
    a = docker_run_argv(fleet, fleet.node("spark1"))
    b = docker_run_argv(fleet, fleet.node("spark2"))
    assert a[a.index("--gpu-memory-utilization") + 1] == "0.85"
    assert b[b.index("--gpu-memory-utilization") + 1] == "0.87"
    assert b[-1] == "--enable-chunked-prefill" and "--enable-chunked-prefill" not in a


def test_fingerprint_tracks_what_shapes_the_server(seed_data):
    f1 = parse_fleet(seed_data)
    seed_data["launch"]["max_model_len"] = 131072
    f2 = parse_fleet(seed_data)
    s1, s2 = launch_spec(f1, f1.nodes[0]), launch_spec(f2, f2.nodes[0])
    assert s1.fingerprint != s2.fingerprint
    assert s1.fingerprint == launch_spec(f1, f1.nodes[0]).fingerprint
