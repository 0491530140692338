"""The linter is part of the unit tier: ruff's pyflakes rules ([tool.ruff] in pyproject.toml) over
the product, the simulator, the tests and the benchmarks. An undefined name in a recovery path
(`httpx` in runbook/deploy.py, reached only when a dead run's deploy was finished) is what it catches."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUFF = str(Path(sys.executable).parent / "ruff")
TREES = ["spark_pipelines", "sim", "tests", "benchmarks", "scripts"]


def ruff(where: Path, *trees: str) -> subprocess.CompletedProcess:
    return subprocess.run([RUFF, "check", "--no-cache", "--output-format", "concise", *trees], cwd=where,
                          capture_output=True, text=True, timeout=120)


def test_the_tree_is_clean():
    out = ruff(ROOT, *TREES)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_an_undefined_name_in_a_recovery_path_is_caught(tmp_path):
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    pkg = tmp_path / "spark_pipelines" / "runbook"
    pkg.mkdir(parents=True)
    (pkg / "deploy.py").write_text(
        "def finish(smoke):\n    try:\n        return smoke()\n    except (httpx.HTTPError, ValueError):\n"
        "        return None\n")
    out = ruff(tmp_path, "spark_pipelines")
    assert out.returncode == 1
    assert "F821" in out.stdout and "httpx" in out.stdout
