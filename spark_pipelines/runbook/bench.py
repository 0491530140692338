"""The isolated bench of one node: wait for zero requests in flight, sample the GPU under load."""

from __future__ import annotations

import threading

from spark_pipelines.core import gpu
from spark_pipelines.core.diagnosis import METRIC_RUNNING, METRIC_WAITING
from spark_pipelines.core.fleet import Fleet, Node
from spark_pipelines.core.polling import poll_until
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook import engine
from spark_pipelines.runbook.errors import RunbookError
from spark_pipelines.runbook.preflight import read_gpu

DRAIN_TIMEOUT_S = 120
GPU_SAMPLE_EVERY_S = 2.0


class GpuSampler:
    """Reads the node's nvidia-smi while the bench drives load: the PD-firmware wedge only shows
    under load (runbook: "run nvidia-smi ... during load -- if <1000 MHz, cold-drain is required").
    A thread, because the bench client owns this thread's event loop."""

    def __init__(self, s: FleetSession, node: Node, every_s: float = GPU_SAMPLE_EVERY_S) -> None:
        self._s, self._node, self._every = s, node, every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"gpu-sampler-{node.name}", daemon=True)
        self.readings: list[gpu.GpuReading] = []
        self.errors: list[str] = []

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self.readings.append(read_gpu(self._s, self._node.name, timeout=20))
            except Exception as e:  # a sample lost must not fail the bench it watches
                self.errors.append(f"{type(e).__name__}: {e}")

    def verdict(self) -> gpu.GpuVerdict:
        v = gpu.judge_under_load(self.readings)
        if self.errors:
            v = gpu.GpuVerdict(state=v.state, reasons=[*v.reasons, f"{len(self.errors)} sample(s) unreadable: "
                                                       f"{self.errors[-1]}"])
        return v


def wait_idle(fleet: Fleet, node: Node, timeout_s: float = DRAIN_TIMEOUT_S) -> float:
    """Wait until vLLM reports no running or waiting request; returns the seconds waited."""
    def in_flight() -> float:
        m = engine.engine_metrics(fleet, node)
        if m is None:
            raise RunbookError(f"{node.name}: vLLM /metrics does not answer; is the deployment up?")
        return m.get(METRIC_RUNNING, 0) + m.get(METRIC_WAITING, 0)

    polled = poll_until(in_flight, lambda busy: busy == 0, timeout_s=timeout_s)
    if not polled.done:
        raise RunbookError(f"{node.name} still has {polled.value:g} requests in flight {timeout_s:.0f} s after "
                           "leaving the gateway; something else talks to it directly")
    return round(polled.waited_s, 1)
