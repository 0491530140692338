"""The JIT cache as an artifact: what the compiled kernels depend on, and where a node keeps them.

The first boot compiles FlashInfer and Triton kernels and torch.compile artifacts for 25-45 min;
the runbook mounts `~/.cache/vllm`, `~/.cache/flashinfer` and `~/.triton` so later boots take
7-10 min, backs them up after a healthy first boot and restores them on fresh deploys. A cache
made for another image, checkpoint or kernel-shaping flag is stale (the runbook's "stale Triton
cache" and "stale torch_compile cache" rows): it must never be mounted.

Layout on a node: each mount path is a symlink to a keyed slot beside it,
`~/.cache/vllm -> vllm.jit-<key>`. Switching keys repoints the links (the user owns them; the
files inside, written by root in the container, are never moved), so a deploy's rollback
repoints them back and the previous deployment restarts warm. A slot carries SEALED once a boot
on it was healthy: only sealed slots are backed up.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spark_pipelines.core import names
from spark_pipelines.core.artifacts import NodeArtifacts
from spark_pipelines.core.launch import LaunchSpec

SLOT_INFIX = ".jit-"
SEALED = ".spark-jit-sealed"  # written into each slot after a healthy boot on it
UNKEYED = "unkeyed"  # a real directory found where a link was expected (a hand deploy's cache)
KEY_LEN = 16

# Flags and env vars that do not change which kernels get compiled: a change in them keeps the
# cache. Everything else (attention backend, speculative config, max-model-len, which sets the
# CUDA-graph sizes, quantization, dtype, ...) is part of the key: an unknown flag costs at most a
# cold boot, a wrongly kept cache costs a wrong or slow engine.
NON_KERNEL_FLAGS = frozenset({
    "--port", "--host", "--served-model-name", "--gpu-memory-utilization", "--reasoning-parser",
    "--tool-call-parser", "--enable-auto-tool-choice", "--api-key", "--load-format",
    "--disable-log-requests", "--disable-log-stats", "--uvicorn-log-level",
})
NON_KERNEL_ENV = frozenset({
    "MAX_JOBS", "FLASHINFER_NVCC_THREADS",  # compile parallelism, not what is compiled
    "PYTORCH_CUDA_ALLOC_CONF", "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS",  # memory accounting
    "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
})
# Flags that take no value (everything else starting with -- takes the next argument).
_SWITCHES = frozenset({"--enable-auto-tool-choice", "--disable-log-requests", "--disable-log-stats",
                       "--enforce-eager", "--enable-prefix-caching", "--enable-chunked-prefill",
                       "--trust-remote-code"})


def kernel_args(serve_args: Sequence[str]) -> list[str]:
    """The serve argv without what does not shape kernels (the model path is kept: its layer
    shapes are what gets compiled)."""
    out: list[str] = []
    i = 0
    args = list(serve_args)
    while i < len(args):
        a = args[i]
        flag, eq, _ = a.partition("=")
        takes_value = a.startswith("--") and not eq and flag not in _SWITCHES and i + 1 < len(args) \
            and not args[i + 1].startswith("--")
        step = 2 if takes_value else 1
        if flag not in NON_KERNEL_FLAGS:
            out.extend(args[i:i + step])
        i += step
    return out


# What of a checkpoint shapes its compiled kernels. vLLM keys its torch.compile cache on a hash of
# its configs (the model config's hash covers the HF config.json, dtype, quantization, max length,
# and the model *path*, which is the same container path for every version here), never on the
# weights' values; FlashInfer names its JIT modules by kernel parameters (dtypes, head dims, tile
# shapes), Triton by kernel source, constants and device. None of them reads a tensor's bytes. So a
# weights-only change (same config.json, same safetensors index: the same tensors, names and
# layout, new values) keeps a warm cache, and any change of config.json or of the index (another
# quantization, layer set or MTP layout) is a new key. The image and the kernel-shaping flags
# enter the key beside it (cache_key).
ARCHITECTURE_FILES = ("config.json", "model.safetensors.index.json")


def architecture(manifest_files: Mapping[str, Mapping]) -> str | None:
    """The checkpoint's kernel-shaping content, from its manifest (None: the manifest lacks one
    of ARCHITECTURE_FILES, so the architecture cannot be told apart: key on the whole manifest)."""
    if any(name not in manifest_files for name in ARCHITECTURE_FILES):
        return None
    blob = json.dumps({n: manifest_files[n]["sha256"] for n in ARCHITECTURE_FILES}, sort_keys=True)
    return "arch-" + hashlib.sha256(blob.encode()).hexdigest()[:32]


def cache_key(image_id: str, checkpoint: str, serve_args: Sequence[str], env: Mapping[str, str]) -> str:
    """What the kernels depend on -> a short stable key: the image (vLLM, torch, Triton,
    FlashInfer builds), the checkpoint's architecture (else its manifest or index digest) and the
    kernel-shaping flags and env."""
    if not image_id or not checkpoint:
        raise ValueError("a JIT cache key needs the image id and the checkpoint digest")
    blob = json.dumps({"image": image_id, "checkpoint": checkpoint, **_kernel_inputs(serve_args, env)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:KEY_LEN]


def launch_hash(serve_args: Sequence[str], env: Mapping[str, str]) -> str:
    """The kernel-shaping launch flags and env as a short hash: the same on two nodes launched
    alike (ports, names, GMU and paths do not enter), so their benches compare (core/baseline.py)."""
    return hashlib.sha256(json.dumps(_kernel_inputs(serve_args, env), sort_keys=True).encode()).hexdigest()[:KEY_LEN]


def _kernel_inputs(serve_args: Sequence[str], env: Mapping[str, str]) -> dict:
    return {"args": kernel_args(serve_args), "env": {k: v for k, v in sorted(env.items()) if k not in NON_KERNEL_ENV}}


def key_for(artifacts: NodeArtifacts, spec: LaunchSpec) -> str | None:
    """The key of what this launch on these artifacts compiles (None: the artifacts do not say
    which image or checkpoint they are, so no cache can be matched to them)."""
    checkpoint = artifacts.architecture or artifacts.manifest or artifacts.index
    if not artifacts.image_id or not checkpoint:
        return None
    return cache_key(artifacts.image_id, checkpoint, spec.serve_args, spec.env)


def slot_path(mount: str, key: str) -> str:
    """`/home/op/.cache/vllm` + key -> `/home/op/.cache/vllm.jit-<key>` (beside the mount: same
    parent, so no rename ever crosses directories)."""
    names.check(names.PATH, mount, "cache mount")
    return mount.rstrip("/") + SLOT_INFIX + key


def key_of_target(mount: str, target: str | None) -> str | None:
    """The key a mount's symlink points at (None: not one of our slots)."""
    if not target:
        return None
    base = posixpath.basename(target.rstrip("/"))
    stem = posixpath.basename(mount.rstrip("/")) + SLOT_INFIX
    return base[len(stem):] if base.startswith(stem) and len(base) > len(stem) else None


@dataclass(frozen=True)
class MountState:
    """One cache mount as read on the node."""

    path: str
    kind: str  # "link" | "dir" | "absent" | "other"
    target: str | None = None  # the link's target
    empty: bool = True  # for a real directory: nothing in it
    slot_exists: bool = False  # the slot for the wanted key is there
    slot_sealed: bool = False  # ... and a healthy boot ran on it
    slot_empty: bool = True


@dataclass(frozen=True)
class Plan:
    """What to do before the launch, and the verdict an operator reads."""

    key: str
    verdict: str  # "warm" | "restore" | "cold"
    why: str
    set_aside: tuple[str, ...] = ()  # real (unkeyed) dirs to rename to their `.jit-unkeyed` slot
    restore: bool = False  # copy the archived slot from the build host first


def plan(key: str, mounts: Sequence[MountState], archived: bool) -> Plan:
    """Warm when every mount already points at a sealed slot of this key (or the slots are there
    and sealed); restore when the build host archived this key and the node's slots are empty;
    else cold (the first boot compiles and the backup follows). A real directory in a mount's
    place is a hand-made cache of unknown key: set aside, never mounted, never deleted here."""
    aside = tuple(m.path for m in mounts if m.kind == "dir")
    bad = [m.path for m in mounts if m.kind == "other"]
    if bad:
        raise ValueError(f"{', '.join(bad)}: neither a directory nor a symlink; move it away, then deploy again")
    stale = [m.path for m in mounts if m.kind == "link" and key_of_target(m.path, m.target) not in (None, key)]
    if mounts and all(m.slot_exists and m.slot_sealed and not m.slot_empty for m in mounts):
        where = "points at" if all(key_of_target(m.path, m.target) == key for m in mounts) else "switches to"
        return Plan(key, "warm", f"the node {where} its sealed cache for key {key}: a warm boot (7-10 min)", aside)
    if archived:
        return Plan(key, "restore", f"the build host holds the cache for key {key}: restored before the launch, "
                                    f"so the boot is warm instead of a 25-45 min first boot", aside, restore=True)
    why = f"no cache for key {key} on the node or the build host: a first boot (25-45 min) compiles it"
    if stale or aside:
        why += f"; the cache there is for another image, checkpoint or flags ({', '.join(stale + list(aside))}): not used"
    return Plan(key, "cold", why, aside)


def parse_probe(text: str, mounts: Sequence[str], key: str) -> list[MountState]:
    """Read the output of `probe_argv` (one line per mount:
    `kind<TAB>target<TAB>empty<TAB>slot_exists<TAB>slot_sealed<TAB>slot_empty`)."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if len(lines) != len(mounts):
        raise ValueError(f"JIT cache probe printed {len(lines)} lines for {len(mounts)} mounts: {text[:200]!r}")
    out = []
    for path, line in zip(mounts, lines):
        kind, target, empty, exists, sealed, slot_empty = (line.split("\t") + [""] * 6)[:6]
        out.append(MountState(path, kind, target or None, empty == "1", exists == "1", sealed == "1", slot_empty == "1"))
    return out


# One POSIX sh program, constant text; the paths arrive as positional arguments ("$@"), so no
# path is ever parsed by the shell. Output: the line parse_probe reads, per mount.
PROBE_SCRIPT = r"""
key=$1; shift
for m in "$@"; do
  slot="$m.jit-$key"
  if [ -L "$m" ]; then kind=link; target=$(readlink "$m"); empty=1
  elif [ -d "$m" ]; then kind=dir; target=; if [ -z "$(ls -A "$m" 2>/dev/null)" ]; then empty=1; else empty=0; fi
  elif [ -e "$m" ]; then kind=other; target=; empty=1
  else kind=absent; target=; empty=1; fi
  if [ -d "$slot" ]; then ex=1; else ex=0; fi
  if [ -f "$slot/.spark-jit-sealed" ]; then se=1; else se=0; fi
  if [ -d "$slot" ] && [ -n "$(ls -A "$slot" 2>/dev/null | grep -v '^\.spark-jit-sealed$')" ]; then sl=0; else sl=1; fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$kind" "$target" "$empty" "$ex" "$se" "$sl"
done
"""


def probe_argv(key: str, mounts: Sequence[str]) -> list[str]:
    for m in mounts:
        names.check(names.PATH, m, "cache mount")
    return ["sh", "-c", PROBE_SCRIPT, "spark-jit-probe", key, *mounts]


def stale_slots(mount: str, entries: Sequence[str], keep: Sequence[str]) -> list[str]:
    """Of the names in the mount's parent folder, the slots of `mount` to wipe after a committed
    deploy: every `<name>.jit-*` (other keys' slots, slots set aside as stale / failed / unsealed /
    unkeyed) except those in `keep` (the running key's slot and the replaced deployment's, which
    a rollback would boot on). A hand-made cache set aside as `unkeyed` is the operator's (its
    kernels may be exactly a key's: `spark-pipelines adopt` names it), so it is never wiped here.
    Anything else in the folder is not the cache's and never touched."""
    prefix = posixpath.basename(mount.rstrip("/")) + SLOT_INFIX
    kept = {posixpath.basename(k.rstrip("/")) for k in keep}
    return sorted(e for e in entries if e.startswith(prefix) and e not in kept and "/" not in e
                  and e not in (".", "..") and not e.startswith(prefix + UNKEYED))
