"""The pipelined distribution on a 4-node simulated fleet (build host + 3 receivers in a chain, links
rate-limited): a receiver whose copy is killed mid-transfer is skipped by its child (which takes the
rest from the node above), does not hold the others back, names itself in the failure, keeps its
partial copy, and completes on the rerun; every receiver verified by content."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spark_pipelines.core import layout
from spark_pipelines.core import versions
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.ssh import FleetSession, SshSettings
from spark_pipelines.resources.transfer import NodeStreams
from spark_pipelines.state import markers
from spark_pipelines.runbook.distribution import DistributionFailed, Payload, distribute
from spark_sim.fleet import SimFleet
from tests.plugins.distribution import make_payload, sim_fleet_of

pytestmark = pytest.mark.slow

LINK_MBIT = 80  # 24 MiB per copy: ~2.5 s on the wire, long enough to kill a copy mid-way
FLOATS = 6 * 1024 * 1024


@pytest.fixture(scope="module")
def fleet4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with sim_fleet_of(4, tmp_path_factory.mktemp("sim4"), link_mbit=LINK_MBIT) as sim:
        yield sim


@pytest.fixture(scope="module")
def session(fleet4: SimFleet) -> Iterator[FleetSession]:
    assert fleet4.fleet_file is not None
    with FleetSession(load_fleet(fleet4.fleet_file), SshSettings(connect_retries=1)) as s:
        yield s


@pytest.fixture(scope="module")
def payload(session: FleetSession) -> Payload:
    return make_payload(session, FLOATS)


def _receivers_of(user: str) -> list[int]:
    """The receiving end of a copy to a node: its user's relay (`relay.py recv`) processes."""
    import pwd

    uid = pwd.getpwnam(user).pw_uid
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid != uid:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(b"relay.py") for a in argv) and b"recv" in argv:
            pids.append(int(entry.name))
    return pids


class KillCopiesTo:
    """While active, kills every relay receiving on `node` once it has run for `after_s`: mid-copy."""

    def __init__(self, user: str, after_s: float = 1.0) -> None:
        self.user, self.after_s = user, after_s
        self.killed: list[int] = []
        self._stop = threading.Event()
        self._seen: dict[int, float] = {}
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            now = time.monotonic()
            for pid in _receivers_of(self.user):
                first = self._seen.setdefault(pid, now)
                if now - first >= self.after_s and pid not in self.killed:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        self.killed.append(pid)
                    except ProcessLookupError:
                        pass

    def __enter__(self) -> KillCopiesTo:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()



def received_at(f, node, payload: Payload) -> str:
    """Where a receiver holds the copy: the version its manifest names (core/versions.py)."""
    return versions.version_path(layout.hybrid_dir(f, node), payload.manifest)


def test_a_receiver_killed_mid_copy_is_skipped_by_its_child_does_not_block_the_others_and_completes_on_rerun(
        fleet4, session, payload):
    f = session.fleet
    build = f.build_node
    receivers = [n for n in f.serve_nodes if n.name != build.name]
    assert len(receivers) == 3
    victim = receivers[1]  # the middle of the chain: spark1 -> spark2 -> spark3 -> spark4
    child = receivers[2]
    streams = NodeStreams(session)

    started = time.monotonic()
    with KillCopiesTo(fleet4.node(victim.name).user) as killer, pytest.raises(DistributionFailed) as failed:
        distribute(session, f.serve_nodes, payload)
    first_run = time.monotonic() - started
    report = failed.value.report
    assert report is not None
    assert killer.killed, "the fault never fired: no copy to the victim was running"
    assert report.tree == {receivers[0].name: build.name, victim.name: receivers[0].name, child.name: victim.name}
    assert report.given_up == [victim.name]
    assert victim.name in failed.value.description and "rerun" in failed.value.description
    others = sorted(n.name for n in receivers if n is not victim)
    assert sorted(report.verified) == others
    # The victim failed its attempts, its retry from another holder than its first try.
    tries = [t for t in report.transfers if t.receiver == victim.name and not t.ok]
    assert len(tries) >= f.distribution.max_attempts and len({t.holder for t in tries}) >= 2, tries
    # Its child took what the victim had not passed on from another verified holder, and nobody
    # took anything from the victim once it had failed.
    failed_at = tries[0].started + tries[0].seconds
    assert all(t.started < failed_at for t in report.transfers if t.holder == victim.name)
    later = [t for t in report.transfers if t.receiver == child.name and t.started >= failed_at]
    assert later and all(t.holder != victim.name for t in later)
    for name in others:
        node = f.node(name)
        v = streams.verify_tree(build.name, name, payload.src_dir, received_at(f, node, payload), manifest=payload.manifest)
        assert v.ok and v.digests_checked >= 3, v.problems
        assert NodeDocker(session).image_id(name, payload.image) == payload.image_id
        assert markers.matches(session, node, "node_artifacts", payload.signature)
    assert markers.matches(session, victim, "node_artifacts", payload.signature) is None
    # No image parts left on any node (the build host's included).
    assert not [p for m in fleet4.nodes for p in (m.home / "models").glob(".image-*")]

    rerun = distribute(session, f.serve_nodes, payload)
    assert sorted(rerun.already_holding) == others
    assert {t.receiver for t in rerun.transfers} <= {victim.name} and rerun.given_up == []
    assert rerun.verified == [victim.name]
    v = streams.verify_tree(build.name, victim.name, payload.src_dir, received_at(f, victim, payload),
                            manifest=payload.manifest)
    # The killed copy resumed in its incoming folder and was renamed once verified: none is left.
    assert not [p.name for p in (fleet4.node(victim.name).home / "models").iterdir() if p.name.endswith(".incoming")]
    assert v.ok and v.digests_checked >= 3, v.problems
    assert NodeDocker(session).image_id(victim.name, payload.image) == payload.image_id
    # A third run finds every node holding and copies nothing.
    again = distribute(session, f.serve_nodes, payload)
    assert again.transfers == [] and sorted(again.already_holding) == sorted(n.name for n in receivers)
    print(f"first run (one receiver killed twice) {first_run:.1f} s, rerun {rerun.seconds:.1f} s")
