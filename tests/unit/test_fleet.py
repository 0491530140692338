"""The fleet file's validation carries the runbook's rules, each refusal naming field, value and fix."""

import copy
from pathlib import Path

import pytest
import yaml

from spark_pipelines.core.fleet import FIX_ENV_VARS, FleetError, load_fleet, load_fleet_text, parse_fleet


def refused(data, *needles):
    with pytest.raises(FleetError) as e:
        parse_fleet(data, "f.yaml")
    msg = str(e.value)
    for n in needles:
        assert n in msg, msg
    return msg


def test_seed_loads_with_runbook_values():
    f = load_fleet("fleets/seed.yaml")
    assert f.node_names == ["spark1", "spark2"]
    assert f.build_node.name == "spark1"
    assert [f.profile_of(n).name for n in f.nodes] == ["founders", "gx10"]
    assert f.launch.gpu_memory_utilization == 0.85
    assert tuple(f.launch.env) == FIX_ENV_VARS
    assert f.pins.vllm_ref == "2a69949bd"
    assert f.pins.torch.abi == "cu130"
    assert f.bench.reference_tok_s == 51.6 and f.bench.loaded_concurrency == 8


def test_gmu_above_profile_max_refused(seed_data):
    seed_data["nodes"][1]["overrides"] = {"gpu_memory_utilization": 0.90}
    refused(seed_data, "spark2", "0.9", "gx10", "0.87", "109.52")


def test_gmu_below_080_refused_with_reason(seed_data):
    seed_data["launch"]["gpu_memory_utilization"] = 0.78
    refused(seed_data, "launch.gpu_memory_utilization", "0.78", "CUDA graph capture", "reboot")


def test_gmu_of_exactly_080_refused_too(seed_data):
    """The runbook's 0.80 is the value that OOMs in CUDA graph capture, not the lowest safe one."""
    seed_data["launch"]["gpu_memory_utilization"] = 0.80
    refused(seed_data, "launch.gpu_memory_utilization", "0.8", "at or below 0.8", "CUDA graph capture")
    seed_data["launch"]["gpu_memory_utilization"] = 0.82
    assert parse_fleet(seed_data, "f.yaml").launch.gpu_memory_utilization == 0.82  # above it: allowed (no runbook evidence against it)


def test_prefix_caching_refused(seed_data):
    seed_data["launch"]["extra_flags"] = ["--enable-chunked-prefill", "--enable-prefix-caching"]
    refused(seed_data, "--enable-prefix-caching", "Qwen3.5", "remove it")


def test_prefix_caching_refused_in_node_override(seed_data):
    seed_data["nodes"][0]["overrides"] = {"extra_flags": ["--enable-prefix-caching"]}
    refused(seed_data, "nodes[0] (spark1).overrides.extra_flags", "--enable-prefix-caching")


@pytest.mark.parametrize("var", FIX_ENV_VARS)
def test_founders_requires_all_six_fix_vars(seed_data, var):
    del seed_data["launch"]["env"][var]
    refused(seed_data, "spark1", var, "launch.env")


def test_gx10_tolerates_missing_fix_vars_but_not_jit_throttle(seed_data):
    # Only spark2 (gx10) in the fleet: the 2026-06-18 vars are optional there, the JIT throttle is not.
    seed_data["nodes"] = [dict(seed_data["nodes"][1], roles=["build", "serve"])]
    seed_data["launch"]["env"] = {"MAX_JOBS": "2", "FLASHINFER_NVCC_THREADS": "1"}
    assert parse_fleet(copy.deepcopy(seed_data)).nodes[0].name == "spark2"
    del seed_data["launch"]["env"]["MAX_JOBS"]
    refused(seed_data, "spark2", "MAX_JOBS", "FlashInfer JIT")


@pytest.mark.parametrize(
    "torch, needle",
    [
        ({"torchvision": "0.27.0+cu128"}, "mixes ABIs"),
        ({"index_url": "https://download.pytorch.org/whl/cu128"}, "use .../whl/cu130"),
        ({"index_url": "https://download.pytorch.org/whl/nightly/cu130"}, "mixes indexes"),
        ({"torch": "2.12.0"}, "pin the exact version"),
        ({"torch": "2.12.0+cpu", "torchvision": "0.27.0+cpu", "torchaudio": "2.11.0+cpu",
          "index_url": "https://download.pytorch.org/whl/cpu"}, "+cpu build"),
    ],
)
def test_torch_triple_mixing_refused(seed_data, torch, needle):
    seed_data["pins"]["torch"].update(torch)
    refused(seed_data, "pins.torch", needle)


def test_unknown_key_is_an_error(seed_data):
    seed_data["launch"]["gpu_memory_utilisation"] = 0.85
    refused(seed_data, "launch.gpu_memory_utilisation", "unknown key")


@pytest.mark.parametrize(
    "where, value",
    [
        (("nodes", 0, "name"), "spark1;rm -rf /"),
        (("nodes", 0, "host"), "spark1 -oProxyCommand=x"),
        (("nodes", 0, "user"), "$(id)"),
        (("launch", "image"), "vllm`id`"),
        (("launch", "container_name"), "a b"),
        (("launch", "models_dir"), "~/models; reboot"),
        (("pins", "vllm_ref"), "main && curl x"),
    ],
)
def test_shell_syntax_cannot_be_smuggled(seed_data, where, value):
    cur = seed_data
    for k in where[:-1]:
        cur = cur[k]
    cur[where[-1]] = value
    refused(seed_data, repr(value))


def test_env_value_with_quote_refused(seed_data):
    seed_data["launch"]["env"]["MAX_JOBS"] = "2'"
    refused(seed_data, "launch.env", "MAX_JOBS")


def test_exactly_one_build_node(seed_data):
    seed_data["nodes"][1]["roles"] = ["build", "serve"]
    refused(seed_data, "exactly one node", "build")


def test_duplicate_node_names(seed_data):
    seed_data["nodes"][1]["name"] = "spark1"
    refused(seed_data, "appears twice")


def test_unknown_hardware_profile(seed_data):
    seed_data["nodes"][1]["hardware"] = "gx11"
    refused(seed_data, "spark2", "gx11", "founders")


def test_load_errors_are_clear(tmp_path):
    with pytest.raises(FleetError, match="does not exist"):
        load_fleet(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [\n")
    with pytest.raises(FleetError, match="not valid YAML at line"):
        load_fleet(bad)
    bad.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(FleetError, match="expected a mapping"):
        load_fleet(bad)


# -- hostile input: each refused with one line naming the field, never a traceback -----------------


@pytest.mark.parametrize(
    "where, value, needle",
    [
        (("nodes", 1, "name"), "spark2\n", "nodes[1].name"),
        (("nodes", 0, "host"), "spark1\x00", "nodes[0] (spark1).host"),
        (("launch", "gpu_memory_utilization"), float("nan"), "launch.gpu_memory_utilization = nan"),
        (("launch", "gpu_memory_utilization"), float("inf"), "finite"),
        (("nodes", 1, "bench_floor_tok_s"), float("nan"), "bench_floor_tok_s"),
        (("bench", "reference_tok_s"), float("inf"), "bench.reference_tok_s"),
        (("launch", "model_dir"), "../../etc", "launch.model_dir"),
        (("launch", "model_dir"), "/etc", "launch.model_dir"),
        (("launch", "models_dir"), "~/models/../..", "'..'"),
        (("launch", "models_dir"), "~root/models", "launch.models_dir"),
        (("launch", "cache_mounts", 0, "container"), "~/.cache/vllm", "must be absolute"),
        (("pins", "patches", 0, "path"), "-rf", "path inside a repository"),
        (("pins", "vllm_ref"), "main..evil", "pins.vllm_ref"),
        (("pins", "torch", "torch"), "2.12.0+cu130\n", "pins.torch.torch"),
        (("launch", "port"), True, "boolean"),
        (("launch", "max_model_len"), 10**18, "launch.max_model_len"),
        (("launch", "extra_flags"), ["--max-num-seqs=8\n"], "launch.extra_flags"),
    ],
)
def test_hostile_values_refused_in_one_line(seed_data, where, value, needle):
    cur = seed_data
    for k in where[:-1]:
        cur = cur[k]
    cur[where[-1]] = value
    msg = refused(seed_data, needle)
    assert "\n" not in msg


def test_gmu_override_below_floor_is_refused_where_it_is_set(seed_data):
    seed_data["nodes"][1]["overrides"] = {"gpu_memory_utilization": 0.5}
    refused(seed_data, "nodes[1] (spark2).overrides.gpu_memory_utilization", "CUDA graph capture")


BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefg", "bcdefgh"))


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"\xff\xfe\x00n\x00o", "not UTF-8"),
        (BOMB.encode(), "anchors/aliases expand"),
        (b"a: &a [*a]\n", "refers to the value that contains it"),
        (("a: " + "[" * 200 + "]" * 200).encode(), "nested deeper"),
        (b"nodes: []\nnodes: []\n", "duplicate key 'nodes'"),
        (b"x: !!python/object/apply:os.system [id]\n", "remove the tag"),
        (b"- 1\n- 2\n", "expected a mapping"),
        (b"", "the file is empty"),
        (("a: " + "1" * 5000).encode(), "a = a number of 5000 characters (line 1): write a number in range"),
        (b"a: " + b"x" * (2 << 20), "over 1024 KiB"),
    ],
)
def test_pathological_files_give_one_line(tmp_path, content, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    with pytest.raises(FleetError) as e:
        load_fleet(bad)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_cli_plan_prints_one_line_and_exits_2(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text(open("fleets/seed.yaml").read().replace("gpu_memory_utilization: 0.85", "gpu_memory_utilization: .nan"))
    r = subprocess.run([sys.executable, "-m", "spark_pipelines.cli", "plan", "--fleet", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "launch.gpu_memory_utilization = nan" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_gateway_reload_mode_brings_its_command_and_an_explicit_one_wins(seed_data):
    gw = seed_data["gateway"]
    assert load_fleet("fleets/seed.yaml").gateway.reload == "graceful"
    del gw["reload_command"]
    assert parse_fleet(seed_data, "f.yaml").gateway.reload_command == ("docker", "compose", "kill", "-s", "SIGHUP",
                                                                       "litellm")
    del gw["reload"]  # a file from before the setting: today's restart, as it was
    assert parse_fleet(seed_data, "f.yaml").gateway.reload_command == ("docker", "compose", "restart", "litellm")
    gw.update(reload="restart", reload_command=["/usr/local/bin/proxy-restart"])
    assert parse_fleet(seed_data, "f.yaml").gateway.reload_command == ("/usr/local/bin/proxy-restart",)
    gw["reload"] = "hup"
    refused(seed_data, "gateway.reload", "graceful", "restart")
    gw["reload"] = "graceful"
    # A graceful reload not ready in time is followed by the runbook's restart (or the operator's).
    g = parse_fleet(seed_data, "f.yaml").gateway
    assert g.restart_command == ("docker", "compose", "restart", "litellm") and g.graceful_confirm_s == 30
    gw["graceful_confirm_s"] = 0
    refused(seed_data, "gateway.graceful_confirm_s")


def test_an_empty_file_and_a_misspelt_top_level_key_say_what_to_do(seed_data):
    with pytest.raises(FleetError, match=r"f.yaml: the file is empty; start from a copy of fleets/seed.yaml"):
        parse_fleet(None, "f.yaml")
    seed_data["nodess"] = seed_data.pop("nodes")
    msg = refused(seed_data, "nodess: unknown key; did you mean 'nodes'? Rename it")
    assert not msg.startswith("f.yaml: nodes:"), msg  # the misspelling first, not "nodes missing"
    seed_data["nodes"] = seed_data.pop("nodess")
    seed_data["gateway"]["colour"] = "blue"  # nothing close: the plain advice
    refused(seed_data, "gateway.colour: unknown key (typo?); remove it or check the spelling")


# -- issue 34, item 13: the hostile classes a hold-out of bad fleet files found ------------------

@pytest.mark.parametrize("host,needle", [
    ("256.1.1.1", "reads as an IPv4 address but is not one"),
    ("1.2.3", "reads as an IPv4 address"),  # inet_aton would read 1.2.0.3
    ("2130706433", "reads as an IPv4 address"),  # 127.0.0.1 to the resolver
    ("0x7f.1", "reads as an IPv4 address"),
    ("010.0.0.1", "without leading zeros"),  # octal to inet_aton: 8.0.0.1
    ("::::", "not an IPv6 address"),
    ("1:2:3:4:5:6:7:8:9", "not an IPv6 address"),
    (".".join(["a" * 60] * 5), "at most 253 characters"),
])
@pytest.mark.parametrize("field", [("nodes", 1, "host"), ("gateway", "host")])
def test_a_host_that_is_no_name_or_address_is_refused_by_field(seed_data, host, needle, field):
    data = copy.deepcopy(seed_data)
    target = data
    for k in field[:-1]:
        target = target[k]
    target[field[-1]] = host
    where = "nodes[1] (spark2).host" if field[0] == "nodes" else "gateway.host"
    refused(data, where, needle)


@pytest.mark.parametrize("host", ["10.0.0.12", "spark2", "spark2.lab.example", "fd00::12", "[fd00::12]", "gx10-a1"])
def test_real_names_and_addresses_still_load(seed_data, host):
    seed_data["nodes"][1]["host"] = host
    assert parse_fleet(seed_data).nodes[1].host == host


@pytest.mark.parametrize("where,value,needle", [
    (("launch", "cache_mounts", 0, "host"), "/", "shared directory"),
    (("launch", "cache_mounts", 0, "host"), "/etc", "/etc is the system's"),
    (("launch", "cache_mounts", 1, "host"), "/usr/lib/vllm", "/usr is the system's"),
    (("launch", "cache_mounts", 2, "host"), "/var/lib/docker", "/var/lib/docker is the system's"),
    (("launch", "cache_mounts", 0, "host"), "/proc/self", "/proc is the system's"),
    (("launch", "cache_mounts", 0, "host"), "~", "a home itself"),
    (("launch", "cache_mounts", 0, "host"), "~/.ssh", "~/.ssh"),
    (("launch", "cache_mounts", 0, "host"), "~/.cache", "shared directory"),  # holds this tool's markers
    (("launch", "models_dir"), "/boot", "/boot is the system's"),
    (("launch", "models_dir"), "/home/operator", "a home itself"),
    (("launch", "jit_cache_store"), "/dev/shm", "/dev is the system's"),
    (("launch", "jit_cache_store"), "/", "shared directory"),
])
def test_a_system_directory_named_as_a_cache_is_refused_by_field(seed_data, where, value, needle):
    target = seed_data
    for k in where[:-1]:
        target = target[k]
    target[where[-1]] = value
    field = ".".join(f"[{k}]" if isinstance(k, int) else k for k in where).replace(".[", "[")
    refused(seed_data, field, needle, "give a directory of its own")


def test_caches_of_their_own_still_load(seed_data):
    seed_data["launch"]["cache_mounts"][0]["host"] = "/data/cache/vllm"
    seed_data["launch"]["models_dir"] = "/srv/models/qwen"
    seed_data["launch"]["jit_cache_store"] = "/var/lib/spark-jit"
    f = parse_fleet(seed_data)
    assert f.launch.models_dir == "/srv/models/qwen"


@pytest.mark.parametrize("key,field", [("  port: 8000", "launch.port"), ("  repeats: 2 ", "bench.repeats"),
                                       ("  restart_budget: 3 ", "health.restart_budget")])
def test_a_number_of_thousands_of_digits_names_its_field(key, field):
    text = Path("fleets/seed.yaml").read_text()
    assert key in text
    name = key.split(":")[0]
    bad = text.replace(key, f"{name}: {'9' * 5000} ", 1)
    with pytest.raises(FleetError) as err:
        load_fleet_text(bad, "f.yaml")
    msg = str(err.value)
    assert msg.startswith(f"f.yaml: {field} = a number of 5000 characters") and "write a number in range" in msg
    assert "\n" not in msg
