"""Local stand-ins for the upstream pieces the pipeline drives, for the simulated fleet.

`make_build_repo` (eugr/spark-vllm-docker), `make_recipe_repo` (albond's recipe) and
`make_model_source` (the Intel AutoRound snapshot and the Qwen FP8 repo) lay out files like the
real ones, with the same anchors, flags, file names and log lines, but everything runs offline:
the build repo's Dockerfile builds FROM a local Python base image with `python3`, `sh` and `git`
only, and the recipe's scripts write tiny but real safetensors files with the stdlib.
Repositories are committed with a fixed author and date, so their shas are reproducible.

The files of both repositories are real files under build/ and recipe/ next to this module;
`_render` fills in the few values that have their home elsewhere (the cu130 index URLs in
core, the stdlib safetensors helpers shared with the model source below, the engine stand-in).
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from spark_pipelines.core.dockerfile import NIGHTLY_CU130_INDEX, STABLE_CU130_INDEX
from spark_sim.upstream import st_stdlib

DEFAULT_BASE_IMAGE = "sim-python-base:latest"
INTEL_REPO = "Intel/Qwen3.5-122B-A10B-int4-AutoRound"
FP8_REPO = "Qwen/Qwen3.5-122B-A10B-FP8"
# The one public report of the snapshot the runbook used (upstream pins no revision).
INTEL_REVISION = "de5e04f218487cb2fb762c6e9aabec784fb40d00"
# Two later revisions of the Intel repo on the sim hub: the same architecture (config, tensor names,
# dtypes and shapes: the same JIT key), other weights. NEXT is a good retrain; BROKEN ships a
# tokenizer config the stand-in answers garbage with (a rollout's quality gate must stop it).
INTEL_REVISION_NEXT = hashlib.sha1(b"sim:intel:next").hexdigest()
INTEL_REVISION_BROKEN = hashlib.sha1(b"sim:intel:broken").hexdigest()
FP8_REVISION = hashlib.sha1(b"sim:" + FP8_REPO.encode()).hexdigest()
COMMIT_DATE = "2026-04-04T12:00:00+00:00"
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "sim upstream",
    "GIT_AUTHOR_EMAIL": "sim@upstream.invalid",
    "GIT_COMMITTER_NAME": "sim upstream",
    "GIT_COMMITTER_EMAIL": "sim@upstream.invalid",
    "GIT_AUTHOR_DATE": COMMIT_DATE,
    "GIT_COMMITTER_DATE": COMMIT_DATE,
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
}
# The file PR 38325's diff patches, relative to the vLLM source tree.
SWAPAB_TARGET = "csrc/quantization/w8a8/cutlass/c3x/scaled_mm_blockwise_sm120_fp8_dispatch.cuh"
SWAPAB_DIFF = "patches/05-pr38325-swapab/pr38325-swapab-fp8-sm120.diff"
LMHEAD_MARKER = "DGX_SPARK_INT8_LMHEAD_V2"


class UpstreamError(RuntimeError):
    """A stand-in could not be created (git missing, destination not empty, ...)."""


def _git(dest: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(_GIT_ENV)
    try:
        done = subprocess.run(
            ["git", "-c", "commit.gpgsign=false", "-c", "init.defaultBranch=main", *args],
            cwd=dest, env=env, check=True, capture_output=True, text=True,
        )
    except FileNotFoundError:
        raise UpstreamError("git is not installed; install the 'git' Debian package") from None
    except subprocess.CalledProcessError as exc:
        raise UpstreamError(f"git {' '.join(args)} failed in {dest}: {exc.stderr.strip()}") from None
    return done.stdout.strip()


def _write_tree(dest: Path, files: dict[str, str], executable: set[str]) -> None:
    for rel, text in files.items():
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        path.chmod(0o755 if rel in executable else 0o644)


def _commit_repo(dest: Path, files: dict[str, str], executable: set[str], message: str) -> str:
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise UpstreamError(f"{dest}: not empty; give a new directory for the stand-in repository")
    dest.mkdir(parents=True, exist_ok=True)
    _git(dest, "init", "-q")
    _write_tree(dest, files, executable)
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", message)
    return _git(dest, "rev-parse", "HEAD")


HERE = Path(__file__).parent
BUILD_TREE = HERE / "build"
RECIPE_TREE = HERE / "recipe"
BUILD_EXECUTABLE = {"build-and-copy.sh", "sim/uv.py", "sim/build_vllm.py", "sim/check_abi.py", "sim/vllm-cli.py"}
RECIPE_EXECUTABLE = {"install.sh", "bench_qwen35.sh", "patches/01-hybrid-int4-fp8/build-hybrid-checkpoint.py",
                     "patches/02-mtp-speculative/add-mtp-weights.py"}
_INLINE = {  # a marker line in a recipe script -> the file inlined there (the script stays one file)
    "# __ST_LIB__:": HERE / "st_stdlib.py",
    "# __HUB__:": HERE / "hub_lookup.py",
}


def _render(text: str) -> str:
    text = text.replace("__NIGHTLY__", NIGHTLY_CU130_INDEX).replace("__STABLE__", STABLE_CU130_INDEX)
    out = []
    for line in text.splitlines(keepends=True):
        marker = next((m for m in _INLINE if line.startswith(m)), None)
        out.append(_INLINE[marker].read_text(encoding="utf-8") + "\n" if marker else line)
    return "".join(out)


def _tree_files(tree: Path) -> dict[str, str]:
    return {
        p.relative_to(tree).as_posix(): _render(p.read_text(encoding="utf-8"))
        for p in sorted(tree.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


# ---------------------------------------------------------------- build repo (spark-vllm-docker)

SWAPAB_ORIGINAL = (BUILD_TREE / "sim-vllm-src" / SWAPAB_TARGET).read_text(encoding="utf-8")
SWAPAB_PATCHED = (HERE / "swapab-patched.cuh").read_text(encoding="utf-8")


def swapab_diff() -> str:
    """A real git-style unified diff turning SWAPAB_ORIGINAL into SWAPAB_PATCHED (the recipe
    repo holds it as a file; a test checks that file against this)."""
    body = difflib.unified_diff(
        SWAPAB_ORIGINAL.splitlines(keepends=True),
        SWAPAB_PATCHED.splitlines(keepends=True),
        fromfile=f"a/{SWAPAB_TARGET}",
        tofile=f"b/{SWAPAB_TARGET}",
    )
    return f"diff --git a/{SWAPAB_TARGET} b/{SWAPAB_TARGET}\n" + "".join(body)


# The GB10 engine stand-in: stdlib-only files that run beside each other in /opt/sim of the image.
ENGINE_FILES = ("vllm_standin.py", "standin_startup.py", "standin_jit.py", "standin_answers.py", "standin_pair.py")


def build_repo_files() -> dict[str, str]:
    files = _tree_files(BUILD_TREE)
    # The engine stand-in has one home, the simulator package; the image build copies it in.
    for name in ENGINE_FILES:
        files[f"sim/{name}"] = (HERE.parent / name).read_text(encoding="utf-8")
    return files


def make_build_repo(dest: str | Path) -> str:
    """Create the spark-vllm-docker stand-in as a git repository at `dest`; return its sha."""
    return _commit_repo(Path(dest), build_repo_files(), BUILD_EXECUTABLE, "Simulated spark-vllm-docker")


# ---------------------------------------------------------------- recipe repo (albond)


def recipe_repo_files() -> dict[str, str]:
    return _tree_files(RECIPE_TREE)


def make_recipe_repo(dest: str | Path) -> str:
    """Create the recipe stand-in as a git repository at `dest`; return its sha."""
    return _commit_repo(Path(dest), recipe_repo_files(), RECIPE_EXECUTABLE,
                        "Simulated DGX Spark Qwen3.5-122B recipe")




DENSE = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelSource:
    hub_cache: Path  # give it to the scripts as HF_HUB_CACHE
    intel_snapshot: Path
    intel_revision: str
    fp8_snapshot: Path
    fp8_revision: str
    layers: int
    shards: int
    mtp_tensors: int

    @property
    def expected_scales(self) -> int:
        return self.layers * len(DENSE)


def _fill(name: str, size: int) -> bytes:
    """Deterministic tensor bytes derived from the tensor's name."""
    seed = hashlib.sha256(name.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def _tensor(name: str, dtype: str, shape: list[int], salt: str = "") -> tuple[str, list[int], bytes]:
    count = 1
    for d in shape:
        count *= d
    return (dtype, shape, _fill(salt + name, count * st_stdlib.DTYPE_BYTES[dtype]))


def _snapshot_dir(hub: Path, repo_id: str, revision: str) -> Path:
    root = hub / ("models--" + repo_id.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(revision, encoding="utf-8")
    snap = root / "snapshots" / revision
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def _write_sharded(snap: Path, shards: list[dict], extra: dict[str, str] | None = None) -> None:
    weight_map: dict[str, str] = dict(extra or {})
    total = 0
    for n, tensors in enumerate(shards, 1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        st_stdlib.st_write(str(snap / name), tensors, {"format": "pt"})
        for key, (_, _, raw) in tensors.items():
            weight_map[key] = name
            total += len(raw)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (snap / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), "utf-8")


def make_model_source(
    dest: str | Path, *, layers: int = 48, shards: int = 14, mtp_tensors: int = 8,
    unmatched_fp8: int = 8,
) -> ModelSource:
    """Lay out an HF hub cache at `dest` holding tiny stand-ins of the Intel AutoRound INT4
    snapshot (at INTEL_REVISION) and of the Qwen FP8 repo. The hybrid build finds
    `layers` x 3 shared-expert dense layers to replace (the recipe's 144 with 48 layers)."""
    if layers < 1 or shards < 1 or shards > layers or mtp_tensors < 1 or unmatched_fp8 < 0:
        raise ValueError("need layers >= shards >= 1, mtp_tensors >= 1, unmatched_fp8 >= 0")
    hub = Path(dest)
    if hub.exists() and any(hub.iterdir()):
        raise UpstreamError(f"{hub}: not empty; give a new directory for the model source")
    # The later revisions first: refs/main ends on INTEL_REVISION, what the seed pins.
    _intel_snapshot(hub, INTEL_REVISION_NEXT, layers, shards, mtp_tensors, salt="next:")
    _intel_snapshot(hub, INTEL_REVISION_BROKEN, layers, shards, mtp_tensors, salt="broken:",
                    tokenizer={"sim_answers": "garbage"})
    intel = _intel_snapshot(hub, INTEL_REVISION, layers, shards, mtp_tensors)

    fp8 = _snapshot_dir(hub, FP8_REPO, FP8_REVISION)
    dense: dict = {}
    for i in range(layers):
        pre = f"model.layers.{i}.mlp.shared_expert"
        for proj in DENSE:
            dense[f"{pre}.{proj}.weight"] = _tensor(f"fp8{i}{proj}", "F8_E4M3", [4, 4])
            dense[f"{pre}.{proj}.weight_scale_inv"] = _tensor(f"s{i}{proj}", "F32", [1, 1])
    for i in range(unmatched_fp8):  # named differently upstream: the builder warns and skips them
        dense[f"model.language_model.layers.{i}.self_attn.qkv_proj.weight"] = _tensor(
            f"qkv{i}", "F8_E4M3", [4, 4])
    experts = {"model.layers.0.mlp.experts.0.gate_proj.weight": _tensor("fe", "F8_E4M3", [4, 4])}
    _write_sharded(fp8, [dense, experts])
    (fp8 / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}), "utf-8")
    return ModelSource(hub, intel, INTEL_REVISION, fp8, FP8_REVISION, layers, shards, mtp_tensors)


def _intel_snapshot(hub: Path, revision: str, layers: int, shards: int, mtp_tensors: int, *, salt: str = "",
                    tokenizer: dict | None = None) -> Path:
    """One revision of the Intel AutoRound INT4 stand-in: `salt` changes every tensor's bytes and
    nothing else (names, dtypes, shapes, config: the same architecture)."""
    intel = _snapshot_dir(hub, INTEL_REPO, revision)
    per_shard: list[dict] = [{} for _ in range(shards)]
    for i in range(layers):
        t = per_shard[i * shards // layers]
        pre = f"model.layers.{i}"
        for proj in DENSE:
            t[f"{pre}.mlp.shared_expert.{proj}.weight"] = _tensor(f"{pre}{proj}", "BF16", [4, 4], salt)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            e = f"{pre}.mlp.experts.0.{proj}"
            t[f"{e}.qweight"] = _tensor(e + "q", "I32", [1, 4], salt)
            t[f"{e}.scales"] = _tensor(e + "s", "F16", [1, 4], salt)
            t[f"{e}.qzeros"] = _tensor(e + "z", "I32", [1, 1], salt)
        t[f"{pre}.input_layernorm.weight"] = _tensor(pre + "ln", "BF16", [4], salt)
    per_shard[0]["model.embed_tokens.weight"] = _tensor("embed", "BF16", [8, 4], salt)
    per_shard[-1]["lm_head.weight"] = _tensor("lm_head", "BF16", [8, 4], salt)
    mtp = {f"mtp.layers.0.t{j}.weight": _tensor(f"mtp{j}", "BF16", [4, 4], salt) for j in range(mtp_tensors)}
    st_stdlib.st_write(str(intel / "model_extra_tensors.safetensors"), mtp, {"format": "pt"})
    _write_sharded(intel, per_shard, {k: "model_extra_tensors.safetensors" for k in mtp})
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "num_hidden_layers": layers,
        "quantization_config": {"quant_method": "auto-round", "bits": 4, "group_size": 128,
                                "sym": True, "packing_format": "auto_round:auto_gptq"},
    }
    (intel / "config.json").write_text(json.dumps(config, indent=2), "utf-8")
    (intel / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend",
                                                             **(tokenizer or {})}), "utf-8")
    return intel
