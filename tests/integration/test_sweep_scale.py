"""The health sweep over light simulated nodes (spark_sim.light), and the scale benchmark end to end.

Verdicts only: the benchmark's figures are printed by benchmarks/sweep_scale.py, never asserted here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.runbook import sweep
from spark_sim.light import LightFleet
from tests.plugins.sim import sim_slot

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def slot():
    if os.geteuid() != 0:
        pytest.skip("light nodes need root (sshd, useradd, iptables)")
    with sim_slot() as n:
        yield n


def test_sweep_judges_light_nodes_healthy_and_unreachable(slot):
    with LightFleet(6, root=Path(f"/var/lib/spark-sim-pytest-{slot}"), slot=slot) as light:
        light.cut(["light002", "light005"])
        fleet = load_fleet(str(light.fleet_path))
        with sweep.open_session(fleet) as s:
            reports = sweep.sweep(s)
        verdicts = {name: r.verdict.verdict for name, r in reports.items()}
        assert verdicts == {"light001": "healthy", "light002": "unreachable", "light003": "healthy",
                            "light004": "healthy", "light005": "unreachable", "light006": "healthy"}
        healthy = reports["light001"].observation
        assert healthy.gpu is not None and healthy.container is not None and healthy.container.running
        assert healthy.metrics is not None and "vllm:num_requests_running" in healthy.metrics
        assert healthy.log_tail and "vllm" in healthy.log_tail.lower()
        assert "timed out" in (reports["light002"].observation.ssh_error or "").lower() or \
            "cannot reach" in (reports["light002"].observation.ssh_error or "")
    assert not light.root.exists()


def test_benchmark_runs_end_to_end(slot):
    if not (Path(os.environ.get("SPARK_ANSIBLE_VENV", "/opt/spark-pipelines/ansible")) / "bin" / "ansible").exists():
        pytest.skip("ansible-core is not installed: scripts/bootstrap.sh ansible")
    env = {**os.environ, "SPARK_SIM_SLOT": str(slot), "SPARK_SIM_ROOT": f"/var/lib/spark-sim-pytest-{slot}",
           "PYTHONPATH": f"{ROOT}:{ROOT / 'sim'}"}
    p = subprocess.run([sys.executable, "benchmarks/sweep_scale.py", "--nodes", "6", "--rounds", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    assert lines[-1].startswith("ratio "), p.stdout
    float(lines[-1].split()[1])
    assert "{'healthy': 5, 'unreachable': 1}" in p.stdout and "'unreachable': 1" in p.stdout.split("ansible, unreachable")[1]
