"""Pipelined distribution vs copying from the build host alone, on rate-limited simulated links.

    .venv/bin/python benchmarks/fanout.py [--link-mbit 200] [--size-mib 192] [--shards 16] [--image-mib 32]
                                          [--nodes 1,2,4,8]

Brings up a simulated fleet of the build host + max(--nodes) receivers in SPARK_SIM_SLOT /
SPARK_SIM_ROOT (default slot 21, /var/lib/spark-sim-bench-fanout), every node's link limited to
--link-mbit each way with tc (a real NIC: the build host's uplink is the one it has). On the build
host: a synthetic checkpoint (safetensors shards + index + sha256 manifest; 16 shards as the real
~71 GB checkpoint's ~5 GB ones) and an image with a random layer. For 1, 2, 4, 8 receivers, from
empty receivers each time:
- build-host-only: the build host copies to each receiver in turn (node_artifacts' whole copy:
  one rsync, every file hashed, docker save | docker load, marker);
- tree: runbook/distribution.py, each unit passed down the tree as soon as it verified.
Then one copy's throughput against `scp -r` of the same files + the image stream over the same
link, for node_artifacts' whole copy and for the pipeline to one receiver. The last line ends with
the tree / build-host-only ratio at the largest receiver count (goal at 8: <= 0.25). With
--with-build-host, --nodes counts the serve nodes that hold the artifacts at the end, the build
host one of them (as the seed's spark1): 8 nodes are 7 copies.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import sys
import tarfile
import time

from spark_pipelines.core import layout, remote
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.ssh import FleetSession, SshSettings
from spark_pipelines.resources.transfer import NodeStreams, write_manifest
from spark_pipelines.state import markers
from spark_pipelines.runbook.distribution import Payload, copy_to, distribute
from spark_sim.fleet import SimFleet

# Written on the build host by its own python3: the bytes never cross the orchestrator's link.
MAKE_SHARDS = r"""
import json, os, sys
d, size, shards = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(d, exist_ok=True)
per = size // shards
weight_map = {}
for i in range(1, shards + 1):
    name = f"model-{i:05d}-of-{shards:05d}.safetensors"
    key = f"layers.{i}.w"
    header = json.dumps({key: {"dtype": "U8", "shape": [per], "data_offsets": [0, per]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(f"{d}/{name}", "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        left = per
        while left:
            n = min(left, 1 << 22)
            f.write(os.urandom(n))
            left -= n
    weight_map[key] = name
json.dump({"weight_map": weight_map}, open(f"{d}/model.safetensors.index.json", "w"))
"""


def image_tar(mib: int, token: str) -> bytes:
    """A one-layer image: busybox (for a CMD) and a random file of `mib` MiB."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, data in (("payload.bin", os.urandom(mib << 20)), ("etc/token", token.encode())):
            info = tarfile.TarInfo(path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def wipe(s: FleetSession, nodes: list[str], payload: Payload) -> None:
    f = s.fleet
    for name in nodes:
        node = f.node(name)
        models = layout.models_dir(f, node)
        s.run(name, ["sh", "-c", 'rm -rf "$1" "$1".v-* "$2"/.*.incoming "$3"', "wipe", layout.hybrid_dir(f, node),
                     models, layout.marker_path(node, "node_artifacts")], log=False)
        s.run(name, ["docker", "image", "rm", "-f", payload.image], check=False, log=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link-mbit", type=float, default=200)
    ap.add_argument("--size-mib", type=int, default=192, help="synthetic checkpoint size")
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--image-mib", type=int, default=32)
    ap.add_argument("--nodes", default="1,2,4,8", help="receiver counts to measure")
    ap.add_argument("--with-build-host", action="store_true",
                    help="--nodes counts serve nodes with the build host among them (the seed's spark1 builds and "
                         "serves): N nodes hold the artifacts at the end, N-1 copies are made")
    ap.add_argument("--keep", action="store_true", help="leave the simulated fleet up afterwards")
    args = ap.parse_args()
    counts = sorted({int(x) - (1 if args.with_build_host else 0) for x in args.nodes.split(",")} - {0})
    os.environ.setdefault("SPARK_SIM_SLOT", "21")
    os.environ.setdefault("SPARK_SIM_ROOT", "/var/lib/spark-sim-bench-fanout")
    sim = SimFleet()
    sim.down()
    t0 = time.monotonic()
    fleet_path = sim.up(nodes=max(counts) + 1, fleet_out=sim.layout.root.parent / f"{sim.layout.root.name}.yaml",
                        link_mbit=args.link_mbit)
    print(f"sim up: {max(counts) + 1} nodes, links {args.link_mbit:g} Mbit/s, in {time.monotonic() - t0:.1f} s")
    try:
        return run(load_fleet(fleet_path), args, counts)
    finally:
        if not args.keep:
            sim.down()


def run(fleet, args, counts: list[int]) -> int:
    figures: list[str] = []
    with FleetSession(fleet, SshSettings(connect_retries=1)) as s:
        build = fleet.build_node
        receivers = [n.name for n in fleet.serve_nodes if n.name != build.name]
        src = layout.hybrid_dir(fleet, build)
        s.run(build.name, ["python3", "-", src, str(args.size_mib << 20), str(args.shards)], stdin=MAKE_SHARDS,
              log=False, timeout=600)
        _, manifest = write_manifest(s, build.name, src)
        token = secrets.token_hex(4)
        ref = f"fanout-bench:{token}"
        s.run(build.name, ["docker", "import", "-c", 'CMD ["/payload.bin"]', "-", ref],
              stdin=image_tar(args.image_mib, token), log=False, timeout=600)
        image_id = NodeDocker(s).image_id(build.name, ref)
        payload = Payload(src, ref, image_id, manifest, markers.signature("fanout-bench", token, manifest))
        total_mib = args.size_mib + args.image_mib
        print(f"payload: checkpoint {args.size_mib} MiB in {args.shards} shards + image {args.image_mib} MiB")

        results: dict[int, tuple[float, float, int]] = {}
        for k in counts:
            targets = receivers[:k]
            wipe(s, targets, payload)
            t0 = time.monotonic()
            for r in targets:
                copy_to(s, build, fleet.node(r), payload)
            alone = time.monotonic() - t0
            wipe(s, targets, payload)
            t0 = time.monotonic()
            report = distribute(s, [build, *(fleet.node(r) for r in targets)], payload)
            tree = time.monotonic() - t0
            results[k] = (alone, tree, len(report.transfers))
            print(f"{k} receiver(s): build-host-only {alone:6.1f} s   tree {tree:6.1f} s in {len(report.transfers)} "
                  f"transfer(s)   ratio {tree / alone:.2f}")
            for line in report.lines():
                print(f"    {line}")

        # One copy against scp of the same files over the same link (build host -> first receiver).
        one = receivers[0]
        wipe(s, [one], payload)
        t0 = time.monotonic()
        copy_to(s, build, fleet.node(one), payload)
        ours = time.monotonic() - t0
        wipe(s, [one], payload)
        t0 = time.monotonic()
        distribute(s, [build, fleet.node(one)], payload)
        piped = time.monotonic() - t0
        route = NodeStreams(s).ensure_peer_access(build.name, one)
        scp_dir = s.expand(one, "~/fanout-scp")
        s.run(one, ["rm", "-rf", scp_dir], log=False)
        scp = ["scp", "-q", "-r", "-i", route.key_path, "-o", "IdentitiesOnly=yes",
               "-o", f"UserKnownHostsFile={route.known_hosts}", "-o", "StrictHostKeyChecking=yes",
               "-o", "BatchMode=yes", "-P", str(route.port), src, f"{route.destination}:{scp_dir}"]
        t0 = time.monotonic()
        s.run(build.name, scp, log=False, timeout=3600)
        scp_ckpt = time.monotonic() - t0
        t0 = time.monotonic()
        s.run(build.name, ["bash", "-o", "pipefail", "-c",
                           f"docker save {ref} | {remote.quote_argv(route.remote_argv(['dd', 'of=/dev/null', 'bs=1M']))}"],
              log=False, timeout=3600)
        scp_image = time.monotonic() - t0
        s.run(one, ["rm", "-rf", scp_dir], log=False)
        wire = scp_ckpt + scp_image
        link = args.link_mbit / 8 * 1e6 / (1 << 20)
        figures.append(f"link {args.link_mbit:g} Mbit/s = {link:.1f} MiB/s each way")
        figures.append(f"scp of the same files + the image stream: {wire:.1f} s = {total_mib / wire:.1f} MiB/s")
        figures.append(f"one whole copy (node_artifacts: rsync + docker save|load + verification): {ours:.1f} s = "
                       f"{total_mib / ours:.1f} MiB/s; throughput ours/scp {wire / ours:.2f} (goal >= 0.9)")
        figures.append(f"one copy through the pipeline (units, parts, per-file verification): {piped:.1f} s = "
                       f"{total_mib / piped:.1f} MiB/s; throughput ours/scp {wire / piped:.2f}")
        for k in counts:
            alone, tree, rounds = results[k]
            figures.append(f"{k} receiver(s){f' ({k + 1} nodes)' if args.with_build_host else ''}: "
                           f"build-host-only {alone:.1f} s, tree {tree:.1f} s ({rounds} transfers), "
                           f"tree/build-host-only {tree / alone:.2f}")
    print()
    for line in figures:
        print(line)
    kmax = counts[-1]
    alone, tree, _ = results[kmax]
    print(json.dumps({"link_mbit": args.link_mbit, "size_mib": args.size_mib, "image_mib": args.image_mib,
                      "shards": args.shards,
                      "results": {k: {"build_host_only_s": round(a, 1), "tree_s": round(t, 1), "transfers": r}
                                  for k, (a, t, r) in results.items()}}))
    where = (f"{kmax + 1} serve nodes, the build host among them ({kmax} receivers)" if args.with_build_host
             else f"{kmax} nodes")
    print(f"at {where} (goal <= 0.25): tree / build-host-only {tree / alone:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
