"""Every undo path meets an exception whose message is empty (a bare EOFError, which the SSH
session re-raises when a peer hangs up) and still finishes its undo: the container is rolled back,
the exporters' failure is one warning line, the rotation's restore failure is told with its cause.

The session is a stand-in recording the calls (it stands for SSH: the point is the error path,
which a real sshd cannot be made to raise on cue); the procedures are the real ones."""

from __future__ import annotations

import pytest

from spark_pipelines.state.markers import RolloutPoint

from spark_pipelines.core import jit_cache as jit_core
from spark_pipelines.core import rollout as rollout_core
from spark_pipelines.core.gate import GateResult
from spark_pipelines.core.errors import first_line
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.resources import engine
from spark_pipelines.resources.docker import PreviousDeploy
from spark_pipelines.runbook import jit_cache, preflight, rollout, rotation, transaction

SEED = "fleets/seed.yaml"


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str) -> None:
        self.lines.append(msg)

    warning = error = debug = info


class Result:
    ok, stdout, stderr, tail, exit_status = True, "", "", "", 0


class Session:
    """A FleetSession whose remote calls raise EOFError() (empty message) when `fails(argv)`."""

    def __init__(self, fails=lambda argv: True) -> None:
        self.fleet = load_fleet(SEED)
        self.log = Log()
        self.fails = fails
        self.calls: list[list[str]] = []

    def run(self, node, argv, **kw):
        self.calls.append(list(argv))
        if self.fails(argv):
            raise EOFError()
        return Result()

    def exists(self, node, path):
        raise EOFError()

    read_text = exists

    def put_text(self, node, path, text):
        raise EOFError()


class Docker:
    """NodeDocker's rollback calls, recorded; `restore_previous` answers with the kept id."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[str] = []
        self.fail = fail

    def restore_previous(self, node, name, image, kept):
        self.calls.append(f"restore_previous {node} {kept.container_id}")
        if self.fail:
            raise EOFError()
        return kept.container_id

    def inspect_container(self, node, name):
        return {"Id": "old", "State": {"Running": True}}


def test_first_line_of_an_empty_message_is_the_type():
    assert first_line(EOFError()) == "EOFError"
    assert first_line(OSError("\n\n")) == "OSError"
    assert first_line(ValueError("one\ntwo")) == "ValueError: one"


def _switch(node: str) -> jit_cache.Switch:
    before = [jit_core.MountState(path="/home/u/.cache/vllm", kind="link", target=".vllm.jit-old"),
              jit_core.MountState(path="/home/u/.triton", kind="dir")]
    return jit_cache.Switch(node, jit_core.Plan("k1", "warm", "cached"), before,
                            ["/home/u/.cache/vllm.jit-k1", "/home/u/.triton.jit-k1"],
                            set_aside=[("/home/u/.triton", "/home/u/.triton.jit-unkeyed")],
                            retired=[("/home/u/.cache/vllm.jit-k1", "/home/u/.cache/vllm.jit-k1.stale-1")],
                            linked=["/home/u/.cache/vllm", "/home/u/.triton"])


def test_jit_cache_undo_tries_every_mount_and_says_which_failed():
    s, log = Session(), Log()
    jit_cache.undo(s, _switch("spark1"), log)
    # Each mount tried: two links, the retired slot (its first move fails, its second is skipped), the set-aside dir.
    assert [c[0] for c in s.calls] == ["ln", "rm", "mv", "mv"]
    [line] = log.lines
    assert "not all put back" in line and line.count("EOFError") == 4


@pytest.fixture()
def txn(monkeypatch):
    """A deploy transaction on spark1 whose cache mounts were switched and whose previous
    container was kept; /health answers once the previous deployment is back."""
    monkeypatch.setattr(engine, "healthy", lambda fleet, node: True)

    def make(session: Session, docker: Docker, keep_previous: bool = False) -> transaction.Transaction:
        node = session.fleet.node("spark1")
        t = transaction.Transaction(session, node, launch_spec(session.fleet, node), Log(), keep_previous=keep_previous)
        t.docker = docker
        t.jit = _switch("spark1")
        t.kept = PreviousDeploy("vllm-previous", "sha256:old", "img:previous", "old-id", "fp")
        return t

    return make


def test_roll_back_puts_the_container_back_after_an_undo_that_met_an_empty_error(txn):
    s = Session(fails=lambda argv: argv[0] in ("ln", "rm", "mv"))  # the cache undo's every call
    docker = Docker()
    back, said = txn(s, docker).roll_back()
    assert docker.calls == ["restore_previous spark1 old-id"]
    assert back and "put back on spark1 (healthy)" in said


def test_roll_back_of_a_rollout_deploy_goes_on_past_its_point_and_cache(txn):
    s = Session()  # the rollout point's clear and the cache undo both raise EOFError()
    docker = Docker()
    back, said = txn(s, docker, keep_previous=True).roll_back()
    assert docker.calls == ["restore_previous spark1 old-id"] and back
    assert any("rollout point was not cleared: EOFError" in line for line in s.log.lines)


def test_a_failed_restore_is_the_answer_never_an_exception(txn):
    back, said = txn(Session(), Docker(fail=True)).roll_back()
    assert not back and said == "the rollback on spark1 failed (EOFError)"


def test_the_exporters_failing_to_start_again_is_one_warning(txn):
    s = Session()
    t = txn(s, Docker())
    t.prepared = preflight.Prepared(stopped_exporters=["dcgm-exporter"])
    t.restore_exporters()
    [line] = s.log.lines
    assert "could not start the exporters again (dcgm-exporter): EOFError" in line


def test_taking_a_node_out_after_a_failed_rollback_says_what_it_could_not_do(txn):
    said = txn(Session(), Docker()).take_out_of_gateway("deploy on spark1 failed: EOFError")
    assert "could NOT be taken out of the gateway (EOFError)" in said
    assert "hold-out reason could not be recorded for spark1 (EOFError)" in said


def test_rollout_relink_of_the_cache_tries_every_mount():
    s, log = Session(), Log()
    point = RolloutPoint(jit_links={"/home/u/.cache/vllm": ".vllm.jit-old"},
                         jit_set_aside=[("/home/u/.triton", "/home/u/.triton.jit-unkeyed")])
    rollout._relink_cache(s, s.fleet.node("spark1"), point, log)
    [line] = log.lines
    assert line.count("EOFError") == 2 and "next deploy re-links them" in line


def test_a_drain_whose_restore_meets_an_empty_error_keeps_both_errors():
    class Gateway:
        session = Session()

        def restore(self, node):
            raise EOFError()

    cause = RuntimeError("the bench stopped")
    rotation._restore_after(Gateway(), "spark1", cause)
    assert cause.__notes__ == ["putting spark1 back in the gateway failed too: "] or \
        "putting spark1 back in the gateway failed too" in cause.__notes__[0]


def test_a_rollout_whose_revert_and_finish_meet_empty_errors_reports_them():
    class Steps:
        def deploy(self, node):
            return "new"

        def gate(self, node):
            return GateResult(node, node != "spark2", "bench", "below floor")

        def revert(self, node, why):
            raise EOFError()

        def finish(self, node):
            raise EOFError()

    plan = rollout_core.plan_waves(["spark1", "spark2"], in_rotation=["spark1", "spark2"], max_unavailable=1,
                                   min_in_rotation=1, canary="spark1")
    out = rollout_core.execute(plan, Steps(), {"spark1": "old", "spark2": "old"}, lambda e, s: None)
    by = {st.node: st for st in out.steps}
    assert by["spark2"].state == rollout_core.REVERT_FAILED and "the rollback failed: EOFError" in by["spark2"].why
    assert "not finished (EOFError)" in by["spark1"].why
