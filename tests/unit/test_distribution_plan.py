"""The pipelined distribution (core/distribution.py): the tree, and the scheduler run on a simulated
clock (every unit takes one tick on a link, a batch lands its units one after the other): every
receiver gets every unit from a holder that had it verified, within its links' limits; the last
receiver is done about one copy plus one unit per level after the start; a failing receiver is
skipped by its children and never serves again."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spark_pipelines.core import distribution as d

names = st.integers(min_value=1, max_value=24).map(lambda n: [f"spark{i}" for i in range(2, n + 2)])


def units(n: int, size: int = 10) -> list[d.Unit]:
    return [d.Unit(f"shard{i:02d}", d.CHECKPOINT, (f"shard{i:02d}",), size) for i in range(n)]


class Sim:
    """Runs a Pipeline on a simulated clock: a receiver's link lands one unit per tick, the units
    of its batches in the order they started; a receiver in `failing` fails every batch it receives
    half-way (after its first unit landed, when the batch has more than one): it never completes."""

    def __init__(self, p: d.Pipeline, failing: frozenset[str] = frozenset(), hash_ticks: float = 0.0) -> None:
        self.p, self.failing, self.hash_ticks = p, failing, hash_ticks
        self.now = 0.0
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = 0
        self.batches: list[tuple[float, d.Batch]] = []
        self.done_at: dict[str, float] = {}
        self.suspect_since: dict[str, float] = {}
        self.feeding: dict[str, dict[str, int]] = {}
        self.incoming: dict[str, int] = {}
        self.link_free: dict[str, float] = {}

    def push(self, t: float, kind: str, what: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, what))

    def start(self) -> None:
        for b in self.p.next_batches():
            # The holder had every unit of the batch verified when it started.
            assert all(u in self.p.have[b.holder] for u in b.units), b
            assert b.holder not in self.p.suspect and b.holder not in self.p.given_up
            feeding = self.feeding.setdefault(b.holder, {})
            feeding[b.receiver] = feeding.get(b.receiver, 0) + 1
            assert len(feeding) <= self.p.fan_out
            self.incoming[b.receiver] = self.incoming.get(b.receiver, 0) + 1
            assert self.incoming[b.receiver] <= d.INCOMING
            self.batches.append((self.now, b))
            t = max(self.now, self.link_free.get(b.receiver, 0.0))
            if b.receiver in self.failing:
                if len(b.units) > 1:
                    self.push(t + 1, "land", (b.receiver, b.units[0]))
                self.push(t + 1.5, "end", (b, False))
                self.link_free[b.receiver] = t + 1.5
            else:
                for i, u in enumerate(b.units, 1):
                    self.push(t + i, "land", (b.receiver, u))
                self.push(t + len(b.units), "end", (b, True))
                self.link_free[b.receiver] = t + len(b.units)

    def run(self, limit: float = 10_000) -> float:
        self.start()
        while self.events:
            self.now, _, kind, what = heapq.heappop(self.events)
            assert self.now < limit, "the pipeline does not finish"
            if kind == "land":
                r, u = what  # type: ignore[misc]
                self.push(self.now + self.hash_ticks, "verified", (r, u))
            elif kind == "verified":
                r, u = what  # type: ignore[misc]
                if r not in self.p.given_up and self.p.verified(r, u):
                    self.done_at[r] = self.now
            else:
                b, ok = what  # type: ignore[misc]
                self.feeding[b.holder][b.receiver] -= 1
                if not self.feeding[b.holder][b.receiver]:
                    del self.feeding[b.holder][b.receiver]
                self.incoming[b.receiver] -= 1
                self.p.ended(b, ok)
                if not ok:
                    self.suspect_since.setdefault(b.receiver, self.now)
            self.start()
            if not self.events and not self.p.done:
                for r in self.p.stuck():
                    self.p.give_up(r)
        return self.now


@given(receivers=names, fan_out=st.integers(1, 4), holders=st.integers(0, 3))
def test_the_tree_gives_every_receiver_one_parent_within_its_fan_out(receivers, fan_out, holders):
    held = [f"holder{i}" for i in range(holders)]
    parent = d.tree("spark1", receivers, fan_out, held)
    assert sorted(parent) == sorted(receivers)
    placed = {"spark1", *held}
    for r in receivers:  # a parent is a root or a receiver placed before
        assert parent[r] in placed
        placed.add(r)
    children: dict[str, int] = {}
    for p in parent.values():
        children[p] = children.get(p, 0) + 1
    assert max(children.values()) <= fan_out


def test_one_link_each_makes_a_chain_and_holders_start_chains_of_their_own():
    assert d.tree_lines(d.tree("spark1", ["spark2", "spark3", "spark4"])) == ["spark1 -> spark2 -> spark3 -> spark4"]
    assert d.tree_lines(d.tree("spark1", ["spark3", "spark4", "spark5"], 1, ["spark2"])) == [
        "spark1 -> spark3 -> spark5", "spark2 -> spark4"]
    assert d.tree("spark1", ["a", "b", "c", "d"], 2) == {"a": "spark1", "b": "spark1", "c": "a", "d": "a"}
    with pytest.raises(ValueError, match="cannot also be a receiver"):
        d.tree("spark1", ["spark1"])


def test_units_put_the_small_files_first_each_shard_alone_and_the_image_parts_last():
    files = {"config.json": {"size": 900}, "model.safetensors.index.json": {"size": 40_000},
             "model-00002-of-00002.safetensors": {"size": 5 << 30}, "model-00001-of-00002.safetensors": {"size": 4 << 30}}
    got = d.units_of(files, {".spark-manifest.json": 700}, {"part-00000": 1 << 30, "part-00001": 10})
    assert [u.name for u in got] == [d.SMALL_FILES, "model-00001-of-00002.safetensors",
                                     "model-00002-of-00002.safetensors", "image part-00000", "image part-00001"]
    assert got[0].files == (".spark-manifest.json", "config.json", "model.safetensors.index.json")
    assert got[0].size == 41_600 and [u.area for u in got] == [d.CHECKPOINT] * 3 + [d.IMAGE] * 2
    assert d.image_part_bytes(5 << 30) == 4 << 30 and d.image_part_bytes(10) == 4 << 20
    assert d.image_part_bytes(48 << 20) == 48 << 20


@settings(max_examples=60, deadline=None)
@given(receivers=names, n_units=st.integers(1, 20), fan_out=st.integers(1, 3))
def test_every_receiver_gets_every_unit_in_about_one_copy_plus_one_unit_per_level(receivers, n_units, fan_out):
    p = d.Pipeline("spark1", receivers, units(n_units), fan_out=fan_out)
    sim = Sim(p)
    end = sim.run()
    assert p.done and sorted(p.complete) == sorted(receivers) and not p.given_up
    assert all(p.have[r] == set(p.order) for r in receivers)
    deepest = max(p.depth.values())
    if fan_out == 1:
        # A chain: each level one unit behind the one above, where copies one after the other
        # from the build host alone would take n_units * receivers.
        assert end <= n_units + deepest
    else:
        assert end <= fan_out * n_units + deepest * fan_out
    assert all(b.receiver in receivers for _, b in sim.batches)


def test_eight_receivers_sixteen_shards_finish_in_a_fifth_of_copying_them_one_after_the_other():
    receivers = [f"spark{i}" for i in range(2, 10)]
    end = Sim(d.Pipeline("spark1", receivers, units(16))).run()
    assert end == 16 + 7  # the chain's last node: one copy plus one unit per level below the first
    assert end / (16 * 8) < 0.2


@settings(max_examples=80, deadline=None)
@given(data=st.data(), receivers=names, n_units=st.integers(1, 8), max_attempts=st.integers(1, 3))
def test_a_failing_receiver_is_skipped_by_its_children_and_never_serves_again(data, receivers, n_units, max_attempts):
    failing = frozenset(data.draw(st.sets(st.sampled_from(receivers), max_size=len(receivers))))
    p = d.Pipeline("spark1", receivers, units(n_units), max_attempts=max_attempts)
    sim = Sim(p, failing)
    sim.run()
    assert p.done
    assert sorted(p.given_up) == sorted(failing)
    assert sorted(p.complete) == sorted(set(receivers) - failing)
    for t, b in sim.batches:  # nobody takes from a receiver once it failed
        since = sim.suspect_since.get(b.holder)
        assert since is None or t < since, f"{b.holder} served {b.receiver} at {t} after failing at {since}"
    for r in failing:
        assert p.fails[r] == max_attempts


def test_the_child_of_a_receiver_that_failed_takes_the_rest_from_the_next_holder_up():
    p = d.Pipeline("spark1", ["spark2", "spark3", "spark4"], units(6), max_attempts=2)
    sim = Sim(p, frozenset({"spark3"}))
    sim.run()
    assert p.given_up == ["spark3"] and sorted(p.complete) == ["spark2", "spark4"]
    from_ = {b.holder for t, b in sim.batches if b.receiver == "spark4" and t >= sim.suspect_since["spark3"]}
    assert from_ == {"spark2"}  # spark3's parent, one level up
    retries = [b.holder for t, b in sim.batches if b.receiver == "spark3" and t >= sim.suspect_since["spark3"]]
    assert retries and "spark2" not in retries  # its retry comes from another holder


def test_a_batch_whose_units_do_not_verify_is_a_failure_and_they_are_wanted_again():
    p = d.Pipeline("spark1", ["spark2"], units(2), max_attempts=2)
    (b,) = p.next_batches()
    p.ended(b, ok=True)
    assert p.verified("spark2", "shard00") is False
    p.unverified("spark2", ["shard01"])
    assert p.fails["spark2"] == 1 and p.lacking("spark2") == ["shard01"]
    (again,) = p.next_batches()
    assert again.holder == "spark1" and again.units == ("shard01",)  # the only holder, even the one it failed from
    p.ended(again, ok=True)
    assert p.verified("spark2", "shard01") is True and p.done


def test_image_parts_announced_later_come_from_whoever_has_them():
    # spark2 already holds the checkpoint (not the image's parts): spark4 below it takes the
    # checkpoint from spark2 and the parts from the build host, which cut them.
    ck = units(2)
    p = d.Pipeline("spark1", ["spark3", "spark4"], ck, holding=["spark2"],
                   have={"spark2": [u.name for u in ck]}, more_for=["spark3", "spark4"])
    assert p.parent == {"spark3": "spark1", "spark4": "spark2"}
    sim = Sim(p)
    sim.run()  # until nothing more can move: the parts are not cut yet
    assert not p.done and p.holds_area("spark3", d.CHECKPOINT) and not p.holds_area("spark3", d.IMAGE)
    parts = [d.Unit("part-00000", d.IMAGE, ("part-00000",), 10)]
    assert p.add_units(parts, "spark1", ["spark3", "spark4"]) == []
    sim.run()
    assert p.done and sorted(p.complete) == ["spark3", "spark4"]
    assert {b.holder for _, b in sim.batches if b.receiver == "spark4" and b.area == d.IMAGE} <= {"spark1", "spark3"}
    assert {b.holder for _, b in sim.batches if b.receiver == "spark4" and b.area == d.CHECKPOINT} == {"spark2"}
