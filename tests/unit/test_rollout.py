"""Rollout planning (canary, waves within max_unavailable, the rotation floor) and the wave gates."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spark_pipelines.core.baseline import Baseline, BenchIdentity
from spark_pipelines.core.gpu import GpuVerdict
from spark_pipelines.core import rollout
from spark_pipelines.core.gate import GateResult, judge
from spark_pipelines.core.rollout import RolloutRefused, plan_waves

HEALTHY = GpuVerdict(state="healthy", reasons=["full clock"])
NODES = [f"spark{i}" for i in range(1, 9)]


def test_canary_alone_then_waves_of_max_unavailable():
    p = plan_waves(NODES, in_rotation=NODES, max_unavailable=3)
    assert p.waves[0].canary and p.waves[0].nodes == ("spark1",)
    assert [len(w.nodes) for w in p.waves] == [1, 3, 3, 1]
    assert p.floor_in_rotation == 5
    assert "canary: spark1" in p.text() and "at most 3 node(s)" in p.text()


def test_nodes_out_of_rotation_go_first_and_cost_no_capacity_skips_are_reported():
    p = plan_waves(["a", "b", "c", "d"], in_rotation=["a", "b", "c"], max_unavailable=1,
                   skip={"c": "quarantined: residue"})
    assert [w.nodes for w in p.waves] == [("a",), ("d",), ("b",)]
    assert p.skipped == {"c": "quarantined: residue"}


def test_refusals_name_the_setting():
    with pytest.raises(RolloutRefused, match="min_in_rotation"):
        plan_waves(["a"], in_rotation=["a"], min_in_rotation=1)
    with pytest.raises(RolloutRefused, match="max_unavailable is 0"):
        plan_waves(["a", "b"], in_rotation=["a", "b"], max_unavailable=0)
    with pytest.raises(RolloutRefused, match="cannot be the canary: quarantined"):
        plan_waves(["a", "b"], in_rotation=["a", "b"], canary="b", skip={"b": "quarantined"})
    with pytest.raises(RolloutRefused, match="no node"):
        plan_waves(["a"], in_rotation=[], skip={"a": "x"})
    # A one-node fleet that does not serve yet can be rolled out (nothing to keep serving).
    assert plan_waves(["a"], in_rotation=[], min_in_rotation=1).waves[0].nodes == ("a",)


@given(n=st.integers(2, 32), serving=st.integers(0, 32), mu=st.integers(1, 8), floor=st.integers(0, 3))
def test_properties_every_node_once_and_the_rotation_never_below_its_floor(n, serving, mu, floor):
    nodes = [f"n{i}" for i in range(n)]
    in_rot = nodes[:min(serving, n)]
    try:
        p = plan_waves(nodes, in_rotation=in_rot, max_unavailable=mu, min_in_rotation=floor)
    except RolloutRefused:
        assert len(in_rot) - max(floor, len(in_rot) - mu) < 1
        return
    seen = [x for w in p.waves for x in w.nodes]
    assert sorted(seen) == sorted(nodes) and len(seen) == len(set(seen))
    for w in p.waves:
        assert len(w.nodes) <= max(mu, 1)
        out = sum(1 for x in w.nodes if x in in_rot)
        assert len(in_rot) - out >= min(p.floor_in_rotation, len(in_rot))
        assert len(in_rot) - out >= len(in_rot) - mu


def base(tok=51.0, low=50.0, high=52.0):
    return Baseline(BenchIdentity("sha256:old"), tok, low, high, 0.95, ("spark1", "spark2"))


def test_gates_in_order():
    assert judge("s", healthy=False, health_why="no /health").gate == "health"
    g = judge("s", healthy=True, mean_tok_s=35.0, gpu_verdict=HEALTHY, floor_tok_s=40.0)
    assert not g.passed and g.gate == "bench floor" and "floor 40" in g.why
    g = judge("s", healthy=True, mean_tok_s=51.0, gpu_verdict=HEALTHY, floor_tok_s=40, acceptance=0.5,
              floor_acceptance=0.8)
    assert not g.passed and g.gate == "MTP acceptance"
    g = judge("s", healthy=True, mean_tok_s=45.0, gpu_verdict=HEALTHY, floor_tok_s=40, acceptance=0.95,
              floor_acceptance=0.8, baseline=base())
    assert not g.passed and g.gate == "baseline" and "slower" in g.why
    # Within the previous version's spread: passes even 2% below its median.
    g = judge("s", healthy=True, mean_tok_s=50.1, gpu_verdict=HEALTHY, floor_tok_s=40, acceptance=0.95,
              floor_acceptance=0.8, baseline=base())
    assert g.passed and "0.98x" in g.why
    assert judge("s", healthy=True, benched=False).passed


# -- executing a plan (core.rollout.execute) with steps that record what they are asked ----------

class FakeFleet:
    """Steps over a pretend fleet: each node runs a version; deploy, gate, revert and finish act
    on it as the real steps do (a failed deploy puts its node back itself)."""

    def __init__(self, nodes, *, deploy_fails=(), gate_fails=(), revert_fails=(), interrupt_at=None):
        self.running = {n: "old" for n in nodes}
        self.kept: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.deploy_fails, self.gate_fails, self.revert_fails = set(deploy_fails), set(gate_fails), set(revert_fails)
        self.interrupt_at = interrupt_at
        self.out_at_once = 0
        self._out: set[str] = set()

    def deploy(self, node):
        self.calls.append(("deploy", node))
        if node in self.deploy_fails:
            raise RuntimeError(f"{node} did not become healthy")
        self.running[node], self.kept = "new", self.kept | {node}
        return "new"

    def gate(self, node):
        self.calls.append(("gate", node))
        if self.interrupt_at == node:
            raise KeyboardInterrupt
        if node in self.gate_fails:
            return GateResult(node, False, "baseline", "slower than the fleet")
        return GateResult(node, True, "passed", "fine")

    def revert(self, node, why):
        self.calls.append(("revert", node))
        if node in self.revert_fails:
            raise RuntimeError("previous container gone")
        self.running[node] = "old"
        self.kept.discard(node)
        return "put back"

    def finish(self, node):
        self.calls.append(("finish", node))
        self.kept.discard(node)
        return "dropped"


def _plan(mu=2):
    return rollout.plan_waves(NODES, in_rotation=NODES, max_unavailable=mu, min_in_rotation=1)


def test_a_clean_rollout_deploys_gates_and_finishes_every_node_wave_by_wave():
    fake, events = FakeFleet(NODES), []
    out = rollout.execute(_plan(), fake, {n: "old" for n in NODES}, lambda e, t: events.append(e))
    assert out.completed and set(fake.running.values()) == {"new"} and not fake.kept
    order = [n for op, n in fake.calls if op == "deploy"]
    assert order == [n for w in _plan().waves for n in w.nodes]
    # every node gated right after its deploy, nobody finished before the last gate
    first_finish = next(i for i, c in enumerate(fake.calls) if c[0] == "finish")
    assert all(op != "gate" for op, _ in fake.calls[first_finish:])
    assert [s.state for s in out.steps] == [rollout.PASSED] * 8 and "completed" in events[-1]


def test_a_failed_gate_stops_the_rollout_and_puts_only_that_node_back():
    plan = _plan()
    victim = plan.waves[2].nodes[0]
    fake = FakeFleet(NODES, gate_fails=[victim])
    out = rollout.execute(plan, fake, {n: "old" for n in NODES})
    assert not out.completed and out.failed_gate.node == victim and out.failed_gate.gate == "baseline"
    assert out.stopped_at == "wave 2" and victim in out.headline() and "slower" in out.headline()
    passed = [n for w in plan.waves[:2] for n in w.nodes]
    assert {n for n, v in fake.running.items() if v == "new"} == set(passed)
    assert fake.running[victim] == "old" and ("revert", victim) in fake.calls
    untouched = [n for n in NODES if n not in passed and n != victim]
    assert not any(n in untouched for _, n in fake.calls)
    by = {s.node: s for s in out.steps}
    assert by[victim].state == rollout.REVERTED and by[victim].now == "old"
    assert all(by[n].state == rollout.NOT_STARTED for n in untouched)
    assert not fake.kept  # the passed nodes were finished, the victim's point went with its revert


def test_a_failed_deploy_is_the_health_gate_and_needs_no_revert():
    fake = FakeFleet(NODES, deploy_fails=[NODES[0]])
    out = rollout.execute(_plan(), fake, {n: "old" for n in NODES})
    assert out.failed_gate.gate == "health" and out.stopped_at == "canary"
    assert ("revert", NODES[0]) not in fake.calls and fake.calls == [("deploy", NODES[0])]


def test_a_revert_that_fails_is_said():
    fake = FakeFleet(NODES, gate_fails=[NODES[0]], revert_fails=[NODES[0]])
    out = rollout.execute(_plan(), fake, {n: "old" for n in NODES})
    assert out.steps[0].state == rollout.REVERT_FAILED and "previous container gone" in out.steps[0].why


def test_a_bench_that_raises_fails_its_gate_and_the_node_goes_back():
    class Raising(FakeFleet):
        def gate(self, node):
            raise RuntimeError("vLLM /metrics does not answer")
    fake = Raising(NODES)
    out = rollout.execute(_plan(), fake, {n: "old" for n in NODES})
    assert out.failed_gate.gate == "bench" and "does not answer" in out.failed_gate.why
    assert fake.running[NODES[0]] == "old"


def test_an_interrupt_puts_back_the_node_being_gated_finishes_the_passed_and_propagates():
    plan = _plan()
    at = plan.waves[1].nodes[1]
    fake = FakeFleet(NODES, interrupt_at=at)
    with pytest.raises(KeyboardInterrupt):
        rollout.execute(plan, fake, {n: "old" for n in NODES})
    assert fake.running[at] == "old" and ("revert", at) in fake.calls
    assert {n for n, v in fake.running.items() if v == "new"} == {plan.waves[0].nodes[0], plan.waves[1].nodes[0]}
    assert not fake.kept


def test_a_void_bench_does_not_pass():
    g = judge("spark1", healthy=True, mean_tok_s=52.0, floor_tok_s=40.0,
                      gpu_verdict=GpuVerdict(state="healthy", reasons=[]), void=["foreign requests ran"])
    assert not g.passed and g.gate == "bench void" and "foreign requests" in g.why


def test_an_interrupt_just_after_a_deploy_committed_puts_that_node_back():
    class CommitsThenInterrupted(FakeFleet):
        def deploy(self, node):
            super().deploy(node)
            if node == NODES[1]:
                raise KeyboardInterrupt  # the termination lands between the commit and the return
            return "new"
    plan = _plan(mu=1)
    fake = CommitsThenInterrupted(NODES)
    with pytest.raises(KeyboardInterrupt):
        rollout.execute(plan, fake, {n: "old" for n in NODES})
    assert fake.running[NODES[1]] == "old" and ("revert", NODES[1]) in fake.calls
    assert fake.running[NODES[0]] == "new" and ("finish", NODES[0]) in fake.calls


def test_a_completed_rollout_names_the_nodes_it_skipped():
    plan = rollout.plan_waves(NODES[:3], in_rotation=NODES[:3], skip={"spark3": "quarantined: crash-loop"})
    out = rollout.execute(plan, FakeFleet(NODES[:3]), {n: "old" for n in NODES[:3]})
    assert out.completed and out.headline() == "rolled out to spark1, spark2; skipped spark3: quarantined: crash-loop"


def test_the_nodes_a_dead_run_passed_are_finished_with_the_others():
    """A rerun after a killed rollout: the dead run's canary (on the new version, its gate passed,
    its previous version still kept) is finished at the end like the nodes this run passed."""
    plan = rollout.plan_waves(["spark1", "spark2"], in_rotation=["spark1", "spark2"],
                              skip={"spark1": "already serves the new version"})
    fake, events = FakeFleet(["spark1", "spark2"]), []
    fake.kept = {"spark1"}
    out = rollout.execute(plan, fake, {"spark2": "old"}, lambda e, t: events.append(e), passed_before=["spark1"])
    assert out.completed and fake.calls[-2:] == [("finish", "spark2"), ("finish", "spark1")], fake.calls
    assert not fake.kept and any("spark1 passed its gate in an earlier run" in e for e in events), events
