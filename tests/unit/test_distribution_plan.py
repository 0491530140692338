"""The fan-out planner (core/distribution.py): properties over fleets of 1-64 receivers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_pipelines.core import distribution as d

names = st.integers(min_value=0, max_value=64).map(lambda n: [f"spark{i}" for i in range(2, n + 2)])


@given(receivers=names, fan_out=st.integers(1, 4))
def test_every_receiver_is_served_once_by_a_holder_within_its_fan_out(receivers, fan_out):
    rounds = d.plan("spark1", receivers, fan_out)
    served = [c.receiver for r in rounds for c in r.copies]
    assert sorted(served) == sorted(receivers)  # every receiver covered, none twice
    holders = {"spark1"}
    for r in rounds:
        per_holder: dict[str, int] = {}
        for c in r.copies:
            assert c.holder in holders, f"{c.holder} serves before it holds a copy"
            per_holder[c.holder] = per_holder.get(c.holder, 0) + 1
        assert max(per_holder.values()) <= fan_out
        assert len(set(r.receivers())) == len(r.copies)
        holders |= set(r.receivers())


@given(receivers=names)
def test_one_copy_per_holder_takes_at_most_ceil_log2_n_plus_1_rounds(receivers):
    n = len(receivers)
    rounds = d.plan("spark1", receivers, fan_out=1)
    assert len(rounds) <= math.ceil(math.log2(n + 1))
    assert len(rounds) == d.rounds_needed(n) == d.log2_bound(n)


@given(receivers=names, fan_out=st.integers(1, 4))
def test_each_round_uses_every_free_holder(receivers, fan_out):
    state = d.start("spark1", receivers)
    while not state.done:
        rnd = d.next_round(state, fan_out)
        assert len(rnd.copies) == min(len(state.pending), len(state.holders) * fan_out)
        state = d.after(state, rnd, {c.receiver: True for c in rnd.copies})


@settings(max_examples=300)
@given(data=st.data(), n=st.integers(1, 40), max_attempts=st.integers(1, 3))
def test_failed_receivers_never_serve_and_do_not_hold_back_the_others(data, n, max_attempts):
    receivers = [f"spark{i}" for i in range(2, n + 2)]
    failing = data.draw(st.sets(st.sampled_from(receivers), max_size=n))
    state = d.start("spark1", receivers)
    healthy_done_at: dict[str, int] = {}
    while not state.done:
        rnd = d.next_round(state, 1)
        assert rnd.copies, "a round with pending receivers and holders must copy something"
        for c in rnd.copies:
            assert c.holder not in failing
        state = d.after(state, rnd, {c.receiver: c.receiver not in failing for c in rnd.copies}, max_attempts)
        for c in rnd.copies:
            if c.receiver not in failing:
                healthy_done_at[c.receiver] = rnd.number
    assert set(state.given_up) == failing
    assert set(state.holders) == {"spark1", *receivers} - failing
    assert all(state.failures[f] == max_attempts for f in failing)
    # Each failure costs at most the one slot its first attempt took: at most one extra round.
    healthy = n - len(failing)
    if healthy:
        assert max(healthy_done_at.values()) <= d.log2_bound(n) + len(failing)


def test_a_failed_subtree_is_reparented_to_the_holders_of_the_next_round():
    receivers = ["spark2", "spark3", "spark4", "spark5", "spark6", "spark7", "spark8"]
    state = d.start("spark1", receivers)
    r1 = d.next_round(state, 1)
    assert d.describe([r1]) == ["round 1: spark1 -> spark2"]
    state = d.after(state, r1, {"spark2": True})
    r2 = d.next_round(state, 1)
    assert [(c.holder, c.receiver) for c in r2.copies] == [("spark1", "spark3"), ("spark2", "spark4")]
    state = d.after(state, r2, {"spark3": True, "spark4": False})  # spark4 fails mid-copy
    r3 = d.next_round(state, 1)
    # spark4 would have served a node in round 3; its turn goes to the three holders there are,
    # healthy receivers first, and spark4 itself waits for a free holder.
    assert [c.holder for c in r3.copies] == ["spark1", "spark2", "spark3"]
    assert [c.receiver for c in r3.copies] == ["spark5", "spark6", "spark7"]
    state = d.after(state, r3, {r: True for r in r3.receivers()})
    r4 = d.next_round(state, 1)
    by_receiver = {c.receiver: c.holder for c in r4.copies}
    assert set(by_receiver) == {"spark8", "spark4"}
    assert by_receiver["spark4"] != "spark2"  # retried from another holder than the one it failed from
    state = d.after(state, r4, {"spark8": True, "spark4": True})
    assert state.done and not state.given_up and state.rounds == 4


def test_nodes_that_already_hold_a_copy_serve_from_the_first_round():
    rounds = d.plan("spark1", ["spark2", "spark3", "spark4"], already_holding=["spark3"])
    assert d.describe(rounds) == ["round 1: spark1 -> spark2, spark3 -> spark4"]


def test_refuses_a_plan_it_cannot_make():
    with pytest.raises(ValueError, match="source"):
        d.start("spark1", ["spark1", "spark2"])
    with pytest.raises(ValueError, match="twice"):
        d.start("spark1", ["spark2", "spark2"])
    with pytest.raises(ValueError, match="fan_out"):
        d.next_round(d.start("spark1", ["spark2"]), 0)
    assert d.plan("spark1", []) == []
