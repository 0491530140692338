"""The bench protocol: how output length was set and how tokens were counted, so that a figure is
only ever compared with figures made the same way.

Why: with speculative decoding (MTP) a bench that lets requests stop at EOS measures a different
mix (short answers weigh TTFT, long ones the accepted drafts), and a client that counts stream
chunks counts engine steps, not tokens (one MTP step carries several). So the fleet's bench forces
the output length (vLLM's `ignore_eos` and `min_tokens`) and counts tokens from the server's usage;
the record says whether the server honoured the forcing (every request returned exactly
max_tokens), and `comparable` refuses any pair made under different protocols.

Pure: no network, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol as _Shape

PROTOCOL_VERSION = 1
TOKENS_FROM_USAGE = "server usage"  # usage.completion_tokens, never the client's chunk count


class ProtocolMismatch(ValueError):
    """Two benches made under different protocols were about to be compared."""


class _Sample(_Shape):
    max_tokens: int
    completion_tokens: int

    @property
    def ok(self) -> bool: ...


@dataclass(frozen=True)
class BenchProtocol:
    output_length: str  # "forced" | "forced, not honoured" | "natural (stops at EOS)"
    forced_by: str  # "ignore_eos + min_tokens" or "-"
    token_count: str = TOKENS_FROM_USAGE
    stream: bool = True
    version: int = PROTOCOL_VERSION

    @property
    def key(self) -> str:
        """What must be equal for two benches to be compared."""
        return f"v{self.version}|{self.output_length}|{self.token_count}|{'stream' if self.stream else 'post'}"

    def text(self) -> str:
        how = f" by {self.forced_by}" if self.forced_by != "-" else ""
        return (f"protocol v{self.version}: output length {self.output_length}{how}, tokens from "
                f"{self.token_count}, {'streamed' if self.stream else 'non-streaming'}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"key": self.key}


FORCED_BY = "ignore_eos + min_tokens"


def protocol_of(samples: Iterable[_Sample], *, forced: bool, stream: bool) -> BenchProtocol:
    """The protocol a run actually followed: forcing asked for counts only when every answered
    request came back with exactly its max_tokens (a server that ignores the fields is found out)."""
    if not forced:
        return BenchProtocol("natural (stops at EOS)", "-", stream=stream)
    ok = [s for s in samples if s.ok]
    honoured = bool(ok) and all(s.completion_tokens == s.max_tokens for s in ok)
    return BenchProtocol("forced" if honoured else "forced, not honoured", FORCED_BY, stream=stream)


def key_of(record: Mapping[str, Any] | None) -> str | None:
    """The key of a recorded protocol (None: recorded before protocols were, never comparable)."""
    if not record:
        return None
    key = record.get("key")
    return str(key) if key else None


def comparable(a: str | None, b: str | None) -> tuple[bool, str]:
    """(comparable, why): two benches compare only under one known protocol."""
    if a is None or b is None:
        return False, "a bench without a recorded protocol is not compared"
    if a != b:
        return False, f"different bench protocols ({a} vs {b}): not compared"
    return True, "same protocol"


def require_comparable(a: str | None, b: str | None) -> None:
    ok, why = comparable(a, b)
    if not ok:
        raise ProtocolMismatch(why)
