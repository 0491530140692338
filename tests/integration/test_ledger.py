"""The ledger on the simulated gateway host (real sshd, flock, the config's lock): hold-outs stack
by who put them, a quarantine sits beside them, concurrent changes all land, and "why is this
node out?" has one answer."""

from __future__ import annotations

import threading

import pytest

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import GATEWAY_KEY, FleetSession
from spark_pipelines.runbook.rotation import promotion
from spark_pipelines.state import ledger

pytestmark = pytest.mark.slow


@pytest.fixture()
def s(sim_fleet):
    with FleetSession(load_fleet(sim_fleet.fleet_file)) as session:
        yield session
        path = GatewayHost(session).sidecar_path(ledger.SUFFIX)
        session.run(GATEWAY_KEY, ["rm", "-f", "--", path, GatewayHost(session).config_path + ledger.LEGACY_SUFFIX],
                    log=False, timeout=30)


def test_holds_stack_by_who_put_them_and_each_lifts_its_own(s):
    assert ledger.read(s).promoted("spark2")
    ledger.hold(s, "spark2", ledger.BY_BENCH, "bench 31.0 tok/s < floor 40", mean_tok_s=31.0)
    ledger.hold(s, "spark2", ledger.BY_DEPLOY, "held out by a failed deploy: NOT healthy")
    led = ledger.read(s)
    assert set(led.entry("spark2").holds) == {"bench", "deploy"} and not led.promoted("spark2")
    assert led.entry("spark2").holds["bench"].facts == {"mean_tok_s": 31.0}
    # A healthy deploy lifts the deploy's and a revert's hold-outs, never the bench's.
    ledger.lift(s, "spark2", *ledger.LIFTED_BY_DEPLOY)
    led = ledger.read(s)
    assert set(led.entry("spark2").holds) == {"bench"} and "31.0 tok/s" in led.why_held("spark2")
    ledger.lift(s, "spark2", ledger.BY_BENCH)
    assert ledger.read(s).promoted("spark2") and ledger.read(s).nodes == {}


def test_a_quarantine_and_hold_outs_are_one_answer_and_promotion_reads_it(s):
    ledger.record_quarantine(s, "spark2", "crash-loop", "3 restarts in 6 h", by="node_health")
    ledger.hold(s, "spark2", ledger.BY_BENCH, "wedged under load")
    rotation, out = promotion(s)
    assert "spark2" not in rotation and out["spark2"].startswith("quarantined: crash-loop")
    assert ledger.end_quarantine(s, "spark2").verdict == "crash-loop"
    rotation, out = promotion(s)
    assert "spark2" not in rotation and "held out by its bench: wedged under load" in out["spark2"]
    ledger.lift(s, "spark2", ledger.BY_BENCH)
    # Nothing holds it any more: only its engine decides (nothing is deployed on this fleet yet).
    assert promotion(s)[1]["spark2"] == "vLLM /health does not answer"


def test_concurrent_changes_all_land(s):
    errors: list[BaseException] = []

    def put(by: str) -> None:
        try:
            with FleetSession(s.fleet) as own:
                ledger.hold(own, "spark1", by, f"reason of {by}")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=put, args=(f"actor{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert set(ledger.read(s).entry("spark1").holds) == {f"actor{i}" for i in range(4)}
    ledger.lift(s, "spark1", *(f"actor{i}" for i in range(4)))
    assert ledger.read(s).promoted("spark1")


def test_quarantines_recorded_before_the_ledger_are_read_then_carried_over(s):
    legacy = GatewayHost(s).config_path + ledger.LEGACY_SUFFIX
    s.put_text(GATEWAY_KEY, legacy, '{"spark2": {"verdict": "residue", "reason": "free 60 GiB", '
                                    '"since": "2026-06-18T00:00:00Z", "by": "node_health"}}')
    assert ledger.read(s).entry("spark2").quarantine.verdict == "residue"
    ledger.hold(s, "spark1", ledger.BY_BENCH, "slow")  # the first write carries the quarantine over
    led = ledger.read(s)
    assert led.entry("spark2").quarantine.verdict == "residue" and "spark1" in led.nodes
    ledger.end_quarantine(s, "spark2")
    ledger.lift(s, "spark1", ledger.BY_BENCH)
    assert ledger.read(s).nodes == {}  # the legacy file is not read once the ledger exists


def test_an_unreadable_ledger_is_one_line_saying_what_to_do(s):
    path = GatewayHost(s).config_path + ledger.SUFFIX
    s.put_text(GATEWAY_KEY, path, "{not json")
    with pytest.raises(ledger.LedgerError, match="not a ledger spark-pipelines can read: fix it"):
        ledger.read(s)
