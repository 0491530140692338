"""Rollout planning (canary, waves within max_unavailable, the rotation floor) and the wave gates."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spark_pipelines.core.baseline import Baseline, BenchIdentity
from spark_pipelines.core.gpu import GpuVerdict
from spark_pipelines.core.rollout import RolloutRefused, judge, plan_waves

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
