"""The stand-in engine's JIT caches: a cold boot compiles and fills them, a warm boot loads them.

On a GB10 the first boot compiles torch.compile artifacts, FlashInfer and Triton kernels into the
three cache mounts (runbook: first boot 25-45 min, second 7-10). The stand-in models that inside
its container: for each cache directory that is a mount (never a directory of the machine it
runs on outside a container), it looks for the entries its own kernel hash names; missing ones
cost compile time and are written, present ones are loaded. A mounted cache that holds kernels
compiled for another hash and none for its own is a stale cache (a compile cache made for another
image, checkpoint or kernel-shaping flag, shipped or mounted by mistake): the boot fails the way the
runbook's "stale torch_compile cache" and "Stale Triton cache" rows describe, naming the directory
to wipe. Stdlib only: copied into the image next to vllm_standin.py.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

# (name, path in the container as the runbook mounts it, share of the compile time)
CACHE_DIRS = (
    ("vllm", "/root/.cache/vllm", 0.5),
    ("flashinfer", "/root/.cache/flashinfer", 0.3),
    ("triton", "/root/.cache/triton", 0.2),
)
# A cold boot takes this many startup paces more (warm ~7-10 min vs first 25-45: ~3.5x).
DEFAULT_COLD_FACTOR = 2.5


def mount_points(mountinfo: str = "/proc/self/mountinfo") -> set[str]:
    try:
        with open(mountinfo, encoding="utf-8") as f:
            return {line.split()[4] for line in f if len(line.split()) > 4}
    except OSError:
        return set()


def kernel_hash(model: str, max_model_len: int, spec: object, attention_backend: str | None, version: str) -> str:
    """What the stand-in's kernels depend on (vLLM hashes its compilation and model config)."""
    blob = json.dumps([model, max_model_len, spec, attention_backend, version], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


@dataclass(frozen=True)
class Entry:
    name: str
    root: str
    share: float
    warm: bool

    def path(self, h: str) -> str:
        if self.name == "vllm":
            return os.path.join(self.root, "torch_compile_cache", h, "rank_0_0", "backbone")
        if self.name == "flashinfer":
            return os.path.join(self.root, "90a", "cached_ops", f"fused_moe_sm121_{h}")
        return os.path.join(self.root, h)

    def others(self, h: str) -> list[str]:
        """The kernel hashes this cache holds entries for, other than `h` (a stale cache's)."""
        if self.name == "vllm":
            base, prefix = os.path.join(self.root, "torch_compile_cache"), ""
        elif self.name == "flashinfer":
            base, prefix = os.path.join(self.root, "90a", "cached_ops"), "fused_moe_sm121_"
        else:
            base, prefix = self.root, ""
        try:
            names = os.listdir(base)
        except OSError:
            return []
        found = [n[len(prefix):] for n in names if n.startswith(prefix)]
        return sorted(x for x in found if x != h and os.path.isfile(os.path.join(self.path(x), "cache_key")))

    def fill(self, h: str) -> None:
        d = self.path(h)
        os.makedirs(d, exist_ok=True)
        # Small stand-in artifacts: the real ones are ~1-3 GB in all; what matters is presence.
        with open(os.path.join(d, "kernels.bin"), "wb") as f:
            f.write(hashlib.sha256(h.encode()).digest() * 256)
        with open(os.path.join(d, "cache_key"), "w", encoding="utf-8") as f:
            f.write(h + "\n")


def entries(h: str, mounts: set[str] | None = None,
            dirs: tuple[tuple[str, str, float], ...] = CACHE_DIRS) -> list[Entry]:
    """The cache directories mounted into this container, each warm or cold for hash `h`."""
    mounts = mount_points() if mounts is None else mounts
    out = []
    for name, root, share in dirs:
        if root in mounts:
            e = Entry(name, root, share, False)
            out.append(Entry(name, root, share, os.path.isfile(os.path.join(e.path(h), "cache_key"))))
    return out


def cold_seconds(pace: float, share: float) -> float:
    factor = float(os.environ.get("SIM_COLD_BOOT_FACTOR", DEFAULT_COLD_FACTOR))
    return max(0.0, pace * factor * share)


class StaleCache(RuntimeError):
    """A mounted cache holds kernels of another hash only: the error line vLLM's loader would end on."""

    def __init__(self, e: Entry, theirs: list[str], h: str) -> None:
        what = {"vllm": "torch_compile", "flashinfer": "FlashInfer JIT", "triton": "Triton"}[e.name]
        super().__init__(f"RuntimeError: stale {what} cache at {e.root}: its kernels were compiled for "
                         f"{', '.join(theirs[:3])}, this engine needs {h} (another image, checkpoint or "
                         f"kernel flags); wipe {e.root} and restart")
        self.entry = e


def stale(h: str, found: list[Entry]) -> StaleCache | None:
    """The first mounted cache that holds another hash's kernels and none of `h`'s."""
    for e in found:
        theirs = e.others(h)
        if theirs and not e.warm:
            return StaleCache(e, theirs, h)
    return None


async def load_or_compile(h: str, pace: float, log: Callable[[str, str], None], found: list[Entry] | None = None) -> None:
    """Load the mounted caches for kernel hash `h`, or compile (slowly) and fill them, logging
    the lines vLLM prints for each (`log(message, "file.py:line")`). Raises StaleCache (before
    anything is loaded or compiled) when a mounted cache holds only another hash's kernels."""
    found = entries(h) if found is None else found
    bad = stale(h, found)
    if bad is not None:
        raise bad
    for e in found:
        where = e.path(h)
        if e.warm:
            if e.name == "vllm":
                log("Directly load the compiled graph(s) for dynamic shape from the cache, took 0.84 s",
                    "backends.py:215")
            else:
                log(f"Loading JIT {e.name} kernels from {where}", "jit.py:118")
            continue
        t0 = time.monotonic()
        await asyncio.sleep(cold_seconds(pace, e.share))
        e.fill(h)
        took = time.monotonic() - t0
        if e.name == "vllm":
            log(f"Using cache directory: {where} for vLLM's torch.compile", "backends.py:641")
            log(f"Compiling a graph for dynamic shape takes {took:.2f} s", "backends.py:257")
        else:
            log(f"JIT-compiled {e.name} kernels into {where} in {took:.2f} s", "jit.py:131")
