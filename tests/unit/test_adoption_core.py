"""core/adoption: a running container compared with the launch spec, field by field; the verdicts."""

import json

import pytest

from spark_pipelines.core import adoption
from spark_pipelines.core.fleet import parse_fleet
from spark_pipelines.core.launch import launch_spec

IMAGE_ENV = ["PATH=/usr/local/bin:/usr/bin", "NVIDIA_VISIBLE_DEVICES=all", "MAX_JOBS=8"]


def hand_container(spec, *, env=None, args=None, binds=None, name=None, image="sha256:" + "a" * 64):
    """`docker inspect` of the runbook's own `docker run` (Phase 4): no labels, ~ expanded by the shell."""
    env = dict(spec.env if env is None else env)
    return {
        "Id": "c" * 64, "Name": "/" + (name or spec.container_name), "Image": image,
        "State": {"Running": True},
        "Config": {"Env": [*IMAGE_ENV[:2], *(f"{k}={v}" for k, v in env.items())],
                   "Cmd": list(spec.serve_args if args is None else args), "Labels": {}},
        "HostConfig": {"Binds": binds if binds is not None else [f"{h}:{c}" for h, c in spec.mounts],
                       "NetworkMode": "host", "IpcMode": "host",
                       "DeviceRequests": [{"Driver": "", "Count": -1, "Capabilities": [["gpu"]]}]},
    }


@pytest.fixture()
def spec(seed_data):
    fleet = parse_fleet(seed_data, "seed")
    return launch_spec(fleet, fleet.node("spark1"))


def test_the_runbooks_docker_run_with_the_six_env_vars_is_the_launch_spec(spec):
    # The image's own MAX_JOBS=8 is overridden by -e MAX_JOBS=2: what -e set is compared, not the image's.
    assert adoption.container_differences(spec, hand_container(spec), IMAGE_ENV, "sha256:" + "a" * 64) == []


def test_the_quick_relaunch_script_lacks_four_env_vars(spec):
    # /tmp/run-upstream.sh (the runbook's base64 script): only MAX_JOBS and FLASHINFER_NVCC_THREADS.
    c = hand_container(spec, env={"MAX_JOBS": "2", "FLASHINFER_NVCC_THREADS": "1"})
    diffs = adoption.container_differences(spec, c, IMAGE_ENV)
    assert sorted(d.split(":")[0] for d in diffs) == sorted(
        f"env {k}" for k in ("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "PYTORCH_CUDA_ALLOC_CONF",
                             "VLLM_MARLIN_USE_ATOMIC_ADD", "VLLM_USE_FLASHINFER_SAMPLER"))


def test_flags_are_compared_by_value_and_named(spec):
    args = list(spec.serve_args)
    args[args.index("--gpu-memory-utilization") + 1] = "0.80"
    # the runbook writes the JSON with its own spacing: the same config
    args[args.index("--speculative-config") + 1] = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    args += ["--enable-prefix-caching"]
    diffs = adoption.container_differences(spec, hand_container(spec, args=args), IMAGE_ENV)
    assert diffs == ["--enable-prefix-caching: set (not in the fleet file)",
                     "--gpu-memory-utilization: 0.80 (fleet file: 0.85)"]


def test_mounts_image_name_gpus_network(spec):
    c = hand_container(spec, binds=[f"{h}:{c}" for h, c in spec.mounts[:-1]] + ["/data/x:/x"], name="qwen-old",
                       image="sha256:" + "b" * 64)
    c["HostConfig"].update(NetworkMode="bridge", IpcMode="private", DeviceRequests=None)
    diffs = adoption.container_differences(spec, c, IMAGE_ENV, "sha256:" + "a" * 64)
    text = "\n".join(diffs)
    assert "container name: qwen-old" in text and "image: bbbbbbbbbbbb (the serving image is aaaaaaaaaaaa)" in text
    assert f"mount {spec.mounts[-1][1]}: missing" in text and "mount /data/x:/x (not in the fleet file)" in text
    assert "GPUs: not requested" in text and "network: bridge" in text and "IPC: private" in text


def test_findings_render_and_refuse_unknown_actions():
    f = [adoption.Finding("spark1", "node_deployment", adoption.ADOPT, "equal"),
         adoption.Finding("spark2", "node_deployment", adoption.DIFFERS, "not equal", ("env X: not set",))]
    text = adoption.render_text(f)
    assert "== spark2" in text and "      - env X: not set" in text
    assert adoption.summary(f) == {"adopt": 1, "differs": 1} and all(x.changes_nothing for x in f)
    with pytest.raises(ValueError, match="unknown adoption action"):
        adoption.Finding("spark1", "x", "rebuild-everything", "")
