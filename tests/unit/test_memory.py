from spark_pipelines.core.memory import memory_gate


def test_runbook_numbers():
    g = memory_gate(106.0, 121.69, 0.85, 0.87)
    assert g.required_gib == 103.44 and g.verdict == "pass"
    # The GX10's refusal at 0.90: "Free memory (106.0 GiB) < desired (109.46 GiB)" (runbook rounds 109.52)
    g = memory_gate(106.0, 121.69, 0.90, 0.87)
    assert g.verdict == "fail" and g.required_gib == 109.52


def test_residue_advice_is_reboot_never_lower_gmu():
    g = memory_gate(99.0, 121.69, 0.85, 0.85)
    assert g.verdict == "fail" and g.margin_gib == -4.44
    text = " ".join(g.advice)
    assert "reboot" in text and "residue" in text
    assert "do NOT lower GMU to 0.80" in text
    assert "use 0.80" not in text.lower()


def test_tight_margin_warns():
    g = memory_gate(104.5, 121.69, 0.85, 0.85)
    assert g.verdict == "tight" and g.passed


def test_bad_numbers_refused():
    import pytest

    with pytest.raises(ValueError):
        memory_gate(-1, 121.69, 0.85)
    with pytest.raises(ValueError):
        memory_gate(100, 0, 0.85)


def test_gmu_080_passes_the_free_memory_check_but_is_called_out():
    g = memory_gate(118.0, 121.69, 0.80, 0.85)
    assert g.verdict == "pass" and any("OOMs in CUDA graph capture" in a for a in g.advice)
