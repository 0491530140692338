#!/usr/bin/env python3
"""A stand-in for the recipe's vLLM serving image, run inside a simulated node's container.

The container has only Debian's python3.11, so this file imports the standard library only and
is copied in with its siblings (upstream.ENGINE_FILES; the start-up log lives in
standin_startup.py). It is launched the way the image's entrypoint is:

    python3 vllm_standin.py serve /models/<dir> --served-model-name N --port P ... [vLLM flags]

and answers what the pipeline talks to: /health, /v1/models, /v1/chat/completions (streaming SSE
and not), /metrics with vLLM's metric names. Tokens come out at a configured pace (env
SIM_TOKENS_PER_SECOND, default 52, the runbook's per-node figure), paced by absolute deadlines so
that hundreds of concurrent streams keep their rate.

It reacts to its launch as the runbook says a GB10 does, from the node's GPU state file (env
SIM_GPU_STATE_FILE: {"state", "profile", "free_gib", "total_gib"}):
- GMU x total > free                      -> vLLM's request_memory() ValueError, exit 1;
- Founders profile without VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1, or "residue" state
                                          -> "num_gpu_blocks=0 ... override=512", silent death, 137;
- --enable-prefix-caching                 -> traceback: hybrid (DeltaNet) attention incompatibility;
- "wedged" state                          -> 34/52 of the rate (PD firmware wedge);
- no --speculative-config                 -> 26/52; no --attention-backend FLASHINFER -> 17/52
  (factors multiply when several apply).

What it answers (standin_answers.py): arithmetic, tool calls and tool results by rule, so the
bench's quality suite scores a healthy node high; env SIM_ANSWERS=garbage (the unpatched image:
fast, wrong) or broken-tools (tool calls as text) breaks that the way those deployments do.
`ignore_eos` / `min_tokens` force the output length as vLLM does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import traceback

# Beside this file, here and in the image (/opt/sim); -I drops the script's folder from sys.path.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import standin_answers  # noqa: E402
import standin_pair  # noqa: E402
from standin_startup import (  # noqa: E402
    KV_BLOCK_TOKENS, PID, VERSION, GpuState, api, die, engine, kv_cache_figures, num_spec_tokens,
    parse_args, plain, startup,
)

BASE_RATE = 52.0  # runbook: ~52 tok/s single stream, healthy node, full launch profile
WEDGED_FACTOR = 34.0 / 52.0  # runbook: wedged GX10 at ~34 tok/s vs 52
NO_SPEC_FACTOR = 26.0 / 52.0  # runbook: "stuck at ~26 tok/s" without --speculative-config
NO_FLASHINFER_FACTOR = 17.0 / 52.0  # runbook: "Only ~17 tok/s" without FLASHINFER
# Runbook, TP=2 dual-node: "~56 tok/s per-request", "Aggregate throughput (2 concurrent) ~56 tok/s
# (1 instance)": the pair's decode rate is shared by its streams.
TP2_FACTOR = 56.0 / 52.0
# MTP-2: per-position acceptance so that accepted/drafted is ~95% (runbook: "~95% acceptance").
MTP_POS_ACCEPT = (0.97, 0.95)
PREFILL_TPS = 4000.0  # prompt tokens per second before the first token
TTFT_FLOOR_S = 0.03
STATS_INTERVAL_S = 10.0

_VOCAB = (
    "the a of to and in is that for it as with on be by this are from or at an which but not "
    "data node value tree left right root key insert delete search rotate color red black "
    "function return list index sorted binary middle low high while if else def class self"
).split()


def rate_factor(args: argparse.Namespace, gpu: GpuState) -> float:
    """Share of the healthy node's rate this launch and GPU state can reach."""
    factor = 1.0
    if gpu.state == "wedged":
        factor *= WEDGED_FACTOR
    if not args.spec:
        factor *= NO_SPEC_FACTOR
    if (args.attention_backend or "").upper() != "FLASHINFER":
        factor *= NO_FLASHINFER_FACTOR
    if args.tensor_parallel_size > 1:
        factor *= TP2_FACTOR
    return factor


# ---------------------------------------------------------------------------------------------
# Serving
# ---------------------------------------------------------------------------------------------


PROCESS_START = time.time()


class Counters:
    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.accepted_per_pos = [0, 0, 0, 0, 0, 0, 0, 0]
        self.created = time.time()


class Server:
    def __init__(self, args: argparse.Namespace, gpu: GpuState) -> None:
        self.args = args
        self.gpu = gpu
        self.c = Counters()
        # The node's rate comes with its GPU state (the sim's hook injects it); env for direct runs.
        self.base_rate = float(gpu.data.get("tokens_per_second") or os.environ.get("SIM_TOKENS_PER_SECOND", BASE_RATE))
        self.api_key = args.api_key or os.environ.get("VLLM_API_KEY")
        self.slots = asyncio.Semaphore(args.max_num_seqs)
        self.spec_k = num_spec_tokens(args)
        self.shared = args.tensor_parallel_size > 1  # the streams share one decode rate (TP2_FACTOR)
        self.seq = 0
        self.access_log = not args.disable_uvicorn_access_log
        self.last_stats = (0, 0, 0, 0)
        self.answers = standin_answers.mode_of(os.environ.get("SIM_ANSWERS")
                                               or getattr(args, "checkpoint_answers", None))

    # -- HTTP plumbing -------------------------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("?", 0)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                try:
                    method, target, _ = lines[0].split(" ", 2)
                except ValueError:
                    return
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        k, v = line.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                length = int(headers.get("content-length") or 0)
                body = await reader.readexactly(length) if length else b""
                path = target.split("?", 1)[0]
                status = await self.route(method, path, headers, body, writer)
                if self.access_log:
                    plain(f'INFO:     {peer[0]}:{peer[1]} - "{method} {target} HTTP/1.1" {status}')
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - the peer is gone either way
                pass

    async def respond(self, writer: asyncio.StreamWriter, status: int, body: bytes,
                      ctype: str = "application/json") -> int:
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
                  405: "Method Not Allowed"}.get(status, "OK")
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nserver: uvicorn\r\ncontent-type: {ctype}\r\n"
            f"content-length: {len(body)}\r\n\r\n".encode() + body
        )
        await writer.drain()
        return status

    async def error(self, writer: asyncio.StreamWriter, status: int, message: str,
                    etype: str = "BadRequestError", param: str | None = None) -> int:
        body = {"error": {"message": message, "type": etype, "param": param, "code": status}}
        return await self.respond(writer, status, json.dumps(body).encode())

    async def route(self, method: str, path: str, headers: dict[str, str], body: bytes,
                    writer: asyncio.StreamWriter) -> int:
        if path == "/health":
            return await self.respond(writer, 200, b"")
        if path == "/metrics":
            return await self.respond(writer, 200, self.metrics().encode(),
                                      "text/plain; version=0.0.4; charset=utf-8")
        if path == "/version":
            return await self.respond(writer, 200, json.dumps({"version": VERSION}).encode())
        if path.startswith("/v1/") and self.api_key:
            if headers.get("authorization") != f"Bearer {self.api_key}":
                return await self.respond(writer, 401, b'{"error":"Unauthorized"}')
        if path == "/v1/models":
            data = {"object": "list", "data": [{
                "id": self.args.served, "object": "model", "created": int(self.c.created),
                "owned_by": "vllm", "root": self.args.model, "parent": None,
                "max_model_len": self.args.max_model_len}]}
            return await self.respond(writer, 200, json.dumps(data).encode())
        if path == "/v1/chat/completions":
            if method != "POST":
                return await self.respond(writer, 405, b'{"detail":"Method Not Allowed"}')
            return await self.chat(body, writer)
        return await self.respond(writer, 404, b'{"detail":"Not Found"}')

    # -- generation ----------------------------------------------------------------------------

    async def chat(self, raw: bytes, writer: asyncio.StreamWriter) -> int:
        try:
            req = json.loads(raw)
            if not isinstance(req, dict):
                raise ValueError("body is not a JSON object")
        except ValueError as exc:
            return await self.error(writer, 400, f"Invalid JSON body: {exc}")
        model = req.get("model")
        if model not in (self.args.served, self.args.model):
            return await self.error(writer, 404, f"The model `{model}` does not exist.",
                                    "NotFoundError", "model")
        messages = req.get("messages")
        if not isinstance(messages, list) or not messages:
            return await self.error(writer, 400, "messages: field required", param="messages")
        text = "".join(str(m.get("content", "")) for m in messages if isinstance(m, dict))
        prompt_tokens = len(text) // 4 + 4 * len(messages) + 3
        limit = self.args.max_model_len
        max_tokens = req.get("max_completion_tokens") or req.get("max_tokens")
        if max_tokens is None:
            max_tokens = limit - prompt_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return await self.error(writer, 400, "max_tokens must be at least 1, got "
                                    f"{max_tokens}.", param="max_tokens")
        if prompt_tokens + max_tokens > limit:
            return await self.error(
                writer, 400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {limit} tokens and your request has "
                f"{prompt_tokens} input tokens ({max_tokens} > {limit} - {prompt_tokens}).",
                param="max_tokens")
        stops = req.get("stop") or []
        if isinstance(stops, str):
            stops = [stops]
        stream = bool(req.get("stream"))
        usage_wanted = bool((req.get("stream_options") or {}).get("include_usage"))
        ctk = req.get("chat_template_kwargs") or {}
        thinking = bool(self.args.reasoning_parser) and ctk.get("enable_thinking", True) is not False
        tools = req.get("tools") if req.get("tool_choice", "auto") != "none" else None
        said = standin_answers.answer(messages, tools, self.answers, thinking)
        forced = max_tokens if req.get("ignore_eos") else int(req.get("min_tokens") or 0)
        self.gpu.refresh()
        rate = self.base_rate * rate_factor(self.args, self.gpu)
        self.seq += 1
        rid = f"chatcmpl-{PID:x}{self.seq:08x}"
        created = int(time.time())
        self.c.waiting += 1
        async with self.slots:
            self.c.waiting -= 1
            self.c.running += 1
            self.c.prompt_tokens += prompt_tokens
            try:
                return await self.generate(writer, rid, created, model, prompt_tokens,
                                           max_tokens, stops, rate, stream, usage_wanted,
                                           sum(text.encode()[:64]), said, thinking, forced)
            finally:
                self.c.running -= 1

    def plan_steps(self, max_tokens: int, seed: int) -> list[tuple[int, int]]:
        """Per engine step (tokens, accepted drafts): 1 for prefill, then 1 + accepted (MTP)."""
        steps = [(1, 0)]
        left = max_tokens - 1
        x = (seed * 2654435761 + 1) & 0x7FFFFFFF  # deterministic, like temperature 0
        while left > 0:
            accepted = 0
            for pos in range(self.spec_k):
                x = (x * 1103515245 + 12345) & 0x7FFFFFFF
                if x / 0x7FFFFFFF >= MTP_POS_ACCEPT[min(pos, len(MTP_POS_ACCEPT) - 1)]:
                    break
                accepted += 1
            n = min(1 + accepted, left)
            steps.append((n, accepted))
            left -= n
        return steps

    def count_step(self, accepted: int) -> None:
        """vLLM's spec-decode counters move per verified step, as the tokens come out."""
        c = self.c
        c.drafts += 1
        c.draft_tokens += self.spec_k
        c.accepted += accepted
        for pos in range(accepted):
            c.accepted_per_pos[pos] += 1

    async def generate(self, writer: asyncio.StreamWriter, rid: str, created: int, model: str,
                       prompt_tokens: int, max_tokens: int, stops: list[str], rate: float,
                       stream: bool, usage_wanted: bool, seed: int, said: standin_answers.Answer | None = None,
                       thinking: bool = True, forced: int = 0) -> int:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ttft = TTFT_FLOOR_S + prompt_tokens / PREFILL_TPS
        steps = self.plan_steps(max_tokens, seed)
        mean_tokens = 1.0
        if self.spec_k:
            mean_tokens, chain = 1.0, 1.0
            for pos in range(self.spec_k):
                chain *= MTP_POS_ACCEPT[min(pos, len(MTP_POS_ACCEPT) - 1)]
                mean_tokens += chain
        interval = mean_tokens / rate  # step length; tokens per step vary, step time does not
        reasoning_tokens = max_tokens // 4 if self.args.reasoning_parser and thinking else 0
        planned = None if said is None else standin_answers.plan(
            said, max_tokens, reasoning_tokens, forced, lambda j: " " + _VOCAB[(seed + j * 7) % len(_VOCAB)])
        prefix = (f'data: {{"id":"{rid}","object":"chat.completion.chunk","created":{created},'
                  f'"model":{json.dumps(model)},"choices":[{{"index":0,"delta":{{').encode()
        if stream:
            writer.write(b"HTTP/1.1 200 OK\r\nserver: uvicorn\r\ncontent-type: text/event-stream; "
                         b"charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n")
            self._chunk(writer, prefix + b'"role":"assistant","content":""},"logprobs":null,'
                        b'"finish_reason":null}]}\n\n')
        produced = 0
        finish = "length"
        calls = []
        if said is not None and said.tool_call is not None:
            calls = [{"index": 0, "id": f"chatcmpl-tool-{rid[-8:]}", "type": "function",
                      "function": {"name": said.tool_call[0], "arguments": said.tool_call[1]}}]
        pieces: list[str] = []
        reasoning: list[str] = []
        deadline = t0 + ttft
        try:
            for i, (n, accepted) in enumerate(steps):
                if not self.shared:
                    deadline = t0 + ttft + i * interval
                elif i:  # this step's share of the engine's rate: as many streams as run now
                    deadline += interval * max(1, self.c.running)
                delay = deadline - loop.time()
                if delay > 0:
                    await asyncio.sleep(delay)
                if planned is None:
                    words = []
                    for j in range(produced, produced + n):
                        w = _VOCAB[(seed + j * 7) % len(_VOCAB)]
                        if w in stops:
                            finish = "stop"
                            break
                        words.append(" " + w)
                    produced += len(words)
                    key = "reasoning_content" if produced <= reasoning_tokens else "content"
                    parts = [(key, "".join(words))]
                    last = finish == "stop" or produced >= max_tokens
                else:
                    tokens, end = planned
                    words = tokens[produced:produced + n]
                    produced += len(words)
                    last = produced >= len(tokens)
                    finish = end if last else finish
                    parts = []
                    for key, piece in words:  # consecutive pieces of one field go in one chunk
                        if key == "tool":
                            continue
                        if parts and parts[-1][0] == key:
                            parts[-1] = (key, parts[-1][1] + piece)
                        else:
                            parts.append((key, piece))
                    if not parts:
                        parts = [("content", "")]
                self.c.generation_tokens += len(words)
                if self.spec_k and i > 0:
                    self.count_step(accepted)
                for k, (key, text) in enumerate(parts):
                    (reasoning if key == "reasoning_content" else pieces).append(text)
                    end_here = last and k == len(parts) - 1
                    if stream and (text or end_here) and not (end_here and calls):
                        fr = f'"{finish}"' if end_here else "null"
                        self._chunk(writer, prefix + f'"{key}":{json.dumps(text)}}},"logprobs":null,'
                                    f'"finish_reason":{fr}}}]}}\n\n'.encode())
                if stream and last and calls:
                    self._chunk(writer, prefix + f'"tool_calls":{json.dumps(calls)}}},"logprobs":null,'
                                f'"finish_reason":"{finish}"}}]}}\n\n'.encode())
                if stream:
                    await writer.drain()
                if last:
                    break
        except (ConnectionError, RuntimeError):
            self.c.success["abort"] += 1
            return 499
        usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + produced,
                 "completion_tokens": produced, "prompt_tokens_details": None}
        self.c.success["stop" if finish == "tool_calls" else finish] += 1  # vLLM counts a tool call as stop
        if stream:
            if usage_wanted:
                self._chunk(writer, f'data: {{"id":"{rid}","object":"chat.completion.chunk",'
                            f'"created":{created},"model":{json.dumps(model)},"choices":[],'
                            f'"usage":{json.dumps(usage, separators=(",", ":"))}}}\n\n'.encode())
            self._chunk(writer, b"data: [DONE]\n\n")
            writer.write(b"0\r\n\r\n")
            try:
                await writer.drain()
            except ConnectionError:
                pass
            return 200
        message = {"role": "assistant", "content": "".join(pieces) or (None if calls else ""), "refusal": None,
                   "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls],
                   "reasoning_content": "".join(reasoning) or None}
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": finish, "stop_reason": None}],
                "usage": usage, "prompt_logprobs": None}
        return await self.respond(writer, 200, json.dumps(body, separators=(",", ":")).encode())

    @staticmethod
    def _chunk(writer: asyncio.StreamWriter, payload: bytes) -> None:
        writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))

    # -- metrics and periodic stats -------------------------------------------------------------

    def metrics(self) -> str:
        c = self.c
        lab = f'engine="0",model_name="{self.args.served}"'
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, rows: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")
            for extra, value in rows:
                labels = lab + ("," + extra if extra else "")
                out.append(f"{name}{{{labels}}} {float(value)!r}")
            if kind == "counter":
                base = name[: -len("_total")] + "_created"
                out.append(f"# HELP {base} {help_}")
                out.append(f"# TYPE {base} gauge")
                for extra, _ in rows:
                    labels = lab + ("," + extra if extra else "")
                    out.append(f"{base}{{{labels}}} {c.created!r}")

        # prometheus_client's process collector, as a real vLLM's /metrics has it (no labels).
        out += ["# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
                "# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {PROCESS_START!r}"]
        metric("vllm:num_requests_running", "gauge",
               "Number of requests in model execution batches.", [("", c.running)])
        digest = getattr(self.args, "checkpoint_digest", None)
        if digest:  # the stand-in's own: which checkpoint content it loaded (a real vLLM says nothing)
            metric("spark_sim:checkpoint_loaded", "gauge", "The checkpoint content the engine loaded.",
                   [(f'digest="{digest[:16]}"', 1)])
        metric("vllm:num_requests_waiting", "gauge",
               "Number of requests waiting to be processed.", [("", c.waiting)])
        _, kv_tokens, _ = kv_cache_figures(self.args.gpu_memory_utilization, self.gpu.total_gib,
                                           self.args.max_model_len)
        metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
               [("", min(1.0, c.running * 600 / max(kv_tokens, 1)))])
        metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
               [("", c.prompt_tokens)])
        metric("vllm:generation_tokens_total", "counter",
               "Number of generation tokens processed.", [("", c.generation_tokens)])
        metric("vllm:request_success_total", "counter",
               "Count of successfully processed requests.",
               [(f'finished_reason="{k}"', v) for k, v in c.success.items()])
        if self.spec_k:
            metric("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.",
                   [("", c.drafts)])
            metric("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.",
                   [("", c.draft_tokens)])
            metric("vllm:spec_decode_num_accepted_tokens_total", "counter",
                   "Number of accepted tokens.", [("", c.accepted)])
            metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Accepted tokens per draft position.",
                   [(f'position="{i}"', c.accepted_per_pos[i]) for i in range(self.spec_k)])
        out.append("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig")
        out.append("# TYPE vllm:cache_config_info gauge")
        out.append(
            f'vllm:cache_config_info{{block_size="{KV_BLOCK_TOKENS}",enable_prefix_caching='
            f'"{self.args.enable_prefix_caching}",engine="0",gpu_memory_utilization='
            f'"{self.args.gpu_memory_utilization}",num_gpu_blocks="{kv_tokens // KV_BLOCK_TOKENS}"}} 1.0'
        )
        return "\n".join(out) + "\n"

    async def stats_loop(self) -> None:
        """vLLM's 10-second engine stats lines, which operators read to see throughput."""
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            c = self.c
            now = (c.prompt_tokens, c.generation_tokens, c.draft_tokens, c.accepted)
            d = [a - b for a, b in zip(now, self.last_stats)]
            self.last_stats = now
            if not any(d[:2]) and not c.running:
                continue
            engine(f"Engine 000: Avg prompt throughput: {d[0] / STATS_INTERVAL_S:.1f} tokens/s, "
                   f"Avg generation throughput: {d[1] / STATS_INTERVAL_S:.1f} tokens/s, Running: "
                   f"{c.running} reqs, Waiting: {c.waiting} reqs, GPU KV cache usage: 0.1%, "
                   "Prefix cache hit rate: 0.0%", "loggers.py:236")
            if self.spec_k and d[2]:
                engine(f"SpecDecoding metrics: Mean acceptance length: "
                       f"{1 + self.spec_k * d[3] / d[2]:.2f}, Accepted: {d[3]} tokens, "
                       f"Drafted: {d[2]} tokens, Avg Draft acceptance rate: {d[3] / d[2]:.1%}",
                       "metrics.py:96")


async def main_async(argv: list[str]) -> int:
    args = parse_args(argv)
    gpu = GpuState(os.environ.get("SIM_GPU_STATE_FILE"))
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    pace = float(os.environ.get("SIM_STARTUP_SECONDS", "2"))
    waiter = asyncio.ensure_future(stop.wait())
    rendezvous = standin_pair.timeout_of(gpu.data)
    background: list[asyncio.Future] = []  # referenced: a task nobody holds may be collected
    if standin_pair.is_pair(args) and args.headless:  # rank 1: no API server; it stands by the head
        boot = asyncio.ensure_future(standin_pair.worker(args, rendezvous, lambda: startup(args, gpu, pace)))
        await asyncio.wait({boot, waiter}, return_when=asyncio.FIRST_COMPLETED)
        boot.cancel()
        api("[shutdown] headless worker: shutdown triggered", "launcher.py:254")
        return 0
    if standin_pair.is_pair(args):  # rank 0: the worker joins before anything loads
        joining = asyncio.ensure_future(standin_pair.head_rendezvous(args, rendezvous))
        await asyncio.wait({joining, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            joining.cancel()
            return 0
        background.append(asyncio.ensure_future(joining.result().watch()))  # the worker gone is the pair gone
    boot = asyncio.ensure_future(startup(args, gpu, pace))
    await asyncio.wait({boot, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        boot.cancel()
        api("[shutdown] API server: shutdown triggered during startup", "launcher.py:254")
        return 0
    server_state = Server(args, gpu)
    server = await asyncio.start_server(server_state.handle, args.host, args.port,
                                        backlog=1024, limit=1 << 20)
    api(f"Starting vLLM API server 0 on http://{args.host}:{args.port}", "launcher.py:46")
    for route, methods in (("/health", "GET"), ("/metrics", "GET"), ("/v1/models", "GET"),
                           ("/v1/chat/completions", "POST"), ("/version", "GET")):
        api(f"Route: {route}, Methods: {methods}", "launcher.py:34")
    plain(f"INFO:     Started server process [{PID}]")
    plain("INFO:     Waiting for application startup.")
    plain("INFO:     Application startup complete.")
    stats = asyncio.ensure_future(server_state.stats_loop())
    await stop.wait()
    api("[shutdown] API server: shutdown triggered", "launcher.py:254")
    stats.cancel()
    server.close()
    plain("INFO:     Shutting down")
    plain("INFO:     Waiting for application shutdown.")
    plain("INFO:     Application shutdown complete.")
    plain(f"INFO:     Finished server process [{PID}]")
    return 0


def main() -> None:
    try:
        code = asyncio.run(main_async(sys.argv[1:]))
    except OSError as exc:  # e.g. the port is taken
        plain(f"OSError: {exc}")
        traceback.print_exc(file=sys.stdout)
        code = 1
    die(code)


if __name__ == "__main__":
    main()
