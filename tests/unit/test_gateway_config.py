"""LiteLLM config rendering for pools x nodes, and per-node drain / restore."""

from spark_pipelines.core import gateway
from spark_pipelines.core.fleet import load_fleet, parse_fleet


def test_seed_config_matches_runbook_entries():
    fleet = load_fleet("fleets/seed.yaml")
    cfg = gateway.render_config(fleet, fleet.node_names)
    ids = [e["model_info"]["id"] for e in cfg["model_list"]]
    assert ids == [f"{n}-qwen35-122b-{p}" for n in ("spark1", "spark2") for p in ("fast", "reasoning", "code")]
    e = cfg["model_list"][3]
    assert e["model_name"] == "fast"
    assert e["litellm_params"] == {"model": "openai/qwen35-hybrid-v2", "api_base": "http://spark2:8000/v1", "api_key": "dummy"}
    assert cfg["router_settings"]["routing_strategy"] == "latency-based-routing"
    assert cfg["general_settings"]["master_key"] == "os.environ/LITELLM_MASTER_KEY"


def test_drain_removes_one_node_from_every_pool_and_restore_puts_it_back():
    fleet = load_fleet("fleets/seed.yaml")
    full = gateway.render_config(fleet, fleet.node_names)
    drained = gateway.drain(full, "spark1")
    assert gateway.nodes_in_rotation(drained) == ["spark2"]
    assert {e["model_name"] for e in drained["model_list"]} == {"fast", "reasoning", "code"}
    assert gateway.restore(drained, fleet, "spark1") == full
    assert gateway.restore(full, fleet, "spark1") == full  # idempotent
    assert full["model_list"] and gateway.drain(full, "spark1") != full  # input untouched
    assert len(full["model_list"]) == 6


def test_foreign_entries_survive_drain_and_restore():
    fleet = load_fleet("fleets/seed.yaml")
    cfg = gateway.render_config(fleet, ["spark2"])
    cfg["model_list"].insert(0, {"model_name": "other", "litellm_params": {"model": "openai/x"}})
    out = gateway.restore(gateway.drain(cfg, "spark2"), fleet, "spark1")
    assert out["model_list"][0]["model_name"] == "other"
    assert gateway.nodes_in_rotation(out) == ["spark1"]
    assert gateway.load(gateway.dump(out)) == out


def test_api_host_override_and_ipv6(seed_data):
    seed_data["gateway"]["api_host_overrides"] = {"spark2": "fd00::2"}
    fleet = parse_fleet(seed_data)
    cfg = gateway.render_config(fleet, ["spark2"])
    assert cfg["model_list"][0]["litellm_params"]["api_base"] == "http://[fd00::2]:8000/v1"
