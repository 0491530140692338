"""The team instance for real: PostgreSQL (Debian's server, on loopback), the Dagster daemon and
webserver, the code server in the offline-built image, and every run in its own container
(DockerRunLauncher on the team's own dockerd), against the simulated fleet.

Runs are submitted through the webserver's GraphQL API as the UI submits them, queued and launched
by the daemon: two runs of one node go one after the other, two nodes at once, one image build at
a time. History is read back from PostgreSQL, and outlives `team down`."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from spark_pipelines.cli.console import LOCATION, REPOSITORY, Console, free_port
from spark_pipelines.cli.team.instance import Team

pytestmark = pytest.mark.slow

ENDED = {"SUCCESS", "FAILURE", "CANCELED"}
RUN_QUERY = ("query($r: ID!) { runOrError(runId: $r) { ... on Run { status startTime endTime "
             "tags { key value } } } }")


@pytest.fixture(scope="module")
def team(sim_fleet):
    saved = dict(os.environ)
    os.environ.pop("DOCKER_HOST", None)  # the team's own engine, not one a test pointed at
    root = Path(tempfile.mkdtemp(prefix="spark-team-", dir="/var/tmp"))
    t = Team(root, web_port=free_port(), log=print)
    try:
        t.up(str(sim_fleet.fleet_file))
        yield t
    finally:
        try:
            t.down()
        finally:
            t.postgres.destroy()
            os.environ.clear()
            os.environ.update(saved)
            shutil.rmtree(root, ignore_errors=True)


def console_of(team: Team) -> Console:
    """A client of the running instance (only its GraphQL half: nothing is started)."""
    return Console(team.home, team.state()["fleet"], web_port=team.web_port, log=lambda *_: None)


def wait_ended(console: Console, run_ids: list[str], timeout_s: float = 900) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    runs: dict[str, dict] = {}
    while time.monotonic() < deadline:
        runs = {r: console.graphql(RUN_QUERY, {"r": r})["runOrError"] for r in run_ids}
        if all(v["status"] in ENDED for v in runs.values()):
            return runs
        time.sleep(2)
    raise AssertionError(f"runs still going after {timeout_s:.0f} s: "
                         f"{ {r[:8]: v['status'] for r, v in runs.items()} }")


def overlap(a: dict, b: dict) -> bool:
    return a["startTime"] < b["endTime"] and b["startTime"] < a["endTime"]


def test_runs_launch_in_containers_one_per_node_and_one_build_at_a_time(team):
    c = console_of(team)
    image = team.state()["image"]
    submitted = {
        "spark2 #1": c.launch("release_quarantine_job", "spark2"),
        "spark2 #2": c.launch("release_quarantine_job", "spark2"),
        "spark1": c.launch("release_quarantine_job", "spark1"),
        "build #1": c.launch("build_job", assets=["base_image"]),
        "build #2": c.launch("build_job", assets=["base_image"]),
    }
    runs = {name: wait_ended(c, [rid])[rid] for name, rid in submitted.items()}
    for name, run in runs.items():
        tags = {t["key"]: t["value"] for t in run["tags"]}
        assert run["status"] == "SUCCESS", f"{name}: {run['status']}"
        assert tags.get("docker/container_id") and tags.get("dagster/image") == image, name
    timeline = {n: (round(r["startTime"] - runs["spark2 #1"]["startTime"], 1),
                    round(r["endTime"] - runs["spark2 #1"]["startTime"], 1)) for n, r in runs.items()}
    print(f"run windows (s after spark2 #1 started): {timeline}")
    assert not overlap(runs["spark2 #1"], runs["spark2 #2"]), timeline  # one node: one after the other
    assert not overlap(runs["build #1"], runs["build #2"]), timeline  # the build host builds once at a time
    assert overlap(runs["spark1"], runs["spark2 #1"]) or overlap(runs["spark1"], runs["spark2 #2"]), timeline
    # The history is PostgreSQL's: the run storage holds each run with its status.
    rows = dict(team.postgres.query("SELECT run_id, status FROM runs"))
    assert all(rows.get(rid) == "SUCCESS" for rid in submitted.values()), rows
    # ... and its event log the materializations the containers recorded.
    built = team.postgres.query("SELECT count(*) FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION' "
                                f"AND run_id IN ('{submitted['build #1']}', '{submitted['build #2']}')")
    assert built == [["2"]], built


def test_a_sensor_ticks_through_the_daemon(team):
    c = console_of(team)
    query = ("query($s: SensorSelector!) { sensorOrError(sensorSelector: $s) { ... on Sensor { sensorState { "
             "status ticks(limit: 5) { status timestamp runIds } } } } }")
    selector = {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY,
                "sensorName": "fleet_summary_refresh"}  # running by default: the daemon ticks it
    deadline = time.monotonic() + 180
    ticks: list[dict] = []
    while time.monotonic() < deadline and not ticks:
        state = c.graphql(query, {"s": selector})["sensorOrError"]["sensorState"]
        ticks = [t for t in state["ticks"] if t["status"] in ("SUCCESS", "SKIPPED")]
        time.sleep(3)
    assert ticks, "no completed tick of fleet_summary_refresh within 180 s"
    assert team.postgres.query("SELECT count(*) FROM job_ticks")[0][0] != "0"
    requested = [r for t in ticks for r in t["runIds"]]
    if requested:  # what the tick asked for runs like any other run: in a container
        run = wait_ended(c, requested[:1])[requested[0]]
        assert run["status"] == "SUCCESS"


def test_down_stops_everything_and_keeps_the_database(team):
    before = int(team.postgres.query("SELECT count(*) FROM runs")[0][0])
    team.down()
    assert not team.postgres.running() and team.engine.pid() is None
    assert not httpx_up(team)
    team.up(team.state()["fleet"])
    assert int(team.postgres.query("SELECT count(*) FROM runs")[0][0]) >= before
    c = console_of(team)
    listed = c.graphql("{ runsOrError(limit: 500) { ... on Runs { results { runId } } } }")["runsOrError"]["results"]
    assert len(listed) >= before > 0


def httpx_up(team: Team) -> bool:
    try:
        httpx.get(f"http://127.0.0.1:{team.web_port}/server_info", timeout=2)
        return True
    except httpx.HTTPError:
        return False
