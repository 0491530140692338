"""Build-host steps shared by the model and image phases: checkouts at a pin, checkpoint
verification on the node, the content check against the manifest, and the staging directory a
rebuild is made in beside the serving checkpoint, then switched into place.

Why beside: the build host is also a serve node, and its containers mount a checkpoint version.
A rebuild written into it would leave it without shards or without MTP keys for as long as the
build runs (~20 min on a GB10), and a failed one would leave it broken. So the steps write
`~/models/.<model_dir>.staging` (same filesystem), verify it there, and only then rename it to the
version its manifest names (core/versions.py); a deploy points the runbook's path at it. (Before
versions, the staging directory was switched over the serving one and the replaced one kept as
`.<model_dir>.previous`: `recover_switch` still finishes such a switch a crash left.) The
node-side half (link, copy, rename) is core/checkpoint.py piped to python3.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from spark_pipelines.core import checkpoint as checkpoint_core
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.core.fleet import GitPin, Node
from spark_pipelines.resources.ssh import FleetSession, RemoteError
from spark_pipelines.resources.transfer import DIGEST_TIMEOUT_S, checkpoint_script, digests_on_node

GIT_TIMEOUT_S = 1800  # a first clone of a large repo over a slow uplink
VERIFY_TIMEOUT_S = 600  # reading 14 shard headers of a ~71 GB checkpoint (hashing: transfer.DIGEST_TIMEOUT_S)
FS_TIMEOUT_S = 900  # linking 14 shards, copying the small files, removing a replaced ~71 GB directory
# A rebuild beside needs about the size of what it replaces free on the same filesystem.
FREE_MARGIN = 1.05


def verify_on_node(
    session: FleetSession, node: Node, directory: str, *, expected_scales: int, require_mtp: bool
) -> checkpoint_core.CheckpointReport:
    """core/checkpoint.py is stdlib-only: it is piped to the node's python3 and reads there."""
    argv = ["python3", "-", directory, "--expected-scales", str(expected_scales)]
    if not require_mtp:
        argv.append("--no-mtp")
    source = Path(checkpoint_core.__file__).read_text()
    r = session.run(node.name, argv, stdin=source, log=False, timeout=VERIFY_TIMEOUT_S)
    data = json.loads(r.stdout.strip().splitlines()[-1])
    return checkpoint_core.CheckpointReport(**data)


def checkout(session: FleetSession, node: Node, pin: GitPin, dest: str) -> str:
    """Clone once, then fetch only when the pinned commit is missing; always a clean detached tree."""
    if not session.exists(node.name, f"{dest}/.git"):
        session.run(node.name, ["git", "clone", "--quiet", pin.url, dest], timeout=GIT_TIMEOUT_S)
    has = session.run(node.name, ["git", "-C", dest, "cat-file", "-e", f"{pin.commit}^{{commit}}"],
                      check=False, log=False, timeout=60)
    if not has.ok:
        session.run(node.name, ["git", "-C", dest, "fetch", "--quiet", "origin"], timeout=GIT_TIMEOUT_S)
    session.run(node.name, ["git", "-C", dest, "checkout", "--quiet", "--force", "--detach", pin.commit], timeout=300)
    session.run(node.name, ["git", "-C", dest, "clean", "-fdq", "-e", ".venv"], timeout=300)
    return session.run(node.name, ["git", "-C", dest, "rev-parse", "HEAD"], log=False, timeout=60).stdout.strip()


def head_commit(session: FleetSession, node: Node, repo: str) -> str | None:
    """The commit a checkout on the node is at, or None when there is no checkout."""
    if not session.exists(node.name, f"{repo}/.git"):
        return None
    r = session.run(node.name, ["git", "-C", repo, "rev-parse", "HEAD"], check=False, log=False, timeout=60)
    return (r.stdout.strip() or None) if r.ok else None


def index_digests(session: FleetSession, node: Node, directory: str) -> dict[str, str]:
    """{"hybrid": ..., "full": ...} of the directory's index (core.checkpoint.weight_map_digests)."""
    return checkpoint_script(session, node.name, [directory, "--index-digests"], VERIFY_TIMEOUT_S)


# ------------------------------------------------------------------------------ staging and switch


def staging_dir(serving: str) -> str:
    parent, _, name = serving.rstrip("/").rpartition("/")
    return f"{parent}/.{name}.staging"


def previous_dir(serving: str) -> str:
    parent, _, name = serving.rstrip("/").rpartition("/")
    return f"{parent}/.{name}.previous"


def remove_dir(session: FleetSession, node: Node, path: str) -> None:
    session.run(node.name, ["rm", "-rf", "--", path], timeout=FS_TIMEOUT_S)


def remove_quietly(session: FleetSession, node: Node, path: str) -> None:
    """For an exception path: try to remove, never raise over the error being handled."""
    try:
        remove_dir(session, node, path)
    except Exception as e:  # the original failure is what the run reports
        session.log.warning(f"[{node.name}] could not remove {path} ({first_line(e)}); the next build removes it")


def recover_switch(session: FleetSession, node: Node, serving: str) -> None:
    """Finish what a switch killed half-way left (the two-rename fallback, or a crash before the
    replaced directory was removed): the serving path always ends up holding a checkpoint."""
    previous = previous_dir(serving)
    if not session.exists(node.name, previous):
        return
    if session.exists(node.name, serving):
        session.log.info(f"[{node.name}] removing {previous}, left by an interrupted switch")
        remove_dir(session, node, previous)
    else:
        session.log.warning(f"[{node.name}] {serving} is missing and {previous} is there (a switch was interrupted): "
                      "putting it back")
        session.run(node.name, ["mv", "-T", "--", previous, serving], timeout=60)


def stage_linked_copy(session: FleetSession, node: Node, source: str, staging: str | None = None) -> str:
    """A fresh staging copy of a checkpoint (a version) for a step that rewrites files in place:
    shards hard-linked, the small files copied (core.checkpoint.stage_copy). Returns its path."""
    staging = staging or staging_dir(source)
    remove_dir(session, node, staging)
    done = checkpoint_script(session, node.name, [staging, "--stage-from", source], FS_TIMEOUT_S)
    session.log.info(f"[{node.name}] staged {staging}: {len(done['linked'])} shard(s) hard-linked, "
               f"{len(done['copied'])} file(s) copied")
    return staging


def require_free_space(session: FleetSession, node: Node, serving: str, what: str) -> None:
    """A rebuild beside needs room for a second copy of what it replaces: say so before ~20 min
    of building fills the disk under the serving checkpoint."""
    if not session.exists(node.name, serving):
        return
    parent = serving.rstrip("/").rpartition("/")[0] or "/"
    try:
        used = int(session.run(node.name, ["du", "-skH", "--", serving], log=False, timeout=FS_TIMEOUT_S).stdout.split()[0])
        free = int(session.run(node.name, ["df", "-Pk", parent], log=False, timeout=60).stdout.splitlines()[-1].split()[3])
    except (RemoteError, ValueError, IndexError):
        return  # unreadable: the build itself will say if the disk fills
    if free < used * FREE_MARGIN:
        raise RunbookError(
            f"{node.name}: not enough free space under {parent} to {what} beside the serving checkpoint "
            f"(needs ~{used * FREE_MARGIN / 2**20:.1f} GiB, {free / 2**20:.1f} GiB free); the serving checkpoint "
            f"is never overwritten in place: free space there (`df -h {parent}`), then rerun build_job")


# ------------------------------------------------------------------------------ content


@dataclass
class ContentCheck:
    """The directory hashed against the manifest its step recorded (resources/transfer.py's
    receiver check, on the build host's own copy)."""

    manifest: str  # digest of what the directory holds now (the manifest file excluded)
    problems: list[str] = field(default_factory=list)
    # Files whose content is not the manifest's; None when unknown (the manifest file itself is gone).
    differing: list[str] | None = None
    restored_manifest: bool = False  # the manifest file was missing or replaced, the content intact
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def seconds_per_gib(self) -> float | None:
        return round(self.seconds / (self.bytes / 2**30), 2) if self.bytes else None


def manifest_text(manifest: dict) -> str:
    """A manifest file's text, as core/checkpoint.py --write-manifest writes it."""
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def content_check(session: FleetSession, node: Node, directory: str, recorded: str | None, *,
                  restore: bool = True) -> ContentCheck:
    """Hash every file of `directory` on the node and compare with the manifest digest `recorded`
    (the step's marker). A directory whose content is intact but whose manifest file is missing
    or replaced gets the manifest back (a small file written atomically, nothing else touched;
    not with restore=False)."""
    started = time.monotonic()
    actual = digests_on_node(session, node.name, directory)
    seconds = time.monotonic() - started
    content = {p: e for p, e in actual.items() if p != checkpoint_core.MANIFEST_NAME}
    manifest = checkpoint_core.make_manifest(content)
    now = checkpoint_core.manifest_digest(manifest)
    check = ContentCheck(manifest=now, files=len(content), bytes=sum(e["size"] for e in content.values()),
                         seconds=round(seconds, 2))
    path = f"{directory}/{checkpoint_core.MANIFEST_NAME}"
    on_disk = None
    if session.exists(node.name, path):
        text = session.read_text(node.name, path)
        try:
            on_disk = (text, checkpoint_core.manifest_digest(checkpoint_core.parse_manifest(text)))
        except ValueError:
            on_disk = None
    if recorded is None or now == recorded:
        if restore and (on_disk is None or on_disk[1] != now):
            session.put_text(node.name, path, manifest_text(manifest))
            check.restored_manifest = True
        check.differing = []
        return check
    if on_disk is not None and on_disk[1] == recorded:
        expected = checkpoint_core.expected_tree(on_disk[0])
        diff = checkpoint_core.diff_manifests(expected, actual)
        check.problems = diff.problems(node.name, expected, actual)
        check.differing = sorted(diff.missing + diff.differing + diff.extra)
    else:
        check.problems = [f"{checkpoint_core.MANIFEST_NAME} in {directory} is missing or not the one recorded, and the "
                          f"content hashes to {now[:16]}, recorded {recorded[:16]}: some file changed"]
    return check


__all__ = ["DIGEST_TIMEOUT_S", "ContentCheck", "checkout", "content_check", "head_commit",
           "index_digests", "manifest_text", "previous_dir", "recover_switch", "remove_dir", "remove_quietly",
           "require_free_space", "stage_linked_copy", "staging_dir", "verify_on_node"]
