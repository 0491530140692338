"""The build host's procedures without a node: what the images' probes are judged by, the advice a
failed blocking check gives, and the hand-built fleet's commands against the fleet file's launch."""

import ast
import pathlib
import shlex

import pytest

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.launch import docker_run_argv
from spark_pipelines.runbook import images as img
from spark_pipelines.runbook import model as mdl
from spark_pipelines.runbook.build_steps import previous_dir, staging_dir
from spark_sim import hand


@pytest.fixture(scope="module")
def fleet():
    return load_fleet("fleets/seed.yaml")


def probe(**kw):
    base = dict(torch="2.12.0+cu130", torchvision="0.27.0+cu130", torchaudio="2.11.0+cu130", starlette="0.46.2",
                fastapi="0.115.12", lmhead=True,
                build_metadata=img.parse_build_metadata("build_args:\n  vllm_ref: 2a69949bd\n  transformers_5: true\n"))
    base.update(kw)
    return img.ImageProbe(**base)


def test_staging_and_previous_sit_beside_the_serving_directory():
    assert staging_dir("/h/models/qwen") == "/h/models/.qwen.staging"
    assert previous_dir("/h/models/qwen/") == "/h/models/.qwen.previous"


def test_build_metadata_is_read_flat():
    meta = img.parse_build_metadata('build_script_commit: abc\nbuild_args:\n  vllm_ref: 2a69949bd\n  vllm_prs: ""\n')
    assert meta == {"build_script_commit": "abc", "vllm_ref": "2a69949bd"}
    assert img.parse_build_metadata(None) == {}


def test_torch_triple_vllm_ref_and_tf5_against_the_pins(fleet):
    assert img.torch_differences(probe(), fleet) == []
    diffs = img.torch_differences(probe(torch="2.12.0+cpu", torchaudio=None,
                                        build_metadata={"vllm_ref": "3b5f1c2d0", "transformers_5": "false"}), fleet)
    assert diffs == ["torch: 2.12.0+cpu (pins.torch: 2.12.0+cu130)",
                     "torchaudio: does not import (pins.torch: 2.11.0+cu130)",
                     "vLLM ref: 3b5f1c2d0 (pins.vllm_ref: 2a69949bd)",
                     "transformers 5: false (pins.build.tf5: true)"]
    assert img.torch_ok(probe(), fleet) and not img.torch_ok(probe(torch="2.12.0+cpu"), fleet)


def test_torch_advice_says_what_to_change_before_the_rebuild(fleet):
    cpu = img.torch_advice(probe(torch="2.12.0+cpu"), fleet, "vllm-sm121:latest")
    assert "CPU" in cpu and "--override" in cpu and fleet.pins.build_repo.commit[:12] in cpu
    other = img.torch_advice(probe(torch="2.11.0+cu130"), fleet, "vllm-sm121:latest")
    assert "pin edit did not apply" in other and "pins.torch" in other
    broken = img.torch_advice(probe(torch=None, errors=("torch: ImportError: libtorch_cuda.so",)), fleet, "t")
    assert "libtorch_cuda.so" in broken and "both stages" in broken


def test_serving_image_needs_patch_03_and_the_starlette_pins(fleet):
    assert img.serving_differences(probe(), fleet) == []
    diffs = img.serving_differences(probe(lmhead=False, starlette="1.0.0", fastapi=None), fleet)
    assert diffs == [f"{img.LMHEAD_MARKER}: missing in logits_processor.py",
                     "starlette: 1.0.0 (pins.serving: >=0.40.0,<1.0)",
                     "fastapi: not installed (pins.serving: >=0.115.0,<0.116.0)"]
    advice = img.lmhead_advice(fleet, "vllm-qwen35-v2", probe(lmhead=False), "/out/build.log")
    assert "patch_int8_lmhead.py" in advice and "same pins gives the same image" in advice and "/out/build.log" in advice


def test_failed_checks_advise_what_mends_them_never_deleting_shards():
    for text in (mdl.HYBRID_ADVICE, mdl.mtp_advice("/snap"), mdl.BUILD_HOST_COPY_ADVICE, mdl.base_model_advice("/d")):
        assert "delete the model-" not in text and "--force" not in text
    assert "beside" in mdl.HYBRID_ADVICE and "not touched" in mdl.HYBRID_ADVICE
    assert "/snap" in mdl.mtp_advice("/snap") and "base_model" in mdl.mtp_advice("/snap")
    from spark_pipelines.core.artifacts import Checkpoint
    from spark_pipelines.core.checkpoint import CheckpointReport

    out = mdl.StepOutcome(Checkpoint("spark1", "/x", "invalid"), CheckpointReport("/x", problems=["a: missing"]), False,
                          mdl.HYBRID_ADVICE)
    assert out.check_text == f"a: missing; {mdl.HYBRID_ADVICE}" and out.data_version == "invalid"
    assert mdl.StepOutcome(Checkpoint("s", "/x", "i1", "m" * 64), CheckpointReport("/x"), True).data_version == "i1-" + "m" * 16


# ------------------------------------------------------------------------------ the hand-built fleet


def _docker_run(script: str) -> list[str]:
    joined = script.replace("\\\n", " ")
    line = next(ln for ln in joined.splitlines() if ln.strip().startswith("docker run"))
    return shlex.split(line)


def test_hand_launch_is_the_fleet_files_launch_without_labels(fleet):
    home = "/home/operator"
    for node in fleet.nodes:
        want = docker_run_argv(fleet, node)
        got = [a.replace("~", home, 1) if a.startswith("~/") else a for a in _docker_run(hand.launch_script())]
        got = [a.replace(":~/", f":{home}/") for a in got]
        assert [a.replace("~/", f"{home}/", 1) for a in got] == want
        assert not any("--label" == a for a in got)


def test_quick_relaunch_differs_only_by_four_env_vars(fleet):
    script = hand.quick_relaunch_argv_text()
    argv = _docker_run(script)
    full = _docker_run(hand.launch_script())
    assert len(full) - len(argv) == 8 and [a for a in full if a not in argv] == [
        f"{k}={v}" for k, v in hand.MANDATORY_ENV[2:]]
    assert "run-upstream.sh" in hand.quick_relaunch_script() and "| base64 -d" in hand.quick_relaunch_script()
    assert "0.80" in _docker_run(hand.launch_script(0.8))


def test_hand_litellm_config_is_the_runbooks_six_entries():
    import yaml

    from spark_sim.layout import Layout

    lay = Layout(pathlib.Path("/var/lib/spark-sim-x"), 3)
    members = lay.members(2)[:2]
    text = hand.litellm_config(members)
    assert "# spark1 entries" in text and "# spark2 entries (identical, different api_base)" in text
    doc = yaml.safe_load(text)
    ids = [e["model_info"]["id"] for e in doc["model_list"]]
    assert ids == [f"spark{n}-qwen35-122b-{p}" for n in (1, 2) for p in ("fast", "reasoning", "code")]
    assert {e["litellm_params"]["api_base"] for e in doc["model_list"]} == {
        f"http://{m.ip}:8000/v1" for m in members}
    assert doc["general_settings"] == {"master_key": "os.environ/LITELLM_MASTER_KEY"}
    assert "spark_pipelines_node" not in text


def test_the_hand_builder_uses_no_spark_pipelines_code():
    tree = ast.parse(pathlib.Path(hand.__file__).read_text())
    mods = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    mods += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    assert not [m for m in mods if m.startswith("spark_pipelines")], mods
    # spark_sim.fleet imports spark_pipelines' fleet loader for `up`; the hand builder only reads
    # what `up` left (members, keys, the fleet file) and runs ssh.
    assert {m for m in mods if m.startswith("spark_sim")} <= {"spark_sim.fleet", "spark_sim.layout"}
