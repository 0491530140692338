"""Checkpoint verification from headers, on checkpoints written by the stand-in recipe scripts."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from spark_pipelines.core import checkpoint as ck
from spark_pipelines.core import remote
from spark_pipelines.core.checkpoint import read_safetensors_header, verify_checkpoint
from spark_sim import upstream

SCRIPTS = "patches/01-hybrid-int4-fp8/build-hybrid-checkpoint.py", "patches/02-mtp-speculative/add-mtp-weights.py"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    upstream.make_recipe_repo(root / "recipe")
    src = upstream.make_model_source(root / "hub", layers=48, shards=4)
    env = dict(os.environ, HF_HUB_CACHE=str(src.hub_cache))
    out = root / "hybrid"
    subprocess.run([sys.executable, root / "recipe" / SCRIPTS[0], "--gptq-dir", src.intel_snapshot,
                    "--fp8-repo", upstream.FP8_REPO, "--output", out, "--force"],
                   env=env, check=True, capture_output=True)
    subprocess.run([sys.executable, root / "recipe" / SCRIPTS[1], "--source", src.intel_snapshot,
                    "--target", out], check=True, capture_output=True)
    return root, src, out


def test_good_checkpoint_passes(built):
    _, src, out = built
    rep = verify_checkpoint(out, expected_scales=src.expected_scales)
    assert rep.problems == []
    assert rep.fp8_count == 144 and rep.scale_count == 144 and rep.mtp_keys_mapped == src.mtp_tensors
    assert len(rep.shards) == 4
    assert rep.total_bytes == sum(p.stat().st_size for p in out.glob("*.safetensors"))


def test_header_reader_agrees_with_safetensors_library(built):
    _, _, out = built
    shard = out / "model-00001-of-00004.safetensors"
    _, tensors, _ = read_safetensors_header(shard)
    with safe_open(str(shard), framework="np") as f:
        assert set(f.keys()) == set(tensors)


def _copy(built, tmp_path):
    dst = tmp_path / "c"
    shutil.copytree(built[2], dst)
    return dst


def test_stale_index_from_intel_fails(built, tmp_path):
    root, src, _ = built
    ck = _copy(built, tmp_path)
    shutil.copy(src.intel_snapshot / "model.safetensors.index.json", ck / "model.safetensors.index.json")
    rep = verify_checkpoint(ck)
    assert not rep.ok
    assert any("not mapped to this file in the index" in p and "weight_scale_inv" in p for p in rep.problems)


def test_crash_before_index_rebuild_is_caught(built, tmp_path):
    root, src, _ = built
    out = tmp_path / "crashed"
    env = dict(os.environ, HF_HUB_CACHE=str(src.hub_cache), SIM_CRASH_BEFORE_INDEX="1")
    done = subprocess.run([sys.executable, root / "recipe" / SCRIPTS[0], "--gptq-dir", src.intel_snapshot,
                           "--output", out, "--force"], env=env, capture_output=True)
    assert done.returncode == 137
    # install.sh's skip test would pass: index and last shard exist
    assert (out / "model.safetensors.index.json").exists() and (out / "model-00004-of-00004.safetensors").exists()
    assert not verify_checkpoint(out).ok


def test_truncated_shard_and_missing_shard(built, tmp_path):
    ck = _copy(built, tmp_path)
    shard = ck / "model-00002-of-00004.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5])
    (ck / "model-00003-of-00004.safetensors").unlink()
    rep = verify_checkpoint(ck)
    assert any(p.startswith("model-00002-of-00004.safetensors:") and "bytes on disk" in p for p in rep.problems)
    assert any(p.startswith("model-00003-of-00004.safetensors: missing") for p in rep.problems)


def test_missing_mtp_and_wrong_scale_count(built, tmp_path):
    ck = _copy(built, tmp_path)
    (ck / "model_extra_tensors.safetensors").unlink()
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if not k.startswith("mtp.")}
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))
    rep = verify_checkpoint(ck, expected_scales=150)
    assert any("model_extra_tensors.safetensors: missing" in p for p in rep.problems)
    assert any("144 *.weight_scale_inv scale tensors, expected 150" in p for p in rep.problems)


def test_garbage_header_is_a_problem_not_a_traceback(tmp_path):
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"\xff" * 16)
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "model-00001-of-00001.safetensors"}}')
    rep = verify_checkpoint(tmp_path, require_mtp=False)
    assert any("header length" in p for p in rep.problems)
    assert not verify_checkpoint(tmp_path / "nope").ok


# -- content: the digest manifest ---------------------------------------------------------------

def _entry(data: bytes) -> dict:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def test_diff_finds_same_size_rewrite_missing_and_extra():
    expected = {"a.safetensors": _entry(b"abcd"), "b.safetensors": _entry(b"xyz"), "config.json": _entry(b"{}")}
    actual = {"a.safetensors": _entry(b"abce"), "config.json": _entry(b"{}"), "stray": _entry(b"1")}
    d = ck.diff_manifests(expected, actual)
    assert d.differing == ["a.safetensors"] and d.missing == ["b.safetensors"] and d.extra == ["stray"]
    assert d.to_resend == ["a.safetensors", "b.safetensors"] and not d.ok
    problems = d.problems("spark2", expected, actual)
    assert problems[0] == "b.safetensors: missing on spark2"
    assert "a.safetensors: content differs, same size on spark2" in problems[1]
    assert "not in the manifest" in problems[2]
    assert ck.diff_manifests(expected, dict(expected)).ok


def test_diff_limited_to_repaired_files_ignores_the_rest():
    expected = {"a": _entry(b"1"), "b": _entry(b"2")}
    d = ck.diff_manifests(expected, {"a": _entry(b"1")}, only=["a"])
    assert d.ok


def test_manifest_digest_is_canonical_and_moves_with_content():
    m1 = ck.make_manifest({"b": _entry(b"2"), "a": _entry(b"1")})
    m2 = ck.make_manifest({"a": _entry(b"1"), "b": _entry(b"2")})
    assert ck.manifest_digest(m1) == ck.manifest_digest(m2)
    assert ck.manifest_digest(ck.make_manifest({"a": _entry(b"X"), "b": _entry(b"2")})) != ck.manifest_digest(m1)


def test_expected_tree_includes_the_manifest_file_itself():
    text = json.dumps(ck.make_manifest({"a": _entry(b"1")}))
    tree = ck.expected_tree(text)
    assert tree[ck.MANIFEST_NAME] == _entry(text.encode()) and tree["a"] == _entry(b"1")


def test_manifest_with_escaping_or_malformed_paths_is_refused():
    for bad in ({"../etc/passwd": _entry(b"")}, {"/abs": _entry(b"")}, {"a//b": _entry(b"")}, {"a": {"size": 1}}):
        with pytest.raises(ValueError):
            ck.parse_manifest(json.dumps(ck.make_manifest(bad)))
    with pytest.raises(ValueError, match="not JSON"):
        ck.parse_manifest("{")


def test_node_script_writes_manifest_and_hashes_like_hashlib(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "model-00001-of-00001.safetensors").write_bytes(b"\x00" * 100)
    (tmp_path / "sub" / "tokenizer.json").write_text("{}")
    (tmp_path / ck.PARTIAL_DIR).mkdir()
    (tmp_path / ck.PARTIAL_DIR / "half").write_bytes(b"x")
    (tmp_path / "link").symlink_to("sub/tokenizer.json")
    src = open(ck.__file__).read()
    run = lambda *a: json.loads(subprocess.run([sys.executable, "-", str(tmp_path), *a], input=src, text=True,
                                                 capture_output=True, check=True, timeout=60).stdout)
    manifest = run("--write-manifest")
    assert sorted(manifest["files"]) == ["model-00001-of-00001.safetensors", "sub/tokenizer.json"]
    assert manifest["files"]["sub/tokenizer.json"] == _entry(b"{}")
    on_disk = (tmp_path / ck.MANIFEST_NAME).read_text()
    assert ck.manifest_digest(ck.parse_manifest(on_disk)) == ck.manifest_digest(manifest)
    # A receiver's listing includes the manifest file, and matches the expected tree exactly.
    assert ck.diff_manifests(ck.expected_tree(on_disk), run("--digests")["files"]).ok
    # Same-size rewrite in place, mtime kept: found.
    shard = tmp_path / "model-00001-of-00001.safetensors"
    st = shard.stat()
    with shard.open("r+b") as fh:
        fh.seek(50)
        fh.write(b"\x01")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    d = ck.diff_manifests(ck.expected_tree(on_disk), run("--digests", f"--only={shard.name}")["files"], only=[shard.name])
    assert d.differing == [shard.name]


def test_partial_dir_constant_matches_rsync_argv():
    assert ck.PARTIAL_DIR == remote.RSYNC_PARTIAL_DIR
