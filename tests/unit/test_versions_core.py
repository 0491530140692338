"""Checkpoint versions, the pure half (core/versions.py): names, the probe's output, the disk a copy
needs, and which versions garbage collection may remove."""

import hashlib
import json
import subprocess

import pytest

from spark_pipelines.core import jit_cache
from spark_pipelines.core import versions as v
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.launch import launch_spec

D1 = hashlib.sha256(b"one").hexdigest()
D2 = hashlib.sha256(b"two").hexdigest()
D3 = hashlib.sha256(b"three").hexdigest()
MODEL = "qwen35-122b-hybrid-int4fp8"
SERVING = f"/home/op/models/{MODEL}"


def test_a_version_is_named_by_its_manifest_digest_beside_the_runbooks_path():
    assert v.version_path(SERVING, D1) == f"/home/op/models/{MODEL}.v-{D1[:16]}"
    assert v.incoming_path(SERVING, D1) == f"/home/op/models/.{MODEL}.v-{D1[:16]}.incoming"
    assert v.digest_of(MODEL, f"{MODEL}.v-{D1[:16]}") == D1[:16]
    assert v.digest_of(MODEL, f"{MODEL}.v-unkeyed-1700000000") == "unkeyed-1700000000"
    # Not ours: another model's version, a staging dir, a name that is no digest.
    assert v.digest_of(MODEL, f"other.v-{D1[:16]}") is None
    assert v.digest_of(MODEL, f".{MODEL}.staging") is None
    assert v.digest_of(MODEL, f"{MODEL}.v-../../etc") is None
    assert v.same(D1, D1[:16]) and not v.same(D1, D2) and not v.same(None, D1)
    with pytest.raises(ValueError):
        v.version_name(MODEL, "not-a-digest")


def listing(*lines: str) -> str:
    return "\n".join(lines) + "\n"


def test_the_probe_output_reads_back_with_the_serving_version():
    held = v.parse_probe(SERVING, listing(
        f"serving\tlink\t{MODEL}.v-{D2[:16]}",
        f"version\t{MODEL}.v-{D1[:16]}\t1\t1000\t100",
        f"version\t{MODEL}.v-{D2[:16]}\t1\t1200\t200",
        f"version\tsomething-else.v-{D3[:16]}\t1\t5\t300",  # not a version of this model: ignored
        f"incoming\t.{MODEL}.v-{D3[:16]}.incoming",
        "total\t1300", "free\t5000"))
    assert held.kind == "link" and held.serving == D2[:16]
    assert [x.digest for x in held.versions] == [D1[:16], D2[:16]]
    assert held.holds(D2).kib == 1200 and held.holds(D3) is None
    assert held.total_kib == 1300 and held.free_kib == 5000 and held.incoming == (f".{MODEL}.v-{D3[:16]}.incoming",)
    plain = v.parse_probe(SERVING, listing("serving\tdir\t", "total\t0", "free\t9"))
    assert plain.kind == "dir" and plain.serving is None and plain.versions == ()
    with pytest.raises(ValueError, match="unreadable line"):
        v.parse_probe(SERVING, f"version\t{MODEL}.v-{D1[:16]}\t1\tnot-a-number\t1\n")


def test_the_probe_script_runs_and_reads_a_real_models_folder(tmp_path):
    models = tmp_path / "models"
    (models / f"{MODEL}.v-{D1[:16]}").mkdir(parents=True)
    (models / f"{MODEL}.v-{D1[:16]}" / "shard").write_bytes(b"x" * 8192)
    (models / f"{MODEL}.v-{D1[:16]}" / ".spark-manifest.json").write_text("{}")
    (models / f"{MODEL}.v-{D2[:16]}").mkdir()
    (models / f".{MODEL}.v-{D3[:16]}.incoming").mkdir()
    (models / MODEL).symlink_to(f"{MODEL}.v-{D1[:16]}")
    serving = str(models / MODEL)
    out = subprocess.run(v.probe_argv(serving, ".spark-manifest.json"), capture_output=True, text=True, check=True)
    held = v.parse_probe(serving, out.stdout)
    assert held.serving == D1[:16] and held.kind == "link"
    assert {x.digest: x.has_manifest for x in held.versions} == {D1[:16]: True, D2[:16]: False}
    assert held.holds(D1).kib >= 8 and held.free_kib and held.incoming


def test_a_copy_writes_only_what_the_serving_version_does_not_hold_alike():
    files = {"a.safetensors": {"size": 100, "sha256": "1" * 64}, "b.safetensors": {"size": 50, "sha256": "2" * 64},
             "config.json": {"size": 5, "sha256": "3" * 64}}
    assert v.bytes_to_write(files, None) == 155
    # A weights-only change: the config is the same file, hard-linked, not written.
    assert v.bytes_to_write(files, {"config.json": {"size": 5, "sha256": "3" * 64},
                                    "a.safetensors": {"size": 100, "sha256": "9" * 64}}) == 150
    ok = v.space_for(150 << 20, free_kib=(200 << 20) // 1024)
    assert ok.ok
    short = v.space_for(150 << 30, free_kib=(10 << 30) // 1024)
    assert not short.ok
    words = short.words("spark2", "/home/op/models", "the checkpoint version abc")
    assert "spark2" in words and "157.5 GiB" in words and "10.0 GiB free" in words and "checkpoint_gc_job" in words
    assert v.space_for(1 << 40, None).ok  # unreadable free space decides nothing


def held_with(*versions: tuple[str, int], serving: str | None = None) -> v.NodeCheckpoints:
    return v.NodeCheckpoints(SERVING, "link" if serving else "absent",
                             f"{MODEL}.v-{serving[:16]}" if serving else None,
                             tuple(v.Version(d[:16], f"{MODEL}.v-{d[:16]}", 1000, t, True) for d, t in versions))


def test_garbage_collection_never_removes_what_serves_or_what_a_revert_needs():
    held = held_with((D1, 100), (D2, 200), (D3, 300), serving=D3)
    keep = v.Protected()
    plan = v.gc_plan(held, keep, keep=1)
    assert [n for n, _ in plan.remove] == [f"{MODEL}.v-{D1[:16]}", f"{MODEL}.v-{D2[:16]}"]
    assert plan.keep[0][1].startswith("serving")
    keep.add(D1, "last known good (bench of yesterday)")
    keep.add(D2, "a rollout's revert puts it back")
    plan = v.gc_plan(held, keep, keep=1)
    assert plan.remove == () and dict(plan.keep)[f"{MODEL}.v-{D1[:16]}"] == "last known good (bench of yesterday)"
    # keep=2: the two newest stay whatever else is true.
    plan = v.gc_plan(held_with((D1, 100), (D2, 200), (D3, 300), serving=D3), v.Protected(), keep=2)
    assert [n for n, _ in plan.remove] == [f"{MODEL}.v-{D1[:16]}"]
    assert any(line.startswith("remove ") for line in plan.lines())
    with pytest.raises(ValueError):
        v.gc_plan(held, keep, keep=0)


def test_the_launch_mounts_the_resolved_version_read_only_and_its_fingerprint_ignores_it():
    fleet = load_fleet("fleets/seed.yaml")
    node = fleet.serve_nodes[1]
    spec = launch_spec(fleet, node)
    argv = spec.docker_run_argv()
    assert f"{spec.mounts[0][0]}:/models" in argv  # the runbook's own mount without a version
    version = v.version_path(f"{spec.mounts[0][0]}/{MODEL}", D1)
    pinned = type(spec)(**{**spec.__dict__, "model_source": version})
    argv = pinned.docker_run_argv()
    assert f"{version}:/models/{MODEL}:ro" in argv and f"{spec.mounts[0][0]}:/models" not in argv
    image_at = len(argv) - 1 - argv[::-1].index(spec.image)
    assert argv[image_at + 1:image_at + 3] == ["serve", f"/models/{MODEL}"]  # serve's path is unchanged
    assert pinned.fingerprint == spec.fingerprint


def manifest(files: dict[str, bytes]) -> dict:
    return {n: {"size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in files.items()}


def test_new_weights_on_the_same_architecture_keep_the_jit_key():
    config = json.dumps({"model_type": "qwen3_5_moe", "num_hidden_layers": 48}).encode()
    index = json.dumps({"weight_map": {"a": "model-00001-of-00001.safetensors"}}).encode()
    before = manifest({"config.json": config, "model.safetensors.index.json": index,
                       "model-00001-of-00001.safetensors": b"weights one", "tokenizer_config.json": b"{}"})
    retrained = manifest({"config.json": config, "model.safetensors.index.json": index,
                          "model-00001-of-00001.safetensors": b"weights two", "tokenizer_config.json": b"{}"})
    requantized = manifest({"config.json": config.replace(b"48", b"47"), "model.safetensors.index.json": index,
                            "model-00001-of-00001.safetensors": b"weights one", "tokenizer_config.json": b"{}"})
    a, b, c = (jit_cache.architecture(m) for m in (before, retrained, requantized))
    assert a == b and a != c and a.startswith("arch-")
    assert jit_cache.architecture({"config.json": before["config.json"]}) is None  # no index: not told apart
    args, env = ["serve", "/models/m", "--max-model-len", "262144"], {"VLLM_MARLIN_USE_ATOMIC_ADD": "1"}
    assert jit_cache.cache_key("sha256:img", a, args, env) == jit_cache.cache_key("sha256:img", b, args, env)
    assert jit_cache.cache_key("sha256:img", a, args, env) != jit_cache.cache_key("sha256:img", c, args, env)


def test_a_rejected_version_is_matched_by_image_checkpoint_and_the_nodes_own_launch():
    from spark_pipelines.state.markers import RejectedVersion

    r = RejectedVersion(image_id="sha256:new", checkpoint=D2[:16], fingerprint="spec-a", node="spark1",
                        gate="quality", why="answers garbage")
    assert r.matches("sha256:new", D2, "spec-a")
    assert not r.matches("sha256:old", D2, "spec-a")  # the image before: not rejected
    assert not r.matches("sha256:new", D1, "spec-a")  # another checkpoint on the same image
    assert not r.matches("sha256:new", D2, "spec-b")  # another launch spec (this node's own override)
