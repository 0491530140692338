"""Clients' traffic through the simulated gateway.

`engines_on` runs the vLLM stand-in on every node's own address, in the node's network namespace
but outside Docker (the gateway needs an engine there, not a deployment). `Streams` sends
streaming chat requests through the real LiteLLM proxy, each in its thread, and records how each
one ended and which node served it (LiteLLM names the backend in `x-litellm-model-api-base`):
what a drain or a reload must not break.
"""

from __future__ import annotations

import json
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
                base = r.headers.get(API_BASE_HEADER, "")
                out.node = next((n for b, n in node_of.items() if base.startswith(b)), None)
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
