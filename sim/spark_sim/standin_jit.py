"""The stand-in engine's JIT caches: a cold boot compiles and fills them, a warm boot loads them.

On a GB10 the first boot compiles torch.compile artifacts, FlashInfer and Triton kernels into the
three cache mounts (runbook: first boot 25-45 min, second 7-10). The stand-in models that inside
its container: for each cache directory that is a mount (never a directory of the machine it
runs on outside a container), it looks for the entries its own kernel hash names; missing ones
cost compile time and are written, present ones are loaded. Stdlib only: copied into the image
next to vllm_standin.py.
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


async def load_or_compile(h: str, pace: float, log: Callable[[str, str], None], found: list[Entry] | None = None) -> None:
    """Load the mounted caches for kernel hash `h`, or compile (slowly) and fill them, logging
    the lines vLLM prints for each (`log(message, "file.py:line")`)."""
    for e in entries(h) if found is None else found:
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
