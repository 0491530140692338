"""A simulated fleet brought to the runbook's hand-run state, the way its operator did it.

`build_by_hand(sim)` takes a fleet `SimFleet.up` made and runs the runbook's own commands over
SSH as the node users, nothing of spark-pipelines: on the build node the recipe's steps 0-2
(clone, `hf download` through the sim's hf stand-in, then install.sh, which runs
build-hybrid-checkpoint.py and add-mtp-weights.py), the base image (spark-vllm-docker at its pin,
the runbook's sed edits, `build-and-copy.sh -t vllm-sm121 --vllm-ref 2a69949bd --tf5 -j 8`), the
serving image (the starlette sed edit, `docker build -t vllm-qwen35-v2 -f docker/Dockerfile.v2 .`),
then `rsync` of the checkpoint and `docker save | ssh <node> docker load` to every other node; on
each node the page-cache flush and Phase 4's `docker run` (no labels, the six env vars of the
"MANDATORY ENV VARS" section), waited to /health; on the gateway host the hand-written LiteLLM
config (the runbook's three entries per node, with its comments) and the proxy restarted.

What the sim must differ in: addresses instead of the `spark1`/`spark2` SSH aliases, the stand-in
repositories' file:// URLs and commits (from the sim's fleet file), `general_settings.master_key`
(the sim's proxy wants a key), and the step-0 snapshot path read from `hf download`'s last line.
No spark-pipelines marker, label or manifest is made.

Variants an operator really ends up with: `quick_relaunch` launches those nodes with the
runbook's base64 quick-relaunch script (only MAX_JOBS and FLASHINFER_NVCC_THREADS: a GX10
tolerates that, a Founders node dies at graph capture), `gmu` another --gpu-memory-utilization.
"""

from __future__ import annotations

import base64
import os
import shlex
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from spark_sim.fleet import SimFleet
from spark_sim.layout import Member, SimError

# The runbook's values, as it writes them.
RECIPE_DIR = "DGX_Spark_Qwen3.5-122B-A10B-AR-INT4"
BUILD_DIR = "spark-vllm-docker"
INTEL_REPO = "Intel/Qwen3.5-122B-A10B-int4-AutoRound"
HYBRID_DIR = "~/models/qwen35-122b-hybrid-int4fp8"
BASE_MODEL_DIR = INTEL_REPO.replace("/", "--")  # where the pipeline's own download puts it (core/layout.py)
VLLM_REF = "2a69949bd"
BASE_TAG = "vllm-sm121"
IMAGE = "vllm-qwen35-v2"
CONTAINER = "vllm-qwen35-v2"
SERVED_MODEL = "qwen35-hybrid-v2"
PORT = 8000
GMU = 0.85
MANDATORY_ENV = (("MAX_JOBS", "2"), ("FLASHINFER_NVCC_THREADS", "1"), ("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "1"),
                 ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"), ("VLLM_MARLIN_USE_ATOMIC_ADD", "1"),
                 ("VLLM_USE_FLASHINFER_SAMPLER", "0"))
POOLS = ("fast", "reasoning", "code")
# Phase 4's "Quick relaunch" script, exactly as the runbook prints it (base64 of /tmp/run-upstream.sh).
QUICK_RELAUNCH_B64 = (
    "IyEvYmluL2Jhc2gKZG9ja2VyIHJ1biAtZCAtLW5hbWUgdmxsbS1xd2VuMzUtdjIgXAogIC0tZ3B1cyBhbGwgLS1uZXQ9aG9zdCAtLWlwYz1ob3N0"
    "IFwKICAtZSBNQVhfSk9CUz0yIFwKICAtZSBGTEFTSElORkVSX05WQ0NfVEhSRUFEUz0xIFwKICAtdiB+L21vZGVsczovbW9kZWxzIFwKICAtdiB+"
    "Ly5jYWNoZS92bGxtOi9yb290Ly5jYWNoZS92bGxtIFwKICAtdiB+Ly5jYWNoZS9mbGFzaGluZmVyOi9yb290Ly5jYWNoZS9mbGFzaGluZmVyIFwK"
    "ICAtdiB+Ly50cml0b246L3Jvb3QvLmNhY2hlL3RyaXRvbiBcCiAgdmxsbS1xd2VuMzUtdjIgXAogIHNlcnZlIC9tb2RlbHMvcXdlbjM1LTEyMmIt"
    "aHlicmlkLWludDRmcDggXAogIC0tc2VydmVkLW1vZGVsLW5hbWUgcXdlbjM1LWh5YnJpZC12MiBcCiAgLS1wb3J0IDgwMDAgXAogIC0tbWF4LW1v"
    "ZGVsLWxlbiAyNjIxNDQgXAogIC0tZ3B1LW1lbW9yeS11dGlsaXphdGlvbiAwLjg1IFwKICAtLXJlYXNvbmluZy1wYXJzZXIgcXdlbjMgXAogIC0t"
    "YXR0ZW50aW9uLWJhY2tlbmQgRkxBU0hJTkZFUiBcCiAgLS1zcGVjdWxhdGl2ZS1jb25maWcgJ3sibWV0aG9kIjoibXRwIiwibnVtX3NwZWN1bGF0"
    "aXZlX3Rva2VucyI6Mn0nCg==")
STEP_TIMEOUT_S = 900.0


@dataclass
class HandFleet:
    """What the hand build left: where things are and what serves."""

    build_node: str
    snapshot: str  # the Intel snapshot on the build node (the HF cache path `hf download` printed)
    checkpoint: str  # the hybrid checkpoint directory, on every node
    base_image_id: str
    image_id: str
    containers: dict[str, str] = field(default_factory=dict)  # node -> container id
    gateway_config: str = ""
    seconds: dict[str, float] = field(default_factory=dict)  # per phase


def _pins(sim: SimFleet) -> dict[str, Any]:
    if sim.fleet_file is None or not sim.fleet_file.exists():
        raise SimError("no simulated fleet file: bring the fleet up with `spark-pipelines sim up` first")
    doc = yaml.safe_load(sim.fleet_file.read_text())
    return doc["pins"]


class Hand:
    """The operator's terminal: ssh to a member as its user, run a runbook script there."""

    def __init__(self, sim: SimFleet, log: Callable[[str], None]) -> None:
        self.sim = sim
        self.log = log

    def ssh_argv(self, m: Member) -> list[str]:
        lay = self.sim.layout
        return ["ssh", "-i", str(lay.key_path), "-o", f"UserKnownHostsFile={lay.known_hosts}",
                "-o", "StrictHostKeyChecking=yes", "-o", "BatchMode=yes", "-o", "ConnectTimeout=15",
                f"{m.user}@{m.ip}"]

    def run(self, m: Member, script: str, what: str, *, stdin: str | None = None,
            timeout: float = STEP_TIMEOUT_S) -> str:
        """bash on the member, as its user; the script's stdout. SimError naming the step on failure."""
        command = "bash -c " + shlex.quote("set -euo pipefail\n" + script)
        self.log(f"[{m.name}] {what}")
        try:
            p = subprocess.run([*self.ssh_argv(m), command], input=stdin, capture_output=True, text=True,
                               timeout=timeout, stdin=None if stdin is not None else subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise SimError(f"hand build, {what} on {m.name}: not done within {timeout:.0f} s") from None
        if p.returncode != 0:
            tail = "\n".join((p.stderr.strip() or p.stdout.strip()).splitlines()[-15:])
            raise SimError(f"hand build, {what} on {m.name} failed (exit {p.returncode}):\n{tail}")
        return p.stdout


def _peer(m: Member) -> str:
    """What the runbook calls `spark2`: the node's SSH alias; here its user at its address."""
    return f"{m.user}@{m.ip}"


def model_script(recipe_url: str, recipe_commit: str) -> str:
    """Phase 3 on the build node: the recipe's steps 0-2 (install.sh --no-launch runs 1-2)."""
    return f"""
cd ~ && git clone -q {shlex.quote(recipe_url)} {RECIPE_DIR}
cd {RECIPE_DIR}
git checkout -q {shlex.quote(recipe_commit)}
# Step 0: Download (cached = instant)
INTEL_DIR=$(hf download {INTEL_REPO} --quiet | tail -n 1)
echo "snapshot: $INTEL_DIR"
# Steps 1-2: build the hybrid checkpoint, add the MTP weights
INTEL_DIR="$INTEL_DIR" bash install.sh --no-launch
"""


def base_model_moved_script(snapshot: str) -> str:
    """The base model moved out of the HF cache into ~/models with a plain copy, as rsync between
    machines leaves it: the files, none of huggingface_hub's metadata (its revision is unknown)."""
    return f"""
mkdir -p ~/models
cp -rL {shlex.quote(snapshot)} ~/models/{BASE_MODEL_DIR}
rm -rf ~/.cache/huggingface/hub/models--{INTEL_REPO.replace("/", "--")}
echo "snapshot: $HOME/models/{BASE_MODEL_DIR}"
"""


def base_image_script(build_url: str, build_commit: str) -> str:
    """Phase 3's base image, the runbook's commands (its `206a` is "the VLLM_PRS block's fi line +1",
    as its own comment says; computed here because the stand-in's Dockerfile is shorter)."""
    return f"""
cd ~
rm -rf {BUILD_DIR}
git clone -q {shlex.quote(build_url)} {BUILD_DIR}
cd {BUILD_DIR}
git checkout -q {shlex.quote(build_commit)}
# Remove temp patches (target main, not v0.19.0)
sed -i '/# TEMPORARY PATCH for broken FP8 kernels/,/\\&\\& rm pr35568.diff/d' Dockerfile
sed -i '/# TEMPORARY PATCH for broken compilation/,/\\&\\& rm pr38919.diff/d' Dockerfile
# Pin stable torch 2.12.0+cu130 (nightly dev20260408 is GONE from PyPI)
sed -i 's|uv pip install torch torchvision torchaudio triton --index-url https://download.pytorch.org/whl/nightly/cu130|uv pip install torch==2.12.0+cu130 torchvision==0.27.0+cu130 torchaudio==2.11.0+cu130 triton --index-url https://download.pytorch.org/whl/cu130|g' Dockerfile
# Cherry-pick PR #38325 (swapAB SM120 FP8 GEMM, +0.76%)
PROJECT_DIR=~/{RECIPE_DIR}
cp "${{PROJECT_DIR}}/patches/05-pr38325-swapab/pr38325-swapab-fp8-sm120.diff" local-pr38325.diff
# Inject after VLLM_PRS block (find the 'fi' line number, +1)
FI=$(awk '/^RUN if \\[ -n "\\$VLLM_PRS" \\]; then/{{f=1}} f && /^[[:space:]]*fi[[:space:]]*$/{{print NR; exit}}' Dockerfile)
sed -i "$((FI + 1))"'a \\
\\
COPY local-pr38325.diff /tmp/local-pr38325.diff\\
RUN git apply -v /tmp/local-pr38325.diff && rm /tmp/local-pr38325.diff' Dockerfile
grep -q local-pr38325 Dockerfile
./build-and-copy.sh -t {BASE_TAG} --vllm-ref {VLLM_REF} --tf5 -j 8 >/dev/null
docker image inspect --format '{{{{.Id}}}}' {BASE_TAG}:latest
"""


def serving_image_script() -> str:
    return f"""
cd ~/{RECIPE_DIR}
grep -q 'starlette' docker/Dockerfile.v2 || \\
sed -i '/^ENTRYPOINT/i \\
# Fix: Starlette 1.x breaks vLLM 0.19 router\\
RUN pip install --no-deps "starlette>=0.40.0,<1.0" "fastapi>=0.115.0,<0.116.0"\\
' docker/Dockerfile.v2
docker build -t {IMAGE} -f docker/Dockerfile.v2 . >/dev/null
docker image inspect --format '{{{{.Id}}}}' {IMAGE}:latest
"""


def copy_script(peer: str) -> str:
    """Phase 3c from the build node to one other node (`spark2` in the runbook)."""
    return f"""
ssh -n {peer} 'mkdir -p ~/models'
# Copy hybrid checkpoint (~71 GB)
rsync -avP --info=progress2 \\
{HYBRID_DIR}/ \\
{peer}:{HYBRID_DIR}/ </dev/null >/dev/null
# Transfer Docker image
docker save {IMAGE} | ssh {peer} 'docker load'
# Verify
ssh -n {peer} 'docker images | grep {IMAGE}'
ssh -n {peer} 'ls {HYBRID_DIR}/model.safetensors.index.json'
"""


# What the operator's first interactive login on DGX OS (Ubuntu) leaves in a home: ~/.cache, the
# user's own. A fresh sim home has none, and then dockerd creates ~/.cache as root for the cache
# mounts of the first `docker run` (no real node's home looks like that).
FIRST_LOGIN = "mkdir -p ~/.cache && touch ~/.cache/motd.legal-displayed\n"


def launch_script(gmu: float = GMU) -> str:
    """Phase 4 on one node: the mandatory flush, then the runbook's docker run with the six
    mandatory env vars (no labels)."""
    env = "".join(f"-e {k}={shlex.quote(v)} \\\n" for k, v in MANDATORY_ENV)
    return FIRST_LOGIN + f"""
# MANDATORY: Flush page cache before EVERY launch
sudo sh -c 'sync; echo 3 > /proc/sys/vm/drop_caches'
docker run -d --name {CONTAINER} \\
--gpus all --net=host --ipc=host \\
{env}-v ~/models:/models \\
-v ~/.cache/vllm:/root/.cache/vllm \\
-v ~/.cache/flashinfer:/root/.cache/flashinfer \\
-v ~/.triton:/root/.cache/triton \\
{IMAGE} \\
serve /models/qwen35-122b-hybrid-int4fp8 \\
--served-model-name {SERVED_MODEL} \\
--port {PORT} \\
--max-model-len 262144 \\
--gpu-memory-utilization {gmu:.2f} \\
--reasoning-parser qwen3 \\
--attention-backend FLASHINFER \\
--speculative-config '{{"method":"mtp","num_speculative_tokens":2}}'
"""


def quick_relaunch_script() -> str:
    """Phase 4's "Quick relaunch" (the script in the user's home, not the shared /tmp of the sim)."""
    return FIRST_LOGIN + f"""
echo {QUICK_RELAUNCH_B64} \\
| base64 -d > ~/run-upstream.sh && chmod +x ~/run-upstream.sh
docker rm -f {CONTAINER} 2>/dev/null || true
sudo sh -c 'sync; echo 3 > /proc/sys/vm/drop_caches'
bash ~/run-upstream.sh
"""


def litellm_config(nodes: Iterable[Member]) -> str:
    """The runbook's hand-written config: three entries per node, its comments, the node's address
    in api_base; the proxy's master key from its environment (the sim's proxy requires one)."""
    lines = ["# In LITELLM_CONFIG_PATH (e.g. /home/USER/litellm/config.yaml)", "model_list:"]
    for i, m in enumerate(nodes):
        lines.append(f"# {m.name} entries" + (" (identical, different api_base)" if i else ""))
        for pool in POOLS:
            lines += [f"- model_name: {pool}",
                      "  litellm_params:",
                      f"    model: openai/{SERVED_MODEL}",
                      f"    api_base: http://{m.ip}:{PORT}/v1",
                      '    api_key: "dummy"',
                      "  model_info:",
                      f"    id: {m.name}-qwen35-122b-{pool}"]
    lines += ["general_settings:", "  master_key: os.environ/LITELLM_MASTER_KEY"]
    return "\n".join(lines) + "\n"


def wait_healthy(nodes: Iterable[Member], timeout_s: float = 300.0) -> None:
    pending = {m.name: m for m in nodes}
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for name, m in list(pending.items()):
            try:
                with urllib.request.urlopen(f"http://{m.ip}:{PORT}/health", timeout=2) as r:  # noqa: S310 - sim net
                    if r.status == 200:
                        pending.pop(name)
            except OSError:
                pass
        if pending:
            time.sleep(0.5)
    if pending:
        raise SimError(f"hand build: {', '.join(pending)} not healthy on :{PORT}/health within {timeout_s:.0f} s "
                       f"(see `docker logs {CONTAINER}` there)")


def build_by_hand(sim: SimFleet, *, quick_relaunch: Iterable[str] = (), gmu: Mapping[str, float] | None = None,
                  base_model_copied: bool = False, log: Callable[[str], None] = lambda _: None) -> HandFleet:
    """Bring an up simulated fleet to the runbook's hand-run state (see the module doc).
    quick_relaunch: nodes launched with the runbook's base64 relaunch script instead of Phase 4's
    docker run; gmu: {node: value} launched with another --gpu-memory-utilization;
    base_model_copied: after the build, the base model moved from the HF cache to ~/models by a
    plain copy (no huggingface_hub metadata: its revision cannot be read off the node)."""
    if not sim.is_up:
        raise SimError("no simulated fleet is up: `spark-pipelines sim up` first")
    gmu = dict(gmu or {})
    quick = set(quick_relaunch)
    known = {m.name for m in sim.nodes}
    for name in [*quick, *gmu]:
        if name not in known:
            raise SimError(f"hand build: no simulated node {name!r}; nodes: {', '.join(sorted(known))}")
    pins = _pins(sim)
    hand = Hand(sim, log)
    build, others = sim.nodes[0], sim.nodes[1:]
    seconds: dict[str, float] = {}

    def phase(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        out = fn()
        seconds[name] = round(time.monotonic() - t0, 2)
        return out

    recipe, build_repo = pins["recipe_repo"], pins["build_repo"]
    out = phase("model", lambda: hand.run(build, model_script(recipe["url"], recipe["commit"]),
                                          "recipe steps 0-2 (hf download, install.sh --no-launch)"))
    snapshot = next((ln.split(": ", 1)[1] for ln in out.splitlines() if ln.startswith("snapshot: ")), "")
    if base_model_copied:
        out = phase("base_model_copied", lambda: hand.run(build, base_model_moved_script(snapshot),
                                                          "base model copied into ~/models (no metadata)"))
        snapshot = next((ln.split(": ", 1)[1] for ln in out.splitlines() if ln.startswith("snapshot: ")), "")
    base_id = phase("base_image", lambda: hand.run(build, base_image_script(build_repo["url"], build_repo["commit"]),
                                                   "base image (build-and-copy.sh)").strip().splitlines()[-1])
    image_id = phase("serving_image", lambda: hand.run(build, serving_image_script(),
                                                       "serving image (docker build)").strip().splitlines()[-1])
    for m in others:
        phase(f"copy_{m.name}", lambda m=m: hand.run(build, copy_script(_peer(m)), f"rsync and docker save | load to {m.name}"))
    containers: dict[str, str] = {}
    for m in sim.nodes:
        if m.name in quick:
            script = quick_relaunch_script()
        else:
            script = launch_script(gmu.get(m.name, GMU))
        cid = phase(f"launch_{m.name}", lambda m=m, script=script: hand.run(m, script, "Phase 4 launch"))
        containers[m.name] = cid.strip().splitlines()[-1]
    phase("healthy", lambda: wait_healthy(sim.nodes))
    gw = sim.gateway
    config = f"{gw.home}/litellm/config.yaml"
    phase("gateway", lambda: hand.run(gw, "cat > ~/litellm/config.yaml\nlitellm-restart", "LiteLLM config + restart",
                                      stdin=litellm_config(sim.nodes)))
    hybrid = str(build.home / HYBRID_DIR.removeprefix("~/"))
    return HandFleet(build.name, snapshot, hybrid, base_id, image_id, containers, config, seconds)


def quick_relaunch_argv_text() -> str:
    """The decoded relaunch script (for the sim's command line and tests)."""
    return base64.b64decode(QUICK_RELAUNCH_B64).decode()


def spark_pipelines_traces(sim: SimFleet) -> list[str]:
    """Anything of spark-pipelines on the simulated members: its state dir, a manifest, a label.
    A hand-built fleet has none."""
    found: list[str] = []
    for m in sim.members:
        state = m.home / ".cache" / "spark-pipelines"
        if state.exists():
            found.append(str(state))
        for p in m.home.rglob(".spark-manifest.json"):
            found.append(str(p))
    env = dict(os.environ)
    for m in sim.nodes:
        p = subprocess.run(["docker", "ps", "-a", "-q"], capture_output=True, text=True,
                           env={**env, "DOCKER_HOST": m.docker_host})
        for cid in p.stdout.split():
            labels = subprocess.run(["docker", "inspect", "--format", "{{json .Config.Labels}}", cid],
                                    capture_output=True, text=True, env={**env, "DOCKER_HOST": m.docker_host}).stdout
            if "org.spark-pipelines" in labels:
                found.append(f"{m.name}: container {cid} labelled {labels.strip()}")
    return found


__all__ = ["HandFleet", "build_by_hand", "litellm_config", "quick_relaunch_argv_text", "spark_pipelines_traces"]
