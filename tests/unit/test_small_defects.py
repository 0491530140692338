"""Issue 34, item 12: the smaller defects, each at the unit tier against the real procedure with a
stand-in only where SSH or a clock would be (the point is the code path, not the transport)."""

from __future__ import annotations

from types import SimpleNamespace

import dagster as dg
import pytest

from spark_pipelines.core import node_os as p0
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.runbook import node_os

SEED = "fleets/seed.yaml"


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)

    warning = error = debug = info


class Phase0Session:
    """Root commands answered in order; `refuse` makes one argv exit 1 (a unit that will not stop)."""

    def __init__(self, refuse: tuple[str, ...]) -> None:
        self.fleet = load_fleet(SEED)
        self.log = Log()
        self.refuse = refuse
        self.ran: list[tuple[str, ...]] = []

    def run(self, node, argv, **kw):
        self.ran.append(tuple(argv))
        ok = tuple(argv) != self.refuse
        return SimpleNamespace(ok=ok, exit_status=0 if ok else 1, stdout="", stderr="" if ok else "Job failed",
                               tail="")


def test_a_half_applied_two_command_change_is_undone():
    """"mask them again": mask, then stop. The mask ran, the stop failed: the mask is undone too
    (before, only the changes completed before it were; rpcbind stayed masked and running)."""
    s = Phase0Session(refuse=("systemctl", "stop", "rpcbind"))
    node = s.fleet.serve_nodes[0]
    changes = p0.remask_changes(["rdma-ndd", "rpcbind"])
    with pytest.raises(RunbookError) as err:
        node_os.apply(s, node, changes)
    assert s.ran == [("systemctl", "mask", "rdma-ndd"), ("systemctl", "stop", "rdma-ndd"),
                     ("systemctl", "mask", "rpcbind"), ("systemctl", "stop", "rpcbind"),
                     ("systemctl", "unmask", "rpcbind"), ("systemctl", "unmask", "rdma-ndd")]
    assert "`sudo -n systemctl stop rpcbind` exited 1 (Job failed)" in str(err.value)
    assert "the 2 change(s) made before it were undone" in str(err.value)


def ledger_load(text: str):
    from spark_pipelines.state import ledger

    gw = SimpleNamespace(gw=SimpleNamespace(host="gw"), sidecar_path=lambda suffix: f"/srv/litellm/config.yaml{suffix}")
    return ledger._load(gw, text)


@pytest.mark.parametrize("text", ['[]', '"held"', '42', '{"nodes": []}', '{"nodes": "spark1"}'])
def test_a_ledger_that_is_json_but_no_ledger_object_is_one_clear_error(text):
    from spark_pipelines.state.ledger import LedgerError

    with pytest.raises(LedgerError, match=r"config.yaml.ledger.json is not a ledger spark-pipelines can read: fix it"):
        ledger_load(text)
    assert ledger_load('{"nodes": {}}') == {}


def test_the_exporters_cache_survives_a_wall_clock_stepped_back(monkeypatch):
    """The cache's age on time.monotonic: a wall clock stepped back an hour (NTP, a VM resumed)
    froze the metrics at their last read until the clock caught up."""
    from spark_pipelines.cli import metrics as metrics_command

    clock = SimpleNamespace(wall=1_800_000_000.0, mono=100.0)
    monkeypatch.setattr(metrics_command.time, "time", lambda: clock.wall)
    monkeypatch.setattr(metrics_command.time, "monotonic", lambda: clock.mono)
    reads: list[float] = []

    def instance():
        reads.append(clock.wall)
        raise RuntimeError("counted")  # the read itself is not the point

    collector = metrics_command.FleetCollector(load_fleet(SEED), instance, cache_s=5.0)
    collector.families()
    clock.mono += 1
    collector.families()
    assert len(reads) == 1  # cached
    clock.wall -= 3600
    clock.mono += 10
    collector.families()
    assert len(reads) == 2, "the wall clock went back an hour and the cache never expired"


def test_adoption_refused_is_a_dagster_failure_not_a_traceback(monkeypatch, tmp_path):
    from spark_pipelines.assets import adoption
    from spark_pipelines.definitions import build_definitions

    def refuse(*a, **kw):
        raise RunbookError("spark2: the serving container is not the fleet file's: relaunch it or fix the fleet file")

    monkeypatch.setattr(adoption, "adopt_fleet", refuse)
    defs = build_definitions(SEED)
    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        res = defs.resolve_job_def("adopt_job").execute_in_process(instance=instance, raise_on_error=False)
    assert not res.success
    (failed,) = [e for e in res.all_events if e.event_type == dg.DagsterEventType.STEP_FAILURE]
    error = failed.event_specific_data.error
    assert error.cls_name == "Failure", error.cls_name  # was RunbookError: a traceback in the UI
    assert "spark2: the serving container is not the fleet file's" in error.message


@pytest.mark.parametrize("message", ["", "\n  \n"])
def test_a_code_location_that_fails_with_an_empty_message_is_one_line(message, tmp_path):
    """console.py named the load error by `message.strip().splitlines()[0]`: IndexError on ''."""
    from spark_pipelines.cli import console

    c = console.Console(home=tmp_path, fleet_path=SEED, startup_timeout_s=5)
    answers = {"workspaceOrError": {"locationEntries": [{
        "name": console.LOCATION, "loadStatus": "LOADED",
        "locationOrLoadError": {"__typename": "PythonError", "message": message}}]}}
    c.graphql = lambda query, variables=None, timeout=60: answers  # type: ignore[method-assign]
    c._check_alive = lambda: None  # type: ignore[method-assign]
    with pytest.raises(console.ConsoleError, match=r"does not load: no error message \(log: "):
        c._wait_for_location()
    assert first_line("") == "" and first_line("  one\ntwo") == "one"
