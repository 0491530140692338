"""drained(): the node goes back in every outcome, a refused drain changes nothing, and the body
runs only once the node's requests in flight ended.

The gateway here records calls (the real proxy is in tests/integration/test_gateway_rotation.py,
the wait for a real stream in tests/integration/test_gateway_streams.py); what is tested is the
context manager's control flow on each exception path."""

from types import SimpleNamespace

import pytest

from spark_pipelines.core.gateway import RotationRefused
from spark_pipelines.resources.gateway import GatewayError
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.runbook import rotation
from spark_pipelines.runbook.rotation import drained, wait_idle


class RecordingGateway:
    def __init__(self, drain_error=None, restore_error=None):
        self.calls: list[str] = []
        self.drain_error, self.restore_error = drain_error, restore_error
        self.fleet = SimpleNamespace(node=lambda name: SimpleNamespace(name=name, gw=self))

    def rotation(self):
        return ["spark1", "spark2"]

    def readable(self):  # the running proxy answers /model/info (the precheck before any drain)
        return None

    def drain(self, node, reason="", wait_s=None, dead=False, deploying=False):
        self.calls.append(f"drain {node}" + (" dead" if dead else "") + (" deploying" if deploying else ""))
        if self.drain_error:
            raise self.drain_error

    def restore(self, node):
        self.calls.append(f"restore {node}")
        if self.restore_error:
            raise self.restore_error


@pytest.fixture(autouse=True)
def requests_end(monkeypatch):
    """wait_idle as a call in the gateway's record (its polling is tested in test_wait_idle)."""
    def idle(fleet, node, timeout_s=None, *, drained=True):
        node.gw.calls.append(f"idle {node.name}")
        if getattr(node.gw, "busy", None):
            raise RunbookError(node.gw.busy)
        return 0.5

    monkeypatch.setattr(rotation, "wait_idle", idle)


def test_clean_exit_restores_unless_kept_out():
    gw = RecordingGateway()
    with drained(gw, "spark1") as d:
        assert gw.calls == ["drain spark1", "idle spark1"]  # its requests ended before the body
    assert gw.calls == ["drain spark1", "idle spark1", "restore spark1"] and d.waited_s == 0.5
    gw = RecordingGateway()
    with drained(gw, "spark1") as d:
        d.keep_out = True
    assert gw.calls == ["drain spark1", "idle spark1"]


def test_requests_that_do_not_end_put_the_node_back_and_the_body_does_not_run():
    gw = RecordingGateway()
    gw.busy = "spark1 still has 1 requests in flight 600 s after leaving the gateway"
    with pytest.raises(RunbookError, match="still has 1 requests in flight"):
        with drained(gw, "spark1"):
            raise AssertionError("the body ran")
    assert gw.calls == ["drain spark1", "idle spark1", "restore spark1"]


def test_a_dead_node_is_not_waited_for_and_a_bench_waits_on_a_node_already_out():
    gw = RecordingGateway()
    with drained(gw, "spark1", dead=True):
        pass
    assert gw.calls == ["drain spark1 dead", "restore spark1"]
    gw = RecordingGateway()
    gw.rotation = lambda: ["spark2"]
    with drained(gw, "spark1", idle=True) as d:
        assert d.keep_out  # it was out: it stays out unless the body clears it
    assert gw.calls == ["idle spark1"]


@pytest.mark.parametrize("exc", [RuntimeError("bench broke"), KeyboardInterrupt(), SystemExit(1)])
def test_body_exception_of_any_kind_restores(exc):
    gw = RecordingGateway()
    with pytest.raises(type(exc)):
        with drained(gw, "spark1"):
            raise exc
    assert gw.calls == ["drain spark1", "idle spark1", "restore spark1"]


def test_a_drain_whose_reload_failed_is_restored_and_the_body_does_not_run():
    gw = RecordingGateway(drain_error=GatewayError("gateway g: the proxy reload failed"))
    ran = []
    with pytest.raises(GatewayError, match="reload failed"):
        with drained(gw, "spark1"):
            ran.append(1)
    assert not ran and gw.calls == ["drain spark1", "restore spark1"]


def test_a_refused_drain_changes_nothing_and_says_why():
    gw = RecordingGateway(drain_error=RotationRefused("would leave 0 node(s) in rotation; spark2 is out (bench)"))
    with pytest.raises(RunbookError, match="spark1 not drained.*spark2 is out"):
        with drained(gw, "spark1"):
            raise AssertionError("the body ran")
    assert gw.calls == ["drain spark1"]


def test_a_failed_restore_does_not_hide_the_first_error():
    gw = RecordingGateway(drain_error=GatewayError("reload failed"), restore_error=GatewayError("sshd frozen"))
    with pytest.raises(GatewayError) as err:
        with drained(gw, "spark1"):
            pass
    assert "reload failed" in str(err.value) and "putting spark1 back in the gateway failed too: sshd frozen" in str(err.value)
    gw = RecordingGateway(restore_error=GatewayError("sshd frozen"))
    with pytest.raises(ValueError) as err2:
        with drained(gw, "spark1"):
            raise ValueError("bench broke")
    assert any("sshd frozen" in n for n in err2.value.__notes__)


def test_a_body_that_keeps_the_node_out_is_not_restored_by_its_error():
    # A failed deploy whose rollback cannot serve keeps the node out, then raises DeployFailed.
    gw = RecordingGateway()
    with pytest.raises(RunbookError):
        with drained(gw, "spark1", dead=True) as d:
            d.keep_out = True
            raise RunbookError("rollback did not serve")
    assert gw.calls == ["drain spark1 dead"]


def test_a_node_quarantined_while_drained_stays_out(monkeypatch):
    """A health sweep's policy quarantined the node during the block: the restore would undo it."""
    import logging

    held = SimpleNamespace(summary=lambda: "residue, by node_health")
    monkeypatch.setattr(rotation.ledger, "quarantined", lambda s: {"spark1": held})
    gw = RecordingGateway()
    gw.session = SimpleNamespace(log=logging.getLogger("test"))
    with drained(gw, "spark1"):
        pass
    assert gw.calls == ["drain spark1", "idle spark1"]
    monkeypatch.setattr(rotation.ledger, "quarantined", lambda s: {})
    gw = RecordingGateway()
    gw.session = SimpleNamespace(log=logging.getLogger("test"))
    with drained(gw, "spark1"):
        pass
    assert gw.calls == ["drain spark1", "idle spark1", "restore spark1"]


def test_wait_idle_needs_zero_on_two_reads_and_names_what_is_in_flight(monkeypatch):
    """vLLM's running + waiting read to zero twice, IDLE_CONFIRM_S apart (a request the proxy's old
    worker accepted just before the reload may still be on its way); a count that never reaches
    zero refuses with the count and the setting; a dead engine serves nothing."""
    from spark_pipelines.core.diagnosis import METRIC_RUNNING, METRIC_WAITING

    reads = iter([{METRIC_RUNNING: 1.0}, {METRIC_RUNNING: 0.0, METRIC_WAITING: 1.0}, {}, {METRIC_RUNNING: 1.0},
                  {}, {}, {}, {}])
    monkeypatch.setattr(rotation.engine, "engine_metrics", lambda fleet, node: next(reads))
    monkeypatch.setattr(rotation, "IDLE_CONFIRM_S", 0.02)
    fleet = SimpleNamespace(gateway=SimpleNamespace(in_flight_wait_s=5))
    node = SimpleNamespace(name="spark1")
    wait_idle(fleet, node)
    assert next(reads) == {}, "returned before two zero reads in a row"

    monkeypatch.setattr(rotation.engine, "engine_metrics", lambda fleet, node: {METRIC_RUNNING: 2.0})
    with pytest.raises(RunbookError, match=r"spark1 still has 2 requests in flight 0 s .*gateway.in_flight_wait_s"):
        wait_idle(fleet, node, timeout_s=0.05)

    monkeypatch.setattr(rotation.engine, "engine_metrics", lambda fleet, node: None)
    monkeypatch.setattr(rotation.engine, "healthy", lambda fleet, node: False)
    assert wait_idle(fleet, node, timeout_s=0.05) < 0.05
