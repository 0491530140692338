"""The runbook's troubleshooting knowledge as data: vLLM/build logs -> findings.

Also reads the readiness milestones of a vLLM start and vLLM's Prometheus /metrics.

Where the runbook contradicts itself, the 2026-06-18 definitive guidance wins: an
OOM / ``num_gpu_blocks=0`` is fixed by the six mandatory env vars (above all
VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1) plus a reboot to clear residue, never
by lowering GMU to 0.80 / 0.78. Older rows ("Lower GMU to 0.78", "ensure compose
uses --gpu-memory-utilization 0.80", "Drop GMU", the A/B table's "do not add these
env vars") predate that finding: 0.80 passes request_memory() but leaves only
30.4 GiB after the 66.93 GiB of weights, so CUDA graph capture OOM-kills the
EngineCore silently (lessons 10 and 11).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum

from prometheus_client.parser import text_fd_to_metric_families

# The 2026-06-18 mandatory env vars, in the runbook's order.
MANDATORY_ENV_VARS: tuple[tuple[str, str], ...] = (
    ("MAX_JOBS", "2"),
    ("FLASHINFER_NVCC_THREADS", "1"),
    ("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "1"),
    ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),
    ("VLLM_MARLIN_USE_ATOMIC_ADD", "1"),
    ("VLLM_USE_FLASHINFER_SAMPLER", "0"),
)
_ENV_FIX = (
    "set the six mandatory env vars ("
    + ", ".join(f"{k}={v}" for k, v in MANDATORY_ENV_VARS)
    + "); VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 is the critical one"
)
_REBOOT_FIX = (
    "reboot the node (sudo reboot; an AC power cut if free memory stays low), "
    "flush the page cache (sync; echo 3 > /proc/sys/vm/drop_caches), then relaunch"
)
_NOT_LOWER_GMU = (
    "keep --gpu-memory-utilization 0.85; do NOT lower it to 0.80/0.78 (passes "
    "request_memory() but CUDA graph capture then OOM-kills EngineCore)"
)


# The runbook's row for TP=2: "NCCL timeout on worker connect (TP=2 only) | Verify master-addr is
# correct (SPARK1_IP), check firewall for port 29501".
PAIR_ROW = ("verify --master-addr is the head's address on the link (the runbook's SPARK1_IP; the fleet file's "
             "pairs[].link.head_address) and check the firewall for port 29501 (pairs[].master_port)")


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


@dataclass(frozen=True)
class Signature:
    id: str
    pattern: re.Pattern[str]
    cause: str
    fix: str
    runbook_ref: str
    severity: Severity
    # Only reported when the signature with this id matched on an earlier line:
    # lesson 11 reads "num_gpu_blocks=0 ... followed by a silent EngineCore death".
    after: str | None = None


@dataclass(frozen=True)
class Finding:
    signature: Signature
    line: str
    line_number: int  # 1-based
    values: dict[str, str] = field(default_factory=dict)  # named groups of the match


def _re(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.IGNORECASE)


_ENGINE_DEATH = (
    r"(?:Engine core initialization failed|EngineDeadError|EngineCore encountered a fatal error"
    r"|Engine core proc \S+ died unexpectedly|Failed core proc\(s\))"
)

SIGNATURES: tuple[Signature, ...] = (
    Signature(
        id="cicc-oom-killed",
        pattern=_re(r"cicc'? died due to signal 9"),
        cause="FlashInfer JIT spawned ~20-32 parallel cicc processes (1-4 GB each) and "
        "exhausted the 128 GB unified memory",
        fix="add MAX_JOBS=2 and FLASHINFER_NVCC_THREADS=1 (part of the six mandatory env "
        f"vars); {_NOT_LOWER_GMU}",
        runbook_ref="Troubleshooting: 'cicc died due to signal 9'; Critical lesson 1; "
        "row 'OOM during FlashInfer JIT' superseded by 2026-06-18",
        severity=Severity.ERROR,
    ),
    Signature(
        id="free-memory-below-gmu",
        pattern=_re(
            r"Free memory on device (?P<device>\S+) \((?P<free_gib>[\d.]+)/(?P<total_gib>[\d.]+) GiB\)"
            r"(?: on startup)?(?: is)? less than desired GPU memory utilization "
            r"\((?P<gmu>[\d.]+), (?P<desired_gib>[\d.]+) GiB\)"
            r"|Free memory \((?P<free_gib_short>[\d.]+) GiB\) < desired \((?P<desired_gib_short>[\d.]+) GiB\)"
        ),
        cause="free CUDA memory is below GMU x total: crash-loop CUDA context residue, "
        "nvidia_gpu_exporter holding ~9 GiB, desktop services, or a GMU above 0.85",
        # The table row says "ensure compose uses 0.80": superseded (module docstring).
        fix="stop and rm the container, stop nvidia_gpu_exporter, "
        f"{_REBOOT_FIX}; {_NOT_LOWER_GMU}; 0.90 fails on both nodes",
        runbook_ref="Troubleshooting: 'ValueError: Free memory on device cuda:0 ... less than "
        "desired GPU memory utilization'; GB10 memory reality (2026-06-18); lessons 9-11",
        severity=Severity.ERROR,
    ),
    Signature(
        id="kv-blocks-zero",
        pattern=_re(
            r"num_gpu_blocks=0\b.*num_gpu_blocks_override=(?P<override>\d+)"
            r"|No available memory for the cache blocks"
        ),
        cause="CUDA graph capture consumed the headroom during profiling, leaving 0 KV "
        "blocks (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 missing, or residue)",
        fix=f"{_ENV_FIX}; {_NOT_LOWER_GMU}; if it repeats, {_REBOOT_FIX}",
        runbook_ref="MANDATORY ENV VARS (2026-06-18); Critical lesson 11",
        severity=Severity.CRITICAL,
    ),
    Signature(
        id="residue-degraded",
        pattern=_re(_ENGINE_DEATH + r"|exited with code 137"),
        cause="num_gpu_blocks=0 followed by EngineCore death: the node is residue-degraded "
        "(each failed start leaves CUDA context residue that docker rm cannot clear)",
        fix=f"{_REBOOT_FIX} (docker compose up -d); {_ENV_FIX}",
        runbook_ref="Critical lesson 11 (reboot before retrying)",
        severity=Severity.CRITICAL,
        after="kv-blocks-zero",
    ),
    Signature(
        id="enginecore-oom-killed",
        pattern=_re(
            r"Failed core proc\(s\):.*-9\b|Out of memory: Killed process"
            r"|earlyoom.*(?:sending SIGKILL|killing)|exited with code 137"
            r"|EngineCore\S*.*(?:died|killed).*(?:signal 9|SIGKILL)"
        ),
        cause="the EngineCore was SIGKILLed (OOM-killer or earlyoom) during warmup / CUDA "
        "graph capture: the memory spike of an un-estimated graph capture",
        fix=f"{_ENV_FIX}; apt purge earlyoom; stop nvidia_gpu_exporter before launch; "
        f"{_NOT_LOWER_GMU}; after repeated failures {_REBOOT_FIX}",
        runbook_ref="Troubleshooting: 'Engine init failed, no completion tokens' ('Drop GMU' "
        "superseded by 2026-06-18); Hazards (1); 'Repeated OOM after retry'",
        severity=Severity.CRITICAL,
    ),
    Signature(
        id="engine-died",
        pattern=_re(_ENGINE_DEATH + r"(?!.*-9\b)"),
        cause="the EngineCore died during start-up; the root cause is on an earlier line "
        "(no traceback at all usually means a silent OOM-kill)",
        fix=f"read the lines above; if there is no traceback treat it as an OOM-kill: {_ENV_FIX}",
        runbook_ref="Troubleshooting: 'Engine init failed, no completion tokens'",
        severity=Severity.ERROR,
    ),
    Signature(
        id="cuda-oom",
        pattern=_re(r"CUDA out of memory|CUDA error: out of memory|torch\.OutOfMemoryError"),
        cause="CUDA allocation failed, typically during CUDA graph capture on first start",
        fix=f"{_ENV_FIX}; {_NOT_LOWER_GMU}",
        runbook_ref="MANDATORY ENV VARS (2026-06-18); upstream 'OOM during CUDA graph capture'",
        severity=Severity.CRITICAL,
    ),
    Signature(
        id="enginecore-rpc-timeout",
        pattern=_re(
            r"RPC call to \S+ timed out|TimeoutError:.*(?:EngineCore|engine core|RPC)"
            r"|timed out waiting for (?:the )?engine"
        ),
        cause="EngineCore stopped answering under unified-memory pressure (page cache, "
        "other processes, swap-like stalls)",
        fix="flush the page cache, stop exporters and other memory users, check swap is off; "
        f"if it persists {_REBOOT_FIX}",
        runbook_ref="Upstream failure signatures: 'EngineCore RPC timeouts'; lesson 2 (page cache)",
        severity=Severity.ERROR,
    ),
    Signature(
        id="weight-scale-inv-missing",
        pattern=_re(r"weight_scale_inv\b.*not found|not found.*weight_scale_inv"),
        cause="the hybrid INT4+FP8 checkpoint/patch 01 is not applied (no FP8 scales)",
        fix="rebuild the serving image with patch 01 (inc.py) and the hybrid checkpoint",
        runbook_ref="Troubleshooting: 'weight_scale_inv not found'",
        severity=Severity.ERROR,
    ),
    Signature(
        id="incconfig-hf-config",
        pattern=_re(r"INCConfig.*hf_config|hf_config.*INCConfig|unexpected keyword argument 'hf_config'"),
        cause="the image carries the unpatched inc.py (no hf_config=None in two signatures)",
        fix="rebuild with the SM121-adapted inc.py (INC Fix section)",
        runbook_ref="Troubleshooting: 'INCConfig hf_config error'; INC Fix",
        severity=Severity.ERROR,
    ),
    Signature(
        id="gptq-marlin-missing",
        pattern=_re(r"ModuleNotFoundError: No module named '[\w.]*\bgptq(?:_marlin)?'"),
        cause="the SM121 vLLM build has auto_gptq.py but not gptq.py / gptq_marlin.py",
        fix="rebuild the image with inc.py aliasing the AutoGPTQ classes to GPTQ/GPTQMarlin",
        runbook_ref="Troubleshooting: 'gptq_marlin / gptq ModuleNotFoundError'; INC Fix",
        severity=Severity.ERROR,
    ),
    Signature(
        id="torch-cpu-wheel",
        pattern=_re(r"libtorch_cuda\.so"),
        cause="uv replaced torch with a +cpu wheel during the image build",
        fix="pin the torch triple of the fleet file's pins.torch (exact +cu130 builds) from the cu130 "
        "index with an override so uv cannot swap it; check torch.__version__ has +cu",
        runbook_ref="Upstream failure signatures: 'ImportError: libtorch_cuda.so'; torch triple",
        severity=Severity.ERROR,
    ),
    Signature(
        id="tokenizers-backend-missing",
        pattern=_re(r"Tokenizer class TokenizersBackend does not exist"),
        cause="the base image was built without transformers 5",
        fix="rebuild the base image with build-and-copy.sh --tf5",
        runbook_ref="Upstream failure signatures: 'TokenizersBackend' without --tf5; Phase 3 build",
        severity=Severity.ERROR,
    ),
    Signature(
        id="torch-abi-drift",
        pattern=_re(r"undefined symbol:?.*getCurrentCUDABlasHandle"),
        cause="torch ABI drift: the build stages installed different torch versions",
        fix="use the same pinned torch triple in BOTH Dockerfile stages and rebuild",
        runbook_ref="Upstream failure signatures: 'undefined symbol getCurrentCUDABlasHandle'; "
        "Phase 3 ('same version in BOTH stages')",
        severity=Severity.ERROR,
    ),
    Signature(
        id="starlette-router",
        pattern=_re(r"_IncludedRouter"),
        cause="--tf5 pulled Starlette 1.x, which removed _IncludedRouter.path used by vLLM 0.19",
        fix="pin starlette below 1.0 and fastapi to match, as the fleet file's pins.serving does, "
        "in docker/Dockerfile.v2 (the serving_image step does it)",
        runbook_ref="Key fix: Starlette 1.x breaks vLLM 0.19 router; Phase 3 serving image",
        severity=Severity.ERROR,
    ),
    Signature(
        id="prefix-caching-enabled",
        pattern=_re(r"'enable_prefix_caching': True|(?<![\w-])--enable-prefix-caching\b"),
        cause="--enable-prefix-caching crashes Qwen3.5 (DeltaNet hybrid attention) in vLLM 0.19",
        fix="remove --enable-prefix-caching from the launch profile",
        runbook_ref="Phase 4 launch: 'IMPORTANT: --enable-prefix-caching CRASHES on Qwen3.5'",
        severity=Severity.ERROR,
    ),
    # A node pair (Phase 4-alt, TP=2 over two nodes): the head (rank 0) holds torch's store on
    # --master-port, the worker (rank 1) connects to --master-addr; then NCCL runs over the link.
    Signature(
        id="pair-head-alone",
        pattern=_re(r"DistStoreError: Timed out after \d+ seconds waiting for clients\. (?P<joined>\d+)/(?P<world>\d+) "
                    r"clients joined"),
        cause="the head (rank 0) waited on --master-port and the worker (rank 1) never joined: the head was "
        "started alone (the worker not running, or started after the head's wait ended)",
        fix=f"start the worker first, then the head ~15 s later; {PAIR_ROW}",
        runbook_ref="Phase 4-alt: 'WORKER (rank 1) FIRST, then HEAD (rank 0) after ~15s'; Troubleshooting: "
        "'NCCL timeout on worker connect (TP=2 only)'",
        severity=Severity.ERROR,
    ),
    Signature(
        id="pair-worker-never-connects",
        pattern=_re(r"client socket has timed out after \d+ms while trying to connect to "
                    r"\((?P<master_addr>[^,\s]+), (?P<master_port>\d+)\)"),
        cause="the worker (rank 1) could not reach the head's --master-addr:--master-port: a wrong master "
        "address (not the head's address on the link), a firewalled port, or no link",
        fix=PAIR_ROW,
        runbook_ref="Troubleshooting: 'NCCL timeout on worker connect (TP=2 only)'; Phase 4-alt",
        severity=Severity.ERROR,
    ),
    Signature(
        id="nccl-timeout",
        pattern=_re(r"NCCL.*(?:timeout|timed out)|Watchdog caught collective operation timeout"),
        cause="NCCL between the pair's ranks stopped: the other node's engine went away or the link dropped "
        "(TP=2: the worker down is the pair down)",
        fix=f"check both nodes' containers and the link, then deploy the pair again (worker first); {PAIR_ROW}",
        runbook_ref="Troubleshooting: 'NCCL timeout on worker connect (TP=2 only)'; Phase 4-alt",
        severity=Severity.ERROR,
    ),
    Signature(
        id="torch-nightly-gone",
        pattern=_re(
            r"(?:No matching distribution found|Could not find a version that satisfies the "
            r"requirement).*torch==2\.12\.0\.dev"
        ),
        cause="the pinned torch nightly rolled off the index (issue #15)",
        fix="use the stable cu130 triple (the fleet file's pins.torch), not a nightly",
        runbook_ref="Intro: resolves issue #15; torch triple",
        severity=Severity.ERROR,
    ),
    Signature(
        id="wrong-attention-backend",
        pattern=_re(r"Using (?:FLASH_ATTN|TRITON_ATTN|TORCH_SDPA|XFORMERS)\w* backend"),
        cause="vLLM did not select FlashInfer attention (~17 tok/s instead of ~50)",
        fix="add --attention-backend FLASHINFER to the launch profile",
        runbook_ref="Troubleshooting: 'Only ~17 tok/s (half expected)'",
        severity=Severity.WARNING,
    ),
    Signature(
        id="run-script-missing",
        pattern=_re(r"/tmp/run-[\w-]+\.sh(?::| not found| No such file)"),
        cause="/tmp was wiped on reboot",
        fix="recreate the launch script (the pipeline renders it from the launch profile)",
        runbook_ref="Troubleshooting: '/tmp/run-mtp2.sh not found'",
        severity=Severity.WARNING,
    ),
    Signature(
        id="stale-jit-cache",
        pattern=_re(r"stale (?:torch_compile|Triton|FlashInfer JIT) cache"),
        cause="a compile cache made for another image, checkpoint or kernel-shaping flag is mounted",
        fix="deploy the node with fresh_jit_cache: true (the runbook: wipe ~/.cache/vllm or ~/.triton with sudo, "
            "relaunch); a shipped cache that did this is dropped and its key's archive marked bad by the deploy",
        runbook_ref="Troubleshooting: 'stale torch_compile cache' and 'Stale Triton cache'",
        severity=Severity.ERROR,
    ),
    Signature(
        id="jit-cache-permission",
        pattern=_re(r"cannot remove .*(?:\.cache/vllm|\.cache/flashinfer|\.triton).*Permission denied"),
        cause="JIT cache files are owned by root (created inside the container)",
        fix="sudo rm -rf ~/.cache/vllm ~/.cache/flashinfer ~/.triton",
        runbook_ref="Troubleshooting: 'JIT cache permission denied on wipe'",
        severity=Severity.WARNING,
    ),
    Signature(
        id="gpu-exporter-invalid-metric",
        pattern=_re(r"invalid metric name"),
        cause="GB10 has non-standard clocks_event_reasons fields that nvidia_gpu_exporter trips on",
        fix="start the exporter with an explicit --query-field-names list (runbook row)",
        runbook_ref="Troubleshooting: 'nvidia_gpu_exporter panic (invalid metric name)'",
        severity=Severity.WARNING,
    ),
)

_BY_ID = {signature.id: signature for signature in SIGNATURES}
assert len(_BY_ID) == len(SIGNATURES), "signature ids must be unique"


def signature(signature_id: str) -> Signature:
    try:
        return _BY_ID[signature_id]
    except KeyError:
        raise KeyError(f"no diagnosis signature {signature_id!r}") from None


def diagnose(log_text: str) -> list[Finding]:
    """Every signature that matches, once each, ordered by its first matching line."""
    findings: dict[str, Finding] = {}
    for number, line in enumerate(log_text.splitlines(), start=1):
        for sig in SIGNATURES:
            if sig.id in findings:
                continue
            if sig.after is not None and sig.after not in findings:
                continue
            match = sig.pattern.search(line)
            if match is None:
                continue
            values = {k: v for k, v in match.groupdict().items() if v is not None}
            findings[sig.id] = Finding(sig, line.strip(), number, values)
    return sorted(findings.values(), key=lambda f: f.line_number)


# ------------------------------------------------------------- readiness milestones

_TIMESTAMP = re.compile(r"\b(?P<month>\d\d)-(?P<day>\d\d) (?P<time>\d\d:\d\d:\d\d)\b")


@dataclass(frozen=True)
class Milestone:
    name: str
    line_number: int
    line: str
    at: str | None  # vLLM's "MM-DD HH:MM:SS" stamp, when the line carries one


@dataclass(frozen=True)
class Readiness:
    milestones: tuple[Milestone, ...]
    weights_loading_started: bool
    weights_loaded: bool
    model_load_gib: float | None
    model_load_seconds: float | None
    kv_cache_gib: float | None
    kv_tokens: int | None
    concurrency: float | None
    concurrency_request_tokens: int | None
    graph_mode: str | None  # "cuda-graphs" | "eager" | "compiled" | None (not reached)
    graph_capture_seconds: float | None
    init_engine_seconds: float | None
    server_url: str | None
    startup_complete: bool
    startup_seconds: float | None  # first stamped line -> server start, from log stamps

    @property
    def ready(self) -> bool:
        return self.startup_complete

    def reached(self, name: str) -> bool:
        return any(m.name == name for m in self.milestones)


_MILESTONES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("weights-loading", re.compile(r"Starting to load model\b")),
    ("shards-loaded", re.compile(r"Loading safetensors checkpoint shards: 100%")),
    ("model-initialized", re.compile(r"Initializing model took (?P<seconds>[\d.]+) seconds")),
    ("weights-loaded", re.compile(r"Loading weights took (?P<seconds>[\d.]+) seconds")),
    (
        "model-loaded",
        re.compile(
            r"Model loading took (?P<gib>[\d.]+) GiB(?: memory)? and (?P<seconds>[\d.]+) seconds"
        ),
    ),
    ("torch-compile", re.compile(r"torch\.compile take?s? (?P<seconds>[\d.]+) s")),
    ("compile-warmup", re.compile(r"Warming up model for the compilation")),
    ("kv-cache-memory", re.compile(r"Available KV cache memory: (?P<gib>[\d.]+) GiB")),
    ("kv-cache", re.compile(r"(?:GPU |CPU |XPU )?KV cache size: (?P<tokens>[\d,]+) tokens")),
    (
        "max-concurrency",
        re.compile(
            r"Maximum concurrency for (?P<request>[\d,]+) tokens per request: (?P<x>[\d.]+)x"
        ),
    ),
    ("eager-mode", re.compile(r"Enforce eager set|enforce_eager=True|Cudagraph is disabled")),
    ("graph-capture", re.compile(r"Capturing CUDA graphs")),
    (
        "graph-captured",
        re.compile(r"Graph capturing finished in (?P<seconds>[\d.]+) secs?"),
    ),
    (
        "engine-initialized",
        re.compile(r"init engine \(profile, create kv cache, warmup model\) took (?P<seconds>[\d.]+) s"),
    ),
    ("server-starting", re.compile(r"Starting vLLM (?:API )?server(?: \d+)? on (?P<url>\S+)")),
    ("startup-complete", re.compile(r"Application startup complete")),
)


def _stamp_seconds(stamp: str) -> float:
    month, day, clock = re.fullmatch(r"(\d\d)-(\d\d) (\S+)", stamp).groups()  # type: ignore[union-attr]
    # No year in vLLM stamps; a fixed leap year keeps Feb 29 valid.
    when = dt.datetime.strptime(f"2024-{month}-{day} {clock}", "%Y-%m-%d %H:%M:%S")
    return when.timestamp()


def milestones(log_text: str) -> Readiness:
    """Where a vLLM start got to, with the figures its log prints on the way."""
    found: list[Milestone] = []
    first: dict[str, re.Match[str]] = {}
    first_stamp: str | None = None
    for number, line in enumerate(log_text.splitlines(), start=1):
        stamp_match = _TIMESTAMP.search(line)
        stamp = stamp_match.group(0) if stamp_match else None
        if stamp and first_stamp is None:
            first_stamp = stamp
        for name, pattern in _MILESTONES:
            if name in first:
                continue
            match = pattern.search(line)
            if match:
                first[name] = match
                found.append(Milestone(name, number, line.strip(), stamp))

    def num(name: str, group: str) -> float | None:
        match = first.get(name)
        return None if match is None else float(match.group(group).replace(",", ""))

    load_seconds = num("model-loaded", "seconds")
    if load_seconds is None:
        load_seconds = num("weights-loaded", "seconds")
    if load_seconds is None:
        load_seconds = num("model-initialized", "seconds")
    kv_tokens = num("kv-cache", "tokens")
    request_tokens = num("max-concurrency", "request")
    if "graph-capture" in first or "graph-captured" in first:
        graph_mode: str | None = "cuda-graphs"
    elif "eager-mode" in first:
        graph_mode = "eager"
    elif "torch-compile" in first or "compile-warmup" in first:
        graph_mode = "compiled"
    else:
        graph_mode = None

    startup_seconds = None
    server = next((m for m in found if m.name == "server-starting"), None)
    if server is not None and server.at and first_stamp:
        delta = _stamp_seconds(server.at) - _stamp_seconds(first_stamp)
        startup_seconds = delta if delta >= 0 else delta + 366 * 86400  # crossed New Year

    return Readiness(
        milestones=tuple(found),
        weights_loading_started="weights-loading" in first,
        weights_loaded=any(n in first for n in ("model-initialized", "weights-loaded", "model-loaded")),
        model_load_gib=num("model-loaded", "gib"),
        model_load_seconds=load_seconds,
        kv_cache_gib=num("kv-cache-memory", "gib"),
        kv_tokens=None if kv_tokens is None else int(kv_tokens),
        concurrency=num("max-concurrency", "x"),
        concurrency_request_tokens=None if request_tokens is None else int(request_tokens),
        graph_mode=graph_mode,
        graph_capture_seconds=num("graph-captured", "seconds"),
        init_engine_seconds=num("engine-initialized", "seconds"),
        server_url=first["server-starting"].group("url") if "server-starting" in first else None,
        startup_complete="startup-complete" in first,
        startup_seconds=startup_seconds,
    )


# ------------------------------------------------------------------ /metrics parsing

# vLLM's Prometheus names (from a real 0.32.0 /metrics and vLLM's spec-decode metrics); every
# reader of /metrics (bench, preflight, wedge_watch) takes them from here. Counters carry _total.
METRIC_RUNNING = "vllm:num_requests_running"
METRIC_WAITING = "vllm:num_requests_waiting"
METRIC_PROMPT = "vllm:prompt_tokens_total"
METRIC_GENERATION = "vllm:generation_tokens_total"
METRIC_DRAFTS = "vllm:spec_decode_num_drafts_total"
METRIC_DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
METRIC_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
# The figures the pipeline acts on.
METRICS_OF_INTEREST: tuple[str, ...] = (
    METRIC_RUNNING, METRIC_WAITING, METRIC_PROMPT, METRIC_GENERATION, METRIC_DRAFTS, METRIC_DRAFTED, METRIC_ACCEPTED,
)


class MetricsFormatError(ValueError):
    """A /metrics line that is not Prometheus text exposition format."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse_exposition(text: str) -> list[Sample]:
    """Prometheus text exposition format -> samples, by prometheus_client's own parser.

    A bad line raises MetricsFormatError naming its line number: the parser reads lines lazily,
    so the line being read when it fails is the bad one.
    """
    lines = text.splitlines()
    read = 0

    def numbered() -> Iterator[str]:
        nonlocal read
        for read, line in enumerate(lines, start=1):  # noqa: B007 (read is the failing line's number)
            yield line

    try:
        return [Sample(s.name, dict(s.labels), float(s.value))
                for family in text_fd_to_metric_families(numbered()) for s in family.samples]
    except ValueError as e:
        bad = lines[read - 1].strip() if 0 < read <= len(lines) else ""
        why = "value is not a number" if "could not convert" in str(e) else str(e)
        raise MetricsFormatError(f"/metrics line {read}: {why}: {bad[:80]!r}") from None


def parse_metrics(text: str) -> dict[str, float]:
    """vLLM /metrics -> {name: value summed over label sets (engines, models)}.

    Only metrics present in the text appear, so spec-decode counters show up only
    on a server running speculative decoding.
    """
    totals: dict[str, float] = {}
    for sample in parse_exposition(text):
        if sample.name in METRICS_OF_INTEREST:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals
