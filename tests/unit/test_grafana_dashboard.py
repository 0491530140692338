"""deploy/grafana/spark-fleet.json against what Grafana needs to import a dashboard (Grafana itself
cannot be installed here: no Debian package, no registry): the top-level fields, unique panel ids,
a grid position inside the 24-column grid, a Prometheus datasource and targets with refIds on every
data panel, and queries that name only metrics the exporter emits or vLLM serves."""

from __future__ import annotations

import json
import re
from pathlib import Path

from spark_pipelines.core import fleet_metrics, summary

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "spark-fleet.json"
PANEL_TYPES = {"row", "stat", "table", "timeseries", "state-timeline", "gauge", "bargauge"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_top_level_fields_grafana_imports():
    d = dashboard()
    assert isinstance(d["title"], str) and d["title"]
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", d["uid"])
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert d["time"]["from"] and d["time"]["to"]
    names = {v["name"]: v for v in d["templating"]["list"]}
    assert names["datasource"]["type"] == "datasource" and names["datasource"]["query"] == "prometheus"
    assert names["node"]["type"] == "query"


def test_every_panel_is_placed_typed_and_queried():
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        assert p["type"] in PANEL_TYPES and p["title"]
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["y"] >= 0
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"] and len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        assert all(t["expr"] for t in p["targets"])


def test_panels_do_not_overlap():
    cells: set[tuple[int, int]] = set()
    for p in dashboard()["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine


def test_queries_name_metrics_that_exist():
    facts = fleet_metrics.FleetFacts(nodes=[summary.NodeFacts("n")], rotation=summary.Rotation(),
                                     min_in_rotation=1, restart_budget=3)
    emitted = {f.name for f in fleet_metrics.families(facts)}
    used = set()
    for p in dashboard()["panels"]:
        for t in p.get("targets", []):
            used |= set(re.findall(r"\b(spark_[a-z_]+|vllm:[a-z_]+)", t["expr"]))
    assert {m for m in used if m.startswith("spark_")} <= emitted
    assert {m for m in used if m.startswith("vllm:")} <= {
        "vllm:generation_tokens_total", "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_draft_tokens_total"}
    # The four views: fleet overview, per node tok/s, acceptance, clocks and power under load.
    assert {"spark_fleet_rotation_size", "spark_node_bench_tok_s", "spark_node_mtp_acceptance_ratio",
            "spark_node_bench_sm_clock_mhz", "spark_node_bench_power_watts"} <= used
