"""The stand-in's JIT caches: a cold boot compiles and fills the mounted caches, a warm one loads them."""

import asyncio

from spark_sim import standin_jit


def dirs(tmp_path):
    return tuple((name, str(tmp_path / name), share) for name, _, share in standin_jit.CACHE_DIRS)


def boot(h, found, monkeypatch):
    lines = []
    monkeypatch.setenv("SIM_COLD_BOOT_FACTOR", "1.0")
    asyncio.run(standin_jit.load_or_compile(h, 0.05, lambda msg, where: lines.append(msg), found))
    return lines


def test_cold_then_warm_and_a_new_hash_is_cold_again(tmp_path, monkeypatch):
    d = dirs(tmp_path)
    mounted = {root for _, root, _ in d}
    h = standin_jit.kernel_hash("/models/q", 262144, {"method": "mtp"}, "FLASHINFER", "0.19.1")
    cold = standin_jit.entries(h, mounted, d)
    assert [e.warm for e in cold] == [False, False, False]
    lines = boot(h, cold, monkeypatch)
    assert any("Compiling a graph for dynamic shape" in ln for ln in lines)
    warm = standin_jit.entries(h, mounted, d)
    assert [e.warm for e in warm] == [True, True, True]
    assert any("Directly load the compiled graph(s)" in ln for ln in boot(h, warm, monkeypatch))
    # Another kernel-shaping flag: another hash, nothing to load.
    other = standin_jit.kernel_hash("/models/q", 131072, {"method": "mtp"}, "FLASHINFER", "0.19.1")
    assert other != h and not any(e.warm for e in standin_jit.entries(other, mounted, d))


def test_only_mounted_cache_dirs_are_modelled(tmp_path):
    d = dirs(tmp_path)
    assert standin_jit.entries("abc", set(), d) == []  # outside a container: the host's caches are never touched
    only_vllm = standin_jit.entries("abc", {d[0][1]}, d)
    assert [e.name for e in only_vllm] == ["vllm"]
    assert standin_jit.mount_points("/nonexistent/mountinfo") == set()


def test_a_cache_holding_only_another_hashs_kernels_fails_the_boot_as_a_stale_cache(tmp_path, monkeypatch):
    d = dirs(tmp_path)
    mounted = {root for _, root, _ in d}
    mine = standin_jit.kernel_hash("/models/q", 262144, {"method": "mtp"}, "FLASHINFER", "0.19.1")
    theirs = standin_jit.kernel_hash("/models/q", 131072, {"method": "mtp"}, "FLASHINFER", "0.19.1")
    for e in standin_jit.entries(theirs, mounted, d):
        e.fill(theirs)  # a cache compiled for another max-model-len, shipped here under the wrong key
    found = standin_jit.entries(mine, mounted, d)
    stale = standin_jit.stale(mine, found)
    assert stale is not None and "stale torch_compile cache" in str(stale) and theirs in str(stale)
    import pytest

    with pytest.raises(standin_jit.StaleCache):
        boot(mine, found, monkeypatch)
    assert not any(e.warm for e in standin_jit.entries(mine, mounted, d))  # nothing compiled or loaded
    # The right kernels beside the other ones (a node that ran both): warm, not stale.
    for e in found:
        e.fill(mine)
    again = standin_jit.entries(mine, mounted, d)
    assert standin_jit.stale(mine, again) is None and all(e.warm for e in again)
