"""The fleet's bench history as a PNG: one series per node on a dated time axis, each node's
floor and the recipe's reference as lines, the y axis from 0 (a 0.01 tok/s wobble is not a drop)."""

from __future__ import annotations

import datetime as dt
import io
from collections.abc import Mapping, Sequence

import matplotlib

matplotlib.use("Agg")  # no display on nodes or CI

import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

from spark_pipelines.core.bench import REFERENCE_MEAN_TOK_S  # noqa: E402

Timestamp = dt.datetime | float | int
Points = Sequence[tuple[Timestamp, float]]

# A lone point (or points minutes apart) still gets a readable axis: at least this wide. Not
# wider: two benches two minutes apart on a half-day axis are one blob.
MIN_SPAN = dt.timedelta(minutes=30)
# One marker shape per node, the later ones hollow: equal figures stay visible on top of each other.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
DATE_FORMAT = "%Y-%m-%d %H:%M"


def _as_datetime(ts: Timestamp) -> dt.datetime:
    if isinstance(ts, dt.datetime):
        return ts if ts.tzinfo else ts.replace(tzinfo=dt.timezone.utc)
    if isinstance(ts, (int, float)):
        return dt.datetime.fromtimestamp(float(ts), tz=dt.timezone.utc)
    raise ValueError(f"history timestamp {ts!r} is neither a datetime nor epoch seconds")


def clean_series(series: Mapping[str, Points]) -> dict[str, list[tuple[dt.datetime, float]]]:
    """Each node's points as (UTC datetime, tok/s) in time order; refuses negative tok/s."""
    out: dict[str, list[tuple[dt.datetime, float]]] = {}
    for node, history in series.items():
        points = sorted((_as_datetime(t), float(v)) for t, v in history)
        for when, value in points:
            if value < 0:
                raise ValueError(f"bench history of {node} at {when.isoformat()} has negative tok/s {value}")
        if points:
            out[node] = points
    if not out:
        raise ValueError("bench history is empty: run a bench on the node first")
    return out


def x_range(times: Sequence[dt.datetime]) -> tuple[dt.datetime, dt.datetime]:
    """The points' span, padded by 5 %, at least MIN_SPAN wide and centred on a lone point."""
    lo, hi = min(times), max(times)
    span = max(hi - lo, MIN_SPAN)
    mid = lo + (hi - lo) / 2
    half = span * 1.1 / 2
    return mid - half, mid + half


def marker_style(index: int) -> dict[str, object]:
    """The index-th node's marker: its own shape, larger and hollow from the second node on, so a
    point equal to another node's is drawn around it, not under it."""
    style: dict[str, object] = {"marker": MARKERS[index % len(MARKERS)], "markersize": 6 + 2 * min(index, 3)}
    if index:
        style["markerfacecolor"] = "none"
        style["markeredgewidth"] = 1.5
    return style


def y_range(values: Sequence[float], lines: Sequence[float | None] = ()) -> tuple[float, float]:
    """From 0 to 15 % above the highest point or line: relative differences read true."""
    top = max([*values, *(v for v in lines if v is not None), 0.0])
    return 0.0, (top * 1.15) or 1.0


def render_fleet_history_png(
    series: Mapping[str, Points],
    *,
    floors: Mapping[str, float] | None = None,
    reference: float | None = REFERENCE_MEAN_TOK_S,
    title: str = "bench history: recipe mean tok/s per node",
) -> bytes:
    """Plot each node's (timestamp, tok/s) points as its own series, with floors and reference."""
    data = clean_series(series)
    floors = dict(floors or {})
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=100)
    try:
        for i, (node, points) in enumerate(data.items()):
            (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], linewidth=1.5,
                              label=f"{node} mean tok/s", **marker_style(i))
            if node in floors:
                ax.axhline(floors[node], color=line.get_color(), linestyle=":", linewidth=1,
                           label=f"{node} floor {floors[node]:g} tok/s")
        if reference is not None:
            ax.axhline(reference, color="grey", linestyle="--", linewidth=1, label=f"reference {reference:g} tok/s")
        times = [p[0] for points in data.values() for p in points]
        ax.set_xlim(*x_range(times))
        ax.set_ylim(*y_range([p[1] for points in data.values() for p in points], [reference, *floors.values()]))
        ax.set_title(title)
        ax.set_ylabel("tok/s")
        ax.set_xlabel("UTC")
        ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=7))
        ax.xaxis.set_major_formatter(mdates.DateFormatter(DATE_FORMAT, tz=dt.timezone.utc))
        fig.autofmt_xdate()
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower left", fontsize=7, ncol=2)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        return buf.getvalue()
    finally:
        plt.close(fig)


def render_history_png(
    history: Points,
    *,
    title: str = "bench history",
    reference: float | None = REFERENCE_MEAN_TOK_S,
    floor: float | None = None,
    node: str = "node",
) -> bytes:
    """One node's history (see render_fleet_history_png)."""
    return render_fleet_history_png({node: history}, floors={node: floor} if floor is not None else None,
                                    reference=reference, title=title)
