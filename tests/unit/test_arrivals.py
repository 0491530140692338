"""The receiver's watcher (core/arrivals.py), run on temp dirs: a file is hashed once it lands whole
(its final name at its full size), reported at once; a bad one is reported and removed so the next
transfer sends it whole; more expected files are picked up when the expectation is rewritten."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
import time

from spark_pipelines.core import arrivals


class Lines(io.StringIO):
    def lines(self) -> list[str]:
        return [ln for ln in self.getvalue().splitlines() if ln]


def wait_for(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def expect(path, dirs, files):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"dirs": [str(d) for d in dirs], "files": files}, f)
    os.replace(tmp, path)


def test_files_are_verified_as_they_land_bad_ones_removed_and_more_picked_up(tmp_path):
    ckpt, parts = tmp_path / "ckpt", tmp_path / "parts"
    ckpt.mkdir()
    parts.mkdir()
    good, other = b"a" * 1000, b"b" * 1000
    sha = hashlib.sha256(good).hexdigest()
    exp = str(tmp_path / "expect.json")
    expect(exp, [ckpt, parts], [[0, "shard1", 1000, sha], [0, "sub/shard2", 1000, sha]])
    out = Lines()
    t = threading.Thread(target=arrivals.watch, args=(exp, out), kwargs={"poll_s": 0.01})
    t.start()
    try:
        (ckpt / "shard1").write_bytes(good[:500])  # still growing: not whole, not hashed
        time.sleep(0.1)
        assert out.lines() == []
        (ckpt / "shard1").write_bytes(good)
        assert wait_for(lambda: "ok 0 shard1" in out.lines())
        (ckpt / "sub").mkdir()
        (ckpt / "sub" / "shard2").write_bytes(other)  # whole, but not the manifest's bytes
        assert wait_for(lambda: any(ln.startswith("bad 0 sub/shard2 ") for ln in out.lines()))
        assert wait_for(lambda: not (ckpt / "sub" / "shard2").exists())  # removed: the next copy sends it whole
        (ckpt / "sub" / "shard2").write_bytes(good)
        assert wait_for(lambda: "ok 0 sub/shard2" in out.lines())
        # The image's parts, announced later.
        expect(exp, [ckpt, parts], [[0, "shard1", 1000, sha], [0, "sub/shard2", 1000, sha], [1, "part-00000", 1000, sha]])
        (parts / "part-00000").write_bytes(good)
        assert wait_for(lambda: "ok 1 part-00000" in out.lines())
    finally:
        open(exp + ".stop", "w").close()
        t.join(timeout=10)
    assert not t.is_alive()
    assert [ln for ln in out.lines() if ln.startswith("ok")] == ["ok 0 shard1", "ok 0 sub/shard2", "ok 1 part-00000"]
