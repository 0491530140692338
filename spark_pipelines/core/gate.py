"""The promotion gate: whether a benched node may serve. One verdict (`GateResult`) for the
isolated bench, a rollout's node and a newcomer joining the fleet, from the gates in order:
health, the PD-firmware wedge, a void bench, the tok/s floor, the MTP acceptance floor, quality,
then the fleet's baseline (its protocol, its quality, its tok/s). Each gate's own figure and
wording live beside its data (core.bench, core.quality); the order and the verdict live here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spark_pipelines.core import bench as bench_core
from spark_pipelines.core import protocol as bench_protocol
from spark_pipelines.core import quality as quality_core
from spark_pipelines.core.baseline import Baseline
from spark_pipelines.core.bench import acceptance_gate
from spark_pipelines.core.gpu import GpuVerdict


@dataclass(frozen=True)
class GateResult:
    """The one verdict every gate gives: a node's bench, a rollout's node, a newcomer joining."""

    node: str
    passed: bool
    gate: str  # "health" | "GPU wedge" | "bench void" | "bench floor" | "MTP acceptance" | "quality" | "baseline" | "passed"
    why: str

    def text(self) -> str:
        """The verdict as one line: what passed, or which gate stopped it and why."""
        return self.why if self.passed else f"the {self.gate} gate failed: {self.why}"


def judge(node: str, *, healthy: bool, health_why: str = "", mean_tok_s: float | None = None,
          acceptance: float | None = None, gpu_verdict: GpuVerdict | None = None, floor_tok_s: float = 0.0,
          floor_acceptance: float | None = None, baseline: Baseline | None = None,
          max_regression: float = 0.05, benched: bool = True, void: Sequence[str] = (),
          quality: quality_core.QualityReport | None = None, floor_quality: float | None = None,
          quality_noise: float = 0.0, protocol_key: str | None = None) -> GateResult:
    """The gates of one node in a wave, in order; the first that fails decides. A void bench
    (wedged GPU, foreign requests: core.baseline) proves nothing either way, so it does not pass.
    Quality: its deterministic checks and the floor (when set), then no drop below the baseline's
    beyond `quality_noise`. A baseline made under another bench protocol cannot be compared with
    (core.protocol): the gate cannot judge, so it fails, saying what to do."""
    if not healthy:
        return GateResult(node, False, "health", health_why or f"{node} did not become healthy on the new version")
    if not benched:
        return GateResult(node, True, "passed", "healthy (rollout without bench gate)")
    verdict = gpu_verdict or GpuVerdict(state="unknown", reasons=["GPU not sampled"])
    if verdict.state == "wedged":  # it voids the bench too, but the wedge is the verdict and its advice
        return GateResult(node, False, "GPU wedge", bench_core.tok_s_gate(mean_tok_s, floor_tok_s, verdict)[1])
    if void:
        return GateResult(node, False, "bench void", f"the bench does not count ({'; '.join(void)}): rerun the rollout "
                                                     f"once the cause is gone")
    promoted, why = bench_core.tok_s_gate(mean_tok_s, floor_tok_s, verdict)
    if not promoted:
        return GateResult(node, False, "bench floor", why)
    ok, acc_why = acceptance_gate(acceptance, floor_acceptance)
    if not ok:
        return GateResult(node, False, "MTP acceptance", acc_why)
    ok, q_why = quality_core.quality_gate(quality, floor_quality)
    if not ok:
        return GateResult(node, False, "quality", q_why)
    acc_why = f"{acc_why}; {q_why}"
    if baseline is not None and protocol_key != baseline.protocol:
        return GateResult(node, False, "baseline", protocol_mismatch(protocol_key, baseline))
    if baseline is not None and quality is not None:
        ok, qb_why = quality_core.quality_vs_baseline(quality.score, quality.suite, baseline.quality,
                                                      baseline.quality_suite, quality_noise)
        if not ok:
            return GateResult(node, False, "quality", qb_why)
    if baseline is not None and mean_tok_s is not None:
        # The fleet's spread on the previous version is noise, not a regression.
        allowed = min(baseline.low, baseline.tok_s * (1 - max_regression))
        if mean_tok_s < allowed:
            return GateResult(node, False, "baseline", (
                f"{mean_tok_s:.1f} tok/s is below the fleet's baseline ({baseline.text()}) by more than "
                f"{max_regression:.0%} and its spread: slower than the nodes that serve"))
        return GateResult(node, True, "passed", f"{why}; {acc_why}; vs baseline {baseline.tok_s:.1f} tok/s: "
                                                f"{mean_tok_s / baseline.tok_s:.2f}x")
    return GateResult(node, True, "passed", f"{why}; {acc_why}; no fleet baseline to compare with")


def protocol_mismatch(protocol_key: str | None, baseline: Baseline) -> str:
    """Why the baseline gate cannot judge a bench made under another protocol, and what to do: a
    gate that cannot compare holds the node (it never passes unjudged)."""
    _, p_why = bench_protocol.comparable(protocol_key, baseline.protocol)
    if protocol_key is not None and "not honoured" in protocol_key:
        todo = ("this version ignored the forced output length (vLLM's ignore_eos + min_tokens): its figure "
                "cannot be compared; serve a version that honours them, or set bench.force_output_length: "
                "false in the fleet file and bench every serving node again before the rollout")
    else:
        todo = ("bench every serving node again (bench_job) so the fleet's baseline is made under this "
                "protocol, then run the rollout again")
    return (f"the baseline gate cannot judge: {p_why} (this bench {protocol_key or 'unrecorded'}, the fleet's "
            f"baseline over {', '.join(baseline.nodes)} {baseline.protocol or 'unrecorded'}); {todo}")
