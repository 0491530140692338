"""Shapes that every name, host, tag and path from a fleet file must have.

Values from the fleet file end up in remote argv (docker run, rsync, ssh). argv quoting already
keeps them from being interpreted by a shell, but a value that *needs* quoting is almost always a
typo or an attack, so we refuse it at load time with a message that names the field.
"""

from __future__ import annotations

import re

# A node or pool name: also used in container names, file names and LiteLLM model ids.
NODE_NAME = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")
# POSIX portable user names (what useradd accepts by default).
USER_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
# A DNS name or an IPv4/IPv6 literal; no spaces, no shell metacharacters.
HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*|\[?[0-9A-Fa-f:.]+\]?)$")
# Docker container names, as the engine accepts them.
CONTAINER_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]{0,127}$")
# An image reference: [registry/]repo[:tag]; lower-case repository as docker requires.
IMAGE_REF = re.compile(r"^[a-z0-9](?:[a-z0-9._/-]{0,200}[a-z0-9])?(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$")
# Paths on a node: absolute or ~-relative, no whitespace, quotes or shell metacharacters.
PATH = re.compile(r"^(?:~|~/|/)[A-Za-z0-9._/+@-]*$")
# A path relative to a repository checkout (patch files, Dockerfiles).
REPO_PATH = re.compile(r"^[A-Za-z0-9._+@-][A-Za-z0-9._/+@-]*$")
# Environment variable names as POSIX defines them.
ENV_NAME = re.compile(r"^[A-Z_][A-Z0-9_]*$")
# Env values end up in `-e NAME=VALUE`; keep them printable and free of quotes and newlines.
ENV_VALUE = re.compile(r"^[A-Za-z0-9_.:,=/+@%-]*$")
# A git revision: a (short) sha, a branch or a tag.
GIT_REF = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
FULL_SHA = re.compile(r"^[0-9a-f]{40}$")
# Hugging Face repo ids: owner/name.
HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.-]{0,95}$")
# A URL we pass to git or pip: https or a local file path, nothing a shell would expand.
URL = re.compile(r"^(?:https://[A-Za-z0-9.-]+(?::\d+)?(?:/[A-Za-z0-9._~/+-]*)?|file:///[A-Za-z0-9._/+-]*|/[A-Za-z0-9._/+-]+)$")
# A command-line flag of vLLM's serve: --kebab-case.
FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")
# A flag value: no whitespace-only tricks, no quotes, no newlines.
FLAG_VALUE = re.compile(r"^[A-Za-z0-9_.:,=/+@%{}\[\]\"-]*$")


def check(pattern: re.Pattern[str], value: str, what: str) -> str:
    """Return value when it has the shape, else raise ValueError saying which shape was expected."""
    if not isinstance(value, str) or not pattern.match(value):
        raise ValueError(f"{value!r} is not a valid {what}")
    return value
