"""Shapes that every name, host, tag and path from a fleet file must have.

Values from the fleet file end up in remote argv (docker run, rsync, ssh). argv quoting already
keeps them from being interpreted by a shell, but a value that *needs* quoting is almost always a
typo or an attack, so we refuse it at load time with a message that names the field.
"""

from __future__ import annotations

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
