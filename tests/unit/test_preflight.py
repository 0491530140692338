from spark_pipelines.core.preflight import Observations, evaluate


def obs(**kw):
    base = dict(free_gib=117.0, total_gib=121.69, gpu_state="idle", gpu_holder_pids=[1580], persistenced_pids=[1580],
                earlyoom_installed=False, running_exporters=[], disk_free_gib=500.0, page_cache_flushed=True)
    base.update(kw)
    return Observations(**base)


def run(o, build=False):
    return evaluate("spark1", o, gmu=0.85, max_gmu=0.85, profile_total_gib=121.69,
                    min_disk_gib=170.0 if build else 100.0)


def test_clean_node_is_ready():
    r = run(obs())
    assert r.passed and r.verdict == "ready" and r.memory.required_gib == 103.44


def test_each_hazard_blocks_with_its_fix():
    cases = {
        "gpu": (obs(gpu_state="wedged"), "cold-drain"),
        "gpu-holders": (obs(gpu_holder_pids=[1580, 4242]), "4242"),
        "earlyoom": (obs(earlyoom_installed=True), "apt purge earlyoom"),
        "exporters": (obs(running_exporters=["nvidia_gpu_exporter"]), "~9 GiB"),
        "disk": (obs(disk_free_gib=50.0), "need ~100"),
        "page-cache": (obs(page_cache_flushed=False), "drop_caches"),
        "memory": (obs(free_gib=99.0), "reboot"),
    }
    for name, (o, needle) in cases.items():
        r = run(o)
        assert not r.passed, name
        assert [c.name for c in r.failures()] == [name]
        assert needle in r.explain(), (name, r.explain())


def test_build_host_needs_more_disk():
    assert run(obs(disk_free_gib=150.0)).passed
    assert not run(obs(disk_free_gib=150.0), build=True).passed


def test_unknown_free_memory_blocks():
    r = run(obs(free_gib=None))
    assert not r.passed and "mem_get_info" in r.explain()
