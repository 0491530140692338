"""Code versions follow the pins; the Dagster definitions load and validate."""

import os
import subprocess
import sys

import yaml

from spark_pipelines.core.launch import launch_spec
from spark_pipelines.core.pins import changed_steps, code_versions, launch_versions
from spark_pipelines.state.markers import deploy_signature
from spark_pipelines.core.fleet import load_fleet, parse_fleet


def test_vllm_ref_changes_only_the_base_image_step(seed_data):
    before = code_versions(parse_fleet(seed_data))
    seed_data["pins"]["vllm_ref"] = "0123456789"
    after = code_versions(parse_fleet(seed_data))
    assert changed_steps(before, after) == ["base_image"]


def test_each_pin_reaches_its_step(seed_data):
    base = code_versions(parse_fleet(seed_data))
    cases = [
        (("pins", "base_model", "revision"), "1" * 40, ["base_model"]),
        (("pins", "recipe_repo", "commit"), "2" * 40, ["hybrid_checkpoint", "mtp_weights", "base_image", "serving_image"]),
        (("pins", "serving", "starlette"), ">=0.41.0,<1.0", ["serving_image"]),
        (("launch", "max_model_len"), 131072, []),  # every node's launch: data (launch_versions)
        (("gateway", "routing_strategy"), "simple-shuffle", ["gateway"]),
    ]
    for path, value, expected in cases:
        data = yaml.safe_load(yaml.safe_dump(seed_data))
        cur = data
        for k in path[:-1]:
            cur = cur[k]
        cur[path[-1]] = value
        assert changed_steps(base, code_versions(parse_fleet(data))) == expected, path


def test_an_override_on_spark2_is_spark2s_launch_not_the_fleets_code(seed_data):
    """A node's launch is that node's data: spark2's override moves spark2's launch version only,
    no code version, and spark1's node_deployment skip signature stays what it was (its next
    deploy still skips)."""
    before = parse_fleet(seed_data)
    seed_data["nodes"][1]["overrides"] = {"max_model_len": 131072}
    after = parse_fleet(seed_data)
    assert changed_steps(code_versions(before), code_versions(after)) == []
    old, new = launch_versions(before), launch_versions(after)
    assert old["spark1"] == new["spark1"] and old["spark2"] != new["spark2"]
    assert new["spark2"] == launch_spec(after, after.node("spark2")).fingerprint

    def spark1_signature(fleet):
        return deploy_signature(code_versions(fleet)["node_deployment"],
                                launch_spec(fleet, fleet.node("spark1")).fingerprint, "sha256:img", "idx")

    assert spark1_signature(before) == spark1_signature(after)


def test_launch_profile_gmu_reaches_every_nodes_launch(seed_data):
    before = launch_versions(parse_fleet(seed_data))
    seed_data["launch"]["gpu_memory_utilization"] = 0.83
    after = launch_versions(parse_fleet(seed_data))
    assert all(before[n] != after[n] for n in before)


def test_definitions_shape():
    from spark_pipelines.definitions import build_definitions

    defs = build_definitions("fleets/seed.yaml")
    repo = defs.get_repository_def()
    keys = {k.to_user_string() for k in repo.asset_graph.get_all_asset_keys()}
    assert keys == {"base_model", "hybrid_checkpoint", "mtp_weights", "base_image", "serving_image",
                    "node_artifacts", "artifact_distribution", "node_deployment", "jit_cache", "gateway",
                    "bench_results", "wedge_evidence", "cold_drain", "fleet_summary", "fleet_rollout", "fleet_adoption",
                    "node_os", "node_join", "node_launch"}
    node = repo.asset_graph.get(__import__("dagster").AssetKey("node_deployment"))
    assert node.partitions_def.get_partition_keys() == ["spark1", "spark2"]
    cv = code_versions(load_fleet("fleets/seed.yaml"))
    assert node.code_version == cv["node_deployment"]
    assert {j.name for j in repo.get_all_jobs()} >= {"build_job", "deploy_node_job", "gateway_job", "bench_job",
                                                    "wedge_capture_job", "cold_drain_job", "rollout_job", "node_os_job", "add_node_job"}


def test_dagster_definitions_validate(tmp_path):
    env = dict(os.environ, DAGSTER_HOME=str(tmp_path), SPARK_FLEET="fleets/seed.yaml")
    p = subprocess.run([sys.executable, "-m", "dagster", "definitions", "validate", "-w", "workspace.yaml"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "All code locations passed validation" in p.stderr + p.stdout


def test_hf_token_is_an_envvar_read_when_a_run_starts(monkeypatch):
    import dagster as dg

    from spark_pipelines.definitions import build_definitions
    from spark_pipelines.resources.hub import ModelHub, model_hub

    monkeypatch.delenv("HF_TOKEN", raising=False)
    defs = build_definitions("fleets/seed.yaml")  # loads without a token: the pinned repos are public
    assert defs.resources["hub"].hf_token is None

    @dg.asset
    def uses_hub(hub: ModelHub) -> dict:
        return hub.secret_env()

    assert dg.materialize([uses_hub], resources={"hub": model_hub()}).output_for_node("uses_hub") == {}
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    hub = model_hub()
    # The definitions hold the variable's name, not the secret; Dagster resolves it per run.
    assert isinstance(hub.hf_token, dg.EnvVar) and "hf_secret_value" not in repr(hub.hf_token)
    res = dg.materialize([uses_hub], resources={"hub": hub})
    assert res.output_for_node("uses_hub") == {"HF_TOKEN": "hf_secret_value"}
