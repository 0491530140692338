"""The one client for a node's vLLM engine: /health, /metrics, the smoke test.

Used by the deploy, the bench, the gateway promotion, the sensors and the CLI. Every call has a
timeout: a probe is seconds, the smoke test up to two minutes (first tokens after a cold start).
"""

from __future__ import annotations

from typing import Any

import httpx

from spark_pipelines.core import diagnosis
from spark_pipelines.core.fleet import Fleet, Node
from spark_pipelines.core.polling import poll_until

SMOKE_PROMPT = "What is 2+2? Be concise."
PROBE_TIMEOUT_S = 5.0
METRICS_TIMEOUT_S = 10.0
SMOKE_TIMEOUT_S = 120.0


def api_root(fleet: Fleet, node: Node) -> str:
    host = node.host if ":" not in node.host else f"[{node.host}]"
    return f"http://{host}:{fleet.launch_for(node).port}"


def engine_metrics(fleet: Fleet, node: Node, timeout: float = METRICS_TIMEOUT_S) -> dict[str, float] | None:
    """The node's vLLM /metrics (parsed), or None when the engine does not answer."""
    try:
        return diagnosis.parse_metrics(httpx.get(f"{api_root(fleet, node)}/metrics", timeout=timeout).text)
    except httpx.HTTPError:
        return None


def healthy(fleet: Fleet, node: Node, timeout: float = PROBE_TIMEOUT_S) -> bool:
    try:
        return httpx.get(f"{api_root(fleet, node)}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(fleet: Fleet, node: Node, seconds: float) -> bool:
    return poll_until(lambda: healthy(fleet, node), bool, timeout_s=seconds).done


def smoke_test(fleet: Fleet, node: Node) -> dict[str, Any]:
    """The runbook's "What is 2+2?" request; raises ValueError when no tokens come back."""
    launch = fleet.launch_for(node)
    r = httpx.post(
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
