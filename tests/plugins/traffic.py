"""Live requests straight to a node's vLLM, as production traffic through the gateway would be."""

from __future__ import annotations

import threading
import time

import httpx

from spark_pipelines.core.diagnosis import parse_metrics
from spark_pipelines.resources import engine

# A loaded CI machine can take seconds between a request's send and the engine's gauge moving.
UNDER_LOAD_WITHIN_S = 30.0


class Traffic:
    """Streams of long requests to one node's engine; entering waits until the engine reports one
    running (vLLM's num_requests_running gauge), so what the test observes next sees the load."""

    def __init__(self, fleet, name="spark2", streams=2):
        node = fleet.node(name)
        self.root = engine.api_root(fleet, node)
        self.model = fleet.launch_for(node).served_model_name
        self.stop = threading.Event()
        self.workers = [threading.Thread(target=self._loop, daemon=True) for _ in range(streams)]

    def _loop(self):
        while not self.stop.is_set():
            try:
                httpx.post(f"{self.root}/v1/chat/completions", timeout=60,
                           json={"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 2048})
            except httpx.HTTPError:
                time.sleep(0.5)

    def running(self) -> float:
        try:
            text = httpx.get(f"{self.root}/metrics", timeout=5).text
        except httpx.HTTPError:
            return 0.0
        return parse_metrics(text).get("vllm:num_requests_running", 0.0)

    def __enter__(self):
        for w in self.workers:
            w.start()
        deadline = time.monotonic() + UNDER_LOAD_WITHIN_S
        while self.running() < 1:
            if time.monotonic() > deadline:
                self.__exit__()
                raise AssertionError(f"{self.root}: no request running {UNDER_LOAD_WITHIN_S:.0f} s after the load began")
            time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for w in self.workers:
            w.join(timeout=60)
