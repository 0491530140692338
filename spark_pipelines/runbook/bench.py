"""The isolated bench of one node: drained from the gateway, zero requests in flight, the GPU
sampled under load, then restored, or kept out when it fails its promotion gate. The drain keeps
a journal (runbook/journal.py): a bench whose run dies with its node drained is finished by the
next run on the node (the node put back where it was, or kept out by the verdict it recorded)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from spark_pipelines.resources.bench_client import BenchError, run_bench, run_quality
from spark_pipelines.core import baseline, gpu
from spark_pipelines.core import quality as quality_core
from spark_pipelines.core import bench as bench_core
from spark_pipelines.core.gate import GateResult, judge
from spark_pipelines.core import steps
from spark_pipelines.core.launch import CHECKPOINT_LABEL, KERNELS_LABEL
from spark_pipelines.core.fleet import Fleet, Node
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources import lease
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.state import ledger, markers
from spark_pipelines.runbook.deploy import labels_of
from spark_pipelines.resources.engine import api_root
from spark_pipelines.core.errors import first_line
from spark_pipelines.runbook.preflight import read_gpu
from spark_pipelines.runbook import versions
from spark_pipelines.runbook.journal import BENCH_JUDGED, claimed, journaled
from spark_pipelines.runbook.rotation import drained

BENCH_DRAIN = "bench"  # the drain note's reason (the run's id follows it)
# The quality suite's two passes take ~2 s on a healthy stand-in, ~30 s on one that never stops
# (garbage to max_tokens); a GB10 decoding ~52 tok/s needs about as long again.
QUALITY_MAX_S = 600
# Once a second: a bench phase can be seconds long (a fast node, a short suite), and a sample that
# falls between requests reads idle and describes nothing.
GPU_SAMPLE_EVERY_S = 1.0


class GpuSampler:
    """Reads the node's nvidia-smi while the bench drives load: the PD-firmware wedge only shows
    under load (runbook: "run nvidia-smi ... during load -- if <1000 MHz, cold-drain is required").
    A thread, because the bench client owns this thread's event loop."""

    def __init__(self, session: FleetSession, node: Node, every_s: float = GPU_SAMPLE_EVERY_S) -> None:
        self._s, self._node, self._every = session, node, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"gpu-sampler-{node.name}", daemon=True)
        self.readings: list[gpu.GpuReading] = []
        self.errors: list[str] = []

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.readings.append(read_gpu(self._s, self._node.name, timeout=20))
            except Exception as e:  # a sample lost must not fail the bench it watches
                self.errors.append(first_line(e))

    def verdict(self) -> gpu.GpuVerdict:
        v = gpu.judge_under_load(self.readings)
        if self.errors:
            v = gpu.GpuVerdict(state=v.state, reasons=[*v.reasons, f"{len(self.errors)} sample(s) unreadable: "
                                                       f"{self.errors[-1]}"])
        return v


@dataclass(frozen=True)
class Benched:
    """One isolated bench of a node and its gate's verdict (the bench_results asset, a rollout's
    bench gate and a newcomer's join all record it)."""

    report: Any  # bench_client.BenchReport
    mean: float | None
    loaded: float | None
    gpu_verdict: gpu.GpuVerdict
    acceptance: float | None
    record: baseline.BenchRecord
    waited_s: float
    samples: int
    quality: quality_core.QualityReport | None = None
    container: dict[str, Any] | None = None  # what was benched (docker inspect, read before the load)
    gate: GateResult | None = None  # None until judged, inside the bench while the node is out
    # What the bench did to the gateway, in order: (event, {node: why it is out}) for the callers'
    # records of the rotation ("drain spark2", then "restore spark2" or "keep out spark2").
    rotation: tuple[tuple[str, dict[str, str]], ...] = ()

    @property
    def promoted(self) -> bool:
        return self.gate is not None and self.gate.passed

    @property
    def reason(self) -> str:
        return self.gate.text() if self.gate is not None else "not judged"


def bench_node(session: FleetSession, gw: GatewayHost, node: Node, log: Any, *, run_id: str = "",
               against: baseline.Baseline | None = None) -> Benched:
    """Drain `node`, wait for zero requests in flight, run the fleet's suite with nvidia-smi
    sampled, judge it (`gate_of`: its floors and, with `against`, the fleet's baseline: a
    rollout's nodes, a newcomer) while the node is still out, record the verdict on the node and
    restore it, or keep it out when it fails: a node below its gate never serves a request. Holds
    the node's run lease. The returned Benched says what happened to the gateway (`rotation`)."""
    with claimed(session, node, "bench", log, run_id=run_id):  # dead runs' work finished first: bench what serves
        log.info(f"drain {node.name}: taking it out of the gateway for an isolated bench")
        reason = f"{BENCH_DRAIN} (run {run_id[:8] or '-'})"
        # idle=True: zero requests in flight before it measures, also on a node already out.
        with journaled(session, node.name, steps.PROC_BENCH, run_id, phase="draining",
                       was_in=node.name in gw.rotation(), drain_reason=reason) as j, \
                drained(gw, node.name, reason=reason, idle=True) as drain:
            rotation = [(f"drain {node.name}", {node.name: "drained for its bench"})] if drain.was_in else []
            if not drain.was_in:
                log.info(f"drain {node.name}: it was not in the gateway; it stays out unless it passes")
            log.info(f"drain {node.name}: out of rotation, zero requests in flight (waited {drain.waited_s or 0:g} s)")
            benched = measure(session, node, log, waited_s=drain.waited_s or 0.0)
            lease.check(session, node.name)  # a run whose lease ended records no verdict on the node
            gate = judge_and_record(session, node, benched, against, was_in=drain.was_in, run_id=run_id)
            drain.keep_out = not gate.passed and not (gate.gate == GATE_VOID and drain.was_in)
            j.try_update(phase=BENCH_JUDGED, facts={"keep_out": drain.keep_out, "reason": gate.text()[:300]})
            log.info(f"{'keep out' if drain.keep_out else 'restore'} {node.name}: {gate.text()}")
        rotation.append((f"keep out {node.name}", {node.name: gate.text()}) if drain.keep_out
                        else (f"restore {node.name}", {}))
    return replace(benched, gate=gate, rotation=tuple(rotation))


def measure(session: FleetSession, node: Node, log: Any, *, waited_s: float) -> Benched:
    """The suite, the quality phase and nvidia-smi under load on the drained node, as a record
    not yet judged. The container is read before the load: a frozen dockerd fails the bench
    before it measures."""
    fleet = session.fleet
    launch = fleet.launch_for(node)
    container = NodeDocker(session).inspect_container(node.name, launch.container_name)
    log.info(f"bench {node.name}: suite {fleet.bench.suite}, {fleet.bench.repeats} run(s) per phase "
             f"(+ warm-up), loaded phase {fleet.bench.loaded_concurrency} at once; nvidia-smi every {GPU_SAMPLE_EVERY_S:g} s")
    with GpuSampler(session, node) as sampler:
        report = run_bench(api_root(fleet, node), launch.served_model_name, suite=fleet.bench.suite,
                           concurrency=fleet.bench.loaded_concurrency, repeats=fleet.bench.repeats,
                           reference_mean_tok_s=fleet.bench.reference_tok_s,
                           ignore_eos=fleet.bench.force_output_length,
                           max_s=fleet.health.bench_max_s,  # past it, no bench any more (core.healing)
                           on_progress=lambda line: log.info(f"bench {node.name}: {line}"))
    quality = quality_phase(fleet, node, log)
    mean = report.recipe_mean_tok_s.median if report.recipe_mean_tok_s else None
    loaded = next((p.aggregate_tok_s.median for p in report.phases
                   if p.phase != bench_core.PHASE_RECIPE and p.aggregate_tok_s), None)
    verdict = sampler.verdict()
    acceptance = report.counters.acceptance_rate if report.counters is not None else None
    # wait_idle returned before the load: num_requests_running == 0 was read before the start.
    rec = baseline.record(
        node.name, time.time(), mean,
        baseline.identity_of(container, labels_of(container, markers.read_deploy(session, node)), sampler.readings,
                             launch_label=KERNELS_LABEL, checkpoint_label=CHECKPOINT_LABEL),
        baseline.load_conditions(sampler.readings, verdict.state, isolation_verified=True,
                                 counters_match=report.counters.tokens_match if report.counters else None,
                                 acceptance_rate=acceptance),
        protocol=(report.protocol or {}).get("key"),
        quality=quality.score if quality is not None else None,
        quality_suite=quality.suite if quality is not None else None)
    return Benched(report, mean, loaded, verdict, acceptance, rec, waited_s, len(sampler.readings), quality, container)


GATE_VOID = "bench void"


def judge_and_record(session: FleetSession, node: Node, benched: Benched, against: baseline.Baseline | None, *,
                     was_in: bool, run_id: str) -> GateResult:
    """The bench's verdict, recorded on the node: promoted lifts its bench (and gate) hold-outs
    and marks the version known good; held out says why in the ledger. A bench made void by
    somebody else's requests judged nothing: the node goes back where it was with its hold-outs
    as they were. One that saw the wedge judged the GPU: the gate holds the node out."""
    if benched.record.void and benched.gpu_verdict.state != "wedged":
        return GateResult(node.name, False, GATE_VOID, bench_core.void_verdict(benched.record.void, was_in=was_in))
    gate = gate_of(session.fleet, node, benched, against)
    if gate.passed:  # its gate too: a version deployed to await this bench
        ledger.lift(session, node.name, ledger.BY_BENCH, ledger.BY_GATE)
        versions.mark_known_good(session, node, benched.container, run_id=run_id)
    else:
        ledger.hold(session, node.name, ledger.BY_BENCH, gate.text(),
                    mean_tok_s=benched.mean, **({ledger.AGAINST_BASELINE: True} if against is not None else {}))
    return gate


def gate_of(fleet: Fleet, node: Node, benched: Benched, against: baseline.Baseline | None) -> GateResult:
    """The bench of `node` judged by its floors and against the fleet's baseline when given
    (core.gate.judge): the one gate of a bench, a rollout's node and a newcomer joining."""
    return judge(node.name, healthy=True, mean_tok_s=benched.mean, acceptance=benched.acceptance,
                 gpu_verdict=benched.gpu_verdict, floor_tok_s=fleet.bench_floor(node),
                 floor_acceptance=fleet.bench.floor_mtp_acceptance, baseline=against,
                 max_regression=fleet.rollout.max_regression, void=benched.record.void, quality=benched.quality,
                 floor_quality=fleet.bench.floor_quality, quality_noise=fleet.bench.quality_noise,
                 protocol_key=benched.record.protocol)


def quality_phase(fleet: Fleet, node: Node, log: Any) -> quality_core.QualityReport | None:
    """The quality suite on the drained node (after the speed phases: its short answers would
    only blur their figures). A server that cannot take it is reported, never a crash: a
    refused request scores 0 with its reason; an unreachable one skips the phase, saying why."""
    try:
        q = run_quality(api_root(fleet, node), fleet.launch_for(node).served_model_name, max_s=QUALITY_MAX_S,
                        on_progress=lambda line: log.info(f"bench {node.name}: {line}"))
    except BenchError as e:
        q = quality_core.QualityReport(quality_core.SUITE_VERSION, (), skipped=first_line(e))
    log.info(f"bench {node.name}: {q.text()}")
    return q
