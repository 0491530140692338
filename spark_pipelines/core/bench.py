"""The runbook's bench, as data and arithmetic: suite, per-request figures, spread, verdicts.

Pure: no network, no clock. The client (`spark_pipelines.resources.bench_client`) records timestamps and
server counters; everything it measured is turned into figures here, so the arithmetic can be
unit-tested against hand-computed numbers.

Definitions (kept next to the rule that uses them):
- tok/s is the recipe's (`bench_qwen35.sh`): usage.completion_tokens / wall time of the whole
  request. It includes queueing, prefill and time to first token, and counts reasoning tokens.
- TTFT: request start -> first chunk that carries generated text.
- TPOT: (wall time - TTFT) / (completion_tokens - 1), as `vllm bench serve` defines it.
- ITL: gaps between consecutive text-carrying chunks. With MTP speculative decoding one chunk
  carries several tokens, so ITL is per chunk (engine step), not per token.
- decode-only tok/s: (completion_tokens - 1) / (last chunk - first chunk).
- loaded-phase aggregate tok/s: sum of completion tokens / (last finish - first start).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from spark_pipelines.core.diagnosis import (  # noqa: F401 (METRIC_* are read as bench.METRIC_* too)
    METRIC_ACCEPTED,
    METRIC_DRAFTED,
    METRIC_GENERATION,
    METRIC_PROMPT,
    METRIC_RUNNING,
    METRIC_WAITING,
)
from spark_pipelines.core.gpu import GpuVerdict

# ---------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchPrompt:
    """One request of a suite: a name for the tables, the user message and its max_tokens."""

    name: str
    prompt: str
    max_tokens: int


# The recipe's five prompts (bench_qwen35.sh), so our numbers line up with the published ones.
RECIPE_PROMPTS: tuple[BenchPrompt, ...] = (
    BenchPrompt("Q&A", "What are the main differences between TCP and UDP? Be concise.", 256),
    BenchPrompt(
        "Code",
        "Write a Python function that implements binary search on a sorted list. "
        "Include type hints and docstring.",
        512,
    ),
    BenchPrompt(
        "JSON",
        "Generate a JSON array of 10 fictional employees with fields: name, age, department, "
        "salary, email, skills (array of 3). Output ONLY valid JSON, no explanation.",
        1024,
    ),
    BenchPrompt("Math", "What is 7823 * 4519? Show only the answer.", 64),
    BenchPrompt(
        "LongCode",
        "Write a complete Python implementation of a red-black tree with insert, delete, search, "
        "and in-order traversal. Include all rotation methods.",
        2048,
    ),
)
# The recipe sends temperature 0.0 so that repeats decode the same tokens.
RECIPE_TEMPERATURE = 0.0
# The recipe runs the whole set twice and reads run 2 (run 1 warms caches and JIT kernels).
RECIPE_RUNS = 2

# albond's published per-prompt tok/s (GX10, 0.90 GMU): the ceiling the runbook compares with.
REFERENCE_TOK_S: Mapping[str, float] = {
    "Q&A": 51.3,
    "Code": 52.8,
    "JSON": 51.1,
    "Math": 47.8,
    "LongCode": 54.9,
}
# The published mean (51.6), derived so it cannot drift from the five figures it summarizes. A
# fleet may compare with another figure (bench.reference_tok_s); this is its default.
REFERENCE_MEAN_TOK_S = round(sum(REFERENCE_TOK_S.values()) / len(REFERENCE_TOK_S), 1)

# Runbook's loaded probe: 8 parallel requests x 128 max_tokens, aggregate tok/s under load.
LOADED_CONCURRENCY = 8
LOADED_MAX_TOKENS = 128
LOADED_PROMPT = BenchPrompt(
    "loaded",
    "Explain, step by step, how a hash map handles collisions and when it resizes.",
    LOADED_MAX_TOKENS,
)

# vLLM runs at most max_num_seqs (256 by default) sequences at once and queues the rest: more
# concurrent streams measure the queue, not the node, and each holds a client socket.
MAX_CONCURRENCY = 256
MAX_REPEATS = 20  # the recipe's 2; 20 already takes ~25 min of single-stream prompts on a GB10

SUITES = ("recipe", "loaded", "all")
PHASE_RECIPE = "recipe"
PHASE_LOADED = "loaded"

# Two spreads whose ranges, each widened by this fraction of its median, overlap cannot be told
# apart. Why 2%: the runbook calls 47.3 vs 47.5 tok/s "within noise", and a single measured run
# (the recipe's) has no range of its own, so a floor is needed to avoid crowning noise.
NOISE_FLOOR = 0.02



class BenchRefused(ValueError):
    """The bench must not run (node busy, bad suite name...); the message says what to do."""


@dataclass(frozen=True)
class SuitePlan:
    """What a run sends: per phase, the prompts of one repeat and how many run at once."""

    phases: tuple[tuple[str, tuple[BenchPrompt, ...], int], ...]
    repeats: int  # total runs of each phase, the first being a warm-up when repeats > 1

    def total_requests(self) -> int:
        return sum(len(prompts) for _, prompts, _ in self.phases) * self.repeats


def plan_suite(
    suite: str,
    concurrency: int = LOADED_CONCURRENCY,
    repeats: int = RECIPE_RUNS,
    *,
    loaded_max_tokens: int = LOADED_MAX_TOKENS,
    loaded_requests: int | None = None,
) -> SuitePlan:
    """Turn CLI choices into a plan, refusing values that cannot make a measurement."""
    if suite not in SUITES:
        raise BenchRefused(f"suite {suite!r} is unknown; choose one of: {', '.join(SUITES)}")
    if not isinstance(concurrency, int) or concurrency < 1:
        raise BenchRefused(f"concurrency must be a whole number >= 1, got {concurrency!r}")
    if concurrency > MAX_CONCURRENCY:
        raise BenchRefused(f"concurrency {concurrency} is above {MAX_CONCURRENCY}: vLLM runs at most max_num_seqs "
                           f"({MAX_CONCURRENCY} by default) at once and queues the rest; use {MAX_CONCURRENCY} or less "
                           f"(the runbook's loaded probe is {LOADED_CONCURRENCY})")
    if not isinstance(repeats, int) or repeats < 1:
        raise BenchRefused(f"repeats must be a whole number >= 1, got {repeats!r}")
    if repeats > MAX_REPEATS:
        raise BenchRefused(f"repeats {repeats} is above {MAX_REPEATS}; the recipe uses {RECIPE_RUNS} (a warm-up, "
                           "then one measured run)")
    if loaded_max_tokens < 1:
        raise BenchRefused(f"loaded max_tokens must be >= 1, got {loaded_max_tokens!r}")
    phases: list[tuple[str, tuple[BenchPrompt, ...], int]] = []
    if suite in ("recipe", "all"):
        # The recipe is single-stream by definition: one request at a time, in order.
        phases.append((PHASE_RECIPE, RECIPE_PROMPTS, 1))
    if suite in ("loaded", "all"):
        n = loaded_requests if loaded_requests is not None else concurrency
        if n < 1:
            raise BenchRefused(f"loaded requests must be >= 1, got {n!r}")
        prompt = BenchPrompt(LOADED_PROMPT.name, LOADED_PROMPT.prompt, loaded_max_tokens)
        phases.append((PHASE_LOADED, (prompt,) * n, concurrency))
    return SuitePlan(phases=tuple(phases), repeats=repeats)


def chat_body(
    model: str, prompt: BenchPrompt, *, stream: bool, ignore_eos: bool = False
) -> dict[str, object]:
    """The request body the recipe sends (plus streaming usage, which vLLM and LiteLLM honour)."""
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt.prompt}],
        "max_tokens": prompt.max_tokens,
        "temperature": RECIPE_TEMPERATURE,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        # vLLM extensions: decode exactly max_tokens, as `vllm bench serve` does for fixed loads
        # (min_tokens too: a server that drops one of the two still forces the length).
        body["ignore_eos"] = True
        body["min_tokens"] = prompt.max_tokens
    return body


# ---------------------------------------------------------------------------------------------
# Per-request figures
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSample:
    """What the client saw for one request; times are seconds on one monotonic clock."""

    phase: str
    prompt: str
    repeat: int  # 0-based; repeat 0 is the warm-up when the plan has more than one repeat
    max_tokens: int
    started: float
    finished: float
    chunk_times: tuple[float, ...] = ()  # arrivals of chunks that carried generated text
    completion_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.completion_tokens > 0


@dataclass(frozen=True)
class RequestFigures:
    phase: str
    prompt: str
    repeat: int
    tokens: int
    prompt_tokens: int
    seconds: float
    tok_s: float  # the recipe's figure
    ttft_s: float | None
    tpot_s: float | None
    decode_tok_s: float | None
    itl_s: tuple[float, ...]


def request_figures(sample: RequestSample) -> RequestFigures:
    """Figures for one successful request (see the module docstring for each definition)."""
    if not sample.ok:
        raise ValueError(f"{sample.phase}/{sample.prompt} repeat {sample.repeat} has no tokens")
    seconds = sample.finished - sample.started
    if seconds <= 0:
        raise ValueError(f"{sample.prompt}: finish time is not after start time")
    n = sample.completion_tokens
    times = sample.chunk_times
    ttft = tpot = decode = None
    itl: tuple[float, ...] = ()
    if times:
        ttft = times[0] - sample.started
        if n > 1:
            tpot = (seconds - ttft) / (n - 1)
        span = times[-1] - times[0]
        if n > 1 and span > 0:
            decode = (n - 1) / span
        itl = tuple(b - a for a, b in zip(times, times[1:]))
    return RequestFigures(
        phase=sample.phase,
        prompt=sample.prompt,
        repeat=sample.repeat,
        tokens=n,
        prompt_tokens=sample.prompt_tokens,
        seconds=seconds,
        tok_s=n / seconds,
        ttft_s=ttft,
        tpot_s=tpot,
        decode_tok_s=decode,
        itl_s=itl,
    )


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Spread:
    """min / median / max over measured repeats (warm-up excluded)."""

    n: int
    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread | None:
        vals = [v for v in values if v is not None]
        if not vals:
            return None
        return cls(n=len(vals), min=min(vals), median=percentile(vals, 50), max=max(vals))

    def text(self, digits: int = 1) -> str:
        if self.n == 1 or self.min == self.max:
            return f"{self.median:.{digits}f}"
        return f"{self.median:.{digits}f} ({self.min:.{digits}f}-{self.max:.{digits}f})"


@dataclass(frozen=True)
class Verdict:
    winner: str | None  # the better side's name, or None when the spreads overlap
    ratio: float  # median of a over median of b
    text: str


def compare(
    a: Spread,
    b: Spread,
    *,
    names: tuple[str, str] = ("a", "b"),
    higher_is_better: bool = True,
    noise_floor: float = NOISE_FLOOR,
) -> Verdict:
    """Say which side is better only when their ranges are apart.

    Rule: widen each side's [min, max] by `noise_floor` x its median (so a single run still has
    a width); if the widened ranges overlap the sides "cannot be told apart at this spread".
    """
    if b.median == 0:
        raise ValueError("cannot compare against a zero median")
    ratio = a.median / b.median
    a_lo, a_hi = a.min - noise_floor * abs(a.median), a.max + noise_floor * abs(a.median)
    b_lo, b_hi = b.min - noise_floor * abs(b.median), b.max + noise_floor * abs(b.median)
    detail = f"{names[0]} {a.text(2)} vs {names[1]} {b.text(2)}, ratio {ratio:.3f}"
    if a_lo <= b_hi and b_lo <= a_hi:
        return Verdict(None, ratio, f"cannot be told apart at this spread ({detail})")
    a_better = (a.median > b.median) == higher_is_better
    winner = names[0] if a_better else names[1]
    return Verdict(winner, ratio, f"{winner} is better ({detail})")


# ---------------------------------------------------------------------------------------------
# Server counters
# ---------------------------------------------------------------------------------------------


def isolation_check(metrics: Mapping[str, float], *, where: str = "the server") -> None:
    """Refuse to bench a node that is serving other traffic (runbook Operational Lesson #6)."""
    if METRIC_RUNNING not in metrics:
        raise BenchRefused(
            f"{where} /metrics has no {METRIC_RUNNING}; cannot verify the node is idle. "
            "Point --metrics-url at the vLLM server itself (not a gateway)."
        )
    busy = {
        name: metrics.get(name, 0.0)
        for name in (METRIC_RUNNING, METRIC_WAITING)
        if metrics.get(name, 0.0) > 0
    }
    if busy:
        counts = ", ".join(f"{k} = {v:g}" for k, v in busy.items())
        raise BenchRefused(
            f"{where} is not isolated: {counts} (must be 0). Drain the node from the gateway "
            "pools (or pause other clients), wait for in-flight requests to finish, then rerun."
        )


@dataclass(frozen=True)
class CounterCheck:
    """Server counters (deltas over the run) against what the client counted."""

    generation_tokens: float
    client_completion_tokens: int
    prompt_tokens: float | None
    client_prompt_tokens: int
    draft_tokens: float | None
    accepted_tokens: float | None
    acceptance_rate: float | None
    tokens_match: bool
    text: str


def counter_check(
    before: Mapping[str, float],
    after: Mapping[str, float],
    samples: Sequence[RequestSample],
) -> CounterCheck:
    """Compare the server's token counters with the client's usage sums (all requests sent).

    On an isolated node the generation counter moves by exactly the completion tokens the
    client was told about; a difference means other traffic, or requests the client lost.
    """
    if METRIC_GENERATION not in before or METRIC_GENERATION not in after:
        raise ValueError(f"/metrics lacks {METRIC_GENERATION}; not a vLLM server?")
    gen = after[METRIC_GENERATION] - before[METRIC_GENERATION]
    prompt = None
    if METRIC_PROMPT in before and METRIC_PROMPT in after:
        prompt = after[METRIC_PROMPT] - before[METRIC_PROMPT]
    client_gen = sum(s.completion_tokens for s in samples)
    client_prompt = sum(s.prompt_tokens for s in samples)
    drafted = accepted = rate = None
    if METRIC_DRAFTED in after:
        drafted = after[METRIC_DRAFTED] - before.get(METRIC_DRAFTED, 0.0)
        accepted = after.get(METRIC_ACCEPTED, 0.0) - before.get(METRIC_ACCEPTED, 0.0)
        rate = accepted / drafted if drafted > 0 else None
    match = int(round(gen)) == client_gen
    if match:
        text = f"server generated {gen:.0f} tokens = client's {client_gen}"
    else:
        text = (
            f"server generated {gen:.0f} tokens but the client counted {client_gen} "
            f"(difference {gen - client_gen:+.0f}): other traffic reached the node, or "
            "responses were lost"
        )
    if rate is not None:
        text += f"; spec-decode acceptance {rate:.1%} ({accepted:.0f}/{drafted:.0f} drafted)"
    return CounterCheck(
        generation_tokens=gen,
        client_completion_tokens=client_gen,
        prompt_tokens=prompt,
        client_prompt_tokens=client_prompt,
        draft_tokens=drafted,
        accepted_tokens=accepted,
        acceptance_rate=rate,
        tokens_match=match,
        text=text,
    )


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptResult:
    phase: str
    prompt: str
    max_tokens: int
    measured: int  # requests that count (warm-up excluded, failures excluded)
    tokens: Spread | None
    seconds: Spread | None
    tok_s: Spread | None
    ttft_s: Spread | None
    tpot_s: Spread | None
    decode_tok_s: Spread | None
    reference_tok_s: float | None
    failures: int


@dataclass(frozen=True)
class PhaseResult:
    phase: str
    concurrency: int
    requests_per_repeat: int
    aggregate_tok_s: Spread | None  # per measured repeat: sum tokens / (last end - first start)
    mean_tok_s: Spread | None  # per measured repeat: mean of per-request tok/s
    itl_p50_s: float | None
    itl_p90_s: float | None
    itl_p99_s: float | None
    ttft_s: Spread | None
    tpot_s: Spread | None


@dataclass
class BenchReport:
    base_url: str
    model: str
    suite: str
    concurrency: int
    repeats: int
    warmup_repeats: int
    prompts: list[PromptResult]
    phases: list[PhaseResult]
    counters: CounterCheck | None
    isolation: str  # "verified idle" or why it could not be verified
    failures: list[str] = field(default_factory=list)
    started_at: str = ""
    reference_mean_tok_s: float = REFERENCE_MEAN_TOK_S  # what the recipe mean is compared with
    protocol: dict[str, object] | None = None  # core.protocol.BenchProtocol.to_dict() of the run

    @property
    def recipe_mean_tok_s(self) -> Spread | None:
        for p in self.phases:
            if p.phase == PHASE_RECIPE:
                return p.mean_tok_s
        return None

    def to_dict(self) -> dict[str, object]:
        data = asdict(self)
        data["recipe_mean_tok_s"] = asdict(self.recipe_mean_tok_s) if self.recipe_mean_tok_s else None
        return data


def warmup_repeats(repeats: int) -> int:
    """The recipe discards its first run; a single run has nothing to discard."""
    return 1 if repeats > 1 else 0


def build_report(
    samples: Sequence[RequestSample],
    plan: SuitePlan,
    *,
    base_url: str,
    model: str,
    suite: str,
    concurrency: int,
    counters: CounterCheck | None = None,
    isolation: str = "not checked",
    started_at: str = "",
    reference_mean_tok_s: float = REFERENCE_MEAN_TOK_S,
) -> BenchReport:
    """Aggregate raw samples into per-prompt and per-phase figures (warm-up excluded)."""
    skip = warmup_repeats(plan.repeats)
    failures = [
        f"{s.phase}/{s.prompt} run {s.repeat + 1}: {s.error or 'no completion tokens'}"
        for s in samples
        if not s.ok
    ]
    measured = [s for s in samples if s.repeat >= skip]
    figures = [request_figures(s) for s in measured if s.ok]

    prompts: list[PromptResult] = []
    phases: list[PhaseResult] = []
    for phase, phase_prompts, phase_conc in plan.phases:
        seen: list[BenchPrompt] = []
        for p in phase_prompts:
            if p.name not in [q.name for q in seen]:
                seen.append(p)
        for p in seen:
            figs = [f for f in figures if f.phase == phase and f.prompt == p.name]
            failed = sum(1 for s in measured if s.phase == phase and s.prompt == p.name and not s.ok)
            prompts.append(
                PromptResult(
                    phase=phase,
                    prompt=p.name,
                    max_tokens=p.max_tokens,
                    measured=len(figs),
                    tokens=Spread.of(f.tokens for f in figs),
                    seconds=Spread.of(f.seconds for f in figs),
                    tok_s=Spread.of(f.tok_s for f in figs),
                    ttft_s=Spread.of(f.ttft_s for f in figs),
                    tpot_s=Spread.of(f.tpot_s for f in figs),
                    decode_tok_s=Spread.of(f.decode_tok_s for f in figs),
                    reference_tok_s=REFERENCE_TOK_S.get(p.name) if phase == PHASE_RECIPE else None,
                    failures=failed,
                )
            )
        aggregates: list[float] = []
        means: list[float] = []
        for r in range(skip, plan.repeats):
            run = [s for s in measured if s.phase == phase and s.repeat == r and s.ok]
            if not run:
                continue
            span = max(s.finished for s in run) - min(s.started for s in run)
            if span > 0:
                aggregates.append(sum(s.completion_tokens for s in run) / span)
            means.append(sum(request_figures(s).tok_s for s in run) / len(run))
        phase_figs = [f for f in figures if f.phase == phase]
        itl = [g for f in phase_figs for g in f.itl_s]
        phases.append(
            PhaseResult(
                phase=phase,
                concurrency=phase_conc,
                requests_per_repeat=len(phase_prompts),
                aggregate_tok_s=Spread.of(aggregates),
                mean_tok_s=Spread.of(means),
                itl_p50_s=percentile(itl, 50) if itl else None,
                itl_p90_s=percentile(itl, 90) if itl else None,
                itl_p99_s=percentile(itl, 99) if itl else None,
                ttft_s=Spread.of(f.ttft_s for f in phase_figs),
                tpot_s=Spread.of(f.tpot_s for f in phase_figs),
            )
        )
    return BenchReport(
        base_url=base_url,
        model=model,
        suite=suite,
        concurrency=concurrency,
        repeats=plan.repeats,
        warmup_repeats=skip,
        prompts=prompts,
        phases=phases,
        counters=counters,
        isolation=isolation,
        failures=failures,
        started_at=started_at,
        reference_mean_tok_s=reference_mean_tok_s,
    )


def _ms(spread: Spread | None) -> str:
    if spread is None:
        return "-"
    return Spread(spread.n, spread.min * 1000, spread.median * 1000, spread.max * 1000).text(1)


def _num(spread: Spread | None, digits: int = 1) -> str:
    return "-" if spread is None else spread.text(digits)


def render_markdown(report: BenchReport) -> str:
    """A markdown summary: the recipe table beside the reference, then the loaded phase."""
    lines = [
        f"## Bench: {report.model} at {report.base_url}",
        "",
        f"Suite `{report.suite}`, {report.repeats} run(s) per phase, "
        f"{report.warmup_repeats} warm-up run(s) excluded. Isolation: {report.isolation}.",
        f"Bench protocol: {report.protocol.get('key') if report.protocol else 'not recorded'} "
        "(benches under different protocols are never compared).",
        "",
    ]
    recipe = [p for p in report.prompts if p.phase == PHASE_RECIPE]
    if recipe:
        lines += [
            "| Prompt | max_tokens | tokens | seconds | tok/s | reference | vs ref | TTFT ms | TPOT ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in recipe:
            vs = "-"
            if p.tok_s and p.reference_tok_s:
                vs = f"{p.tok_s.median / p.reference_tok_s:.0%}"
            lines.append(
                f"| {p.prompt} | {p.max_tokens} | {_num(p.tokens, 0)} | {_num(p.seconds, 2)} | "
                f"{_num(p.tok_s)} | {p.reference_tok_s or '-'} | {vs} | {_ms(p.ttft_s)} | "
                f"{_ms(p.tpot_s)} |"
            )
        mean = report.recipe_mean_tok_s
        ref = report.reference_mean_tok_s
        vs_mean = f"{mean.median / ref:.0%}" if mean else "-"
        lines.append(f"| **Mean** | | | | **{_num(mean)}** | {ref:g} | {vs_mean} | | |")
        lines.append("")
    for ph in report.phases:
        if ph.phase == PHASE_RECIPE:
            continue
        lines += [
            f"Loaded phase: {ph.requests_per_repeat} requests, {ph.concurrency} at once: "
            f"aggregate {_num(ph.aggregate_tok_s)} tok/s, per request {_num(ph.mean_tok_s)} tok/s, "
            f"TTFT {_ms(ph.ttft_s)} ms, TPOT {_ms(ph.tpot_s)} ms.",
            "",
        ]
    itl_rows = [ph for ph in report.phases if ph.itl_p50_s is not None]
    if itl_rows:
        lines += ["| Phase | ITL p50 ms | ITL p90 ms | ITL p99 ms |", "|---|---:|---:|---:|"]
        for ph in itl_rows:
            lines.append(
                f"| {ph.phase} | {ph.itl_p50_s * 1000:.1f} | {ph.itl_p90_s * 1000:.1f} | "
                f"{ph.itl_p99_s * 1000:.1f} |"
            )
        lines.append("")
    if report.counters is not None:
        mark = "ok" if report.counters.tokens_match else "MISMATCH"
        lines += [f"Server counters ({mark}): {report.counters.text}.", ""]
    else:
        lines += ["Server counters: not available.", ""]
    if report.failures:
        lines += ["Failed requests:"] + [f"- {f}" for f in report.failures] + [""]
    return "\n".join(lines)


def void_verdict(void: Sequence[str], *, was_in: bool) -> str:
    """Why a void bench (it did not measure the node alone, or measured a wedge) promotes nothing."""
    where = "back in the gateway as before" if was_in else "left out of the gateway as before"
    return (f"void bench, not a verdict ({'; '.join(void)}): not promoted, {where}; rerun the bench once "
            f"nothing else talks to the node (every gateway route to it drained)")


def acceptance_gate(acceptance: float | None, floor: float | None) -> tuple[bool, str]:
    """(passes, why) for the MTP acceptance floor; no floor set passes, an unreadable rate with a
    floor set fails (a gate that cannot read its figure does not open)."""
    if floor is None:
        return True, "no MTP acceptance floor set"
    if acceptance is None:
        return False, (f"MTP acceptance could not be read (no spec-decode counters on /metrics) and the fleet "
                       f"sets a floor of {floor:.0%}: check that the launch has --speculative-config (MTP-2)")
    if acceptance >= floor:
        return True, f"MTP acceptance {acceptance:.1%} >= floor {floor:.0%}"
    return False, (f"MTP acceptance {acceptance:.1%} < floor {floor:.0%}: the runbook's MTP-2 gives ~95%; check the "
                   f"MTP weights step (add-mtp-weights.py, mtp_keys_mapped) and the launch's speculative config")


def tok_s_gate(mean: float | None, floor: float, gpu_verdict: GpuVerdict) -> tuple[bool, str]:
    """(passes, why) for the bench floor, the runbook's two checks in order. A wedged GPU never
    passes, even above the floor (it only gets worse); a slow one at full clock is not the wedge,
    so the advice is the second check (a stale torch_compile cache)."""
    if gpu_verdict.state == "wedged":
        return False, ("PD-firmware wedge under load (" + "; ".join(gpu_verdict.reasons) + "); kept out of the "
                       "gateway. Runbook Known Firmware Issues: capture evidence, stop vLLM, sudo poweroff, "
                       "unplug the brick at the wall 90-120 s, power on, then rerun the bench")
    if mean is not None and mean >= floor:
        return True, f"bench {mean:.1f} tok/s >= floor {floor:g}"
    got = f"{mean:.1f}" if mean is not None else "no"
    if gpu_verdict.state == "healthy":
        advice = ("the GPU ran at full clock under load, so not the wedge; second check: a stale torch_compile "
                  "cache (~/.cache/vllm): redeploy with config fresh_jit_cache: true, which sets it aside")
    else:
        advice = ("check for the PD-firmware wedge (nvidia-smi clocks under load; "
                  + "; ".join(gpu_verdict.reasons) + ") before redeploying")
    return False, f"bench {got} tok/s < floor {floor:g}: kept out of the gateway; {advice}"
