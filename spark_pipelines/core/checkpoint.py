"""Verify a safetensors checkpoint from its index and shard headers, without loading tensors.

install.sh's skip test only asks whether the index and the last shard exist. That passes a
half-built hybrid checkpoint: build-hybrid-checkpoint.py copies Intel's index into the output
first and rebuilds it from the shards only at the end, so a crash in between leaves an index
that does not describe the shards. This check reads each shard's header (8-byte little-endian
length + JSON) and cross-checks it with the index both ways.

Headers say nothing about content: a shard overwritten in place with the same size passes them
(and rsync's size+mtime quick check). The digest manifest (sha256 of every file, made on the build
host right after a step changed the directory, `.spark-manifest.json` next to the checkpoint) is
what every copy is checked against, the build host's own included, file by file, so only the files
that differ are re-sent or rebuilt.

The problems found say what is wrong and nothing more: what mends them depends on where the
checkpoint is (the build host rebuilds beside the serving copy, a node gets it copied again), so
the callers add the advice (runbook/model.py). The same file, piped to the node's python3, also
stages a rebuild beside the serving directory and switches it into place (`main`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

INDEX_NAME = "model.safetensors.index.json"
MTP_FILE = "model_extra_tensors.safetensors"
FP8_DTYPE = "F8_E4M3"
SCALE_SUFFIX = ".weight_scale_inv"
# "Tensors replaced (BF16->FP8): 144": the shared-expert dense layers, 48 layers x gate/up/down.
EXPECTED_FP8_SCALES = 144
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own header limit
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
_SHARD_NAME = re.compile(r"^model-(\d{5})-of-(\d{5})\.safetensors$")


class CheckpointError(ValueError):
    """A safetensors file whose header cannot be read."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass
class CheckpointReport:
    directory: str
    shards: list[str] = field(default_factory=list)
    total_bytes: int = 0
    tensor_count: int = 0
    fp8_count: int = 0
    scale_count: int = 0
    expected_scales: int = 0
    mtp_keys_mapped: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def read_safetensors_header(path: Path) -> tuple[int, dict[str, TensorEntry], dict[str, str]]:
    """(header length, tensors, __metadata__) of one safetensors file, reading only its header."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path.name}: {size} bytes, too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise CheckpointError(
                f"{path.name}: header length {header_len} does not fit in the file ({size} bytes)"
            )
        raw = fh.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path.name}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path.name}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorEntry] = {}
    for key, info in header.items():
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path.name}: tensor {key!r} has a malformed entry") from None
        tensors[key] = TensorEntry(dtype, shape, begin, end)
    return header_len, tensors, metadata


def _check_shard(path: Path, report: CheckpointReport) -> dict[str, TensorEntry] | None:
    try:
        header_len, tensors, _ = read_safetensors_header(path)
    except CheckpointError as exc:
        report.problems.append(f"{exc}: the file is damaged or truncated")
        return None
    data_end = max((t.end for t in tensors.values()), default=0)
    expected = 8 + header_len + data_end
    actual = path.stat().st_size
    if actual != expected:
        report.problems.append(
            f"{path.name}: {actual} bytes on disk but its header describes {expected} "
            f"(incomplete write or copy)"
        )
    for key, t in tensors.items():
        width = DTYPE_BYTES.get(t.dtype)
        count = 1
        for dim in t.shape:
            count *= dim
        if width is None:
            report.problems.append(f"{path.name}: tensor {key} has unknown dtype {t.dtype}")
        elif t.end - t.begin != count * width or t.begin < 0:
            report.problems.append(
                f"{path.name}: tensor {key} spans {t.end - t.begin} bytes, its shape "
                f"{list(t.shape)} x {t.dtype} needs {count * width}"
            )
    return tensors


def verify_checkpoint(
    directory: str | Path, expected_scales: int = EXPECTED_FP8_SCALES, require_mtp: bool = True
) -> CheckpointReport:
    """Check a checkpoint directory: index <-> shard headers, sizes, FP8 scales and MTP keys."""
    root = Path(directory)
    report = CheckpointReport(directory=str(root), expected_scales=expected_scales)
    if not root.is_dir():
        report.problems.append(f"{root}: not a directory")
        return report
    index_path = root / INDEX_NAME
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except FileNotFoundError:
        report.problems.append(f"{INDEX_NAME}: missing")
        return report
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        report.problems.append(f"{INDEX_NAME}: unreadable ({exc})")
        return report

    by_file: dict[str, list[str]] = {}
    for key, fname in weight_map.items():
        by_file.setdefault(str(fname), []).append(key)
    on_disk = sorted(p.name for p in root.iterdir() if _SHARD_NAME.match(p.name))
    totals = {int(m.group(2)) for name in on_disk + list(by_file) if (m := _SHARD_NAME.match(name))}
    if len(totals) > 1:
        report.problems.append(
            f"shards disagree on the shard count (-of-{sorted(totals)}): files from two "
            f"builds are mixed"
        )
    for total in totals:
        for n in range(1, total + 1):
            name = f"model-{n:05d}-of-{total:05d}.safetensors"
            if name not in on_disk:
                report.problems.append(f"{name}: missing (index or file names say {total} shards)")
    for name in on_disk:
        if name not in by_file:
            report.problems.append(
                f"{name}: on disk but no index key points to it (stale index?)"
            )

    headers: dict[str, dict[str, TensorEntry]] = {}
    extra = {MTP_FILE} if (root / MTP_FILE).is_file() else set()
    for fname in sorted(set(by_file) | set(on_disk) | extra):
        path = root / fname
        if not path.is_file():
            if fname not in on_disk and not _SHARD_NAME.match(fname):
                report.problems.append(f"{fname}: named in {INDEX_NAME} but missing")
            continue
        report.total_bytes += path.stat().st_size
        if fname != MTP_FILE:
            report.shards.append(fname)
        tensors = _check_shard(path, report)
        if tensors is not None:
            headers[fname] = tensors

    for fname, keys in by_file.items():
        tensors = headers.get(fname)
        if tensors is None:
            continue
        absent = [k for k in keys if k not in tensors]
        if absent:
            report.problems.append(
                f"{fname}: {len(absent)} index key(s) not in this file, e.g. {absent[0]} "
                f"(stale index from another build)"
            )
    for fname, tensors in headers.items():
        unindexed = [
            k for k in tensors
            if weight_map.get(k) != fname and (fname != MTP_FILE or k.startswith("mtp."))
        ]
        if unindexed:
            report.problems.append(
                f"{fname}: {len(unindexed)} tensor(s) not mapped to this file in the index, e.g. "
                f"{unindexed[0]} (the index is stale: it was not rebuilt from these shards)"
            )
        if fname == MTP_FILE:
            continue
        report.tensor_count += len(tensors)
        report.fp8_count += sum(1 for t in tensors.values() if t.dtype == FP8_DTYPE)
        report.scale_count += sum(1 for k in tensors if k.endswith(SCALE_SUFFIX))
        for key in tensors:
            if key.endswith(SCALE_SUFFIX):
                weight = key[: -len(SCALE_SUFFIX)] + ".weight"
                located = headers.get(str(weight_map.get(weight, "")), {}).get(weight)
                if located is None or located.dtype != FP8_DTYPE:
                    report.problems.append(
                        f"{fname}: scale {key} has no FP8 weight {weight} in the checkpoint"
                    )

    if report.scale_count != expected_scales:
        report.problems.append(
            f"{report.scale_count} *{SCALE_SUFFIX} scale tensors, expected {expected_scales}: "
            f"the FP8 dense layers did not all land"
        )

    mtp_path = root / MTP_FILE
    mtp_tensors = headers.get(MTP_FILE)
    if mtp_tensors is not None:
        mtp_keys = [k for k in mtp_tensors if k.startswith("mtp.")]
        report.mtp_keys_mapped = sum(1 for k in mtp_keys if weight_map.get(k) == MTP_FILE)
        report.tensor_count += len(mtp_tensors)
        if require_mtp and not mtp_keys:
            report.problems.append(f"{MTP_FILE}: holds no mtp. tensors")
    elif require_mtp and not mtp_path.exists():
        report.problems.append(f"{MTP_FILE}: missing, MTP speculative decoding will not load")
    if require_mtp and mtp_tensors is not None and report.mtp_keys_mapped == 0:
        report.problems.append(f"{INDEX_NAME}: no mtp. keys mapped to {MTP_FILE}")
    return report


# -- content: the digest manifest ---------------------------------------------------------------

MANIFEST_NAME = ".spark-manifest.json"
MANIFEST_FORMAT = "spark-manifest/1"
# = core.remote.RSYNC_PARTIAL_DIR (this file is piped alone to the node's python3: no imports of ours)
PARTIAL_DIR = ".rsync-partial"
_CHUNK = 8 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


PROGRESS_PREFIX = "spark-progress"  # `spark-progress <bytes hashed> <bytes in all>` on stderr
PROGRESS_EVERY_S = 2.0


class HashProgress:
    """Bytes hashed so far, said on stderr at most every PROGRESS_EVERY_S (the orchestrator turns
    it into a line a person can watch: core/progress.py)."""

    def __init__(self, total: int, out=None) -> None:
        import threading
        import time

        self.total, self.done, self.out = total, 0, out
        self._lock, self._clock = threading.Lock(), time.monotonic
        self._said = self._clock()
        self._say()

    def _say(self) -> None:
        if self.out is not None:
            print(f"{PROGRESS_PREFIX} {self.done} {self.total}", file=self.out, flush=True)

    def add(self, n: int) -> None:
        if self.out is None:
            return
        with self._lock:
            self.done += n
            now = self._clock()
            if now - self._said >= PROGRESS_EVERY_S:
                self._said = now
                self._say()

    def finish(self) -> None:
        with self._lock:
            self._say()


def file_sha256(path: Path, progress: HashProgress | None = None) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            if progress is not None:
                progress.add(len(chunk))
    return h.hexdigest()


def digest_tree(
    directory: str | Path, only: list[str] | None = None, workers: int = 4, with_manifest: bool = True,
    progress_out=None,
) -> dict[str, dict]:
    """{relative path: {size, sha256}} of every regular file (not symlinks, not rsync's partial dir;
    the manifest file itself only with_manifest), or of the `only` files that exist. hashlib
    releases the GIL, so a few threads read several shards at once. `progress_out`: a stream the
    bytes hashed so far are said on (HashProgress)."""
    root = Path(directory)
    if only is not None:
        rels = [r for r in only if safe_relative(r) and (root / r).is_file() and not (root / r).is_symlink()]
    else:
        rels = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not (Path(dirpath) == root and d == PARTIAL_DIR))
            for name in filenames:
                full = Path(dirpath) / name
                rel = full.relative_to(root).as_posix()
                if (with_manifest or rel != MANIFEST_NAME) and full.is_file() and not full.is_symlink():
                    rels.append(rel)
    progress = HashProgress(sum((root / r).stat().st_size for r in rels), progress_out) if progress_out else None
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = list(pool.map(lambda r: file_sha256(root / r, progress), rels))
    if progress is not None:
        progress.finish()
    return {r: {"size": (root / r).stat().st_size, "sha256": d} for r, d in sorted(zip(rels, digests))}


def safe_relative(path: str) -> bool:
    """A manifest path that stays inside the directory (it ends up in rsync --files-from)."""
    parts = path.split("/")
    return bool(path) and not path.startswith("/") and ".." not in parts and "" not in parts and "\x00" not in path


def make_manifest(files: dict[str, dict]) -> dict:
    return {"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": dict(sorted(files.items()))}


def manifest_digest(manifest: dict) -> str:
    """What the data versions carry: sha256 over the canonical file list."""
    blob = json.dumps(manifest["files"], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def parse_manifest(text: str) -> dict:
    """A manifest read back from a node; ValueError saying what is wrong."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{MANIFEST_NAME}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT or not isinstance(data.get("files"), dict):
        raise ValueError(f"{MANIFEST_NAME}: not a {MANIFEST_FORMAT} manifest")
    for path, entry in data["files"].items():
        if not safe_relative(path):
            raise ValueError(f"{MANIFEST_NAME}: path {path!r} leaves the directory")
        if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                or not _SHA256.fullmatch(str(entry.get("sha256")))):
            raise ValueError(f"{MANIFEST_NAME}: entry for {path} is malformed")
    return data


def expected_tree(manifest_text: str) -> dict[str, dict]:
    """What a receiver must hold: the manifest's files plus the manifest file itself."""
    files = dict(parse_manifest(manifest_text)["files"])
    raw = manifest_text.encode()
    files[MANIFEST_NAME] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
    return files


@dataclass
class ManifestDiff:
    missing: list[str] = field(default_factory=list)
    differing: list[str] = field(default_factory=list)  # same path, other size or digest
    extra: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.differing or self.extra)

    @property
    def to_resend(self) -> list[str]:
        return sorted(self.missing + self.differing)

    def problems(self, node: str, expected: dict[str, dict], actual: dict[str, dict]) -> list[str]:
        out = [f"{p}: missing on {node}" for p in self.missing]
        for p in self.differing:
            e, a = expected[p], actual[p]
            how = ("content differs, same size" if e["size"] == a["size"]
                   else f"{a['size']} bytes, expected {e['size']}")
            out.append(f"{p}: {how} on {node} (sha256 {a['sha256'][:12]}, manifest {e['sha256'][:12]})")
        if self.extra:
            out.append(f"{len(self.extra)} file(s) on {node} not in the manifest, e.g. {self.extra[0]}")
        return out


def diff_manifests(expected: dict[str, dict], actual: dict[str, dict], only: list[str] | None = None) -> ManifestDiff:
    """Compare {path: {size, sha256}} listings; with `only`, just those paths (a re-check after repair)."""
    d = ManifestDiff()
    paths = sorted(expected) if only is None else sorted(set(only))
    for p in paths:
        if p not in expected:
            continue
        if p not in actual:
            d.missing.append(p)
        elif actual[p].get("sha256") != expected[p]["sha256"] or actual[p].get("size") != expected[p]["size"]:
            d.differing.append(p)
    if only is None:
        d.extra = sorted(set(actual) - set(expected))
    return d


# -- the index's identity -------------------------------------------------------------------------


def weight_map_digests(index_text: str) -> dict[str, str]:
    """Digests of what the index maps, canonical (key order and JSON formatting do not count):
    "full" of the whole weight map (mtp_weights' output), "hybrid" without the keys mapped to the
    MTP file (hybrid_checkpoint's output: step 2 only adds those, so step 1's digest is the same
    before and after step 2, and the same for a checkpoint built by hand). ValueError if unreadable."""
    try:
        weight_map = json.loads(index_text)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{INDEX_NAME}: unreadable ({e})") from None

    def digest(wm: dict) -> str:
        blob = json.dumps({str(k): str(v) for k, v in wm.items()}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    return {"full": digest(weight_map), "hybrid": digest({k: v for k, v in weight_map.items() if v != MTP_FILE})}


# -- staging beside the serving directory, and versions -----------------------------------------
# A rebuild never writes into a directory a container mounts: it is made in a staging directory next
# to it (same filesystem), verified there, and renamed to the checkpoint version its manifest names
# (core/versions.py). The runbook's plain directory becomes a version in place (make_version).

def stage_copy(source: str | Path, staging: str | Path) -> dict[str, list[str]]:
    """A staging copy of `source` for add-mtp-weights.py, which rewrites the index and the MTP file
    in place: the model-*-of-* shards hard-linked (that step never writes them; a link costs no
    space), every other file copied, the MTP file and the manifest left out (written anew).
    `staging` must not exist yet."""
    src, dst = Path(source), Path(staging)
    dst.mkdir(parents=True)
    linked: list[str] = []
    copied: list[str] = []
    for dirpath, dirnames, filenames in os.walk(src):
        here = Path(dirpath)
        dirnames[:] = sorted(d for d in dirnames if not (here == src and d == PARTIAL_DIR))
        (dst / here.relative_to(src)).mkdir(exist_ok=True)
        for name in sorted(filenames):
            full = here / name
            rel = full.relative_to(src).as_posix()
            if rel in (MTP_FILE, MANIFEST_NAME) or full.is_symlink() or not full.is_file():
                continue
            if _SHARD_NAME.match(rel):
                try:
                    os.link(full, dst / rel)
                    linked.append(rel)
                    continue
                except OSError as e:
                    if e.errno != errno.EXDEV:
                        raise
            shutil.copy2(full, dst / rel)
            copied.append(rel)
    return {"linked": linked, "copied": copied}


def make_version(serving: str | Path, name: str) -> dict:
    """The plain checkpoint directory at `serving` becomes the version `name` beside it and
    `serving` a relative link to it: one rename and one symlink in this one process, so the path
    is absent for microseconds, not an SSH round trip (no call swaps a directory for a link to its
    new name at once). A reader holding its files keeps them (a rename moves no data). The rename
    is undone when the link cannot be made."""
    sv = Path(serving)
    if "/" in name or name in ("", ".", ".."):
        raise ValueError(f"{name!r}: a version's name, not a path")
    target = sv.with_name(name)
    if sv.is_symlink() or not sv.is_dir():
        raise NotADirectoryError(f"{sv}: not a plain directory")
    if os.path.lexists(target):
        raise FileExistsError(f"{target}: exists")
    os.rename(sv, target)
    try:
        os.symlink(name, sv)
    except BaseException:
        os.rename(target, sv)
        raise
    return {"version": name, "path": str(target)}


# -- the tie to the base model: what a hybrid build keeps of its source ----------------------------


def compare_with_source(hybrid: str | Path, source: str | Path) -> dict:
    """How a hybrid checkpoint differs from what build-hybrid-checkpoint.py and add-mtp-weights.py
    make of `source` (the Intel snapshot): per shard the same tensors, dtypes and shapes, except
    the dense weights replaced by FP8 with their added scales; the MTP file byte for byte; every
    other file of the source (tokenizer, ...) byte for byte, config.json with the builder's
    `_hybrid_quant_info` added. Headers only, plus the MTP file's and the small files' bytes.
    Returns {differences: [...], source_fp8: str | None, replaced: int}."""
    hy, so = Path(hybrid), Path(source)
    out: list[str] = []
    replaced = 0
    source_shards = sorted(p.name for p in so.iterdir() if _SHARD_NAME.match(p.name))
    hybrid_shards = sorted(p.name for p in hy.iterdir() if _SHARD_NAME.match(p.name)) if hy.is_dir() else []
    if source_shards != hybrid_shards:
        out.append(f"shards {len(hybrid_shards)} ({', '.join(hybrid_shards[:1])}...), the base model has "
                   f"{len(source_shards)} ({', '.join(source_shards[:1])}...)")
    for name in sorted(set(source_shards) & set(hybrid_shards)):
        try:
            _, theirs, _ = read_safetensors_header(so / name)
            _, ours, _ = read_safetensors_header(hy / name)
        except CheckpointError as e:
            out.append(str(e))
            continue
        scales = {k for k in ours if k.endswith(SCALE_SUFFIX) and k not in theirs}
        missing = sorted(set(theirs) - set(ours))
        extra = sorted(set(ours) - set(theirs) - scales)
        if missing:
            out.append(f"{name}: {len(missing)} tensor(s) of the base model missing, e.g. {missing[0]}")
        if extra:
            out.append(f"{name}: {len(extra)} tensor(s) the base model does not have, e.g. {extra[0]}")
        for key in sorted(set(theirs) & set(ours)):
            a, b = theirs[key], ours[key]
            fp8 = b.dtype == FP8_DTYPE and (key[: -len(".weight")] + SCALE_SUFFIX) in scales
            if fp8:
                replaced += 1
                if a.shape != b.shape:
                    out.append(f"{name}: {key} is {list(b.shape)} FP8, the base model's is {list(a.shape)}")
            elif (a.dtype, a.shape) != (b.dtype, b.shape):
                out.append(f"{name}: {key} is {b.dtype} {list(b.shape)}, the base model's {a.dtype} {list(a.shape)}")
                break
    if (so / MTP_FILE).is_file():
        if not (hy / MTP_FILE).is_file():
            out.append(f"{MTP_FILE}: missing (the base model has it)")
        elif file_sha256(so / MTP_FILE) != file_sha256(hy / MTP_FILE):
            out.append(f"{MTP_FILE}: not the base model's (add-mtp-weights.py copies it byte for byte)")
    for f in sorted(p for p in so.iterdir() if p.is_file() and p.suffix != ".safetensors"):
        if f.name in (INDEX_NAME, "config.json") or f.name.startswith("."):
            continue
        mine = hy / f.name
        if not mine.is_file():
            out.append(f"{f.name}: missing (the base model has it)")
        elif file_sha256(mine) != file_sha256(f):
            out.append(f"{f.name}: differs from the base model's")
    source_fp8 = None
    try:
        info = json.loads((hy / "config.json").read_text(encoding="utf-8")).get("_hybrid_quant_info") or {}
        source_fp8 = info.get("source_fp8")
        if not info:
            out.append("config.json: no _hybrid_quant_info (not written by build-hybrid-checkpoint.py)")
    except (OSError, ValueError, AttributeError):
        out.append("config.json: missing or unreadable")
    return {"differences": out, "source_fp8": source_fp8, "replaced": replaced}


def main(argv: list[str] | None = None) -> int:
    """Run on the node itself (`python3 - DIR < checkpoint.py`): stdlib only, so the ~71 GB
    checkpoint is checked where it lies and only a JSON report crosses the network.

    --digests prints {files: {path: {size, sha256}}}; --write-manifest also writes MANIFEST_NAME
    (atomically) and prints the manifest; --only=PATH (repeatable) limits the hashing.
    --index-digests, --stage-from SRC, --make-version NAME and --compare-source SRC: the
    functions of the same names, on DIR."""
    import argparse
    from dataclasses import asdict

    ap = argparse.ArgumentParser(prog="verify-checkpoint")
    ap.add_argument("directory")
    ap.add_argument("--expected-scales", type=int, default=EXPECTED_FP8_SCALES)
    ap.add_argument("--no-mtp", action="store_true")
    ap.add_argument("--digests", action="store_true")
    ap.add_argument("--write-manifest", action="store_true")
    ap.add_argument("--only", action="append")
    ap.add_argument("--index-digests", action="store_true")
    ap.add_argument("--stage-from")
    ap.add_argument("--make-version")
    ap.add_argument("--compare-source")
    ap.add_argument("--progress", action="store_true", help="say the bytes hashed so far on stderr")
    args = ap.parse_args(argv)
    if args.index_digests:
        print(json.dumps(weight_map_digests((Path(args.directory) / INDEX_NAME).read_text(encoding="utf-8"))))
        return 0
    if args.stage_from:
        print(json.dumps(stage_copy(args.stage_from, args.directory)))
        return 0
    if args.make_version:
        print(json.dumps(make_version(args.directory, args.make_version)))
        return 0
    if args.compare_source:
        print(json.dumps(compare_with_source(args.directory, args.compare_source)))
        return 0
    if args.digests or args.write_manifest:
        import sys

        files = digest_tree(args.directory, only=args.only, workers=min(4, os.cpu_count() or 1),
                            with_manifest=not args.write_manifest, progress_out=sys.stderr if args.progress else None)
        if not args.write_manifest:
            print(json.dumps({"files": files}))
            return 0
        manifest = make_manifest(files)
        target = Path(args.directory) / MANIFEST_NAME
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, target)
        print(json.dumps(manifest))
        return 0
    report = verify_checkpoint(args.directory, args.expected_scales, require_mtp=not args.no_mtp)
    print(json.dumps(asdict(report)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
