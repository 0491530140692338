"""The vLLM stand-in (system python3, stdlib only) under the real bench harness, and its launch
reactions as the runbook describes a GB10: memory check, missing env var, prefix caching, wedge."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from spark_pipelines.cli import main as cli
from spark_pipelines.resources import bench_client
from spark_pipelines.core import diagnosis
from spark_sim.upstream import ENGINE_FILES
from tests.plugins.servers import HEALTHY_GPU, MANDATORY_ENV, RECIPE_FLAGS, STANDIN


def bench(argv) -> int:
    return cli.main(["bench", *argv])


pytestmark = pytest.mark.slow

FIXTURE_METRICS = Path("/work/shared/fixtures/vllm-0.32.0-cpu/metrics.txt")
FAST = {**MANDATORY_ENV, "SIM_TOKENS_PER_SECOND": "520"}  # 10x the runbook's 52: quick tests


def _without(flags, name):
    out = list(flags)
    i = out.index(name)
    del out[i : i + 2]
    return tuple(out)


def _decode_rate(served, requests=6, max_tokens=96):
    report = bench_client.run_bench(served.base_url, served.model, "loaded", requests, 1,
                                    loaded_max_tokens=max_tokens)
    assert report.failures == [] and report.counters.tokens_match
    return report.prompts[0].decode_tok_s.median, report


def test_standin_is_stdlib_only():
    # The node image has Debian's python3 and nothing else: the stand-in and its JIT module
    # (copied beside it) may import only the standard library and each other.
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    own = {name.removesuffix(".py") for name in ENGINE_FILES}
    for name in ENGINE_FILES:
        imports = set(re.findall(r"^\s*(?:from|import) (\w+)", STANDIN.with_name(name).read_text(), re.M))
        assert imports - own <= stdlib, (name, imports - stdlib)


def test_startup_log_reads_like_vllm_on_gb10(healthy_standin):
    ready = diagnosis.milestones(healthy_standin.log())
    assert ready.startup_complete and ready.weights_loaded
    # The runbook's production point: 0.85 GMU, 262,144 context.
    assert ready.kv_tokens == 268_224 and ready.concurrency == pytest.approx(3.81)
    assert ready.concurrency_request_tokens == 262_144
    assert ready.model_load_gib == pytest.approx(66.93)
    assert ready.graph_mode == "cuda-graphs"
    assert diagnosis.diagnose(healthy_standin.log()) == []


def test_openai_endpoints_and_real_metric_names(healthy_standin):
    base = healthy_standin.base_url
    assert httpx.get(base + "/health").status_code == 200
    models = httpx.get(base + "/v1/models").json()
    assert models["data"][0]["id"] == "qwen35-hybrid-v2"
    bad = httpx.post(base + "/v1/chat/completions",
                     json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert bad.status_code == 404 and "does not exist" in bad.json()["error"]["message"]
    too_long = httpx.post(base + "/v1/chat/completions", json={
        "model": healthy_standin.model, "max_tokens": 300_000,
        "messages": [{"role": "user", "content": "x"}]})
    assert too_long.status_code == 400 and "maximum context length" in too_long.text
    text = httpx.get(base + "/metrics").text
    names = set(re.findall(r"^(vllm:[a-z_:]+)\{", text, re.M))
    real = set(re.findall(r"^(vllm:[a-z_:]+)\{", FIXTURE_METRICS.read_text(), re.M))
    spec = {n for n in names if n.startswith("vllm:spec_decode_")}
    assert spec, "speculative config given, spec-decode counters expected"
    assert names - spec <= real, names - spec - real
    parsed = diagnosis.parse_metrics(text)
    assert parsed["vllm:num_requests_running"] == 0
    # The process collector's start time (the soak tells a new engine from the old one by it): the
    # stand-in's names outside vllm: are ones the real vLLM's /metrics has too.
    samples = diagnosis.parse_exposition(text)
    own = {x.name for x in samples if not x.name.startswith(("vllm:", "spark_sim:"))}
    assert "process_start_time_seconds" in own
    assert own <= {x.name for x in diagnosis.parse_exposition(FIXTURE_METRICS.read_text())}, own
    started = [x.value for x in samples if x.name == "process_start_time_seconds"]
    assert len(started) == 1 and 0 < time.time() - started[0] < 3600


def test_non_streaming_reply_has_exact_usage(healthy_standin):
    def ask(**extra):
        return httpx.post(healthy_standin.base_url + "/v1/chat/completions", json={
            "model": healthy_standin.model, "max_tokens": 20, "temperature": 0,
            "messages": [{"role": "user", "content": "What is 7823 * 4519?"}], **extra}, timeout=30).json()
    body = ask(ignore_eos=True)  # forced: decodes max_tokens past the answer's EOS
    assert body["usage"]["completion_tokens"] == 20
    assert body["choices"][0]["finish_reason"] == "length"
    body = ask()  # natural: thinking, the answer, EOS
    msg = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "stop" and msg["content"].strip() == str(7823 * 4519)
    assert body["usage"]["completion_tokens"] == len(msg["reasoning_content"].split()) + 1 < 20


def test_recipe_suite_rate_and_counters(vllm_standin):
    served = vllm_standin(env=FAST)
    report = bench_client.run_bench(served.base_url, served.model, "recipe", 1, 1, ignore_eos=True)
    assert [p.tokens.median for p in report.prompts] == [256, 512, 1024, 64, 2048]  # forced, as the fleet benches
    for p in report.prompts:
        assert p.decode_tok_s.median == pytest.approx(520, rel=0.05), p.prompt
    c = report.counters
    assert c.tokens_match and c.generation_tokens == 256 + 512 + 1024 + 64 + 2048
    assert c.acceptance_rate == pytest.approx(0.95, abs=0.02)  # MTP-2, runbook "~95%"


def test_pacing_holds_at_64_streams(vllm_standin):
    served = vllm_standin(env={**MANDATORY_ENV, "SIM_TOKENS_PER_SECOND": "52"})
    rate, report = _decode_rate(served, requests=64, max_tokens=40)
    assert rate == pytest.approx(52, rel=0.06)
    assert report.counters.generation_tokens == 64 * 40


@pytest.mark.parametrize(
    ("case", "gpu", "flags", "factor"),
    [
        ("wedged", {**HEALTHY_GPU, "state": "wedged", "profile": "gx10"}, RECIPE_FLAGS, 34 / 52),
        ("no-mtp", HEALTHY_GPU, _without(RECIPE_FLAGS, "--speculative-config"), 26 / 52),
        ("no-flashinfer", HEALTHY_GPU, _without(RECIPE_FLAGS, "--attention-backend"), 17 / 52),
    ],
)
def test_degraded_rates_follow_the_runbook(vllm_standin, case, gpu, flags, factor):
    served = vllm_standin(gpu=gpu, flags=flags, env=FAST)
    rate, _ = _decode_rate(served, requests=4, max_tokens=64)
    assert rate == pytest.approx(520 * factor, rel=0.08), case
    if case == "no-flashinfer":
        assert "wrong-attention-backend" in _finding_ids(served.log())


def test_wedge_appearing_after_launch_slows_new_requests(vllm_standin):
    # 256-token answers: a late last token on a loaded CI machine moves a 64-token rate by over 8%.
    served = vllm_standin(env=FAST)
    healthy, _ = _decode_rate(served, requests=3, max_tokens=256)
    Path(served.extra["gpu_file"]).write_text(json.dumps({**HEALTHY_GPU, "state": "wedged"}))
    wedged, _ = _decode_rate(served, requests=3, max_tokens=256)
    assert wedged / healthy == pytest.approx(34 / 52, rel=0.08)


def _finding_ids(log: str) -> set[str]:
    return {f.signature.id for f in diagnosis.diagnose(log)}


def test_a_free_memory_below_gmu_exits_1_with_vllms_error(vllm_standin):
    code, log = vllm_standin.run_to_exit(gpu={**HEALTHY_GPU, "free_gib": 99.0})
    assert code == 1
    assert ("ValueError: Free memory on device cuda:0 (99.00/121.69 GiB) on startup is less "
            "than desired GPU memory utilization (0.85, 103.44 GiB). Decrease GPU memory "
            "utilization or reduce GPU memory used by other processes.") in log
    assert "Loading weights took" not in log  # the check runs before any weight is read
    found = {f.signature.id: f for f in diagnosis.diagnose(log)}
    assert found["free-memory-below-gmu"].values["free_gib"] == "99.00"


def test_b_founders_without_estimate_env_dies_silently_137(vllm_standin):
    env = {k: v for k, v in MANDATORY_ENV.items() if k != "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"}
    code, log = vllm_standin.run_to_exit(env=env)
    assert code == 137
    assert "num_gpu_blocks=0 with num_gpu_blocks_override=512" in log
    assert "Traceback" not in log and "Application startup complete" not in log
    assert "kv-blocks-zero" in _finding_ids(log)


def test_b_gx10_tolerates_missing_env_but_residue_does_not(vllm_standin):
    env = {k: v for k, v in MANDATORY_ENV.items() if k != "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"}
    served = vllm_standin(gpu={**HEALTHY_GPU, "profile": "gx10"}, env=env)
    assert "Application startup complete" in served.log()
    code, log = vllm_standin.run_to_exit(gpu={**HEALTHY_GPU, "state": "residue"})
    assert code == 137 and "num_gpu_blocks=0" in log


def test_c_prefix_caching_crashes_with_hybrid_attention_traceback(vllm_standin):
    code, log = vllm_standin.run_to_exit(flags=RECIPE_FLAGS + ("--enable-prefix-caching",))
    assert code == 1
    assert "Traceback (most recent call last)" in log
    assert re.search(r"Prefix caching is not supported for hybrid .*DeltaNet", log)
    assert "prefix-caching-enabled" in _finding_ids(log)


def test_kv_cache_figures_scale_with_gmu_and_context(vllm_standin):
    flags = list(RECIPE_FLAGS)
    flags[flags.index("--gpu-memory-utilization") + 1] = "0.80"
    flags[flags.index("--max-model-len") + 1] = "131072"
    served = vllm_standin(flags=tuple(flags))
    ready = diagnosis.milestones(served.log())
    assert ready.kv_tokens < 268_224  # less GMU, less KV cache
    # Half the context per request roughly doubles the concurrency, less the smaller cache.
    assert ready.concurrency == pytest.approx(3.81 * 2 * ready.kv_tokens / 268_224, rel=0.01)


def test_sigterm_shuts_down_cleanly(vllm_standin):
    served = vllm_standin()
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(10) == 0
    assert "Application shutdown complete." in served.log()


def test_busy_node_is_refused_and_bad_input_is_one_line(vllm_standin, capsys):
    served = vllm_standin(env={**MANDATORY_ENV, "SIM_TOKENS_PER_SECOND": "52"})

    async def busy_then_bench():
        async with httpx.AsyncClient(timeout=30) as client:
            hold = asyncio.create_task(client.post(served.base_url + "/v1/chat/completions", json={
                "model": served.model, "max_tokens": 200,
                "messages": [{"role": "user", "content": "keep busy"}]}))
            await asyncio.sleep(0.5)
            code = await asyncio.to_thread(lambda a: cli.main(["bench", *a]), [
                "--base-url", served.base_url, "--model", served.model, "--suite", "recipe"])
            hold.cancel()
            return code

    assert asyncio.run(busy_then_bench()) == 2
    err = capsys.readouterr().err
    assert "not isolated" in err and "num_requests_running = 1" in err and "Traceback" not in err

    for argv, needle in [
        (["--base-url", "http://127.0.0.1:9", "--model", "m", "--suite", "loaded"], "cannot reach"),
        (["--base-url", "ftp://x", "--model", "m"], "not an http(s) URL"),
        (["--base-url", served.base_url, "--model", "m", "--suite", "fast"], "invalid choice"),
        (["--base-url", served.base_url, "--model", "m", "--concurrency", "0",
          "--suite", "loaded"], "concurrency"),
        (["--base-url", served.base_url, "--model", "m", "--api-key-env", "NO_SUCH_VAR_X"],
         "NO_SUCH_VAR_X"),
        (["--model", "m"], "--base-url"),
    ]:
        assert bench(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err, (argv, err)
        # One line of error; progress lines ("bench: ...") only once the bench reached the network.
        assert len([ln for ln in err.strip().splitlines() if not ln.startswith("bench: ")]) == 1, err


def test_unknown_model_fails_every_request_with_the_servers_message(healthy_standin, capsys):
    code = bench(["--base-url", healthy_standin.base_url, "--model", "nope",
                                       "--suite", "loaded", "--concurrency", "1", "--repeats", "1"])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_standin_runs_under_debian_python_without_site_packages(tmp_path):
    # -I -S: no user site, no site-packages at all, as in the node image.
    out = subprocess.run(["/usr/bin/python3", "-I", "-S", str(STANDIN), "serve", "--help"],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 0 and "--speculative-config" in out.stdout


def test_gmu_090_fails_on_a_clean_spark_as_the_runbook_says(vllm_standin):
    # Runbook: "0.90 fails on both nodes (107.82 GiB free < 109.52 needed)".
    flags = list(RECIPE_FLAGS)
    flags[flags.index("--gpu-memory-utilization") + 1] = "0.90"
    code, log = vllm_standin.run_to_exit(flags=tuple(flags))
    assert code == 1 and "(107.82/121.69 GiB)" in log and "(0.90, 109.52 GiB)" in log


def test_optional_production_flags_are_accepted(vllm_standin):
    served = vllm_standin(flags=RECIPE_FLAGS + (
        "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder",
        "--enable-chunked-prefill", "--load-format", "fastsafetensors"))
    assert httpx.get(served.base_url + "/health").status_code == 200


def test_quality_suite_tells_healthy_garbage_and_broken_tool_calls_apart(vllm_standin):
    """The quality phase against three stand-ins launched alike but for SIM_ANSWERS: the healthy
    one scores 100 with every check; the unpatched image ("Garbage output") fails every
    deterministic check though it is as fast; a broken tool-call parser fails the tool call only."""
    from spark_pipelines.core import quality

    got = {}
    for mode in ("healthy", "garbage", "broken-tools"):
        served = vllm_standin(env={**FAST, "SIM_ANSWERS": mode})
        got[mode] = bench_client.run_quality(served.base_url, served.model, max_s=120)
        print(f"{mode}: {got[mode].text()}")
    healthy, garbage, broken = got["healthy"], got["garbage"], got["broken-tools"]
    assert healthy.score == 100 and healthy.failed_checks() == {}
    assert [r.mode for r in healthy.runs] == ["sequential", "parallel 4"]
    assert quality.quality_gate(healthy, 50)[0]
    assert set(garbage.failed_checks()) == {quality.CHECK_SMOKE, quality.CHECK_REASONING, quality.CHECK_TOOL_CALL}
    assert garbage.score == 0 and not quality.quality_gate(garbage, 0)[0]
    assert set(broken.failed_checks()) == {quality.CHECK_TOOL_CALL}
    assert "tool-call parser" in broken.failed_checks()[quality.CHECK_TOOL_CALL]
    assert 0 < broken.score < healthy.score


def test_bench_command_runs_the_quality_phase_and_fails_on_a_broken_check(vllm_standin, capsys):
    """`bench --quality`: the fourth phase from a terminal. A healthy server exits 0 with the
    scenario table; the unpatched image (fast garbage) exits 1 and its JSON names the checks."""
    healthy = vllm_standin(env=FAST)
    args = ["--model", healthy.model, "--suite", "loaded", "--concurrency", "1", "--repeats", "1", "--quiet"]
    assert bench(["--base-url", healthy.base_url, *args, "--quality"]) == 0
    out = capsys.readouterr().out
    assert "Quality (spark-quality/" in out and "| **Total** | **100** | **100** |" in out
    garbage = vllm_standin(env={**FAST, "SIM_ANSWERS": "garbage"})
    assert bench(["--base-url", garbage.base_url, *args, "--quality", "--format", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["quality"]["score"] == 0 and "smoke answer" in doc["quality"]["failed_checks"]
    assert doc["prompts"], "the speed phases still ran and are reported"


def test_forced_output_length_is_honoured_and_recorded(vllm_standin):
    """ignore_eos + min_tokens: the Math prompt (a short answer at EOS) decodes max_tokens; without
    them it stops early, and the two runs carry different protocols (never compared)."""
    served = vllm_standin(env={**MANDATORY_ENV, "SIM_TOKENS_PER_SECOND": "2000"})  # 3.9k tokens forced
    forced = bench_client.run_bench(served.base_url, served.model, "recipe", 1, 1, ignore_eos=True)
    natural = bench_client.run_bench(served.base_url, served.model, "recipe", 1, 1)
    math = {r: next(p for p in rep.prompts if p.prompt == "Math") for r, rep in (("f", forced), ("n", natural))}
    assert math["f"].tokens.median == 64 and math["n"].tokens.median < 64
    assert forced.protocol["output_length"] == "forced" and forced.protocol["token_count"] == "server usage"
    assert natural.protocol["key"] != forced.protocol["key"]
