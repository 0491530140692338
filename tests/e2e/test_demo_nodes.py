"""`spark-pipelines demo --nodes 4`, as an operator runs it (a subprocess, its own instance and its
own simulated fleet of four serve nodes): it ends with four deployed, benched nodes, all four in
the gateway; then a rollout_job takes a new launch spec to the four in waves of two. Nothing in
the chain is written for two nodes."""

from __future__ import annotations

import os
import subprocess
import sys

import dagster as dg
import pytest
import yaml

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.launch import DEPLOY_LABEL, launch_spec
from spark_pipelines.definitions import build_definitions
from spark_pipelines.resources.docker import NodeDocker, container_labels
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession

from spark_sim.fleet import SimFleet
from tests.e2e.test_zz_rollout import RotationWatch
from tests.plugins.sim import sim_slot

pytestmark = pytest.mark.slow

NODES = 4


def test_demo_with_four_nodes_ends_with_four_benched_nodes_in_the_gateway(tmp_path, monkeypatch):
    with sim_slot() as slot:
        root = f"/var/lib/spark-sim-pytest-{slot}"
        sim = SimFleet(root=root, slot=slot)
        sim.down()
        fleet_out = tmp_path / "sim-fleet.yaml"
        home = tmp_path / "dagster"
        try:
            # Up first at the test suite's rate (1000 tok/s keeps each bench to seconds); the demo
            # finds a fleet of the size it was asked for and reuses it.
            sim.up(nodes=NODES, fleet_out=fleet_out, tokens_per_second=1000)
            env = {**os.environ, "SPARK_SIM_SLOT": str(slot), "SPARK_SIM_ROOT": root, "DAGSTER_HOME": str(home)}
            p = subprocess.run([sys.executable, "-m", "spark_pipelines.cli", "demo", "--nodes", str(NODES),
                                "--fleet-out", str(fleet_out)], env=env, cwd=tmp_path, capture_output=True,
                               text=True, timeout=2400)
            print(p.stdout[-4000:])
            assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
            assert f"already up ({NODES} nodes); reusing it" in p.stdout
            assert "distribute_job: ok" in p.stdout  # the tree, not N copies from the build host
            nodes = [n.name for n in sim.nodes]
            table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
                     for line in p.stdout.splitlines() if line.startswith("| spark")}
            assert sorted(table) == sorted(nodes) and len(nodes) == NODES
            assert all(row[0] == "ok" and row[-1] == "in" and float(row[3]) > 0 for row in table.values()), table
            instance = dg.DagsterInstance.from_config(str(home))
            try:
                for n in nodes:
                    rec = instance.fetch_materializations(dg.AssetRecordsFilter(
                        asset_key=dg.AssetKey("bench_results"), asset_partitions=[n]), limit=1).records
                    meta = rec[0].asset_materialization.metadata
                    assert meta["promoted"].value is True and meta["void"].value == "no", n
                gw = instance.fetch_materializations(dg.AssetKey("gateway"), limit=1).records[0]
                in_rotation = str(gw.asset_materialization.metadata["rotation"].value)
                assert all(n in in_rotation for n in nodes), in_rotation
                # The fleet's baseline spans all four (same image, checkpoint and launch flags).
                last = instance.fetch_materializations(dg.AssetKey("bench_results"), limit=1).records[0]
                rows = last.asset_materialization.metadata["vs_fleet"].value.records
                assert len(rows) == NODES and all(r.data["counts"] == "yes" for r in rows), rows
                # In this process too, the proxy's key as the demo read it (the sim made it).
                monkeypatch.setenv("LITELLM_MASTER_KEY", sim.master_key_file.read_text().strip())
                rolled_out_in_waves(instance, str(fleet_out), tmp_path, nodes)
            finally:
                instance.dispose()
        finally:
            sim.down()


def rolled_out_in_waves(instance, fleet_file: str, tmp_path, nodes: list[str]) -> None:
    """A new launch spec onto the four, two out at a time: canary, then waves of 2 and 1; every
    node gated against the fleet's baseline; the gateway never below N - max_unavailable."""
    doc = yaml.safe_load(open(fleet_file))
    doc["launch"]["env"]["VLLM_LOGGING_LEVEL"] = "INFO"
    doc.setdefault("rollout", {})["max_unavailable"] = 2
    path = tmp_path / "fleet-v2.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    fleet = load_fleet(str(path))
    with RotationWatch(fleet) as watch:
        res = build_definitions(str(path)).resolve_job_def("rollout_job").execute_in_process(instance=instance)
    sizes = watch.sizes
    assert res.success
    meta = res.asset_materializations_for_node("fleet_rollout")[-1].metadata
    rows = {r.data["node"]: r.data for r in meta["nodes"].value.records}
    waves = [r["wave"] for r in rows.values()]
    assert waves.count("canary") == 1 and waves.count("wave 1") == 2 and waves.count("wave 2") == 1, rows
    assert all(r["state"] == "passed" and "vs baseline" in r["why"] for r in rows.values()), rows
    assert sizes and min(sizes) >= NODES - 2 and max(sizes) == NODES, sorted(set(sizes))
    with FleetSession(fleet) as s:
        for n in nodes:
            spec = launch_spec(fleet, fleet.node(n))
            c = NodeDocker(s).inspect_container(n, spec.container_name)
            assert container_labels(c).get(DEPLOY_LABEL) == spec.fingerprint, n
        assert sorted(GatewayHost(s).rotation()) == sorted(nodes)
    print(f"rollout of {NODES} nodes, max_unavailable 2: rotation sizes seen {sorted(set(sizes))}")
