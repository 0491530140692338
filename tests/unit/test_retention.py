"""Issue 34, item 10: the command-output files and the bench-history PNGs are pruned where they are
written, by the fleet file's `retention:` (age and count): old ones go, recent ones stay, and
nothing else in the directory is touched."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from spark_pipelines.core import retention
from spark_pipelines.core.fleet import FleetError, load_fleet, parse_fleet
from spark_pipelines.core.fleet_settings import RetentionSettings
from spark_pipelines.resources.ssh.output import CommandOutput

SEED = "fleets/seed.yaml"
DAY = 86400


def write(path, age_days: float) -> None:
    path.write_text("x")
    t = time.time() - age_days * DAY
    os.utime(path, (t, t))


def test_the_rule_keeps_the_newest_and_nothing_older_than_the_age():
    now = 1_000_000.0
    files = [("a", now - 40 * DAY), ("b", now - 1), ("c", now - 2), ("d", now - 3), ("e", now)]
    assert sorted(retention.expired(files, now=now, max_age_days=30, max_files=10)) == ["a"]
    assert sorted(retention.expired(files, now=now, max_age_days=30, max_files=2)) == ["a", "c", "d"]
    assert retention.expired([], now=now, max_age_days=1, max_files=1) == []


def test_a_session_writing_command_output_prunes_what_earlier_runs_left(tmp_path):
    out = tmp_path / "command-output"
    out.mkdir()
    for i in range(3):
        write(out / f"20250101T00000{i}-spark1-docker-abc12{i}.log", age_days=45)  # past 30 days
    for i in range(101):
        write(out / f"20260101T0{i // 60:01d}{i % 60:02d}00-spark2-rsync-{i:06x}.log", age_days=i / 1000)
    write(out / "notes.txt", age_days=400)  # the operator's, not ours: never touched
    write(out / "old-build.log", age_days=400)
    keep = RetentionSettings(max_age_days=30, command_outputs=100)
    o = CommandOutput("spark1", "docker ps", "docker", out, None, [], "spark1", keep=keep)
    o.close()
    ours = sorted(p.name for p in out.iterdir() if p.name[0].isdigit())
    assert o.path is not None and o.path.name in ours  # the new file stays
    assert not any(n.startswith("2025") for n in ours)  # the 45-day-old ones are gone
    # Pruned before this run's first file: the newest 100 of before, then the new one.
    assert len(ours) == 101 and "20260101T014000-spark2-rsync-000064.log" not in ours  # the oldest recent one
    assert "20260101T013900-spark2-rsync-000063.log" in ours
    assert (out / "notes.txt").exists() and (out / "old-build.log").exists()


def test_each_bench_chart_written_prunes_the_old_ones(tmp_path, seed_data):
    from spark_pipelines.assets.bench_metadata import chart_metadata

    seed_data["retention"] = {"bench_charts": 3, "max_age_days": 7}
    fleet = parse_fleet(seed_data)
    charts = tmp_path / "bench-charts"
    charts.mkdir()
    write(charts / "bench-history-20250101T000000-spark1.png", age_days=10)  # past 7 days
    for i in range(4):
        write(charts / f"bench-history-2026010{i}T000000-spark2.png", age_days=1 + i / 10)
    write(charts / "keep-me.png", age_days=100)
    context = SimpleNamespace(instance=SimpleNamespace(storage_directory=lambda: str(tmp_path)),
                              log=SimpleNamespace(warning=print))
    meta = chart_metadata(context, fleet, "spark1", {"spark1": [(time.time() - 60, 50.0), (time.time(), 51.0)]})
    written = meta["history_chart_png"].value
    left = sorted(p.name for p in charts.iterdir())
    assert os.path.basename(written) in left
    assert left == sorted(["keep-me.png", os.path.basename(written), "bench-history-20260100T000000-spark2.png",
                           "bench-history-20260101T000000-spark2.png"])


@pytest.mark.parametrize("section,needle", [
    ({"max_age_days": 0}, "retention.max_age_days"),
    ({"command_outputs": 10}, "retention.command_outputs"),
    ({"bench_charts": 10**9}, "retention.bench_charts"),
    ({"keep_forever": True}, "retention.keep_forever"),
])
def test_the_retention_section_is_validated_naming_the_field(seed_data, section, needle):
    seed_data["retention"] = section
    with pytest.raises(FleetError, match=needle.replace(".", r"\.")):
        parse_fleet(seed_data, "f.yaml")


def test_the_defaults_keep_a_month():
    r = load_fleet(SEED).retention
    assert r.max_age_days == 30 and r.command_outputs >= 10000 and r.bench_charts >= 100
