"""Checkpoint versions on a node (core/versions.py for the layout and why): read them, make a
plain directory a version, point the runbook's path at a version and back, check the disk before
a copy, and remove the versions nothing needs.

Every change here is a rename or a symlink swap in the models directory (never a byte of a
checkpoint rewritten): the link is replaced by renaming a new link over it, so at every instant the
runbook's path names a whole version. The caller holds the node's lease.
"""

from __future__ import annotations

import posixpath
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import checkpoint as checkpoint_core
from spark_pipelines.core import layout, remote
from spark_pipelines.core import versions as core
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.core.fleet import Node
from spark_pipelines.core.launch import CHECKPOINT_VERSION_LABEL
from spark_pipelines.resources.ssh import FleetSession, RemoteError
from spark_pipelines.resources.transfer import checkpoint_script
from spark_pipelines.state import markers

_T = remote.PROBE_TIMEOUT_S
RM_TIMEOUT_S = 900  # removing a ~71 GB version on a busy disk


def serving_path(session: FleetSession, node: Node) -> str:
    return layout.hybrid_dir(session.fleet, node)


def read(session: FleetSession, node: Node) -> core.NodeCheckpoints:
    """The node's versions, its runbook path and free space, in one SSH call."""
    path = serving_path(session, node)
    r = session.run(node.name, core.probe_argv(path, checkpoint_core.MANIFEST_NAME), log=False, timeout=_T)
    return core.parse_probe(path, r.stdout)


def _manifest_digest(session: FleetSession, node: Node, directory: str) -> str | None:
    """The digest of the manifest file in `directory` (None: none there, or unreadable). Names a
    plain directory's version; its content is judged by whoever verifies it (node_artifacts)."""
    path = f"{directory}/{checkpoint_core.MANIFEST_NAME}"
    try:
        if not session.exists(node.name, path):
            return None
        return checkpoint_core.manifest_digest(checkpoint_core.parse_manifest(session.read_text(node.name, path)))
    except (RemoteError, ValueError):
        return None


def serving_digest(session: FleetSession, node: Node) -> str | None:
    """The manifest digest of what the runbook's path serves on the node (a version or a plain
    directory; None: no manifest there)."""
    return _manifest_digest(session, node, serving_path(session, node))


def make_version(session: FleetSession, node: Node, digest: str | None = None) -> str | None:
    """The runbook's plain directory becomes a version beside it, and the path a link to it: one
    rename and one symlink, nothing copied; a running container keeps its open files, and one that
    mounts the whole models directory finds the same files through the link. `digest`: what the
    content was verified to be (else the manifest file's, else 'unkeyed'). Returns the version's
    name (None: nothing to do, the path is no plain directory). Both happen in one process on the
    node (core/checkpoint.py make_version), undone there if the link fails."""
    path = serving_path(session, node)
    held = read(session, node)
    if held.kind != "dir":
        return None
    digest = digest or _manifest_digest(session, node, path)
    name = core.version_name(held.model_dir, digest or f"{core.UNKEYED}-{int(time.time())}")
    if held.holds(core.digest_of(held.model_dir, name)):
        # A version of that name exists already (a copy landed beside the hand directory): the
        # hand one gets a name of its own, and the link points at it: what serves stays the same.
        name = core.version_name(held.model_dir, f"{core.UNKEYED}-{int(time.time())}")
    checkpoint_script(session, node.name, [path, "--make-version", name], _T)
    session.log.info(f"[{node.name}] {path} is now the checkpoint version {name} (renamed, nothing copied) and the "
               "path a link to it")
    return name


def _link(session: FleetSession, node: Node, path: str, name: str) -> None:
    """Point `path` at the version `name` beside it: a new relative link renamed over the old one
    (rename(2) replaces it atomically; the link is the user's, the version's files untouched)."""
    tmp = f"{posixpath.dirname(path)}/.{posixpath.basename(path)}.link-{secrets.token_hex(4)}"
    session.run(node.name, ["ln", "-sfn", "--", name, tmp], log=False, timeout=_T)
    try:
        session.run(node.name, ["mv", "-Tf", "--", tmp, path], log=False, timeout=_T)
    except BaseException:
        session.run(node.name, ["rm", "-f", "--", tmp], check=False, log=False, timeout=_T)
        raise


@dataclass
class Pointed:
    """What `point` changed, for its undo: the version the path named before (None: nothing
    there), and a plain directory it made a version on the way."""

    node: str
    before: str | None
    after: str
    made: str | None = None


def point(session: FleetSession, node: Node, name: str, noted: Any = None) -> Pointed:
    """Point the runbook's path at the version `name` (which must be there, complete); a plain
    directory found there first becomes a version (make_version). `noted(before, after)` is
    called before the link moves (the deploy's journal). Raises RunbookError naming what is wrong."""
    path = serving_path(session, node)
    held = read(session, node)
    if not any(v.name == name for v in held.versions):
        raise RunbookError(f"{node.name}: no checkpoint version {name} beside {path}; run node_artifacts for "
                           f"{node.name} (it copies and verifies it) before the deploy")
    made = make_version(session, node) if held.kind == "dir" else None
    if held.kind == "other":
        raise RunbookError(f"{node.name}: {path} is neither a directory nor a link; move it away, then deploy again")
    before = made or (held.target if held.kind == "link" else None)
    if noted is not None:
        noted(before, name)
    if before != name:
        _link(session, node, path, name)
        session.log.info(f"[{node.name}] checkpoint: {path} -> {name}" + (f" (was {before})" if before else ""))
    return Pointed(node.name, before, name, made)


def point_back(session: FleetSession, node: Node, before: str | None, log: Any = None) -> str:
    """Undo `point`: the path names `before` again (or no link when there was nothing). Returns
    what an operator reads."""
    path = serving_path(session, node)
    if before is None:
        held = read(session, node)
        if held.kind == "link":
            session.run(node.name, ["rm", "-f", "--", path], log=False, timeout=_T)
        return "checkpoint link removed (there was none before)"
    held = read(session, node)
    if held.kind == "link" and held.target == before:
        return f"checkpoint {before} (already)"
    if held.kind not in ("link", "absent"):
        raise RunbookError(f"{node.name}: {path} is no longer a link ({held.kind}); point it at {before} by hand: "
                           f"`ln -sfn {before} {path}`")
    _link(session, node, path, before)
    (log or session.log).info(f"[{node.name}] checkpoint put back: {path} -> {before}")
    return f"checkpoint put back: {before}"


# ------------------------------------------------------------------------------ copies


@dataclass
class Received:
    """A version that landed on a node (`copy` None: it held it already, verified)."""

    path: str
    copy: Any = None  # resources.transfer.TreeCopyReport
    linked_from: str | None = None


def receive(session: FleetSession, streams: Any, holder: str, node: Node, src_dir: str, digest: str, *,
            bwlimit_kib: int | None = None) -> Received:
    """Copy the version `digest` from `holder`'s `src_dir` to `node` as a version of its own:
    after the disk check, into `.<name>.incoming` (a killed copy resumes there, and nothing ever
    mounts it), the files the node's serving version holds alike hard-linked, every file hashed
    against the manifest, then renamed into place. A version the node holds already is verified
    and repaired where it lies (rsync replaces a damaged file by a new one: a container reading the
    old inode keeps it). `streams`: resources.transfer.NodeStreams of the session."""
    serving = serving_path(session, node)
    final = core.version_path(serving, digest)
    held = read(session, node)
    if held.holds(digest):
        copy = streams.copy_tree(holder, node.name, src_dir, final, manifest=digest, bwlimit_kib=bwlimit_kib)
        return Received(final, copy)
    manifest_text = session.read_text(holder, f"{src_dir}/{checkpoint_core.MANIFEST_NAME}")
    require_space(session, node, manifest_text, digest, f"the checkpoint version {core.short(digest)}")
    parent = posixpath.dirname(serving)
    base = held.holds(held.serving) if held.serving else None
    link_dest = (f"{parent}/{base.name}" if base is not None
                 else serving if held.kind == "dir" else None)  # the runbook's plain directory
    incoming = core.incoming_path(serving, digest)
    copy = streams.copy_tree(holder, node.name, src_dir, incoming, manifest=digest, bwlimit_kib=bwlimit_kib,
                             link_dest=link_dest)
    session.run(node.name, ["mv", "-T", "--", incoming, final], log=False, timeout=_T)
    return Received(final, copy, link_dest)


# ------------------------------------------------------------------------------ last known good


def mark_known_good(session: FleetSession, node: Node, container: dict[str, Any] | None, *, run_id: str = "") -> None:
    """The bench promoted the node: what it runs (image, checkpoint version, JIT key) is its last
    known good, which garbage collection keeps and an operator can go back to. A failure to write
    it is a warning: the promotion stands."""
    if not container:
        return
    marker = markers.read_deploy(session, node)
    labels = dict((container.get("Config") or {}).get("Labels") or {})
    if marker is not None and marker.adopted and marker.container_id == container.get("Id"):
        labels = {**marker.labels, **labels}
    good = markers.KnownGood(image_id=str(container.get("Image") or "") or None,
                             checkpoint=labels.get(CHECKPOINT_VERSION_LABEL),
                             jit_key=str((marker.metadata if marker else {}).get("jit_cache_key") or "") or None,
                             since=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), run_id=run_id)
    try:
        markers.write_typed(session, node, markers.KNOWN_GOOD, good)
    except RemoteError as e:
        session.log.warning(f"[{node.name}] promoted, but its last known good was not recorded ({first_line(e)})")


# ------------------------------------------------------------------------------ disk


def require_space(session: FleetSession, node: Node, manifest_text: str, digest: str, what: str,
                  extra_bytes: int = 0) -> core.SpaceVerdict:
    """Before a copy of version `digest` to the node: the bytes it writes (files its serving
    version holds alike are hard-linked, not written; `extra_bytes` beside it: the image's parts
    of a distribution) against the free space under the models directory. Raises RunbookError
    with both numbers and what to remove; nothing changed."""
    held = read(session, node)
    if held.holds(digest):
        verdict = core.space_for(extra_bytes, held.free_kib)
        if not verdict.ok:
            raise RunbookError(verdict.words(node.name, posixpath.dirname(held.serving_path), what))
        return verdict
    files = checkpoint_core.parse_manifest(manifest_text)["files"]
    linkable = None
    serving = held.holds(held.serving) if held.serving else None
    if serving is not None and serving.has_manifest:
        try:
            text = session.read_text(node.name, f"{posixpath.dirname(held.serving_path)}/{serving.name}/"
                                          f"{checkpoint_core.MANIFEST_NAME}")
            linkable = checkpoint_core.parse_manifest(text)["files"]
        except (RemoteError, ValueError):
            linkable = None
    verdict = core.space_for(core.bytes_to_write(files, linkable) + extra_bytes, held.free_kib)
    if not verdict.ok:
        raise RunbookError(verdict.words(node.name, posixpath.dirname(held.serving_path), what),
                           {"versions": "\n".join(f"- {ln}" for ln in core.describe(held)) or "none"})
    return verdict


# ------------------------------------------------------------------------------ garbage collection


def protected(session: FleetSession, node: Node, held: core.NodeCheckpoints) -> core.Protected:
    """Why versions must stay: what a rollout point or a deploy journal names (a revert or a dead
    run's rollback puts it back), and the node's last known good."""
    keep = core.Protected()
    point = markers.read_typed(session, node, markers.ROLLOUT_POINT, markers.RolloutPoint)
    if point is not None:
        keep.add(core.digest_of(held.model_dir, point.checkpoint_link or ""), "a rollout's revert puts it back")
        keep.add(core.digest_of(held.model_dir, point.checkpoint_now or ""), "a rollout deployed it")
    journal = markers.read_journal(session, node)
    if journal is not None:
        keep.add(core.digest_of(held.model_dir, journal.checkpoint_before or ""), "a deploy in flight may put it back")
        keep.add(core.digest_of(held.model_dir, journal.checkpoint_after or ""), "a deploy in flight launches it")
    built = markers.read(session, node, "mtp_weights")  # the build host's newest build: what copies start from
    if built and built.get("path"):
        keep.add(core.digest_of(held.model_dir, str(built["path"])), "mtp_weights' output (the copies' source)")
    copied = markers.read(session, node, "node_artifacts")  # verified on the node: what its next deploy launches
    if copied and copied.get("manifest"):
        keep.add(str(copied["manifest"]), "node_artifacts verified it for the next deploy")
    good = markers.read_known_good(session, node)
    if good is not None:
        keep.add(good.checkpoint, f"last known good (bench of {good.since or 'unknown date'})")
    return keep


@dataclass
class GcReport:
    node: str
    plan: core.GcPlan
    removed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    check: bool = True

    def lines(self) -> list[str]:
        out = [f"{self.node}: {ln}" for ln in self.plan.lines()]
        if not self.check:
            out += [f"{self.node}: removed {n}" for n in self.removed]
            out += [f"{self.node}: NOT removed {f}" for f in self.failed]
        return out


def collect(session: FleetSession, node: Node, *, keep: int, check: bool) -> GcReport:
    """Remove the versions nothing needs (core.versions.gc_plan); `check`: only say which. The
    protection is read under the node's lease (the caller's), so no deploy moves it meanwhile."""
    held = read(session, node)
    plan = core.gc_plan(held, protected(session, node, held), keep)
    report = GcReport(node.name, plan, check=check)
    if check:
        return report
    parent = posixpath.dirname(held.serving_path)
    for name, _ in plan.remove:
        try:
            session.run(node.name, ["rm", "-rf", "--", f"{parent}/{name}"], timeout=RM_TIMEOUT_S)
            report.removed.append(name)
        except RemoteError as e:
            report.failed.append(f"{name}: {first_line(e)}")
    return report
