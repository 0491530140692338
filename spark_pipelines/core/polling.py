"""Wait for a condition by asking again: the one polling loop of the runbook's waits (engine
/health, a drained node's in-flight requests, the gateway's readiness, the simulator's waits).

The clock and the sleep are parameters, so the loop's arithmetic is tested without waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Polled(Generic[T]):
    done: bool  # the condition held before the deadline
    value: T  # the probe's last answer
    waited_s: float


def poll_until(
    probe: Callable[[], T],
    done: Callable[[T], bool],
    *,
    timeout_s: float,
    every_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Polled[T]:
    """Call `probe` until `done(answer)` or `timeout_s` have passed; the probe runs at least once
    and once more at the deadline. Exceptions of the probe propagate: a probe that knows the wait
    is hopeless (the engine is gone) says so at once rather than at the deadline."""
    if every_s <= 0:
        raise ValueError(f"every_s must be > 0, got {every_s!r}")
    started = clock()
    while True:
        value = probe()
        waited = clock() - started
        if done(value):
            return Polled(True, value, waited)
        if waited >= timeout_s:
            return Polled(False, value, waited)
        sleep(min(every_s, timeout_s - waited))
