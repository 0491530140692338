"""The offline Python base image of the simulated fleet, assembled from Debian packages.

No container registry is reachable from the simulated nodes (nor from this machine), so the
`FROM` of every simulated build is an image made here: the .debs of a minimal Python 3.11 plus
busybox (sh, patch, sed, ... as applets) and git (local clones and `git apply`), unpacked with
`dpkg -x` into one folder, tarred once into a cache dir and `docker import`ed into each node's
engine on every `sim up`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from spark_sim.gpu_hook import CONTAINER_STATE_PATH

IMAGE_REF = "sim-python-base:latest"

# The closure of python3.11-minimal + libpython3.11-stdlib that the stdlib modules a serving
# stand-in needs (json, http.server, ssl, sqlite3, ctypes, hashlib, lzma, ...) link against.
# perl and libcurl are left out on purpose: git's local operations work without them.
PACKAGES: tuple[str, ...] = (
    "libc6",
    "libgcc-s1",
    "zlib1g",
    "libssl3",
    "libffi8",
    "libexpat1",
    "libbz2-1.0",
    "liblzma5",
    "libsqlite3-0",
    "libncursesw6",
    "libtinfo6",
    "libreadline8",
    "libuuid1",
    "libdb5.3",
    "libnsl2",
    "libtirpc3",
    "libtirpc-common",
    "libcrypt1",
    "libgssapi-krb5-2",
    "libkrb5-3",
    "libk5crypto3",
    "libkrb5support0",
    "libcom-err2",
    "libkeyutils1",
    "media-types",
    "ca-certificates",
    "netbase",
    "libpython3.11-minimal",
    "libpython3.11-stdlib",
    "python3.11-minimal",
    "python3-minimal",
    "busybox-static",
    "git",
    "libpcre2-8-0",
)

# Busybox applets linked into /bin so Dockerfile RUN lines and scripts find the usual tools.
BUSYBOX_APPLETS: tuple[str, ...] = (
    "sh", "ash", "cat", "cp", "mv", "rm", "ln", "ls", "mkdir", "rmdir", "chmod", "chown", "touch",
    "echo", "printf", "test", "[", "true", "false", "sleep", "env", "sed", "grep", "awk", "head",
    "tail", "wc", "sort", "uniq", "cut", "tr", "find", "xargs", "tar", "gzip", "gunzip", "patch",
    "diff", "id", "whoami", "hostname", "uname", "ps", "kill", "date", "dirname", "basename",
    "readlink", "realpath", "stat", "du", "df", "tee", "which", "wget", "sha256sum", "md5sum",
    "mktemp", "seq", "expr", "yes", "nproc", "free", "pwd", "install", "dd", "vi", "less", "more",
)

VERIFY_ARGV = ("python3", "-c", "import json, http.server, ssl, sqlite3, hashlib, ctypes, lzma; print('ok')")


class BaseImageError(Exception):
    """The base image could not be assembled; the message says which step and what to do."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("SPARK_SIM_CACHE", "/var/cache/spark-sim"))


# Bump when the assembly below changes, so a cached tarball of the old recipe is not reused.
RECIPE_VERSION = "2"


def _cache_key() -> str:
    return hashlib.sha256("\n".join((RECIPE_VERSION, *PACKAGES, *BUSYBOX_APPLETS)).encode()).hexdigest()[:12]


def tarball_path(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / f"sim-python-base-{_cache_key()}.tar"


def _run(argv: list[str], cwd: Path | None = None, what: str = "") -> str:
    try:
        p = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        raise BaseImageError(f"{what or argv[0]}: {argv[0]} is not installed (apt-get install it)") from None
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise BaseImageError(f"{what or ' '.join(argv[:3])} failed (exit {p.returncode}): {' | '.join(tail)}")
    return p.stdout


def _fetch_debs(debs: Path) -> list[Path]:
    """apt-get download each package once; a reused cache dir needs no network at all."""
    debs.mkdir(parents=True, exist_ok=True)
    have = {f.name.split("_", 1)[0]: f for f in debs.glob("*.deb")}
    missing = [p for p in PACKAGES if p not in have]
    if missing:
        _run(["apt-get", "download", *missing], cwd=debs, what="apt-get download of the base image packages")
    found = {f.name.split("_", 1)[0]: f for f in debs.glob("*.deb")}
    absent = [p for p in PACKAGES if p not in found]
    if absent:
        raise BaseImageError(f"apt-get download did not produce {', '.join(absent)}; run apt-get update and retry")
    return [found[p] for p in PACKAGES]


def _merge_into(src: Path, dst: Path) -> None:
    """Move src's tree into dst, merging directories that exist in both, then drop src."""
    for entry in list(src.iterdir()):
        target = dst / entry.name
        if entry.is_dir() and not entry.is_symlink() and target.is_dir() and not target.is_symlink():
            _merge_into(entry, target)
        elif not target.exists() and not target.is_symlink():
            shutil.move(str(entry), str(target))
    shutil.rmtree(src)


def _assemble_rootfs(root: Path, debs: list[Path]) -> None:
    for deb in debs:
        _run(["dpkg-deb", "-x", str(deb), str(root)], what=f"unpacking {deb.name}")
    # Debian 12 is merged-/usr: the packages put files in /usr/bin, /usr/lib, and the dynamic
    # loader path /lib64/ld-linux-x86-64.so.2 must resolve, so recreate the top-level symlinks.
    for d in ("bin", "sbin", "lib", "lib64"):
        top, usr = root / d, root / "usr" / d
        usr.mkdir(parents=True, exist_ok=True)
        if top.is_dir() and not top.is_symlink():
            _merge_into(top, usr)
        if not top.is_symlink():
            top.symlink_to(f"usr/{d}")
    bb = root / "usr/bin/busybox"
    if not bb.exists():
        raise BaseImageError("busybox-static did not unpack /usr/bin/busybox")
    for applet in BUSYBOX_APPLETS:
        link = root / "usr/bin" / applet
        if not link.exists() and not link.is_symlink():
            link.symlink_to("busybox")
    py = root / "usr/bin/python3"
    if not py.exists() and not py.is_symlink():
        py.symlink_to("python3.11")
    if not (root / "usr/bin/python").exists():
        (root / "usr/bin/python").symlink_to("python3")
    for d in ("tmp", "root", "run", "proc", "sys", "dev", "etc", "var/tmp", "home", "workspace"):
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)
    (root / "var/tmp").chmod(0o1777)
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    # Empty is fine for loopback-only use; keeps name lookups from reading the build host's files.
    (root / "etc/hosts").write_text("127.0.0.1 localhost\n")
    (root / "etc/os-release").write_text('PRETTY_NAME="spark-pipelines sim base (Debian 12 packages)"\nID=debian\n')
    # git refuses to work in a repo owned by another uid (docker build's COPY): trust everything.
    (root / "etc/gitconfig").write_text("[safe]\n\tdirectory = *\n[user]\n\tname = sim\n\temail = sim@localhost\n")


def build_tarball(cache_dir: Path | None = None, *, force: bool = False) -> Path:
    """Return the cached rootfs tarball, building it once (a few seconds from cached .debs)."""
    cache = cache_dir or default_cache_dir()
    out = tarball_path(cache)
    if out.exists() and not force:
        return out
    cache.mkdir(parents=True, exist_ok=True)
    debs = _fetch_debs(cache / "debs")
    with tempfile.TemporaryDirectory(dir=cache, prefix="rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        root.mkdir()
        _assemble_rootfs(root, debs)
        partial = out.with_suffix(".tar.partial")
        with tarfile.open(partial, "w") as tar:
            for entry in sorted(root.iterdir()):
                tar.add(entry, arcname=entry.name)
        partial.rename(out)
    return out


def import_into(docker_host: str, tarball: Path, ref: str = IMAGE_REF) -> str:
    """`docker import` the tarball into one engine; returns the image id."""
    env = {**os.environ, "DOCKER_HOST": docker_host}
    argv = [
        "docker", "import",
        "--change", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "--change", "ENV LANG=C.UTF-8",
        # Where the GPU hook puts the node's GPU state (as the real hook injects the driver):
        # every image built FROM this one finds it without extra launch env.
        "--change", f"ENV SIM_GPU_STATE_FILE=/{CONTAINER_STATE_PATH}",
        "--change", 'CMD ["python3"]',
        str(tarball), ref,
    ]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    if p.returncode != 0:
        raise BaseImageError(f"docker import into {docker_host} failed: {p.stderr.strip()[-300:]}")
    return p.stdout.strip()
