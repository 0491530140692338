"""Session fixtures for the simulated fleet: `sim_fleet` brings it up once and tears it down.

Several pytest sessions may run at once on this machine (helpers working in parallel), so each
session takes a free slot (6-9) with an flock: a slot is a subnet 10.213.<slot>.0/24, a root
/var/lib/spark-sim-pytest-<slot>, and names prefixed `sp<slot>-`. A crashed session releases its
lock with its process; the next session on that slot first removes what was left behind.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.plugins import unavailable

from spark_pipelines.core.fleet import Fleet, load_fleet
from spark_sim.fleet import SimFleet

TEST_SLOTS = tuple(range(6, 16))  # several helpers and CI may run sessions side by side
LOCK_DIR = Path("/run/lock")


@contextmanager
def sim_slot() -> Iterator[int]:
    """Hold a free sim slot for the duration of the block."""
    for slot in TEST_SLOTS:
        path = LOCK_DIR / f"spark-sim-slot-{slot}.lock"
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            yield slot
        finally:
            path.unlink(missing_ok=True)
            os.close(fd)
        return
    unavailable(f"all simulated-fleet slots {TEST_SLOTS} are taken by other test sessions")


def _need_root() -> None:
    if os.geteuid() != 0:
        unavailable("the simulated fleet needs root (network namespaces, users, dockerd)")


@pytest.fixture(scope="session")
def sim_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    """A 2-node simulated fleet (spark1 founders build+serve, spark2 gx10) plus the gateway host.

    `sim_fleet.fleet_file` is the fleet file; `sim_fleet.node("spark1")` gives addresses, user,
    docker socket; `sim_fleet.layout.key_path` / `.known_hosts` the client credentials.
    LITELLM_MASTER_KEY is set for the session when absent, and the gateway uses the same key."""
    _need_root()
    added_key = "LITELLM_MASTER_KEY" not in os.environ
    if added_key:
        os.environ["LITELLM_MASTER_KEY"] = f"sk-test-{secrets.token_urlsafe(16)}"
    with sim_slot() as slot:
        fleet = SimFleet(root=f"/var/lib/spark-sim-pytest-{slot}", slot=slot)
        fleet.down()  # whatever a crashed session on this slot left behind
        # 1000 tok/s instead of the runbook's 52 keeps the recipe suite (3,904 tokens) to seconds.
        fleet.up(nodes=2, fleet_out=tmp_path_factory.mktemp("sim") / "sim-fleet.yaml", tokens_per_second=1000)
        try:
            yield fleet
        finally:
            fleet.down()
            if added_key:
                os.environ.pop("LITELLM_MASTER_KEY", None)


@pytest.fixture(scope="session")
def sim_fleet_config(sim_fleet: SimFleet) -> Fleet:
    """The simulated fleet's fleet file, loaded the way every command loads one."""
    assert sim_fleet.fleet_file is not None
    return load_fleet(sim_fleet.fleet_file)


@pytest.fixture()
def sim_gpu(sim_fleet: SimFleet) -> Iterator[Callable[[str, str], list[str]]]:
    """`sim_gpu(node, state)` sets a node's GPU state; every node is healthy again afterwards."""
    yield sim_fleet.set_gpu
    for node in sim_fleet.nodes:
        sim_fleet.set_gpu(node.name, "healthy")
