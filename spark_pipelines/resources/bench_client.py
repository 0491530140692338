"""A thin async client that runs `core.bench` suites against an OpenAI-compatible server.

It records, per request, the start time, the arrival time of every chunk that carries generated
text, the end time and the server's usage; all arithmetic lives in `core.bench`. The per-chunk
path is kept cheap on purpose (the client shares 2 cores with the server it measures): streamed
requests use plain asyncio streams (see `_Http1Pool`), bytes are split on newlines and searched
with `bytes.find`, and only the usage chunk and error chunks are parsed as JSON. httpx serves
the rest: /metrics, probes and the recipe's non-streaming requests.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import json
import time
from collections.abc import Awaitable, Callable, Mapping
from urllib.parse import urlsplit

import httpx

from spark_pipelines.core import bench as core
from spark_pipelines.core import protocol
from spark_pipelines.core import quality
from spark_pipelines.core.errors import first_line

# Markers of a delta that carries generated text: vLLM writes compact JSON, LiteLLM may add a
# space after the colon; reasoning parsers put thinking tokens in reasoning(_content).
_TEXT_MARKERS = (
    b'"content":"',
    b'"content": "',
    b'"reasoning_content":"',
    b'"reasoning_content": "',
    b'"reasoning":"',
    b'"reasoning": "',
)
_USAGE_MARKERS = (b'"usage":{', b'"usage": {')
_ERROR_MARKERS = (b'{"error"', b'{"object":"error"', b'"object": "error"')


def _carries_text(line: bytes) -> bool:
    for marker in _TEXT_MARKERS:
        i = line.find(marker)
        # An empty string ("content":"") is vLLM's role-only first chunk or a finish chunk.
        if i >= 0 and line[i + len(marker) : i + len(marker) + 1] != b'"':
            return True
    return False


# /metrics and /v1/models answer at once on a live server: one that accepts and stays silent is
# reported within this, not after a generation's timeout.
PROBE_TIMEOUT_S = 30.0


class BenchError(Exception):
    """A problem that stops the whole run (unreachable server, refused isolation...)."""


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class _Http1Pool:
    """Keep-alive HTTP/1.1 connections for the streaming hot path.

    httpx (h11 + anyio) costs several times more CPU per SSE chunk than the server spends
    making it; on 2 shared cores that skews the very rates we measure. Streaming requests
    therefore go over plain asyncio streams: one readline + one readexactly per chunk.
    httpx still does everything else (metrics, probes, non-streaming requests).
    """

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = parts.scheme == "https"
        self.path = parts.path or "/"
        netloc = self.host if parts.port is None else f"{self.host}:{parts.port}"
        self.host_header = netloc
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def acquire(self, fresh: bool = False) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """A connection and whether it was reused (a reused one may have been closed idle)."""
        while self.idle and not fresh:
            reader, writer = self.idle.pop()
            if not reader.at_eof() and not writer.is_closing():
                return reader, writer, True
            writer.close()
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl or None,
                                                       limit=1 << 20)
        return reader, writer, False

    def release(self, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], reuse: bool) -> None:
        if reuse:
            self.idle.append(conn)
        else:
            conn[1].close()

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()

    def request_head(self, body: bytes, headers: Mapping[str, str]) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
            "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n"
        ).encode("latin-1")


async def _stream_one(
    pool: _Http1Pool,
    body: Mapping[str, object],
    headers: Mapping[str, str],
    meta: tuple[str, str, int, int],
    timeout_s: float = 600.0,
) -> core.RequestSample:
    phase, name, repeat, max_tokens = meta
    clock = time.perf_counter
    chunk_times: list[float] = []
    append = chunk_times.append
    usage: dict[str, int] = {}
    error: str | None = None
    payload = json.dumps(body).encode()
    started = clock()
    conn = None
    reusable = False
    try:
        async with asyncio.timeout(timeout_s):
            for attempt in (1, 2):
                reader, writer, reused = await pool.acquire(fresh=attempt == 2)
                conn = reader, writer
                try:
                    writer.write(pool.request_head(payload, headers) + payload)
                    status_line = await reader.readline()
                except ConnectionError:
                    status_line = b""
                    if not reused:
                        raise
                if status_line or not reused:
                    break
                # The server closed this kept-alive connection while it sat idle (uvicorn's
                # keep-alive timeout is 5 s) before reading the request: send it again on a
                # new connection, as HTTP clients do. A fresh connection that closes is an error.
                pool.release(conn, False)
                conn = None
                started = clock()
            if not status_line:
                raise ConnectionError("server closed the connection without answering")
            status = int(status_line.split(b" ", 2)[1])
            length = -1
            chunked = False
            keep_alive = status_line.startswith(b"HTTP/1.1")
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                key, _, value = line.partition(b":")
                key = key.strip().lower()
                if key == b"content-length":
                    length = int(value)
                elif key == b"transfer-encoding":
                    chunked = b"chunked" in value.lower()
                elif key == b"connection":
                    keep_alive = b"close" not in value.lower()
            if status != 200:
                raw = await _read_body(reader, chunked, length)
                error = f"HTTP {status}: {_error_text(raw)}"
                reusable = keep_alive
            else:
                buf = b""
                done = False
                while not done:
                    if chunked:
                        size_line = await reader.readline()
                        size = int(size_line.split(b";", 1)[0], 16)
                        if size == 0:
                            await reader.readline()  # the empty trailer
                            reusable = keep_alive
                            break
                        data = (await reader.readexactly(size + 2))[:-2]
                    else:
                        data = await reader.read(65536)
                        if not data:
                            break
                    now = clock()
                    if buf:
                        data = buf + data
                    if not data.endswith(b"\n"):
                        lines = data.split(b"\n")
                        buf = lines.pop()
                    else:
                        buf = b""
                        lines = data.split(b"\n")
                    seen_text = False
                    for line in lines:
                        if not line.startswith(b"data:"):
                            continue
                        if line.startswith(b"[DONE]", 6) or line.startswith(b"[DONE]", 5):
                            done = not chunked
                            continue
                        if not seen_text and _carries_text(line):
                            seen_text = True
                        if b'"usage"' in line:
                            for m in _USAGE_MARKERS:
                                if m in line:
                                    usage = json.loads(line[5:]).get("usage") or {}
                                    break
                        elif line.startswith(_ERROR_MARKERS, 5) or line.startswith(_ERROR_MARKERS, 6):
                            error = _error_text(line[5:])
                    if seen_text:
                        append(now)
    except TimeoutError:
        error = f"no complete answer within {timeout_s:.0f} s"
        reusable = False
    except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as exc:
        error = first_line(exc)
        reusable = False
    finally:
        if conn is not None:
            pool.release(conn, reusable)
    finished = clock()
    if error is None and not usage:
        error = "stream ended without a usage chunk (server ignores stream_options.include_usage?)"
    return core.RequestSample(
        phase=phase,
        prompt=name,
        repeat=repeat,
        max_tokens=max_tokens,
        started=started,
        finished=finished,
        chunk_times=tuple(chunk_times),
        completion_tokens=int(usage.get("completion_tokens") or 0),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        error=error,
    )


async def _read_body(reader: asyncio.StreamReader, chunked: bool, length: int) -> bytes:
    if chunked:
        parts = []
        while True:
            size = int((await reader.readline()).split(b";", 1)[0], 16)
            if size == 0:
                await reader.readline()
                return b"".join(parts)
            parts.append((await reader.readexactly(size + 2))[:-2])
    if length >= 0:
        return await reader.readexactly(length)
    return await reader.read()


async def _post_one(
    client: httpx.AsyncClient,
    url: str,
    body: Mapping[str, object],
    headers: Mapping[str, str],
    meta: tuple[str, str, int, int],
) -> core.RequestSample:
    """Non-streaming, exactly as bench_qwen35.sh: one POST, tok/s over its wall time."""
    phase, name, repeat, max_tokens = meta
    error = None
    usage: dict[str, int] = {}
    started = time.perf_counter()
    try:
        resp = await client.post(url, json=body, headers=headers)
        raw = resp.content
        if resp.status_code != 200:
            error = f"HTTP {resp.status_code}: {_error_text(raw)}"
        else:
            usage = json.loads(raw).get("usage") or {}
    except (httpx.HTTPError, ValueError) as exc:
        error = first_line(exc)
    finished = time.perf_counter()
    return core.RequestSample(
        phase=phase,
        prompt=name,
        repeat=repeat,
        max_tokens=max_tokens,
        started=started,
        finished=finished,
        completion_tokens=int(usage.get("completion_tokens") or 0),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        error=error,
    )


def _error_text(raw: bytes) -> str:
    try:
        data = json.loads(raw)
    except ValueError:
        return raw[:200].decode("utf-8", "replace").strip() or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:300]
        if isinstance(err, str):
            return err[:300]
        if "message" in data:
            return str(data["message"])[:300]
    return str(data)[:300]


async def read_metrics(
    client: httpx.AsyncClient, metrics_url: str, headers: Mapping[str, str] | None = None
) -> dict[str, float] | None:
    """The server's /metrics as {name: value}, or None where the server has none (a gateway)."""
    from spark_pipelines.core.diagnosis import parse_metrics

    try:
        resp = await client.get(metrics_url, headers=dict(headers or {}), timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        parsed = parse_metrics(resp.text)
    except ValueError:  # 200 but not Prometheus text: some gateway page
        return None
    return parsed if core.METRIC_GENERATION in parsed else None


async def run_bench_async(
    base_url: str,
    model: str,
    suite: str = "recipe",
    concurrency: int = core.LOADED_CONCURRENCY,
    repeats: int = core.RECIPE_RUNS,
    api_key: str | None = None,
    *,
    metrics_url: str | None = None,
    stream: bool = True,
    ignore_eos: bool = False,
    loaded_max_tokens: int = core.LOADED_MAX_TOKENS,
    loaded_requests: int | None = None,
    require_isolation: bool = True,
    timeout_s: float = 600.0,
    reference_mean_tok_s: float = core.REFERENCE_MEAN_TOK_S,
    on_progress: Callable[[str], None] | None = None,
) -> core.BenchReport:
    """Run a suite; see `run_bench`. `on_progress` gets one line per request (single stream) or
    per concurrent phase, so a long bench is not silent."""
    say = on_progress or (lambda _line: None)
    plan = core.plan_suite(
        suite,
        concurrency,
        repeats,
        loaded_max_tokens=loaded_max_tokens,
        loaded_requests=loaded_requests,
    )
    base = _check_url(base_url, "--base-url")
    api_root = base if base.endswith("/v1") else base + "/v1"
    chat_url = api_root + "/chat/completions"
    if metrics_url is None:
        root = base[: -len("/v1")] if base.endswith("/v1") else base
        metrics_url = root + "/metrics"
    else:
        metrics_url = _check_url(metrics_url, "--metrics-url")
    headers = _auth_headers(api_key)
    max_conn = max(conc for _, _, conc in plan.phases) + 2
    limits = httpx.Limits(max_connections=max_conn, max_keepalive_connections=max_conn)
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    started_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        # The metrics endpoint of a gateway may want the same key; vLLM ignores it.
        say(f"reading {metrics_url} (is anything else running there?)")
        before = await read_metrics(client, metrics_url, headers)
        if before is None:
            isolation = f"not verified ({metrics_url} has no vLLM metrics)"
            await _probe(client, api_root, headers)
        else:
            if require_isolation:
                core.isolation_check(before, where=metrics_url)
            isolation = "verified idle (num_requests_running = 0 before start)"
        pool = _Http1Pool(chat_url)

        async def send(body: Mapping[str, object], meta: tuple[str, str, int, int]):
            if stream:
                return await _stream_one(pool, body, headers, meta, timeout_s)
            return await _post_one(client, chat_url, body, headers, meta)

        samples: list[core.RequestSample] = []
        for repeat in range(plan.repeats):
            for phase, prompts, conc in plan.phases:
                if conc == 1:
                    for p in prompts:
                        body = core.chat_body(model, p, stream=stream, ignore_eos=ignore_eos)
                        meta = (phase, p.name, repeat, p.max_tokens)
                        sample = await send(body, meta)
                        samples.append(sample)
                        say(f"{phase} run {repeat + 1}/{plan.repeats}: {p.name}: " + _progress(sample))
                else:
                    gate = asyncio.Semaphore(conc)

                    async def gated(p: core.BenchPrompt, ph: str = phase, r: int = repeat):
                        async with gate:
                            body = core.chat_body(model, p, stream=stream, ignore_eos=ignore_eos)
                            return await send(body, (ph, p.name, r, p.max_tokens))

                    say(f"{phase} run {repeat + 1}/{plan.repeats}: {len(prompts)} requests, {conc} at once ...")
                    done = await asyncio.gather(*(gated(p) for p in prompts))
                    samples.extend(done)
                    ok = [s for s in done if s.ok]
                    say(f"{phase} run {repeat + 1}/{plan.repeats}: {len(ok)}/{len(done)} ok, "
                        f"{sum(s.completion_tokens for s in ok)} tokens")
        pool.close()
        counters = None
        if before is not None:
            after = await read_metrics(client, metrics_url, headers)
            if after is not None:
                counters = core.counter_check(before, after, samples)
                if not counters.tokens_match:  # idle at the start is not isolated throughout
                    isolation = f"NOT isolated: {counters.text}"
    if all(not s.ok for s in samples):
        first = next((s.error for s in samples if s.error), "no completion tokens")
        raise BenchError(f"every request failed; first error: {first}")
    report = core.build_report(
        samples,
        plan,
        base_url=base,
        model=model,
        suite=suite,
        concurrency=concurrency,
        counters=counters,
        isolation=isolation,
        started_at=started_at,
        reference_mean_tok_s=reference_mean_tok_s,
    )
    # What the run actually did (a server that ignores ignore_eos is found out by its usage).
    report.protocol = protocol.protocol_of(samples, forced=ignore_eos, stream=stream).to_dict()
    return report


def _progress(sample: core.RequestSample) -> str:
    if not sample.ok:
        return f"failed ({sample.error or 'no completion tokens'})"
    return f"{sample.completion_tokens} tokens at {core.request_figures(sample).tok_s:.1f} tok/s"


def run_bench(
    base_url: str,
    model: str,
    suite: str = "recipe",
    concurrency: int = core.LOADED_CONCURRENCY,
    repeats: int = core.RECIPE_RUNS,
    api_key: str | None = None,
    max_s: float | None = None,
    **options: object,
) -> core.BenchReport:
    """Run `suite` ("recipe" | "loaded" | "all") against an OpenAI-compatible server.

    recipe: the recipe's five prompts, single-stream, in order; loaded: `concurrency` parallel
    requests x 128 max_tokens. Each phase runs `repeats` times; the first run is a warm-up when
    repeats > 1 (the recipe's 2 runs = 1 warm-up + 1 measured). Before starting, the server's
    /metrics must show no running or waiting request (else `core.BenchRefused`). Keyword options:
    metrics_url (vLLM's /metrics when base_url is a gateway), stream (False = the recipe's
    non-streaming POSTs), ignore_eos, loaded_max_tokens, loaded_requests, require_isolation,
    timeout_s, reference_mean_tok_s (what the report compares the recipe mean with). max_s bounds
    the whole bench. Raises BenchError when the server is unreachable, every request fails, or
    max_s passes.
    """
    return asyncio.run(_within(max_s, run_bench_async(base_url, model, suite, concurrency, repeats, api_key,
                                                      **options)))  # type: ignore[arg-type]


async def _within(max_s: float | None, bench: Awaitable[core.BenchReport]) -> core.BenchReport:
    """The whole bench bounded by max_s (None: only each request's timeout_s)."""
    try:
        async with asyncio.timeout(max_s):
            return await bench
    except TimeoutError:
        raise BenchError(f"the bench did not finish within {max_s:.0f} s (--max-time); nothing was recorded") from None


async def _probe(client: httpx.AsyncClient, api_root: str, headers: Mapping[str, str]) -> None:
    """Fail fast, with one message, when nothing (usable) answers at base_url."""
    try:
        resp = await client.get(api_root + "/models", headers=dict(headers), timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {api_root}/models: {first_line(exc)}") from None
    if resp.status_code != 200:
        # Gateways differ on a missing key: 401, or LiteLLM without a database answers 500/400.
        hint = "" if headers else (
            "; no API key was sent: if the server wants one, pass --api-key-env VAR naming an "
            "environment variable that holds it"
        )
        raise BenchError(
            f"{api_root}/models answered HTTP {resp.status_code}: {_error_text(resp.content)}{hint}"
        )


def _check_url(url: str, what: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise core.BenchRefused(f"{what} {url!r} is not an http(s) URL like http://127.0.0.1:8000")
    return url.rstrip("/")


# -- the quality phase ----------------------------------------------------------------------------


def _reply(raw: bytes, status: int, seconds: float) -> quality.Reply:
    """One non-streaming answer as core.quality reads it (vLLM: reasoning_content; newer: reasoning)."""
    if status != 200:
        return quality.Reply(seconds=seconds, error=f"HTTP {status}: {_error_text(raw)}")
    try:
        data = json.loads(raw)
        msg = data["choices"][0]["message"]
        calls = tuple(quality.ToolCall(str((c.get("function") or {}).get("name")),
                                       str((c.get("function") or {}).get("arguments") or ""))
                      for c in msg.get("tool_calls") or [])
        return quality.Reply(content=str(msg.get("content") or ""),
                             reasoning=str(msg.get("reasoning_content") or msg.get("reasoning") or ""),
                             tool_calls=calls, seconds=seconds,
                             completion_tokens=int((data.get("usage") or {}).get("completion_tokens") or 0))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        return quality.Reply(seconds=seconds, error=f"unreadable answer: {first_line(e)}")


async def run_quality_async(base_url: str, model: str, api_key: str | None = None, *,
                            parallel: int = quality.PARALLEL, timeout_s: float = 300.0,
                            on_progress: Callable[[str], None] | None = None) -> quality.QualityReport:
    """The suite twice, as the runbook runs tool-eval-bench: sequential, then `parallel` at once.
    A request the server refuses (no tool-call parser: HTTP 400) scores 0 with its reason; only
    an unreachable server raises BenchError."""
    say = on_progress or (lambda _line: None)
    base = _check_url(base_url, "--base-url")
    api_root = base if base.endswith("/v1") else base + "/v1"
    url = api_root + "/chat/completions"
    headers = _auth_headers(api_key)
    limits = httpx.Limits(max_connections=parallel + 1, max_keepalive_connections=parallel + 1)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                 trust_env=False) as client:
        async def ask(s: quality.Scenario) -> quality.Reply:
            t0 = time.perf_counter()
            try:
                resp = await client.post(url, json=s.body(model), headers=headers)
            except httpx.ConnectError as e:
                raise BenchError(f"cannot reach {url}: {first_line(e)}") from None
            except httpx.HTTPError as e:
                return quality.Reply(seconds=time.perf_counter() - t0, error=first_line(e) or type(e).__name__)
            return _reply(resp.content, resp.status_code, time.perf_counter() - t0)

        runs = []
        for mode, conc in (("sequential", 1), (f"parallel {parallel}", parallel)):
            gate = asyncio.Semaphore(conc)

            async def gated(s: quality.Scenario) -> quality.Reply:
                async with gate:
                    return await ask(s)

            t0 = time.perf_counter()
            if conc == 1:
                replies = [await ask(s) for s in quality.SUITE]
            else:
                replies = list(await asyncio.gather(*(gated(s) for s in quality.SUITE)))
            run = quality.run_of(mode, replies, round(time.perf_counter() - t0, 2))
            runs.append(run)
            say(f"quality {mode}: {run.score:g}/100 in {run.seconds:.1f} s")
    return quality.QualityReport(quality.SUITE_VERSION, tuple(runs))


def run_quality(base_url: str, model: str, api_key: str | None = None, max_s: float | None = None,
                **options: object) -> quality.QualityReport:
    """The quality phase (core.quality.SUITE) against an OpenAI-compatible server; see
    run_quality_async. max_s bounds the whole phase (BenchError past it)."""
    async def bounded() -> quality.QualityReport:
        try:
            async with asyncio.timeout(max_s):
                return await run_quality_async(base_url, model, api_key, **options)  # type: ignore[arg-type]
        except TimeoutError:
            raise BenchError(f"the quality phase did not finish within {max_s:.0f} s") from None
    return asyncio.run(bounded())
