"""Faults while the checkpoint reaches a serving node: the SSH connection dropped mid-copy, the
receiving disk full, a shard damaged in place with its size kept. Nothing built or already
copied is lost, the node keeps serving, and a rerun repairs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.faults.conftest import deployed_id, failure_text
from tests.plugins import faults as fx

pytestmark = pytest.mark.slow


def checkpoint_bytes(sim, node="spark1") -> int:
    return sum(p.stat().st_size for p in fx.hybrid_dir(sim, node).rglob("*") if p.is_file())


def seen_by_sessions(m, path: Path) -> Path:
    """`path` as the node's SSH sessions see it (through its sshd's mount namespace)."""
    pid = int(m.sshd_pidfile.read_text())
    return Path(f"/proc/{pid}/root") / str(path).lstrip("/")


def received_version(m, models: Path) -> Path:
    """The checkpoint version a copy left under `models` as the node's sessions see it."""
    found = [p for p in seen_by_sessions(m, models).iterdir() if ".v-" in p.name and not p.name.startswith(".")]
    assert len(found) == 1, found
    return found[0]


def test_ssh_dropped_mid_copy_loses_nothing_and_rerun_resumes(fleet):
    """A fresh disk on spark2 (empty tmpfs over its models folder) gets the checkpoint over a
    slowed link; the sshd child serving the rsync is killed mid-copy."""
    c, sim = fleet, fleet.sim
    m = sim.node("spark2")
    before = deployed_id(sim, "spark2")
    built, _ = fx.artifact_digests(sim, "spark1")
    models = fx.hybrid_dir(sim, "spark2").parent
    with fx.tmpfs_over(m, models, 4 * checkpoint_bytes(sim) + (1 << 20)):
        with fx.slow_link(sim.node("spark1"), "256kbit"), fx.SessionKiller(m) as killer:
            res = c.run("deploy_node_job", "spark2")
        assert killer.killed, "the copy was never caught in flight: the fault was not injected"
        assert not res.success, "the copy whose SSH connection was killed reported success"
        assert "spark2" in failure_text(res), failure_text(res)
        fx.assert_serving(sim, "spark2", before)
        fx.assert_gateway_has_backend(sim)
        assert fx.artifact_digests(sim, "spark1")[0] == built, "the build host's checkpoint changed"

        again = c.run("deploy_node_job", "spark2")
        assert again.success, f"the rerun did not finish the interrupted copy:\n{failure_text(again)}"
        copied = fx.tree_digests(received_version(m, models))
        assert copied == built, "the resumed copy on spark2 differs from the build host's checkpoint"
        # Resumed in its incoming folder, renamed once verified: nothing half-copied is left.
        assert not [p.name for p in seen_by_sessions(m, models).iterdir() if p.name.endswith(".incoming")]
        fx.assert_serving(sim, "spark2", before)
    fx.assert_artifacts_intact(sim, "spark2")  # the original copy under the mount is untouched


def test_disk_full_on_the_receiver_fails_cleanly_and_loses_nothing(fleet):
    c, sim = fleet, fleet.sim
    m = sim.node("spark2")
    before = deployed_id(sim, "spark2")
    built, _ = fx.artifact_digests(sim, "spark1")
    models = fx.hybrid_dir(sim, "spark2").parent
    with fx.tmpfs_over(m, models, max(checkpoint_bytes(sim) // 3, 16 << 10)):
        with fx.RotationWatch(sim) as watch:
            res = c.run("deploy_node_job", "spark2")
        assert not res.success, "a copy onto a full disk reported success"
        why = failure_text(res)
        # Refused before the copy, with both numbers and what to remove; nothing written.
        assert "spark2" in why and re.search(r"needs [0-9.]+ [KMG]iB under .*, [0-9.]+ [KMG]iB free", why), why
        assert "checkpoint_gc_job" in why and "nothing was copied" in why, why
        assert list(seen_by_sessions(m, models).iterdir()) == []
        fx.assert_serving(sim, "spark2", before)
        fx.assert_gateway_has_backend(sim)
        assert watch.fewest and watch.fewest >= 1
    assert fx.artifact_digests(sim, "spark1")[0] == built, "the build host's checkpoint changed"
    fx.assert_artifacts_intact(sim, "spark2")
    again = c.run("deploy_node_job", "spark2")
    assert again.success, f"the rerun with space back did not pass:\n{failure_text(again)}"
    fx.assert_serving(sim, "spark2", before)


def test_same_size_corrupted_shard_is_found_and_repaired(fleet):
    """A shard on spark2 overwritten in place, same size and mtime: rsync's quick check and a
    header-only verification both miss it; the digest manifest must not."""
    c, sim = fleet, fleet.sim
    shards = sorted(fx.hybrid_dir(sim, "spark2").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    assert shards, "spark2 holds no shard to damage"
    victim = shards[-1]
    good = fx.corrupt_same_size(victim)
    built, _ = fx.artifact_digests(sim, "spark1")
    try:
        res = c.run("deploy_node_job", "spark2")
        import hashlib

        now = hashlib.sha256(victim.read_bytes()).hexdigest()
        assert now == good, (
            f"spark2's {victim.name} is still damaged after a deploy (run {'passed' if res.success else 'failed'}: "
            f"{failure_text(res)[:300]})")
        assert res.success, failure_text(res)
        fx.assert_artifacts_intact(sim, "spark2")
        assert fx.artifact_digests(sim, "spark1")[0] == built
        fx.assert_serving(sim, "spark2")
        fx.assert_gateway_has_backend(sim)
    finally:
        # Leave the shard whole for the next test whatever the product did.
        src = fx.hybrid_dir(sim, "spark1") / victim.name
        if src.exists() and victim.read_bytes() != src.read_bytes():
            st = victim.stat()
            victim.write_bytes(src.read_bytes())
            import os

            os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
