"""A compile cache shipped from the build host's archive into a node's slots (runbook/jit_cache.py
`restore`), on the simulated fleet: to another node and to the build host itself (a serve node
too in the seed fleet: the soak found its first version refusing to copy a node to itself), and
an archive whose files no longer hash to its manifest is never placed."""

from __future__ import annotations

import json
import posixpath
import secrets

import pytest

from spark_pipelines.core import jit_cache as core
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.runbook import jit_cache

pytestmark = pytest.mark.slow

ENTRIES = {"0_vllm": {"torch_compile_cache/abc/graph.py": "kernel a\n", "cache_key": "k\n"},
           "1_triton": {"x/y.cubin": "cubin bytes\n"}}


@pytest.fixture
def archive(fleet_session):
    """A key's archive on the build host, as `back_up` leaves it (entries, manifest, COMPLETE)."""
    key = secrets.token_hex(8)
    build = fleet_session.fleet.build_node.name
    d = jit_cache.archived_dir(fleet_session, key)
    for entry, files in ENTRIES.items():
        for rel, text in files.items():
            path = posixpath.join(d, entry, rel)
            fleet_session.run(build, ["mkdir", "-p", posixpath.dirname(path)], log=False)
            fleet_session.put_text(build, path, text)
    jit_cache.write_archive_manifest(fleet_session, key, jit_cache.archive_digests(fleet_session, key, list(ENTRIES)),
                                     build)
    yield key
    fleet_session.run(build, ["rm", "-rf", "--", d], log=False)


def _mounts(session, node: str, key: str) -> tuple[list[str], list[str], str]:
    base = session.expand(node, f"~/jit-ship-test-{key}")
    mounts = [f"{base}/.cache/vllm", f"{base}/.triton"]
    for m in mounts:  # as `switch` leaves them before a restore: the parents, the empty slots
        session.run(node, ["mkdir", "-p", core.slot_path(m, key)], log=False)
    return mounts, [core.slot_path(m, key) for m in mounts], base


@pytest.mark.parametrize("where", ["serve", "build"])
def test_a_shipped_cache_lands_in_the_slots_hashed_and_sealed(fleet_session, node_pair, archive, where):
    node = fleet_session.fleet.node(node_pair.serve if where == "serve" else node_pair.build)
    mounts, slots, base = _mounts(fleet_session, node.name, archive)
    try:
        done = jit_cache.restore(fleet_session, node, archive, mounts, slots)
        assert done["bytes"] == sum(len(t) for files in ENTRIES.values() for t in files.values())
        for (entry, files), slot in zip(ENTRIES.items(), slots):
            for rel, text in files.items():
                assert fleet_session.read_text(node.name, posixpath.join(slot, rel)) == text
            assert fleet_session.exists(node.name, posixpath.join(slot, core.SEALED))
        assert not fleet_session.exists(node.name, f"{slots[0]}.incoming")  # the staging slot is gone
    finally:
        fleet_session.run(node.name, ["rm", "-rf", "--", base], log=False)


def test_an_archive_that_no_longer_hashes_to_its_manifest_is_never_placed(fleet_session, node_pair, archive):
    build = fleet_session.fleet.build_node.name
    manifest = json.loads(fleet_session.read_text(build, posixpath.join(jit_cache.archived_dir(fleet_session, archive),
                                                                        jit_cache.MANIFEST)))
    assert manifest["key"] == archive
    # A kernel rewritten on the build host after the manifest was made (same size, other bytes).
    fleet_session.put_text(build, posixpath.join(jit_cache.archived_dir(fleet_session, archive),
                                                 "1_triton/x/y.cubin"), "cubin BYTES\n")
    node = fleet_session.fleet.node(node_pair.serve)
    mounts, slots, base = _mounts(fleet_session, node.name, archive)
    try:
        with pytest.raises(RunbookError, match="does not hash to its manifest .*1_triton/x/y.cubin"):
            jit_cache.restore(fleet_session, node, archive, mounts, slots)
        for slot in slots:  # nothing placed: the slots as they were (empty), the staging gone
            assert fleet_session.run(node.name, ["ls", "-A", slot], log=False).stdout.strip() == ""
        assert not fleet_session.exists(node.name, f"{slots[0]}.incoming")
    finally:
        fleet_session.run(node.name, ["rm", "-rf", "--", base], log=False)
