"""Verify a safetensors checkpoint from its index and shard headers, without loading tensors.

install.sh's skip test only asks whether the index and the last shard exist. That passes a
half-built hybrid checkpoint: build-hybrid-checkpoint.py copies Intel's index into the output
first and rebuilds it from the shards only at the end, so a crash in between leaves an index
that does not describe the shards. This check reads each shard's header (8-byte little-endian
length + JSON) and cross-checks it with the index both ways.
"""

from __future__ import annotations

import json
import re
import struct
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


def main(argv: list[str] | None = None) -> int:
    """Run on the node itself (`python3 - DIR < checkpoint.py`): stdlib only, so the ~71 GB
    checkpoint is checked where it lies and only a JSON report crosses the network."""
    import argparse
    from dataclasses import asdict

    ap = argparse.ArgumentParser(prog="verify-checkpoint")
    ap.add_argument("directory")
    ap.add_argument("--expected-scales", type=int, default=EXPECTED_FP8_SCALES)
    ap.add_argument("--no-mtp", action="store_true")
    args = ap.parse_args(argv)
    report = verify_checkpoint(args.directory, args.expected_scales, require_mtp=not args.no_mtp)
    print(json.dumps(asdict(report)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
