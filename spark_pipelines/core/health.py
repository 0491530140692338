"""One probe, one verdict per node: what a health sweep read -> the runbook's verdict.

Pure judgement over plain observations (`Observation`, filled by `runbook.sweep`): SSH
reachability, nvidia-smi (`core.gpu`), the serving container's `docker inspect` state, its log
tail (`core.diagnosis`), /health and /metrics, and the node's last benches. Every verdict carries
the evidence that decided it and the runbook's advice. When the evidence does not decide, the
verdict is `unknown` and says what is missing: a verdict is never guessed.

Order of judgement, most specific first: unreachable (nothing else can be read) -> residue
(relaunching cannot help) -> crash-loop -> engine-down -> starting -> wedged -> regressed -> healthy.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from spark_pipelines.core import bench, diagnosis, gpu
from spark_pipelines.core.memory import RESIDUE_PER_FAILURE_GIB

VerdictName = Literal[
    "healthy", "starting", "engine-down", "crash-loop", "residue", "wedged", "regressed", "unreachable", "unknown"
]
VERDICTS: tuple[VerdictName, ...] = (
    "healthy", "starting", "engine-down", "crash-loop", "residue", "wedged", "regressed", "unreachable", "unknown"
)
# Every other verdict asks a person (or a policy) to act.
NO_ACTION: frozenset[str] = frozenset({"healthy", "starting"})

# Runbook Phase 4: "First boot: ~25-45 min (weights + JIT + graph capture). Second boot: ~7-10 min."
FIRST_BOOT_MAX_S = 45 * 60
WARM_BOOT_MAX_S = 10 * 60
# "SSH will become unresponsive during CUDA graph compilation ... Do not hard-reset unless it
# exceeds 30 minutes."
SSH_SILENT_DURING_CAPTURE_MAX_S = 30 * 60
# Lesson 5 / table: "Node SSH-unreachable for >10 min: hard-reset the node, don't wait."
SSH_DEAD_HARD_RESET_S = 10 * 60
# Restarts seen in one read that make a loop even without an earlier read to compare with.
CRASH_LOOP_RESTARTS = 3
# A start whose log holds these is a failed start; warnings (attention backend, ...) are not.
_FATAL = (diagnosis.Severity.ERROR, diagnosis.Severity.CRITICAL)
# A bench history needs at least this many earlier benches to have a spread to compare against.
MIN_BENCH_HISTORY = 2
# docker's exit code for SIGKILL: the OOM killer's (or earlyoom's) signature.
SIGKILL_EXIT = 137
# One vLLM start begins with this line (0.19 through 0.32 print it once per start).
_START_LINE = re.compile(r"non-default args:")

ADVICE: dict[str, str] = {
    "healthy": "nothing to do",
    "starting": "wait: a first boot takes 25-45 min (weights + JIT + graph capture), a warm one 7-10; SSH may "
    "not answer for up to 30 min during graph capture; do not hard-reset inside that window",
    "engine-down": "redeploy the node (deploy_node_job for this partition); read the container log's diagnosis "
    "first; do NOT lower GMU to 0.80/0.78",
    "crash-loop": "stop relaunching: docker rm -f the container, then reboot the node (sudo reboot) to clear the "
    "CUDA residue each failed start leaves, flush the page cache, fix the failure the log names, then redeploy",
    "residue": "relaunching cannot help: the node is residue-degraded (CUDA context residue docker rm cannot "
    "clear). Reboot it (sudo reboot; cut AC power 90-120 s if free memory stays below the baseline), flush the "
    "page cache (sync; echo 3 > /proc/sys/vm/drop_caches), then redeploy",
    "wedged": "PD-firmware wedge: keep the node out of the gateway, capture the evidence (nvidia-smi -q, "
    "clocks, power, throttle reasons, dmesg, container log), stop vLLM, sudo poweroff, unplug the power brick "
    "at the wall 90-120 s, power on, then rerun the bench",
    "regressed": "slower than its own bench history at full clock, so not the wedge: the runbook's second check "
    "is a stale torch_compile cache (~/.cache/vllm): redeploy the node with a fresh JIT cache (deploy_node_job, "
    "config fresh_jit_cache: true, which sets the stale one aside), then rerun the bench",
    "unreachable": "SSH does not answer: re-probe; once it has been dead for 10 min hard-reset the node, do not "
    "wait (nodes in OOM-kill loops do not recover gracefully; JIT cache volumes survive the reset)",
    "unknown": "the probe could not decide: read the evidence, fix what could not be read, probe again",
}


# ------------------------------------------------------------------ observations


@dataclass(frozen=True)
class ContainerState:
    """The serving container as `docker inspect` reported it (exists=False: no such container)."""

    exists: bool
    status: str | None = None  # created | running | restarting | paused | exited | dead
    running: bool = False
    restarting: bool = False
    restart_count: int = 0
    exit_code: int | None = None
    oom_killed: bool = False
    error: str | None = None
    started_at: float | None = None  # epoch seconds of the current (or last) start
    finished_at: float | None = None  # epoch seconds it last stopped; None while it never did


def _docker_time(raw: Any) -> float | None:
    """docker's RFC 3339 nanosecond stamps; its zero time means "never"."""
    if not isinstance(raw, str) or not raw or raw.startswith("0001-01-01"):
        return None
    text = raw.strip().replace("Z", "+00:00")
    match = re.match(r"^(?P<base>[^.+]+)(?:\.(?P<frac>\d+))?(?P<tz>[+-]\d\d:\d\d)?$", text)
    if match is None:
        return None
    frac = (match.group("frac") or "0")[:6].ljust(6, "0")
    try:
        when = dt.datetime.fromisoformat(f"{match.group('base')}.{frac}{match.group('tz') or '+00:00'}")
    except ValueError:
        return None
    return when.timestamp()


def container_state(inspect: Mapping[str, Any] | None) -> ContainerState:
    """One element of `docker inspect`'s JSON array (None: docker said "No such container")."""
    if inspect is None:
        return ContainerState(exists=False)
    state = inspect.get("State") or {}
    exit_code = state.get("ExitCode")
    return ContainerState(
        exists=True,
        status=state.get("Status"),
        running=bool(state.get("Running")),
        restarting=bool(state.get("Restarting")),
        restart_count=int(inspect.get("RestartCount") or 0),
        exit_code=None if exit_code is None else int(exit_code),
        oom_killed=bool(state.get("OOMKilled")),
        error=state.get("Error") or None,
        started_at=_docker_time(state.get("StartedAt")),
        finished_at=_docker_time(state.get("FinishedAt")),
    )


@dataclass(frozen=True)
class BenchHistory:
    """The node's benches, oldest first; the last entry is the latest bench."""

    tok_s: tuple[float, ...] = ()
    acceptance: tuple[float, ...] = ()  # MTP accepted / drafted per bench
    latest_gpu_state: str | None = None  # the latest bench's GPU verdict under load (core.gpu state)


@dataclass(frozen=True)
class DeployInFlight:
    """A deploy journal found on the node (runbook.deploy): a deploy that began and did not end.
    `lease_held`: whether a process holds the node's run lease now (None: could not tell). A
    journal whose lease is free is a dead run's: the next deploy finishes it."""

    run_id: str
    phase: str
    started: str | None = None
    owner: str | None = None
    lease_held: bool | None = None

    @property
    def dead(self) -> bool:
        return self.lease_held is False

    def describe(self) -> str:
        who = f"the deploy of run {self.run_id[:8] or '-'} ({self.owner or 'owner unknown'}, started {self.started or '?'})"
        if self.dead:
            return f"{who} died in phase {self.phase}: its journal is on the node and its node lease ended"
        if self.lease_held:
            return f"{who} is in progress (phase {self.phase}; it holds the node's lease)"
        return f"{who} left its journal (phase {self.phase}); whether it still runs could not be read"


@dataclass(frozen=True)
class Observation:
    """What one probe of one node read. None = not read (the matching *_error says why)."""

    node: str
    probed_at: float  # epoch seconds
    ssh_ok: bool
    ssh_error: str | None = None
    ssh_refused: bool = False  # the node answered but refused us (host key, auth): not a dead node
    clean_boot_free_gib: float | None = None  # node_os's measured clean boot, else the profile's
    gpu: gpu.GpuReading | None = None
    gpu_error: str | None = None
    container: ContainerState | None = None
    container_error: str | None = None
    # `<name>-previous`, read only when the serving container is absent: a deploy keeps the old
    # deployment aside under that name until the new one is healthy.
    previous_container: ContainerState | None = None
    log_tail: str | None = None
    health_ok: bool | None = None
    health_error: str | None = None
    metrics: Mapping[str, float] | None = None
    metrics_error: str | None = None
    free_gib: float | None = None  # CUDA-visible free memory, when something measured it with no engine up
    bench: BenchHistory | None = None
    warm_start: bool | None = None  # JIT caches present: the 7-10 min boot, not the 25-45 min one
    deploy_journal: DeployInFlight | None = None  # a deploy that began and did not end
    lease_held: bool | None = None  # whether a run holds the node's lease now (None: not read)
    # What earlier sweeps knew (a sensor's cursor); a one-shot doctor leaves them None.
    ssh_dead_since: float | None = None
    last_started_at: float | None = None
    previous_restart_count: int | None = None
    # When a sweep last saw /health answer (epoch; carried by with_earlier): an engine that served
    # after its launch started is past its graph capture, so dead SSH then is not a boot.
    served_at: float | None = None


@dataclass(frozen=True)
class NodeVerdict:
    node: str
    verdict: VerdictName
    evidence: tuple[str, ...]
    advice: str

    @property
    def needs_action(self) -> bool:
        return self.verdict not in NO_ACTION

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "evidence": list(self.evidence), "advice": self.advice}


def _verdict(obs: Observation, name: VerdictName, evidence: Sequence[str], advice: str | None = None) -> NodeVerdict:
    return NodeVerdict(obs.node, name, tuple(e for e in evidence if e), advice or ADVICE[name])


# ------------------------------------------------------------------ log reading


@dataclass(frozen=True)
class Start:
    """One vLLM start in a container's log (a restarted container's log holds every start)."""

    text: str
    findings: tuple[diagnosis.Finding, ...]
    readiness: diagnosis.Readiness

    @property
    def failures(self) -> tuple[diagnosis.Finding, ...]:
        return tuple(f for f in self.findings if f.signature.severity in _FATAL)

    @property
    def failure_signature(self) -> str | None:
        """The first fatal finding's id: what "the same failure on consecutive starts" compares."""
        return self.failures[0].signature.id if self.failures else None

    def finding(self, signature_id: str) -> diagnosis.Finding | None:
        return next((f for f in self.findings if f.signature.id == signature_id), None)


def starts(log_text: str) -> list[Start]:
    """Split a container log into its vLLM starts, each diagnosed on its own."""
    chunks: list[list[str]] = [[]]
    for line in log_text.splitlines():
        if _START_LINE.search(line) and any(_START_LINE.search(x) for x in chunks[-1]):
            chunks.append([])
        chunks[-1].append(line)
    out = []
    for lines in chunks:
        text = "\n".join(lines)
        if text.strip():
            out.append(Start(text, tuple(diagnosis.diagnose(text)), diagnosis.milestones(text)))
    return out


def _quote(finding: diagnosis.Finding) -> str:
    return f"log line {finding.line_number}: {finding.line[:160]}"


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min"


# ------------------------------------------------------------------ the verdicts


def unreachable(obs: Observation) -> NodeVerdict | None:
    """SSH dead: starting inside the graph-capture window of a known launch, else unreachable."""
    if obs.ssh_ok:
        return None
    evidence = [f"SSH: {obs.ssh_error or 'no session'}"]
    if obs.ssh_refused:
        return _verdict(obs, "unknown", [*evidence, "no session for a reason of the fleet file or the credentials "
                                                    "(host key, key, user, host name): not a dead node"],
                        "fix what the SSH error names (key, user, known_hosts entry or host), then probe again; "
                        "never a reset for this")
    if obs.health_ok:
        evidence.append("/health still answers 200: vLLM serves, but the node cannot be inspected or managed")
    dead_for = None if obs.ssh_dead_since is None else obs.probed_at - obs.ssh_dead_since
    since_launch = None if obs.last_started_at is None else obs.probed_at - obs.last_started_at
    served_since_launch = (obs.served_at is not None and obs.last_started_at is not None
                           and obs.served_at >= obs.last_started_at)
    if served_since_launch:
        evidence.append(f"its engine served {_minutes(obs.probed_at - obs.served_at)} ago, after its launch: "
                        "not a boot's graph capture")
    elif since_launch is not None and 0 <= since_launch <= SSH_SILENT_DURING_CAPTURE_MAX_S and not obs.health_ok:
        evidence.append(f"a launch started {_minutes(since_launch)} ago: SSH may not answer during CUDA graph "
                        f"capture for up to {_minutes(SSH_SILENT_DURING_CAPTURE_MAX_S)}")
        return _verdict(obs, "starting", evidence)
    if dead_for is not None and dead_for >= SSH_DEAD_HARD_RESET_S:
        evidence.append(f"SSH dead for {_minutes(dead_for)} (>= {_minutes(SSH_DEAD_HARD_RESET_S)})")
        return _verdict(obs, "unreachable", evidence,
                        "hard-reset the node now, do not wait (runbook: SSH-unreachable for >10 min; "
                        "nodes in OOM-kill loops do not recover gracefully; JIT cache volumes survive the reset)")
    if dead_for is not None:
        evidence.append(f"SSH dead for {_minutes(dead_for)} so far")
    return _verdict(obs, "unreachable", evidence)


def _free_memory(obs: Observation, current: Start | None) -> tuple[float | None, str]:
    """Free CUDA memory with its source, only where it means something (no engine holding it)."""
    if current is not None:
        f = current.finding("free-memory-below-gmu")
        if f is not None:
            raw = f.values.get("free_gib") or f.values.get("free_gib_short")
            if raw is not None:
                return float(raw), _quote(f)
    if obs.free_gib is not None:
        return obs.free_gib, "measured with no engine running"
    engine_up = obs.container is not None and obs.container.exists and obs.container.running
    if not engine_up and obs.gpu is not None and obs.gpu.memory_free_mib is not None:
        return round(obs.gpu.memory_free_mib / 1024, 2), "nvidia-smi memory.free with no engine running"
    return None, ""


def residue(obs: Observation, runs: Sequence[Start]) -> NodeVerdict | None:
    """`num_gpu_blocks=0 ... override=512` then a silent EngineCore death, or free memory below the
    profile's clean baseline (lesson 11): relaunching cannot help."""
    c = obs.container
    serving = c is not None and c.exists and c.running and bool(obs.health_ok)
    for i, run in enumerate(runs if not serving else ()):
        blocks = run.finding("kv-blocks-zero")
        if blocks is None:
            continue
        death = run.finding("residue-degraded")
        later_start = i < len(runs) - 1  # the container was started again: this start died
        is_last = i == len(runs) - 1
        killed = (is_last and c is not None and c.exists and not c.running
                  and (c.exit_code == SIGKILL_EXIT or c.oom_killed))
        if death is None and not later_start and not killed:
            continue
        evidence = [_quote(blocks)]
        if death is not None:
            evidence.append(_quote(death))
        elif killed and c is not None:
            oom = " (OOMKilled)" if c.oom_killed else ""
            evidence.append(f"then the container exited with code {c.exit_code}{oom} and no traceback: "
                            "silent EngineCore death")
        else:
            evidence.append("then the engine died silently and the container started again")
        if len(runs) > 1:
            evidence.append(f"start {i + 1} of {len(runs)} in the container log")
        return _verdict(obs, "residue", evidence)

    current = runs[-1] if runs else None
    if serving or obs.clean_boot_free_gib is None:
        return None
    free, source = _free_memory(obs, current)
    tolerance = RESIDUE_PER_FAILURE_GIB[0]  # less than one failed start's residue is noise
    if free is not None and free < obs.clean_boot_free_gib - tolerance:
        return _verdict(obs, "residue", [
            f"free memory {free:.2f} GiB is below the clean-boot baseline "
            f"{obs.clean_boot_free_gib:.2f} GiB ({source})",
        ])
    return None


def crash_loop(obs: Observation, runs: Sequence[Start]) -> NodeVerdict | None:
    """Restarts climbing, or the same failure signature on consecutive starts."""
    c = obs.container
    if c is None or not c.exists:
        return None
    evidence = []
    failed = [r.failure_signature for r in runs]
    if len(failed) >= 2 and failed[-1] is not None and failed[-1] == failed[-2]:
        repeats = 1
        while repeats < len(failed) and failed[-1 - repeats] == failed[-1]:
            repeats += 1
        evidence.append(f"the same failure on {repeats} consecutive starts: {failed[-1]} "
                        f"({_quote(runs[-1].failures[0])})")
    climbing = obs.previous_restart_count is not None and c.restart_count > obs.previous_restart_count
    if climbing:
        evidence.append(f"restart count climbing: {obs.previous_restart_count} -> {c.restart_count}")
    if c.restarting:
        evidence.append(f"docker is restarting the container (restart count {c.restart_count})")
    elif c.restart_count >= CRASH_LOOP_RESTARTS and not obs.health_ok:
        evidence.append(f"restarted {c.restart_count} times and not serving")
    if not evidence:
        return None
    if runs and runs[-1].failures:
        f = runs[-1].failures[0]
        evidence.append(f"cause: {f.signature.cause}; fix: {f.signature.fix}")
    return _verdict(obs, "crash-loop", evidence)


def _describe_exit(c: ContainerState) -> str:
    parts = [f"container {c.status or 'not running'}"]
    if c.exit_code is not None:
        parts.append(f"exit code {c.exit_code}")
    if c.oom_killed:
        parts.append("OOMKilled")
    if c.error:
        parts.append(f"error {c.error!r}")
    return ", ".join(parts)


def _diagnosis_evidence(current: Start | None) -> list[str]:
    if current is None or not current.failures:
        return []
    f = current.failures[0]
    return [f"{f.signature.id}: {_quote(f)}", f"cause: {f.signature.cause}; fix: {f.signature.fix}"]


def engine_down_or_starting(obs: Observation, runs: Sequence[Start]) -> NodeVerdict | None:
    """Container gone or exited, or /health failing: engine-down, unless a start is still inside
    the runbook's boot window."""
    c = obs.container
    current = runs[-1] if runs else None
    if c is None:
        if obs.health_ok is False:
            return _verdict(obs, "unknown", [
                f"/health fails ({obs.health_error or 'no answer'})",
                f"the container could not be inspected ({obs.container_error or 'not read'}): "
                "cannot tell a start in progress from a dead engine",
            ])
        return None
    if not c.exists:
        evidence = ["the serving container does not exist",
                    f"/health: {'200' if obs.health_ok else obs.health_error or 'no answer'}"]
        prev = obs.previous_container
        journal = obs.deploy_journal
        if journal is not None and journal.dead:
            return _verdict(obs, "engine-down", [*evidence, journal.describe()],
                            "a deploy was interrupted: deploy_node_job for this node (the health sweep requests it) "
                            "finishes it: the previous deployment back, or the verified new one committed")
        if prev is not None and prev.exists and not prev.running:
            aside = None if prev.finished_at is None else obs.probed_at - prev.finished_at
            if aside is not None and 0 <= aside <= FIRST_BOOT_MAX_S:
                return _verdict(obs, "starting", [*evidence, f"a deploy is in progress: the previous deployment "
                                                             f"was set aside {_minutes(aside)} ago"])
            evidence.append("a deploy set the previous deployment aside "
                            + (f"{_minutes(aside)} ago" if aside is not None else "at an unknown time")
                            + " and never finished")
            return _verdict(obs, "engine-down", evidence,
                            "a deploy was interrupted: rerun it (deploy_node_job for this partition), which puts the "
                            "previous deployment back if the new one does not come up")
        return _verdict(obs, "engine-down", evidence)
    if not c.running and not c.restarting:
        return _verdict(obs, "engine-down", [_describe_exit(c), *_diagnosis_evidence(current)])
    if obs.health_ok:
        return None
    if obs.health_ok is None:
        return _verdict(obs, "unknown", [f"/health not probed ({obs.health_error or 'no result'})"])
    evidence = [f"/health fails ({obs.health_error or 'no answer'})"]
    # kv-blocks-zero alone is not a death yet: vLLM goes on with the override (lesson 11).
    died = [f for f in current.failures if f.signature.id != "kv-blocks-zero"] if current is not None else []
    if died:
        return _verdict(obs, "engine-down", [*evidence, "the container runs but its engine died",
                                             f"{died[0].signature.id}: {_quote(died[0])}",
                                             f"cause: {died[0].signature.cause}; fix: {died[0].signature.fix}"])
    blocks = current.finding("kv-blocks-zero") if current is not None else None
    if blocks is not None:
        evidence.append(f"warning: {_quote(blocks)} (lesson 11: a silent EngineCore death usually follows; "
                        "then the node needs a reboot)")
    if current is not None and current.readiness.startup_complete:
        return _verdict(obs, "engine-down", [*evidence, "the log says startup completed, yet /health fails"])
    if c.started_at is None:
        return _verdict(obs, "unknown", [*evidence, "the container's start time is unknown: cannot tell a start "
                                                    "in progress from a hung one"])
    elapsed = obs.probed_at - c.started_at
    limit = WARM_BOOT_MAX_S if obs.warm_start else FIRST_BOOT_MAX_S
    boot = "warm boot" if obs.warm_start else "first boot" if obs.warm_start is False else "boot (warmth unknown)"
    reached = [m.name for m in current.readiness.milestones] if current is not None else []
    where = f"last milestone: {reached[-1]}" if reached else "no readiness milestone in the log yet"
    if elapsed <= limit:
        return _verdict(obs, "starting", [*evidence, f"started {_minutes(elapsed)} ago, inside the {boot} "
                                                     f"window of {_minutes(limit)}", where])
    return _verdict(obs, "engine-down", [*evidence, f"started {_minutes(elapsed)} ago, past the {boot} window "
                                                    f"of {_minutes(limit)}", where],
                    "the start hung: read docker logs for an OOM (runbook: health returns nothing after 25 min cold "
                    "/ 10 min warm), then redeploy; do NOT lower GMU to 0.80/0.78")


def _under_load(obs: Observation) -> bool:
    return bool(obs.metrics and obs.metrics.get(bench.METRIC_RUNNING, 0.0) > 0)


def wedged(obs: Observation) -> NodeVerdict | None:
    """The whole PD-firmware signature under load, judged by core.gpu."""
    if obs.gpu is None or not _under_load(obs):
        return None
    v = gpu.classify(obs.gpu, under_load=True)
    if v.state != "wedged":
        return None
    running = obs.metrics.get(bench.METRIC_RUNNING, 0.0)  # type: ignore[union-attr]
    return _verdict(obs, "wedged", [f"under {running:g} live request(s): {v.reasons[0]}"])


def regressed(obs: Observation) -> NodeVerdict | None:
    """The latest bench below the node's own earlier benches by more than their spread, at full
    clock (runbook: first the wedge, then a stale ~/.cache/vllm)."""
    h = obs.bench
    if h is None:
        return None
    slower = []
    for label, series, unit in (("throughput", h.tok_s, " tok/s"), ("MTP acceptance", h.acceptance, "")):
        if len(series) < MIN_BENCH_HISTORY + 1:
            continue
        latest = bench.Spread.of([series[-1]])
        earlier = bench.Spread.of(series[:-1])
        assert latest is not None and earlier is not None
        if earlier.median == 0:
            continue
        cmp = bench.compare(latest, earlier, names=("latest bench", "earlier benches"))
        if cmp.winner == "earlier benches":
            slower.append(f"{label}: {cmp.text.replace(cmp.winner + ' is better', 'below its history')}"
                          + (unit and f" ({series[-1]:g}{unit})"))
    if not slower:
        return None
    if h.latest_gpu_state == "healthy":
        return _verdict(obs, "regressed", [*slower, "the GPU ran at full clock under load during that bench"])
    return _verdict(obs, "unknown", [
        *slower, f"the GPU under load during that bench was {h.latest_gpu_state or 'not judged'}: "
                 "cannot tell a regression from the wedge"],
        "rerun the bench (it samples nvidia-smi under load): a full clock means a stale ~/.cache/vllm, a pinned "
        "one the PD-firmware wedge")


def _healthy_evidence(obs: Observation) -> list[str]:
    c = obs.container
    evidence = ["/health 200"]
    if c is not None and c.started_at is not None:
        evidence.append(f"container up {_minutes(obs.probed_at - c.started_at)}, restart count {c.restart_count}")
    m = obs.metrics
    if m is not None:
        running, waiting = m.get(bench.METRIC_RUNNING, 0.0), m.get(bench.METRIC_WAITING, 0.0)
        text = f"{running:g} running / {waiting:g} waiting"
        drafted, accepted = m.get(bench.METRIC_DRAFTED), m.get(bench.METRIC_ACCEPTED)
        if drafted:
            text += f", MTP acceptance {accepted / drafted:.1%} since the engine started"  # type: ignore[operator]
        evidence.append(text)
    elif obs.metrics_error:
        evidence.append(f"/metrics unread ({obs.metrics_error})")
    if obs.gpu is not None:
        if _under_load(obs):
            evidence.append("GPU under load: " + gpu.classify(obs.gpu, under_load=True).reasons[0])
        else:
            evidence.append("GPU not judged for the wedge: no live request (it only shows under load)")
    elif obs.gpu_error:
        evidence.append(f"nvidia-smi unread ({obs.gpu_error})")
    return evidence


def judge(obs: Observation) -> NodeVerdict:
    """The one verdict of one node's observations (a deploy journal on the node is named in its
    evidence, whatever the verdict)."""
    v = _judge(obs)
    line = obs.deploy_journal.describe() if obs.deploy_journal is not None else None
    if line and line not in v.evidence:
        v = replace(v, evidence=(*v.evidence, line))
    return v


def _judge(obs: Observation) -> NodeVerdict:
    first = unreachable(obs)
    if first is not None:
        return first
    runs = starts(obs.log_tail) if obs.log_tail else []
    for rule in (residue, crash_loop):
        v = rule(obs, runs)
        if v is not None:
            return v
    v = engine_down_or_starting(obs, runs)
    if v is not None:
        return v
    if obs.health_ok is not True:
        return _verdict(obs, "unknown", [
            f"/health: {obs.health_error or 'not probed'}",
            f"container: {obs.container_error or 'not read'}",
        ])
    for judge_rule in (wedged, regressed):
        v = judge_rule(obs)
        if v is not None:
            return v
    return _verdict(obs, "healthy", _healthy_evidence(obs))


def with_earlier(obs: Observation, earlier: Observation | None) -> Observation:
    """Carry what an earlier sweep of the same node knew into this observation: since when SSH is
    dead, when the last launch started, the restart count then, when /health last answered."""
    if earlier is None or earlier.node != obs.node:
        return obs
    dead_since = None
    if not obs.ssh_ok:
        dead_since = obs.ssh_dead_since or (
            (earlier.ssh_dead_since or earlier.probed_at) if not earlier.ssh_ok else None)
    c = earlier.container
    started = c.started_at if c is not None and c.exists and c.started_at is not None else earlier.last_started_at
    restarts = c.restart_count if c is not None and c.exists else earlier.previous_restart_count
    served = obs.probed_at if obs.health_ok else (obs.served_at if obs.served_at is not None else (
        earlier.probed_at if earlier.health_ok else earlier.served_at))
    return replace(obs, ssh_dead_since=dead_since, served_at=served,
                   last_started_at=obs.last_started_at if obs.last_started_at is not None else started,
                   previous_restart_count=obs.previous_restart_count if obs.previous_restart_count is not None
                   else restarts)


def summary_exit_status(verdicts: Mapping[str, NodeVerdict] | Sequence[NodeVerdict]) -> int:
    """0 when every node is healthy or starting, 1 when some node needs action."""
    values = verdicts.values() if isinstance(verdicts, Mapping) else verdicts
    return 1 if any(v.needs_action for v in values) else 0


__all__ = [
    "ADVICE", "BenchHistory", "ContainerState", "DeployInFlight", "NodeVerdict", "Observation", "Start", "VERDICTS",
    "container_state", "judge", "starts", "summary_exit_status", "with_earlier",
]
