"""`spark-pipelines sim` refuses bad input with exit 2 and one clear line, before touching anything;
the GPU hook writes the node's state into a container rootfs only when GPUs were asked for."""

from __future__ import annotations

import io
import os
import json
from pathlib import Path

import pytest

from spark_sim import gpu_hook
from spark_sim.cli import sim_command


@pytest.fixture(autouse=True)
def _empty_sim_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_SIM_ROOT", str(tmp_path / "sim-root"))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["set", "spark1", "melted"], "unknown GPU state 'melted'"),
        (["up", "--nodes", "0"], "--nodes 0"),
        (["up", "--nodes", "two"], "invalid int value"),
        (["reboot"], "invalid choice"),
        ([], "required"),
        (["set", "spark9", "wedged"], "no simulated fleet is up"),
        (["power", "spark2", "reboot"], "unknown action 'reboot'"),
        (["power", "spark2", "on"], "no simulated fleet is up"),
        (["hand"], "no simulated fleet is up"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_command(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err


def test_status_without_a_fleet_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_command(["status"]) == 0
    assert "no simulated fleet is up" in capsys.readouterr().out


def test_bad_slot_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SPARK_SIM_SLOT", "40")
    assert sim_command(["status"]) == 1
    assert "SPARK_SIM_SLOT=40" in capsys.readouterr().err


def _bundle(tmp_path: Path, env: list[str]) -> Path:
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "process": {"env": env}}))
    return bundle


def _hook(bundle: Path, state_file: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"ociVersion": "1.0.2", "id": "c1", "bundle": str(bundle)})))
    return gpu_hook.main(["--state-file", str(state_file), "prestart"])


def test_hook_injects_the_state_with_memory_figures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"state": "residue", "profile": "gx10"}))
    bundle = _bundle(tmp_path, ["PATH=/usr/bin", "NVIDIA_VISIBLE_DEVICES=all"])
    assert _hook(bundle, state, monkeypatch) == 0
    doc = json.loads((bundle / "rootfs/run/sim-gpu/state.json").read_text())
    healthy = gpu_hook.container_state({"state": "healthy", "profile": "gx10"})
    assert doc["state"] == "residue" and doc["total_gib"] == healthy["total_gib"]
    assert doc["free_gib"] < healthy["free_gib"]  # residue leaves less free than a clean boot


@pytest.mark.parametrize("env", [["PATH=/usr/bin"], ["NVIDIA_VISIBLE_DEVICES=void"]])
def test_hook_leaves_containers_without_gpus_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: list[str]) -> None:
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"state": "healthy", "profile": "founders"}))
    bundle = _bundle(tmp_path, env)
    assert _hook(bundle, state, monkeypatch) == 0
    assert not (bundle / "rootfs/run").exists()


def test_hook_fails_loudly_without_a_state_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    bundle = _bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=all"])
    assert _hook(bundle, tmp_path / "missing.json", monkeypatch) == 1
    assert "GPU state file" in capsys.readouterr().err


def test_down_refuses_a_root_the_sim_did_not_make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "data.txt").write_text("keep me")
    monkeypatch.setenv("SPARK_SIM_ROOT", str(precious))
    monkeypatch.setenv("SPARK_SIM_SLOT", "4")
    assert sim_command(["down"]) == 1
    assert "was not made by the sim" in capsys.readouterr().err
    assert (precious / "data.txt").read_text() == "keep me"


def test_root_too_close_to_slash_is_refused(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SPARK_SIM_ROOT", "/var")
    assert sim_command(["down"]) == 1
    assert "too close to /" in capsys.readouterr().err


def test_up_refuses_a_root_the_node_users_cannot_enter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() != 0:
        pytest.skip("sim up checks root first")
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    monkeypatch.setenv("SPARK_SIM_ROOT", str(private / "sim-root"))
    monkeypatch.setenv("SPARK_SIM_SLOT", "5")
    assert sim_command(["up", "--nodes", "1", "--fleet-out", str(tmp_path / "f.yaml")]) == 1
    err = capsys.readouterr().err
    assert f"lies under {private} (mode 700)" in err and len(err.strip().splitlines()) == 1
    assert not (private / "sim-root").exists() and not (tmp_path / "f.yaml").exists()


@pytest.mark.parametrize("argv", [["up", "--nodes", "33"], ["up", "--link-mbit", "0"]])
def test_up_refuses_more_than_32_nodes_and_a_link_without_rate(argv: list[str],
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_command(argv) in (1, 2)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and argv[1] in err and "choose" in err
