"""The offline Python base image of the simulated fleet, assembled from Debian packages.

The `FROM` of every simulated build is an image made here (no registry is reachable): the
product's offline rootfs (spark_pipelines.resources.rootfs: a minimal Python 3.11 and busybox) plus git
(local clones and `git apply`), tarred once into a cache dir and `docker import`ed into each node's
engine on every `sim up`.
"""

from __future__ import annotations

import os
from pathlib import Path

from spark_pipelines.resources import rootfs
from spark_pipelines.resources.rootfs import BUSYBOX_APPLETS
from spark_pipelines.resources.rootfs import RootfsError as BaseImageError  # noqa: F401  (the sim CLI's name)
from spark_sim.gpu_hook import CONTAINER_STATE_PATH

IMAGE_REF = "sim-python-base:latest"

# perl and libcurl are left out on purpose: git's local operations work without them.
PACKAGES: tuple[str, ...] = (*rootfs.PYTHON_PACKAGES, "git", "libpcre2-8-0")

VERIFY_ARGV = ("python3", "-c", "import json, http.server, ssl, sqlite3, hashlib, ctypes, lzma; print('ok')")


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPARK_SIM_CACHE", "/var/cache/spark-sim"))


# Bump when the assembly below changes, so a cached tarball of the old recipe is not reused.
RECIPE_VERSION = "2"


def tarball_path(cache_dir: Path | None = None) -> Path:
    key = rootfs.cache_key(RECIPE_VERSION, *PACKAGES, *BUSYBOX_APPLETS)
    return (cache_dir or default_cache_dir()) / f"sim-python-base-{key}.tar"


def _trust_every_repo(root: Path) -> None:
    # git refuses to work in a repo owned by another uid (docker build's COPY): trust everything.
    (root / "etc/gitconfig").write_text("[safe]\n\tdirectory = *\n[user]\n\tname = sim\n\temail = sim@localhost\n")


def build_tarball(cache_dir: Path | None = None, *, force: bool = False) -> Path:
    """Return the cached rootfs tarball, building it once (a few seconds from cached .debs)."""
    return rootfs.build_tarball(tarball_path(cache_dir), PACKAGES, BUSYBOX_APPLETS, "spark-pipelines sim base",
                                finish=_trust_every_repo, force=force)


def import_into(docker_host: str, tarball: Path, ref: str = IMAGE_REF) -> str:
    """`docker import` the tarball into one engine; returns the image id."""
    # Where the GPU hook puts the node's GPU state (as the real hook injects the driver): every
    # image built FROM this one finds it without extra launch env.
    return rootfs.docker_import(docker_host, tarball, ref,
                                [f"ENV SIM_GPU_STATE_FILE=/{CONTAINER_STATE_PATH}", 'CMD ["python3"]'])
