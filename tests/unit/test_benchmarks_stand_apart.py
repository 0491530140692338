"""benchmarks/ and tests/ share launchers through spark_sim.servers, never each other's modules."""

import ast
import pathlib


def imported(path: pathlib.Path) -> set[str]:
    mods: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            mods.add(node.module.split(".")[0])
    return mods


def test_benchmarks_do_not_import_tests_and_tests_do_not_import_benchmarks():
    benchmarks = list(pathlib.Path("benchmarks").glob("*.py"))
    assert benchmarks
    assert [str(p) for p in benchmarks if "tests" in imported(p)] == []
    assert [str(p) for p in pathlib.Path("tests").rglob("*.py") if "benchmarks" in imported(p)] == []
    assert "spark_sim" in imported(pathlib.Path("benchmarks/bench_vs_vllm.py"))
