"""The alert rules (deploy/prometheus/spark-alerts.yml) checked and unit-tested by Prometheus' own
promtool: series in, alerts out (tests/unit/prometheus/spark-alerts.test.yml), every alert covered,
each tied to a runbook row with its advice and the Dagster job that acts, each reading only metrics
the fleet exporter emits."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from spark_pipelines.core import fleet_metrics, health, steps, summary
from tests.plugins import unavailable

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "spark-alerts.yml"
CASES = ROOT / "tests" / "unit" / "prometheus" / "spark-alerts.test.yml"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        unavailable("promtool is not installed (scripts/bootstrap.sh prometheus: Debian's prometheus package)")
    return str(path)


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules_file():
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules())} rules found" in out.stdout


def test_promtool_unit_tests_every_alert():
    out = subprocess.run([promtool(), "test", "rules", CASES.name], cwd=CASES.parent, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    tested = {t["alertname"] for case in yaml.safe_load(CASES.read_text())["tests"] for t in case["alert_rule_test"]}
    assert tested == {r["alert"] for r in rules()}


def test_promtool_test_fails_when_an_alert_does_not_fire(tmp_path):
    """The cases can fail: the wedge alert's expression made to never match is caught."""
    broken = RULES.read_text().replace('verdict="wedged"} == 1', 'verdict="wedged"} == 2')
    (tmp_path / "deploy" / "prometheus").mkdir(parents=True)
    (tmp_path / "deploy" / "prometheus" / RULES.name).write_text(broken)
    (tmp_path / "tests" / "unit" / "prometheus").mkdir(parents=True)
    case = tmp_path / "tests" / "unit" / "prometheus" / CASES.name
    case.write_text(CASES.read_text())
    out = subprocess.run([promtool(), "test", "rules", case.name], cwd=case.parent, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "SparkNodeWedgeSuspected" in out.stdout + out.stderr


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_each_alert_carries_the_runbook_row_the_advice_and_the_job(rule):
    notes = rule["annotations"]
    assert set(notes) >= {"summary", "runbook", "advice", "dagster_job"}
    assert "for" in rule and rule["labels"]["severity"] in ("critical", "warning")
    jobs = {v for k, v in vars(steps).items() if k.endswith(("_JOB", "_SENSOR")) and isinstance(v, str)}
    named = set(re.findall(r"[a-z_]+_job|node_health|wedge_watch", notes["dagster_job"]))
    assert named <= jobs, named - jobs
    assert named or notes["dagster_job"].startswith("none")


def test_alerts_read_only_metrics_the_exporter_emits():
    facts = fleet_metrics.FleetFacts(nodes=[summary.NodeFacts("spark1")], rotation=summary.Rotation(),
                                     min_in_rotation=1, restart_budget=3)
    emitted = {f.name for f in fleet_metrics.families(facts)} | {"spark_exporter_instance_read_ok"}
    for rule in rules():
        used = set(re.findall(r"\bspark_[a-z_]+", rule["expr"]))
        assert used and used <= emitted, (rule["alert"], used - emitted)
        for verdict in re.findall(r'verdict="([^"]+)"', rule["expr"]):
            assert verdict in health.VERDICTS
