"""drained(): the node goes back in every outcome, and a refused drain changes nothing.

The gateway here records calls (the real proxy is in tests/integration/test_gateway_rotation.py);
what is tested is the context manager's control flow on each exception path."""

import pytest

from spark_pipelines.core.gateway import RotationRefused
from spark_pipelines.resources.gateway import GatewayError
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.runbook.rotation import drained


class RecordingGateway:
    def __init__(self, drain_error=None, restore_error=None):
        self.calls: list[str] = []
        self.drain_error, self.restore_error = drain_error, restore_error

    def rotation(self):
        return ["spark1", "spark2"]

    def drain(self, node, reason="", wait_s=None, dead=False, deploying=False):
        self.calls.append(f"drain {node}" + (" dead" if dead else "") + (" deploying" if deploying else ""))
        if self.drain_error:
            raise self.drain_error

    def restore(self, node):
        self.calls.append(f"restore {node}")
        if self.restore_error:
            raise self.restore_error


def test_clean_exit_restores_unless_kept_out():
    gw = RecordingGateway()
    with drained(gw, "spark1"):
        pass
    assert gw.calls == ["drain spark1", "restore spark1"]
    gw = RecordingGateway()
    with drained(gw, "spark1") as d:
        d.keep_out = True
    assert gw.calls == ["drain spark1"]


@pytest.mark.parametrize("exc", [RuntimeError("bench broke"), KeyboardInterrupt(), SystemExit(1)])
def test_body_exception_of_any_kind_restores(exc):
    gw = RecordingGateway()
    with pytest.raises(type(exc)):
        with drained(gw, "spark1"):
            raise exc
    assert gw.calls == ["drain spark1", "restore spark1"]


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
    from types import SimpleNamespace

    from spark_pipelines.runbook import rotation

    held = SimpleNamespace(summary=lambda: "residue, by node_health")
    monkeypatch.setattr(rotation.ledger, "quarantined", lambda s: {"spark1": held})
    gw = RecordingGateway()
    gw.session = SimpleNamespace(log=logging.getLogger("test"))
    with drained(gw, "spark1"):
        pass
    assert gw.calls == ["drain spark1"]
    monkeypatch.setattr(rotation.ledger, "quarantined", lambda s: {})
    gw = RecordingGateway()
    gw.session = SimpleNamespace(log=logging.getLogger("test"))
    with drained(gw, "spark1"):
        pass
    assert gw.calls == ["drain spark1", "restore spark1"]
