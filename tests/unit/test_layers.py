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
    assert "Contracts: 9 kept, 0 broken" in out.stdout


def test_a_broken_tree_breaks_the_contracts(tmp_path):
    shutil.copytree(ROOT / "spark_pipelines", tmp_path / "spark_pipelines",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    pkg = tmp_path / "spark_pipelines"

    def add(module: str, line: str) -> None:
        path = pkg / module
        path.write_text(path.read_text() + f"\n{line}\n")

    add("core/names.py", "import httpx  # an effect in the core")
    add("runbook/sweep.py", "from spark_pipelines.cli.doctor import render_text  # a face in the code location")
    add("resources/lease.py", "from spark_pipelines.runbook import rotation  # upward")
    add("runbook/rollout.py", "from spark_pipelines.state import records  # the instance below the Dagster side")
    add("sensors/pins.py", "import spark_sim.fleet  # the simulator in the code location")
    add("state/markers.py", "import paramiko  # an SSH client of its own")
    add("core/steps.py", "from spark_pipelines.core import pins  # steps -> pins -> steps: a circle")
    add("assets/health.py", "from spark_pipelines.assets.nodes import DeployConfig  # a sibling phase's logic")
    add("runbook/bench.py", "import dagster  # a procedure on the framework")
    out = lint(tmp_path)
    assert out.returncode != 0
    assert "Contracts: 0 kept, 9 broken" in out.stdout, out.stdout[-3000:]


# The gateway host's writes of who is in the rotation (resources/gateway.py GatewayHost).
MEMBERSHIP_WRITES = {"drain", "restore", "note", "set_rotation"}


def membership_writers(root: Path) -> dict[str, list[str]]:
    """Every module under spark_pipelines/ that calls a membership write on a gateway host, with
    the calls (`x.drain(...)` where x is a gateway: gw, host, self.gw, ...)."""
    import ast

    found: dict[str, list[str]] = {}
    for path in sorted((root / "spark_pipelines").rglob("*.py")):
        rel = str(path.relative_to(root))
        if rel == "spark_pipelines/resources/gateway.py":  # the writes themselves
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in MEMBERSHIP_WRITES):
                owner = ast.unparse(node.func.value)
                if owner.split(".")[-1] in ("gw", "host", "gateway", "gateway_host") or "GatewayHost(" in owner:
                    found.setdefault(rel, []).append(f"{owner}.{node.func.attr} (line {node.lineno})")
    return found


def test_one_procedure_writes_who_is_in_the_gateway(tmp_path):
    assert set(membership_writers(ROOT)) == {"spark_pipelines/runbook/rotation.py"}, membership_writers(ROOT)
    # A second writer is seen (the test can fail).
    shutil.copytree(ROOT / "spark_pipelines", tmp_path / "spark_pipelines",
                    ignore=shutil.ignore_patterns("__pycache__"))
    bench = tmp_path / "spark_pipelines" / "runbook" / "bench.py"
    bench.write_text(bench.read_text() + "\n\ndef _out(gw, node):\n    gw.drain(node, reason='x')\n")
    assert "spark_pipelines/runbook/bench.py" in membership_writers(tmp_path)
