# --- stdlib safetensors (struct + json), so this script runs on a bare python3 ---
import json as _json
import struct as _struct

DTYPE_BYTES = {"F8_E4M3": 1, "U8": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8}


def st_read(path):
    """{name: (dtype, shape, raw bytes)} of a safetensors file, in file order."""
    with open(path, "rb") as fh:
        (n,) = _struct.unpack("<Q", fh.read(8))
        header = _json.loads(fh.read(n).decode("utf-8"))
        data = fh.read()
    header.pop("__metadata__", None)
    out = {}
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b, e = info["data_offsets"]
        out[name] = (info["dtype"], list(info["shape"]), data[b:e])
    return out


def st_keys(path):
    with open(path, "rb") as fh:
        (n,) = _struct.unpack("<Q", fh.read(8))
        header = _json.loads(fh.read(n).decode("utf-8"))
    header.pop("__metadata__", None)
    return header


def st_write(path, tensors, metadata=None):
    header = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    blobs = []
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        count = 1
        for d in shape:
            count *= d
        if len(raw) != count * DTYPE_BYTES[dtype]:
            raise ValueError("%s: %d bytes for shape %s %s" % (name, len(raw), shape, dtype))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = _json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as fh:
        fh.write(_struct.pack("<Q", len(text)))
        fh.write(text)
        for raw in blobs:
            fh.write(raw)
# --- end stdlib safetensors ---
