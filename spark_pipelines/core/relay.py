"""A distribution's node side: relay files from a holder to a receiver, hashed as they land.

    python3 relay.py send DIR...                      on the holder: `[dir index, path]` lines in,
      | ssh RECEIVER python3 relay.py recv DIR...     each file out as soon as it is named

One stream per tree edge for the whole distribution: the holder's `send` writes each file it is
told to (a JSON header line `{"i", "path", "size"}`, then its bytes) the moment it is told, the
receiver's `recv` writes it under a temp name beside its place (`.NAME.relay`), hashing the bytes
as they land, renames it into place when whole and says `got [dir index, path, sha256]`, flushed
at once: the orchestrator compares the digest with the build host's manifest and passes a verified
unit on to the next node while the rest still arrives. One connection and two processes per edge:
a unit costs its bytes, not a process start and a handshake (what an rsync per shard cost: a third
of a second each on a busy node, on every level of the tree). A file that hashes wrong is only
reported: the orchestrator sends it again, renamed over it. Stdlib only: copied to each node of
the distribution.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

RELAY_SUFFIX = ".relay"  # a file on its way in: `.NAME.relay` beside NAME, renamed when whole
_BLOCK = 1 << 20


def send(dirs: list[str], names=None, out=None) -> int:
    """For each `[dir index, path]` line in: a header line, then the file (sendfile: no copy here)."""
    names = names or sys.stdin
    out = out or sys.stdout.buffer
    for line in names:
        if not line.strip():
            continue
        i, rel = json.loads(line)
        path = os.path.join(dirs[int(i)], rel)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            out.write(json.dumps({"i": int(i), "path": rel, "size": size}).encode() + b"\n")
            out.flush()
            sent = 0
            while sent < size:
                n = _copy(f, out, sent, size - sent)
                if n <= 0:
                    raise OSError(f"{path} shrank while it was sent")
                sent += n
        out.flush()
    return 0


def _copy(f, out, offset: int, left: int) -> int:
    try:
        return os.sendfile(out.fileno(), f.fileno(), offset, min(left, 64 * _BLOCK))
    except (OSError, AttributeError, ValueError):  # not a pipe or socket here (a test's buffer)
        f.seek(offset)
        chunk = f.read(min(left, _BLOCK))
        out.write(chunk)
        return len(chunk)


def _safe(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and ".." not in parts and "" not in parts


def recv(dirs: list[str], stream=None, out=None) -> int:
    """Each file of the stream under `.NAME.relay` beside its place, hashed as it lands, renamed
    into place when whole; `got [dir index, path, sha256]` once it is there."""
    stream = stream or sys.stdin.buffer
    out = out or sys.stdout
    while True:
        head = stream.readline()
        if not head:
            return 0
        h = json.loads(head)
        i, rel, size = int(h["i"]), str(h["path"]), int(h["size"])
        if not _safe(rel) or not 0 <= i < len(dirs):
            raise ValueError(f"refusing {rel!r} in directory {i}")
        final = os.path.join(dirs[i], rel)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(os.path.dirname(final), "." + os.path.basename(final) + RELAY_SUFFIX)
        digest = hashlib.sha256()
        with open(tmp, "wb") as f:
            left = size
            while left:
                chunk = stream.read(min(_BLOCK, left))
                if not chunk:
                    raise EOFError(f"the stream ended inside {rel}")
                digest.update(chunk)
                f.write(chunk)
                left -= len(chunk)
        os.replace(tmp, final)
        print("got " + json.dumps([i, rel, digest.hexdigest()]), file=out, flush=True)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    sys.exit(send(rest) if mode == "send" else recv(rest))
