"""A distribution's node side: hash each expected file as soon as it lands whole, and relay files.

    python3 arrivals.py watch EXPECT.json          on a receiver, for the whole distribution
    python3 arrivals.py send DIR...                 on a holder: `[dir index, path]` lines in,
      | ssh RECEIVER python3 arrivals.py recv DIR...  each file out as it is named, `got` lines back

EXPECT.json: {"dirs": [dir, ...], "files": [[dir index, relative path, size, sha256], ...]}; the
orchestrator rewrites it when more is expected (the image's parts, once the build host cut them)
and creates EXPECT.json.stop to end this. A file counts as landed when its final name holds its
full size: rsync writes into a temp name (or rsync's partial dir) and renames the whole file into
place, and a hard link from the serving version is whole at once. Each landed file is hashed
once; one line per verdict on stdout, flushed at once (the orchestrator passes a verified unit on
to the next node as soon as it reads the line):

    ok <dir index> <path>
    bad <dir index> <path> <sha256 found>

A bad file is removed (only that inode: a newer copy renamed over it meanwhile stays), so the next
transfer sends it whole, and it stays expected.

The relay is one stream per tree edge for the whole distribution: the holder's `send` writes each
file it is told to (a JSON header line, then its bytes) as soon as it is told, the receiver's
`recv` writes it under a temp name beside its place (`.NAME.relay`), renames it into place when
whole and says `got [dir index, path]`. One connection and two processes per edge: a unit costs
its bytes, not a process start and a handshake (what an rsync per shard would cost, a third of a
second each on a busy node). The bytes are judged by the watcher, never by the relay.
Stdlib only: copied to each node of the distribution.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

POLL_S = 0.1
_CHUNK = 8 << 20


def sha256_of(path: str) -> tuple[str, int]:
    """(hex digest, inode) of the file as opened."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        ino = os.fstat(fh.fileno()).st_ino
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest(), ino


def landed(path: str, size: int) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return not os.path.islink(path) and os.path.isfile(path) and st.st_size == size


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def load(expect: str) -> tuple[list[str], dict[tuple[int, str], tuple[int, str]]]:
    with open(expect, encoding="utf-8") as f:
        spec = json.load(f)
    dirs = [str(d) for d in spec["dirs"]]
    files = {(int(i), str(p)): (int(n), str(sha)) for i, p, n, sha in spec["files"]}
    return dirs, files


def watch(expect: str, out=sys.stdout, poll_s: float = POLL_S, workers: int = 2, max_s: float = 6 * 3600) -> int:
    stop = expect + ".stop"
    seen_mtime = None
    dirs: list[str] = []
    files: dict[tuple[int, str], tuple[int, str]] = {}
    done: set[tuple[int, str]] = set()
    hashing: dict[tuple[int, str], object] = {}
    bad: dict[tuple[int, str], tuple[int, int]] = {}  # (inode, mtime) found bad: not hashed again
    deadline = time.monotonic() + max_s
    with ThreadPoolExecutor(max_workers=workers) as pool:
        while time.monotonic() < deadline:
            try:
                mtime = os.stat(expect).st_mtime_ns
                if mtime != seen_mtime:
                    dirs, files = load(expect)
                    seen_mtime = mtime
            except (OSError, ValueError, KeyError):
                pass  # being rewritten: read it on the next turn
            for key, fut in list(hashing.items()):
                if not fut.done():  # type: ignore[attr-defined]
                    continue
                del hashing[key]
                i, rel = key
                path = os.path.join(dirs[i], rel)
                try:
                    digest, ino = fut.result()  # type: ignore[attr-defined]
                except OSError:
                    continue  # gone meanwhile (replaced): looked at again
                if digest == files[key][1]:
                    done.add(key)
                    print(f"ok {i} {rel}", file=out, flush=True)
                else:
                    print(f"bad {i} {rel} {digest}", file=out, flush=True)
                    try:
                        st = os.lstat(path)
                        bad[key] = (st.st_ino, st.st_mtime_ns)
                        if st.st_ino == ino:
                            os.unlink(path)
                    except OSError:
                        pass
            for key, (size, _) in files.items():
                if key in done or key in hashing or key[0] >= len(dirs):
                    continue
                path = os.path.join(dirs[key[0]], key[1])
                if landed(path, size) and bad.get(key) != _identity(path):
                    hashing[key] = pool.submit(sha256_of, path)
            if os.path.exists(stop) and not hashing:
                return 0
            time.sleep(poll_s)
    return 1


RELAY_SUFFIX = ".relay"  # a file on its way in: `.NAME.relay` beside NAME, renamed when whole
_BLOCK = 1 << 20


def send(dirs: list[str], names=None, out=None) -> int:
    """For each `[dir index, path]` line in: a header line `{"i", "path", "size"}`, then the file."""
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
            left = size
            while left:
                chunk = f.read(min(_BLOCK, left))
                if not chunk:
                    raise OSError(f"{path} shrank while it was sent")
                out.write(chunk)
                left -= len(chunk)
        out.flush()
    return 0


def _safe(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and ".." not in parts and "" not in parts


def recv(dirs: list[str], stream=None, out=None) -> int:
    """Each file of the stream under `.NAME.relay` beside its place, renamed into place when whole;
    `got [dir index, path]` once it is there."""
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
        with open(tmp, "wb") as f:
            left = size
            while left:
                chunk = stream.read(min(_BLOCK, left))
                if not chunk:
                    raise EOFError(f"the stream ended inside {rel}")
                f.write(chunk)
                left -= len(chunk)
        os.replace(tmp, final)
        print("got " + json.dumps([i, rel]), file=out, flush=True)


if __name__ == "__main__":
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "watch":
        sys.exit(watch(rest[0]))
    sys.exit(send(rest) if mode == "send" else recv(rest))
