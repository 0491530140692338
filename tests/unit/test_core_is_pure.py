"""The runbook's knowledge stays importable without Dagster, SSH, Docker or HTTP clients."""

import ast
import pathlib

FORBIDDEN = {"dagster", "paramiko", "docker", "httpx", "requests", "socket", "subprocess", "urllib", "huggingface_hub"}
# prometheus_client is allowed for its text parser only (core/diagnosis.py reads /metrics text with
# it); its exporters and HTTP servers stay out of core.
ALLOWED_ONLY = {"prometheus_client": {"prometheus_client.parser"}}


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
            offenders += [f"{path}: {m}" for m in mods
                          if m.split(".")[0] in ALLOWED_ONLY and m not in ALLOWED_ONLY[m.split(".")[0]]]
    assert not offenders, offenders
    assert len(list(pathlib.Path("spark_pipelines/core").glob("*.py"))) >= 5
