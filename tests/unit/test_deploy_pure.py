"""Pure parts of the deploy transaction: labels on the launch argv, the serving comparison, the
lease command and its busy message."""

import dataclasses
import json
import shlex

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.launch import DEPLOY_LABEL, IMAGE_LABEL, launch_spec
from spark_pipelines.resources.lease import BUSY_EXIT, _describe, lease_argv
from spark_pipelines.runbook.deploy import serving_mismatch

SEED = "fleets/seed.yaml"
IMG_A = "sha256:" + "a" * 64
IMG_B = "sha256:" + "b" * 64


def spec():
    f = load_fleet(SEED)
    return launch_spec(f, f.node("spark1"))


def test_labels_go_on_the_argv_but_not_into_the_fingerprint():
    plain = spec()
    labelled = dataclasses.replace(plain, labels={DEPLOY_LABEL: plain.fingerprint, IMAGE_LABEL: IMG_A})
    argv = labelled.docker_run_argv()
    assert plain.docker_run_argv() == [a for a in argv if a not in
                                       ("--label", f"{DEPLOY_LABEL}={plain.fingerprint}", f"{IMAGE_LABEL}={IMG_A}")]
    i = argv.index(f"{DEPLOY_LABEL}={plain.fingerprint}")
    image_at = len(argv) - len(plain.serve_args) - 1
    assert argv[i - 1] == "--label" and i < image_at and argv[image_at] == plain.image  # an option, before the image
    assert labelled.fingerprint == plain.fingerprint


def container(image, label, running=True):
    return {"Id": "c" * 64, "Image": image, "State": {"Running": running}, "Config": {"Labels": {DEPLOY_LABEL: label}}}


def test_serving_mismatch_names_the_node_and_the_fix():
    fp = spec().fingerprint
    assert serving_mismatch("spark1", container(IMG_A, fp), IMG_A, fp) is None
    why = serving_mismatch("spark1", container(IMG_A, fp), IMG_B, fp)
    assert why.startswith("spark1 runs image aaaaaaaaaaaa but node_artifacts recorded bbbbbbbbbbbb")
    assert "rerun node_artifacts for spark1" in why
    assert "launch spec other" in serving_mismatch("spark1", container(IMG_A, "other"), IMG_A, fp)
    assert "unlabelled" in serving_mismatch("spark1", {**container(IMG_A, fp), "Config": {"Labels": None}}, IMG_A, fp)
    assert "not running" in serving_mismatch("spark1", container(IMG_A, fp, running=False), IMG_A, fp)
    assert "not running" in serving_mismatch("spark1", None, IMG_A, fp)


def test_lease_argv_holds_the_lock_while_stdin_is_open():
    argv = lease_argv("/home/u/.cache/spark-pipelines/locks/run.lock", "/home/u/x.holder", json.dumps({"pid": 1}))
    assert argv[:5] == ["flock", "-n", "-E", str(BUSY_EXIT), "/home/u/.cache/spark-pipelines/locks/run.lock"]
    assert argv[-3:] == ["sh", '{"pid": 1}', "/home/u/x.holder"]
    assert argv[7].endswith("echo held; exec cat")
    # One command line, every argument quoted on its own.
    assert shlex.split(shlex.join(argv)) == argv


def test_busy_message_names_the_holder():
    text = _describe(json.dumps({"purpose": "bench", "run_id": "r1", "pid": 42, "host": "ctl", "started": 0}))
    assert text == "bench (run r1, pid 42 on ctl, since 1970-01-01 00:00:00 UTC)"
    assert "unknown holder" in _describe("")
