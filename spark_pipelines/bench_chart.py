"""A node's bench history as a PNG (for asset metadata and the operator's report)."""

from __future__ import annotations

import datetime as dt
import io
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # no display on nodes or CI

import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

from spark_pipelines.core.bench import REFERENCE_MEAN_TOK_S  # noqa: E402

Timestamp = dt.datetime | float | int


def _as_datetime(ts: Timestamp) -> dt.datetime:
    if isinstance(ts, dt.datetime):
        return ts if ts.tzinfo else ts.replace(tzinfo=dt.timezone.utc)
    if isinstance(ts, (int, float)):
        return dt.datetime.fromtimestamp(float(ts), tz=dt.timezone.utc)
    raise ValueError(f"history timestamp {ts!r} is neither a datetime nor epoch seconds")


def render_history_png(
    history: Sequence[tuple[Timestamp, float]],
    *,
    title: str = "bench history",
    reference: float | None = REFERENCE_MEAN_TOK_S,
) -> bytes:
    """Plot (timestamp, tok/s) points in time order, with the recipe's reference line."""
    if not history:
        raise ValueError("bench history is empty: run a bench on the node first")
    points = sorted((_as_datetime(t), float(v)) for t, v in history)
    for when, value in points:
        if value < 0:
            raise ValueError(f"bench history at {when.isoformat()} has negative tok/s {value}")
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=100)
    try:
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        ax.plot(xs, ys, marker="o", linewidth=1.5, label="measured mean tok/s")
        if reference is not None:
            ax.axhline(reference, color="grey", linestyle="--", linewidth=1,
                       label=f"reference {reference:g} tok/s")
        ax.set_title(title)
        ax.set_ylabel("tok/s")
        ax.set_ylim(bottom=0, top=max(ys + [reference or 0]) * 1.15 or 1)
        ax.xaxis.set_major_formatter(mdates.DateFormatter("%m-%d %H:%M"))
        fig.autofmt_xdate()
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()
    finally:
        plt.close(fig)
