"""core.bench: the recipe's definitions, statistics, verdicts and the table, on hand-made samples."""

from __future__ import annotations

import pytest

from spark_pipelines.core import bench as core


def sample(prompt="Q&A", repeat=1, tokens=256, start=0.0, end=5.0, chunks=(), phase="recipe",
           prompt_tokens=20, error=None):
    return core.RequestSample(
        phase=phase, prompt=prompt, repeat=repeat, max_tokens=tokens, started=start,
        finished=end, chunk_times=tuple(chunks), completion_tokens=tokens if error is None else 0,
        prompt_tokens=prompt_tokens, error=error,
    )


def test_recipe_suite_matches_bench_qwen35():
    names = [p.name for p in core.RECIPE_PROMPTS]
    assert names == ["Q&A", "Code", "JSON", "Math", "LongCode"]
    assert [p.max_tokens for p in core.RECIPE_PROMPTS] == [256, 512, 1024, 64, 2048]
    assert core.RECIPE_TEMPERATURE == 0.0 and core.RECIPE_RUNS == 2
    ref = core.REFERENCE_TOK_S
    assert [ref[n] for n in names] == [51.3, 52.8, 51.1, 47.8, 54.9]
    # The published mean is the mean of the five published figures.
    assert round(sum(ref.values()) / 5, 1) == core.REFERENCE_MEAN_TOK_S


def test_chat_body_is_the_recipes_plus_streaming_usage():
    body = core.chat_body("qwen", core.RECIPE_PROMPTS[3], stream=True)
    assert body["max_tokens"] == 64 and body["temperature"] == 0.0
    assert body["messages"] == [{"role": "user", "content": core.RECIPE_PROMPTS[3].prompt}]
    assert body["stream_options"] == {"include_usage": True}
    plain = core.chat_body("qwen", core.RECIPE_PROMPTS[3], stream=False)
    assert "stream" not in plain and "ignore_eos" not in plain
    assert core.chat_body("m", core.RECIPE_PROMPTS[0], stream=False, ignore_eos=True)["ignore_eos"]


def test_tok_s_is_completion_tokens_over_whole_request_wall_time():
    # 256 tokens in 5 s including a 0.5 s TTFT: the recipe says 51.2 tok/s, not 256/4.5.
    chunks = [0.5 + i * (4.5 / 255) for i in range(256)]
    fig = core.request_figures(sample(tokens=256, start=0.0, end=5.0, chunks=chunks))
    assert fig.tok_s == pytest.approx(51.2)
    assert fig.ttft_s == pytest.approx(0.5)
    assert fig.tpot_s == pytest.approx(4.5 / 255)
    assert fig.decode_tok_s == pytest.approx(255 / 4.5)
    assert len(fig.itl_s) == 255 and fig.itl_s[0] == pytest.approx(4.5 / 255)


def test_multi_token_chunks_keep_tpot_per_token_and_itl_per_chunk():
    # MTP-2: 3 tokens per chunk; 10 chunks carry 28 tokens (first chunk has 1).
    chunks = [0.2 + 0.1 * i for i in range(10)]
    fig = core.request_figures(sample(tokens=28, start=0.0, end=1.1, chunks=chunks))
    assert len(fig.itl_s) == 9 and all(g == pytest.approx(0.1) for g in fig.itl_s)
    assert fig.tpot_s == pytest.approx((1.1 - 0.2) / 27)
    assert fig.decode_tok_s == pytest.approx(27 / 0.9)


def test_non_streaming_sample_has_tok_s_but_no_ttft():
    fig = core.request_figures(sample(tokens=64, start=1.0, end=2.0))
    assert fig.tok_s == pytest.approx(64.0)
    assert fig.ttft_s is None and fig.tpot_s is None and fig.itl_s == ()


def test_failed_or_zero_time_samples_are_refused():
    with pytest.raises(ValueError):
        core.request_figures(sample(error="HTTP 400: too long"))
    with pytest.raises(ValueError, match="not after start"):
        core.request_figures(sample(start=3.0, end=3.0))


def test_percentile_interpolates_like_numpy():
    vals = [1.0, 2.0, 3.0, 4.0]
    assert core.percentile(vals, 50) == 2.5
    assert core.percentile(vals, 90) == pytest.approx(3.7)
    assert core.percentile(vals, 0) == 1.0 and core.percentile(vals, 100) == 4.0
    assert core.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        core.percentile([], 50)


def test_spread_and_compare_rules():
    a = core.Spread.of([50.0, 52.0, 51.0])
    assert (a.n, a.min, a.median, a.max) == (3, 50.0, 51.0, 52.0)
    overlapping = core.Spread.of([51.5, 53.0, 52.5])
    v = core.compare(a, overlapping, names=("spark1", "spark2"))
    assert v.winner is None and "cannot be told apart at this spread" in v.text
    far = core.Spread.of([33.0, 34.0, 34.5])  # the wedged GX10
    v = core.compare(a, far, names=("spark1", "spark2"))
    assert v.winner == "spark1" and v.ratio == pytest.approx(51.0 / 34.0)
    # Lower-is-better figures (TTFT) flip the winner.
    v = core.compare(a, far, names=("x", "y"), higher_is_better=False)
    assert v.winner == "y"


def test_single_runs_within_noise_floor_are_not_a_win():
    # Runbook: 47.3 vs 47.5 tok/s was "within noise".
    v = core.compare(core.Spread.of([47.3]), core.Spread.of([47.5]))
    assert v.winner is None
    v = core.compare(core.Spread.of([47.3]), core.Spread.of([52.0]))
    assert v.winner == "b"


def test_isolation_refuses_a_busy_node_and_names_the_counter():
    core.isolation_check({core.METRIC_RUNNING: 0.0, core.METRIC_WAITING: 0.0})
    with pytest.raises(core.BenchRefused, match=r"num_requests_running = 2 .*Drain"):
        core.isolation_check({core.METRIC_RUNNING: 2.0, core.METRIC_WAITING: 0.0}, where="spark2")
    with pytest.raises(core.BenchRefused, match="num_requests_waiting = 1"):
        core.isolation_check({core.METRIC_RUNNING: 0.0, core.METRIC_WAITING: 1.0})
    with pytest.raises(core.BenchRefused, match="cannot verify"):
        core.isolation_check({"process_cpu_seconds_total": 3.0})


def test_counter_check_matches_and_reports_acceptance():
    samples = [sample(tokens=100, prompt_tokens=10), sample(tokens=28, prompt_tokens=12)]
    before = {core.METRIC_GENERATION: 1000.0, core.METRIC_PROMPT: 50.0,
              core.METRIC_DRAFTED: 200.0, core.METRIC_ACCEPTED: 190.0}
    after = {core.METRIC_GENERATION: 1128.0, core.METRIC_PROMPT: 72.0,
             core.METRIC_DRAFTED: 288.0, core.METRIC_ACCEPTED: 273.6}
    check = core.counter_check(before, after, samples)
    assert check.tokens_match and check.generation_tokens == 128
    assert check.prompt_tokens == 22 and check.client_prompt_tokens == 22
    assert check.acceptance_rate == pytest.approx(83.6 / 88)
    assert "acceptance 95.0%" in check.text
    after[core.METRIC_GENERATION] = 1200.0
    bad = core.counter_check(before, after, samples)
    assert not bad.tokens_match and "+72" in bad.text and "other traffic" in bad.text


def test_counter_check_without_spec_decode_has_no_rate():
    check = core.counter_check({core.METRIC_GENERATION: 0.0}, {core.METRIC_GENERATION: 5.0},
                               [sample(tokens=5)])
    assert check.acceptance_rate is None and check.tokens_match


def test_plan_suite_refuses_bad_choices():
    plan = core.plan_suite("all", concurrency=8, repeats=2)
    assert [ph for ph, _, _ in plan.phases] == ["recipe", "loaded"]
    assert plan.total_requests() == (5 + 8) * 2
    assert plan.phases[1][1][0].max_tokens == core.LOADED_MAX_TOKENS
    for bad in ({"suite": "fast"}, {"suite": "recipe", "concurrency": 0},
                {"suite": "recipe", "repeats": 0}):
        with pytest.raises(core.BenchRefused):
            core.plan_suite(**bad)


def _recipe_samples(rate_by_repeat):
    out = []
    t = 0.0
    for repeat, rate in enumerate(rate_by_repeat):
        for p in core.RECIPE_PROMPTS:
            secs = p.max_tokens / rate
            out.append(sample(prompt=p.name, repeat=repeat, tokens=p.max_tokens, start=t,
                              end=t + secs, chunks=[t + 0.1, t + secs]))
            t += secs
    return out


def test_build_report_excludes_warmup_and_renders_table():
    plan = core.plan_suite("recipe", repeats=3)
    samples = _recipe_samples([10.0, 50.0, 54.0])  # warm-up run is far slower
    report = core.build_report(samples, plan, base_url="http://127.0.0.1:8000", model="qwen",
                               suite="recipe", concurrency=1)
    assert report.warmup_repeats == 1
    qa = report.prompts[0]
    assert qa.prompt == "Q&A" and qa.measured == 2
    assert (qa.tok_s.min, qa.tok_s.max) == (pytest.approx(50.0), pytest.approx(54.0))
    assert report.recipe_mean_tok_s.median == pytest.approx(52.0)
    table = core.render_markdown(report)
    assert "| Q&A | 256 |" in table and "51.3" in table and "**Mean**" in table
    assert "52.0 (50.0-54.0)" in table
    data = report.to_dict()
    assert data["reference_mean_tok_s"] == 51.6
    assert data["prompts"][4]["prompt"] == "LongCode"
    assert "| **Mean** | | | | **52.0 (50.0-54.0)** | 51.6 | 101% |" in table
    # A fleet's own reference (bench.reference_tok_s) is what both the table and the data compare with.
    own = core.build_report(samples, plan, base_url="http://127.0.0.1:8000", model="qwen", suite="recipe",
                            concurrency=1, reference_mean_tok_s=40.0)
    assert "| 40 | 130% |" in core.render_markdown(own) and own.to_dict()["reference_mean_tok_s"] == 40.0


def test_loaded_phase_aggregate_is_tokens_over_span():
    plan = core.plan_suite("loaded", concurrency=4, repeats=1)
    samples = [sample(phase="loaded", prompt="loaded", repeat=0, tokens=128, start=0.0 + i * 0.1,
                      end=2.0 + i * 0.1, chunks=[0.3 + i * 0.1, 2.0 + i * 0.1]) for i in range(4)]
    report = core.build_report(samples, plan, base_url="u", model="m", suite="loaded",
                               concurrency=4)
    ph = report.phases[0]
    assert report.warmup_repeats == 0
    assert ph.aggregate_tok_s.median == pytest.approx(4 * 128 / 2.3)
    assert ph.mean_tok_s.median == pytest.approx(64.0)
    assert "Loaded phase: 4 requests, 4 at once" in core.render_markdown(report)


def test_failures_are_listed_not_averaged():
    plan = core.plan_suite("recipe", repeats=1)
    samples = _recipe_samples([50.0])
    samples[4] = sample(prompt="LongCode", repeat=0, error="HTTP 400: max_tokens too large")
    report = core.build_report(samples, plan, base_url="u", model="m", suite="recipe",
                               concurrency=1)
    assert report.prompts[4].failures == 1 and report.prompts[4].tok_s is None
    assert report.failures == ["recipe/LongCode run 1: HTTP 400: max_tokens too large"]
    assert "Failed requests" in core.render_markdown(report)


def test_the_bench_floor_follows_the_runbooks_two_checks():
    from spark_pipelines.core.gpu import GpuVerdict

    healthy = GpuVerdict(state="healthy", reasons=["under load (util 96%, SM 2450 MHz)"])
    wedged = GpuVerdict(state="wedged", reasons=["2 wedged, 0 healthy of 2 loaded sample(s)"])
    unknown = GpuVerdict(state="unknown", reasons=["none of 3 sample(s) caught the GPU under load"])

    assert core.tok_s_gate(52.0, 40.0, healthy) == (True, "bench 52.0 tok/s >= floor 40")
    # A wedge keeps the node out even above the floor, and names the cold drain.
    promoted, why = core.tok_s_gate(45.0, 40.0, wedged)
    assert not promoted and "PD-firmware wedge" in why and "unplug the brick at the wall 90-120 s" in why
    # Slow at full clock: not the wedge, so the second check (stale torch_compile cache).
    promoted, why = core.tok_s_gate(34.0, 40.0, healthy)
    assert not promoted and "34.0 tok/s < floor 40" in why and "fresh_jit_cache: true" in why
    promoted, why = core.tok_s_gate(None, 40.0, unknown)
    assert not promoted and "no tok/s" in why and "check for the PD-firmware wedge" in why


def test_the_gate_holds_out_a_fast_node_with_low_mtp_acceptance():
    """bench.floor_mtp_acceptance: tok/s alone can pass with broken MTP weights (no drafts accepted)."""
    from spark_pipelines.core.gate import judge
    from spark_pipelines.core.gpu import GpuVerdict

    healthy = GpuVerdict(state="healthy", reasons=["under load"])

    def gate(mean, acceptance, floor):
        return judge("spark2", healthy=True, mean_tok_s=mean, acceptance=acceptance, gpu_verdict=healthy,
                     floor_tok_s=40.0, floor_acceptance=floor)

    g = gate(52.0, 0.95, 0.8)
    assert g.passed and g.why.startswith("bench 52.0 tok/s >= floor 40; MTP acceptance 95.0% >= floor 80%")
    g = gate(52.0, 0.42, 0.8)
    assert (g.passed, g.gate) == (False, "MTP acceptance") and "42.0% < floor 80%" in g.why
    assert "add-mtp-weights.py" in g.why and g.text().startswith("the MTP acceptance gate failed: MTP acceptance 42.0%")
    g = gate(52.0, None, 0.8)
    assert not g.passed and "could not be read" in g.why and "--speculative-config" in g.why
    # No floor set: tok/s and the wedge decide, as before; a slow node's reason is the tok/s one.
    assert gate(52.0, 0.1, None).passed
    g = gate(30.0, 0.1, 0.8)
    assert (g.passed, g.gate) == (False, "bench floor") and "< floor 40" in g.why and "MTP" not in g.why


def test_a_wedged_gpu_is_the_verdict_even_when_it_voided_the_bench():
    """The wedge voids the figure (core.baseline) but it is what the operator must act on."""
    from spark_pipelines.core.gate import judge
    from spark_pipelines.core.gpu import GpuVerdict

    wedged = GpuVerdict(state="wedged", reasons=["2 wedged, 0 healthy of 2 loaded sample(s)"])
    g = judge("spark2", healthy=True, mean_tok_s=45.0, gpu_verdict=wedged, floor_tok_s=40.0,
              void=("the GPU showed the PD-firmware wedge under load",))
    assert (g.passed, g.gate) == (False, "GPU wedge") and "unplug the brick at the wall" in g.why
