"""A simulated fleet of N nodes on its own slot, and a real checkpoint + image on its build host,
for the fan-out distribution tests (the session's 2-node `sim_fleet` stays as it is)."""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from spark_pipelines.core import layout
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.resources.transfer import write_manifest
from spark_pipelines.state import markers
from spark_pipelines.runbook.distribution import Payload
from spark_sim.fleet import SimFleet
from tests.plugins.remote import busybox_rootfs_tar
from tests.plugins.sim import _need_root, sim_slot


@contextmanager
def sim_fleet_of(nodes: int, out_dir: Path, link_mbit: float | None = None) -> Iterator[SimFleet]:
    """`nodes` simulated nodes + gateway on a free slot; LITELLM_MASTER_KEY set for the proxy."""
    _need_root()
    added = "LITELLM_MASTER_KEY" not in os.environ
    if added:
        os.environ["LITELLM_MASTER_KEY"] = f"sk-test-{secrets.token_urlsafe(16)}"
    try:
        with sim_slot() as slot:
            sim = SimFleet(root=f"/var/lib/spark-sim-pytest-{slot}", slot=slot)
            sim.down()
            sim.up(nodes=nodes, fleet_out=out_dir / "sim-fleet.yaml", tokens_per_second=1000, link_mbit=link_mbit)
            try:
                yield sim
            finally:
                sim.down()
    finally:
        if added:
            os.environ.pop("LITELLM_MASTER_KEY", None)


def make_payload(session: FleetSession, floats: int) -> Payload:
    """A real checkpoint (2 shards + index + sha256 manifest) where mtp_weights leaves it on the
    build host, and a busybox image there."""
    f = session.fleet
    build = f.build_node.name
    src = layout.hybrid_dir(f, f.build_node)
    rng = np.random.default_rng(11)
    shards = {"model-00001-of-00002.safetensors": {"layers.0.w": rng.random(floats, dtype=np.float32)},
              "model-00002-of-00002.safetensors": {"layers.1.w": rng.integers(0, 255, (64, 64), dtype=np.uint8)}}
    session.run(build, ["mkdir", "-p", src], log=False)
    weight_map = {}
    for name, tensors in shards.items():
        session.run(build, ["sh", "-c", 'cat > "$1"', "sh", f"{src}/{name}"], stdin=save(tensors), log=False)
        weight_map.update({k: name for k in tensors})
    session.put_text(build, f"{src}/model.safetensors.index.json", json.dumps({"weight_map": weight_map}))
    _, digest = write_manifest(session, build, src)
    token = secrets.token_hex(4)
    ref = f"spark-test-busybox:{token}"
    session.run(build, ["docker", "import", "-c", 'CMD ["sh"]', "-", ref], stdin=busybox_rootfs_tar(token), log=False)
    image_id = NodeDocker(session).image_id(build, ref)
    assert image_id
    return Payload(src_dir=src, image=ref, image_id=image_id, manifest=digest,
                   signature=markers.signature("test", token, digest))
