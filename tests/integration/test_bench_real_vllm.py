"""The bench harness against a REAL vLLM (CPU, tiny random-weight Llama), directly and through a
REAL LiteLLM proxy: the token counts the client adds up must equal vLLM's own counters."""

from __future__ import annotations

import json

import httpx
import pytest

from spark_pipelines.cli import main as cli
from spark_pipelines.resources import bench_client
from spark_pipelines.core import bench as core
from spark_pipelines.core.diagnosis import parse_metrics


def bench(argv) -> int:
    return cli.main(["bench", *argv])


pytestmark = pytest.mark.slow


def _generation_total(base_url: str) -> float:
    return parse_metrics(httpx.get(base_url + "/metrics", timeout=10).text)[core.METRIC_GENERATION]


def test_recipe_suite_direct_matches_server_counters(real_vllm):
    report = bench_client.run_bench(real_vllm.base_url, real_vllm.model, "all", 4, 2)
    assert report.isolation.startswith("verified idle")
    assert report.failures == []
    names = [p.prompt for p in report.prompts if p.phase == "recipe"]
    assert names == ["Q&A", "Code", "JSON", "Math", "LongCode"]
    for p in report.prompts:
        assert p.measured == (1 if p.phase == "recipe" else 4)
        assert 0 < p.tokens.median <= p.max_tokens
        # The recipe's tok/s stays below the decode-only rate: it also pays for TTFT.
        if p.tokens.median > 8:  # random weights may stop early; short replies prove little
            assert p.tok_s.median <= p.decode_tok_s.median * 1.001
        assert 0 < p.ttft_s.median < p.seconds.median
    c = report.counters
    assert c is not None and c.tokens_match, c.text
    assert c.generation_tokens == c.client_completion_tokens > 0
    # Prompt tokens as counted by vLLM's tokenizer equal the usage the client received.
    assert c.prompt_tokens == c.client_prompt_tokens
    assert c.acceptance_rate is None  # no speculative decoding on this server
    loaded = next(ph for ph in report.phases if ph.phase == "loaded")
    assert loaded.aggregate_tok_s.median > 0 and loaded.itl_p99_s >= loaded.itl_p50_s


def test_non_streaming_mode_counts_the_same_tokens(real_vllm):
    before = _generation_total(real_vllm.base_url)
    report = bench_client.run_bench(real_vllm.base_url, real_vllm.model, "loaded", 2, 1,
                                    stream=False, loaded_max_tokens=32)
    after = _generation_total(real_vllm.base_url)
    p = report.prompts[0]
    assert p.ttft_s is None  # nothing streamed, nothing to time
    assert report.counters.tokens_match
    assert after - before == report.counters.client_completion_tokens


def test_through_real_litellm_proxy(real_vllm, real_litellm, capsys):
    """Gateway path: requests via LiteLLM, counters read from the vLLM behind it."""
    argv = ["--base-url", real_litellm.base_url, "--model", real_litellm.model,
            "--suite", "loaded", "--concurrency", "3", "--repeats", "2", "--format", "json",
            "--api-key-env", real_litellm.extra["key_env"],
            "--metrics-url", real_vllm.base_url + "/metrics"]
    assert bench(argv) == 0
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert data["failures"] == []
    assert data["counters"]["tokens_match"], data["counters"]["text"]
    assert data["counters"]["generation_tokens"] == data["counters"]["client_completion_tokens"]
    p = data["prompts"][0]
    assert p["measured"] == 3 and p["tok_s"]["median"] > 0 and p["ttft_s"]["median"] > 0
    # The master key reached the proxy but never the output.
    import os

    assert os.environ[real_litellm.extra["key_env"]] not in out + err


def test_litellm_without_key_is_one_clear_error(real_litellm, capsys):
    argv = ["--base-url", real_litellm.base_url, "--model", real_litellm.model,
            "--suite", "loaded", "--concurrency", "1", "--repeats", "1"]
    assert bench(argv) == 2
    err = capsys.readouterr().err
    assert "api key" in err.lower() and "Traceback" not in err
    # One line of error after the progress lines ("bench: ...", on stderr so stdout stays the report).
    assert len([ln for ln in err.strip().splitlines() if not ln.startswith("bench: ")]) == 1, err


def test_quality_phase_on_a_server_without_tool_call_parser_is_reported_not_a_crash(real_vllm):
    """The tiny random-weight model has no reasoning or tool-call parser (vLLM refuses tool_choice
    auto without --enable-auto-tool-choice): every scenario is scored with its reason, the checks
    fail by name, and the gate says so in one line."""
    from spark_pipelines.core import quality

    q = bench_client.run_quality(real_vllm.base_url, real_vllm.model, max_s=300)
    print(q.text())
    assert [r.mode for r in q.runs] == ["sequential", "parallel 4"]
    assert q.score is not None and q.score < 50  # random weights answer nothing right
    tool = next(x for x in q.runs[0].scored if x.deterministic == quality.CHECK_TOOL_CALL)
    assert tool.points == 0 and ("HTTP 400" in tool.why or "no tool call" in tool.why), tool.why
    ok, why = quality.quality_gate(q, 50)
    assert not ok and "\n" not in why and quality.CHECK_TOOL_CALL in why


def test_real_vllm_honours_the_forced_output_length(real_vllm):
    """ignore_eos + min_tokens, as the fleet's bench sends them: every request decodes exactly
    max_tokens and the report records the protocol as forced (server usage counts)."""
    report = bench_client.run_bench(real_vllm.base_url, real_vllm.model, "loaded", 2, 1, ignore_eos=True,
                                    loaded_max_tokens=24)
    assert report.prompts[0].tokens.min == report.prompts[0].tokens.max == 24
    assert report.protocol["output_length"] == "forced" and report.protocol["token_count"] == "server usage"
    assert report.counters.tokens_match
