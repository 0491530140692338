"""Issue 23, item 5: `make plan` ("touching nothing") ran `apt-get update` on every call, and failed
for a user who cannot, because bootstrap looked for `/var/lib/apt/lists/*_Packages` while this
Debian keeps them as `*_Packages.lz4`. With everything installed, bootstrap runs no apt-get at all."""

import glob
import os
import subprocess
from pathlib import Path

import pytest


def test_bootstrap_base_runs_no_apt_get_when_everything_is_there(tmp_path):
    if not glob.glob("/var/lib/apt/lists/*_Packages*"):
        pytest.skip("no apt package lists on this machine: the first bootstrap must run apt-get update")
    stamp = Path(".venv/.stamp")
    if not stamp.is_file():
        pytest.skip("the project venv is not bootstrapped here")
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "apt-get.calls"
    (fake / "apt-get").write_text(f"#!/bin/sh\necho \"$*\" >> {calls}\nexit 100\n")
    (fake / "apt-get").chmod(0o755)
    p = subprocess.run(["scripts/bootstrap.sh", "base"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert p.returncode == 0, p.stderr
    assert not calls.exists(), calls.read_text()


def test_bootstrap_prometheus_runs_no_apt_get_once_installed(tmp_path):
    """`make test` bootstraps the prometheus part each time: once Debian's prometheus and
    prometheus-alertmanager are installed it is a no-op (no apt-get, no service started)."""
    installed = subprocess.run(["dpkg-query", "-W", "-f=${Status}\\n", "prometheus", "prometheus-alertmanager"],
                               capture_output=True, text=True)
    if installed.stdout.count("ok installed") != 2:
        pytest.skip("prometheus / prometheus-alertmanager not installed here (scripts/bootstrap.sh prometheus)")
    fake = tmp_path / "bin"
    fake.mkdir()
    calls = tmp_path / "calls"
    for tool in ("apt-get", "systemctl"):
        (fake / tool).write_text(f"#!/bin/sh\necho \"{tool} $*\" >> {calls}\nexit 100\n")
        (fake / tool).chmod(0o755)
    p = subprocess.run(["scripts/bootstrap.sh", "prometheus"], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"})
    assert p.returncode == 0, p.stderr
    assert not calls.exists(), calls.read_text()
