"""The local upstream stand-ins: reproducible repos, real anchors, a diff that really applies."""

import shutil
import subprocess

from spark_pipelines.core.dockerfile import LocalPatch, ServingPins, TorchPins, apply_build_edits, pin_serving_deps
from spark_sim import upstream
from spark_pipelines.core.fleet import load_fleet

# The pins come from the fleet file, their one home.
SEED_PINS = load_fleet("fleets/seed.yaml").pins


def test_repos_are_reproducible(tmp_path):
    assert upstream.make_build_repo(tmp_path / "a") == upstream.make_build_repo(tmp_path / "b")
    assert upstream.make_recipe_repo(tmp_path / "c") == upstream.make_recipe_repo(tmp_path / "d")


def test_build_dockerfile_takes_the_real_edits(tmp_path):
    upstream.make_build_repo(tmp_path / "b")
    text = (tmp_path / "b" / "Dockerfile").read_text()
    assert "ARG SIM_BASE_IMAGE=sim-python-base:latest" in text and "# syntax=" not in text
    edited, records = apply_build_edits(text, TorchPins.of(SEED_PINS.torch), [LocalPatch("pr38325")])
    assert all(r.changed for r in records)
    assert "torch==2.12.0+cu130" in edited and "nightly" not in edited


def test_swapab_diff_applies_with_git_apply_to_the_build_tree(tmp_path):
    upstream.make_build_repo(tmp_path / "b")
    upstream.make_recipe_repo(tmp_path / "r")
    # outside any git work tree, as /workspace/vllm is in the image
    src = tmp_path / "vllm"
    shutil.copytree(tmp_path / "b" / "sim-vllm-src", src)
    diff = tmp_path / "r" / upstream.SWAPAB_DIFF
    subprocess.run(["git", "apply", "-v", str(diff)], cwd=src, check=True, capture_output=True)
    assert (src / upstream.SWAPAB_TARGET).read_text() == upstream.SWAPAB_PATCHED


def test_dockerfile_v2_takes_the_starlette_pin(tmp_path):
    upstream.make_recipe_repo(tmp_path / "r")
    v2 = (tmp_path / "r" / "docker" / "Dockerfile.v2").read_text()
    assert "ARG VLLM_BASE=" in v2 and upstream.LMHEAD_MARKER in v2
    assert "starlette" in pin_serving_deps(v2, ServingPins.of(SEED_PINS.serving))


def test_build_and_copy_rejects_bad_flags(tmp_path):
    upstream.make_build_repo(tmp_path / "b")
    script = tmp_path / "b" / "build-and-copy.sh"
    bad = subprocess.run(["bash", script, "--bogus"], cwd=tmp_path / "b", capture_output=True, text=True)
    assert bad.returncode == 1 and "Unknown option: --bogus" in bad.stderr
    jobs = subprocess.run(["bash", script, "-j", "x", "--no-build"], cwd=tmp_path / "b", capture_output=True, text=True)
    assert jobs.returncode == 1 and "--build-jobs" in jobs.stderr
    ok = subprocess.run(["bash", script, "--no-build"], cwd=tmp_path / "b", capture_output=True, text=True)
    assert ok.returncode == 0 and not (tmp_path / "b" / "build-metadata.yaml").exists()


def test_stored_swapab_diff_is_the_diff_of_the_stored_sources(tmp_path):
    # The diff is a real file in the recipe tree; it must stay the diff between the two .cuh files.
    upstream.make_recipe_repo(tmp_path / "r")
    assert (tmp_path / "r" / upstream.SWAPAB_DIFF).read_text() == upstream.swapab_diff()


def test_every_stand_in_file_is_a_real_file_in_the_package():
    files = {**{f"build/{k}": v for k, v in upstream.build_repo_files().items()},
             **{f"recipe/{k}": v for k, v in upstream.recipe_repo_files().items()}}
    for rel in files:
        if rel not in {f"build/sim/{name}" for name in upstream.ENGINE_FILES}:  # their home is the simulator package
            assert (upstream.HERE / rel).is_file(), rel
    assert not any("__NIGHTLY__" in v or "__STABLE__" in v or "# __ST_LIB__" in v for v in files.values())
    for rel in (*upstream.BUILD_EXECUTABLE, *upstream.RECIPE_EXECUTABLE):
        assert rel in upstream.build_repo_files() or rel in upstream.recipe_repo_files(), rel
