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
    full = gateway.fresh(gateway.render_config(fleet, fleet.node_names))
    drained = gateway.drain(full, fleet, "spark1")
    assert gateway.nodes_in_rotation(drained.config, fleet) == ["spark2"]
    assert {e["model_name"] for e in drained.config["model_list"]} == {"fast", "reasoning", "code"}
    assert gateway.restore(drained, fleet, "spark1").text() == full.text()
    assert gateway.restore(full, fleet, "spark1").text() == full.text()  # idempotent
    assert len(full.config["model_list"]) == 6 and drained.text() != full.text()  # input untouched


def test_foreign_entries_survive_drain_and_restore():
    fleet = load_fleet("fleets/seed.yaml")
    cfg = gateway.render_config(fleet, ["spark2"])
    cfg["model_list"].insert(0, {"model_name": "other", "litellm_params": {"model": "openai/x"}})
    out = gateway.restore(gateway.drain(gateway.fresh(cfg), fleet, "spark2"), fleet, "spark1").config
    assert out["model_list"][0]["model_name"] == "other"
    assert gateway.nodes_in_rotation(out, fleet) == ["spark1"]
    assert gateway.load(gateway.dump(out)) == out


def test_api_host_override_and_ipv6(seed_data):
    seed_data["gateway"]["api_host_overrides"] = {"spark2": "fd00::2"}
    fleet = parse_fleet(seed_data)
    cfg = gateway.render_config(fleet, ["spark2"])
    assert cfg["model_list"][0]["litellm_params"]["api_base"] == "http://[fd00::2]:8000/v1"


# -- owned entries: an operator's config survives render / drain / restore -----------------------

OPERATOR_ENTRY = {"model_name": "gpt-4o-proxy", "litellm_params": {"model": "openai/gpt-4o", "api_key": "os.environ/OPENAI_KEY"},
                  "model_info": {"id": "operator-gpt4o", "team": "research"}}
OPERATOR_TAIL = {"model_name": "local-embed", "litellm_params": {"model": "openai/embed", "api_base": "http://10.0.0.9/v1"}}


def operator_config(fleet):
    """What an operator's file looks like after the first gateway step and their own edits."""
    cfg = gateway.render_config(fleet, fleet.node_names)
    cfg["model_list"] = [OPERATOR_ENTRY, *cfg["model_list"], OPERATOR_TAIL]
    cfg["litellm_settings"] = {"drop_params": True, "num_retries": 3, "callbacks": ["prometheus"]}
    cfg["router_settings"] = {"routing_strategy": "simple-shuffle", "timeout": 600}
    cfg["general_settings"] = {"master_key": "os.environ/MY_KEY", "alerting": ["slack"]}
    cfg["environment_variables"] = {"SOME": "value"}
    return cfg


def foreign(cfg):
    return [e for e in cfg["model_list"] if gateway.owner(e) is None]


def test_render_keeps_operator_entries_settings_and_unknown_keys():
    fleet = load_fleet("fleets/seed.yaml")
    cfg = operator_config(fleet)
    out = gateway.render_config(fleet, ["spark2"], cfg)
    assert foreign(out) == [OPERATOR_ENTRY, OPERATOR_TAIL]
    assert gateway.nodes_in_rotation(out) == ["spark2"]
    for k in ("litellm_settings", "router_settings", "general_settings", "environment_variables"):
        assert out[k] == cfg[k], k
    # The owned block keeps its place between the operator's entries.
    assert out["model_list"][0] == OPERATOR_ENTRY and out["model_list"][-1] == OPERATOR_TAIL
    back = gateway.render_config(fleet, fleet.node_names, out)
    assert back == cfg
    assert cfg == operator_config(fleet)  # input untouched


def test_drain_and_restore_keep_operator_config_exactly():
    fleet = load_fleet("fleets/seed.yaml")
    cfg = operator_config(fleet)
    doc = gateway.fresh(cfg)
    drained = gateway.drain(doc, fleet, "spark1")
    assert gateway.nodes_in_rotation(drained.config, fleet) == ["spark2"]
    assert foreign(drained.config) == [OPERATOR_ENTRY, OPERATOR_TAIL]
    assert {k: v for k, v in drained.config.items() if k != "model_list"} == {k: v for k, v in cfg.items() if k != "model_list"}
    assert gateway.restore(drained, fleet, "spark1").config == cfg
    # Emptied (min_in_rotation 0) and refilled: everything back where it was.
    emptied = gateway.drain(drained, fleet, "spark2")
    assert foreign(emptied.config) == foreign(drained.config) and gateway.nodes_in_rotation(emptied.config, fleet) == []
    refilled = gateway.restore(emptied, fleet, "spark2")
    assert refilled.text() == drained.text()
    # Text round trip, with drain notes in the header
    text = gateway.drain(doc, fleet, "spark1", "bench_results run 1a2b since 2026-12-03T11:00:00Z").text()
    assert gateway.load(text) == drained.config
    assert gateway.load_drains(text) == {"spark1": "bench_results run 1a2b since 2026-12-03T11:00:00Z"}


def test_legacy_tag_is_owned_and_rewritten_with_the_new_mark():
    fleet = load_fleet("fleets/seed.yaml")
    cfg = gateway.render_config(fleet, fleet.node_names)
    for e in cfg["model_list"]:
        e["model_info"] = {"id": e["model_info"]["id"], "spark_node": e["model_info"][gateway.OWNER_TAG]}
    assert gateway.nodes_in_rotation(cfg) == ["spark1", "spark2"]
    out = gateway.render_config(fleet, ["spark1"], cfg)
    assert all(gateway.OWNER_TAG in e["model_info"] for e in out["model_list"])
    assert gateway.nodes_in_rotation(out) == ["spark1"]


def test_entry_with_an_operator_model_info_but_no_mark_is_not_owned():
    assert gateway.owner({"model_name": "x", "model_info": {"id": "spark1-qwen35-122b-fast"}}) is None
    assert gateway.owner({"model_name": "x", "model_info": {gateway.OWNER_TAG: "spark1"}}) == "spark1"
    assert gateway.owner("junk") is None


def test_fresh_config_gets_defaults_and_existing_settings_are_never_added_to():
    fleet = load_fleet("fleets/seed.yaml")
    fresh = gateway.render_config(fleet, ["spark1"], None)
    assert fresh["general_settings"]["master_key"] == "os.environ/LITELLM_MASTER_KEY"
    bare = {"model_list": [OPERATOR_ENTRY]}  # an operator's proxy with no master key
    out = gateway.render_config(fleet, ["spark1"], bare)
    assert set(out) == {"model_list"} and out["model_list"][0] == OPERATOR_ENTRY
    drift = gateway.settings_drift(out, fleet)
    assert any("routing_strategy" in d and "kept" in d for d in drift)
    assert any("master_key is not set" in d for d in drift)
    assert gateway.settings_drift(fresh, fleet) == []


def test_owned_view_hides_operator_entries():
    fleet = load_fleet("fleets/seed.yaml")
    view = gateway.owned_view(operator_config(fleet))
    assert view["operator_entries"] == ["gpt-4o-proxy", "local-embed"]
    assert "OPENAI_KEY" not in gateway.dump(view)
    assert len(view["model_list"]) == 6


# -- the rotation floor ----------------------------------------------------------------------------


def test_rotation_refusal_below_min_in_rotation(seed_data):
    fleet = load_fleet("fleets/seed.yaml")
    assert fleet.gateway.min_in_rotation == 1
    assert gateway.rotation_refusal(fleet, ["spark1", "spark2"], ["spark2"]) is None
    why = gateway.rotation_refusal(fleet, ["spark2"], [], {"spark1": "bench_results since 2026-12-03T11:00:00Z"})
    assert why and "min_in_rotation=1" in why and "spark2" in why
    assert "spark1 is out (bench_results since 2026-12-03T11:00:00Z)" in why
    # Putting a node back, or not shrinking, is never refused, even below the floor.
    assert gateway.rotation_refusal(fleet, [], ["spark1"]) is None
    assert gateway.rotation_refusal(fleet, [], []) is None
    seed_data["gateway"]["min_in_rotation"] = 2
    two = parse_fleet(seed_data)
    why = gateway.rotation_refusal(two, ["spark1", "spark2"], ["spark2"])
    assert "only 2 serve node(s)" in why and "lower gateway.min_in_rotation" in why
    seed_data["gateway"]["min_in_rotation"] = 0
    assert gateway.rotation_refusal(parse_fleet(seed_data), ["spark1"], []) is None
    try:
        gateway.check_rotation(fleet, ["spark1"], [])
    except gateway.RotationRefused as e:
        assert "min_in_rotation" in str(e)
    else:
        raise AssertionError("not refused")


def test_min_in_rotation_is_validated(seed_data):
    import pytest

    from spark_pipelines.core.fleet import FleetError

    seed_data["gateway"]["min_in_rotation"] = -1
    with pytest.raises(FleetError, match="min_in_rotation"):
        parse_fleet(seed_data)


def test_bad_config_text_is_one_clear_line():
    import pytest

    with pytest.raises(ValueError, match="not valid YAML.*previous"):
        gateway.load("model_list: [\n")
    with pytest.raises(ValueError, match="model_list is not a list"):
        gateway.nodes_in_rotation({"model_list": "x"})


def test_definitions_bind_the_master_key_only_when_set(monkeypatch):
    from spark_pipelines.definitions import build_definitions

    monkeypatch.delenv("LITELLM_MASTER_KEY", raising=False)
    assert build_definitions("fleets/seed.yaml").resources["litellm"].master_key is None
    monkeypatch.setenv("LITELLM_MASTER_KEY", "sk-unit")
    import dagster as dg

    bound = build_definitions("fleets/seed.yaml").resources["litellm"]
    assert bound.master_key == dg.EnvVar("LITELLM_MASTER_KEY")


def test_deploy_drains_are_counted_against_max_unavailable(seed_data):
    fleet = parse_fleet(seed_data)  # rollout.max_unavailable defaults to 1
    assert gateway.deploy_refusal(fleet, "spark1", {}) is None
    assert gateway.deploy_refusal(fleet, "spark1", {"spark2": "bench spark2 since 2026-12-03T10:00:00Z"}) is None
    why = gateway.deploy_refusal(fleet, "spark1", {"spark2": f"{gateway.DEPLOY_DRAIN} (run ab12cd34) since x"})
    assert why and "spark2 is out of the gateway for a deploy already" in why and "rollout.max_unavailable=1" in why
    # Its own note (a retried drain) does not count against it.
    assert gateway.deploy_refusal(fleet, "spark1", {"spark1": f"{gateway.DEPLOY_DRAIN} since x"}) is None
    seed_data["rollout"] = {**seed_data.get("rollout", {}), "max_unavailable": 2}
    assert gateway.deploy_refusal(parse_fleet(seed_data), "spark1", {"spark2": f"{gateway.DEPLOY_DRAIN} since x"}) is None
