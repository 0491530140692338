"""Pipelined distribution of the checkpoint and the serving image (the runbook's step 4 copy, for N nodes).

core/distribution.py decides who sends which unit to whom; this runs it. Each tree edge is one
relay for the whole run (core/relay.py: `send` on the holder piped into `ssh receiver recv`,
resources/transfer.py PeerStream): a unit is queued into it as soon as the holder has it verified,
and the receiver hashes every file as it lands (sha256, compared here with the build host's
manifest), so a unit verified there is passed on to the receiver's children at once while the
rest of its own copy still arrives. Copies land in the receiver's `.<version>.incoming`
directory: what a killed run left there is hashed first and kept when it matches, and the files
its serving version holds alike (same sha256 in both manifests) are hard-linked there and never
sent. The image travels as parts of the build host's `docker save` stream, no larger than the
largest shard, in `<models>/.image-<id>.parts`; a receiver loads them (`cat | docker load`) once
all its parts verified and checks the image id. When nothing more moves, each receiver that
verified everything is checked as a whole (no file the manifest does not name), its incoming
directory renamed to the version, and it gets the `node_artifacts` step marker. Every receiver
holds its own lease for the whole distribution. A receiver that fails is retried from another
holder, never serves again in this run, and what verified there stays for the rerun.

Why node-to-node and not relayed through here: a relay through the orchestrator (`ssh A tar | ssh
B untar`) needs no trust between nodes, but every byte then crosses the orchestrator's own link
twice per copy, which is the uplink bottleneck moved, not removed. Here each holder uses its own
peer key (made on the holder, never copied anywhere), authorized on the receiver as `restrict`
(no forwarding, no agent, no pty) and, when the fleet names the holder by IP address, `from=` that
address; the receiver's host key comes from the orchestrator's verified known_hosts
(ensure_peer_access).
"""

from __future__ import annotations

import posixpath
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spark_pipelines.core import checkpoint as checkpoint_core
from spark_pipelines.core import distribution as core
from spark_pipelines.core import layout, relay, remote
from spark_pipelines.core import versions as versions_core
from spark_pipelines.core import steps
from spark_pipelines.core.artifacts import BuiltImage, Checkpoint
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.core.fleet import Node
from spark_pipelines.core.progress import Progress
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSession, RemoteError
from spark_pipelines.resources.transfer import NodeStreams, PeerStream, digests_on_node, hash_progress
from spark_pipelines.runbook import versions
from spark_pipelines.state import markers

STEP = "node_artifacts"  # the marker a verified receiver gets: node_artifacts then verifies and skips
_T = remote.PROBE_TIMEOUT_S
# One POSIX sh program: hard-link each (source, destination) pair given as arguments, once.
_LINK = 'while [ $# -gt 1 ]; do [ -e "$2" ] || { mkdir -p "$(dirname "$2")" && ln "$1" "$2"; } || exit 1; shift 2; done'
RELAY_TIMEOUT_S = remote.COPY_TIMEOUT_S + remote.IMAGE_COPY_TIMEOUT_S  # one relay carries a whole copy at most
SCRIPT = f"{layout.STATE_DIR}/distribution/relay.py"
CKPT, PARTS = 0, 1  # a relayed file's directory: the checkpoint version's, the image's parts


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


def holds_copy(session: FleetSession, node: Node, payload: Payload) -> bool:
    """The node's marker says it received this checkpoint verified, it holds that version, and the
    same image id.
    (node_artifacts re-hashes the content on its own run; a damaged holder's receivers fail their
    content check against the manifest, so damage does not spread as a pass.)"""
    try:
        return (markers.matches(session, node, STEP, payload.signature) is not None
                and versions.read(session, node).holds(payload.manifest) is not None
                and NodeDocker(session).image_id(node.name, payload.image) == payload.image_id)
    except RemoteError:
        return False


def copy_to(session: FleetSession, holder: Node, receiver: Node, payload: Payload, *, run_id: str = "",
            bwlimit_kib: int | None = None) -> tuple[int, bool]:
    """One whole copy, as node_artifacts makes it: checkpoint (one rsync, then every file hashed),
    image, checks, marker. Holds the receiver's lease. Returns (bytes rsync sent, whether the
    image was streamed)."""
    fleet = session.fleet
    streams = NodeStreams(session)
    # A holder serves its own version of the checkpoint (the build host's is what mtp_weights made).
    src_dir = (payload.src_dir if holder.name == fleet.build_node.name
               else versions_core.version_path(layout.hybrid_dir(fleet, holder), payload.manifest or ""))
    with node_lease(session, receiver.name, f"distribution from {holder.name}", run_id=run_id):
        got = versions.receive(session, streams, holder.name, receiver, src_dir, payload.manifest or "",
                               bwlimit_kib=bwlimit_kib)
        img = streams.copy_image(holder.name, receiver.name, payload.image)
        if img.image_id != payload.image_id:
            raise RunbookError(f"{receiver.name}: received image {img.image_id[:19]} from {holder.name}, but the "
                               f"build host built {payload.image_id[:19]}; rerun the distribution")
        markers.write(session, receiver, STEP, payload.signature, manifest=payload.manifest, source=holder.name,
                      path=got.path)
    return got.copy.bytes_sent, not img.skipped


def parts_dir(session: FleetSession, node: Node, image_id: str) -> str:
    """Where a node keeps the image's parts during a distribution (beside the checkpoint versions)."""
    return f"{layout.models_dir(session.fleet, node)}/.image-{image_id.removeprefix('sha256:')[:16]}.parts"


@dataclass
class _Receiver:
    node: Node
    dest: str  # the version's directory being written: `.<version>.incoming`, or the version itself
    final: str
    wants_image: bool
    parts: str
    linked: int = 0  # files hard-linked from its serving version (never sent)
    ok_files: set[tuple[int, str]] = field(default_factory=set)
    bad: set[str] = field(default_factory=set)  # units a file of which hashed wrong while their batch ran
    loading: bool = False


def distribute(session: FleetSession, receivers: list[Node], payload: Payload, *, log: Any = None, run_id: str = "",
               progress_every_s: float = 10.0) -> DistributionReport:
    """Bring payload from the build host to every receiver, pipelined down the tree; raise
    DistributionFailed naming the receivers left without a verified copy (after the others
    completed)."""
    return _Distribution(session, payload, log or session.log, run_id, progress_every_s).run(receivers)


class _Distribution:
    def __init__(self, session: FleetSession, payload: Payload, log: Any, run_id: str, every_s: float) -> None:
        self.s, self.payload, self.log, self.run_id, self.every_s = session, payload, log, run_id, every_s
        self.f = session.fleet
        self.build = self.f.build_node
        self.streams = NodeStreams(session)
        self.events: queue.Queue = queue.Queue()
        self.rx: dict[str, _Receiver] = {}
        self.dirs: dict[str, list[str]] = {}  # node -> [checkpoint dir, parts dir] it sends from / writes to
        self.files: dict[str, tuple[str, ...]] = {}  # unit -> files
        self.unit_of: dict[tuple[int, str], str] = {}  # (directory, file) -> unit
        self.expected: dict[tuple[int, str], dict] = {}  # (directory, file) -> {size, sha256}
        self.started = time.monotonic()
        self.report = DistributionReport(source=self.build.name)
        self.background = 0  # the image's cut and loads under way
        self.lock = threading.Lock()
        self.edges: dict[tuple[str, str], PeerStream] = {}
        self.opening: dict[tuple[str, str], threading.Lock] = {}
        # edge -> batches queued on it: [batch, files not landed yet, when queued]
        self.outstanding: dict[tuple[str, str], list[list]] = {}
        self.scripts: dict[str, str] = {}
        self.progress = Progress("distribution", 0, time.monotonic(), every_s=every_s)

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
        units = core.units_of({k: v for k, v in expected.items() if k != checkpoint_core.MANIFEST_NAME},
                              {checkpoint_core.MANIFEST_NAME: expected[checkpoint_core.MANIFEST_NAME]["size"]})
        self._know(units, CKPT, expected)
        self.dirs[self.build.name] = [p.src_dir.rstrip("/"), parts_dir(s, self.build, p.image_id)]
        for h in holding:
            held_at = versions_core.version_path(layout.hybrid_dir(f, f.node(h)), p.manifest)
            self.dirs[h] = [held_at, held_at]  # a holder serves its checkpoint; it holds no parts
        self._install([self.build.name, *holding, *pending])
        with ExitStack() as leases:
            ready = self._prepare(pending, manifest_text, expected, leases)
            if not ready:
                return self._end()
            names_of = [u.name for u in units]
            pipe = core.Pipeline(self.build.name, ready, units, fan_out=f.distribution.fan_out,
                                 max_attempts=f.distribution.max_attempts, holding=holding,
                                 have={h: names_of for h in holding}, wants={r: names_of for r in ready},
                                 more_for=[r for r in ready if self.rx[r].wants_image])
            self.report.tree = dict(pipe.parent)
            self.progress.total = sum(u.size for u in units) * len(ready)
            for r in ready:  # what a killed run left, hashed and found whole
                for u in units:
                    if all((CKPT, fn) in self.rx[r].ok_files for fn in u.files):
                        self._verified(pipe, r, u.name)
            self.log.info("distribution tree (each node passes every unit on once it verified it): "
                          + "; ".join(core.tree_lines(pipe.parent)))
            self._open_edges(pipe.parent)
            self._loop(pipe, ready)
            self._finish(pipe, ready)
        return self._end()

    def _know(self, units: list[core.Unit], area: int, files: dict[str, dict]) -> None:
        for u in units:
            self.files[u.name] = u.files
            for fn in u.files:
                self.unit_of[(area, fn)] = u.name
                self.expected[(area, fn)] = files[fn]

    def _end(self) -> DistributionReport:
        r = self.report
        r.seconds = round(time.monotonic() - self.started, 2)
        if self.progress.total:
            self.log.info(self.progress.end(time.monotonic()))
            r.figures = self.progress.figures(time.monotonic(), "verified")
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

    def _install(self, nodes: list[str]) -> None:
        """core/relay.py on every node of the distribution."""
        source = Path(relay.__file__).read_text()

        def one(n: str) -> None:
            path = self.s.expand(n, SCRIPT)
            self.s.run(n, ["mkdir", "-p", posixpath.dirname(path)], log=False, timeout=_T)
            self.s.put_text(n, path, source)
            self.scripts[n] = path

        with ThreadPoolExecutor(max_workers=max(1, min(8, len(nodes))), thread_name_prefix="install") as pool:
            list(pool.map(one, nodes))

    def _prepare(self, pending: list[str], manifest_text: str, expected: dict, leases: ExitStack) -> list[str]:
        """Each receiver's lease, its disk, where its copy lands (the files its serving version
        holds alike hard-linked there, what is there hashed); the receivers that are ready."""
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
            dest = final if held.holds(p.manifest) else versions_core.incoming_path(serving, p.manifest or "")
            parts = parts_dir(s, node, p.image_id)
            # A killed run's parts go (the build host cuts them again), its incoming files stay.
            s.run(r, ["sh", "-c", 'rm -rf -- "$1" && mkdir -p -- "$2" && if [ -n "$3" ]; then mkdir -p -- "$1"; fi',
                      "prepare", parts, dest, "1" if wants_image else ""], log=False, timeout=_T * 4)
            rx = _Receiver(node, dest, final, wants_image, parts)
            if dest != final:
                rx.linked = self._link_alike(node, held, expected, dest)
            if dest == final or rx.linked or posixpath.basename(dest) in held.incoming:  # something is there
                there = digests_on_node(s, r, dest, progress=hash_progress(r, dest))
                rx.ok_files = {(CKPT, fn) for fn, e in there.items()
                               if expected.get(fn, {}).get("sha256") == e["sha256"]}
            return rx

        ready = []
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(taken) or 1)), thread_name_prefix="prepare") as pool:
            for r, fut in [(r, pool.submit(one, r)) for r in taken]:
                try:
                    self.rx[r] = fut.result()
                    self.dirs[r] = [self.rx[r].dest, self.rx[r].parts]
                    ready.append(r)
                except (RunbookError, RemoteError, OSError, ValueError) as e:
                    self._give_up(None, r, first_line(e))
        return ready

    def _link_alike(self, node: Node, held: versions_core.NodeCheckpoints, expected: dict, dest: str) -> int:
        """The files the node's serving version holds with the same path and sha256, hard-linked
        into `dest`: a new version costs only the files that changed."""
        s = self.s
        base = held.holds(held.serving) if held.serving else None
        if base is None or not base.has_manifest:
            return 0
        src = f"{posixpath.dirname(held.serving_path)}/{base.name}"
        try:
            theirs = checkpoint_core.expected_tree(s.read_text(node.name, f"{src}/{checkpoint_core.MANIFEST_NAME}"))
        except (RemoteError, ValueError):
            return 0
        alike = [p for p, e in expected.items() if p != checkpoint_core.MANIFEST_NAME
                 and theirs.get(p, {}).get("sha256") == e["sha256"]]
        if alike:
            pairs = [x for p in alike for x in (f"{src}/{p}", f"{dest}/{p}")]
            s.run(node.name, ["sh", "-c", _LINK, "link-alike", *pairs], log=False, timeout=_T * 4)
        return len(alike)

    def _open_edges(self, parent: dict[str, str]) -> None:
        """Each tree edge's relay, before the first unit: its handshake is on no unit's way (a
        failure here is the first batch's to report)."""
        edges = [(p, r) for r, p in parent.items()]

        def one(edge: tuple[str, str]) -> None:
            try:
                self._stream(*edge)
            except (RemoteError, RunbookError, OSError):
                pass

        with ThreadPoolExecutor(max_workers=max(1, min(8, len(edges))), thread_name_prefix="edges") as pool:
            list(pool.map(one, edges))

    def _stream(self, holder: str, receiver: str) -> PeerStream:
        """The relay of the edge, opened at its first use."""
        edge = (holder, receiver)
        with self.lock:
            gate = self.opening.setdefault(edge, threading.Lock())
        with gate:
            with self.lock:
                if edge in self.edges:
                    return self.edges[edge]
            route = self.streams.ensure_peer_access(holder, receiver)
            st = PeerStream(self.s, holder, receiver, route, (self.scripts[holder], self.scripts[receiver]),
                            self.dirs[holder], self.dirs[receiver],
                            on_got=lambda i, path, sha: self.events.put(("got", holder, receiver, i, path, sha)),
                            on_end=lambda error: self.events.put(("edge-ended", holder, receiver, error)),
                            timeout_s=RELAY_TIMEOUT_S)
            with self.lock:
                self.edges[edge] = st
            return st

    # -- the pipeline

    def _loop(self, pipe: core.Pipeline, ready: list[str]) -> None:
        pool = ThreadPoolExecutor(max_workers=len(ready) + 4, thread_name_prefix="distribution")
        if any(self.rx[r].wants_image for r in ready):
            self.background += 1
            pool.submit(self._cut_image)
        try:
            while not pipe.done:
                started = pipe.next_batches()
                for b in started:
                    pool.submit(self._queue, b)
                try:
                    ev = self.events.get(timeout=0.5)
                except queue.Empty:
                    ev = None
                if ev is not None:
                    self._handle(pipe, ev, pool)
                if ev is None and not started and not self.background and not pipe.in_flight:
                    for r in pipe.stuck():
                        self._give_up(pipe, r, "no verified holder could send it what it lacks "
                                               f"({', '.join(pipe.lacking(r)[:3])})")
                for r in [r for r in pipe.given_up if r not in self.report.given_up]:
                    last = next((t.error for t in reversed(self.report.transfers) if t.receiver == r and t.error),
                                "its transfers failed")
                    self._give_up(pipe, r, last)
                now = time.monotonic()
                if self.progress.due(now):
                    self.log.info(self.progress.line(now) + f"; verified on {len(pipe.complete)} of {len(ready)}")
            while self.background:  # image loads still running
                self._handle(pipe, self.events.get(timeout=RELAY_TIMEOUT_S), pool)
        finally:
            pool.shutdown(wait=True)
            self._close_edges()

    def _handle(self, pipe: core.Pipeline, ev: tuple, pool: ThreadPoolExecutor) -> None:
        kind = ev[0]
        if kind == "got":
            self._got(pipe, ev, pool)
        elif kind == "edge-ended":
            self._edge_ended(pipe, ev)
        elif kind == "parts":
            self.background -= 1
            parts = ev[1]
            wanting = [r for r in self.rx if self.rx[r].wants_image and not pipe.finished(r)]
            units = core.units_of({}, parts={k: v["size"] for k, v in parts.items()})
            self._know(units, PARTS, parts)
            pipe.add_units(units, self.build.name, wanting)
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

    def _verified(self, pipe: core.Pipeline, r: str, unit: str) -> None:
        pipe.verified(r, unit)
        self.progress.add(pipe.units[unit].size)
        if pipe.wants[r] <= pipe.have[r] and r not in self.report.done_at:
            self.report.done_at[r] = round(time.monotonic() - self.started, 2)

    def _got(self, pipe: core.Pipeline, ev: tuple, pool: ThreadPoolExecutor) -> None:
        """A file landed whole on a receiver: judged against the manifest, its unit verified when
        all its files are, its batch over when all the batch's files landed."""
        _, holder, r, i, path, sha = ev
        rx = self.rx[r]
        unit = self.unit_of.get((i, path))
        done = None
        with self.lock:
            queued = self.outstanding.get((holder, r), [])
            for entry in queued:
                if (i, path) in entry[1]:
                    entry[1].discard((i, path))
                    if not entry[1]:
                        queued.remove(entry)
                        done = entry
                    break
        if unit is not None and r not in pipe.given_up:
            if self.expected[(i, path)]["sha256"] == sha:
                rx.ok_files.add((i, path))
                if all((i, fn) in rx.ok_files for fn in self.files[unit]) and unit not in pipe.have[r]:
                    self._verified(pipe, r, unit)
            else:
                rx.ok_files.discard((i, path))
                rx.bad.add(unit)
                self.log.warning(f"distribution: {path} landed on {r} from {holder} but does not hash to the "
                                 f"manifest (sha256 {sha[:12]}); sent again")
            if rx.wants_image and not rx.loading and pipe.holds_area(r, core.IMAGE):
                rx.loading = True
                self.background += 1
                pool.submit(self._load_image, r)
        if done is not None:
            b, _, since = done
            size = sum(pipe.units[u].size for u in b.units)
            self._ended(pipe, b, Transfer(holder, r, b.area, b.units, True, round(time.monotonic() - since, 2),
                                          size, started=round(since - self.started, 2)))

    def _ended(self, pipe: core.Pipeline, b: core.Batch, t: Transfer) -> None:
        self.report.transfers.append(t)
        pipe.ended(b, t.ok)
        rx = self.rx[b.receiver]
        wrong = [u for u in b.units if u in rx.bad and u not in pipe.have[b.receiver]]
        rx.bad -= set(b.units)
        if t.ok and wrong:  # landed whole, hashed wrong: wanted again, and a failure of the receiver
            pipe.unverified(b.receiver, wrong)
        if not t.ok:
            self.log.warning(f"distribution: {b.holder} -> {b.receiver} failed ({t.error[:300]}); "
                             f"{b.receiver} takes the rest from another holder and serves nobody in this run")

    def _queue(self, b: core.Batch) -> None:
        """Put the batch's files into its edge's relay (opened at its first use)."""
        area = CKPT if b.area == core.CHECKPOINT else PARTS
        files = [(area, fn) for u in b.units for fn in self.files[u]]
        with self.lock:
            self.outstanding.setdefault((b.holder, b.receiver), []).append([b, set(files), time.monotonic()])
        try:
            st = self._stream(b.holder, b.receiver)
            for i, fn in files:
                st.send(i, fn)
        except Exception as e:  # noqa: BLE001 - the edge failed: every batch on it fails with it
            self.events.put(("edge-ended", b.holder, b.receiver, f"copy {b.holder} -> {b.receiver} failed: "
                                                                  f"{first_line(e)}"))

    def _edge_ended(self, pipe: core.Pipeline, ev: tuple) -> None:
        _, holder, receiver, error = ev
        with self.lock:
            st = self.edges.pop((holder, receiver), None)
            failed = self.outstanding.pop((holder, receiver), [])
        if st is not None and error:
            st.close()
        for b, _, since in failed:
            self._ended(pipe, b, Transfer(holder, receiver, b.area, b.units, False,
                                          round(time.monotonic() - since, 2), error=error or "the relay ended",
                                          started=round(since - self.started, 2)))

    def _close_edges(self) -> None:
        """Every relay told there is no more; each ends once its last file is through (bounded)."""
        with self.lock:
            edges = list(self.edges.values())
        for st in edges:
            try:
                st.close()
            except Exception:  # noqa: BLE001 - already gone
                pass
        end = time.monotonic() + 30
        while time.monotonic() < end:
            with self.lock:
                if not self.edges:
                    return
            try:
                ev = self.events.get(timeout=0.5)
            except queue.Empty:
                continue
            if ev[0] == "edge-ended":
                with self.lock:
                    self.edges.pop((ev[1], ev[2]), None)

    def _cut_image(self) -> None:
        """The image as parts on the build host: `docker save | split`, each part hashed."""
        s, b, p = self.s, self.build.name, self.payload
        d = self.dirs[b][PARTS]
        try:
            size = core.image_part_bytes(max(int(v["size"]) for v in self.expected.values()))
            s.run(b, ["rm", "-rf", "--", d], log=False, timeout=_T * 4)
            s.run(b, ["mkdir", "-p", d], log=False, timeout=_T)
            cut = (f"{remote.quote_argv(['docker', 'save', p.image])} | "
                   f"{remote.quote_argv(['split', '-b', str(size), '-d', '-a', '5', '-', f'{d}/part-'])}")
            s.run(b, ["bash", "-o", "pipefail", "-c", cut], log=False, timeout=remote.IMAGE_COPY_TIMEOUT_S)
            self.events.put(("parts", digests_on_node(s, b, d)))
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
        its marker written. Then the parts go."""
        s, p = self.s, self.payload
        expected = {fn: e["size"] for (i, fn), e in self.expected.items() if i == CKPT}

        def one(r: str) -> str:
            # Every file hashed to the manifest as it landed (the build host's own verified copy, its
            # index and headers included): what is left to see is a file the manifest does not name.
            rx = self.rx[r]
            found = remote.parse_file_sizes(s.run(r, remote.list_files_argv(rx.dest), log=False, timeout=_T).stdout)
            stale = [x for x in found if x.endswith(relay.RELAY_SUFFIX) or x in remote.rsync_leftovers(found)]
            if stale:  # a killed copy's temp files
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
        """The image's parts go (best effort, every node at once)."""
        gone = {self.build.name: self.dirs[self.build.name][PARTS],
                **{r: self.rx[r].parts for r in ready if self.rx[r].wants_image}}

        def remove(node: str) -> None:
            try:
                self.s.run(node, ["rm", "-rf", "--", gone[node]], log=False, timeout=_T * 4)
            except (RemoteError, OSError):
                pass

        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="clean-up") as pool:
            list(pool.map(remove, list(gone)))


def distribution_payload(cv: dict[str, str], mtp_weights: Checkpoint, serving_image: BuiltImage) -> Payload:
    """What the tree fans out: the build host's checkpoint and image, and the node_artifacts
    marker signature a verified receiver gets (artifact_distribution and a rollout)."""
    return Payload(src_dir=mtp_weights.path, image=serving_image.ref, image_id=serving_image.image_id,
                   manifest=mtp_weights.manifest,
                   signature=markers.signature(cv[steps.NODE_ARTIFACTS], mtp_weights.index, mtp_weights.manifest))
