"""Checkpoint versions on a real node (the simulator's sshd, its user's files): a plain directory
becomes a version by a rename that a reader holding its files never notices; the runbook's path is
pointed at a version and back atomically; garbage collection's check removes nothing and its
removal spares what serves, what a rollout point names and the last known good; a copy is refused
for disk space before anything is written."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

import pytest

from spark_pipelines.core import checkpoint as checkpoint_core
from spark_pipelines.core import layout
from spark_pipelines.core import versions as core
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.resources.ssh import FleetSession, SshSettings
from spark_pipelines.runbook import versions
from spark_pipelines.state import markers
from tests.plugins import faults as fx

pytestmark = pytest.mark.slow
NODE = "spark2"


def write_version(root: Path, files: dict[str, bytes], uid: int) -> str:
    """A checkpoint directory with its manifest, as a copy leaves it; returns the manifest digest."""
    root.mkdir(parents=True)
    entries = {}
    for name, data in files.items():
        (root / name).write_bytes(data)
        entries[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest = checkpoint_core.make_manifest(entries)
    (root / checkpoint_core.MANIFEST_NAME).write_text(json.dumps(manifest))
    for p in [root, *root.iterdir()]:
        os.chown(p, uid, uid)
    return checkpoint_core.manifest_digest(manifest)


@pytest.fixture()
def node(sim_fleet):
    fleet = load_fleet(sim_fleet.fleet_file)
    n = fleet.node(NODE)
    models = Path(layout.hybrid_dir(fleet, n)).parent
    saved = models.with_name("models.saved-by-test")
    if models.exists():
        models.rename(saved)
    models.mkdir()
    uid = models.parent.stat().st_uid
    os.chown(models, uid, uid)
    with FleetSession(fleet, SshSettings(connect_retries=1)) as s:
        try:
            yield {"s": s, "node": n, "models": models, "uid": uid, "sim": sim_fleet, "fleet": fleet}
        finally:
            for step in (markers.ROLLOUT_POINT, markers.KNOWN_GOOD):
                markers.clear(s, n, step)
    import shutil

    shutil.rmtree(models)
    if saved.exists():
        saved.rename(models)


def test_a_plain_directory_becomes_a_version_and_the_path_moves_between_versions(node):
    s, n, models, uid = node["s"], node["node"], node["models"], node["uid"]
    serving = models / "qwen35-122b-hybrid-int4fp8"
    d1 = write_version(serving, {"config.json": b"{}", "model-00001-of-00001.safetensors": b"one" * 100}, uid)
    inode = (serving / "model-00001-of-00001.safetensors").stat().st_ino
    held = open(serving / "model-00001-of-00001.safetensors", "rb")  # a reader that never lets go
    stop, reads = threading.Event(), []

    def reader():  # the runbook's path must name a whole checkpoint at every instant
        while not stop.is_set():
            try:
                reads.append((serving / "config.json").read_bytes())
            except OSError as e:
                reads.append(repr(e).encode())

    name = versions.make_version(s, n)
    assert name == core.version_name(serving.name, d1)
    assert serving.is_symlink() and os.readlink(serving) == name
    assert (models / name / "model-00001-of-00001.safetensors").stat().st_ino == inode  # renamed, not copied
    assert held.read() == b"one" * 100
    assert versions.make_version(s, n) is None  # a link is converted once
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        d2 = write_version(models / core.version_name(serving.name, hashlib.sha256(b"x").hexdigest()),
                           {"config.json": b"{}", "model-00001-of-00001.safetensors": b"two" * 100}, uid)
        # write_version named it by a fake digest; the real one is in its manifest: name it so.
        other = models / core.version_name(serving.name, d2)
        (models / core.version_name(serving.name, hashlib.sha256(b"x").hexdigest())).rename(other)
        for _ in range(20):  # back and forth under the reader
            moved = versions.point(s, n, other.name)
            assert moved.before == name and os.readlink(serving) == other.name
            said = versions.point_back(s, n, moved.before)
            assert "checkpoint put back" in said and os.readlink(serving) == name
    finally:
        stop.set()
        t.join(5)
        held.close()
    assert reads and set(reads) == {b"{}"}, {r for r in reads if r != b"{}"}
    with pytest.raises(RunbookError, match="no checkpoint version .* run node_artifacts"):
        versions.point(s, n, core.version_name(serving.name, hashlib.sha256(b"absent").hexdigest()))


def test_gc_check_removes_nothing_and_gc_spares_what_serves_a_revert_and_the_last_known_good(node):
    s, n, models, uid = node["s"], node["node"], node["models"], node["uid"]
    model = "qwen35-122b-hybrid-int4fp8"
    digests = []
    for i in range(5):
        tmp = models / f"tmp{i}"
        d = write_version(tmp, {"config.json": b"{}", "w.safetensors": bytes([i]) * 2048}, uid)
        tmp.rename(models / core.version_name(model, d))
        os.utime(models / core.version_name(model, d), (1_700_000_000 + i, 1_700_000_000 + i))
        digests.append(d)
    (models / model).symlink_to(core.version_name(model, digests[0]))  # serving: the oldest
    markers.write_typed(s, n, markers.ROLLOUT_POINT, markers.RolloutPoint(
        checkpoint_link=core.version_name(model, digests[1]), checkpoint_now=core.version_name(model, digests[0])))
    markers.write_typed(s, n, markers.KNOWN_GOOD, markers.KnownGood(checkpoint=digests[2][:16], since="yesterday"))
    before = sorted(p.name for p in models.iterdir())
    check = versions.collect(s, n, keep=1, check=True)
    assert sorted(p.name for p in models.iterdir()) == before  # the check removed nothing
    assert [name for name, _ in check.plan.remove] == [core.version_name(model, digests[3])]
    kept = dict(check.plan.keep)
    assert kept[core.version_name(model, digests[0])].startswith("serving")
    assert "revert" in kept[core.version_name(model, digests[1])]
    assert "last known good" in kept[core.version_name(model, digests[2])]
    assert "newest" in kept[core.version_name(model, digests[4])]
    done = versions.collect(s, n, keep=1, check=False)
    assert done.removed == [core.version_name(model, digests[3])] and not done.failed
    assert not (models / core.version_name(model, digests[3])).exists()
    assert all((models / core.version_name(model, d)).is_dir() for i, d in enumerate(digests) if i != 3)


def test_a_copy_is_refused_for_disk_space_before_anything_is_written(node):
    s, n, models = node["s"], node["node"], node["models"]
    files = {"w.safetensors": {"size": 64 << 20, "sha256": "1" * 64}, "config.json": {"size": 2, "sha256": "2" * 64}}
    text = json.dumps(checkpoint_core.make_manifest(files))
    digest = checkpoint_core.manifest_digest(checkpoint_core.make_manifest(files))
    with fx.tmpfs_over(node["sim"].node(NODE), models, 8 << 20):
        with pytest.raises(RunbookError) as refused:
            versions.require_space(s, n, text, digest, "the checkpoint version test")
        words = refused.value.description
        assert NODE in words and "needs 67.2 MiB" in words and "free" in words and "checkpoint_gc_job" in words
        assert s.run(NODE, ["ls", "-A", str(models)], log=False).stdout.strip() == ""
