"""Pipelined distribution: which holder sends which shard to which node, as soon as it can.

Copying from the build host alone makes its uplink carry N whole copies in a row, and a tree of
whole copies still waits for each copy to finish before it is passed on (at 8 receivers it cannot
go below half the time of the build host alone). Here the checkpoint and the image travel as
units (each shard, the small files together, the image in parts no larger than the largest
shard), and a receiver passes each unit on to its children as soon as that unit is verified on it
(sha256 against the manifest): the units stream down the tree like a pipeline, and the last
receiver is done about one copy plus one unit per level after the first byte left the build host.

The tree: every node feeds at most `fan_out` children at once (distribution.fan_out; 1 gives each
link its full rate, so with one source the tree is a chain, which a pipeline fills best), the
source and every node already holding the version at its roots. A receiver takes each unit from
its nearest usable ancestor: its parent when the parent has it verified, else it waits while the
parent is still to get it. A receiver whose transfer failed is suspect from then on: its children
skip it (they take what it has not passed on from the next ancestor up, the build host at worst),
it serves nobody again in this run, and it retries from another verified holder than the one it
failed from, until it failed `max_attempts` times (then it is given up; a rerun resumes its
partial copy). Pure: runbook/distribution.py runs the batches and reports what verified.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

CHECKPOINT = "checkpoint"
IMAGE = "image"
SMALL_FILES = "small files"
SHARD_MIN_BYTES = 1 << 20  # a file at least this big is a unit of its own; the rest travel together
IMAGE_PART_MIN_BYTES = 4 << 20
IMAGE_PART_MAX_BYTES = 4 << 30
BATCH_UNITS = 4  # units one batch carries at most from a holder that has them all (then others take turns)
# Batches a receiver has under way at once: the next one is queued while the last one is still
# arriving and being hashed, so the link is never idle between units.
INCOMING = 2


@dataclass(frozen=True)
class Unit:
    name: str
    area: str  # CHECKPOINT (a version's files) | IMAGE (parts of the image's `docker save` stream)
    files: tuple[str, ...]
    size: int


def image_part_bytes(largest_shard: int) -> int:
    """The image's parts are no larger than the checkpoint's largest shard, so no unit holds the
    pipeline back longer than a shard does (within 4 MiB .. 4 GiB)."""
    return min(IMAGE_PART_MAX_BYTES, max(IMAGE_PART_MIN_BYTES, largest_shard))


def units_of(files: Mapping[str, Mapping], extra: Mapping[str, int] | None = None,
             parts: Mapping[str, int] | None = None) -> list[Unit]:
    """The checkpoint's manifest files (`{path: {size, ...}}`) plus `extra` files (the manifest
    file itself) -> the small files as one unit first, then each big file, then the image parts
    (`{name: size}`), in that order."""
    sizes = {p: int(e["size"]) for p, e in files.items()} | dict(extra or {})
    small = sorted(p for p, n in sizes.items() if n < SHARD_MIN_BYTES)
    out = [Unit(SMALL_FILES, CHECKPOINT, tuple(small), sum(sizes[p] for p in small))] if small else []
    out += [Unit(p, CHECKPOINT, (p,), n) for p, n in sorted(sizes.items()) if n >= SHARD_MIN_BYTES]
    out += [Unit(f"image {p}", IMAGE, (p,), n) for p, n in sorted((parts or {}).items())]
    return out


def tree(source: str, receivers: Sequence[str], fan_out: int = 1, holding: Sequence[str] = ()) -> dict[str, str]:
    """receiver -> parent: each node feeds at most `fan_out` children; receivers are placed in
    order under the shallowest node with room (the source and the holders are the roots)."""
    if fan_out < 1:
        raise ValueError("fan_out must be at least 1")
    if source in receivers:
        raise ValueError(f"the source {source} cannot also be a receiver")
    if len(set(receivers)) != len(receivers):
        raise ValueError("a receiver is listed twice")
    room: list[list] = [[0, i, n, fan_out] for i, n in enumerate([source, *holding])]  # depth, order, node, free
    parent: dict[str, str] = {}
    for r in receivers:
        best = min((slot for slot in room if slot[3] > 0), key=lambda slot: (slot[0], slot[1]))
        best[3] -= 1
        parent[r] = best[2]
        room.append([best[0] + 1, len(room), r, fan_out])
    return parent


def depth_of(parent: Mapping[str, str], node: str) -> int:
    d = 0
    while node in parent:
        node, d = parent[node], d + 1
    return d


def tree_lines(parent: Mapping[str, str]) -> list[str]:
    """One line per path from a root: `spark1 -> spark2 -> spark3`, `spark2 -> spark4`."""
    children: dict[str, list[str]] = {}
    for r, p in parent.items():
        children.setdefault(p, []).append(r)
    roots = [p for p in children if p not in parent]
    out: list[str] = []

    def walk(node: str, path: list[str]) -> None:
        kids = children.get(node, [])
        if not kids:
            out.append(" -> ".join(path))
            return
        walk(kids[0], [*path, kids[0]])
        for k in kids[1:]:
            walk(k, [node, k])

    for root in roots:
        walk(root, [root])
    return out


@dataclass(frozen=True)
class Batch:
    """One transfer: `units` (all of one area) from `holder` to `receiver`, sent one after the other."""

    holder: str
    receiver: str
    area: str
    units: tuple[str, ...]
    seq: int = 0  # the order batches started in


class Pipeline:
    """Who holds which unit verified, what each receiver still wants, who sends what now.

    Not thread-safe: the runbook calls it under one lock. `have`: the units each node already
    holds verified (the source: everything it has made; a node already holding the version: its
    checkpoint units). `wants`: per receiver the units it needs (default every unit). `more_for`:
    receivers that will want units not known yet (`add_units`: the image's parts)."""

    def __init__(self, source: str, receivers: Sequence[str], units: Sequence[Unit], *, fan_out: int = 1,
                 max_attempts: int = 2, holding: Sequence[str] = (),
                 have: Mapping[str, Collection[str]] | None = None,
                 wants: Mapping[str, Collection[str]] | None = None, batch_units: int = BATCH_UNITS,
                 more_for: Collection[str] = ()) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.source, self.fan_out, self.max_attempts, self.batch_units = source, fan_out, max_attempts, batch_units
        self.units = {u.name: u for u in units}
        self.order = [u.name for u in units]
        self.receivers = list(receivers)
        self.parent = tree(source, receivers, fan_out, holding)
        self.roots = [source, *holding]
        self.depth = {r: depth_of(self.parent, r) for r in self.receivers}
        everything = set(self.order)
        self.have: dict[str, set[str]] = {n: set() for n in [*self.roots, *self.receivers]}
        self.have[source] = set(everything)
        for n, held in (have or {}).items():
            self.have.setdefault(n, set()).update(u for u in held if u in everything)
        self.wants = {r: set((wants or {}).get(r, everything)) & everything for r in self.receivers}
        self.incoming: dict[str, list[Batch]] = {r: [] for r in self.receivers}
        self.sending: dict[str, dict[str, int]] = {n: {} for n in self.have}  # holder -> receiver -> batches
        self.pending: dict[str, dict[str, str]] = {r: {} for r in self.receivers}  # unit -> the holder it came from
        self.fails: dict[str, int] = {r: 0 for r in self.receivers}
        self._started = 0
        self._failed_at: dict[str, int] = {}  # receiver -> batches started when its last failure counted
        self.failed_from: dict[str, str] = {}
        self.suspect: set[str] = set()
        self.given_up: list[str] = []
        self.complete: list[str] = []
        self.more_for = set(more_for) & set(self.receivers)
        for r in self.receivers:
            self._check_complete(r)

    # -- reading

    def lacking(self, r: str) -> list[str]:
        """The units `r` wants that it neither holds verified, nor receives now, nor waits to
        see verified, in unit order."""
        busy = {u for b in self.incoming[r] for u in b.units}
        return [u for u in self.order if u in self.wants[r] and u not in self.have[r]
                and u not in self.pending[r] and u not in busy]

    def usable(self, n: str) -> bool:
        return n not in self.suspect and n not in self.given_up

    def finished(self, r: str) -> bool:
        return r in self.complete or r in self.given_up

    @property
    def done(self) -> bool:
        return all(self.finished(r) for r in self.receivers)

    @property
    def in_flight(self) -> bool:
        return any(self.incoming.values()) or any(self.pending.values())

    def _free(self, n: str, r: str) -> bool:
        """`n` may send to `r` now: it feeds `r` already, or fewer than fan_out receivers. A
        suspect receiver only takes what nobody else waits for: a new link, never a second batch."""
        feeding = self.sending.get(n, {})
        if r in self.suspect:
            return r not in feeding and len(feeding) < self.fan_out
        return r in feeding or len(feeding) < self.fan_out

    def _source(self, r: str, u: str) -> tuple[str | None, bool]:
        """(holder to take `u` from now or None, whether to wait for an ancestor that gets it)."""
        if r not in self.suspect:
            a = self.parent.get(r)
            while a is not None:
                if self.usable(a):
                    if u in self.have[a]:
                        return (a if self._free(a, r) else None), True
                    if a in self.wants and u in self.wants[a] and not self.finished(a):
                        return None, True  # it comes down the tree
                a = self.parent.get(a)
        # Off the tree: a suspect receiver retries, or no ancestor gets this unit (a root that
        # holds the checkpoint but not the image's parts): any usable holder of it, the one it
        # failed from last, then the busiest, last.
        holders = [n for n in self.have if n != r and self.usable(n) and u in self.have[n]]
        if not holders:
            return None, False
        avoid = self.failed_from.get(r)
        free = [n for n in holders if self._free(n, r)]
        if not free:
            return None, True
        return min(free, key=lambda n: (n == avoid, n not in self.roots, len(self.sending.get(n, {})),
                                        list(self.have).index(n))), False

    def next_batches(self) -> list[Batch]:
        """The batches to start now (each receiver INCOMING at a time, each holder feeding
        `fan_out` receivers at a time), shallow healthy receivers first: they feed the most nodes."""
        out: list[Batch] = []
        order = sorted((r for r in self.receivers if not self.finished(r) and len(self.incoming[r]) < INCOMING),
                       key=lambda r: (r in self.suspect, self.depth[r], self.receivers.index(r)))
        for r in order:
            want = self.lacking(r)
            for i, u in enumerate(want):
                holder, _ = self._source(r, u)
                if holder is None:
                    continue
                area = self.units[u].area
                rest = [v for v in want[i + 1:] if self.units[v].area == area]
                picked = [u] + [v for v in rest if v in self.have[holder]]
                # A holder still receiving: one unit at a time, or what it verifies meanwhile waits
                # for the whole batch (the lag down each level is one batch). A holder with all
                # of it: a few per rsync, fewer handshakes.
                limit = self.batch_units if len(picked) == 1 + len(rest) else 1
                if limit > 1 and any(x.holder != holder for x in self.incoming[r]):
                    break  # a full batch does not share the link with another holder's: it waits
                self._started += 1
                b = Batch(holder, r, area, tuple(picked[:limit]), self._started)
                self.incoming[r].append(b)
                feeding = self.sending.setdefault(holder, {})
                feeding[r] = feeding.get(r, 0) + 1
                out.append(b)
                break
        return out

    def stuck(self) -> list[str]:
        """Receivers that can get nothing more: nothing in flight anywhere, no batch to start,
        nothing more announced, and units still missing (their only holders were given up)."""
        if self.in_flight or self.more_for:
            return []
        return [r for r in self.receivers if not self.finished(r)]

    # -- changes

    def add_units(self, units: Sequence[Unit], holder: str, wanted_by: Collection[str]) -> list[str]:
        """Units that exist from now on (the image's parts, once `holder` cut them), wanted by
        the receivers in `wanted_by`. Returns the receivers this completes (none wanted a part)."""
        for u in units:
            if u.name not in self.units:
                self.units[u.name] = u
                self.order.append(u.name)
            self.have.setdefault(holder, set()).add(u.name)
        for r in wanted_by:
            if r in self.wants and not self.finished(r):
                self.wants[r] |= {u.name for u in units}
            self.more_for.discard(r)
        return [r for r in self.receivers if self._check_complete(r)]

    def ended(self, b: Batch, ok: bool) -> None:
        """A batch's rsync ended. Its units wait for the receiver's own hash (`verified`); a
        failed batch is a failure of its receiver (`failed`)."""
        feeding = self.sending[b.holder]
        feeding[b.receiver] -= 1
        if not feeding[b.receiver]:
            del feeding[b.receiver]
        if b in self.incoming.get(b.receiver, []):
            self.incoming[b.receiver].remove(b)
        if b.receiver in self.given_up:
            return
        if ok:
            for u in b.units:
                if u not in self.have[b.receiver]:
                    self.pending[b.receiver][u] = b.holder
        elif b.seq > self._failed_at.get(b.receiver, 0):
            self.failed(b.receiver, b.holder)  # a batch that ran beside one that failed fails with it: one attempt

    def verified(self, r: str, u: str) -> bool:
        """`u` hashed to the manifest on `r` (whoever sent it, or found there). True when that
        completes `r`: the runbook then finishes the receiver (rename, image load, marker)."""
        if u not in self.units or r not in self.wants:
            return False
        self.have[r].add(u)
        self.pending[r].pop(u, None)
        return self._check_complete(r)

    def _check_complete(self, r: str) -> bool:
        if (self.wants[r] <= self.have[r] and r not in self.more_for and r not in self.complete
                and r not in self.given_up):
            self.complete.append(r)
            return True
        return False

    def holds_area(self, r: str, area: str) -> bool:
        """Every unit of `area` that `r` wants is verified on it (and no more are to come)."""
        if area == IMAGE and r in self.more_for:
            return False
        return all(u in self.have[r] for u in self.wants[r] if self.units[u].area == area)

    def unverified(self, r: str, units: Collection[str]) -> None:
        """Units a batch delivered that did not hash to the manifest on `r` in time: they are
        wanted again, and it is a failure of `r` (from the holder that sent them)."""
        came = {self.pending[r].pop(u) for u in units if u in self.pending[r]}
        if came:
            self.failed(r, sorted(came)[0])

    def failed(self, r: str, holder: str | None = None) -> None:
        """`r` failed a transfer (or could not be finished): suspect from now on, given up after
        max_attempts failures."""
        if r in self.given_up:
            return
        self.suspect.add(r)
        if holder:
            self.failed_from[r] = holder
        if r in self.complete:
            return  # everything it wants is verified on it: a late error changes nothing it holds
        self.fails[r] += 1
        self._failed_at[r] = self._started
        if self.fails[r] >= self.max_attempts:
            self.give_up(r)

    def give_up(self, r: str) -> None:
        if r not in self.given_up:
            self.given_up.append(r)
            if r in self.complete:
                self.complete.remove(r)
            self.pending[r].clear()
