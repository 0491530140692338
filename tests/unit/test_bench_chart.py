"""bench_chart: a PNG of a node's bench history; bench_client's SSE line test."""

from __future__ import annotations

import datetime as dt
import io

import pytest

from spark_pipelines.assets.bench_chart import render_history_png
from spark_pipelines.resources.bench_client import _carries_text


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_history_png_is_a_real_image_of_the_points():
    t0 = dt.datetime(2026, 6, 15, 12, 0, tzinfo=dt.timezone.utc)
    history = [(t0 + dt.timedelta(days=i), v) for i, v in enumerate([47.5, 34.0, 52.0, 53.3])]
    png = render_history_png(history, title="spark2")
    w, h = _png_size(png)
    assert w > 300 and h > 150
    # Matplotlib can read it back: a decodable image with colour in it (the line).
    import matplotlib.image as mpimg

    img = mpimg.imread(io.BytesIO(png), format="png")
    assert img.shape[0] == h and img.shape[1] == w
    assert (img[..., :3].std(axis=2) > 0.1).any()


def test_history_accepts_epoch_seconds_and_unsorted_points():
    png = render_history_png([(1_800_000_000.0, 50.0), (1_799_000_000, 40.0)])
    assert _png_size(png)[0] > 0


def test_history_refuses_empty_or_negative():
    with pytest.raises(ValueError, match="empty"):
        render_history_png([])
    with pytest.raises(ValueError, match="negative"):
        render_history_png([(1_800_000_000, -1.0)])
    with pytest.raises(ValueError, match="neither"):
        render_history_png([("yesterday", 1.0)])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}', False),
        (b'data: {"choices":[{"index":0,"delta":{"content":"py"}}]}', True),
        (b'data: {"choices":[{"index":0,"delta":{"content": "x"}}]}', True),  # LiteLLM spacing
        (b'data: {"choices":[{"delta":{"reasoning_content":"think"}}]}', True),
        (b'data: {"choices":[{"delta":{"reasoning":"think"}}]}', True),
        (b'data: {"choices":[{"delta":{"content":""},"finish_reason":"length"}]}', False),
        (b'data: {"choices":[],"usage":{"completion_tokens":5}}', False),
        (b'data: {"choices":[{"delta":{"content":"\\"quoted\\""}}]}', True),
    ],
)
def test_sse_text_detection(line, expected):
    assert _carries_text(line) is expected
