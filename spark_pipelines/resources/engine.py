"""The one client for a node's vLLM engine: /health, /metrics, the smoke test, the sweep's probe.

Used by the deploy, the bench, the gateway promotion, the health sweep, the sensors and the CLI.
Every call has a timeout: a probe is seconds, the smoke test up to two minutes (first tokens after
a cold start).
"""

from __future__ import annotations

import threading
from typing import Any

import httpx

from spark_pipelines.core import diagnosis
from spark_pipelines.core.errors import first_line
from spark_pipelines.core.fleet import Fleet, Node
from spark_pipelines.core.polling import poll_until

# What an engine call raises when the engine does not answer as HTTP should (callers above catch
# this name, not the client library's).
EngineError = httpx.HTTPError

SMOKE_PROMPT = "What is 2+2? Be concise."
PROBE_TIMEOUT_S = 5.0
METRICS_TIMEOUT_S = 10.0
SMOKE_TIMEOUT_S = 120.0


_client: httpx.Client | None = None
_client_lock = threading.Lock()


def client() -> httpx.Client:
    """One client for every engine call of the process: a new httpx client per request loads the
    CA bundle each time (~0.1 s of CPU, once the largest cost of a sweep); the engine is plain
    http, and no connection is kept (a restarted engine must not meet a stale one)."""
    global _client
    with _client_lock:
        if _client is None:
            _client = httpx.Client(verify=False, limits=httpx.Limits(max_connections=256,
                                                                     max_keepalive_connections=0))
        return _client


def api_root(fleet: Fleet, node: Node) -> str:
    host = node.host if ":" not in node.host else f"[{node.host}]"
    return f"http://{host}:{fleet.launch_for(node).port}"


def engine_metrics(fleet: Fleet, node: Node, timeout: float = METRICS_TIMEOUT_S) -> dict[str, float] | None:
    """The node's vLLM /metrics (parsed), or None when the engine does not answer."""
    try:
        return diagnosis.parse_metrics(client().get(f"{api_root(fleet, node)}/metrics", timeout=timeout).text)
    except httpx.HTTPError:
        return None


def healthy(fleet: Fleet, node: Node, timeout: float = PROBE_TIMEOUT_S) -> bool:
    try:
        return client().get(f"{api_root(fleet, node)}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(fleet: Fleet, node: Node, seconds: float) -> bool:
    return poll_until(lambda: healthy(fleet, node), bool, timeout_s=seconds).done


def smoke_test(fleet: Fleet, node: Node) -> dict[str, Any]:
    """The runbook's "What is 2+2?" request; raises ValueError when no tokens come back."""
    launch = fleet.launch_for(node)
    r = client().post(
        f"{api_root(fleet, node)}/v1/chat/completions",
        json={"model": launch.served_model_name, "messages": [{"role": "user", "content": SMOKE_PROMPT}],
              "max_tokens": 64},
        timeout=SMOKE_TIMEOUT_S,
    )
    r.raise_for_status()
    body = r.json()
    tokens = int(body["usage"]["completion_tokens"])
    if tokens <= 0 or not body.get("choices"):
        raise ValueError("the smoke test got no completion tokens (Engine init failed?)")
    return {"completion_tokens": tokens}


def complete(fleet: Fleet, node: Node, prompt: str, max_tokens: int, timeout: float) -> None:
    """One chat completion straight at the node's engine (load for the wedge's validation);
    raises EngineError when it does not answer."""
    body = {"model": fleet.launch_for(node).served_model_name, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}]}
    client().post(f"{api_root(fleet, node)}/v1/chat/completions", json=body, timeout=timeout)


def interesting_metrics(text: str) -> str:
    """Only the sample lines of the metrics the verdicts read: vLLM's /metrics is ~600 lines of
    histograms and process gauges, and parsing all of it cost more CPU than the SSH probe.
    Dropped comment lines leave those samples untyped, with the same names and values."""
    keep = diagnosis.METRICS_OF_INTEREST
    return "\n".join(line for line in text.splitlines()
                     if line and line[0] != "#" and line.split("{", 1)[0].split(" ", 1)[0] in keep) + "\n"


def probe(fleet: Fleet, node: Node, health_timeout_s: float = PROBE_TIMEOUT_S,
          metrics_timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """The health sweep's HTTP half of one node: health_ok / health_error, and when healthy the
    metrics the verdicts read (metrics / metrics_error). Never raises for the engine's answer."""
    root, c = api_root(fleet, node), client()
    try:
        ok = c.get(f"{root}/health", timeout=health_timeout_s).status_code == 200
    except httpx.HTTPError:
        ok = False
    out: dict[str, Any] = {"health_ok": ok,
                           "health_error": None if ok else f"no 200 from {root}/health within {health_timeout_s:g} s"}
    if ok:  # a dead engine's /metrics says nothing the container state does not
        metrics = None
        try:
            metrics = diagnosis.parse_metrics(interesting_metrics(
                c.get(f"{root}/metrics", timeout=metrics_timeout_s).text))
        except diagnosis.MetricsFormatError as e:
            out["metrics_error"] = first_line(e)
        except httpx.HTTPError:
            pass
        out["metrics"] = metrics
        if metrics is None and "metrics_error" not in out:
            out["metrics_error"] = f"/metrics did not answer within {metrics_timeout_s:g} s"
    return out
