"""core.quality (the quality suite, its scorers and verdicts) and core.protocol (benches under
different protocols are never compared), against hand-made replies."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from spark_pipelines.core import protocol, quality as q

BY_NAME = {s.name: s for s in q.SUITE}


def good_reply(s: q.Scenario) -> q.Reply:
    """What a healthy deployment answers (the scenario's own expectation, written out)."""
    if s.check == "tool_call":
        return q.Reply(tool_calls=(q.ToolCall(s.expect["name"], json.dumps(s.expect["arguments"])),))
    if s.check == "reasoning":
        return q.Reply(content=f"It is {s.expect['text']}.", reasoning="17 * 3 = 51")
    return q.Reply(content=f"The answer: {s.expect['text']}")


def run(replies, mode="sequential") -> q.QualityRun:
    return q.run_of(mode, replies, 1.0)


def test_the_suite_is_versioned_scored_out_of_100_with_three_deterministic_checks():
    assert q.SUITE_VERSION.startswith("spark-quality/") and q.MAX_POINTS == 100
    assert set(q.DETERMINISTIC_CHECKS) == {q.CHECK_SMOKE, q.CHECK_REASONING, q.CHECK_TOOL_CALL}
    assert BY_NAME["smoke 2+2"].messages[0]["content"] == "What is 2+2? Be concise."  # the runbook's smoke test
    body = BY_NAME["tool call"].body("m")
    assert body["tool_choice"] == "auto" and {t["function"]["name"] for t in body["tools"]} >= {"get_weather"}
    assert body["temperature"] == 0 and body["chat_template_kwargs"] == {"enable_thinking": False}
    assert "tools" not in BY_NAME["smoke 2+2"].body("m")


def test_a_good_deployment_scores_100_and_passes_every_check():
    r = run([good_reply(s) for s in q.SUITE])
    assert r.score == 100 and all(v == "ok" for v in r.checks().values())
    rep = q.QualityReport(q.SUITE_VERSION, (r, run([good_reply(s) for s in q.SUITE], "parallel 4")))
    assert rep.score == 100 and rep.failed_checks() == {}
    assert q.quality_gate(rep, 60) == (True, "quality 100/100 >= floor 60")


def test_garbage_fails_the_smoke_check_and_the_gate_names_it():
    garbage = q.Reply(content=" the a of node value tree", reasoning=" data key")
    r = run([garbage] * len(q.SUITE))
    assert r.score == 0
    failed = q.QualityReport(q.SUITE_VERSION, (r,)).failed_checks()
    assert set(failed) == {q.CHECK_SMOKE, q.CHECK_TOOL_CALL, q.CHECK_REASONING}
    ok, why = q.quality_gate(q.QualityReport(q.SUITE_VERSION, (r,)), 0)  # even a floor of 0: checks decide
    assert not ok and "smoke answer" in why and "patched image" in why


def test_a_broken_tool_call_parser_fails_only_the_tool_scenarios():
    def reply(s):
        if s.check == "tool_call":  # the call written into the content, as without --tool-call-parser
            return q.Reply(content='<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"')
        return good_reply(s)
    r = run([reply(s) for s in q.SUITE])
    assert r.score == 55
    checks = r.checks()
    assert checks[q.CHECK_SMOKE] == "ok" and checks[q.CHECK_REASONING] == "ok"
    assert "tool-call parser" in checks[q.CHECK_TOOL_CALL]


@pytest.mark.parametrize("reply,points,why", [
    (q.Reply(tool_calls=(q.ToolCall("get_time", "{}"),)), 0, "called 'get_time'"),
    (q.Reply(tool_calls=(q.ToolCall("get_weather", "{city: Paris"),)), 7.5, "not a JSON object"),
    (q.Reply(tool_calls=(q.ToolCall("get_weather", '{"city": "paris", "unit": "fahrenheit"}'),)), 7.5, "unit="),
    (q.Reply(tool_calls=(q.ToolCall("get_weather", '{"city": "Paris", "unit": "Celsius"}'),)), 15, "ok"),
    (q.Reply(error="HTTP 400: \"auto\" tool choice requires --enable-auto-tool-choice"), 0, "request failed"),
])
def test_tool_call_scoring(reply, points, why):
    got = q.score(BY_NAME["tool call"], reply)
    assert got.points == points and why in got.why


def test_numbers_compare_as_numbers_and_a_call_where_an_answer_was_due_loses():
    s = BY_NAME["typed arguments"]
    assert q.score(s, q.Reply(tool_calls=(q.ToolCall("convert_currency",
                   '{"amount": "250.0", "from_currency": "usd", "to_currency": "EUR"}'),))).points == 15
    assert q.score(BY_NAME["no tool needed"], q.Reply(tool_calls=(q.ToolCall("get_time", "{}"),))).points == 0


def test_reasoning_check_needs_reasoning_apart_from_the_content():
    s = BY_NAME["reasoning split"]
    assert q.score(s, q.Reply(content="<think>17*3</think> 51")).points == 0
    assert "thinking tags" in q.score(s, q.Reply(content="<think>x</think> 51", reasoning="x")).why
    assert q.score(s, q.Reply(content="51", reasoning="17 * 3 = 51")).passed


def test_the_lower_run_is_the_score_and_a_missing_phase_fails_a_set_floor():
    good = run([good_reply(s) for s in q.SUITE])
    # every check passes, two tool scenarios fail under parallel load
    half = run([good_reply(s) if s.points == 10 or s.deterministic else q.Reply(content="?") for s in q.SUITE],
               "parallel 4")
    rep = q.QualityReport(q.SUITE_VERSION, (good, half))
    assert half.score == 70 and rep.score == 70
    assert not q.quality_gate(rep, 75)[0] and "70/100 < floor 75" in q.quality_gate(rep, 75)[1]
    skipped = q.QualityReport(q.SUITE_VERSION, (), skipped="server has no tool-call parser")
    ok, why = q.quality_gate(skipped, 60)
    assert not ok and "no tool-call parser" in why
    assert "not measured" in q.render_markdown(skipped)
    assert "| **Total** | **100** | **70** |" in q.render_markdown(rep)


def test_quality_vs_baseline_fails_only_beyond_the_noise_and_only_within_one_suite():
    v = q.SUITE_VERSION
    assert q.quality_vs_baseline(90, v, 100, v, 15)[0]
    ok, why = q.quality_vs_baseline(80, v, 100, v, 15)
    assert not ok and "more than the measured noise (15 points)" in why
    assert q.quality_vs_baseline(0, v, 100, "spark-quality/0", 15)[0]  # other suite: not compared
    assert q.quality_vs_baseline(0, v, None, None, 15)[0]


def test_noise_and_the_repeats_an_honest_verdict_needs():
    n = q.noise_of([73, 60, 80, 87, 80])  # the runbook's tool-eval-bench --short repeats, same config
    assert n.low == 60 and n.high == 87 and round(n.sd, 1) == 10.2
    assert q.repeats_needed(n.sd, 10) == 9  # 8 * 10.2^2 / 10^2 = 8.4 -> 9 runs per side
    assert q.repeats_needed(0.0, 10) == 1  # a deterministic suite: one run says it
    with pytest.raises(ValueError):
        q.repeats_needed(1.0, 0)


def _sample(tokens, max_tokens=64, ok=True):
    return SimpleNamespace(completion_tokens=tokens, max_tokens=max_tokens, ok=ok)


def test_the_protocol_says_whether_forcing_was_honoured_and_mismatches_are_refused():
    forced = protocol.protocol_of([_sample(64), _sample(64), _sample(0, ok=False)], forced=True, stream=True)
    assert forced.output_length == "forced" and forced.forced_by == "ignore_eos + min_tokens"
    assert forced.token_count == "server usage"
    ignored = protocol.protocol_of([_sample(64), _sample(12)], forced=True, stream=True)
    assert ignored.output_length == "forced, not honoured"
    natural = protocol.protocol_of([_sample(12)], forced=False, stream=True)
    assert protocol.comparable(forced.key, forced.key)[0]
    for other in (ignored, natural, protocol.protocol_of([_sample(64)], forced=True, stream=False)):
        ok, why = protocol.comparable(forced.key, other.key)
        assert not ok and "different bench protocols" in why
    assert not protocol.comparable(forced.key, None)[0]
    with pytest.raises(protocol.ProtocolMismatch):
        protocol.require_comparable(forced.key, natural.key)
    assert protocol.key_of(forced.to_dict()) == forced.key and protocol.key_of({}) is None


# -- the gates that read it: the rollout's judge and the fleet's baseline --------------------------

from spark_pipelines.core import baseline as bl  # noqa: E402
from spark_pipelines.core import gate  # noqa: E402
from spark_pipelines.core.gpu import GpuVerdict  # noqa: E402

FORCED = "v1|forced|server usage|stream"
HEALTHY = GpuVerdict(state="healthy", reasons=[])


def report_of(replies) -> q.QualityReport:
    return q.QualityReport(q.SUITE_VERSION, (run(replies), run(replies, "parallel 4")))


def judged(quality, base=None, protocol_key=FORCED, floor=50.0):
    return gate.judge("spark1", healthy=True, mean_tok_s=52.0, acceptance=0.95, gpu_verdict=HEALTHY,
                         floor_tok_s=40, floor_acceptance=0.8, baseline=base, quality=quality,
                         floor_quality=floor, quality_noise=20, protocol_key=protocol_key)


def base_of(quality_score, protocol_key=FORCED):
    recs = [bl.record(n, t, 52.0, bl.BenchIdentity("sha256:a", "c", "l"),
                      bl.LoadConditions(gpu_state="healthy", isolation_verified=True, counters_match=True),
                      protocol=protocol_key, quality=quality_score, quality_suite=q.SUITE_VERSION)
            for t, n in ((1.0, "spark1"), (2.0, "spark2"))]
    return bl.fleet_baseline(recs)


def test_fast_garbage_fails_the_rollout_quality_gate_that_speed_alone_passes():
    garbage = report_of([q.Reply(content=" the a of")] * len(q.SUITE))
    g = judged(garbage, base_of(100.0))
    assert not g.passed and g.gate == "quality" and "smoke answer" in g.why
    good = judged(report_of([good_reply(s) for s in q.SUITE]), base_of(100.0))
    assert good.passed and "quality 100/100" in good.why and "vs baseline" in good.why


def test_a_quality_drop_beyond_the_noise_fails_within_it_passes():
    # 70/100: above the floor, every check passing, 30 below the baseline's 100 (noise 20)
    worse = report_of([good_reply(s) if s.points == 10 or s.deterministic else q.Reply(content="?")
                       for s in q.SUITE])
    g = judged(worse, base_of(100.0))
    assert not g.passed and g.gate == "quality" and "measured noise (20 points)" in g.why
    assert judged(worse, base_of(85.0)).passed  # 15 below: within the noise


def test_a_baseline_under_another_protocol_is_never_compared_and_the_gate_holds():
    natural = "v1|natural (stops at EOS)|server usage|stream"
    base = base_of(100.0, protocol_key=natural)
    assert base.protocol == natural and base.quality == 100.0
    g = gate.judge("spark1", healthy=True, mean_tok_s=20.0, gpu_verdict=HEALTHY, floor_tok_s=10,
                      baseline=base, protocol_key=FORCED)  # far below the baseline's 52 tok/s
    # The gate cannot compare, so it cannot pass: it says so and what to do (was: passed unjudged).
    assert not g.passed and g.gate == "baseline", g
    assert "cannot judge" in g.why and "different bench protocols" in g.why and "bench every serving node" in g.why
    ignored = "v1|forced, not honoured|server usage|stream"  # a version that ignores ignore_eos
    g = gate.judge("spark1", healthy=True, mean_tok_s=60.0, gpu_verdict=HEALTHY, floor_tok_s=10,
                      baseline=base_of(100.0), protocol_key=ignored)
    assert not g.passed and g.gate == "baseline" and "ignored the forced output length" in g.why
    # the fleet's baseline pools one protocol: the newest comparable bench's
    ident = bl.BenchIdentity("sha256:a", "c", "l")
    cond = bl.LoadConditions(gpu_state="healthy", isolation_verified=True, counters_match=True)
    recs = [bl.record("spark1", 1.0, 30.0, ident, cond, protocol=natural),
            bl.record("spark2", 2.0, 52.0, ident, cond, protocol=FORCED)]
    pooled = bl.fleet_baseline(recs)
    assert pooled.nodes == ("spark2",) and pooled.tok_s == 52.0 and pooled.protocol == FORCED
    again = bl.BenchRecord.from_dict(recs[1].to_dict())
    assert again.protocol == FORCED and again.quality is None


# -- gates that cannot judge hold (issue 34, item 5) ---------------------------------------------

def test_without_a_quality_floor_a_failed_check_still_holds_the_node():
    garbage = report_of([q.Reply(content=" the a of")] * len(q.SUITE))
    ok, why = q.quality_gate(garbage, None)  # the schema's default: no floor
    assert not ok and "smoke answer" in why and "patched image" in why
    g = judged(garbage, floor=None)
    assert not g.passed and g.gate == "quality" and "smoke answer" in g.why
    good = report_of([good_reply(s) for s in q.SUITE])
    ok, why = q.quality_gate(good, None)
    assert ok and "no quality floor set" in why and "checks passed" in why


def test_a_quality_phase_that_measured_nothing_holds_even_without_a_floor():
    skipped = q.QualityReport(q.SUITE_VERSION, (), skipped="HTTP 503 from /v1/chat/completions")
    ok, why = q.quality_gate(skipped, None)
    assert not ok and "quality not judged: HTTP 503" in why and "bench it again" in why
    g = judged(skipped, floor=None)
    assert not g.passed and g.gate == "quality"
    assert q.quality_gate(None, None)[0]  # no phase asked for, no floor: nothing to judge, nothing held


def test_without_a_floor_a_quality_drop_below_the_baseline_still_fails_the_rollout():
    worse = report_of([good_reply(s) if s.points == 10 or s.deterministic else q.Reply(content="?")
                       for s in q.SUITE])
    g = judged(worse, base_of(100.0), floor=None)
    assert not g.passed and g.gate == "quality" and "measured noise" in g.why
