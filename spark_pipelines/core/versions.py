"""The checkpoint as versions on a node: content-keyed directories, one of them serving.

The runbook keeps one checkpoint per node in one mutable directory (`~/models/<model_dir>`), so a
copy or a rebuild writes into what the running container mounts, and nothing can be put back.
Here each checkpoint a node holds is a version: a directory beside the runbook's path, named by
the digest of its content manifest (`<model_dir>.v-<digest16>`), written once (copied into
`.<model_dir>.v-<digest16>.incoming` and renamed when it verifies) and never written again. The
runbook's path is a symlink to the serving version, switched by a deploy (atomically: a new link
renamed over the old one) and switched back by its rollback or a rollout's revert. A container
launched by a deploy mounts the resolved version itself (core/launch.py `model_source`), so a
restart (a crash, a reboot, the sweep's redeploy) loads what was deployed, never what was last
copied; a hand container that mounts all of `~/models` follows the link, which only its own
deploy or revert moves.

Versions of one checkpoint share the files that did not change: a copy hard-links them from the
serving version (rsync --link-dest), so a weights-only or config-only change costs its changed
files on disk, and a version is removed only by garbage collection (`gc_plan`), never while a
node serves it, a rollout point or deploy journal names it, or it is the node's last known good.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from spark_pipelines.core import names

VERSION_INFIX = ".v-"
INCOMING_SUFFIX = ".incoming"  # a version being copied: never mounted, resumed by the next copy
DIGEST_LEN = 16
UNKEYED = "unkeyed"  # a plain directory found at the runbook's path with no manifest to name it
# Room a copy needs beyond the bytes it writes (filesystem metadata, rsync's partial files).
SPACE_MARGIN = 1.05
_NAME_TAIL = re.compile(r"^[0-9a-f]{16}$|^unkeyed(-[0-9]+)?$")


def short(digest: str | None) -> str:
    return (digest or "")[:DIGEST_LEN]


def version_name(model_dir: str, digest: str) -> str:
    """`qwen35-122b-hybrid-int4fp8` + manifest digest -> `qwen35-122b-hybrid-int4fp8.v-<16 hex>`."""
    tail = digest if digest.startswith(UNKEYED) else short(digest)
    if not _NAME_TAIL.match(tail):
        raise ValueError(f"{digest!r} is not a manifest digest (64 hex) or {UNKEYED!r}")
    return f"{model_dir}{VERSION_INFIX}{tail}"


def version_path(serving: str, digest: str) -> str:
    """The version's directory beside the runbook's path (same parent: a rename never crosses
    filesystems, and a hand container mounting the parent sees every version)."""
    names.check(names.PATH, serving, "checkpoint path")
    parent, _, model_dir = serving.rstrip("/").rpartition("/")
    return f"{parent}/{version_name(model_dir, digest)}"


def incoming_path(serving: str, digest: str) -> str:
    parent, _, name = version_path(serving, digest).rpartition("/")
    return f"{parent}/.{name}{INCOMING_SUFFIX}"


def digest_of(model_dir: str, entry: str) -> str | None:
    """The short digest a version directory's name carries (None: not a version of model_dir)."""
    entry = posixpath.basename(entry.rstrip("/"))
    stem = model_dir + VERSION_INFIX
    tail = entry[len(stem):] if entry.startswith(stem) else ""
    return tail if _NAME_TAIL.match(tail) else None


def same(a: str | None, b: str | None) -> bool:
    """Two digests (full or short) name the same version."""
    return bool(a) and bool(b) and short(a) == short(b)


@dataclass(frozen=True)
class Version:
    digest: str  # short digest (or UNKEYED...) from its name
    name: str
    kib: int  # its size alone (du -sk)
    mtime: int  # when it was completed (the directory's mtime, epoch seconds)
    has_manifest: bool


@dataclass(frozen=True)
class NodeCheckpoints:
    """What a node holds under its models directory, as `PROBE_SCRIPT` printed it."""

    serving_path: str
    kind: str  # "link" | "dir" | "absent" | "other"
    target: str | None  # the link's target (a version name beside it)
    versions: tuple[Version, ...] = ()
    incoming: tuple[str, ...] = ()
    total_kib: int = 0  # every version together, hard-linked files counted once
    free_kib: int | None = None  # free space under the models directory

    @property
    def model_dir(self) -> str:
        return posixpath.basename(self.serving_path.rstrip("/"))

    @property
    def serving(self) -> str | None:
        """The short digest of the version the runbook's path points at (None: a plain
        directory, nothing, or a link to something that is not a version)."""
        if self.kind != "link" or not self.target:
            return None
        return digest_of(self.model_dir, self.target)

    def holds(self, digest: str | None) -> Version | None:
        return next((v for v in self.versions if same(v.digest, digest)), None)


# One POSIX sh program, constant text; the paths arrive as positional arguments. Output, one line
# each: `serving<TAB>kind<TAB>target`, `version<TAB>name<TAB>has_manifest<TAB>kib<TAB>mtime` per
# version, `incoming<TAB>name` per copy in progress, `total<TAB>kib`, `free<TAB>kib`.
PROBE_SCRIPT = r"""
serving=$1; manifest=$2
parent=$(dirname "$serving"); base=$(basename "$serving")
if [ -L "$serving" ]; then printf 'serving\tlink\t%s\n' "$(readlink "$serving")"
elif [ -d "$serving" ]; then printf 'serving\tdir\t\n'
elif [ -e "$serving" ]; then printf 'serving\tother\t\n'
else printf 'serving\tabsent\t\n'; fi
set --
for d in "$parent/$base".v-*; do
  [ -d "$d" ] && [ ! -L "$d" ] || continue
  if [ -f "$d/$manifest" ]; then m=1; else m=0; fi
  printf 'version\t%s\t%s\t%s\t%s\n' "$(basename "$d")" "$m" "$(du -sk "$d" | cut -f1)" "$(stat -c %Y "$d")"
  set -- "$@" "$d"
done
for d in "$parent/.$base".v-*.incoming; do [ -d "$d" ] && printf 'incoming\t%s\n' "$(basename "$d")"; done
if [ $# -gt 0 ]; then printf 'total\t%s\n' "$(du -skc "$@" | tail -n 1 | cut -f1)"; else printf 'total\t0\n'; fi
if [ -d "$parent" ]; then printf 'free\t%s\n' "$(df -Pk "$parent" | tail -n 1 | awk '{print $4}')"; fi
"""


def probe_argv(serving: str, manifest_name: str) -> list[str]:
    names.check(names.PATH, serving, "checkpoint path")
    return ["sh", "-c", PROBE_SCRIPT, "spark-versions-probe", serving, manifest_name]


def parse_probe(serving: str, text: str) -> NodeCheckpoints:
    kind, target, versions, incoming, total, free = "absent", None, [], [], 0, None
    model_dir = posixpath.basename(serving.rstrip("/"))
    for line in text.splitlines():
        parts = line.split("\t")
        try:
            if parts[0] == "serving":
                kind, target = parts[1], (parts[2] or None) if len(parts) > 2 else None
            elif parts[0] == "version":
                digest = digest_of(model_dir, parts[1])
                if digest is not None:
                    versions.append(Version(digest, parts[1], int(parts[3]), int(parts[4]), parts[2] == "1"))
            elif parts[0] == "incoming":
                incoming.append(parts[1])
            elif parts[0] == "total":
                total = int(parts[1])
            elif parts[0] == "free":
                free = int(parts[1])
        except (IndexError, ValueError):
            raise ValueError(f"checkpoint versions probe printed an unreadable line: {line[:200]!r}") from None
    return NodeCheckpoints(serving, kind, target, tuple(sorted(versions, key=lambda v: (v.mtime, v.name))),
                           tuple(incoming), total, free)


# ------------------------------------------------------------------------------ disk


def bytes_to_write(manifest_files: Mapping[str, Mapping], linkable: Mapping[str, Mapping] | None) -> int:
    """What a copy of a version writes on a node: every file of its manifest, except those the
    node's serving version holds with the same path and sha256 (rsync --link-dest hard-links them)."""
    held = linkable or {}
    return sum(int(e["size"]) for p, e in manifest_files.items()
               if not (p in held and held[p].get("sha256") == e.get("sha256")))


@dataclass(frozen=True)
class SpaceVerdict:
    ok: bool
    needed_bytes: int
    free_bytes: int | None

    def words(self, node: str, where: str, what: str) -> str:
        free = "unknown" if self.free_bytes is None else size_text(self.free_bytes)
        return (f"{node}: {what} needs {size_text(self.needed_bytes)} under {where}, {free} free; "
                f"remove checkpoint versions no node serves (checkpoint_gc_job, check: false, after reading its "
                f"check run) or free space there (`df -h {where}`), then rerun: nothing was copied or changed")


def size_text(n: int) -> str:
    """Bytes as a person reads them: GiB for checkpoints, MiB or KiB for the small ones."""
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if n >= scale // 10:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def space_for(write_bytes: int, free_kib: int | None) -> SpaceVerdict:
    needed = int(write_bytes * SPACE_MARGIN)
    if free_kib is None:  # unreadable: the copy itself will say if the disk fills
        return SpaceVerdict(True, needed, None)
    free = free_kib * 1024
    return SpaceVerdict(free >= needed, needed, free)


# ------------------------------------------------------------------------------ garbage collection


@dataclass(frozen=True)
class GcPlan:
    keep: tuple[tuple[str, str], ...]  # (version name, why kept)
    remove: tuple[tuple[str, int], ...]  # (version name, kib)
    incoming: tuple[str, ...] = ()  # copies in progress: never removed here (the next copy resumes them)

    @property
    def freed_kib(self) -> int:
        return sum(k for _, k in self.remove)

    def lines(self) -> list[str]:
        out = [f"keep {name}: {why}" for name, why in self.keep]
        out += [f"remove {name} ({kib / 2**20:.1f} GiB alone)" for name, kib in self.remove]
        out += [f"leave {name}: a copy in progress (the next copy resumes it)" for name in self.incoming]
        return out


@dataclass(frozen=True)
class Protected:
    """Why versions must stay on a node, by short digest (the reasons an operator reads)."""

    reasons: dict[str, list[str]] = field(default_factory=dict)

    def add(self, digest: str | None, why: str) -> None:
        if digest:
            self.reasons.setdefault(short(digest) if not digest.startswith(UNKEYED) else digest, []).append(why)


def gc_plan(held: NodeCheckpoints, protected: Protected, keep: int) -> GcPlan:
    """Which versions go: never the serving one, one a rollout point, deploy journal or the last
    known good names, nor the `keep` newest; every other version is removed. A version whose
    name cannot be read is not one of ours and is never touched (parse_probe drops it)."""
    if keep < 1:
        raise ValueError("versions.keep must be at least 1 (the serving version)")
    kept: list[tuple[str, str]] = []
    removed: list[tuple[str, int]] = []
    newest = {v.name for v in sorted(held.versions, key=lambda v: (v.mtime, v.name), reverse=True)[:keep]}
    for v in held.versions:
        why = list(protected.reasons.get(v.digest, []))
        if held.serving and v.digest == held.serving:
            why.insert(0, "serving")
        if v.name in newest:
            why.append(f"among the {keep} newest (versions.keep)")
        if why:
            kept.append((v.name, "; ".join(why)))
        else:
            removed.append((v.name, v.kib))
    return GcPlan(tuple(kept), tuple(removed), held.incoming)


def describe(held: NodeCheckpoints) -> list[str]:
    """One line per version for a report: name, size, serving."""
    gib = 2 ** 20
    out = []
    for v in held.versions:
        tag = " (serving)" if held.serving == v.digest else ""
        out.append(f"{v.name}: {v.kib / gib:.1f} GiB{tag}")
    if held.kind == "dir":
        out.append(f"{held.serving_path}: a plain directory (the runbook's layout; it becomes a version at its "
                   f"node's next deploy or adoption)")
    return out
