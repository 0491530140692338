"""Fuzzing the fleet loader: the seed fleet, one field at a time replaced by a hostile value.

Whatever goes in, load_fleet / parse_fleet either refuse it with ONE line that names the field,
or the loaded fleet is safe: no control characters anywhere, finite numbers, no `..` in paths, and
every docker run argv survives core/remote's quoting argument for argument."""

import copy
import math
import shlex
import tempfile
import unicodedata
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spark_pipelines.core import layout, names, remote
from spark_pipelines.core.fleet import FleetError, load_fleet, load_fleet_text, parse_fleet
from spark_pipelines.core.launch import launch_spec

SEED = yaml.safe_load(Path("fleets/seed.yaml").read_text())


def _paths(value, loc=()):
    """Every leaf and every container of the seed, as a tuple of keys/indexes."""
    if loc:
        yield loc
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, loc + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, loc + (i,))


FIELDS = list(_paths(SEED))

HOSTILE = [
    "spark1\n", "a\x00b", "x\r", "$(id)", "`id`", "a;reboot", "a && b", "a|b", "a b", "'", '"', "\\",
    "..", "../..", "a/../../etc", "/etc/passwd", "~root/.ssh", "~/../..", "-rf", "--help", "",
    "ü", "\u202egnp.exe", "zero\u200bwidth", "x" * 5000, "1e400", "nan", ".nan", "inf",
    float("nan"), float("inf"), float("-inf"), 1e308, -1.0, 0.0, 10**30, -1, 0, 2**63, True, False, None,
    [], {}, ["x\n"], {"k": "v"}, {"BAD KEY": "x"}, [float("nan")],
    # issue 34's hold-out classes: no name or address, a system directory as a cache, giant numbers
    "256.1.1.1", "1.2.3", "2130706433", "0x7f.1", "010.0.0.1", "::::", "1:2:3:4:5:6:7:8:9",
    "/", "/etc", "/usr/lib", "/var/lib/docker", "/boot", "/proc/1", "~", "~/.ssh", "~/.cache", "/home/operator",
    10**400, -(10**400),
]

hostile = st.one_of(
    st.sampled_from(HOSTILE),
    st.text(max_size=40),
    st.floats(),
    st.integers(min_value=-(10**20), max_value=10**20),
)


def _set(data, loc, value):
    cur = data
    for k in loc[:-1]:
        cur = cur[k]
    cur[loc[-1]] = value


def _named(loc, msg: str) -> bool:
    keys = [k for k in loc if isinstance(k, str)]
    return bool(keys) and keys[-1] in msg


def _walk(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _walk(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _walk(v)
    else:
        yield value


def assert_safe(fleet):
    for v in _walk(fleet.model_dump()):
        if isinstance(v, str):
            assert not any(unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp") for c in v), repr(v)
        elif isinstance(v, float):
            assert math.isfinite(v), v
    for target in (*fleet.nodes, fleet.gateway):  # a name or an address, nothing the resolver reads otherwise
        names.check_host(target.host)
    for cache in (fleet.launch.models_dir, fleet.launch.jit_cache_store, *(m.host for m in fleet.launch.cache_mounts)):
        names.check_cache_dir(cache)
    for node in fleet.serve_nodes:
        spec = launch_spec(fleet, node)
        argv = spec.docker_run_argv()
        assert shlex.split(remote.quote_argv(argv)) == argv
        for host, container in spec.mounts:
            for p in (host, container, layout.hybrid_dir(fleet, node)):
                assert p.startswith("/") and ".." not in p.split("/"), p
        assert not spec.image.startswith("-") and not spec.container_name.startswith("-")


def check_one(data, loc, value):
    try:
        fleet = parse_fleet(data, "f.yaml")
    except FleetError as e:
        msg = str(e)
        assert "\n" not in msg, msg
        assert msg.startswith("f.yaml: "), msg
        assert _named(loc, msg), f"mutating {loc} to {value!r}: {msg}"
        return
    assert_safe(fleet)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loc=st.sampled_from(FIELDS), value=hostile)
def test_hostile_field_is_refused_by_name_or_safe(loc, value):
    data = copy.deepcopy(SEED)
    _set(data, loc, value)
    check_one(data, loc, value)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loc=st.sampled_from(FIELDS), value=hostile)
def test_hostile_field_through_the_yaml_file(loc, value):
    data = copy.deepcopy(SEED)
    _set(data, loc, value)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", encoding="utf-8") as fh:
        yaml.safe_dump(data, fh, allow_unicode=True)
        fh.flush()
        try:
            fleet = load_fleet(fh.name)
        except FleetError as e:
            assert "\n" not in str(e) and _named(loc, str(e)), f"mutating {loc} to {value!r}: {e}"
            return
    assert_safe(fleet)


@settings(max_examples=150, deadline=None)
@given(raw=st.one_of(st.binary(max_size=300), st.text(max_size=300).map(str.encode)))
def test_any_bytes_give_fleet_error_or_fleet(raw):
    with tempfile.NamedTemporaryFile("wb", suffix=".yaml") as fh:
        fh.write(raw)
        fh.flush()
        try:
            load_fleet(fh.name)
        except FleetError as e:
            assert "\n" not in str(e)


@settings(max_examples=100, deadline=None)
@given(cut=st.integers(min_value=0, max_value=len(Path("fleets/seed.yaml").read_bytes())),
       junk=st.sampled_from([b"", b"\n", b"\xff", b"&a", b"*a", b"!!python/object:os.system", b"[", b"{", b": :"]))
def test_truncated_or_spliced_seed_file(cut, junk):
    raw = Path("fleets/seed.yaml").read_bytes()
    with tempfile.NamedTemporaryFile("wb", suffix=".yaml") as fh:
        fh.write(raw[:cut] + junk + raw[cut:])
        fh.flush()
        try:
            assert_safe(load_fleet(fh.name))
        except FleetError as e:
            assert "\n" not in str(e)


@pytest.mark.parametrize("loc", [("nodes", 0, "name"), ("launch", "image"), ("launch", "models_dir"),
                                 ("launch", "env", "MAX_JOBS"), ("gateway", "host"), ("pins", "vllm_ref"),
                                 ("nodes", 1, "host"), ("launch", "cache_mounts", 0, "host"),
                                 ("launch", "jit_cache_store"), ("launch", "port"), ("bench", "repeats")])
def test_every_hostile_string_on_named_fields(loc):
    for value in HOSTILE:
        data = copy.deepcopy(SEED)
        _set(data, loc, value)
        check_one(data, loc, value)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loc=st.sampled_from([loc for loc in FIELDS if type(loc[-1]) is str]),
       digits=st.integers(min_value=101, max_value=6000))
def test_a_giant_integer_anywhere_in_the_file_names_its_field(loc, digits):
    """Python refuses to read an integer of over 4300 digits (a ValueError naming nothing); no
    setting takes over 100: either way the message names where it is."""
    data = copy.deepcopy(SEED)
    _set(data, loc, 987654321)  # a sentinel no seed value has
    text = yaml.safe_dump(data, sort_keys=False).replace("987654321", "9" * digits, 1)
    try:
        load_fleet_text(text, "f.yaml")
    except FleetError as e:
        msg = str(e)
        assert "\n" not in msg and _named(loc, msg), f"{loc}: {msg}"
        return
    raise AssertionError(f"{loc}: a {digits}-digit number was accepted")
