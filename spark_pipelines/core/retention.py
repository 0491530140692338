"""Which of the files this tool writes for people (and never reads back) to keep: each command's
whole output and the bench-history charts. The newest `max_files` stay, none older than the age
limit (fleet file `retention:`, core/fleet_settings.py). Pure: names and times in, names out."""

from __future__ import annotations

from collections.abc import Iterable

DAY_S = 86400.0


def expired(files: Iterable[tuple[str, float]], *, now: float, max_age_days: float, max_files: int) -> list[str]:
    """The names to remove from (name, mtime) pairs: beyond the newest `max_files`, or older than
    `max_age_days`. A file written now is never one of them."""
    newest_first = sorted(files, key=lambda f: f[1], reverse=True)
    limit = max_age_days * DAY_S
    return [name for i, (name, mtime) in enumerate(newest_first) if i >= max_files or now - mtime > limit]
