"""Fan-out distribution: which holder sends the checkpoint and the image to which node, round by round.

Copying from the build host alone makes its uplink carry N copies in a row. Instead every node that
holds a verified copy serves the next ones: with one copy per holder at a time, the holders double
each round, so N receivers take ceil(log2(N+1)) rounds (the build host's own round included).

The plan is made one round at a time from what is verified now, never fixed in advance: a receiver
that fails is simply not a holder in the next round, so the nodes it would have served (its
subtree) are given to the holders there are, and it is retried after the others, from another
holder where there is one, until `max_attempts`. Pure: the runbook's `distribution.py` runs the
copies and reports which ones verified.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Copy:
    holder: str
    receiver: str


@dataclass(frozen=True)
class Round:
    number: int  # 1-based
    copies: tuple[Copy, ...]

    def receivers(self) -> list[str]:
        return [c.receiver for c in self.copies]


def rounds_needed(receivers: int, fan_out: int = 1, holders: int = 1) -> int:
    """Rounds for `receivers` nodes when nothing fails: each round the holders grow (fan_out+1)-fold."""
    if fan_out < 1 or holders < 1:
        raise ValueError("fan_out and holders must be at least 1")
    if receivers <= 0:
        return 0
    # Integer loop, not log(): exact at the powers where floating point rounds the wrong way.
    rounds, have = 0, holders
    while have < holders + receivers:
        have *= fan_out + 1
        rounds += 1
    return rounds


def log2_bound(receivers: int) -> int:
    """ceil(log2(N+1)): the round count the issue asks for, one copy per holder at a time."""
    return math.ceil(math.log2(receivers + 1)) if receivers > 0 else 0


@dataclass(frozen=True)
class DistributionState:
    """Who holds a verified copy, who still waits, and how often each waiting node failed."""

    holders: tuple[str, ...]
    pending: tuple[str, ...]
    failures: Mapping[str, int] = field(default_factory=dict)
    given_up: tuple[str, ...] = ()
    # Who served whom last (receiver -> holder): a retry prefers a different holder.
    last_holder: Mapping[str, str] = field(default_factory=dict)
    rounds: int = 0

    @property
    def done(self) -> bool:
        return not self.pending


def start(source: str, receivers: Sequence[str], already_holding: Sequence[str] = ()) -> DistributionState:
    """The first state: the source and every receiver that already holds a verified copy are holders."""
    if source in receivers:
        raise ValueError(f"the source {source} cannot also be a receiver")
    if len(set(receivers)) != len(receivers):
        raise ValueError("a receiver is listed twice")
    held = [r for r in receivers if r in set(already_holding)]
    return DistributionState(holders=(source, *held), pending=tuple(r for r in receivers if r not in set(held)))


def next_round(state: DistributionState, fan_out: int = 1) -> Round:
    """The copies to run at once now: every holder serves at most `fan_out` receivers; receivers
    that never failed go first (a failing node never takes a healthy node's turn twice), and a
    retried receiver gets a holder other than the one it failed from when there is one."""
    if fan_out < 1:
        raise ValueError("fan_out must be at least 1")
    order = sorted(state.pending, key=lambda r: (state.failures.get(r, 0), state.pending.index(r)))
    load = {h: 0 for h in state.holders}
    copies: list[Copy] = []
    for receiver in order:
        free = [h for h in state.holders if load[h] < fan_out]
        if not free:
            break
        avoid = state.last_holder.get(receiver)
        # Least loaded first, then a holder this receiver did not fail from, then fleet order.
        holder = min(free, key=lambda h: (load[h], h == avoid, state.holders.index(h)))
        load[holder] += 1
        copies.append(Copy(holder, receiver))
    return Round(state.rounds + 1, tuple(copies))


def after(state: DistributionState, rnd: Round, verified: Mapping[str, bool], max_attempts: int = 2) -> DistributionState:
    """The state once `rnd` ran: a verified receiver becomes a holder; a failed one stays pending
    until it failed `max_attempts` times, then it is given up (a rerun resumes its partial copy)."""
    if max_attempts < 1:
        raise ValueError("max_attempts must be at least 1")
    holders = list(state.holders)
    pending = list(state.pending)
    failures = dict(state.failures)
    given_up = list(state.given_up)
    last = dict(state.last_holder)
    for c in rnd.copies:
        if c.receiver not in pending:
            raise ValueError(f"{c.receiver} was not waiting for a copy")
        last[c.receiver] = c.holder
        if verified.get(c.receiver, False):
            pending.remove(c.receiver)
            holders.append(c.receiver)
        else:
            failures[c.receiver] = failures.get(c.receiver, 0) + 1
            if failures[c.receiver] >= max_attempts:
                pending.remove(c.receiver)
                given_up.append(c.receiver)
    return DistributionState(tuple(holders), tuple(pending), failures, tuple(given_up), last, state.rounds + 1)


def plan(source: str, receivers: Sequence[str], fan_out: int = 1,
         already_holding: Sequence[str] = ()) -> list[Round]:
    """Every round when every copy verifies: what `spark-pipelines plan` and the bench show."""
    state = start(source, receivers, already_holding)
    out: list[Round] = []
    while not state.done:
        rnd = next_round(state, fan_out)
        out.append(rnd)
        state = after(state, rnd, {c.receiver: True for c in rnd.copies})
    return out


def describe(rounds: Sequence[Round]) -> list[str]:
    """One line per round: `round 2: spark1 -> spark3, spark2 -> spark4`."""
    return [f"round {r.number}: " + ", ".join(f"{c.holder} -> {c.receiver}" for c in r.copies) for r in rounds]
