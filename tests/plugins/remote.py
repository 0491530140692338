"""Fixtures for the remote resources' integration tests, on top of the simulated fleet (`sim_fleet`)."""

from __future__ import annotations

import io
import secrets
import shutil
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.ssh import FleetSession, SshSettings

BUSYBOX = Path("/bin/busybox")


@dataclass(frozen=True)
class Pair:
    """The build node and one serving node of the simulated fleet."""

    fleet: Fleet
    build: str
    serve: str


@pytest.fixture(scope="session")
def node_pair(sim_fleet_config: Fleet) -> Pair:
    fleet = sim_fleet_config
    build = fleet.build_node.name
    serve = next((n.name for n in fleet.serve_nodes if n.name != build), None)
    assert serve is not None, "the simulated fleet needs a serving node besides the build node"
    return Pair(fleet, build, serve)


@pytest.fixture(scope="module")
def fleet_session(node_pair) -> Iterator[FleetSession]:
    with FleetSession(node_pair.fleet, SshSettings(connect_retries=1)) as s:
        yield s


def busybox_rootfs_tar(label: str) -> bytes:
    """A tiny image root (busybox-static and its applets), made here because no registry is reachable."""
    if not BUSYBOX.is_file() or shutil.which("busybox") is None:
        pytest.fail("busybox-static is needed for the test image: apt-get install busybox-static")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("bin")
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
        data = BUSYBOX.read_bytes()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
        for applet in ("sh", "echo", "sleep", "cat", "ls", "true"):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)
        marker = label.encode()
        info = tarfile.TarInfo("etc/test-image")
        info.size = len(marker)
        tar.addfile(info, io.BytesIO(marker))
    return buf.getvalue()


@pytest.fixture(scope="module")
def test_image(node_pair, fleet_session) -> Iterator[str]:
    """A busybox image on the build node (imported over SSH stdin), removed from both nodes after."""
    token = secrets.token_hex(4)
    ref = f"spark-test-busybox:{token}"
    fleet_session.run(
        node_pair.build,
        ["docker", "import", "-c", f"LABEL org.spark-pipelines.test={token}", "-c", 'CMD ["sh"]', "-", ref],
        stdin=busybox_rootfs_tar(token),
        log=False,
    )
    yield ref
    for node in (node_pair.build, node_pair.serve):
        fleet_session.run(node, ["docker", "image", "rm", "-f", ref], check=False, log=False)
