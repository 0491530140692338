"""Node-to-node streams on the simulated fleet: checkpoint rsync (interrupted, resumed, verified)
and docker save | docker load, both run on the build node."""

import json
import os
import secrets
import signal
import threading
import time
from pathlib import Path

import numpy as np
import paramiko
import pytest
from safetensors.numpy import save

from spark_pipelines.core import remote
from spark_pipelines.resources.ssh import RemoteCommandError
from spark_pipelines.resources.transfer import NodeStreams, write_manifest

pytestmark = pytest.mark.slow

BIG_FLOATS = 6 * 1024 * 1024  # 24 MiB of float32: long enough to interrupt under a rate limit


def _upload(session, node: str, path: str, data: bytes) -> None:
    session.run(node, ["sh", "-c", 'cat > "$1"', "sh", path], stdin=data, log=False)


@pytest.fixture(scope="module")
def checkpoint(node_pair, fleet_session):
    """A small real checkpoint (2 shards + index) on the build node; removed from both nodes after."""
    token = secrets.token_hex(4)
    src = fleet_session.expand(node_pair.build, f"~/spark-test-ckpt-{token}")
    dst = fleet_session.expand(node_pair.serve, f"~/models/spark-test-ckpt-{token}")
    rng = np.random.default_rng(7)
    shards = {
        "model-00001-of-00002.safetensors": {"layers.0.w": rng.random(BIG_FLOATS, dtype=np.float32)},
        "model-00002-of-00002.safetensors": {
            "layers.1.w": rng.integers(0, 255, (64, 64), dtype=np.uint8),
            "layers.1.w.weight_scale_inv": rng.random((1, 1), dtype=np.float32),
        },
    }
    fleet_session.run(node_pair.build, ["mkdir", "-p", src], log=False)
    weight_map = {}
    for name, tensors in shards.items():
        _upload(fleet_session, node_pair.build, f"{src}/{name}", save(tensors))
        weight_map.update({k: name for k in tensors})
    fleet_session.put_text(node_pair.build, f"{src}/model.safetensors.index.json", json.dumps({"weight_map": weight_map}))
    yield {"src": src, "dst": dst, "keys": len(weight_map)}
    fleet_session.run(node_pair.build, ["rm", "-rf", src], log=False)
    fleet_session.run(node_pair.serve, ["rm", "-rf", dst], log=False)


def _ssh_client_pids_for(dst_dir: str) -> list[int]:
    """The build node's ssh client carrying rsync to dst_dir (same pid namespace as the sim nodes)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        joined = b" ".join(argv)
        if argv[0].endswith(b"ssh") and b"rsync --server" in joined and dst_dir.encode() in joined:
            pids.append(int(entry.name))
    return pids


def test_peer_access_is_dedicated_verified_and_idempotent(node_pair, fleet_session):
    streams = NodeStreams(fleet_session)
    route = streams.ensure_peer_access(node_pair.build, node_pair.serve)
    again = NodeStreams(fleet_session).ensure_peer_access(node_pair.build, node_pair.serve)
    assert route == again
    assert route.key_path.endswith(remote.PEER_KEY_NAME)
    public = fleet_session.read_text(node_pair.build, route.key_path + ".pub").split()[1]
    ak = fleet_session.read_text(node_pair.serve, "~/.ssh/authorized_keys")
    build_ip = node_pair.fleet.node(node_pair.build).host
    assert ak.count(public) == 1 and f'restrict,from="{build_ip}" ssh-ed25519 {public}' in ak
    # The destination's host key comes from the orchestrator's verified known_hosts.
    dst = node_pair.fleet.node(node_pair.serve)
    ours = paramiko.HostKeys(str(Path(dst.known_hosts).expanduser())).lookup(remote.known_hosts_name(dst.host, dst.port))
    peer_kh = fleet_session.read_text(node_pair.build, route.known_hosts)
    for key in ours.values():
        assert f"{remote.known_hosts_name(dst.host, dst.port)} {key.get_name()} {key.get_base64()}" in peer_kh
    # And it works with StrictHostKeyChecking=yes, from the build node itself.
    r = fleet_session.run(node_pair.build, route.remote_argv(["echo", "peer-ok"]), log=False)
    assert r.stdout == "peer-ok\n"


def test_checkpoint_copy_interrupted_then_resumed_and_verified(node_pair, fleet_session, checkpoint):
    streams = NodeStreams(fleet_session)
    src, dst = checkpoint["src"], checkpoint["dst"]
    big = "model-00001-of-00002.safetensors"
    failure: list[BaseException] = []

    def slow_copy() -> None:
        try:
            streams.copy_tree(node_pair.build, node_pair.serve, src, dst, bwlimit_kib=3000)
        except BaseException as e:  # expected: the connection is cut
            failure.append(e)

    t = threading.Thread(target=slow_copy)
    t.start()
    # Wait until a good part of the big shard arrived, then cut the node-to-node connection.
    deadline = time.monotonic() + 30
    received = 0
    while time.monotonic() < deadline and received < 8 * 1024 * 1024:
        time.sleep(0.3)
        r = fleet_session.run(
            node_pair.serve, ["find", dst, "-name", f".{big}.*", "-printf", "%s\\n"], check=False, log=False
        )
        received = max([int(x) for x in r.stdout.split()] or [0])
    pids = _ssh_client_pids_for(dst)
    assert received >= 8 * 1024 * 1024 and pids, f"copy did not progress ({received} bytes) or no ssh client found"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    t.join(timeout=60)
    assert not t.is_alive()
    assert failure and isinstance(failure[0], RemoteCommandError), failure
    assert "rsync" in failure[0].command and failure[0].node == node_pair.build
    listing = fleet_session.run(
        node_pair.serve, ["find", f"{dst}/{remote.RSYNC_PARTIAL_DIR}", "-type", "f", "-printf", "%f\\t%s\\n"], log=False
    )
    partial = remote.parse_file_sizes(listing.stdout)
    assert big in partial and partial[big] > 0, "rsync must keep the interrupted shard aside"
    assert not fleet_session.exists(node_pair.serve, f"{dst}/{big}"), "no truncated shard under its real name"

    report = streams.copy_tree(node_pair.build, node_pair.serve, src, dst)
    total = report.rsync_stats["total_file_size"]
    # The kept part was not sent again: only the rest (plus rsync's block checksums) crossed the wire.
    assert report.rsync_stats["matched_data"] >= partial[big] * 0.9
    assert report.bytes_sent < total - partial[big] * 0.8
    v = report.verification
    assert v.ok, v.problems
    assert v.index_keys == checkpoint["keys"] and v.shards_checked == 2 and v.files == 3
    assert not fleet_session.exists(node_pair.serve, f"{dst}/{remote.RSYNC_PARTIAL_DIR}/{big}")
    # It ran on the build node, pushing to the serving node.
    rsyncs = [c for c in fleet_session.commands if c.argv[0] == "rsync"]
    assert rsyncs and all(c.node == node_pair.build for c in rsyncs)
    print(f"\nresume: total {total} B, kept partial {partial[big]} B, resent {report.bytes_sent} B")


def test_verification_catches_a_truncated_shard_and_a_rerun_repairs_it(node_pair, fleet_session, checkpoint):
    streams = NodeStreams(fleet_session)
    src, dst = checkpoint["src"], checkpoint["dst"]
    streams.copy_tree(node_pair.build, node_pair.serve, src, dst)
    shard = "model-00001-of-00002.safetensors"
    fleet_session.run(node_pair.serve, ["truncate", "-s", "-4096", f"{dst}/{shard}"], log=False)
    v = streams.verify_tree(node_pair.build, node_pair.serve, src, dst)
    assert not v.ok
    assert any(p.startswith(f"{shard}: ") and "on the destination" in p for p in v.problems)
    assert any(p.startswith(f"{shard}: ") and "header describes" in p for p in v.problems)
    report = streams.copy_tree(node_pair.build, node_pair.serve, src, dst)
    assert report.verification.ok and report.files_transferred == 1


# Rewrites bytes in the middle of a file in place: same size, same mtime (bit rot, or a tool that
# writes into an existing shard), which neither the headers nor rsync's quick check can see.
FLIP = """
import os, sys
p = sys.argv[1]; st = os.stat(p)
with open(p, "r+b") as f:
    f.seek(st.st_size // 2); b = f.read(64); f.seek(st.st_size // 2); f.write(bytes(x ^ 0xFF for x in b))
os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
"""


def test_same_size_rewrite_is_found_by_content_and_only_that_file_resent(node_pair, fleet_session, checkpoint):
    streams = NodeStreams(fleet_session)
    build, serve = node_pair.build, node_pair.serve
    src, dst = checkpoint["src"], checkpoint["dst"]
    manifest, digest = write_manifest(fleet_session, build, src)
    assert len(manifest["files"]) == 3
    first = streams.copy_tree(build, serve, src, dst, manifest=digest)
    v = first.verification
    assert v.ok and v.manifest == digest and v.digests_checked == 4  # 2 shards, index, the manifest
    total = v.total_bytes

    shard = "model-00001-of-00002.safetensors"
    fleet_session.run(serve, ["python3", "-c", FLIP, f"{dst}/{shard}"], log=False)
    v = streams.verify_tree(build, serve, src, dst, manifest=digest)
    assert not v.ok and v.resend == [shard]
    assert v.problems == [p for p in v.problems if p.startswith(f"{shard}: content differs, same size on {serve}")]
    assert v.problems and v.shards_checked == 2  # the headers alone still pass

    # rsync's quick check (size + mtime) does not see it: the plain copy sends no file.
    route = streams.ensure_peer_access(build, serve)
    plain = remote.parse_rsync_stats(fleet_session.run(build, remote.rsync_argv(src, route, dst), log=False).stdout)
    assert plain["number_of_regular_files_transferred"] == 0

    since = len(fleet_session.commands)
    report = streams.copy_tree(build, serve, src, dst, manifest=digest)
    assert report.repaired == [shard] and report.verification.ok
    assert report.verification.digests_checked == 1  # after the repair only the re-sent file is hashed again
    # Only the damaged blocks crossed the wire (delta against the damaged file), not the tree.
    assert 0 < report.repair_bytes_sent < total / 20, (report.repair_bytes_sent, total)
    resend = [c for c in fleet_session.commands[since:] if "--files-from=-" in c.argv]
    assert len(resend) == 1 and resend[0].node == build and "--checksum" in resend[0].argv
    assert streams.verify_tree(build, serve, src, dst, manifest=digest).ok
    print(f"\nrepair: tree {total} B, re-sent {report.repair_bytes_sent} B for {shard}")


def test_a_manifest_that_is_not_the_recorded_one_is_refused(node_pair, fleet_session, checkpoint):
    streams = NodeStreams(fleet_session)
    v = streams.verify_tree(node_pair.build, node_pair.serve, checkpoint["src"], checkpoint["dst"], manifest="0" * 64)
    assert not v.ok and "the build host's checkpoint changed since" in v.problems[-1]


def test_image_streams_between_nodes_with_equal_ids(node_pair, fleet_session, test_image):
    streams = NodeStreams(fleet_session)
    src_id = streams.docker.image_id(node_pair.build, test_image)
    assert src_id and src_id.startswith("sha256:")
    assert streams.docker.image_id(node_pair.serve, test_image) is None
    report = streams.copy_image(node_pair.build, node_pair.serve, test_image)
    assert not report.skipped and report.image_id == src_id
    assert streams.docker.image_id(node_pair.serve, test_image) == src_id
    token = test_image.split(":")[1]
    assert streams.docker.image_labels(node_pair.serve, test_image) == {"org.spark-pipelines.test": token}
    again = streams.copy_image(node_pair.build, node_pair.serve, test_image)
    assert again.skipped and again.image_id == src_id
    assert [c.node for c in fleet_session.commands if c.argv[:1] == ("bash",)] == [node_pair.build]
