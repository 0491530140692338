"""The project is a `dg` project: `dg check defs` and `dg list defs` work from the project root."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DG = Path(sys.executable).with_name("dg")


def dg(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VIRTUAL_ENV": str(Path(sys.executable).parent.parent), "DAGSTER_HOME": ""}
    env.pop("DAGSTER_HOME")
    return subprocess.run([str(DG), *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)


def test_dg_check_defs_passes():
    r = dg("check", "defs")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "All definitions loaded successfully" in r.stdout + r.stderr


def test_dg_list_defs_shows_every_phase():
    r = dg("list", "defs", "--json")
    assert r.returncode == 0, r.stderr
    defs = json.loads(r.stdout)
    assets = {a["asset_key"] for a in defs["assets"]}
    assert {"base_model", "hybrid_checkpoint", "mtp_weights", "base_image", "serving_image", "node_artifacts",
            "node_deployment", "gateway", "bench_results"} <= assets
    assert {j["name"] for j in defs["jobs"]} >= {"build_job", "deploy_node_job", "gateway_job", "bench_job",
                                                 "ab_experiment_job"}
    assert {s["name"] for s in defs["sensors"]} >= {"pins_changed", "node_health", "wedge_watch", "rollout"}
    assert {s["name"] for s in defs["schedules"]} == {"weekly_rebuild", "nightly_bench"}
    # Every asset and job says what it does in the runbook's terms.
    assert all(a["description"] for a in defs["assets"]), [a["asset_key"] for a in defs["assets"] if not a["description"]]
    assert all(j["description"] for j in defs["jobs"]), [j["name"] for j in defs["jobs"] if not j["description"]]
