"""A/B variants are fleet changes validated like a fleet file, limited to the node under test."""

import pytest

from spark_pipelines.assets.experiments import Variant
from spark_pipelines.runbook.experiment import comparison_md, variant_fleet
from spark_pipelines.core.launch import docker_run_argv
from spark_pipelines.core.fleet import FleetError, load_fleet


def test_mtp3_variant_changes_only_the_speculative_tokens():
    f = load_fleet("fleets/seed.yaml")
    vf = variant_fleet(f, "spark2", Variant(name="mtp3", num_speculative_tokens=3))
    base, var = docker_run_argv(f, f.node("spark2")), docker_run_argv(vf, vf.node("spark2"))
    diff = [(a, b) for a, b in zip(base, var) if a != b]
    assert diff == [('{"method":"mtp","num_speculative_tokens":2}', '{"method":"mtp","num_speculative_tokens":3}')]
    assert vf.node_names == ["spark2"]


def test_env_variant_on_gx10_can_drop_a_fix_var_but_not_on_founders():
    f = load_fleet("fleets/seed.yaml")
    vf = variant_fleet(f, "spark2", Variant(name="no-atomic", unset_env=["VLLM_MARLIN_USE_ATOMIC_ADD"]))
    assert not any("VLLM_MARLIN_USE_ATOMIC_ADD" in a for a in docker_run_argv(vf, vf.node("spark2")))
    with pytest.raises(FleetError, match="VLLM_MARLIN_USE_ATOMIC_ADD"):
        variant_fleet(f, "spark1", Variant(name="no-atomic", unset_env=["VLLM_MARLIN_USE_ATOMIC_ADD"]))


def test_variant_cannot_exceed_the_hardware_gmu():
    f = load_fleet("fleets/seed.yaml")
    with pytest.raises(FleetError, match="0.9"):
        variant_fleet(f, "spark2", Variant(name="gmu90", gpu_memory_utilization=0.90))


def test_comparison_table_without_reports_still_renders_verdicts():
    md = comparison_md("spark2", {}, ["single-stream: cannot be told apart at this spread (...)"])
    assert "cannot be told apart" in md and "| variant |" in md


def test_a_variant_with_other_kernels_boots_on_a_slot_of_its_own():
    """An A/B variant whose kernel-shaping flags differ (MTP-3 vs MTP-2) must not boot on, nor
    compile into, the cache production reloads after the experiment (the stand-in fails such a
    boot as the runbook's stale-cache rows do); a variant alike in kernels shares production's."""
    from spark_pipelines.core.launch import launch_spec
    from spark_pipelines.runbook.experiment import variant_jit_key

    fleet = load_fleet("fleets/seed.yaml")
    node = fleet.serve_nodes[0]
    production = launch_spec(fleet, node)
    mtp3 = variant_fleet(fleet, node.name, Variant(name="mtp3", num_speculative_tokens=3))
    mtp2 = variant_fleet(fleet, node.name, Variant(name="mtp2", num_speculative_tokens=2))
    key = "0123456789abcdef"
    assert variant_jit_key(key, production, launch_spec(mtp2, mtp2.node(node.name))) == key
    other = variant_jit_key(key, production, launch_spec(mtp3, mtp3.node(node.name)))
    assert other is not None and other != key and len(other) == len(key)
    assert variant_jit_key(None, production, launch_spec(mtp3, mtp3.node(node.name))) is None
