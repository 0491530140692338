"""Checkpoint verification from headers, on checkpoints written by the stand-in recipe scripts."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

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
