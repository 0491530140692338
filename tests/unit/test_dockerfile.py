"""Dockerfile edits on texts shaped like eugr/spark-vllm-docker's (anchors as install.sh sees them)."""

import pytest

from spark_pipelines.core.dockerfile import (
    DockerfileEditError, LocalPatch, ServingPins, TorchPins, apply_build_edits,
    find_vllm_prs_block, guard_torch_override, inject_local_patch, pin_serving_deps, pin_torch,
    strip_temporary_patches,
)
from spark_pipelines.core.fleet import load_fleet

# The pins come from the fleet file, their one home.
SEED_PINS = load_fleet("fleets/seed.yaml").pins

NIGHTLY = "uv pip install torch torchvision torchaudio triton --index-url https://download.pytorch.org/whl/nightly/cu130"
UPSTREAM = f"""\
ARG BUILD_JOBS=16
FROM nvidia/cuda:13.2.0-devel-ubuntu24.04 AS base
RUN --mount=type=cache,id=uv-cache,target=/root/.cache/uv \\
     {NIGHTLY} && \\
     uv pip install nvidia-nvshmem-cu13 "apache-tvm-ffi<0.2"
FROM base AS vllm-builder
ARG VLLM_PRS=""

RUN if [ -n "$VLLM_PRS" ]; then \\
        echo "Applying PRs: $VLLM_PRS"; \\
        for pr in $VLLM_PRS; do \\
            git fetch origin pull/${{pr}}/head:pr-${{pr}}; \\
        done; \\
    fi

# TEMPORARY PATCH for broken FP8 kernels - https://github.com/vllm-project/vllm/pull/35568
RUN curl -fsL https://example.invalid/35568.diff -o pr35568.diff \\
    && git apply -v --exclude="tests/*" pr35568.diff \\
    && rm pr35568.diff

# TEMPORARY PATCH for broken compilation - https://github.com/vllm-project/vllm/pull/38919
RUN curl -fsL https://example.invalid/38919.diff -o pr38919.diff \\
    && git apply -v pr38919.diff \\
    && rm pr38919.diff

RUN uv pip install -r requirements/build/cuda.txt
FROM nvidia/cuda:13.2.0-devel-ubuntu24.04 AS runner
RUN --mount=type=cache,id=uv-cache,target=/root/.cache/uv \\
     {NIGHTLY} && \\
     uv pip install nvidia-nvshmem-cu13
RUN if [ "$PRE_TRANSFORMERS" = "1" ]; then \\
        uv pip install /workspace/wheels/*.whl --override /tmp/tf-override.txt; \\
    else \\
        uv pip install /workspace/wheels/*.whl; \\
    fi
RUN uv pip install ray[default] fastsafetensors
"""
PINS = TorchPins.of(SEED_PINS.torch)


def test_strip_removes_both_blocks_and_is_idempotent():
    out = strip_temporary_patches(UPSTREAM)
    assert "pr35568" not in out and "pr38919" not in out and "TEMPORARY PATCH" not in out
    assert "uv pip install -r requirements/build/cuda.txt" in out
    assert strip_temporary_patches(out) == out


def test_strip_refuses_block_without_end_instead_of_deleting_to_eof():
    broken = UPSTREAM.replace("    && rm pr38919.diff\n", "")
    with pytest.raises(DockerfileEditError) as err:
        strip_temporary_patches(broken)
    assert err.value.edit == "strip-temporary-patches" and "rm pr38919.diff" in err.value.anchor


def test_strip_refuses_when_pr_reference_remains():
    moved = UPSTREAM + "RUN echo pr38919 is referenced elsewhere\n"
    with pytest.raises(DockerfileEditError, match="pr38919"):
        strip_temporary_patches(moved)


def test_pin_changes_both_stages_to_stable_triple():
    out = pin_torch(UPSTREAM, PINS)
    assert out.count(PINS.install_line) == 2
    assert "nightly" not in out and "whl/cu130" in out
    assert pin_torch(out, PINS) == out


def test_pin_refuses_when_only_one_stage_matches():
    one = UPSTREAM.replace(NIGHTLY, NIGHTLY.replace("nightly/cu130", "cu130"), 1)
    with pytest.raises(DockerfileEditError) as err:
        pin_torch(one, PINS)
    assert err.value.edit == "pin-torch" and "1 pinned" in str(err.value)


def test_inject_lands_right_after_the_vllm_prs_fi_structurally():
    shifted = "# padding\n" * 7 + UPSTREAM
    first, last = find_vllm_prs_block(shifted)
    out = inject_local_patch(shifted, LocalPatch("pr38325"))
    lines = out.splitlines()
    assert lines[last].strip() == "fi"
    assert lines[last + 2] == "COPY local-pr38325.diff /tmp/local-pr38325.diff"
    assert lines[last + 3] == "RUN git apply -v /tmp/local-pr38325.diff && rm /tmp/local-pr38325.diff"
    assert inject_local_patch(out, LocalPatch("pr38325")) == out


def test_inject_refuses_without_vllm_prs_block():
    with pytest.raises(DockerfileEditError, match="VLLM_PRS"):
        inject_local_patch(UPSTREAM.replace('RUN if [ -n "$VLLM_PRS" ]', "RUN if true"), LocalPatch("x"))


def test_guard_overrides_every_later_uv_install_including_derived_stage():
    out = guard_torch_override(pin_torch(UPSTREAM, PINS), PINS)
    assert out.count("> /etc/uv-torch-override.txt") == 2
    for needle in ("requirements/build/cuda.txt", "/workspace/wheels/*.whl;", "ray[default]"):
        line = next(l for l in out.splitlines() if needle in l)
        assert "--override /etc/uv-torch-override.txt" in line, line
    assert guard_torch_override(out, PINS) == out


def test_guard_needs_the_pin_first():
    with pytest.raises(DockerfileEditError, match="pin-torch"):
        guard_torch_override(UPSTREAM, PINS)


def test_apply_build_edits_records_each_edit():
    text, records = apply_build_edits(UPSTREAM, PINS, [LocalPatch("pr38325")])
    assert [r.edit for r in records] == [
        "strip-temporary-patches", "pin-torch", "guard-torch-override", "inject-pr38325"]
    assert all(r.changed for r in records)
    assert records[0].lines[0] == UPSTREAM.splitlines().index(
        "# TEMPORARY PATCH for broken FP8 kernels - https://github.com/vllm-project/vllm/pull/35568") + 1
    again, records2 = apply_build_edits(text, PINS, [LocalPatch("pr38325")])
    assert again == text and not any(r.changed for r in records2)


def test_serving_pins_before_entrypoint_once():
    v2 = 'ARG VLLM_BASE=vllm-sm121:latest\nFROM ${VLLM_BASE}\nENTRYPOINT ["vllm"]\nCMD ["serve"]\n'
    out = pin_serving_deps(v2, ServingPins.of(SEED_PINS.serving))
    lines = out.splitlines()
    run = 'RUN pip install --no-deps "starlette>=0.40.0,<1.0" "fastapi>=0.115.0,<0.116.0"'
    assert lines.index(run) == lines.index('ENTRYPOINT ["vllm"]') - 1
    assert pin_serving_deps(out, ServingPins.of(SEED_PINS.serving)) == out
    with pytest.raises(DockerfileEditError, match="ENTRYPOINT"):
        pin_serving_deps("FROM x\n", ServingPins.of(SEED_PINS.serving))


def test_bad_params_are_refused_with_field_name():
    with pytest.raises(ValueError, match="TorchPins.torch"):
        TorchPins(torch="2.12 ; rm -rf /", torchvision="0.27.0+cu130", torchaudio="2.11.0+cu130",
                  index_url="https://download.pytorch.org/whl/cu130")
    with pytest.raises(ValueError, match="LocalPatch.name"):
        LocalPatch("../evil")
