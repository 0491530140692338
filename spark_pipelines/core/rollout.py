"""A new image or checkpoint reaches the fleet as a rollout: a canary first, then waves.

Pure planning and gating. The canary node goes alone; each later wave takes at most
`max_unavailable` nodes, so the gateway never holds fewer than N - max_unavailable of the nodes
that were serving (and never fewer than gateway.min_in_rotation). Every node of a wave must pass
the gates (healthy and serving the new deployment, then the bench against its floor, the MTP
acceptance floor and the fleet's baseline on the previous version) before the next wave starts.
A failed gate stops the rollout; the failed nodes go back to their previous deployment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from spark_pipelines.core import bench as bench_core
from spark_pipelines.core.baseline import Baseline
from spark_pipelines.core.bench import acceptance_gate
from spark_pipelines.core.gpu import GpuVerdict


class RolloutRefused(ValueError):
    """The rollout cannot start as asked; the message says why and what to change."""


@dataclass(frozen=True)
class Wave:
    index: int  # 0 is the canary
    nodes: tuple[str, ...]

    @property
    def canary(self) -> bool:
        return self.index == 0

    def label(self) -> str:
        return "canary" if self.canary else f"wave {self.index}"


@dataclass(frozen=True)
class RolloutPlan:
    waves: tuple[Wave, ...]
    skipped: Mapping[str, str]  # node -> why it is not part of this rollout
    max_unavailable: int
    floor_in_rotation: int  # the rotation never goes below this while the rollout runs

    def text(self) -> str:
        lines = [f"{w.label()}: {', '.join(w.nodes)}" for w in self.waves]
        lines += [f"skipped {n}: {why}" for n, why in self.skipped.items()]
        lines.append(f"at most {self.max_unavailable} node(s) out of the gateway at a time; "
                     f"the rotation keeps at least {self.floor_in_rotation}")
        return "\n".join(lines)


def plan_waves(nodes: Sequence[str], *, in_rotation: Sequence[str], max_unavailable: int = 1,
               min_in_rotation: int = 1, canary: str | None = None,
               skip: Mapping[str, str] | None = None) -> RolloutPlan:
    """Order the nodes into waves. `in_rotation`: the nodes serving through the gateway now (a
    node out of it costs the rotation nothing when it is redeployed, so it may join any wave
    beyond the max_unavailable count). `skip`: nodes kept out of the rollout (quarantined, ...)."""
    skip = dict(skip or {})
    targets = [n for n in nodes if n not in skip]
    if not targets:
        raise RolloutRefused("no node to roll out to" + (f" (skipped: {', '.join(skip)})" if skip else ""))
    if max_unavailable < 1:
        raise RolloutRefused(f"rollout.max_unavailable is {max_unavailable}: at least 1 node must be allowed out")
    serving = [n for n in in_rotation if n in nodes]
    floor = max(min_in_rotation, len(serving) - max_unavailable)
    room = len(serving) - floor  # serving nodes that may be out at once
    if serving and room < 1 and any(n in serving for n in targets):
        raise RolloutRefused(
            f"{len(serving)} node(s) serve ({', '.join(serving)}) and gateway.min_in_rotation is {min_in_rotation}: "
            f"taking one out for its deploy would leave fewer; add a node or lower gateway.min_in_rotation")
    first = canary or next((n for n in targets if n in serving), targets[0])
    if first not in targets:
        why = skip.get(first, "not a serve node of this fleet")
        raise RolloutRefused(f"rollout.canary {first!r} cannot be the canary: {why}")
    rest = [n for n in targets if n != first]
    waves = [Wave(0, (first,))]
    # Nodes out of the rotation go first after the canary: deploying them costs no capacity.
    rest.sort(key=lambda n: n in serving)
    wave: list[str] = []
    used = 0
    for n in rest:
        cost = 1 if n in serving else 0
        if wave and (len(wave) >= max_unavailable or used + cost > room):
            waves.append(Wave(len(waves), tuple(wave)))
            wave, used = [], 0
        wave.append(n)
        used += cost
    if wave:
        waves.append(Wave(len(waves), tuple(wave)))
    return RolloutPlan(tuple(waves), skip, max_unavailable, floor)


@dataclass(frozen=True)
class GateResult:
    node: str
    passed: bool
    gate: str  # "health" | "bench floor" | "MTP acceptance" | "baseline" | "passed"
    why: str


def judge(node: str, *, healthy: bool, health_why: str = "", mean_tok_s: float | None = None,
          acceptance: float | None = None, gpu_verdict: GpuVerdict | None = None, floor_tok_s: float = 0.0,
          floor_acceptance: float | None = None, baseline: Baseline | None = None,
          max_regression: float = 0.05, benched: bool = True) -> GateResult:
    """The gates of one node in a wave, in order; the first that fails decides."""
    if not healthy:
        return GateResult(node, False, "health", health_why or f"{node} did not become healthy on the new version")
    if not benched:
        return GateResult(node, True, "passed", "healthy (rollout without bench gate)")
    verdict = gpu_verdict or GpuVerdict(state="unknown", reasons=["GPU not sampled"])
    promoted, why = bench_core.promotion_gate(mean_tok_s, floor_tok_s, verdict)
    if not promoted:
        return GateResult(node, False, "bench floor", why)
    ok, acc_why = acceptance_gate(acceptance, floor_acceptance)
    if not ok:
        return GateResult(node, False, "MTP acceptance", acc_why)
    if baseline is not None and mean_tok_s is not None:
        # The fleet's spread on the previous version is noise, not a regression.
        allowed = min(baseline.low, baseline.tok_s * (1 - max_regression))
        if mean_tok_s < allowed:
            return GateResult(node, False, "baseline", (
                f"{mean_tok_s:.1f} tok/s is below the fleet's baseline on the previous version "
                f"({baseline.text()}) by more than {max_regression:.0%} and its spread: the new version is slower"))
        return GateResult(node, True, "passed", f"{why}; {acc_why}; vs baseline {baseline.tok_s:.1f} tok/s: "
                                                f"{mean_tok_s / baseline.tok_s:.2f}x")
    return GateResult(node, True, "passed", f"{why}; {acc_why}; no baseline on the previous version to compare with")
