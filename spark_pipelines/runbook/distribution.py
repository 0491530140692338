"""Fan-out distribution of the checkpoint and the serving image (the runbook's step 4 copy, for N nodes).

Round by round (core/distribution.py plans each one from who holds a verified copy now), every
copy of a round runs at once: the holder pushes with rsync --partial and `docker save | docker
load` straight to the receiver (resources/transfer.py), the receiver is verified by content
against the build host's manifest (sizes, index, shard headers, every file's sha256; the manifest
travels with the checkpoint and must have the digest recorded when the build host made it) and
by image id, and only then gets the `node_artifacts` step marker and becomes a holder. A receiver
that fails is retried from another holder after the others were served, and never serves; its
partial files stay for the next attempt or run to resume.

Why node-to-node and not relayed: a relay (`ssh A tar | ssh B untar` from the orchestrator) needs
no trust between nodes, but every byte then crosses the orchestrator's own link twice per copy,
which is the uplink bottleneck moved, not removed. Here each holder uses its own peer key (made
on the holder, never copied anywhere), authorized on the receiver as `restrict` (no forwarding,
no agent, no pty) and, when the fleet names the holder by IP address, `from=` that address; the
receiver's host key comes from the orchestrator's verified known_hosts (ensure_peer_access).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import distribution as plan_core
from spark_pipelines.core import layout
from spark_pipelines.core import versions as versions_core
from spark_pipelines.core.fleet import Node
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSession, RemoteError
from spark_pipelines.resources.transfer import NodeStreams
from spark_pipelines.runbook import versions
from spark_pipelines.state import markers
from spark_pipelines.core.errors import RunbookError

STEP = "node_artifacts"  # the marker a verified receiver gets: node_artifacts then verifies and skips


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
class CopyOutcome:
    holder: str
    receiver: str
    round: int
    ok: bool
    seconds: float
    bytes_sent: int = 0
    image_copied: bool = False
    error: str = ""


@dataclass
class DistributionReport:
    source: str
    rounds: list[list[CopyOutcome]] = field(default_factory=list)
    already_holding: list[str] = field(default_factory=list)
    given_up: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def verified(self) -> list[str]:
        return [o.receiver for r in self.rounds for o in r if o.ok]

    def lines(self) -> list[str]:
        out = [f"already holding: {', '.join(self.already_holding)}"] if self.already_holding else []
        for i, r in enumerate(self.rounds, 1):
            out.append(f"round {i}: " + ", ".join(
                f"{o.holder} -> {o.receiver} {'ok' if o.ok else 'FAILED'} {o.seconds:.1f}s" for o in r))
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
    """One copy of the tree: checkpoint, image, checks, marker. Holds the receiver's lease.
    Returns (bytes rsync sent, whether the image was streamed)."""
    f = s.fleet
    build = f.build_node
    streams = NodeStreams(s)
    # A holder serves its own version of the checkpoint (the build host's is what mtp_weights made).
    src_dir = (payload.src_dir if holder.name == build.name
               else versions_core.version_path(layout.hybrid_dir(f, holder), payload.manifest or ""))
    with node_lease(s, receiver.name, f"distribution from {holder.name}", run_id=run_id):
        got = versions.receive(s, streams, holder.name, receiver, src_dir, payload.manifest or "",
                               bwlimit_kib=bwlimit_kib)
        tree = got.copy
        img = streams.copy_image(holder.name, receiver.name, payload.image)
        if img.image_id != payload.image_id:
            raise RunbookError(f"{receiver.name}: received image {img.image_id[:19]} from {holder.name}, but the "
                               f"build host built {payload.image_id[:19]}; rerun the distribution")
        markers.write(s, receiver, STEP, payload.signature, manifest=payload.manifest, source=holder.name,
                      path=got.path)
    return tree.bytes_sent, not img.skipped


def distribute(s: FleetSession, receivers: list[Node], payload: Payload, *, log: Any = None, run_id: str = "",
               copy: Callable[[FleetSession, Node, Node, Payload], tuple[int, bool]] | None = None,
               bwlimit_kib: int | None = None) -> DistributionReport:
    """Bring payload from the build host to every receiver along the tree; raise DistributionFailed
    naming the receivers left without a verified copy (after the others completed)."""
    f = s.fleet
    log = log or s.log
    build = f.build_node
    settings = f.distribution
    started = time.monotonic()
    names = [n.name for n in receivers if n.name != build.name]
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(names) or 1)), thread_name_prefix="holds") as pool:
        holding = [n for n, ok in zip(names, pool.map(lambda n: holds_copy(s, f.node(n), payload), names)) if ok]
    state = plan_core.start(build.name, names, holding)
    report = DistributionReport(source=build.name, already_holding=holding)
    if holding:
        log.info(f"distribution: {', '.join(holding)} already hold a verified copy and serve from round 1")
    do_copy = copy or (lambda s_, h, r, p: copy_to(s_, h, r, p, run_id=run_id, bwlimit_kib=bwlimit_kib))

    def one(c: plan_core.Copy, number: int) -> CopyOutcome:
        t0 = time.monotonic()
        try:
            sent, image_copied = do_copy(s, f.node(c.holder), f.node(c.receiver), payload)
            return CopyOutcome(c.holder, c.receiver, number, True, round(time.monotonic() - t0, 2), sent, image_copied)
        except (RunbookError, RemoteError, OSError) as e:
            return CopyOutcome(c.holder, c.receiver, number, False, round(time.monotonic() - t0, 2), error=str(e))

    while not state.done:
        rnd = plan_core.next_round(state, settings.fan_out)
        log.info(f"distribution {plan_core.describe([rnd])[0]}")
        with ThreadPoolExecutor(max_workers=len(rnd.copies), thread_name_prefix="distribution") as pool:
            outcomes = list(pool.map(lambda c: one(c, rnd.number), rnd.copies))
        for o in outcomes:
            if not o.ok:
                log.warning(f"distribution round {rnd.number}: {o.receiver} did not receive a verified copy from "
                            f"{o.holder}: {o.error}")
        report.rounds.append(outcomes)
        state = plan_core.after(state, rnd, {o.receiver: o.ok for o in outcomes}, settings.max_attempts)
    report.given_up = list(state.given_up)
    report.seconds = round(time.monotonic() - started, 2)
    if report.given_up:
        last = {o.receiver: o.error for r in report.rounds for o in r if not o.ok}
        failed = DistributionFailed(
            f"distribution: {', '.join(report.given_up)} have no verified copy after {settings.max_attempts} "
            f"attempt(s) ({'; '.join(f'{n}: {last[n]}' for n in report.given_up)}); the others "
            f"({', '.join(report.verified + holding) or 'none'}) do. Fix the named node and rerun: it resumes",
            details={"rounds": "\n".join(f"- {ln}" for ln in report.lines())},
        )
        failed.report = report
        raise failed
    return report
