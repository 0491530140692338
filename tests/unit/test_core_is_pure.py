"""The runbook's knowledge stays importable without Dagster, SSH, Docker or HTTP clients."""

import ast
import pathlib

FORBIDDEN = {"dagster", "paramiko", "docker", "httpx", "requests", "socket", "subprocess", "urllib", "huggingface_hub"}


def test_core_modules_import_no_effects():
    offenders = []
    for path in pathlib.Path("spark_pipelines/core").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            offenders += [f"{path}: {m}" for m in mods if m.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders
    assert len(list(pathlib.Path("spark_pipelines/core").glob("*.py"))) >= 5
