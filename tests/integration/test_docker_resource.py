"""NodeDocker against the simulated node's real dockerd, driven through the node's SSH."""

import secrets

import pytest

from spark_pipelines.core import remote
from spark_pipelines.resources.docker import DockerError, NodeDocker
from tests.plugins.remote import busybox_rootfs_tar

pytestmark = pytest.mark.slow

# PID 1 ignores SIGTERM unless it traps it; without the trap every `docker stop` waits its full timeout.
READY_SCRIPT = "trap 'exit 0' TERM; echo starting; sleep 1; echo ready >&2; sleep 300 & wait"


@pytest.fixture()
def container_name(node_pair, fleet_session):
    name = f"spark-test-{secrets.token_hex(3)}"
    yield name
    for n in (name, remote.previous_container_name(name)):
        fleet_session.run(node_pair.build, ["docker", "rm", "-f", n], check=False, log=False)


def _run_argv(name: str, image: str, script: str = READY_SCRIPT) -> list[str]:
    # Same shape as core.launch's argv: detached, named, host network.
    return ["docker", "run", "-d", "--name", name, "--net=host", image, "sh", "-c", script]


def test_image_id_and_labels(node_pair, fleet_session, test_image):
    d = NodeDocker(fleet_session)
    image_id = d.image_id(node_pair.build, test_image)
    listed = fleet_session.run(node_pair.build, ["docker", "images", "--no-trunc", "--format", "{{.ID}}", test_image], log=False)
    assert image_id == listed.stdout.strip()
    assert d.image_labels(node_pair.build, test_image) == {"org.spark-pipelines.test": test_image.split(":")[1]}
    assert d.image_id(node_pair.build, "spark-test-absent:nope") is None
    with pytest.raises(DockerError, match=rf"node {node_pair.build}: image spark-test-absent:nope does not exist"):
        d.image_labels(node_pair.build, "spark-test-absent:nope")


def test_run_follow_logs_inspect_stop_remove(node_pair, fleet_session, test_image, container_name):
    d = NodeDocker(fleet_session)
    node = node_pair.build
    cid = d.run_container(node, _run_argv(container_name, test_image))
    info = d.inspect_container(node, container_name)
    assert info["Id"] == cid and info["State"]["Running"] and info["Image"] == d.image_id(node, test_image)
    watch = d.follow_logs(node, container_name, until=lambda line: line.strip() == "ready", timeout=30)
    assert watch.matched == "ready" and not watch.timed_out and not watch.ended
    assert watch.tail[:1] == ["starting"]
    assert "starting" in d.logs(node, container_name, tail=10)
    never = d.follow_logs(node, container_name, until=lambda line: "never printed" in line, timeout=2, log=False)
    assert never.timed_out and never.matched is None and never.lines_seen == 2
    d.stop(node, container_name, timeout_s=1)
    assert not d.inspect_container(node, container_name)["State"]["Running"]
    assert d.remove(node, container_name) is True
    assert d.inspect_container(node, container_name) is None
    assert d.remove(node, container_name) is False


def test_follow_logs_reports_a_container_that_exits(node_pair, fleet_session, test_image, container_name):
    d = NodeDocker(fleet_session)
    d.run_container(node_pair.build, _run_argv(container_name, test_image, "echo loading; sleep 1; echo 'num_gpu_blocks=0' >&2; exit 1"))
    watch = d.follow_logs(node_pair.build, container_name, until=lambda line: "Application startup complete" in line, timeout=30)
    assert watch.ended and watch.matched is None and watch.tail[-1] == "num_gpu_blocks=0"


def test_run_container_takes_only_detached_docker_run(node_pair, fleet_session):
    d = NodeDocker(fleet_session)
    with pytest.raises(DockerError, match="detached"):
        d.run_container(node_pair.build, ["docker", "run", "--name", "x", "img"])
    with pytest.raises(DockerError):
        d.run_container(node_pair.build, ["sh", "-c", "docker run -d x"])


def test_keep_previous_then_restore_then_drop(node_pair, fleet_session, test_image, container_name):
    d = NodeDocker(fleet_session)
    node = node_pair.build
    ref = f"spark-test-serve:{secrets.token_hex(3)}"
    prev_tag = remote.previous_image_tag(ref)
    d.tag(node, test_image, ref)
    old_image = d.image_id(node, ref)
    old_cid = d.run_container(node, _run_argv(container_name, ref))
    try:
        # A new build moves the tag to a different image.
        fleet_session.run(node, ["docker", "import", "-", ref], stdin=busybox_rootfs_tar("new build"), log=False)
        new_image = d.image_id(node, ref)
        assert new_image != old_image

        kept = d.keep_previous(node, container_name, ref)
        assert kept is not None and kept.container == f"{container_name}-previous" and kept.image_id == old_image
        prev = d.inspect_container(node, kept.container)
        assert prev["Id"] == old_cid and not prev["State"]["Running"]
        assert d.inspect_container(node, container_name) is None
        assert d.image_id(node, prev_tag) == old_image

        new_cid = d.run_container(node, _run_argv(container_name, ref))
        assert d.inspect_container(node, container_name)["Image"] == new_image

        # The new one is judged unhealthy: roll back.
        assert d.restore_previous(node, container_name, ref) == old_cid
        back = d.inspect_container(node, container_name)
        assert back["Id"] == old_cid and back["State"]["Running"]
        assert d.image_id(node, ref) == old_image and d.image_id(node, prev_tag) is None
        assert all(c["Id"] != new_cid for c in [back])
        assert d.inspect_container(node, kept.container) is None

        # Deploy again, and this time it is healthy: the rollback point is dropped.
        d.keep_previous(node, container_name, ref)
        d.run_container(node, _run_argv(container_name, ref))
        assert d.drop_previous(node, container_name, ref) is True
        assert d.inspect_container(node, kept.container) is None and d.image_id(node, prev_tag) is None
        with pytest.raises(DockerError, match="no .*-previous container to roll back to"):
            d.restore_previous(node, container_name, ref)
        assert d.keep_previous(node, "spark-test-none", ref) is None
    finally:
        fleet_session.run(node, ["docker", "rm", "-f", container_name], check=False, log=False)
        for r in (ref, prev_tag):
            fleet_session.run(node, ["docker", "image", "rm", "-f", r], check=False, log=False)
