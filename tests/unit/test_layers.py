"""The layers declared in pyproject.toml ([tool.importlinter]) hold: import-linter's contracts run
here, on this tree, and on a copy broken on purpose (so a contract that cannot fail is seen)."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = str(Path(sys.executable).parent / "lint-imports")


def lint(where: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT, "--no-cache"], cwd=where, capture_output=True, text=True, timeout=120)


def test_every_layer_contract_is_kept():
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 7 kept, 0 broken" in out.stdout


def test_a_broken_tree_breaks_the_contracts(tmp_path):
    shutil.copytree(ROOT / "spark_pipelines", tmp_path / "spark_pipelines",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    pkg = tmp_path / "spark_pipelines"

    def add(module: str, line: str) -> None:
        path = pkg / module
        path.write_text(path.read_text() + f"\n{line}\n")

    add("core/names.py", "import httpx  # an effect in the core")
    add("runbook/sweep.py", "from spark_pipelines.doctor import render_text  # a face in the code location")
    add("resources/lease.py", "from spark_pipelines.runbook import rotation  # upward")
    add("runbook/rollout.py", "from spark_pipelines.state import records  # the instance below the Dagster side")
    add("sensors/pins.py", "import spark_sim.fleet  # the simulator in the code location")
    add("state/markers.py", "import paramiko  # an SSH client of its own")
    add("core/steps.py", "from spark_pipelines.core import pins  # steps -> pins -> steps: a circle")
    out = lint(tmp_path)
    assert out.returncode != 0
    assert "Contracts: 0 kept, 7 broken" in out.stdout, out.stdout[-3000:]
