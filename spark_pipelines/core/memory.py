"""The preflight memory gate: will vLLM's request_memory() check pass on this node right now?

vLLM refuses to start when free CUDA memory < GMU x CUDA-visible total. On GB10 nvidia-smi reports
no memory at all, so `free` must come from `torch.cuda.mem_get_info()` in a fresh container or from
vLLM's own startup log. The advice carries the 2026-06-18 lesson: a shortfall is residue (reboot),
never a reason to lower GMU to 0.80.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spark_pipelines.core.fleet import MIN_GMU

# Below this margin the launch passes the check but any allocation during model load can tip it
# over (the runbook's "startup fragility" of 0.90 GMU).
TIGHT_MARGIN_GIB = 2.0
# Each failed launch leaves 1-9 GiB of CUDA context residue that `docker rm` cannot clear.
RESIDUE_PER_FAILURE_GIB = (1.0, 9.0)
Verdict = Literal["pass", "tight", "fail"]


@dataclass(frozen=True)
class MemoryGate:
    free_gib: float
    total_gib: float
    gmu: float
    required_gib: float
    margin_gib: float
    verdict: Verdict
    advice: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.verdict != "fail"

    def summary(self) -> str:
        return (
            f"free {self.free_gib:.2f} GiB vs {self.gmu:g} x {self.total_gib:.2f} = {self.required_gib:.2f} GiB "
            f"(margin {self.margin_gib:+.2f} GiB): {self.verdict}"
        )


def memory_gate(free_gib: float, total_gib: float, gmu: float, max_gmu: float = 1.0) -> MemoryGate:
    """Compare free memory with what `--gpu-memory-utilization gmu` will ask for."""
    if not 0 < total_gib:
        raise ValueError(f"total_gib must be positive, got {total_gib}")
    if free_gib < 0:
        raise ValueError(f"free_gib cannot be negative, got {free_gib}")
    required = round(gmu * total_gib, 2)
    margin = round(free_gib - required, 2)
    advice: list[str] = []
    if gmu > max_gmu:
        advice.append(f"GMU {gmu:g} is above this hardware's max {max_gmu:g}; use {min(0.85, max_gmu):g}")
    if gmu <= MIN_GMU:
        advice.append(f"GMU {gmu:g} passes this check but OOMs in CUDA graph capture; use 0.85 on a clean boot")
    if margin < 0:
        verdict: Verdict = "fail"
        advice += [
            f"free memory is {-margin:.2f} GiB short of {required:.2f} GiB: vLLM will refuse to start "
            "('Free memory on device ... less than desired GPU memory utilization')",
            "stop GPU holders first: nvidia_gpu_exporter holds ~9 GiB, leftover vLLM containers hold their context",
            "if nothing holds the GPU, this is CUDA residue from failed launches (1-9 GiB each): reboot the node "
            "(sudo reboot), flush the page cache, and rerun the preflight; if a reboot does not restore the "
            "baseline, cut AC power for 90-120 s (GB10 keeps CUDA state on 5VSB standby)",
            "do NOT lower GMU to 0.80: it passes this check but EngineCore is OOM-killed in CUDA graph capture",
        ]
    elif margin < TIGHT_MARGIN_GIB or gmu > max_gmu:
        verdict = "tight"
        advice.append(
            f"only {margin:.2f} GiB above the request: any allocation during model load can fail the start; "
            "flush the page cache and stop exporters right before launch"
        )
    else:
        verdict = "pass"
    return MemoryGate(free_gib, total_gib, gmu, required, margin, verdict, advice)
