"""A killed run of any procedure: its journal in the ledger (state/ledger.Procedure), who counts
as dead (runbook/journal.py), and the Dagster run that stays STARTED marked failed by the next run
(state/records.py). The fault tier (tests/faults/test_dead_procedures.py) kills real runs."""

import os
import subprocess
from types import SimpleNamespace

import dagster as dg
from dagster._core.events import EngineEventData

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.runbook import journal
from spark_pipelines.state import ledger, records
from spark_pipelines.state.ledger import Ledger, Procedure

NOW = 2_000_000_000.0


def proc(**kw) -> Procedure:
    return Procedure(**{"procedure": "node_os", "run_id": "0123456789abcdef", "token": "t1", "phase": "rebooting",
                        "was_in": True, "drain_reason": "node_os reboot (run 01234567)", **kw})


def in_memory(monkeypatch) -> list[Ledger]:
    """ledger.change on a ledger held here (the real one is a file on the gateway host)."""
    held = [Ledger()]

    def change(s, edit):
        held[0] = edit(held[0])
        return held[0]

    monkeypatch.setattr(ledger, "change", change)
    return held


def test_the_ledgers_other_writers_keep_a_nodes_procedures(monkeypatch):
    """A hold-out, a lift, a quarantine and its end written while a procedure is in flight keep its
    journal; the journal is no hold-out (the node is still promoted) and survives the file's text."""
    held = in_memory(monkeypatch)
    ledger.begin_procedure(None, "spark2", proc())
    ledger.hold(None, "spark2", ledger.BY_BENCH, "below its floor")
    ledger.record_quarantine(None, "spark2", "wedged", "clocks", by="test")
    ledger.end_quarantine(None, "spark2")
    ledger.lift(None, "spark2", ledger.BY_BENCH)
    led = held[0]
    assert [p.token for p in led.procedures("spark2")] == ["t1"] and led.promoted("spark2")
    assert ledger.update_procedure(None, "spark2", "t1", phase="verifying").phase == "verifying"
    assert ledger.update_procedure(None, "spark2", "gone", phase="x") is None  # another run finished it
    again = Ledger(nodes=ledger._parse(held[0].text(), None))
    assert again.procedures("spark2")[0].phase == "verifying"
    ledger.end_procedure(None, "spark2", "t1")
    assert held[0].nodes == {}


def test_a_journal_whose_node_is_down_is_a_live_runs_until_its_run_ended_or_its_time_passed():
    ended: set[str] = set()
    s = SimpleNamespace(run_ended=lambda run_id: run_id in ended)
    waiting = proc(down_until=NOW + 600)
    assert journal.still_waiting(s, waiting, now=NOW) and "waits for the node" in journal.still_waiting(s, waiting, now=NOW)
    assert journal.still_waiting(s, waiting, now=NOW + 601) is None  # the live run would have given up
    ended.add(waiting.run_id)
    assert journal.still_waiting(s, waiting, now=NOW) is None  # the instance says it ended
    assert journal.still_waiting(s, proc(down_until=None), now=NOW) is None
    nobody = SimpleNamespace(run_ended=None)  # no instance to ask: the time decides
    assert journal.still_waiting(nobody, waiting, now=NOW)


def test_the_sweep_counts_a_journal_dead_only_with_the_lease_free_or_its_node_down_for_it():
    s = SimpleNamespace(run_ended=lambda run_id: False)
    bench = proc(procedure="bench", phase="drained", down_until=None)
    assert journal.dead_in_sweep(s, bench, reachable=True, lease_held=False, now=NOW)
    assert not journal.dead_in_sweep(s, bench, reachable=True, lease_held=True, now=NOW)  # in progress
    assert not journal.dead_in_sweep(s, bench, reachable=True, lease_held=None, now=NOW)  # not read
    assert not journal.dead_in_sweep(s, bench, reachable=False, lease_held=None, now=NOW)  # unknown while down
    off = proc(procedure="cold_drain", phase="power-off", down_until=NOW - 1)
    assert journal.dead_in_sweep(s, off, reachable=False, lease_held=None, now=NOW)  # down for it, past its time
    assert not journal.dead_in_sweep(s, off.model_copy(update={"down_until": NOW + 60}), reachable=False,
                                     lease_held=None, now=NOW)


def test_a_deploys_own_notes_are_told_apart_from_others():
    assert gateway_core.deploy_note("deploying (run 01234567) since 2026-01-01T00:00:00Z", "0123456789ab")
    assert gateway_core.deploy_note("failed deploy (run 01234567): the rollback on spark2 failed since 2026-01-01T00:00:00Z",
                                    "0123456789ab")
    assert not gateway_core.deploy_note("failed deploy (run 01234567): x since t", "fedcba987654")
    assert gateway_core.deploy_note("failed deploy (run 01234567): x since t")  # any deploy's
    assert not gateway_core.deploy_note("bench (run 01234567) since t") and not gateway_core.deploy_note(None)


@dg.op
def noop():
    return 1


@dg.job
def one():
    noop()


def test_a_started_run_whose_process_is_gone_is_failed_by_the_next_run():
    """`dagster job execute` or an in-process run killed stays STARTED with no daemon to notice;
    the next run (or sweep) on an instance whose runs run here marks it failed, and only it."""
    with dg.instance_for_test() as instance:
        gone = subprocess.Popen(["true"])
        gone.wait()
        dead = instance.create_run_for_job(one)
        instance.handle_run_event(dead.run_id, dg.DagsterEvent(
            dg.DagsterEventType.RUN_START.value, job_name=dead.job_name))
        instance.report_engine_event("Executing steps in process (pid: x).", dead, EngineEventData.in_process(gone.pid))
        alive = instance.create_run_for_job(one)
        instance.handle_run_event(alive.run_id, dg.DagsterEvent(
            dg.DagsterEventType.RUN_START.value, job_name=alive.job_name))
        instance.report_engine_event("Executing steps in process (pid: y).", alive,
                                     EngineEventData.in_process(os.getpid()))
        assert instance.get_run_by_id(dead.run_id).status == dg.DagsterRunStatus.STARTED
        assert not records.run_ended(instance, dead.run_id)
        assert records.fail_dead_runs(instance, besides="nobody") == [dead.run_id]
        assert instance.get_run_by_id(dead.run_id).status == dg.DagsterRunStatus.FAILURE
        assert instance.get_run_by_id(alive.run_id).status == dg.DagsterRunStatus.STARTED
        assert records.run_ended(instance, dead.run_id) and not records.run_ended(instance, alive.run_id)
        assert not records.run_ended(instance, "not-a-run-of-this-instance")
        assert records.fail_dead_runs(instance) == []  # once


def test_runs_elsewhere_are_never_judged_by_a_pid_here(monkeypatch):
    with dg.instance_for_test() as instance:
        monkeypatch.setattr(records, "runs_here", lambda instance: False)
        dead = instance.create_run_for_job(one)
        instance.handle_run_event(dead.run_id, dg.DagsterEvent(dg.DagsterEventType.RUN_START.value,
                                                               job_name=dead.job_name))
        instance.report_engine_event("Started process for run (pid: 1).", dead, EngineEventData.in_process(2 ** 22 + 7))
        assert records.fail_dead_runs(instance) == []
        assert instance.get_run_by_id(dead.run_id).status == dg.DagsterRunStatus.STARTED
