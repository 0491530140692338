"""The soak's checker and schedule (spark_sim/soak.py) on made-up timelines: how a failed request
is classified, which route samples are stale, and that a seed gives the same faults."""

from __future__ import annotations

import random
from types import SimpleNamespace

from spark_sim.soak import FAULTS, Mark, Soak, SoakConfig, classify, replaced_while_routed, stale_routes


def req(at: float, ok: bool = False, node: str | None = None) -> dict:
    return {"kind": "pooled", "node": node, "at": at, "end": at + 0.5, "ok": ok, "error": "" if ok else "x"}


FAULT = Mark("fault", "engine-killed", "spark2", start=100.0, end=101.0, out_at=120.0, settled=180.0, outcome="healed")
ROLLOUT = Mark("run", "rollout_job", None, start=90.0, end=300.0, ok=True)
BENCH = Mark("run", "bench_job", "spark1", start=400.0, end=420.0, ok=True)


def test_a_request_failing_on_the_faulted_node_before_the_sweep_took_it_out_is_the_faults():
    assert classify(req(110.0, node="spark2"), [FAULT], [ROLLOUT]) == "fault:engine-killed"
    assert classify(req(110.0), [FAULT], [ROLLOUT]) == "fault:engine-killed"  # no answer head: any fault


def test_a_request_that_failed_before_the_injection_is_not_the_faults():
    # A rollout that stopped spark2's engine while it was routed, a second before the fault hit
    # the same node: the overlap must not hide the pipeline's failure (it did, with a 1 s lead).
    assert classify(req(99.0), [FAULT], [ROLLOUT]) == "pipeline:rollout_job"
    assert classify(req(99.6, node="spark2"), [FAULT], [ROLLOUT]) == "fault:engine-killed"  # ended after it


def test_a_request_failing_elsewhere_during_a_run_is_the_pipelines():
    assert classify(req(110.0, node="spark1"), [FAULT], [ROLLOUT]) == "pipeline:rollout_job"
    assert classify(req(410.0), [FAULT], [ROLLOUT, BENCH]) == "pipeline:bench_job"
    assert classify(req(500.0), [FAULT], [ROLLOUT, BENCH]) == "unexplained"
    assert classify(req(410.0, ok=True), [FAULT], [BENCH]) == "served"


def test_after_the_take_out_only_an_empty_or_all_faulted_route_makes_it_compound():
    empty = [(150.0, []), (151.0, [])]
    assert classify(req(150.0), [FAULT], [ROLLOUT], empty) == "compound:engine-killed+rollout_job"
    serving = [(150.0, ["spark1"])]
    assert classify(req(150.0), [FAULT], [ROLLOUT], serving) == "pipeline:rollout_job"


def test_a_route_to_a_node_down_longer_than_the_detection_time_is_stale():
    soak = SimpleNamespace(cfg=SoakConfig(tick_s=10), fleet=SimpleNamespace(health=SimpleNamespace(failed_sweeps=2)),
                           t0=0.0, rel=lambda t: t,
                           health=[(0.0, "spark2", True), (10.0, "spark2", False), (200.0, "spark2", True)],
                           routes=[(50.0, ["spark1", "spark2"]), (90.0, ["spark1", "spark2"]), (95.0, ["spark1"])])
    # budget: 10 s * (2 + 1) + 45 s = 75 s; down since 10 s: routed at 50 s is fine, at 90 s stale
    assert stale_routes(soak) == ["spark2 at 90 s, down since 10 s"]


def test_an_engine_replaced_while_its_node_stayed_routed_without_a_fault_is_the_pipelines():
    def soak(engines, routes, marks=()):
        return SimpleNamespace(engines=engines, routes=routes, marks=list(marks), rel=lambda t: t)

    # spark2's engine started at 1000 until 60 s, a new one (start 1065) from 66 s.
    engines = [(57.0, "spark2", 1000.0), (60.0, "spark2", 1000.0), (66.0, "spark2", 1065.0)]
    drained = [(61.0, ["spark1", "spark2"]), (62.0, ["spark1"]), (64.0, ["spark1"]), (65.0, ["spark1", "spark2"])]
    kept = [(61.0, ["spark1", "spark2"]), (62.0, ["spark1", "spark2"]), (64.0, ["spark1", "spark2"])]
    assert replaced_while_routed(soak(engines, drained)) == []  # out of the routes for its restart
    assert replaced_while_routed(soak(engines, kept)) == ["spark2 between 60 s and 66 s (3 route samples, every one with it)"]
    # A fault on the node in that window replaced it (engine killed, reboot, power off): not the pipeline.
    killed = Mark("fault", "engine-killed", "spark2", start=61.0, end=62.0, settled=70.0, outcome="healed")
    assert replaced_while_routed(soak(engines, kept, [killed])) == []
    elsewhere = Mark("fault", "engine-killed", "spark1", start=61.0, end=62.0, settled=70.0, outcome="healed")
    assert len(replaced_while_routed(soak(engines, kept, [elsewhere]))) == 1
    # No route sample answered in the window (the proxy down): nothing to judge.
    assert replaced_while_routed(soak(engines, [(61.0, None)])) == []


def test_the_same_seed_gives_the_same_plan_and_every_kind_once_before_any_twice():
    cfg = SoakConfig(seed=7, duration_s=3600, fault_gap_s=(40, 80), action_every_s=300)

    def plan(seed_cfg: SoakConfig) -> list:
        return Soak.schedule(SimpleNamespace(cfg=seed_cfg, rng=random.Random(seed_cfg.seed)))

    first, again = plan(cfg), plan(cfg)
    assert first == again
    faults = [w.split(":", 1)[1] for _, w, _ in first if w.startswith("fault:")]
    assert sorted(faults[:len(FAULTS)]) == sorted(FAULTS)
    assert plan(SoakConfig(seed=8, duration_s=3600, fault_gap_s=(40, 80))) != first
    assert [w for _, w, _ in first if w.startswith("action:")][:4] == [
        "action:rollout", "action:bench", "action:reload", "action:bench"]
