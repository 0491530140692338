"""Shapes that every name, host, tag and path from a fleet file must have.

Values from the fleet file end up in remote argv (docker run, rsync, ssh). argv quoting already
keeps them from being interpreted by a shell, but a value that *needs* quoting is almost always a
typo or an attack, so we refuse it at load time with a message that names the field.
"""

from __future__ import annotations

import ipaddress
import re

# A node or pool name: also used in container names, file names and LiteLLM model ids.
NODE_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?\Z")
# POSIX portable user names (what useradd accepts by default).
USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}\Z")
# A DNS name or an IPv4/IPv6 literal; no spaces, no shell metacharacters.
HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*|[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*|\[[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*\])\Z")
# Docker container names, as the engine accepts them.
CONTAINER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}\Z")
# An image reference: [registry/]repo[:tag]; lower-case repository as docker requires.
IMAGE_REF = re.compile(r"^[a-z0-9](?:[a-z0-9._/-]{0,200}[a-z0-9])?(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?\Z")
# Paths on a node: absolute or ~-relative, no whitespace, quotes or shell metacharacters.
PATH = re.compile(r"^(?:~|~/[A-Za-z0-9._/+@-]*|/[A-Za-z0-9._/+@-]*)\Z")  # `~user` (another home) refused
# A path relative to a repository checkout (patch files, Dockerfiles).
REPO_PATH = re.compile(r"^[A-Za-z0-9._+@][A-Za-z0-9._/+@-]*\Z")  # no leading "-": it would read as an option
# Environment variable names as POSIX defines them.
# A systemd unit as systemctl takes it: `gdm3`, `snapd.socket`, `NetworkManager-wait-online`.
UNIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@:-]{0,127}\Z")
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*\Z")
# Env values end up in `-e NAME=VALUE`; keep them printable and free of quotes and newlines.
ENV_VALUE = re.compile(r"^[A-Za-z0-9_.:,=/+@%-]*\Z")
# A git revision: a (short) sha, a branch or a tag; no `..` (a range to git, not a revision).
GIT_REF = re.compile(r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._/-]{0,127}\Z")
FULL_SHA = re.compile(r"^[0-9a-f]{40}\Z")
# Hugging Face repo ids: owner/name.
HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}\Z")
# A URL we pass to git or pip: https or a local file path, nothing a shell would expand.
URL = re.compile(r"^(?:https://[A-Za-z0-9.-]+(?::\d+)?(?:/[A-Za-z0-9._~/+-]*)?|file:///[A-Za-z0-9._/+-]*|/[A-Za-z0-9._/+-]+)\Z")
# A command-line flag of vLLM's serve: --kebab-case.
FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*\Z")
# A flag value: no whitespace-only tricks, no quotes, no newlines.
FLAG_VALUE = re.compile(r"^[A-Za-z0-9_.:,=/+@%{}\[\]\"-]*\Z")


MAX_SHOWN = 60


def shown(value: object) -> str:
    """repr of a value for a one-line message: escapes visible, long values cut."""
    r = repr(value)
    return r if len(r) <= MAX_SHOWN else r[: MAX_SHOWN - 3] + "..."


def check(pattern: re.Pattern[str], value: str, what: str) -> str:
    """Return value when it has the shape, else raise ValueError saying which shape was expected.

    fullmatch (and `\\Z` in the patterns): with `$`, a value ending in a newline would pass."""
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"{shown(value)} is not a valid {what}")
    return value


def check_host(value: str, what: str = "host name or IP address") -> str:
    """A DNS name or an IP address, and nothing that only looks like one: `256.1.1.1`, `1.2.3`,
    `2130706433` or `0x7f.1` would reach the resolver as some other address (inet_aton reads them),
    `::::` as no address at all."""
    check(HOST, value, what)
    bare = value[1:-1] if value.startswith("[") else value
    if ":" in bare:
        try:
            ipaddress.IPv6Address(bare)
        except ValueError:
            raise ValueError(f"{shown(value)} is not a valid {what}: not an IPv6 address; write it as the "
                             "node's IPv6 address (e.g. fd00::12) or its name") from None
        return value
    if len(value) > 253:
        raise ValueError(f"{shown(value)} is not a valid {what}: a DNS name has at most 253 characters")
    if re.fullmatch(r"\d+|0[xX][0-9A-Fa-f]*", value.rsplit(".", 1)[-1]):
        try:
            ipaddress.IPv4Address(value)
        except ValueError:
            raise ValueError(f"{shown(value)} is not a valid {what}: it reads as an IPv4 address but is not "
                             "one; write four numbers 0-255 without leading zeros (e.g. 10.0.0.12), or a "
                             "name whose last label is not a number") from None
    return value


# The OS's own directories: a cache or model directory there would be set aside, relinked or wiped
# by the deploy's cache switch, the rollout's finish and the checkpoint's rebuild. Refused with
# everything under them; the shared roots below are refused as themselves.
SYSTEM_DIRS = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/boot", "/dev", "/proc", "/sys",
               "/run", "/snap", "/var/run", "/var/lib/docker", "/var/lib/containerd", "/var/lib/dpkg", "/var/lib/apt")
SHARED_ROOTS = ("/", "/home", "/root", "/var", "/var/lib", "/var/log", "/tmp", "/var/tmp", "/opt", "/srv", "/mnt",
                "/media", "~", "~/.cache", "~/.config", "~/.local")
HOME_PRIVATE = ("~/.ssh", "~/.cache/spark-pipelines")  # keys; this tool's own markers, journal and leases


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def check_cache_dir(value: str, what: str = "cache or model directory") -> str:
    """A directory of its own for caches, models or kernel archives (see SYSTEM_DIRS)."""
    path = value.rstrip("/") or "/"
    fix = "give a directory of its own, e.g. ~/.cache/vllm or ~/models"
    top = next((d for d in SYSTEM_DIRS if _under(path, d)), None)
    if top is not None:
        raise ValueError(f"{shown(value)} is not a place for a {what}: {top} is the system's; {fix}")
    if path in SHARED_ROOTS or re.fullmatch(r"/home/[^/]+", path):
        raise ValueError(f"{shown(value)} is not a place for a {what}: it is a shared directory or a home itself, "
                         f"which the deploy would set aside and relink; {fix}")
    private = next((d for d in HOME_PRIVATE if _under(path, d) or _under(d, path)), None)
    if private is not None:
        raise ValueError(f"{shown(value)} is not a place for a {what}: it holds or is inside {private}; {fix}")
    return value


def check_path(value: str, what: str, *, form: str = "node") -> str:
    """A path of the given form with no `..` component (it would escape the directory it names).

    form: "node" = absolute or ~/..., "absolute" = starts with /, "relative" = inside a directory."""
    pattern = REPO_PATH if form == "relative" else PATH
    check(pattern, value, what)
    if form == "absolute" and not value.startswith("/"):
        raise ValueError(f"{shown(value)} is not a valid {what}: it must be absolute (start with /)")
    if ".." in value.split("/"):
        raise ValueError(f"{shown(value)} is not a valid {what}: '..' would leave the directory; write the path without it")
    return value
