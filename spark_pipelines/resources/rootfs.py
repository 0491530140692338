"""An image root filesystem assembled from Debian packages, for engines that reach no registry.

No container registry is reachable from this machine (nor from a fleet behind a firewall), so a
`FROM` has to be made here: the .debs of a minimal Python 3.11 (and whatever else a caller lists)
are fetched once with `apt-get download`, unpacked with `dpkg -x` into one folder, tarred once into
a cache dir and `docker import`ed. The team image and the simulated fleet's base image both start
from this.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

# The closure of python3.11-minimal + libpython3.11-stdlib that the stdlib modules a Python
# service needs (json, http.server, ssl, sqlite3, ctypes, hashlib, lzma, ...) link against.
PYTHON_PACKAGES: tuple[str, ...] = (
    "libc6", "libgcc-s1", "zlib1g", "libssl3", "libffi8", "libexpat1", "libbz2-1.0", "liblzma5",
    "libsqlite3-0", "libncursesw6", "libtinfo6", "libreadline8", "libuuid1", "libdb5.3", "libnsl2",
    "libtirpc3", "libtirpc-common", "libcrypt1", "libgssapi-krb5-2", "libkrb5-3", "libk5crypto3",
    "libkrb5support0", "libcom-err2", "libkeyutils1", "media-types", "ca-certificates", "netbase",
    "libpython3.11-minimal", "libpython3.11-stdlib", "python3.11-minimal", "python3-minimal",
    "busybox-static",
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

PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class RootfsError(Exception):
    """The image root could not be assembled or imported; the message says which step and what to do."""


def run(argv: Sequence[str], cwd: Path | None = None, what: str = "", env: dict[str, str] | None = None,
        timeout: float = 600) -> str:
    try:
        p = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    except FileNotFoundError:
        raise RootfsError(f"{what or argv[0]}: {argv[0]} is not installed (apt-get install it)") from None
    except subprocess.TimeoutExpired:
        raise RootfsError(f"{what or ' '.join(argv[:3])} did not finish within {timeout:.0f} s") from None
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
        raise RootfsError(f"{what or ' '.join(argv[:3])} failed (exit {p.returncode}): {' | '.join(tail)}")
    return p.stdout


def fetch_debs(packages: Sequence[str], debs: Path) -> list[Path]:
    """apt-get download each package once; a reused cache dir needs no network at all."""
    debs.mkdir(parents=True, exist_ok=True)
    have = {f.name.split("_", 1)[0]: f for f in debs.glob("*.deb")}
    missing = [p for p in packages if p not in have]
    if missing:
        run(["apt-get", "download", *missing], cwd=debs, what="apt-get download of the image's packages")
    found = {f.name.split("_", 1)[0]: f for f in debs.glob("*.deb")}
    absent = [p for p in packages if p not in found]
    if absent:
        raise RootfsError(f"apt-get download did not produce {', '.join(absent)}; run apt-get update and retry")
    return [found[p] for p in packages]


def _merge_into(src: Path, dst: Path) -> None:
    """Move src's tree into dst, merging directories that exist in both, then drop src."""
    for entry in list(src.iterdir()):
        target = dst / entry.name
        if entry.is_dir() and not entry.is_symlink() and target.is_dir() and not target.is_symlink():
            _merge_into(entry, target)
        elif not target.exists() and not target.is_symlink():
            shutil.move(str(entry), str(target))
    shutil.rmtree(src)


def assemble(root: Path, debs: Sequence[Path], applets: Sequence[str], title: str) -> None:
    for deb in debs:
        run(["dpkg-deb", "-x", str(deb), str(root)], what=f"unpacking {deb.name}")
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
        raise RootfsError("busybox-static did not unpack /usr/bin/busybox")
    for applet in applets:
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
    # Loopback only by default; keeps name lookups from reading the build host's files.
    (root / "etc/hosts").write_text("127.0.0.1 localhost\n")
    (root / "etc/os-release").write_text(f'PRETTY_NAME="{title} (Debian 12 packages)"\nID=debian\n')


def cache_key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def build_tarball(out: Path, packages: Sequence[str], applets: Sequence[str], title: str, *,
                  finish: Callable[[Path], None] | None = None, force: bool = False) -> Path:
    """The rootfs tarball at `out`, built once (a few seconds from cached .debs, which sit beside
    it in debs/). `finish` adds the caller's own files to the root before it is tarred."""
    if out.exists() and not force:
        return out
    cache = out.parent
    cache.mkdir(parents=True, exist_ok=True)
    debs = fetch_debs(packages, cache / "debs")
    with tempfile.TemporaryDirectory(dir=cache, prefix="rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        root.mkdir()
        assemble(root, debs, applets, title)
        if finish:
            finish(root)
        partial = out.with_suffix(".tar.partial")
        with tarfile.open(partial, "w") as tar:
            for entry in sorted(root.iterdir()):
                tar.add(entry, arcname=entry.name)
        partial.rename(out)
    return out


def docker_import(docker_host: str | None, tarball: Path, ref: str, changes: Sequence[str] = ()) -> str:
    """`docker import` the tarball into one engine (DOCKER_HOST, or the default one); returns the image id."""
    env = dict(os.environ)
    if docker_host:
        env["DOCKER_HOST"] = docker_host
    argv = ["docker", "import", "--change", f"ENV {PATH_ENV}", "--change", "ENV LANG=C.UTF-8"]
    for c in changes:
        argv += ["--change", c]
    return run([*argv, str(tarball), ref], what=f"docker import into {docker_host or 'the local engine'}",
               env=env, timeout=300).strip()
