"""The node library: what the simulated nodes run is copied under the sim root and imports
from there alone, as an unprivileged user (a clone under a 0700 folder is out of its reach)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from spark_pipelines.core.gpu import parse_q
from spark_sim import node_lib
from spark_sim.layout import SimError

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv (runs the check as nobody)")


@pytest.fixture()
def root() -> Iterator[Path]:
    # Not under pytest's tmp_path: /tmp/pytest-of-root is 0700, which is the very thing tested.
    d = Path(tempfile.mkdtemp(prefix="spark-sim-lib-", dir="/var/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_install_copies_the_stand_ins_and_their_imports(root: Path) -> None:
    lib = node_lib.install(root)
    assert lib.path == root / "lib" / "python"
    assert (lib.path / "spark_sim" / "captures").is_dir() and (lib.path / "pydantic").is_dir()
    assert (lib.path / "spark_pipelines" / "core" / "gpu.py").is_file()
    assert not (lib.path / "spark_pipelines" / "assets").exists()  # only the pure layer
    for p in lib.path.rglob("*"):
        assert p.stat().st_mode & (0o005 if p.is_dir() else 0o004), p
    # The nvidia-smi stand-in, run as nobody from the copy, answers -q in the layout core parses.
    state = root / "state.json"
    state.write_text('{"state": "wedged", "profile": "gx10", "under_load": true}')
    os.chmod(state, 0o644)
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", lib.python, "-s", "-m",
         "spark_sim.nvidia_smi_standin", "-q"],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(lib.path), "SIM_GPU_STATE_FILE": str(state)},
        cwd=root, capture_output=True, text=True, timeout=60, check=True)
    reading = parse_q(out.stdout)[0]
    assert reading.power_draw_w is not None and reading.power_draw_w < 15  # the wedge: load at ~10 W
    assert reading.name is not None and "GB10" in reading.name


def test_a_missing_dependency_is_named(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node_lib, "THIRD_PARTY", tuple(n for n in node_lib.THIRD_PARTY if n != "pydantic"))
    with pytest.raises(SimError, match="pydantic"):
        node_lib.install(root)
