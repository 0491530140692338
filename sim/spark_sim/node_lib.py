"""What the simulated nodes' programs run on, copied under the sim root.

A node user must never read the checkout or the project venv: a clone under a 0700 folder
(/root, a `mktemp -d`) is out of its reach, and `sim up` would then fail only later, at the first
`nvidia-smi` or `hf download` of a run. `install` copies the stand-in modules, the pure
`spark_pipelines.core` modules they import and the third-party packages those need (pydantic
and its dependencies) into <root>/lib/python, root-owned, dirs 0755 and files 0644, and checks
as an unprivileged user, with the interpreter the nodes use, that they import from there alone.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from spark_sim.layout import SimError

# Top-level packages (or single modules) the node programs import; the import check below
# names the missing one if a new dependency appears.
FIRST_PARTY = ("spark_sim", "spark_pipelines")
THIRD_PARTY = ("pydantic", "pydantic_core", "typing_extensions", "annotated_types", "typing_inspection",
               "prometheus_client")  # core.diagnosis parses /metrics with it
# Of spark_pipelines only the pure layer: the rest (dagster, paramiko) is the product's, not a node's.
FIRST_PARTY_ONLY = {"spark_pipelines": ("__init__.py", "core")}
# What the node wrappers run: nvidia-smi, hf, the GPU hook, poweroff and reboot, the OS stand-ins.
NODE_MODULES = ("spark_sim.nvidia_smi_standin", "spark_sim.gpu_states", "spark_sim.gpu_hook", "spark_sim.hf_standin",
                "spark_sim.power", "spark_sim.node_os", "spark_sim.reboot")
NOBODY = 65534


@dataclass(frozen=True)
class NodeLib:
    python: str  # an interpreter every node user can run
    path: Path  # PYTHONPATH for it

    def module_file(self, name: str) -> Path:
        return self.path / "spark_sim" / f"{name}.py"


def node_python() -> str:
    """The system interpreter of this venv's version (pydantic_core is compiled for it): the
    venv's own may live under a folder the node users cannot enter."""
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    return str(system) if system.exists() else os.path.realpath(sys.executable)


def _source(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise SimError(f"python package {name} is not installed; run `scripts/bootstrap.sh base`")
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    assert spec.origin is not None
    return Path(spec.origin)


def _copy(src: Path, dst: Path, only: tuple[str, ...] | None = None) -> None:
    if src.is_file():
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o644)
        return
    dst.mkdir(mode=0o755, exist_ok=True)
    os.chmod(dst, 0o755)
    for child in sorted(src.iterdir()):
        if child.name == "__pycache__" or (only is not None and child.name not in only):
            continue
        if child.is_dir() or child.is_file():
            _copy(child, dst / child.name)


def install(root: Path) -> NodeLib:
    """Copy what the node programs import to <root>/lib/python and prove a stranger can import it."""
    lib = root / "lib" / "python"
    if lib.exists():
        shutil.rmtree(lib)
    for d in (root / "lib", lib):
        d.mkdir(mode=0o755, exist_ok=True)
        os.chmod(d, 0o755)
    for name in (*FIRST_PARTY, *THIRD_PARTY):
        src = _source(name)
        _copy(src, lib / src.name, FIRST_PARTY_ONLY.get(name))
    out = NodeLib(node_python(), lib)
    check(out)
    return out


def check(lib: NodeLib) -> None:
    """Import the node modules as user nobody with only `lib.path` on the path: a file left
    unreadable or a dependency not copied fails `sim up` here, with its name."""
    probe = (
        "import sys\n"
        f"for m in {NODE_MODULES!r}:\n"
        "    __import__(m)\n"
        "    f = sys.modules[m].__file__\n"
        f"    assert f.startswith({str(lib.path) + '/'!r}), m + ' imported from ' + f\n"
    )
    argv = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", lib.python, "-s", "-c", probe]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(lib.path), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=lib.path, timeout=60)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        raise SimError(f"checking the node library {lib.path} failed: {e}") from None
    if p.returncode != 0:
        lines = (p.stderr or p.stdout).strip().splitlines()
        raise SimError(f"the node programs cannot import from {lib.path} as an unprivileged user: "
                       f"{lines[-1] if lines else 'exit ' + str(p.returncode)}")
