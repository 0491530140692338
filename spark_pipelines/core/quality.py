"""The bench's quality phase, as data and arithmetic: a fixed, versioned suite of answer-checking
and tool-calling scenarios, its scorers, and the verdicts a gate reads.

Why: a node serving fast garbage (the runbook's troubleshooting row "Garbage output -> ensure the
patched image", broken MTP weights that still accept, a bad quantization patch) passes every
speed gate. The runbook runs NVIDIA's tool-eval-bench --short (15 scenarios, out of 100) and found
same-config repeats spread 60-87/100: too noisy to rank configs, but a broken deployment scores
near 0. So this suite is small and checkable by rule (no judge model), every scenario is sent at
temperature 0, and three deterministic checks fail a broken deployment at once whatever its score.

Pure: no network, no clock. The client (resources/bench_client.run_quality) sends the bodies
built here and hands back what the server said as `Reply`.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# Bumped whenever a scenario, its points or a scorer changes: scores of different versions are
# never compared (quality_vs_baseline refuses).
SUITE_VERSION = "spark-quality/1"
PARALLEL = 4  # the runbook's `--short --parallel 4`
TEMPERATURE = 0.0
ANSWER_MAX_TOKENS = 64  # thinking off: a short answer or one tool call (~30 tokens) fits
REASONING_MAX_TOKENS = 512  # thinking on: room for Qwen3.5's thinking on an easy product

# The deterministic checks: names the gate and the report use.
CHECK_SMOKE = "smoke answer"
CHECK_REASONING = "reasoning parser"
CHECK_TOOL_CALL = "tool call parses"


def _tool(name: str, description: str, **props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": props, "required": list(props)}}}


_CURRENCIES = ["USD", "EUR", "GBP", "JPY"]
TOOLS: tuple[dict[str, Any], ...] = (
    _tool("get_weather", "Current weather conditions for a city",
          city={"type": "string", "description": "city name"},
          unit={"type": "string", "enum": ["celsius", "fahrenheit"]}),
    _tool("get_time", "Current local time in a city", city={"type": "string", "description": "city name"}),
    _tool("convert_currency", "Convert an amount of money between currencies",
          amount={"type": "number"}, from_currency={"type": "string", "enum": _CURRENCIES},
          to_currency={"type": "string", "enum": _CURRENCIES}),
)


@dataclass(frozen=True)
class Scenario:
    """One request of the suite and what its answer must show. `check` names the scorer."""

    name: str
    messages: tuple[dict[str, Any], ...]
    check: str  # "contains" | "reasoning" | "tool_call" | "no_tool"
    expect: Mapping[str, Any]
    points: int
    tools: bool = False  # send TOOLS with tool_choice auto
    thinking: bool = False
    deterministic: str | None = None  # the check a broken deployment fails at once, or None

    def body(self, model: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model, "messages": [dict(m) for m in self.messages], "temperature": TEMPERATURE,
            "max_tokens": REASONING_MAX_TOKENS if self.thinking else ANSWER_MAX_TOKENS,
            # Qwen3.5 thinks by default; the answer scenarios do not need it (and stay short).
            "chat_template_kwargs": {"enable_thinking": self.thinking},
        }
        if self.tools:
            body["tools"] = [dict(t) for t in TOOLS]
            body["tool_choice"] = "auto"
        return body


def _user(text: str) -> tuple[dict[str, Any], ...]:
    return ({"role": "user", "content": text},)


_WEATHER_CALL = {"id": "call_0", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "celsius"})}}

SUITE: tuple[Scenario, ...] = (
    Scenario("smoke 2+2", _user("What is 2+2? Be concise."), "contains", {"text": "4"}, 10,
             deterministic=CHECK_SMOKE),
    Scenario("arithmetic", _user("What is 7 * 8? Answer with the number only."), "contains", {"text": "56"}, 10),
    Scenario("reasoning split", _user("What is 17 * 3? Think it through, then answer."), "reasoning",
             {"text": "51"}, 15, thinking=True, deterministic=CHECK_REASONING),
    Scenario("tool call", _user("What's the weather in Paris right now, in celsius?"), "tool_call",
             {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, 15, tools=True,
             deterministic=CHECK_TOOL_CALL),
    Scenario("pick the tool", _user("What time is it in Tokyo?"), "tool_call",
             {"name": "get_time", "arguments": {"city": "Tokyo"}}, 15, tools=True),
    Scenario("typed arguments", _user("Convert 250 USD to EUR."), "tool_call",
             {"name": "convert_currency", "arguments": {"amount": 250, "from_currency": "USD", "to_currency": "EUR"}},
             15, tools=True),
    Scenario("no tool needed", _user("What is 12 + 30? Answer with the number only."), "no_tool", {"text": "42"},
             10, tools=True),
    Scenario("use the tool result", (
        {"role": "user", "content": "What's the weather in Oslo, in celsius?"},
        {"role": "assistant", "content": None, "tool_calls": [_WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call_0", "content": "Oslo: -3 C, light snow"},
    ), "no_tool", {"text": "-3"}, 10, tools=True),
)
MAX_POINTS = sum(s.points for s in SUITE)
assert MAX_POINTS == 100, MAX_POINTS  # scores read as /100, like tool-eval-bench
DETERMINISTIC_CHECKS = tuple(s.deterministic for s in SUITE if s.deterministic)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # as the server sent it (JSON text when the parser works)


@dataclass(frozen=True)
class Reply:
    """What the server answered to one scenario (client-parsed, not judged)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    completion_tokens: int = 0
    seconds: float = 0.0
    error: str | None = None


@dataclass(frozen=True)
class Scored:
    scenario: str
    points: float
    max_points: int
    why: str  # "ok" or what was wrong
    deterministic: str | None = None

    @property
    def passed(self) -> bool:
        return self.points >= self.max_points


def _args_match(got: Mapping[str, Any], want: Mapping[str, Any]) -> list[str]:
    bad = []
    for k, v in want.items():
        g = got.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            try:
                ok = g is not None and math.isclose(float(g), float(v))
            except (TypeError, ValueError):
                ok = False
        else:
            ok = isinstance(g, str) and g.strip().lower() == str(v).lower()
        if not ok:
            bad.append(f"{k}={g!r} (want {v!r})")
    return bad


def score(s: Scenario, r: Reply) -> Scored:
    """Points for one reply (all or part of the scenario's), with the reason for any loss."""
    def out(points: float, why: str) -> Scored:
        return Scored(s.name, points, s.points, why, s.deterministic)

    if r.error:
        return out(0, f"request failed: {r.error[:200]}")
    text = s.expect.get("text", "")
    if s.check == "contains":
        return out(s.points, "ok") if text in r.content else out(0, f"answer lacks {text!r}: {r.content[:80]!r}")
    if s.check == "reasoning":
        if not r.reasoning.strip():
            return out(0, "no reasoning returned apart from the content (reasoning parser missing or broken)")
        if "<think>" in r.content or "</think>" in r.content:
            return out(0, "thinking tags left in the content: the reasoning parser did not split them")
        if text not in r.content:
            return out(0, f"reasoning split, but the answer lacks {text!r}: {r.content[:80]!r}")
        return out(s.points, "ok")
    if s.check == "no_tool":
        if r.tool_calls:
            return out(0, f"called {r.tool_calls[0].name} where an answer was due")
        return out(s.points, "ok") if text in r.content else out(0, f"answer lacks {text!r}: {r.content[:80]!r}")
    if s.check == "tool_call":
        want = s.expect["name"]
        if not r.tool_calls:
            hint = " (a call written into the content: tool-call parser missing or wrong)" \
                if "tool_call" in r.content or '"name"' in r.content else ""
            return out(0, f"no tool call{hint}: {r.content[:80]!r}")
        call = r.tool_calls[0]
        if call.name != want:
            return out(0, f"called {call.name!r}, want {want!r}")
        try:
            args = json.loads(call.arguments or "{}")
            if not isinstance(args, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return out(s.points / 2, f"{want} called, but its arguments are not a JSON object ({e})")
        bad = _args_match(args, s.expect["arguments"])
        return out(s.points / 2, f"{want} called with wrong arguments: {', '.join(bad)}") if bad else out(s.points, "ok")
    raise ValueError(f"scenario {s.name!r}: unknown check {s.check!r}")


@dataclass(frozen=True)
class QualityRun:
    """One pass over the suite: sequential (1 at a time) or parallel (PARALLEL at a time)."""

    mode: str  # "sequential" | "parallel 4"
    scored: tuple[Scored, ...]
    seconds: float
    completion_tokens: int = 0

    @property
    def score(self) -> float:
        return round(100 * sum(x.points for x in self.scored) / MAX_POINTS, 1)

    def checks(self) -> dict[str, str]:
        """Each deterministic check: "ok" or why it failed."""
        return {x.deterministic: x.why for x in self.scored if x.deterministic}


def run_of(mode: str, replies: Sequence[Reply], seconds: float, suite: Sequence[Scenario] = SUITE) -> QualityRun:
    if len(replies) != len(suite):
        raise ValueError(f"{len(replies)} replies for {len(suite)} scenarios")
    return QualityRun(mode, tuple(score(s, r) for s, r in zip(suite, replies)), seconds,
                      sum(r.completion_tokens for r in replies))


@dataclass(frozen=True)
class QualityReport:
    suite: str
    runs: tuple[QualityRun, ...]
    skipped: str | None = None  # why the phase did not run (a server that cannot take it)

    @property
    def score(self) -> float | None:
        """The lower of the runs: a node must answer well alone and under parallel load."""
        return min(r.score for r in self.runs) if self.runs else None

    @property
    def seconds(self) -> float:
        return round(sum(r.seconds for r in self.runs), 2)

    def failed_checks(self) -> dict[str, str]:
        """Deterministic checks failed in any run: name -> why (the first run's reason)."""
        out: dict[str, str] = {}
        for r in self.runs:
            for name, why in r.checks().items():
                if why != "ok":
                    out.setdefault(name, f"{why} ({r.mode})")
        return out

    def text(self) -> str:
        if not self.runs:
            return f"quality not measured: {self.skipped or 'no run'}"
        parts = ", ".join(f"{r.mode} {r.score:g}/100 in {r.seconds:.1f} s" for r in self.runs)
        failed = self.failed_checks()
        checks = "all deterministic checks passed" if not failed else \
            "FAILED " + "; ".join(f"{k}: {v}" for k, v in failed.items())
        return f"{self.suite}: {parts}; {checks}"

    def to_dict(self) -> dict[str, Any]:
        return {"suite": self.suite, "score": self.score, "seconds": self.seconds, "skipped": self.skipped,
                "failed_checks": self.failed_checks(), "runs": [asdict(r) | {"score": r.score} for r in self.runs]}


def render_markdown(q: QualityReport) -> str:
    if not q.runs:
        return f"Quality ({q.suite}): not measured: {q.skipped}.\n"
    modes = [r.mode for r in q.runs]
    lines = [f"Quality ({q.suite}): {q.text()}.", "",
             "| Scenario | " + " | ".join(modes) + " | why (first run) |",
             "|---|" + "---:|" * len(modes) + "---|"]
    for i, s in enumerate(q.runs[0].scored):
        pts = " | ".join(f"{r.scored[i].points:g}/{s.max_points}" for r in q.runs)
        lines.append(f"| {s.scenario}{' (check)' if s.deterministic else ''} | {pts} | {s.why[:120]} |")
    lines.append("| **Total** | " + " | ".join(f"**{r.score:g}**" for r in q.runs) + " | |")
    return "\n".join(lines) + "\n"


# -- verdicts --------------------------------------------------------------------------------------


def quality_gate(q: QualityReport | None, floor: float | None) -> tuple[bool, str]:
    """(passes, why) against the fleet's floor. A failed deterministic check fails whatever the
    score, floor or none; a phase that was run but measured nothing fails too (a gate that cannot
    read its checks does not open). With no floor set, the score alone gates nothing; with no
    phase run at all (q None: the caller benched without one), only a set floor fails."""
    if q is None:
        if floor is None:
            return True, "no quality phase and no quality floor set"
        return False, f"quality not measured (the quality phase did not run) and the fleet sets a floor of {floor:g}/100"
    if q.score is None:
        floor_txt = f" and the fleet sets a floor of {floor:g}/100" if floor is not None else ""
        return False, (f"quality not judged: {q.skipped or 'the quality phase measured nothing'}{floor_txt}; its "
                       "deterministic checks (smoke answer, reasoning parser, tool call) could not run, so the node "
                       "is not promoted: bench it again once its server answers the quality suite")
    failed = q.failed_checks()
    if failed:
        return False, ("quality check failed: " + "; ".join(f"{k}: {v}" for k, v in failed.items())
                       + ". Runbook troubleshooting, Garbage output: ensure the patched image, not vanilla vLLM; "
                         "check the launch's --reasoning-parser and tool-call parser")
    if floor is None:
        return True, f"no quality floor set; deterministic checks passed ({q.text()})"
    if q.score < floor:
        return False, f"quality {q.score:g}/100 < floor {floor:g} ({q.text()})"
    return True, f"quality {q.score:g}/100 >= floor {floor:g}"


def quality_vs_baseline(score: float | None, suite: str, base_score: float | None, base_suite: str | None,
                        noise: float) -> tuple[bool, str]:
    """(passes, why) against the fleet's baseline on the previous version: a drop beyond `noise`
    points (the fleet's measured noise band) fails; a baseline of another suite version or
    without a score cannot judge (passes, and says so)."""
    if base_score is None or score is None:
        return True, "no quality baseline to compare with"
    if base_suite != suite:
        return True, f"quality baseline is suite {base_suite}, this bench {suite}: not compared"
    if score < base_score - noise:
        return False, (f"quality {score:g}/100 is below the fleet's baseline {base_score:g} by more than the "
                       f"measured noise ({noise:g} points): the new version answers worse")
    return True, f"quality {score:g}/100 vs baseline {base_score:g} (noise {noise:g})"


@dataclass(frozen=True)
class Noise:
    n: int
    mean: float
    sd: float
    low: float
    high: float

    def text(self) -> str:
        return f"{self.mean:.1f} +- {self.sd:.1f} (range {self.low:g}-{self.high:g}, n={self.n})"


def noise_of(scores: Sequence[float]) -> Noise:
    """Spread of repeated scores of one node on one version."""
    if not scores:
        raise ValueError("noise of no scores")
    sd = statistics.stdev(scores) if len(scores) > 1 else 0.0
    return Noise(len(scores), statistics.fmean(scores), sd, min(scores), max(scores))


def repeats_needed(sd: float, drop: float) -> int:
    """Runs per side so that a `drop` in the mean score stands out of the noise: the difference of
    two means of n runs has standard error sd*sqrt(2/n); honest when drop >= 2 of those, i.e.
    n >= 8 sd^2 / drop^2 (at least 1)."""
    if drop <= 0:
        raise ValueError("the drop to detect must be > 0 points")
    return max(1, math.ceil(8 * sd * sd / (drop * drop)))
