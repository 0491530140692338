"""Progress a person can watch (core/progress.py): the line, its pacing, the figures at the end."""

from spark_pipelines.core.progress import Progress, duration_text, size_text


def test_the_line_says_bytes_of_the_total_rate_and_time_left():
    p = Progress("copy spark1 -> spark2", total=10 << 30, started=100.0)
    assert p.line(100.5) == "copy spark1 -> spark2: 0 B of 10.0 GiB (0%)"  # no rate before a second passed
    p.add(1 << 30)
    assert p.line(110.0) == "copy spark1 -> spark2: 1.0 GiB of 10.0 GiB (10%), 102.4 MiB/s, ETA 1m30s"
    p.set(512)  # a node-side count that went back (a retry) never moves the line back
    assert p.done == 1 << 30
    assert p.end(120.0).endswith("51.2 MiB/s, ETA 3m00s")
    p.set(10 << 30)
    assert p.line(130.0) == "copy spark1 -> spark2: 10.0 GiB of 10.0 GiB (100%), 512.0 MiB/s, done in 20s"


def test_a_line_is_due_every_few_seconds_not_at_every_byte():
    p = Progress("hash", total=0, started=0.0, every_s=10.0)
    assert not p.due(5.0) and not p.spoke
    assert p.due(10.0) and p.spoke
    assert not p.due(19.0) and p.due(20.5)
    p.add(3 << 20)
    assert p.line(30.0) == "hash: 3.0 MiB, 102.4 KiB/s"  # no total: no percentage, no ETA


def test_figures_are_what_the_asset_records_when_it_ends():
    p = Progress("distribution", total=1 << 30, started=0.0)
    p.add(1 << 30)
    p.end(8.0)
    assert p.figures(99.0, "verified") == {"verified_bytes": 1 << 30, "verified_seconds": 8.0,
                                           "verified_mib_per_s": 128.0}
    assert size_text(999) == "999 B" and duration_text(3725) == "1h02m"
