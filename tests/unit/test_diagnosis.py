"""Diagnosis signatures, vLLM readiness milestones and /metrics, on real vLLM 0.32.0 output."""

import re
from pathlib import Path

import pytest

from spark_pipelines.core.diagnosis import (
    SIGNATURES,
    MetricsFormatError,
    diagnose,
    milestones,
    parse_exposition,
    parse_metrics,
)

FIXTURES = Path("/work/shared/fixtures/vllm-0.32.0-cpu")

# GPU-variant lines in the format vLLM prints on CUDA, with the runbook's spark1 figures.
GPU_START = """\
(APIServer pid=1) INFO 06-18 09:00:00 [api_server.py:1] vLLM API server version 0.19.1
(Worker pid=7) INFO 06-18 09:00:20 [gpu_model_runner.py:2] Starting to load model /models/qwen35-122b-hybrid-int4fp8...
(Worker pid=7) INFO 06-18 09:10:02 [default_loader.py:3] Loading weights took 540.21 seconds
(Worker pid=7) INFO 06-18 09:10:05 [gpu_model_runner.py:4] Model loading took 66.93 GiB memory and 545.003 seconds
(Worker pid=7) INFO 06-18 09:11:17 [backends.py:5] torch.compile takes 72.31 s in total
(Worker pid=7) INFO 06-18 09:11:30 [gpu_worker.py:6] Available KV cache memory: 27.25 GiB
(EngineCore pid=5) INFO 06-18 09:11:31 [kv_cache_utils.py:7] GPU KV cache size: 268,224 tokens
(EngineCore pid=5) INFO 06-18 09:11:31 [kv_cache_utils.py:8] Maximum concurrency for 262,144 tokens per request: 3.81x
(Worker pid=7) INFO 06-18 09:11:32 [gpu_model_runner.py:9] Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 51/51
(Worker pid=7) INFO 06-18 09:12:02 [gpu_model_runner.py:10] Graph capturing finished in 30 secs, took 0.52 GiB
(EngineCore pid=5) INFO 06-18 09:12:03 [core.py:11] init engine (profile, create kv cache, warmup model) took 118.40 seconds
(APIServer pid=1) INFO 06-18 09:12:05 [api_server.py:12] Starting vLLM API server 0 on http://0.0.0.0:8000
INFO:     Application startup complete.
"""


def ids(text: str) -> list[str]:
    return [finding.signature.id for finding in diagnose(text)]


@pytest.mark.parametrize("name", ["vllm-eager.log", "vllm-compiled.log"])
def test_healthy_real_logs_have_no_findings(name: str) -> None:
    assert diagnose((FIXTURES / name).read_text()) == []


def test_residue_needs_kv_zero_then_engine_death_and_orders_by_first_line() -> None:
    log = "\n".join(
        [
            "INFO loading",
            "(EngineCore_DP0 pid=9) INFO 06-18 09:11:30 [gpu_worker.py:1] Overriding num_gpu_blocks=0 with num_gpu_blocks_override=512",
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': -9}",
            "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore_DP0': -9}",
        ]
    )
    findings = diagnose(log)
    assert [f.signature.id for f in findings] == ["kv-blocks-zero", "residue-degraded", "enginecore-oom-killed"]
    assert [f.line_number for f in findings] == [2, 3, 3]
    assert findings[0].values == {"override": "512"}
    assert "reboot" in findings[1].signature.fix
    # The same engine death without the num_gpu_blocks=0 line is not residue.
    assert "residue-degraded" not in ids(log.splitlines()[2])


def test_free_memory_error_parses_values_and_never_advises_lower_gmu() -> None:
    line = (
        "ValueError: Free memory on device cuda:0 (99.12/121.69 GiB) on startup is less than "
        "desired GPU memory utilization (0.85, 103.44 GiB). Decrease GPU memory utilization"
    )
    (finding,) = diagnose(line)
    assert finding.signature.id == "free-memory-below-gmu"
    assert finding.values == {"device": "cuda:0", "free_gib": "99.12", "total_gib": "121.69", "gmu": "0.85", "desired_gib": "103.44"}
    assert "do NOT lower" in finding.signature.fix
    short = "ValueError: Free memory (106.0 GiB) < desired (109.46 GiB)"
    assert diagnose(short)[0].values == {"free_gib_short": "106.0", "desired_gib_short": "109.46"}


def test_no_signature_recommends_lowering_gmu() -> None:
    # 2026-06-18 definitive guidance: the OOM fix is the env vars + reboot.
    for sig in SIGNATURES:
        assert "Lower GMU" not in sig.fix and "Drop GMU" not in sig.fix, sig.id
        # 0.80 / 0.78 appear only inside the warning against them.
        rest = sig.fix.replace("do NOT lower it to 0.80/0.78", "")
        assert not re.search(r"0\.80|0\.78", rest), sig.id
        if sig.id in ("kv-blocks-zero", "cuda-oom", "enginecore-oom-killed"):
            assert "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1" in sig.fix


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("nvcc error : 'cicc' died due to signal 9 (Kill signal)", "cicc-oom-killed"),
        ("KeyError: 'model.layers.0.mlp.shared_expert.down_proj.weight_scale_inv not found'", "weight-scale-inv-missing"),
        ("TypeError: INCConfig.get_quant_method() got an unexpected keyword argument 'hf_config'", "incconfig-hf-config"),
        ("ModuleNotFoundError: No module named 'vllm.model_executor.layers.quantization.gptq_marlin'", "gptq-marlin-missing"),
        ("ImportError: libtorch_cuda.so: cannot open shared object file: No such file or directory", "torch-cpu-wheel"),
        ("ValueError: Tokenizer class TokenizersBackend does not exist or is not currently imported.", "tokenizers-backend-missing"),
        ("ImportError: /usr/local/lib/python3.12/dist-packages/vllm/_C.abi3.so: undefined symbol: _ZN2at4cuda26getCurrentCUDABlasHandleEv", "torch-abi-drift"),
        ("AttributeError: '_IncludedRouter' object has no attribute 'path'", "starlette-router"),
        ("non-default args: {'model': '/models/x', 'enable_prefix_caching': True}", "prefix-caching-enabled"),
        ("TimeoutError: RPC call to sample_tokens timed out.", "enginecore-rpc-timeout"),
        ("[rank1]:[E ProcessGroupNCCL.cpp:616] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)", "nccl-timeout"),
        ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "cuda-oom"),
        ("earlyoom: low memory! sending SIGKILL to process 4242 \"VLLM::EngineCore\"", "enginecore-oom-killed"),
        ("(EngineCore_DP0) INFO Using FLASH_ATTN backend.", "wrong-attention-backend"),
    ],
)
def test_each_failure_signature(line: str, expected: str) -> None:
    assert ids("INFO before\n" + line + "\nINFO after") == [expected]


def test_no_prefix_caching_flag_is_not_a_finding() -> None:
    assert ids("vllm serve /m --no-enable-prefix-caching") == []


def test_milestones_of_real_eager_and_compiled_cpu_starts() -> None:
    eager = milestones((FIXTURES / "vllm-eager.log").read_text())
    assert eager.ready and eager.weights_loading_started and eager.weights_loaded
    assert (eager.kv_tokens, eager.concurrency, eager.concurrency_request_tokens) == (4_194_304, 4096.0, 1024)
    assert eager.graph_mode == "eager"
    assert eager.init_engine_seconds == pytest.approx(0.93)
    assert eager.startup_seconds == 34.0  # 15:10:19 -> 15:10:53
    assert eager.server_url == "http://127.0.0.1:8001"
    compiled = milestones((FIXTURES / "vllm-compiled.log").read_text())
    assert compiled.graph_mode == "compiled"
    assert compiled.init_engine_seconds == pytest.approx(34.48)


def test_milestones_accept_gpu_variant_lines() -> None:
    r = milestones(GPU_START)
    assert r.kv_tokens == 268_224 and r.concurrency == 3.81
    assert r.concurrency_request_tokens == 262_144
    assert r.model_load_gib == 66.93 and r.model_load_seconds == pytest.approx(545.003)
    assert r.kv_cache_gib == 27.25
    assert r.graph_mode == "cuda-graphs" and r.graph_capture_seconds == 30
    assert r.init_engine_seconds == pytest.approx(118.4)
    assert r.startup_seconds == 12 * 60 + 5
    assert r.ready


def test_a_start_that_died_is_not_ready() -> None:
    cut = "\n".join(GPU_START.splitlines()[:5])
    r = milestones(cut)
    assert r.weights_loaded and not r.ready
    assert r.kv_tokens is None and r.graph_mode == "compiled" and r.startup_seconds is None


def test_parse_metrics_on_real_vllm_metrics() -> None:
    metrics = parse_metrics((FIXTURES / "metrics.txt").read_text())
    assert metrics == {
        "vllm:num_requests_running": 0.0,
        "vllm:num_requests_waiting": 0.0,
        "vllm:prompt_tokens_total": 34.0,
        "vllm:generation_tokens_total": 84.0,
    }


def test_parse_metrics_sums_engines_and_reads_spec_decode() -> None:
    text = "\n".join(
        [
            "# HELP vllm:num_requests_running x",
            'vllm:num_requests_running{engine="0",model_name="q"} 2.0',
            'vllm:num_requests_running{engine="1",model_name="q"} 1.0',
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="q"} 100',
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="q"} 200',
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="q, \\"b\\""} 190 1700000000000',
        ]
    )
    m = parse_metrics(text)
    assert m["vllm:num_requests_running"] == 3.0
    assert m["vllm:spec_decode_num_accepted_tokens_total"] == 190
    assert m["vllm:spec_decode_num_drafts_total"] == 100
    samples = parse_exposition(text)
    assert samples[-1].labels["model_name"] == 'q, "b"'


def test_every_real_metrics_line_parses() -> None:
    text = (FIXTURES / "metrics.txt").read_text()
    samples = parse_exposition(text)
    data_lines = [l for l in text.splitlines() if l.strip() and not l.startswith("#")]
    assert len(samples) == len(data_lines)
    info = next(s for s in samples if s.name == "vllm:cache_config_info")
    assert info.labels["kv_cache_size_tokens"] == "4194304"


def test_bad_metrics_line_names_the_line() -> None:
    with pytest.raises(MetricsFormatError, match="line 2"):
        parse_exposition("vllm:a 1\nvllm:b{engine=0} 1\n")
    with pytest.raises(MetricsFormatError, match="not a number"):
        parse_exposition("vllm:a abc\n")
