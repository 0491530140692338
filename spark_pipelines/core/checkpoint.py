"""Verify a safetensors checkpoint from its index and shard headers, without loading tensors.

install.sh's skip test only asks whether the index and the last shard exist. That passes a
half-built hybrid checkpoint: build-hybrid-checkpoint.py copies Intel's index into the output
first and rebuilds it from the shards only at the end, so a crash in between leaves an index
that does not describe the shards. This check reads each shard's header (8-byte little-endian
length + JSON) and cross-checks it with the index both ways.

Headers say nothing about content: a shard overwritten in place with the same size passes them
(and rsync's size+mtime quick check). The digest manifest (sha256 of every file, made on the build
host right after a step changed the directory, `.spark-manifest.json` next to the checkpoint) is
what every receiver is checked against, file by file, so only the files that differ are re-sent.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
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
REBUILD_ADVICE = (
    "rebuild the hybrid checkpoint (delete the model-*-of-* shards first: the builder's --force "
    "removes only model.safetensors* and config.json)"
)


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
        report.problems.append(f"{exc}: the file is damaged or truncated; {REBUILD_ADVICE}")
        return None
    data_end = max((t.end for t in tensors.values()), default=0)
    expected = 8 + header_len + data_end
    actual = path.stat().st_size
    if actual != expected:
        report.problems.append(
            f"{path.name}: {actual} bytes on disk but its header describes {expected} "
            f"(incomplete write or copy); re-copy or {REBUILD_ADVICE}"
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
                f"{list(t.shape)} x {t.dtype} needs {count * width}; {REBUILD_ADVICE}"
            )
    return tensors


def verify_checkpoint(
    directory: str | Path, expected_scales: int = EXPECTED_FP8_SCALES, require_mtp: bool = True
) -> CheckpointReport:
    """Check a checkpoint directory: index <-> shard headers, sizes, FP8 scales and MTP keys."""
    root = Path(directory)
    report = CheckpointReport(directory=str(root), expected_scales=expected_scales)
    if not root.is_dir():
        report.problems.append(f"{root}: not a directory; build the checkpoint first")
        return report
    index_path = root / INDEX_NAME
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except FileNotFoundError:
        report.problems.append(f"{INDEX_NAME}: missing; {REBUILD_ADVICE}")
        return report
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
        report.problems.append(f"{INDEX_NAME}: unreadable ({exc}); {REBUILD_ADVICE}")
        return report

    by_file: dict[str, list[str]] = {}
    for key, fname in weight_map.items():
        by_file.setdefault(str(fname), []).append(key)
    on_disk = sorted(p.name for p in root.iterdir() if _SHARD_NAME.match(p.name))
    totals = {int(m.group(2)) for name in on_disk + list(by_file) if (m := _SHARD_NAME.match(name))}
    if len(totals) > 1:
        report.problems.append(
            f"shards disagree on the shard count (-of-{sorted(totals)}): files from two "
            f"builds are mixed; {REBUILD_ADVICE}"
        )
    for total in totals:
        for n in range(1, total + 1):
            name = f"model-{n:05d}-of-{total:05d}.safetensors"
            if name not in on_disk:
                report.problems.append(f"{name}: missing (index or file names say {total} shards)")
    for name in on_disk:
        if name not in by_file:
            report.problems.append(
                f"{name}: on disk but no index key points to it (stale index?); {REBUILD_ADVICE}"
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
                f"(stale index from another build); {REBUILD_ADVICE}"
            )
    for fname, tensors in headers.items():
        unindexed = [
            k for k in tensors
            if weight_map.get(k) != fname and (fname != MTP_FILE or k.startswith("mtp."))
        ]
        if unindexed:
            report.problems.append(
                f"{fname}: {len(unindexed)} tensor(s) not mapped to this file in the index, e.g. "
                f"{unindexed[0]} (the index is stale: it was not rebuilt from these shards); "
                f"{REBUILD_ADVICE}"
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
            f"the FP8 dense layers did not all land; {REBUILD_ADVICE}"
        )

    mtp_path = root / MTP_FILE
    mtp_tensors = headers.get(MTP_FILE)
    if mtp_tensors is not None:
        mtp_keys = [k for k in mtp_tensors if k.startswith("mtp.")]
        report.mtp_keys_mapped = sum(1 for k in mtp_keys if weight_map.get(k) == MTP_FILE)
        report.tensor_count += len(mtp_tensors)
        if require_mtp and not mtp_keys:
            report.problems.append(f"{MTP_FILE}: holds no mtp. tensors; re-run add-mtp-weights.py")
    elif require_mtp and not mtp_path.exists():
        report.problems.append(
            f"{MTP_FILE}: missing, MTP speculative decoding will not load; run "
            "add-mtp-weights.py --source <Intel snapshot> --target <checkpoint>"
        )
    if require_mtp and mtp_tensors is not None and report.mtp_keys_mapped == 0:
        report.problems.append(
            f"{INDEX_NAME}: no mtp. keys mapped to {MTP_FILE}; run add-mtp-weights.py"
        )
    return report


# -- content: the digest manifest ---------------------------------------------------------------

MANIFEST_NAME = ".spark-manifest.json"
MANIFEST_FORMAT = "spark-manifest/1"
# = core.remote.RSYNC_PARTIAL_DIR (this file is piped alone to the node's python3: no imports of ours)
PARTIAL_DIR = ".rsync-partial"
_CHUNK = 8 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digest_tree(
    directory: str | Path, only: list[str] | None = None, workers: int = 4, with_manifest: bool = True
) -> dict[str, dict]:
    """{relative path: {size, sha256}} of every regular file (not symlinks, not rsync's partial dir;
    the manifest file itself only with_manifest), or of the `only` files that exist. hashlib
    releases the GIL, so a few threads read several shards at once."""
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
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        digests = list(pool.map(lambda r: file_sha256(root / r), rels))
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


def main(argv: list[str] | None = None) -> int:
    """Run on the node itself (`python3 - DIR < checkpoint.py`): stdlib only, so the ~71 GB
    checkpoint is checked where it lies and only a JSON report crosses the network.

    --digests prints {files: {path: {size, sha256}}}; --write-manifest also writes MANIFEST_NAME
    (atomically) and prints the manifest; --only=PATH (repeatable) limits the hashing."""
    import argparse
    from dataclasses import asdict

    ap = argparse.ArgumentParser(prog="verify-checkpoint")
    ap.add_argument("directory")
    ap.add_argument("--expected-scales", type=int, default=EXPECTED_FP8_SCALES)
    ap.add_argument("--no-mtp", action="store_true")
    ap.add_argument("--digests", action="store_true")
    ap.add_argument("--write-manifest", action="store_true")
    ap.add_argument("--only", action="append")
    args = ap.parse_args(argv)
    if args.digests or args.write_manifest:
        files = digest_tree(args.directory, only=args.only, workers=min(4, os.cpu_count() or 1),
                            with_manifest=not args.write_manifest)
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
