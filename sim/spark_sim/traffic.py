"""Clients' traffic through the simulated gateway.

`engines_on` runs the vLLM stand-in on every node's own address, in the node's network namespace
but outside Docker (the gateway needs an engine there, not a deployment). `Streams` sends
streaming chat requests through the real LiteLLM proxy, each in its thread, and records how each
one ended and which node served it (LiteLLM names the backend in `x-litellm-model-api-base`):
what a drain or a reload must not break. `Traffic` runs clients as users' programs do, each
sending requests back to back: on one pooled keep-alive connection without resending (httpx's
default), on a fresh connection each, or through the OpenAI SDK's default client.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from spark_pipelines.core.fleet import Fleet, parse_fleet
from spark_sim.fleet import SimFleet
from spark_sim.servers import (
    HEALTHY_GPU,
    MANDATORY_ENV,
    RECIPE_FLAGS,
    STANDIN,
    SYSTEM_PYTHON,
    Served,
    standin_env,
    start_server,
)

API_BASE_HEADER = "x-litellm-model-api-base"


def answered_by(headers: httpx.Headers, node_of: dict[str, str]) -> str | None:
    """The node LiteLLM sent the request to, from its api-base response header (None: not said)."""
    base = headers.get(API_BASE_HEADER, "")
    return next((n for b, n in node_of.items() if base.startswith(b)), None)


@contextmanager
def engines_on(sim: SimFleet, port: int, model: str, work: Path, tokens_per_second: float = 52.0
               ) -> Iterator[dict[str, Served]]:
    """The stand-in serving `model` on <node ip>:<port> of every node; stopped on exit."""
    served: dict[str, Served] = {}
    try:
        for m in sim.nodes:
            d = work / m.name
            d.mkdir(parents=True, exist_ok=True)
            argv = ["ip", "netns", "exec", m.netns, SYSTEM_PYTHON, str(STANDIN), "serve",
                    "/models/qwen35-122b-hybrid-int4fp8", "--served-model-name", model,
                    "--host", m.ip, "--port", str(port), *RECIPE_FLAGS]
            env = standin_env(d / "gpu.json", HEALTHY_GPU, {**MANDATORY_ENV, "SIM_STARTUP_SECONDS": "0.2",
                                                            "SIM_TOKENS_PER_SECOND": str(tokens_per_second)})
            base = f"http://{m.ip}:{port}"
            served[m.name] = start_server(argv, env=env, log_path=d / "vllm.log", ready_url=base + "/health",
                                          base_url=base, model=model, timeout=30)
        yield served
    finally:
        for s in served.values():
            s.stop()


@dataclass
class Stream:
    """One streamed answer as the client saw it."""

    node: str | None = None  # the backend LiteLLM chose, by its address
    finished: bool = False  # a finish_reason and data: [DONE] arrived
    chunks: int = 0
    error: str = ""
    started: float = 0.0
    ended: float = 0.0
    resent: list[str] = field(default_factory=list)  # connection errors before any answer, then sent again
    at: float = 0.0  # wall clock at the start (to set beside a run's event times)
    head_at: float = 0.0  # wall clock when the response head arrived: the node had taken the request
    kind: str = ""  # the client that sent it (Traffic)

    @property
    def dropped(self) -> bool:
        return not self.finished


# Raised before a response head arrived: the server never took the request (a refused or reset
# connection), so a client may send it again; the OpenAI SDK does, twice by default.
_UNANSWERED = (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError)


def _one(url: str, key: str, pool: str, max_tokens: int, node_of: dict[str, str], out: Stream,
         timeout_s: float, resend: int = 0) -> None:
    body = {"model": pool, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Count slowly, one word per line."}]}
    out.started = time.monotonic()
    finish = None
    try:
        with httpx.Client(timeout=timeout_s, headers={"Authorization": f"Bearer {key}"}) as client:
            request = client.build_request("POST", f"{url}/v1/chat/completions", json=body)
            while True:
                try:
                    r = client.send(request, stream=True)  # returns once the response head arrived
                    break
                except _UNANSWERED as e:
                    if len(out.resent) >= resend:
                        raise
                    out.resent.append(f"{time.monotonic() - out.started:.2f}s {type(e).__name__}: {e}"[:200])
                    time.sleep(0.2 * len(out.resent))
            try:
                out.node = answered_by(r.headers, node_of)
                if r.status_code != 200:
                    out.error = f"HTTP {r.status_code}"
                    return
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        out.finished = finish is not None
                        break
                    if line.startswith("data: "):
                        choices = json.loads(line[6:]).get("choices") or []
                        if choices:
                            out.chunks += 1
                            finish = choices[0].get("finish_reason") or finish
                if not out.finished:
                    out.error = "the stream ended without finish_reason and [DONE]"
            finally:
                r.close()
    except (httpx.HTTPError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"[:200]
    except Exception as e:  # a thread's exception would vanish: make it this stream's error
        out.error = f"client failure: {type(e).__name__}: {e}"[:200]
    finally:
        out.ended = time.monotonic()


class Streams:
    """Streaming requests in flight at once through the gateway, `add(n)` at a time; `wait()` gives
    their ends."""

    def __init__(self, gateway_url: str, key: str, node_of: dict[str, str], *, max_tokens: int,
                 pool: str = "fast", timeout_s: float = 120.0, resend_unanswered: int = 0) -> None:
        self._args = (gateway_url, key, pool, max_tokens, node_of)
        self._timeout_s = timeout_s
        self._resend = resend_unanswered
        self.results: list[Stream] = []
        self._threads: list[threading.Thread] = []

    def add(self, n: int) -> Streams:
        for _ in range(n):
            s = Stream()
            t = threading.Thread(target=_one, args=(*self._args, s, self._timeout_s, self._resend), daemon=True)
            self.results.append(s)
            self._threads.append(t)
            t.start()
        return self

    def wait(self, timeout_s: float = 180.0) -> list[Stream]:
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return self.results


class Clients:
    """Clients streaming through a simulated fleet's gateway for the whole of a `with` block, one
    new short stream every `every_s`, as the OpenAI SDK behaves: a request whose connection was
    reset before any answer (uvicorn closes a connection it accepted but had not read yet when a
    graceful reload ends its worker) is sent again, twice at most; each resend is counted."""

    def __init__(self, sim: SimFleet, key: str, *, every_s: float = 0.4, max_tokens: int = 48,
                 resend_unanswered: int = 2) -> None:
        node_of = {f"http://{m.ip}:8000": m.name for m in sim.nodes}
        self.streams = Streams(f"http://{sim.gateway.ip}:4000", key, node_of, max_tokens=max_tokens,
                               timeout_s=120, resend_unanswered=resend_unanswered)
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.streams.add(1)

    def __enter__(self) -> Clients:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.streams.wait(180)

    @property
    def failed(self) -> list[str]:
        return [f"{s.node}: {s.error} (resent: {s.resent})" for s in self.streams.results if s.dropped]

    @property
    def resent(self) -> list[str]:
        return [r for s in self.streams.results for r in s.resent]


def on_every_engine(gateway_url: str, key: str, engines: dict[str, Served], *, max_tokens: int, first: int = 2,
                    tries: int = 8, wait_s: float = 3.0) -> Streams:
    """`first` streams through the gateway, then two more at a time until every engine carries one
    (the router may pick the same node for a whole batch)."""
    node_of = {e.base_url: name for name, e in engines.items()}
    streams = Streams(gateway_url, key, node_of, max_tokens=max_tokens).add(first)
    for _ in range(tries):
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if all(running(e) >= 1 for e in engines.values()):
                return streams
            time.sleep(0.1)
        streams.add(2)
    raise RuntimeError(f"streams did not reach every engine: { {n: running(e) for n, e in engines.items()} }")


def traffic_fleet(sim: SimFleet, port: int, reload: str = "graceful") -> Fleet:
    """The sim's fleet with the engines of `engines_on` at `port`, routing shuffled (streams land on
    every node, not on the fastest only), reloading gracefully or by the runbook's restart."""
    data = yaml.safe_load(open(sim.fleet_file))
    data["launch"]["port"] = port
    data["gateway"]["routing_strategy"] = "simple-shuffle"
    data["gateway"]["reload"] = reload
    data["gateway"]["reload_command"] = [str(sim.gateway.bin / ("litellm-reload" if reload == "graceful"
                                                                 else "litellm-restart"))]
    return parse_fleet(data, f"{reload} traffic fleet")


def running(engine: Served) -> float:
    """vllm:num_requests_running on one engine (the stand-in's /metrics)."""
    text = httpx.get(engine.base_url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))


POOLED, FRESH, OPENAI, WHOLE = "pooled", "fresh", "openai", "whole"
KINDS = (POOLED, FRESH, OPENAI, WHOLE)
_BODY_TEXT = "Count slowly, one word per line."


def _read_whole(r: httpx.Response, out: Stream, node_of: dict[str, str]) -> None:
    """A non-streaming answer: served when it is one JSON body with a finish_reason."""
    out.head_at = time.time()
    out.node = answered_by(r.headers, node_of)
    if r.status_code != 200:
        out.error = f"HTTP {r.status_code}: {r.text[:120]}"
        return
    try:
        choices = r.json().get("choices") or []
    except ValueError:
        out.error = f"not a JSON answer: {r.text[:120]}"
        return
    out.chunks = 1 if choices else 0
    out.finished = bool(choices) and choices[0].get("finish_reason") is not None
    if not out.finished:
        out.error = "the answer has no choice with a finish_reason"


def _read_stream(r: httpx.Response, out: Stream, node_of: dict[str, str]) -> None:
    out.head_at = time.time()
    out.node = answered_by(r.headers, node_of)
    if r.status_code != 200:
        r.read()
        out.error = f"HTTP {r.status_code}: {r.text[:120]}"
        return
    finish = None
    for line in r.iter_lines():
        if line == "data: [DONE]":
            out.finished = finish is not None
            break
        if line.startswith("data: "):
            choices = json.loads(line[6:]).get("choices") or []
            if choices:
                out.chunks += 1
                finish = choices[0].get("finish_reason") or finish
    if not out.finished:
        out.error = "the stream ended without finish_reason and [DONE]"


class _SdkRetries(logging.Handler):
    """The OpenAI SDK says each retry on its logger ("Retrying request to ...", after the exception
    or status that caused it): kept per thread, with its cause."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.by_thread: dict[int, list[str]] = {}
        self._cause: dict[int, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        said, thread = record.getMessage(), record.thread or 0
        if said.startswith(("Encountered", "Retrying due to")):
            self._cause[thread] = said
        elif "Retrying request" in said:
            self.by_thread.setdefault(thread, []).append(f"{self._cause.pop(thread, '?')}: {said}"[:200])


class ClientLoop:
    """One client sending requests through the gateway back to back until stopped, streaming
    but for `whole`. `pooled`: one httpx client (keep-alive pool) for every request, never
    resending: what a program holding a connection does. `whole`: the same pooled client asking
    for non-streaming answers (one JSON body, the whole answer at its end). `fresh`: a new
    connection for each request. `openai`: the OpenAI SDK's default client (its own keep-alive
    pool; it resends a request whose connection failed, twice, and says so on its logger:
    counted in each Stream's `resent`)."""

    def __init__(self, kind: str, url: str, key: str, node_of: dict[str, str], *, max_tokens: int,
                 pool: str = "fast", pause_s: float = 0.0, timeout_s: float = 120.0,
                 retries: _SdkRetries | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"client kind {kind!r}: one of {', '.join(KINDS)}")
        self.kind, self.url, self.key, self.node_of = kind, url, key, node_of
        self.max_tokens, self.pool, self.pause_s, self.timeout_s = max_tokens, pool, pause_s, timeout_s
        self.results: list[Stream] = []
        self._retries = retries
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"client-{kind}", daemon=True)

    def _body(self) -> dict:
        return {"model": self.pool, "stream": self.kind != WHOLE, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": _BODY_TEXT}]}

    def _loop(self) -> None:
        headers = {"Authorization": f"Bearer {self.key}"}
        pooled = httpx.Client(timeout=self.timeout_s, headers=headers) if self.kind in (POOLED, WHOLE) else None
        sdk = None
        if self.kind == OPENAI:
            import openai  # the test extra; only this client kind needs it

            sdk = openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, timeout=self.timeout_s)
        try:
            while not self._stop.is_set():
                out = Stream(kind=self.kind, at=time.time(), started=time.monotonic())
                self.results.append(out)
                try:
                    if sdk is not None:
                        self._sdk_one(sdk, out)
                    elif self.kind == WHOLE:
                        _read_whole(pooled.post(f"{self.url}/v1/chat/completions", json=self._body()), out,
                                    self.node_of)
                    elif pooled is not None:
                        with pooled.stream("POST", f"{self.url}/v1/chat/completions", json=self._body()) as r:
                            _read_stream(r, out, self.node_of)
                    else:
                        with httpx.Client(timeout=self.timeout_s, headers=headers) as c, \
                                c.stream("POST", f"{self.url}/v1/chat/completions", json=self._body()) as r:
                            _read_stream(r, out, self.node_of)
                except Exception as e:  # a thread's exception would vanish: make it this request's error
                    out.error = f"{type(e).__name__}: {e}"[:200]
                finally:
                    out.ended = time.monotonic()
                if self.pause_s:
                    self._stop.wait(self.pause_s)
        finally:
            if pooled is not None:
                pooled.close()
            if sdk is not None:
                sdk.close()

    def _sdk_one(self, sdk, out: Stream) -> None:
        before = len(self._retries.by_thread.get(threading.get_ident(), [])) if self._retries else 0
        try:
            raw = sdk.chat.completions.with_raw_response.create(
                model=self.pool, stream=True, max_tokens=self.max_tokens,
                messages=[{"role": "user", "content": _BODY_TEXT}])
            out.head_at = time.time()
            out.node = answered_by(raw.headers, self.node_of)
            finish = None
            for chunk in raw.parse():
                if chunk.choices:
                    out.chunks += 1
                    finish = chunk.choices[0].finish_reason or finish
            out.finished = finish is not None
            if not out.finished:
                out.error = "the stream ended without finish_reason"
        finally:
            if self._retries:
                out.resent = self._retries.by_thread.get(threading.get_ident(), [])[before:]

    def start(self) -> ClientLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


class Traffic:
    """`clients` {kind: how many} sending back to back through the simulated fleet's gateway for
    the whole of a `with` block (each request `max_tokens` long). `failed(kind)` lists what
    failed; `served_by(node)` what reached a node, with wall-clock start times."""

    def __init__(self, url: str, key: str, node_of: dict[str, str], clients: dict[str, int], *,
                 max_tokens: int = 24, pause_s: float = 0.0) -> None:
        self._retries = _SdkRetries()
        self.loops = [ClientLoop(kind, url, key, node_of, max_tokens=max_tokens, pause_s=pause_s,
                                 retries=self._retries)
                      for kind, n in clients.items() for _ in range(n)]

    @classmethod
    def through(cls, sim: SimFleet, key: str, clients: dict[str, int], *, port: int = 8000, **kw) -> Traffic:
        node_of = {f"http://{m.ip}:{port}": m.name for m in sim.nodes}
        return cls(f"http://{sim.gateway.ip}:4000", key, node_of, clients, **kw)

    def __enter__(self) -> Traffic:
        if any(loop.kind == OPENAI for loop in self.loops):
            sdk_log = logging.getLogger("openai._base_client")
            sdk_log.addHandler(self._retries)
            sdk_log.setLevel(logging.DEBUG)
        for loop in self.loops:
            loop.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for loop in self.loops:
            loop.stop()
        for loop in self.loops:
            loop.join(180)
        logging.getLogger("openai._base_client").removeHandler(self._retries)

    def results(self, kind: str | None = None) -> list[Stream]:
        return [s for loop in self.loops if kind in (None, loop.kind) for s in loop.results if s.ended]

    def failed(self, kind: str | None = None) -> list[str]:
        return [f"{s.kind} {s.node or '?'} at {s.at:.2f}: {s.error}" for s in self.results(kind) if s.dropped]

    def resent(self, kind: str | None = None) -> list[str]:
        return [r for s in self.results(kind) for r in s.resent]

    def summary(self) -> str:
        kinds = dict.fromkeys(loop.kind for loop in self.loops)
        return "; ".join(f"{k}: {len(self.results(k))} requests, {len(self.failed(k))} failed"
                         + (f", {len(self.resent(k))} resent" if k == OPENAI else "") for k in kinds)
