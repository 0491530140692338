"""A command's output on our side: captured for the result, kept whole in a local file, logged in batches.

Capture is linear in the output: each stream keeps a running byte count (never re-summing what it
holds). The file holds every line (secret values redacted, as everywhere) so the run log can stay
bounded: `core.remote.LogBatcher` decides which events reach the log.
"""

from __future__ import annotations

import os
import re
import secrets as pysecrets
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from spark_pipelines.core import remote
from spark_pipelines.core.fleet_settings import RetentionSettings
from spark_pipelines.resources.retention import prune

# Keep at most this much text per stream in a result; the output file and the tail carry the rest.
STDOUT_CAPTURE_BYTES = 8 * 1024 * 1024
# The files CommandOutput writes (and only those are ever pruned): <stamp>-<node>-<program>-<hex>.log
OUTPUT_NAME = re.compile(r"\d{8}T\d{6}-[A-Za-z0-9._-]+\.log")
PRUNE_EVERY_S = 3600.0  # a long-lived process (the CLI, a console) prunes again after this
_pruned: dict[Path, float] = {}  # directory -> when this process last pruned it (monotonic)

LineSink = Callable[[str], None]


def output_root(configured: str | None) -> Path:
    """The directory command output files go to: configured, else Dagster's storage, else temp."""
    if configured:
        return Path(os.path.expanduser(configured))
    home = os.environ.get("DAGSTER_HOME")
    if home:
        return Path(home) / "storage" / "command-output"
    return Path(tempfile.gettempdir()) / f"spark-pipelines-{os.getuid()}" / "command-output"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)[:40] or "cmd"


class CommandOutput:
    """Everything one command printed, as it arrives: capture, tail, file and batched log events."""

    def __init__(self, node: str, command: str, program: str, directory: Path | None,
                 sink: LineSink | None, secrets: list[str], prefix: str,
                 keep: RetentionSettings | None = None) -> None:
        self.node, self.sink, self.secrets, self.prefix = node, sink, secrets, prefix
        self.tail = remote.OutputTail()
        self.batcher = remote.LogBatcher()
        self.lines = 0
        self._buf: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._bytes: dict[str, int] = {"stdout": 0, "stderr": 0}
        self.path: Path | None = None
        self._fh: IO[str] | None = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            if keep is not None:
                _prune_once(directory, keep)
            stamp = time.strftime("%Y%m%dT%H%M%S")
            self.path = directory / f"{stamp}-{_slug(node)}-{_slug(program)}-{pysecrets.token_hex(3)}.log"
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            self._fh = os.fdopen(fd, "w", encoding="utf-8", errors="replace", buffering=1 << 16)
            self._fh.write(f"# node {node}: $ {command}\n")

    def add(self, stream: str, line: str) -> str:
        """Take one line (redacted here); returns it as the caller's on_line should see it."""
        line = remote.redact(line, self.secrets)
        self.lines += 1
        self.tail.add(line)
        if self._bytes[stream] < STDOUT_CAPTURE_BYTES:
            self._buf[stream].append(line)
            self._bytes[stream] += len(line) + 1
        if self._fh is not None:
            self._fh.write(line + "\n" if stream == "stdout" else f"[stderr] {line}\n")
        if self.sink is not None:
            self._emit(self.batcher.add(f"[{self.prefix}{'' if stream == 'stdout' else ' stderr'}] {line}",
                                        time.monotonic()))
        return line

    def tick(self) -> None:
        if self.sink is not None:
            self._emit(self.batcher.tick(time.monotonic()))

    def _emit(self, events: list[str]) -> None:
        assert self.sink is not None
        for e in events:
            self.sink(e)

    def text(self, stream: str) -> str:
        buf = self._buf[stream]
        return "\n".join(buf) + ("\n" if buf else "")

    def close(self, footer: str | None = None) -> None:
        """Flush the last batch (and the "K more lines in FILE" event) and close the file."""
        if self._fh is not None:
            if footer:
                self._fh.write(f"# {footer}\n")
            self._fh.close()
            self._fh = None
        if self.sink is not None:
            self._emit(self.batcher.finish(time.monotonic(), str(self.path or "the command's output")))


def _prune_once(directory: Path, keep: RetentionSettings) -> None:
    """The fleet's retention on the output directory, when this process first writes there (and
    hourly after): every run prunes what the runs before it left."""
    now = time.monotonic()
    last = _pruned.get(directory)
    if last is not None and now - last < PRUNE_EVERY_S:
        return
    _pruned[directory] = now
    prune(directory, OUTPUT_NAME, max_age_days=keep.max_age_days, max_files=keep.command_outputs)

