"""The distribution's relay (core/relay.py), send piped into recv on temp dirs: each file lands
whole under its final name (a temp name beside it meanwhile), hashed as it landed, in the order it
was named; a stream cut inside a file leaves only the temp file, never a short file under the name."""

from __future__ import annotations

import hashlib
import io
import json

import pytest

from spark_pipelines.core import relay


def test_files_relayed_land_whole_with_their_digest(tmp_path):
    src, parts, dst, dparts = (tmp_path / d for d in ("src", "parts", "dst", "dparts"))
    for d in (src, parts, dst, dparts):
        d.mkdir()
    (src / "sub").mkdir()
    (src / "sub" / "shard").write_bytes(b"x" * (3 << 20))
    (parts / "part-00000").write_bytes(b"")
    names = io.StringIO(json.dumps([0, "sub/shard"]) + "\n" + json.dumps([1, "part-00000"]) + "\n")
    stream = io.BytesIO()
    assert relay.send([str(src), str(parts)], names, stream) == 0
    out = io.StringIO()
    stream.seek(0)
    assert relay.recv([str(dst), str(dparts)], stream, out) == 0
    got = [json.loads(ln[4:]) for ln in out.getvalue().splitlines()]
    assert got == [[0, "sub/shard", hashlib.sha256(b"x" * (3 << 20)).hexdigest()],
                   [1, "part-00000", hashlib.sha256(b"").hexdigest()]]
    assert (dst / "sub" / "shard").read_bytes() == b"x" * (3 << 20) and (dparts / "part-00000").exists()
    assert not list(dst.rglob("*" + relay.RELAY_SUFFIX))


def test_a_stream_cut_inside_a_file_never_leaves_it_short_under_its_name(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "shard").write_bytes(b"y" * 5000)
    stream = io.BytesIO()
    relay.send([str(tmp_path / "src")], io.StringIO(json.dumps([0, "shard"]) + "\n"), stream)
    cut = io.BytesIO(stream.getvalue()[:-100])
    with pytest.raises(EOFError, match="ended inside shard"):
        relay.recv([str(tmp_path / "dst")], cut, io.StringIO())
    assert not (tmp_path / "dst" / "shard").exists() and (tmp_path / "dst" / ".shard.relay").exists()
    with pytest.raises(ValueError, match="refusing"):  # a path that leaves the directory
        relay.recv([str(tmp_path / "dst")], io.BytesIO(b'{"i": 0, "path": "../x", "size": 0}\n'), io.StringIO())
