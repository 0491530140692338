"""Preflight: what must hold on a node before a launch, judged from observations.

The shell (resources) gathers observations with read-only commands; this module decides. Each
check carries the runbook's reason and the operator's next step, so a refused deploy says why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spark_pipelines.core.memory import RESIDUE_PER_FAILURE_GIB, MemoryGate, memory_gate

# Exporters hold a CUDA context (~9 GiB for nvidia_gpu_exporter) and must be stopped before
# launch so the memory check sees the real free memory; restarted once the node is healthy.
EXPORTER_CONTAINERS = ("nvidia_gpu_exporter", "node_exporter")
# "Stop monitoring exporters during deployment (re-enable after)": the host's node exporter too
# (`sudo systemctl stop`), started again on every path like the containers.
EXPORTER_UNITS = ("prometheus-node-exporter",)

Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Observations:
    """Read-only facts gathered from one node."""

    free_gib: float | None  # CUDA free memory from mem_get_info in a fresh container; None = unknown
    total_gib: float | None
    gpu_state: str  # healthy | idle | wedged | unknown (core.gpu verdict)
    gpu_holder_pids: list[int]  # PIDs holding /dev/nvidia* (fuser)
    persistenced_pids: list[int]
    earlyoom_installed: bool
    running_exporters: list[str]
    disk_free_gib: float
    page_cache_flushed: bool


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass(frozen=True)
class PreflightReport:
    node: str
    checks: list[Check]
    memory: MemoryGate | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    @property
    def verdict(self) -> str:
        if not self.passed:
            return "blocked"
        return "ready (with warnings)" if any(c.status == "warn" for c in self.checks) else "ready"

    def failures(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]

    def explain(self) -> str:
        lines = [f"preflight {self.node}: {self.verdict}"]
        for c in self.checks:
            if c.status != "ok":
                lines.append(f"  [{c.status}] {c.name}: {c.detail}" + (f" -> {c.fix}" if c.fix else ""))
        return "\n".join(lines)


# What each check of `evaluate` verifies, in its order (`spark-pipelines plan` lists these).
CHECKS: tuple[tuple[str, str], ...] = (
    ("gpu", "GPU state not wedged (nvidia-smi)"),
    ("gpu-holders", "only nvidia-persistenced holds /dev/nvidia* (fuser)"),
    ("earlyoom", "earlyoom absent"),
    ("exporters", f"exporters stopped ({', '.join((*EXPORTER_CONTAINERS, *EXPORTER_UNITS))})"),
    ("disk", "disk space in $HOME"),
    ("page-cache", "page cache flushed (sync; echo 3 > /proc/sys/vm/drop_caches)"),
    ("memory", "free CUDA memory >= GMU x total"),
)
# Only for a node quarantined for residue (runbook/quarantine.py), after the checks above.
RESIDUE_CHECK = ("residue", "free CUDA memory back at the clean-boot baseline (a residue quarantine)")


CLEAN_BOOT_CHECK = "clean boot"


def evaluate(
    node: str,
    obs: Observations,
    *,
    gmu: float,
    max_gmu: float,
    profile_total_gib: float,
    min_disk_gib: float,
    residue_baseline_gib: float | None = None,
    measured_baseline_gib: float | None = None,
) -> PreflightReport:
    """`residue_baseline_gib`: the node is quarantined for residue; refuse until free memory is
    back at this clean-boot baseline (less than one failed start's residue below it is noise).
    `measured_baseline_gib`: the node's own memcheck after its Phase 0 reboot; a drop below it by
    more than one failed start's residue is said (residue accumulates above the baseline)."""
    checks: list[Check] = []

    if obs.gpu_state == "wedged":
        checks.append(
            Check(
                "gpu",
                "fail",
                "GPU matches the PD-firmware wedge signature (clock pinned <1 GHz, <15 W, no throttle reason)",
                "capture evidence, then AC cold-drain: poweroff, unplug the brick 90-120 s, power on",
            )
        )
    elif obs.gpu_state == "unknown":
        checks.append(Check("gpu", "warn", "nvidia-smi state could not be classified"))
    else:
        checks.append(Check("gpu", "ok", f"GPU {obs.gpu_state}"))

    unexpected = sorted(set(obs.gpu_holder_pids) - set(obs.persistenced_pids))
    if unexpected:
        checks.append(
            Check(
                "gpu-holders",
                "fail",
                f"PIDs holding the GPU device besides nvidia-persistenced: {unexpected}",
                "stop those processes (docker stop/rm stale containers); if they persist, reboot to clear CUDA context",
            )
        )
    else:
        checks.append(Check("gpu-holders", "ok", "only nvidia-persistenced holds the GPU device"))

    if obs.earlyoom_installed:
        checks.append(
            Check("earlyoom", "fail", "earlyoom is installed: it SIGKILLs EngineCore during the warmup memory spike",
                  "sudo apt purge earlyoom")
        )
    else:
        checks.append(Check("earlyoom", "ok", "earlyoom absent"))

    if obs.running_exporters:
        checks.append(
            Check(
                "exporters",
                "fail",
                f"exporters running: {', '.join(obs.running_exporters)} (nvidia_gpu_exporter holds ~9 GiB of CUDA context)",
                "stop them before launch; restart after the node is healthy",
            )
        )
    else:
        checks.append(Check("exporters", "ok", "no exporter holds the GPU"))

    need = min_disk_gib
    if obs.disk_free_gib < need:
        checks.append(
            Check("disk", "fail", f"{obs.disk_free_gib:.0f} GiB free in $HOME, need ~{need:.0f} GiB",
                  "free space (old checkpoints, dangling images: docker image prune)")
        )
    else:
        checks.append(Check("disk", "ok", f"{obs.disk_free_gib:.0f} GiB free"))

    checks.append(
        Check("page-cache", "ok", "page cache flushed")
        if obs.page_cache_flushed
        else Check("page-cache", "fail", "page cache not flushed: crashed runs leave it at the memory ceiling",
                   "sudo sh -c 'sync; echo 3 > /proc/sys/vm/drop_caches' (needs the sudoers line)")
    )

    gate = None
    if obs.free_gib is None:
        checks.append(Check("memory", "fail", "free CUDA memory could not be read (nvidia-smi reports none on GB10)",
                            "run the memcheck container (torch.cuda.mem_get_info) on the node by hand"))
    else:
        total = obs.total_gib or profile_total_gib
        gate = memory_gate(obs.free_gib, total, gmu, max_gmu)
        status: Status = {"pass": "ok", "tight": "warn", "fail": "fail"}[gate.verdict]
        checks.append(Check("memory", status, gate.summary(), "; ".join(gate.advice)))
    if residue_baseline_gib is not None and obs.free_gib is not None:
        if obs.free_gib < residue_baseline_gib - RESIDUE_PER_FAILURE_GIB[0]:
            checks.append(Check(
                RESIDUE_CHECK[0], "fail",
                f"quarantined for residue and free CUDA memory {obs.free_gib:.2f} GiB is still below the "
                f"clean-boot baseline {residue_baseline_gib:.2f} GiB",
                "reboot the node (sudo reboot; cut AC power 90-120 s if free memory stays below the baseline), "
                "flush the page cache, then redeploy"))
        else:
            checks.append(Check(RESIDUE_CHECK[0], "ok", f"free CUDA memory {obs.free_gib:.2f} GiB is back at the "
                                                        f"clean-boot baseline {residue_baseline_gib:.2f} GiB"))
    if measured_baseline_gib is not None and obs.free_gib is not None:
        drop = measured_baseline_gib - obs.free_gib
        if drop > RESIDUE_PER_FAILURE_GIB[0]:
            checks.append(Check(
                CLEAN_BOOT_CHECK, "warn",
                f"free CUDA memory {obs.free_gib:.2f} GiB is {drop:.2f} GiB below this node's measured clean boot "
                f"{measured_baseline_gib:.2f} GiB: residue of failed starts (lesson 11)",
                "a reboot clears it (an AC power cut if it stays)"))
        else:
            checks.append(Check(CLEAN_BOOT_CHECK, "ok", f"free CUDA memory {obs.free_gib:.2f} GiB is at this node's "
                                                        f"measured clean boot {measured_baseline_gib:.2f} GiB"))
    return PreflightReport(node=node, checks=checks, memory=gate)
