"""The code-location image, built offline: the code server and every run container use it.

Its base is a Debian-package rootfs made here (rootfs.py: no registry is reachable); the project
and its pinned dependencies come as a wheelhouse built by pip from the project's own files, so
nothing but this machine's package sources is read. deploy/Dockerfile says what goes in; no secret
does (they arrive at run time as environment variables and read-only mounts).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from spark_pipelines.resources import rootfs

# What the wheels' native parts link against beyond the Python closure: grpcio, numpy and
# matplotlib need libstdc++; zoneinfo reads tzdata.
PACKAGES: tuple[str, ...] = (*rootfs.PYTHON_PACKAGES, "libstdc++6", "tzdata")
RECIPE_VERSION = "1"  # bump when the base assembly changes
REPOSITORY = "spark-pipelines-team"
BUILD_TIMEOUT_S = 1200


class ImageError(rootfs.RootfsError):
    """The image could not be built; the message names the step and what to do."""


@dataclass(frozen=True)
class TeamImage:
    ref: str  # repository:tag, the tag being the content key of what went in
    image_id: str
    size_bytes: int
    seconds: float
    built: bool  # False: an image of the same content was there already


def project_root() -> Path:
    """The clone the image is built from (an editable install's package sits in it)."""
    root = Path(__file__).resolve().parents[3]
    if not (root / "pyproject.toml").exists() or not (root / "deploy" / "Dockerfile").exists():
        raise ImageError(f"{root} is not a spark-pipelines clone (no pyproject.toml or deploy/Dockerfile): "
                         "build the team image from a clone")
    return root


def cache_dir() -> Path:
    return Path(os.environ.get("SPARK_TEAM_CACHE", "/var/cache/spark-pipelines"))


def _docker(docker_host: str, *args: str, timeout: float = 120, what: str = "") -> str:
    return rootfs.run(["docker", *args], env={**os.environ, "DOCKER_HOST": docker_host},
                      what=what or f"docker {args[0]}", timeout=timeout)


def image_present(docker_host: str, ref: str) -> bool:
    p = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", ref], capture_output=True, text=True,
                       env={**os.environ, "DOCKER_HOST": docker_host}, timeout=60)
    return p.returncode == 0


def base_image(docker_host: str) -> str:
    key = rootfs.cache_key(RECIPE_VERSION, *PACKAGES, *rootfs.BUSYBOX_APPLETS)
    ref = f"{REPOSITORY}-base:{key}"
    if not image_present(docker_host, ref):
        tar = rootfs.build_tarball(cache_dir() / f"team-base-{key}.tar", PACKAGES, rootfs.BUSYBOX_APPLETS,
                                   "spark-pipelines team base")
        rootfs.docker_import(docker_host, tar, ref, ['CMD ["python3"]'])
    return ref


def _pip(*args: str, what: str) -> None:
    rootfs.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], what=what, timeout=BUILD_TIMEOUT_S)


def _project_wheel(root: Path, into: Path) -> None:
    """The project's wheel, built from a copy of its files (setuptools would leave build/ in the clone)."""
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix="team-src-") as tmp:
        src = Path(tmp)
        shutil.copy2(root / "pyproject.toml", src)
        shutil.copytree(root / "spark_pipelines", src / "spark_pipelines",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        _pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(into), str(src), what="pip wheel of the project")


def wheelhouse(root: Path, into: Path) -> None:
    """The project's wheel, built now, and its dependencies' wheels, cached per pyproject.toml."""
    deps = cache_dir() / f"wheels-{hashlib.sha256((root / 'pyproject.toml').read_bytes()).hexdigest()[:12]}"
    if not (deps / ".complete").exists():
        deps.mkdir(parents=True, exist_ok=True)
        _project_wheel(root, deps)
        project = next(deps.glob("spark_pipelines-*.whl"))
        _pip("wheel", "--quiet", "--wheel-dir", str(deps), str(project), what="pip wheel of the project's dependencies")
        _pip("download", "--quiet", "--no-deps", "--dest", str(deps), "pip", what="pip download of pip")
        (deps / ".complete").touch()
    into.mkdir(parents=True)
    for whl in deps.glob("*.whl"):
        if not whl.name.startswith("spark_pipelines-"):
            os.link(whl, into / whl.name) if whl.stat().st_dev == into.stat().st_dev else shutil.copy2(whl, into)
    _project_wheel(root, into)


def _content_key(wheels: Path) -> str:
    h = hashlib.sha256()
    for whl in sorted(wheels.glob("*.whl")):
        h.update(whl.name.encode())
        if whl.name.startswith("spark_pipelines-"):
            # A wheel's zip carries timestamps: key the project by its files' contents instead.
            import zipfile
            with zipfile.ZipFile(whl) as z:
                for info in sorted(z.infolist(), key=lambda i: i.filename):
                    h.update(info.filename.encode() + z.read(info))
    return h.hexdigest()[:12]


def build(docker_host: str, log=print) -> TeamImage:
    """Build (or find) the image of this clone's code in the engine at `docker_host`."""
    started = time.monotonic()
    root = project_root()
    cache_dir().mkdir(parents=True, exist_ok=True)
    base = base_image(docker_host)
    with tempfile.TemporaryDirectory(dir=cache_dir(), prefix="team-context-") as ctx:
        context = Path(ctx)
        wheelhouse(root, context / "wheels")
        ref = f"{REPOSITORY}:{_content_key(context / 'wheels')}"
        built = not image_present(docker_host, ref)
        if built:
            log(f"team image: building {ref} from {base} (offline: local rootfs + wheelhouse)")
            _docker(docker_host, "build", "--quiet", "-f", str(root / "deploy" / "Dockerfile"), "--build-arg",
                    f"BASE={base}", "-t", ref, str(context), timeout=BUILD_TIMEOUT_S, what="docker build of the team image")
    _docker(docker_host, "tag", ref, f"{REPOSITORY}:latest")
    image_id, size = _docker(docker_host, "image", "inspect", "-f", "{{.Id}} {{.Size}}", ref).split()
    return TeamImage(ref=ref, image_id=image_id, size_bytes=int(size), seconds=time.monotonic() - started, built=built)
