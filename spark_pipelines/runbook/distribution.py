"""Pipelined distribution of the checkpoint and the serving image (the runbook's step 4 copy, for N nodes).

core/distribution.py decides who sends which unit to whom; this runs it. Each receiver runs one
watcher (core/arrivals.py piped to its python3) that hashes every expected file as soon as it
lands whole and says so at once; a unit verified there may be sent on to the receiver's children
at once, while its own transfer goes on. A batch is one rsync of a few units, run ON the holder and
pushing straight to the receiver over one shared SSH connection per pair (its own peer key, see
below), into the receiver's `.<version>.incoming` directory with `--link-dest` from its serving
version (files alike are hard-linked, not sent). The image travels as parts of the build host's
`docker save` stream, no larger than the largest shard, beside the checkpoint in
`<models>/.image-<id>.parts`; a receiver loads them (`cat | docker load`) once all its parts
verified and checks the image id. When nothing more moves, each receiver that verified everything
is checked as a whole (sizes, index, shard headers against the build host's listing), its
incoming directory renamed to the version, and it gets the `node_artifacts` step marker. Every
receiver holds its own lease for the whole distribution. A receiver that fails is retried from
another holder, never serves again in this run, and its partial files stay for the rerun.

Why node-to-node and not relayed: a relay (`ssh A tar | ssh B untar` from the orchestrator) needs
no trust between nodes, but every byte then crosses the orchestrator's own link twice per copy,
which is the uplink bottleneck moved, not removed. Here each holder uses its own peer key (made
on the holder, never copied anywhere), authorized on the receiver as `restrict` (no forwarding,
no agent, no pty) and, when the fleet names the holder by IP address, `from=` that address; the
receiver's host key comes from the orchestrator's verified known_hosts (ensure_peer_access).
"""

from __future__ import annotations

import json
import posixpath
import queue
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spark_pipelines.core import arrivals
from spark_pipelines.core import checkpoint as checkpoint_core
from spark_pipelines.core import distribution as core
from spark_pipelines.core import layout, remote
from spark_pipelines.core import versions as versions_core
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.core.fleet import Node
from spark_pipelines.core.progress import Progress
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSession, RemoteError
from spark_pipelines.resources.transfer import NodeStreams, copy_failure, digests_on_node
from spark_pipelines.runbook import versions
from spark_pipelines.state import markers

STEP = "node_artifacts"  # the marker a verified receiver gets: node_artifacts then verifies and skips
_T = remote.PROBE_TIMEOUT_S
HASH_BYTES_PER_S = 50 << 20  # the slowest hash a landed unit is waited for (a busy disk), plus a fixed 30 s
WATCH_TIMEOUT_S = remote.COPY_TIMEOUT_S + remote.IMAGE_COPY_TIMEOUT_S


class DistributionFailed(RunbookError):
    """Some receivers have no verified copy after every attempt; the others do (`report`)."""

    report: DistributionReport | None = None


@dataclass(frozen=True)
class Payload:
    """What to distribute: the build host's checkpoint directory and image, and their identities."""

    src_dir: str  # on the build host
    image: str
    image_id: str
    manifest: str | None  # digest of the build host's sha256 manifest (mtp_weights recorded it)
    signature: str  # the node_artifacts marker signature (code version, index, manifest)


@dataclass
class Transfer:
    """One batch as it ran."""

    holder: str
    receiver: str
    area: str
    units: tuple[str, ...]
    ok: bool
    seconds: float
    bytes_sent: int = 0
    error: str = ""
    started: float = 0.0  # seconds after the distribution started


@dataclass
class DistributionReport:
    source: str
    tree: dict[str, str] = field(default_factory=dict)  # receiver -> parent
    transfers: list[Transfer] = field(default_factory=list)
    already_holding: list[str] = field(default_factory=list)
    verified: list[str] = field(default_factory=list)
    given_up: list[str] = field(default_factory=list)
    why: dict[str, str] = field(default_factory=dict)  # given-up receiver -> why
    done_at: dict[str, float] = field(default_factory=dict)  # receiver -> seconds until it verified everything
    seconds: float = 0.0
    figures: dict[str, float] = field(default_factory=dict)  # bytes, seconds, MiB/s verified (core.progress)

    def lines(self) -> list[str]:
        out = [f"already holding: {', '.join(self.already_holding)}"] if self.already_holding else []
        if self.tree:
            out += [f"tree: {ln}" for ln in core.tree_lines(self.tree)]
        for r in self.tree:
            got = [t for t in self.transfers if t.receiver == r and t.ok]
            by: dict[str, int] = {}
            for t in got:
                by[t.holder] = by.get(t.holder, 0) + len(t.units)
            src = ", ".join(f"{h} ({n})" for h, n in by.items()) or "nothing sent (found verified there)"
            failed = sum(1 for t in self.transfers if t.receiver == r and not t.ok)
            state = (f"GIVEN UP: {self.why.get(r, '')}" if r in self.given_up
                     else f"verified in {self.done_at.get(r, self.seconds):.1f} s" if r in self.verified else "not finished")
            out.append(f"{r}: {state}; units from {src}" + (f"; {failed} failed transfer(s)" if failed else ""))
        return out


def holds_copy(s: FleetSession, node: Node, payload: Payload) -> bool:
    """The node's marker says it received this checkpoint verified, it holds that version, and the
    same image id.
    (node_artifacts re-hashes the content on its own run; a damaged holder's receivers fail their
    content check against the manifest, so damage does not spread as a pass.)"""
    try:
        return (markers.matches(s, node, STEP, payload.signature) is not None
                and versions.read(s, node).holds(payload.manifest) is not None
                and NodeDocker(s).image_id(node.name, payload.image) == payload.image_id)
    except RemoteError:
        return False


def copy_to(s: FleetSession, holder: Node, receiver: Node, payload: Payload, *, run_id: str = "",
            bwlimit_kib: int | None = None) -> tuple[int, bool]:
    """One whole copy, as node_artifacts makes it: checkpoint (one rsync, then every file hashed),
    image, checks, marker. Holds the receiver's lease. Returns (bytes rsync sent, whether the
    image was streamed)."""
    f = s.fleet
    streams = NodeStreams(s)
    # A holder serves its own version of the checkpoint (the build host's is what mtp_weights made).
    src_dir = (payload.src_dir if holder.name == f.build_node.name
               else versions_core.version_path(layout.hybrid_dir(f, holder), payload.manifest or ""))
    with node_lease(s, receiver.name, f"distribution from {holder.name}", run_id=run_id):
        got = versions.receive(s, streams, holder.name, receiver, src_dir, payload.manifest or "",
                               bwlimit_kib=bwlimit_kib)
        img = streams.copy_image(holder.name, receiver.name, payload.image)
        if img.image_id != payload.image_id:
            raise RunbookError(f"{receiver.name}: received image {img.image_id[:19]} from {holder.name}, but the "
                               f"build host built {payload.image_id[:19]}; rerun the distribution")
        markers.write(s, receiver, STEP, payload.signature, manifest=payload.manifest, source=holder.name,
                      path=got.path)
    return got.copy.bytes_sent, not img.skipped


def parts_dir(s: FleetSession, node: Node, image_id: str) -> str:
    """Where a node keeps the image's parts during a distribution (beside the checkpoint versions)."""
    return f"{layout.models_dir(s.fleet, node)}/.image-{image_id.removeprefix('sha256:')[:16]}.parts"


@dataclass
class _Receiver:
    node: Node
    dest: str  # the version's directory being written: `.<version>.incoming`, or the version itself
    final: str
    link_dest: str | None
    wants_image: bool
    parts: str
    expect: str  # the watcher's expectation file on the node
    ok_files: set[tuple[int, str]] = field(default_factory=set)
    bad: set[str] = field(default_factory=set)  # units found bad while their batch ran
    loading: bool = False
    image_ok: bool = False


def distribute(s: FleetSession, receivers: list[Node], payload: Payload, *, log: Any = None, run_id: str = "",
               progress_every_s: float = 10.0) -> DistributionReport:
    """Bring payload from the build host to every receiver, pipelined down the tree; raise
    DistributionFailed naming the receivers left without a verified copy (after the others
    completed)."""
    return _Distribution(s, payload, log or s.log, run_id, progress_every_s).run(receivers)


class _Distribution:
    def __init__(self, s: FleetSession, payload: Payload, log: Any, run_id: str, every_s: float) -> None:
        self.s, self.payload, self.log, self.run_id, self.every_s = s, payload, log, run_id, every_s
        self.f = s.fleet
        self.build = self.f.build_node
        self.streams = NodeStreams(s)
        self.events: queue.Queue = queue.Queue()
        self.rx: dict[str, _Receiver] = {}
        self.dirs: dict[str, dict[str, str]] = {}  # node -> area -> the directory it sends that area from
        self.files: dict[str, tuple[str, ...]] = {}  # unit -> files
        self.unit_of: dict[tuple[int, str], str] = {}  # (area index, file) -> unit
        self.sizes: dict[str, dict] = {}  # (area index) file -> {size, sha256}
        self.started = time.monotonic()
        self.report = DistributionReport(source=self.build.name)
        self.pairs: set[tuple[str, str]] = set()
        self.background = 0

    # -- the whole run

    def run(self, receivers: list[Node]) -> DistributionReport:
        s, f, p = self.s, self.f, self.payload
        names = [n.name for n in receivers if n.name != self.build.name]
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(names) or 1)), thread_name_prefix="holds") as pool:
            holding = [n for n, ok in zip(names, pool.map(lambda n: holds_copy(s, f.node(n), p), names)) if ok]
        self.report.already_holding = holding
        pending = [n for n in names if n not in holding]
        if holding:
            self.log.info(f"distribution: {', '.join(holding)} already hold a verified copy (and serve from the start)")
        if not pending:
            return self._end()
        if not p.manifest:
            raise RunbookError("mtp_weights recorded no content manifest for the checkpoint (an output from before "
                               "manifests): rematerialize mtp_weights (build_job), then distribute")
        manifest_text = s.read_text(self.build.name, f"{p.src_dir}/{checkpoint_core.MANIFEST_NAME}")
        expected = checkpoint_core.expected_tree(manifest_text)
        if checkpoint_core.manifest_digest(checkpoint_core.parse_manifest(manifest_text)) != p.manifest:
            raise RunbookError(f"{self.build.name}:{p.src_dir}/{checkpoint_core.MANIFEST_NAME} is not the manifest "
                               f"mtp_weights recorded ({versions_core.short(p.manifest)}): the build host's checkpoint "
                               "changed since; rematerialize mtp_weights")
        if NodeDocker(s).image_id(self.build.name, p.image) != p.image_id:
            raise RunbookError(f"{self.build.name} does not hold {p.image} as {p.image_id[7:19]} (serving_image's "
                               "output): rematerialize serving_image, then distribute")
        ckpt_units = core.units_of({k: v for k, v in expected.items() if k != checkpoint_core.MANIFEST_NAME},
                                   {checkpoint_core.MANIFEST_NAME: expected[checkpoint_core.MANIFEST_NAME]["size"]})
        for u in ckpt_units:
            self.files[u.name] = u.files
            for fn in u.files:
                self.unit_of[(0, fn)] = u.name
        self.sizes = {f"0/{k}": v for k, v in expected.items()}
        self.dirs[self.build.name] = {core.CHECKPOINT: p.src_dir.rstrip("/"),
                                      core.IMAGE: parts_dir(s, self.build, p.image_id)}
        for h in holding:
            self.dirs[h] = {core.CHECKPOINT: versions_core.version_path(layout.hybrid_dir(f, f.node(h)), p.manifest)}

        with ExitStack() as leases:
            ready = self._prepare(pending, manifest_text, expected, leases)
            if not ready:
                return self._end()
            pipe = core.Pipeline(self.build.name, ready, ckpt_units, fan_out=f.distribution.fan_out,
                                 max_attempts=f.distribution.max_attempts, holding=holding,
                                 have={h: [u.name for u in ckpt_units] for h in holding},
                                 wants={r: [u.name for u in ckpt_units] for r in ready},
                                 more_for=[r for r in ready if self.rx[r].wants_image])
            self.report.tree = dict(pipe.parent)
            self._open_links(pipe.parent)
            self.log.info("distribution tree (each node passes every unit on once it verified it): "
                          + "; ".join(core.tree_lines(pipe.parent)))
            total = sum(u.size for u in ckpt_units) * len(ready)
            self.progress = Progress("distribution", total, time.monotonic(), every_s=self.every_s)
            try:
                self._loop(pipe, ready)
            finally:
                self._stop_watchers(ready)
            self._finish(pipe, ready)
        return self._end()

    def _end(self) -> DistributionReport:
        r = self.report
        r.seconds = round(time.monotonic() - self.started, 2)
        prog = getattr(self, "progress", None)
        if prog is not None:
            self.log.info(prog.end(time.monotonic()))
            r.figures = prog.figures(time.monotonic(), "verified")
        if r.given_up:
            why = "; ".join(f"{n}: {r.why.get(n, '?')}" for n in r.given_up)
            failed = DistributionFailed(
                f"distribution: {', '.join(r.given_up)} have no verified copy after "
                f"{self.f.distribution.max_attempts} attempt(s) ({why}); the others "
                f"({', '.join(r.verified + r.already_holding) or 'none'}) do. Fix the named node and rerun: it resumes",
                details={"tree": "\n".join(f"- {ln}" for ln in r.lines())},
            )
            failed.report = r
            raise failed
        return r

    def _give_up(self, pipe: core.Pipeline | None, r: str, why: str) -> None:
        if r in self.report.given_up:
            return
        self.report.given_up.append(r)
        self.report.why[r] = why[:400]
        self.log.warning(f"distribution: {r} is given up: {why[:400]}")
        if pipe is not None:
            pipe.give_up(r)

    # -- before the first byte

    def _prepare(self, pending: list[str], manifest_text: str, expected: dict, leases: ExitStack) -> list[str]:
        """Each receiver's lease, its disk, where its copy lands, and its watcher; the receivers
        that are ready."""
        s, p = self.s, self.payload
        taken = []
        for r in pending:
            try:
                leases.enter_context(node_lease(s, r, f"distribution from {self.build.name}", run_id=self.run_id))
                taken.append(r)
            except (RunbookError, RemoteError) as e:
                self._give_up(None, r, first_line(e))
        image_bytes = NodeDocker(s).image_size(self.build.name, p.image) or 0

        def one(r: str) -> _Receiver:
            node = self.f.node(r)
            held = versions.read(s, node)
            serving = versions.serving_path(s, node)
            final = versions_core.version_path(serving, p.manifest or "")
            wants_image = NodeDocker(s).image_id(r, p.image) != p.image_id
            versions.require_space(s, node, manifest_text, p.manifest or "",
                                   f"the checkpoint version {versions_core.short(p.manifest)}"
                                   + (" and the image's parts" if wants_image else ""),
                                   extra_bytes=image_bytes if wants_image else 0)
            if held.holds(p.manifest):
                dest, link_dest = final, None  # checked and repaired where it lies
            else:
                dest = versions_core.incoming_path(serving, p.manifest or "")
                base = held.holds(held.serving) if held.serving else None
                link_dest = (f"{posixpath.dirname(serving)}/{base.name}" if base is not None
                             else serving if held.kind == "dir" else None)
            parts = parts_dir(s, node, p.image_id)
            s.run(r, ["mkdir", "-p", dest, *([parts] if wants_image else [])], log=False, timeout=_T)
            expect = s.expand(r, f"{layout.STATE_DIR}/distribution/expect-{secrets.token_hex(6)}.json")
            s.run(r, ["mkdir", "-p", posixpath.dirname(expect)], log=False, timeout=_T)
            rx = _Receiver(node, dest, final, link_dest, wants_image, parts, expect)
            self._write_expect(rx, {})
            return rx

        ready = []
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(taken) or 1)), thread_name_prefix="prepare") as pool:
            for r, fut in [(r, pool.submit(one, r)) for r in taken]:
                try:
                    self.rx[r] = fut.result()
                    self.dirs[r] = {core.CHECKPOINT: self.rx[r].dest, core.IMAGE: self.rx[r].parts}
                    ready.append(r)
                except (RunbookError, RemoteError, OSError, ValueError) as e:
                    self._give_up(None, r, first_line(e))
        for r in ready:
            threading.Thread(target=self._watch, args=(r,), name=f"arrivals-{r}", daemon=True).start()
        return ready

    def _open_links(self, parent: dict[str, str]) -> None:
        """Each tree edge's peer access and shared connection, before the first unit (a failure
        here is the first batch's to report)."""
        s = self.s

        def one(edge: tuple[str, str]) -> None:
            holder, receiver = edge
            try:
                route = self.streams.ensure_peer_access(holder, receiver)
                self.pairs.add(edge)
                s.run(holder, remote.open_shared_argv(route, route.control_path(s.expand(holder, "~/.ssh"))),
                      check=False, log=False, timeout=_T)
            except (RemoteError, OSError):
                pass

        edges = [(p, r) for r, p in parent.items()]
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(edges))), thread_name_prefix="links") as pool:
            list(pool.map(one, edges))

    def _write_expect(self, rx: _Receiver, parts: dict[str, dict]) -> None:
        files = [[0, k, v["size"], v["sha256"]] for k, v in
                 ((k.removeprefix("0/"), v) for k, v in self.sizes.items() if k.startswith("0/"))]
        files += [[1, k, v["size"], v["sha256"]] for k, v in parts.items()] if rx.wants_image else []
        tmp = f"{rx.expect}.tmp"
        self.s.put_text(rx.node.name, tmp, json.dumps({"dirs": [rx.dest, rx.parts], "files": files}))
        self.s.run(rx.node.name, ["mv", "-f", "--", tmp, rx.expect], log=False, timeout=_T)

    def _watch(self, r: str) -> None:
        rx = self.rx[r]

        def on_line(stream: str, line: str) -> bool:
            parts = line.split(" ", 3)
            if stream == "stdout" and len(parts) >= 3 and parts[0] in ("ok", "bad") and parts[1].isdigit():
                self.events.put((parts[0], r, int(parts[1]), parts[2]))
            return False

        try:
            self.s.run(r, ["python3", "-", rx.expect], stdin=Path(arrivals.__file__).read_text(), log=False,
                       timeout=WATCH_TIMEOUT_S, on_line=on_line)
            self.events.put(("watch-ended", r, ""))
        except Exception as e:  # the node went away: whatever it has not verified stays missing
            self.events.put(("watch-ended", r, first_line(e)))

    def _stop_watchers(self, ready: list[str]) -> None:
        def stop(r: str) -> None:
            try:
                self.s.run(r, ["touch", f"{self.rx[r].expect}.stop"], log=False, timeout=_T)
            except (RemoteError, OSError):
                pass

        with ThreadPoolExecutor(max_workers=max(1, min(8, len(ready))), thread_name_prefix="stop") as pool:
            list(pool.map(stop, ready))

    # -- the pipeline

    def _loop(self, pipe: core.Pipeline, ready: list[str]) -> None:
        pool = ThreadPoolExecutor(max_workers=len(ready) + 4, thread_name_prefix="distribution")
        deadlines: dict[tuple[str, str], float] = {}
        if any(self.rx[r].wants_image for r in ready):
            self.background += 1
            pool.submit(self._cut_image, pipe)
        try:
            while not pipe.done:
                started = pipe.next_batches()
                for b in started:
                    pool.submit(self._send, b)
                try:
                    ev = self.events.get(timeout=0.5)
                except queue.Empty:
                    ev = None
                if ev is not None:
                    self._handle(pipe, ev, deadlines, pool)
                now = time.monotonic()
                for (r, u), t in list(deadlines.items()):
                    if u not in pipe.pending[r]:
                        del deadlines[(r, u)]
                    elif now > t:
                        del deadlines[(r, u)]
                        self.log.warning(f"distribution: {u} landed on {r} but did not hash to the manifest in time")
                        pipe.unverified(r, [u])
                if ev is None and not started and not self.background and not pipe.in_flight:
                    for r in pipe.stuck():
                        self._give_up(pipe, r, "no verified holder could send it what it lacks "
                                               f"({', '.join(pipe.lacking(r)[:3])})")
                for r in list(self.rx):
                    if r in pipe.given_up and r not in self.report.given_up:
                        last = next((t.error for t in reversed(self.report.transfers) if t.receiver == r and t.error),
                                    "its transfers failed")
                        self._give_up(pipe, r, last)
                if self.progress.due(now):
                    self.log.info(self.progress.line(now) + f"; verified on {len(pipe.complete)} of {len(ready)}")
            while self.background:  # image loads still running
                self._handle(pipe, self.events.get(timeout=WATCH_TIMEOUT_S), deadlines, pool)
        finally:
            pool.shutdown(wait=True)

    def _handle(self, pipe: core.Pipeline, ev: tuple, deadlines: dict, pool: ThreadPoolExecutor) -> None:
        kind = ev[0]
        if kind in ("ok", "bad"):
            _, r, area_i, name = ev
            rx = self.rx[r]
            if kind == "bad":
                self.log.warning(f"distribution: {name} on {r} does not hash to the manifest; removed, sent again")
                unit = self.unit_of.get((area_i, name))
                busy = pipe.incoming.get(r)
                if unit in pipe.pending[r]:
                    pipe.unverified(r, [unit])
                elif busy is not None and unit in busy.units:
                    rx.bad.add(unit)  # judged when its batch ends
                return
            rx.ok_files.add((area_i, name))
            unit = self.unit_of.get((area_i, name))
            if unit is None or r in pipe.given_up:
                return
            if all((area_i, fn) in rx.ok_files for fn in self.files[unit]) and unit not in pipe.have[r]:
                pipe.verified(r, unit)
                self.progress.add(pipe.units[unit].size)
                if pipe.wants[r] <= pipe.have[r]:
                    self.report.done_at[r] = round(time.monotonic() - self.started, 2)
            if rx.wants_image and not rx.loading and pipe.holds_area(r, core.IMAGE):
                rx.loading = True
                self.background += 1
                pool.submit(self._load_image, r)
        elif kind == "ended":
            _, b, t = ev
            self.report.transfers.append(t)
            pipe.ended(b, t.ok)
            late_bad = [u for u in b.units if u in self.rx[b.receiver].bad and u in pipe.pending[b.receiver]]
            self.rx[b.receiver].bad -= set(b.units)
            if late_bad:
                pipe.unverified(b.receiver, late_bad)
            if t.ok:
                grace = 30 + sum(pipe.units[u].size for u in b.units) / HASH_BYTES_PER_S
                for u in b.units:
                    if u in pipe.pending[b.receiver]:
                        deadlines[(b.receiver, u)] = time.monotonic() + grace
            else:
                self.log.warning(f"distribution: {b.holder} -> {b.receiver} failed ({t.error[:300]}); "
                                 f"{b.receiver} takes the rest from another holder and serves nobody in this run")
        elif kind == "parts":
            self.background -= 1
            _, parts = ev
            wanting = [r for r in self.rx if self.rx[r].wants_image and r in pipe.wants]
            units = core.units_of({}, parts={k: v["size"] for k, v in parts.items()})
            for u in units:
                self.files[u.name] = u.files
                self.unit_of[(1, u.files[0])] = u.name
            for r in wanting:
                if not pipe.finished(r):
                    try:
                        self._write_expect(self.rx[r], parts)
                    except (RemoteError, OSError) as e:
                        self._give_up(pipe, r, f"could not tell it the image's parts: {first_line(e)}")
            pipe.add_units(units, self.build.name, [r for r in wanting if r not in pipe.given_up])
            self.progress.total += sum(u.size for u in units) * len(wanting)
            self.log.info(f"distribution: the image is cut into {len(units)} part(s) on {self.build.name}")
        elif kind == "parts-failed":
            self.background -= 1
            for r in [r for r in self.rx if self.rx[r].wants_image]:
                self._give_up(pipe, r, ev[1])
            pipe.more_for.clear()
        elif kind == "loaded":
            self.background -= 1
            _, r, error = ev
            if error:
                self._give_up(pipe, r, error)
            else:
                self.rx[r].image_ok = True
        elif kind == "watch-ended":
            _, r, error = ev
            if error and not pipe.finished(r):
                self._give_up(pipe, r, f"its arrivals check ended: {error}")

    def _send(self, b: core.Batch) -> None:
        s = self.s
        started = time.monotonic()
        files = [fn for u in b.units for fn in self.files[u]]
        try:
            route = self.streams.ensure_peer_access(b.holder, b.receiver)
            self.pairs.add((b.holder, b.receiver))
            area = b.area
            dst = self.dirs[b.receiver][area]
            argv = remote.rsync_files_argv(
                self.dirs[b.holder][area], route, dst,
                link_dest=self.rx[b.receiver].link_dest if area == core.CHECKPOINT else None,
                control_path=route.control_path(s.expand(b.holder, "~/.ssh")))
            r = s.run(b.holder, argv, stdin="".join(fn + "\0" for fn in files), timeout=remote.COPY_TIMEOUT_S,
                      check=False, log=False)
            if not r.ok:
                raise RemoteError(copy_failure(b.holder, b.receiver, dst, r.exit_status, r.stderr + r.tail))
            sent = remote.parse_rsync_stats(r.stdout).get("total_bytes_sent", 0)
            t = Transfer(b.holder, b.receiver, b.area, b.units, True, round(time.monotonic() - started, 2), sent)
        except (RemoteError, RunbookError, OSError, ValueError) as e:
            t = Transfer(b.holder, b.receiver, b.area, b.units, False, round(time.monotonic() - started, 2),
                         error=first_line(e))
        t.started = round(started - self.started, 2)
        self.events.put(("ended", b, t))

    def _cut_image(self, pipe: core.Pipeline) -> None:
        """The image as parts on the build host: `docker save | split`, each part hashed."""
        s, b, p = self.s, self.build.name, self.payload
        d = self.dirs[b][core.IMAGE]
        try:
            largest = max(v["size"] for v in self.sizes.values())
            size = core.image_part_bytes(largest)
            s.run(b, ["rm", "-rf", "--", d], log=False, timeout=_T)
            s.run(b, ["mkdir", "-p", d], log=False, timeout=_T)
            cut = (f"{remote.quote_argv(['docker', 'save', p.image])} | "
                   f"{remote.quote_argv(['split', '-b', str(size), '-d', '-a', '5', '-', f'{d}/part-'])}")
            s.run(b, ["bash", "-o", "pipefail", "-c", cut], log=False, timeout=remote.IMAGE_COPY_TIMEOUT_S)
            parts = digests_on_node(s, b, d)
            self.events.put(("parts", parts))
        except (RemoteError, OSError, ValueError) as e:
            self.events.put(("parts-failed", f"the build host could not cut {p.image} into parts: {first_line(e)}"))

    def _load_image(self, r: str) -> None:
        s, rx, p = self.s, self.rx[r], self.payload
        try:
            load = f"cat {remote.quote_argv([rx.parts])}/part-* | docker load"
            s.run(r, ["bash", "-o", "pipefail", "-c", load], log=False, timeout=remote.IMAGE_COPY_TIMEOUT_S)
            got = NodeDocker(s).image_id(r, p.image)
            error = "" if got == p.image_id else (
                f"loaded {p.image} as {(got or 'nothing')[7:19]}, but the build host built {p.image_id[7:19]}")
        except (RemoteError, OSError) as e:
            error = f"docker load of the verified parts failed: {first_line(e)}"
        self.events.put(("loaded", r, error))

    # -- after the last byte

    def _finish(self, pipe: core.Pipeline, ready: list[str]) -> None:
        """Each receiver that verified everything: checked as a whole, renamed to its version,
        its marker written. Then the parts and the shared connections go."""
        s, p = self.s, self.payload

        expected = {k.removeprefix("0/"): v["size"] for k, v in self.sizes.items() if k.startswith("0/")}

        def one(r: str) -> str:
            # Every file hashed to the manifest on arrival (the build host's own verified copy, its
            # index and headers included): what is left to see is a file the manifest does not name.
            rx = self.rx[r]
            found = remote.parse_file_sizes(s.run(r, remote.list_files_argv(rx.dest), log=False, timeout=_T).stdout)
            stale = remote.rsync_leftovers(found)
            if stale:  # a killed copy's temp files beside files now whole
                s.run(r, ["rm", "-f", "--", *(f"{rx.dest}/{x}" for x in stale)], log=False, timeout=_T)
            problems = remote.compare_trees(expected, {k: n for k, n in found.items() if k not in stale})
            if problems:
                return "the copy does not verify as a whole: " + "; ".join(problems[:3])
            if rx.dest != rx.final:
                s.run(r, ["mv", "-T", "--", rx.dest, rx.final], log=False, timeout=_T)
            if NodeDocker(s).image_id(r, p.image) != p.image_id:
                return f"{p.image} there is not {p.image_id[7:19]}"
            markers.write(s, rx.node, STEP, p.signature, manifest=p.manifest, source="distribution", path=rx.final)
            return ""

        whole = [r for r in ready if r in pipe.complete and r not in self.report.given_up]
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(whole) or 1)), thread_name_prefix="finish") as pool:
            for r, fut in [(r, pool.submit(one, r)) for r in whole]:
                try:
                    why = fut.result()
                except (RemoteError, RunbookError, OSError, ValueError) as e:
                    why = first_line(e)
                if why:
                    self._give_up(pipe, r, why)
                else:
                    self.report.verified.append(r)
        for r in ready:
            if r not in self.report.verified and r not in self.report.given_up:
                self._give_up(pipe, r, "its copy did not complete")
        self._clean_up(ready)

    def _clean_up(self, ready: list[str]) -> None:
        """The image's parts, the watchers' files and the shared connections go (best effort, at once)."""
        s = self.s
        leftovers: dict[str, list[str]] = {self.build.name: [self.dirs[self.build.name][core.IMAGE]]}
        for r in ready:
            rx = self.rx[r]
            leftovers.setdefault(r, []).extend([*([rx.parts] if rx.wants_image else []), rx.expect, f"{rx.expect}.stop"])

        def remove(node: str) -> None:
            try:
                s.run(node, ["rm", "-rf", "--", *leftovers[node]], log=False, timeout=_T * 4)
            except (RemoteError, OSError):
                pass

        def stop(pair: tuple[str, str]) -> None:
            try:
                route = self.streams.ensure_peer_access(*pair)
                s.run(pair[0], remote.stop_shared_argv(route, route.control_path(s.expand(pair[0], "~/.ssh"))),
                      check=False, log=False, timeout=_T)
            except (RemoteError, OSError):
                pass

        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="clean-up") as pool:
            list(pool.map(remove, list(leftovers)))
            list(pool.map(stop, list(self.pairs)))
