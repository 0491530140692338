"""Pruning a local directory of files this tool wrote, by core.retention's rule: done where the
files are written (the command outputs when a session writes its first one, the bench charts
after each chart), so no schedule or hand step is needed and the directory never grows unbounded."""

from __future__ import annotations

import re
import time
from pathlib import Path

from spark_pipelines.core import retention


def prune(directory: Path, name: re.Pattern[str], *, max_age_days: float, max_files: int,
          now: float | None = None) -> list[str]:
    """Remove the files in `directory` whose name matches `name` and that the rule expires; returns
    their names. Best effort: a file another process removed first, or one that cannot be read,
    is skipped (pruning never fails the step that writes)."""
    files = []
    try:
        for p in directory.iterdir():
            if name.fullmatch(p.name):
                try:
                    files.append((p.name, p.stat().st_mtime))
                except OSError:
                    continue
    except OSError:
        return []
    gone = []
    for n in retention.expired(files, now=time.time() if now is None else now, max_age_days=max_age_days,
                               max_files=max_files):
        try:
            (directory / n).unlink()
            gone.append(n)
        except OSError:
            continue
    return gone
