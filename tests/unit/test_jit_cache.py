"""The JIT cache key, the node-side probe (run by a real sh on temp dirs) and the deploy's plan."""

import os
import subprocess

import pytest

from spark_pipelines.core import jit_cache as jc
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.launch import launch_spec

FLEET = load_fleet("fleets/seed.yaml")


def spec_args(**launch):
    f = FLEET.model_copy(update={"launch": FLEET.launch.model_copy(update=launch)})
    sp = launch_spec(f, f.nodes[0])
    return sp.serve_args, sp.env


def key(image="sha256:aa", ckpt="idx1", **launch):
    args, env = spec_args(**launch)
    return jc.cache_key(image, ckpt, args, env)


def test_the_key_follows_what_kernels_depend_on_and_nothing_else():
    base = key()
    assert key() == base  # stable
    assert key(image="sha256:bb") != base
    assert key(ckpt="idx2") != base
    assert key(max_model_len=131072) != base  # CUDA-graph sizes
    assert key(attention_backend="FLASH_ATTN") != base
    # Serving-only settings keep the cache (GMU, port, name, compile parallelism).
    assert key(gpu_memory_utilization=0.88) == base
    assert key(port=8001, served_model_name="other") == base
    assert key(env={**FLEET.launch.env, "MAX_JOBS": "4"}) == base
    assert key(env={**FLEET.launch.env, "VLLM_USE_FLASHINFER_SAMPLER": "1"}) != base
    assert key(extra_flags=("--enable-auto-tool-choice",)) == base
    assert key(extra_flags=("--kv-cache-dtype", "fp8")) != base
    with pytest.raises(ValueError, match="image id and the checkpoint"):
        jc.cache_key("", "idx", [], {})


def test_kernel_args_drop_values_with_their_flags():
    args = ["serve", "/m", "--port", "8000", "--enforce-eager", "--gpu-memory-utilization=0.85", "--max-model-len", "4"]
    assert jc.kernel_args(args) == ["serve", "/m", "--enforce-eager", "--max-model-len", "4"]


def probe(tmp_path, key, mounts):
    r = subprocess.run(jc.probe_argv(key, [str(m) for m in mounts]), capture_output=True, text=True, check=True)
    return jc.parse_probe(r.stdout, [str(m) for m in mounts], key)


def test_probe_reads_links_dirs_and_slots(tmp_path):
    vllm, fi, tri = tmp_path / "vllm", tmp_path / "flashinfer", tmp_path / ".triton"
    # vllm: linked to a sealed slot of key k1; flashinfer: a hand-made real dir; triton: absent.
    slot = tmp_path / "vllm.jit-k1"
    slot.mkdir()
    (slot / "graph").write_text("x")
    (slot / jc.SEALED).write_text("")
    os.symlink("vllm.jit-k1", vllm)
    fi.mkdir()
    (fi / "op.so").write_text("x")
    states = probe(tmp_path, "k1", [vllm, fi, tri])
    assert [s.kind for s in states] == ["link", "dir", "absent"]
    assert states[0].target == "vllm.jit-k1" and jc.key_of_target(str(vllm), states[0].target) == "k1"
    assert states[0].slot_exists and states[0].slot_sealed and not states[0].slot_empty
    assert not states[1].empty and not states[1].slot_exists
    p = jc.plan("k1", states, archived=False)
    assert p.verdict == "cold" and p.set_aside == (str(fi),) and "not used" in p.why
    assert jc.plan("k1", states, archived=True).verdict == "restore"


def test_plan_warm_only_when_every_slot_is_sealed_and_filled(tmp_path):
    mounts = [tmp_path / "vllm", tmp_path / "flashinfer"]
    for m in mounts:
        s = tmp_path / f"{m.name}.jit-k2"
        s.mkdir()
        (s / "k").write_text("x")
        (s / jc.SEALED).write_text("")
        os.symlink(f"{m.name}.jit-k1", m)  # pointing at another (stale) key
    p = jc.plan("k2", probe(tmp_path, "k2", mounts), archived=False)
    assert p.verdict == "warm" and "switches to" in p.why
    (tmp_path / "flashinfer.jit-k2" / jc.SEALED).unlink()  # a boot that never got healthy
    p = jc.plan("k2", probe(tmp_path, "k2", mounts), archived=False)
    assert p.verdict == "cold" and "another image" in p.why


def test_odd_things_in_a_mounts_place_are_refused_and_probe_output_checked(tmp_path):
    f = tmp_path / "vllm"
    f.write_text("a file")
    with pytest.raises(ValueError, match="neither a directory nor a symlink"):
        jc.plan("k", probe(tmp_path, "k", [f]), archived=False)
    with pytest.raises(ValueError, match="printed 0 lines for 1 mounts"):
        jc.parse_probe("", ["/x"], "k")
    with pytest.raises(ValueError):
        jc.probe_argv("k", ["/x; rm -rf /"])
    assert jc.slot_path("/home/op/.triton", "abc") == "/home/op/.triton.jit-abc"


def test_stale_slots_are_every_slot_of_the_mount_but_the_kept_ones():
    from spark_pipelines.core.jit_cache import stale_slots

    entries = ["vllm", "vllm.jit-aaaa", "vllm.jit-bbbb", "vllm.jit-aaaa.stale-20261204", "vllm.jit-cccc.failed-1",
               "vllm.jit-unkeyed", "flashinfer.jit-aaaa", "huggingface", "vllm.jitter", "pip"]
    keep = ["/home/op/.cache/vllm.jit-aaaa", "vllm.jit-bbbb"]
    # a hand-made cache set aside (`unkeyed`) is the operator's: never wiped
    assert stale_slots("/home/op/.cache/vllm", entries, keep) == [
        "vllm.jit-aaaa.stale-20261204", "vllm.jit-cccc.failed-1"]
    # another mount's slots and anything that is not a slot are never touched
    assert stale_slots("/home/op/.cache/flashinfer", entries, ["flashinfer.jit-aaaa"]) == []


def test_launch_hash_is_alike_on_nodes_launched_alike_and_moves_with_a_kernel_flag(seed_data):
    import copy

    from spark_pipelines.core.fleet import parse_fleet
    from spark_pipelines.core.jit_cache import launch_hash
    from spark_pipelines.core.launch import launch_spec

    fleet = parse_fleet(seed_data, "f.yaml")
    specs = [launch_spec(fleet, n) for n in fleet.serve_nodes]
    assert launch_hash(specs[0].serve_args, specs[0].env) == launch_hash(specs[1].serve_args, specs[1].env)
    # GMU, port and served name do not shape kernels: a launch differing only there compares
    alike = copy.deepcopy(seed_data)
    alike["launch"].update(gpu_memory_utilization=0.84, port=8001, served_model_name="other-name")
    spec = launch_spec(parse_fleet(alike, "f.yaml"), fleet.serve_nodes[0])
    assert spec.fingerprint != specs[0].fingerprint
    assert launch_hash(spec.serve_args, spec.env) == launch_hash(specs[0].serve_args, specs[0].env)
    other = copy.deepcopy(seed_data)
    other["launch"]["attention_backend"] = "TRITON_ATTN"
    spec = launch_spec(parse_fleet(other, "f.yaml"), fleet.serve_nodes[0])
    assert launch_hash(spec.serve_args, spec.env) != launch_hash(specs[0].serve_args, specs[0].env)
