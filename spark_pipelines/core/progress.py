"""Progress a person can watch: bytes done of a total, the rate and the time left, as one line.

A 71 GB copy or hash runs for minutes; a log that says nothing until it ends looks hung. Every
long transfer and hash feeds one `Progress` (bytes as they are done), says `line()` in the run's
log at most every `every_s` seconds (`due`), and leaves `figures()` in the asset's metadata when it
ends. Pure: the caller passes the clock, so the wording and the pacing are testable without
sleeping; the caller also holds the lock when several threads feed one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_EVERY_S = 10.0


def size_text(n: float) -> str:
    """Bytes as a person reads them: `512 B`, `3.4 MiB`, `71.2 GiB`."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def duration_text(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


@dataclass
class Progress:
    """What `what` has done so far. `total` 0: unknown (no percentage, no ETA)."""

    what: str
    total: int
    started: float
    done: int = 0
    every_s: float = DEFAULT_EVERY_S
    ended: float | None = None
    _said: float | None = field(default=None, repr=False)

    def add(self, n: int) -> None:
        self.done += max(0, n)

    def set(self, done: int) -> None:
        """An absolute count (a node-side hash reports how far it is)."""
        self.done = max(self.done, done)

    def rate(self, now: float) -> float:
        """Bytes per second since the start (0 before a second passed)."""
        elapsed = (self.ended if self.ended is not None else now) - self.started
        return self.done / elapsed if elapsed >= 1.0 else 0.0

    def eta(self, now: float) -> float | None:
        r = self.rate(now)
        if not self.total or r <= 0 or self.done >= self.total:
            return None
        return (self.total - self.done) / r

    def due(self, now: float) -> bool:
        """Time for another log line: the first one after `every_s`, then every `every_s`."""
        since = self._said if self._said is not None else self.started
        if now - since < self.every_s:
            return False
        self._said = now
        return True

    @property
    def spoke(self) -> bool:
        """It said a line while running: a long one, whose end is worth a line too."""
        return self._said is not None

    def line(self, now: float) -> str:
        """`copy spark1 -> spark2: 12.3 GiB of 71.0 GiB (17%), 85.2 MiB/s, ETA 11m42s`."""
        head = f"{self.what}: {size_text(self.done)}"
        if self.total:
            head += f" of {size_text(self.total)} ({100 * min(self.done, self.total) // self.total}%)"
        r = self.rate(now)
        if r > 0:
            head += f", {size_text(r)}/s"
        eta = self.eta(now)
        if eta is not None:
            head += f", ETA {duration_text(eta)}"
        elif self.ended is not None:
            head += f", done in {duration_text(self.ended - self.started)}"
        return head

    def end(self, now: float) -> str:
        self.ended = now
        return self.line(now)

    def figures(self, now: float, prefix: str) -> dict[str, float]:
        """The metadata a step records when it ends: `<prefix>_bytes`, `_seconds`, `_mib_per_s`."""
        end = self.ended if self.ended is not None else now
        return {f"{prefix}_bytes": self.done, f"{prefix}_seconds": round(end - self.started, 1),
                f"{prefix}_mib_per_s": round(self.rate(now) / (1 << 20), 1)}
