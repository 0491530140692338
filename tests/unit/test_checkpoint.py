"""Checkpoint verification from headers, on checkpoints written by the stand-in recipe scripts."""

import hashlib
import json
import os
import shutil
import subprocess
import sys

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


# -- staging beside the serving checkpoint, the switch, the tie to the base model ---------------


def _node_script(directory, *args):
    src = open(ck.__file__).read()
    done = subprocess.run([sys.executable, "-", str(directory), *map(str, args)], input=src, text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_step_one_digest_is_the_same_before_and_after_step_two(built, tmp_path):
    """hybrid_checkpoint's index digest, read from a checkpoint step 2 already extended (a hand
    build), is the one step 1 records right after building: adoption records what the step would."""
    root, src, out = built
    env = dict(os.environ, HF_HUB_CACHE=str(src.hub_cache))
    step1 = tmp_path / "step1"
    subprocess.run([sys.executable, root / "recipe" / SCRIPTS[0], "--gptq-dir", src.intel_snapshot,
                    "--fp8-repo", upstream.FP8_REPO, "--output", step1, "--force"], env=env, check=True,
                   capture_output=True)
    before = ck.weight_map_digests((step1 / ck.INDEX_NAME).read_text())
    after = ck.weight_map_digests((out / ck.INDEX_NAME).read_text())
    assert before["hybrid"] == after["hybrid"] and before["full"] != after["full"]
    # Formatting and key order do not count; a key does.
    idx = json.loads((out / ck.INDEX_NAME).read_text())
    assert ck.weight_map_digests(json.dumps(idx, sort_keys=True))["full"] == after["full"]
    idx["weight_map"]["extra"] = "model-00001-of-00004.safetensors"
    assert ck.weight_map_digests(json.dumps(idx))["hybrid"] != after["hybrid"]
    assert _node_script(out, "--index-digests") == after
    with pytest.raises(ValueError, match="unreadable"):
        ck.weight_map_digests("{}")


def test_staging_copy_links_shards_and_step_two_there_leaves_the_serving_copy_alone(built, tmp_path):
    root, src, out = built
    serving = tmp_path / "serving"
    shutil.copytree(out, serving)
    (serving / ck.MANIFEST_NAME).write_text("{}")
    (serving / ck.PARTIAL_DIR).mkdir()
    (serving / ck.PARTIAL_DIR / "half").write_bytes(b"x")
    before = _tree(serving)
    staging = tmp_path / ".serving.staging"
    done = _node_script(staging, "--stage-from", serving)
    assert sorted(done["linked"]) == sorted(p.name for p in serving.glob("model-*-of-*.safetensors"))
    assert ck.INDEX_NAME in done["copied"] and "config.json" in done["copied"]
    for name in done["linked"]:
        assert (staging / name).stat().st_ino == (serving / name).stat().st_ino
    assert (staging / ck.INDEX_NAME).stat().st_ino != (serving / ck.INDEX_NAME).stat().st_ino
    assert not (staging / ck.MTP_FILE).exists() and not (staging / ck.MANIFEST_NAME).exists()
    assert not (staging / ck.PARTIAL_DIR).exists()
    # add-mtp-weights.py rewrites the index and the MTP file in the staging copy only.
    subprocess.run([sys.executable, root / "recipe" / SCRIPTS[1], "--source", src.intel_snapshot,
                    "--target", staging], check=True, capture_output=True)
    assert _tree(serving) == before
    assert verify_checkpoint(staging, expected_scales=src.expected_scales).ok
    with pytest.raises(subprocess.CalledProcessError):  # never onto an existing directory
        subprocess.run([sys.executable, "-", str(staging), "--stage-from", str(serving)], input=open(ck.__file__).read(),
                       text=True, capture_output=True, check=True, timeout=60)


def test_a_plain_directory_becomes_a_version_by_a_rename_and_a_link(tmp_path):
    serving = tmp_path / "ck"
    serving.mkdir()
    (serving / "v").write_text("weights")
    inode = (serving / "v").stat().st_ino
    held = open(serving / "v")
    done = _node_script(serving, "--make-version", "ck.v-0123456789abcdef")
    assert done == {"version": "ck.v-0123456789abcdef", "path": str(tmp_path / "ck.v-0123456789abcdef")}
    assert serving.is_symlink() and os.readlink(serving) == "ck.v-0123456789abcdef"
    assert (serving / "v").stat().st_ino == inode and held.read() == "weights"
    held.close()
    with pytest.raises(NotADirectoryError):  # a link is no plain directory: never converted twice
        ck.make_version(serving, "ck.v-fedcba9876543210")
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(ValueError):
        ck.make_version(other, "../escape")


def test_a_hybrid_checkpoint_is_tied_to_its_base_model(built, tmp_path):
    _, src, out = built
    tie = _node_script(out, "--compare-source", src.intel_snapshot)
    assert tie["differences"] == [] and tie["replaced"] == 144 and tie["source_fp8"] == upstream.FP8_REPO
    other = _copy(built, tmp_path)
    mtp = other / ck.MTP_FILE
    data = bytearray(mtp.read_bytes())
    data[-1] ^= 0xFF
    mtp.write_bytes(bytes(data))
    (other / "tokenizer_config.json").write_text("{}")
    config = json.loads((other / "config.json").read_text())
    del config["_hybrid_quant_info"]
    (other / "config.json").write_text(json.dumps(config))
    diffs = ck.compare_with_source(other, src.intel_snapshot)["differences"]
    assert any(d.startswith(f"{ck.MTP_FILE}: not the base model's") for d in diffs)
    assert any(d.startswith("tokenizer_config.json: differs") for d in diffs)
    assert any("no _hybrid_quant_info" in d for d in diffs)


def test_problems_say_what_is_wrong_and_never_advise_deleting_shards(built, tmp_path):
    """What mends a problem depends on where the checkpoint is (the runbook's procedures add it):
    the texts themselves must not tell anyone to delete shards or run a script on the serving copy."""
    ck_dir = _copy(built, tmp_path)
    (ck_dir / "model-00002-of-00004.safetensors").write_bytes(b"\xff" * 16)
    (ck_dir / ck.MTP_FILE).unlink()
    rep = verify_checkpoint(ck_dir, expected_scales=150)
    assert rep.problems
    for p in rep.problems:
        assert "delete" not in p and "add-mtp-weights.py" not in p and "rebuild" not in p, p
