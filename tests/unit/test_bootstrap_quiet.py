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


def test_two_bootstraps_do_not_install_into_one_shared_venv_at_once(tmp_path):
    """Issue 35, item 16: the venvs under /opt are shared by every clone; a second bootstrap waits
    for the one holding <dir>.lock, then installs (here: a stand-in python and pip that record calls)."""
    import fcntl
    import time

    calls = tmp_path / "calls"
    fake_py = tmp_path / "python"
    # `python -m venv DIR` makes DIR/bin/python and DIR/bin/pip that only record what they were asked.
    fake_py.write_text(f"""#!/bin/sh
echo "python $*" >> {calls}
mkdir -p "$3/bin"
printf '#!/bin/sh\\necho "pip $*" >> {calls}\\n' > "$3/bin/pip"
cp "$3/bin/pip" "$3/bin/python"
chmod 755 "$3/bin/pip" "$3/bin/python"
""")
    fake_py.chmod(0o755)
    venv = tmp_path / "opt" / "litellm"
    venv.parent.mkdir()
    held = open(f"{venv}.lock", "w")
    fcntl.flock(held, fcntl.LOCK_EX)  # another bootstrap is installing there
    p = subprocess.Popen(["scripts/bootstrap.sh", "litellm"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env={**os.environ, "PYTHON": str(fake_py), "SPARK_LITELLM_VENV": str(venv)})
    try:
        time.sleep(3)
        assert p.poll() is None and not calls.exists(), "the second bootstrap installed while the lock was held"
    finally:
        held.close()  # the first one is done
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    assert "waiting for it" in out, out
    assert calls.read_text().splitlines()[0].startswith("python -m venv"), calls.read_text()
