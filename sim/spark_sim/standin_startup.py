"""The GB10 engine stand-in's launch: its arguments, the node's GPU state, and the start-up log
a GB10 prints with the ways it dies (vllm_standin.py serves once this returns).

Standard library only: copied into the node image beside vllm_standin.py.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
import time

# Beside this file, here and in the image (/opt/sim).
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import standin_jit  # noqa: E402

VERSION = "0.19.1.dev0+g2a69949bd.d20260616.cu132"  # the runbook's pinned, working build
DEFAULT_TOTAL_GIB = 121.69  # GB10 unified memory as vLLM reports it
DEFAULT_FREE_GIB = 107.82  # runbook: clean-boot free memory on a Spark
MODEL_GIB = 66.93  # runbook: "Model loading took 66.93 GiB"
NON_KV_GIB = 4.02  # activations + graphs, chosen so 0.85 GMU gives the runbook's 268,224 tokens
REF_GMU, REF_KV_TOKENS, REF_MAX_LEN, REF_CONCURRENCY = 0.85, 268_224, 262_144, 3.81
KV_BLOCK_TOKENS = 528  # hybrid attention block size; 268,224 = 528 x 508
GRAPH_SIZES = 51  # runbook: "51-size PIECEWISE graph capture"

PID = os.getpid()


# ---------------------------------------------------------------------------------------------
# Logging that looks like vLLM's
# ---------------------------------------------------------------------------------------------


def _log(proc: str, level: str, where: str, msg: str, pid: int = PID) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    sys.stdout.write(f"({proc} pid={pid}) {level} {stamp} [{where}] {msg}\n")
    sys.stdout.flush()


def api(msg: str, where: str = "api_server.py:1", level: str = "INFO") -> None:
    _log("APIServer", level, where, msg)


def engine(msg: str, where: str = "core.py:1", level: str = "INFO") -> None:
    _log("EngineCore_DP0", level, where, msg, PID + 1)


def plain(msg: str) -> None:
    sys.stdout.write(msg + "\n")
    sys.stdout.flush()


def die(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------------------------
# Launch arguments and the node's GPU state
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    if argv and argv[0] == "serve":
        argv = argv[1:]
    p = argparse.ArgumentParser(prog="vllm serve", add_help=True)
    p.add_argument("model_tag", nargs="?")
    p.add_argument("--model")
    p.add_argument("--served-model-name", nargs="+")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-model-len", type=int, default=REF_MAX_LEN)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--reasoning-parser")
    p.add_argument("--attention-backend")
    p.add_argument("--speculative-config")
    p.add_argument("--enable-prefix-caching", action="store_true", default=False)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--api-key")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    # Phase 4-alt: TP=2 over two nodes (standin_pair.py)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--distributed-executor-backend")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29501)
    p.add_argument("--headless", action="store_true")
    args, unknown = p.parse_known_args(argv)
    args.unknown = unknown
    model = args.model or args.model_tag
    if not model:
        plain("vllm serve: error: the following arguments are required: model_tag")
        die(2)
    args.model = model
    args.served = (args.served_model_name or [model])[0]
    args.spec = None
    if args.speculative_config:
        try:
            args.spec = json.loads(args.speculative_config)
        except ValueError:
            plain(f"vllm serve: error: argument --speculative-config: invalid loads value: "
                  f"{args.speculative_config!r}")
            die(2)
    if args.nnodes > 1 and (args.tensor_parallel_size != args.nnodes or args.distributed_executor_backend != "mp"
                            or args.headless != (args.node_rank > 0)):
        plain("vllm serve: error: a multi-node launch here is --tensor-parallel-size N --nnodes N "
              "--distributed-executor-backend mp, --headless on every rank but 0")
        die(2)
    if not 0 < args.gpu_memory_utilization <= 1:
        plain("vllm serve: error: --gpu-memory-utilization must be within (0, 1]")
        die(2)
    return args


class GpuState:
    """The node's GPU as the simulated fleet describes it; re-read when the file changes."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self.mtime = -1.0
        self.data = {"state": "healthy", "profile": "founders", "free_gib": DEFAULT_FREE_GIB,
                     "total_gib": DEFAULT_TOTAL_GIB}
        self.refresh(strict=True)

    def refresh(self, strict: bool = False) -> None:
        if not self.path:
            return
        try:
            mtime = os.stat(self.path).st_mtime
            if mtime == self.mtime:
                return
            with open(self.path, encoding="utf-8") as fh:
                data = json.load(fh)
            if not isinstance(data, dict):
                raise ValueError("top level is not an object")
        except (OSError, ValueError) as exc:
            if strict:
                plain(f"RuntimeError: cannot read GPU state file {self.path}: {exc}")
                die(1)
            return  # mid-rewrite: keep the last good state
        self.mtime = mtime
        self.data.update(data)

    @property
    def state(self) -> str:
        return str(self.data.get("state", "healthy"))

    @property
    def profile(self) -> str:
        return str(self.data.get("profile", "founders"))

    @property
    def free_gib(self) -> float:
        return float(self.data.get("free_gib", DEFAULT_FREE_GIB))

    @property
    def total_gib(self) -> float:
        return float(self.data.get("total_gib", DEFAULT_TOTAL_GIB))


def num_spec_tokens(args: argparse.Namespace) -> int:
    if not args.spec:
        return 0
    return int(args.spec.get("num_speculative_tokens", 1))


# ---------------------------------------------------------------------------------------------
# Startup: the log a GB10 prints, and the ways it dies
# ---------------------------------------------------------------------------------------------


def kv_cache_figures(gmu: float, total: float, max_len: int) -> tuple[float, int, float]:
    """(KV GiB, KV tokens, max concurrency) scaled from the runbook's 0.85 GMU / 262K point."""
    kv_gib = gmu * total - MODEL_GIB - NON_KV_GIB
    ref_gib = REF_GMU * DEFAULT_TOTAL_GIB - MODEL_GIB - NON_KV_GIB
    blocks = int((REF_KV_TOKENS // KV_BLOCK_TOKENS) * max(kv_gib, 0.0) / ref_gib)
    tokens = blocks * KV_BLOCK_TOKENS
    concurrency = REF_CONCURRENCY * (tokens / REF_KV_TOKENS) * (REF_MAX_LEN / max_len)
    return kv_gib, tokens, concurrency


def engine_traceback(frames: list[tuple[str, int, str, str]], error: str) -> None:
    engine("EngineCore failed to start.", "core.py:708", "ERROR")
    plain("Traceback (most recent call last):")
    for path, line, func, code in frames:
        plain(f'  File "{path}", line {line}, in {func}')
        plain(f"    {code}")
    plain(error)
    plain("Traceback (most recent call last):")
    plain('  File "/usr/local/bin/vllm", line 10, in <module>')
    plain("    sys.exit(main())")
    plain('  File "/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/utils.py", line 810, '
          "in wait_for_engine_startup")
    plain("    raise RuntimeError(")
    plain("RuntimeError: Engine core initialization failed. See root cause above. "
          "Failed core proc(s): {}")


# spark-pipelines' content manifest sits in every checkpoint version; it is not weights.
_NOT_LOADED = (".spark-manifest.json", ".rsync-partial")


def checkpoint_content(model: str) -> tuple[str | None, str | None]:
    """What the engine loaded: the digest of the checkpoint's files as spark-pipelines' manifest
    computes it (sha256 per file, then over the sorted list), so a test can ask the engine which
    version it serves; and the answer mode a broken tokenizer config carries (the sim hub's
    broken revision: `"sim_answers": "garbage"`). (None, None) when the path is no directory."""
    if not os.path.isdir(model):
        return None, None
    files = {}
    for dirpath, dirnames, names in os.walk(model):
        dirnames[:] = sorted(d for d in dirnames if d not in _NOT_LOADED)
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, model)
            if rel in _NOT_LOADED or not os.path.isfile(path):
                continue
            h = hashlib.sha256()
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
            files[rel] = {"size": os.path.getsize(path), "sha256": h.hexdigest()}
    digest = hashlib.sha256(json.dumps(dict(sorted(files.items())), sort_keys=True,
                                       separators=(",", ":")).encode()).hexdigest()
    answers = None
    try:
        with open(os.path.join(model, "tokenizer_config.json"), encoding="utf-8") as fh:
            answers = json.load(fh).get("sim_answers")
    except (OSError, ValueError, AttributeError):
        pass
    return digest, answers


async def startup(args: argparse.Namespace, gpu: GpuState, pace: float) -> None:
    """Print vLLM's start-up log over `pace` seconds; exit the way a GB10 would on failure."""
    step = pace / 8.0
    gmu, total, free = args.gpu_memory_utilization, gpu.total_gib, gpu.free_gib
    api(f"vLLM API server version {VERSION}", "api_server.py:1837")
    nd = {"model_tag": args.model, "port": args.port, "model": args.model,
          "max_model_len": args.max_model_len, "gpu_memory_utilization": gmu,
          "served_model_name": [args.served]}
    if args.reasoning_parser:
        nd["reasoning_parser"] = args.reasoning_parser
    if args.attention_backend:
        nd["attention_backend"] = args.attention_backend
    if args.spec:
        nd["speculative_config"] = args.spec
    if args.enable_prefix_caching:
        nd["enable_prefix_caching"] = True
    api(f"non-default args: {nd}", "utils.py:328")
    api("Resolved architecture: Qwen3_5MoeForConditionalGeneration", "model.py:547")
    api(f"Using max model len {args.max_model_len}", "model.py:1510")
    if args.spec:
        api(f"Speculative decoding: method={args.spec.get('method')}, "
            f"num_speculative_tokens={num_spec_tokens(args)}", "speculative.py:512")
    await asyncio.sleep(step)
    engine(f"Initializing a V1 LLM engine (v{VERSION}) with config: model='{args.model}', "
           f"speculative_config={args.spec}, max_seq_len={args.max_model_len}, "
           f"enable_prefix_caching={args.enable_prefix_caching}", "core.py:77")
    want = gmu * total
    if want > free:
        # vLLM's request_memory() check, in the worker, before any weight is loaded.
        engine_traceback(
            [("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", 699,
              "run_engine_core", "engine_core = EngineCoreProc(*args, **kwargs)"),
             ("/usr/local/lib/python3.12/dist-packages/vllm/v1/worker/gpu_worker.py", 241,
              "init_device", "self.requested_memory = request_memory(init_snapshot, self.cache_config)"),
             ("/usr/local/lib/python3.12/dist-packages/vllm/v1/worker/utils.py", 318,
              "request_memory", "raise ValueError(")],
            f"ValueError: Free memory on device cuda:0 ({free:.2f}/{total:.2f} GiB) on startup "
            f"is less than desired GPU memory utilization ({gmu:.2f}, {want:.2f} GiB). Decrease "
            "GPU memory utilization or reduce GPU memory used by other processes.",
        )
        die(1)
    await asyncio.sleep(step)
    engine(f"Starting to load model {args.model}...", "gpu_model_runner.py:2345")
    args.checkpoint_digest, args.checkpoint_answers = checkpoint_content(args.model)
    if args.checkpoint_digest:
        engine(f"Checkpoint content {args.checkpoint_digest[:16]} (sha256 of every file loaded)",
               "default_loader.py:262")
    # Without the flag vLLM picks FLASH_ATTN on SM121: the runbook's "only ~17 tok/s".
    engine(f"Using {(args.attention_backend or 'FLASH_ATTN').upper()} backend.", "cuda.py:311")
    engine("Hybrid INT4+FP8: detected 144 FP8 dense layers", "inc.py:214")
    t0 = time.monotonic()
    await asyncio.sleep(2 * step)
    load_s = time.monotonic() - t0
    engine(f"Loading weights took {load_s:.2f} seconds", "default_loader.py:268")
    engine(f"Model loading took {MODEL_GIB:.2f} GiB memory and {load_s + 0.4:.2f} seconds",
           "gpu_model_runner.py:2402")
    if args.enable_prefix_caching:
        engine_traceback(
            [("/usr/local/lib/python3.12/dist-packages/vllm/v1/engine/core.py", 104,
              "__init__", "num_gpu_blocks, num_cpu_blocks, kv_cache_config = self._initialize_kv_caches("),
             ("/usr/local/lib/python3.12/dist-packages/vllm/v1/core/kv_cache_utils.py", 1121,
              "unify_hybrid_kv_cache_specs", "raise NotImplementedError(")],
            "NotImplementedError: Prefix caching is not supported for hybrid models with "
            "GatedDeltaNet (linear attention) layers: the DeltaNet hybrid attention state cannot "
            "be block-cached. Relaunch without --enable-prefix-caching.",
        )
        die(1)
    h = standin_jit.kernel_hash(args.model, args.max_model_len, args.spec, args.attention_backend, VERSION)
    try:
        await standin_jit.load_or_compile(h, pace, engine)
    except standin_jit.StaleCache as e:
        engine_traceback(
            [("/usr/local/lib/python3.12/dist-packages/vllm/compilation/backends.py", 215, "load",
              "compiled = self.cache.load(graph, runtime_shape)")], str(e))
        die(1)
    await asyncio.sleep(step)
    kv_gib, kv_tokens, concurrency = kv_cache_figures(gmu, total, args.max_model_len)
    if args.tensor_parallel_size > 1:  # weights split over the ranks: the KV cache doubles (runbook: ~54 GiB)
        tp = args.tensor_parallel_size
        kv_gib, kv_tokens, concurrency = kv_gib * tp, kv_tokens * tp, concurrency * tp
    estimate = os.environ.get("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS") == "1"
    if gpu.state == "residue" or (gpu.profile == "founders" and not estimate):
        # Graphs captured during profiling eat the headroom: no KV blocks left, the override
        # kicks in, and the OOM killer ends EngineCore during capture without a traceback.
        engine("Available KV cache memory: -0.41 GiB", "gpu_worker.py:298")
        engine("Overriding num_gpu_blocks=0 with num_gpu_blocks_override=512", "kv_cache_utils.py:1193")
        engine("GPU KV cache size: 270,336 tokens", "kv_cache_utils.py:1087")
        await asyncio.sleep(step)
        plain(f"Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  35%|###5      | "
              f"18/{GRAPH_SIZES} [00:04<00:07,  4.31it/s]")
        die(137)
    if kv_tokens <= 0 or concurrency < 1.0:
        engine_traceback(
            [("/usr/local/lib/python3.12/dist-packages/vllm/v1/core/kv_cache_utils.py", 700,
              "check_enough_kv_cache_memory", "raise ValueError(")],
            f"ValueError: To serve at least one request with the models's max seq len "
            f"({args.max_model_len}), more KV cache is needed than is available "
            f"({max(kv_gib, 0):.2f} GiB). Try increasing `gpu_memory_utilization` or "
            "decreasing `max_model_len` when initializing the engine.",
        )
        die(1)
    engine(f"Available KV cache memory: {kv_gib:.2f} GiB", "gpu_worker.py:298")
    engine(f"GPU KV cache size: {kv_tokens:,} tokens", "kv_cache_utils.py:1087")
    engine(f"Maximum concurrency for {args.max_model_len:,} tokens per request: "
           f"{concurrency:.2f}x", "kv_cache_utils.py:1091")
    t1 = time.monotonic()
    await asyncio.sleep(step)
    plain(f"Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| "
          f"{GRAPH_SIZES}/{GRAPH_SIZES} [00:{int(time.monotonic() - t1):02d}<00:00, 9.80it/s]")
    engine(f"Graph capturing finished in {max(1, round(time.monotonic() - t1))} secs, took 0.84 GiB",
           "gpu_model_runner.py:3251")
    engine(f"init engine (profile, create kv cache, warmup model) took {6 * step:.2f} seconds",
           "core.py:210")
    await asyncio.sleep(step)
