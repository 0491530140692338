"""Pure pieces of remote execution: argv quoting, sudo detection, rsync / ssh / verification argv,
and the output tail kept for error messages.

Nothing here opens a connection. `resources/ssh.py`, `resources/transfer.py` and
`resources/docker.py` render their commands with these functions and run them; keeping the
rendering here lets it be unit-tested without a node.
"""

from __future__ import annotations

import ipaddress
import json
import re
import shlex
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from spark_pipelines.core import names

# -- argv ---------------------------------------------------------------------------------------


class ArgvError(ValueError):
    """An argv that cannot be sent to a node (empty, not a list of strings, NUL bytes)."""


def check_argv(argv: Sequence[str]) -> list[str]:
    """Refuse shell strings and junk before they reach a node: argv must be a non-empty list of str."""
    if isinstance(argv, (str, bytes)):
        raise ArgvError(
            f"argv must be a list of arguments, not a string ({argv!r}); split it, e.g. ['docker', 'ps']"
        )
    out = list(argv)
    if not out:
        raise ArgvError("argv is empty: give at least the program to run")
    for i, a in enumerate(out):
        if not isinstance(a, str):
            raise ArgvError(f"argv[{i}] is {type(a).__name__} {a!r}, not str: convert it with str() first")
        if "\x00" in a:
            raise ArgvError(f"argv[{i}] contains a NUL byte, which no remote program can receive")
    return out


def quote_argv(argv: Sequence[str]) -> str:
    """The one command line sshd hands to the user's shell: each argument shlex-quoted."""
    return shlex.join(check_argv(argv))


def with_env(argv: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """Prefix `env K=V ...` (non-secret values only: they appear in the logged command line)."""
    if not env:
        return check_argv(argv)
    pairs = []
    for k, v in env.items():
        names.check(names.ENV_NAME, k, "environment variable name")
        pairs.append(f"{k}={v}")
    return ["env", *pairs, *check_argv(argv)]


def with_timeout(argv: Sequence[str], seconds: float, kill_after_s: int = 10) -> list[str]:
    """Wrap with coreutils `timeout` so the REMOTE process dies at the deadline.

    Closing an SSH channel does not stop a command started without a pty, so a local deadline
    alone would leave e.g. a runaway build running on the node."""
    secs = max(1, int(round(seconds)))
    return ["timeout", "-k", str(kill_after_s), str(secs), *check_argv(argv)]


# `timeout` exits with 124 when the deadline passed (137 if it had to SIGKILL after -k).
TIMEOUT_EXIT_CODES = frozenset({124, 137})

# -- how long a remote command may take ------------------------------------------------------------
# Every command runs under `with_timeout`: a command without its own limit gets the default. The long
# steps take the runbook's durations, each with margin, because killing a healthy 90-minute build at
# minute 89 costs more than waiting a little longer for a hung one. (Boot waits are not commands:
# the fleet file's `health_timeout_s` bounds the cold start, the deploy's rollback the warm one.)

# Anything not listed below: `docker image inspect`, mkdir, git checkout... answer in seconds; a few
# minutes is generous and still ends a frozen dockerd's hang before an operator would.
DEFAULT_COMMAND_TIMEOUT_S = 180.0
# A probe that should answer in seconds (inspect, stat): a frozen dockerd shows up fast.
PROBE_TIMEOUT_S = 30.0
# Runbook step 3: "./build-and-copy.sh ... ~15 min on Founders (fast NVMe), ~90 min on GX10". The
# serving image (step 4, a layer on top) gets the same limit.
IMAGE_BUILD_TIMEOUT_S = 150 * 60.0
# Runbook step 1: "Build hybrid checkpoint (~20 min, ~71 GB output)"; step 2 (MTP weights) is smaller.
CHECKPOINT_BUILD_TIMEOUT_S = 60 * 60.0
# Not in the runbook: ~70 GB from the Hub at ~50 Mbit/s is ~3 h; hf download resumes on a rerun.
DOWNLOAD_TIMEOUT_S = 4 * 60 * 60.0
# ~71 GB checkpoint node to node at 1 Gbit/s is ~10 min (the nodes' link is faster); rsync resumes.
COPY_TIMEOUT_S = 60 * 60.0
# docker save | docker load of the ~20 GB serving image between nodes.
IMAGE_COPY_TIMEOUT_S = 45 * 60.0


def secret_env_file(secrets: Mapping[str, str]) -> str:
    """Contents of the 0600 file that carries secret env values to a node (`set -a; . FILE`)."""
    lines = []
    for k, v in secrets.items():
        names.check(names.ENV_NAME, k, "environment variable name")
        if "\n" in v or "\x00" in v:
            raise ValueError(f"secret {k} contains a newline or NUL byte; it cannot be passed as an env value")
        lines.append(f"{k}={shlex.quote(v)}")
    return "\n".join(lines) + "\n"


def source_env_file_argv(env_file: str, argv: Sequence[str]) -> list[str]:
    """argv that loads secret env values from env_file, deletes the file, then execs argv.

    The values never appear in the command line (visible in `ps` on the node and in our logs),
    only the path of a file that is gone before the command starts doing work."""
    script = 'set -a; . "$0" || exit 97; rm -f -- "$0"; set +a; exec "$@"'
    return ["sh", "-c", script, env_file, *check_argv(argv)]


def redact(text: str, secrets: Iterable[str]) -> str:
    """Replace every secret value in text (belt and braces for output a command echoes back)."""
    for s in secrets:
        if s and len(s) >= 4:
            text = text.replace(s, "***")
    return text


# -- sudo ---------------------------------------------------------------------------------------

# `sudo -n` prints this (sudo 1.8 - 1.9) when it would have prompted for a password.
_SUDO_PASSWORD = re.compile(r"sudo: (?:a password is required|a terminal is required)")


def sudo_argv(argv: Sequence[str]) -> list[str]:
    """`sudo -n`: never prompt (there is no terminal), fail fast with a recognisable message."""
    return ["sudo", "-n", *check_argv(argv)]


def sudo_wants_password(stderr: str) -> bool:
    return bool(_SUDO_PASSWORD.search(stderr))


def sudoers_line(user: str, program_path: str) -> str:
    """The exact line that lets `user` run `program_path` as root without a password."""
    names.check(names.USER_NAME, user, "user name")
    if not program_path.startswith("/"):
        raise ValueError(f"sudoers needs an absolute program path, got {program_path!r}")
    return f"{user} ALL=(root) NOPASSWD: {program_path}"


def sudo_advice(node: str, user: str, program_path: str) -> str:
    line = sudoers_line(user, program_path)
    return (
        f"sudo on node {node} asked for a password for user {user} (spark-pipelines runs `sudo -n`, "
        f"it cannot type one). On {node}, run `sudo visudo -f /etc/sudoers.d/spark-pipelines` and add:\n"
        f"    {line}"
    )


# -- output tail --------------------------------------------------------------------------------


class OutputTail:
    """The last `max_lines` lines (each cut to `max_line_chars`) of a command's output.

    A 90-minute build prints hundreds of MB; errors only need the end, and memory must stay flat."""

    def __init__(self, max_lines: int = 60, max_line_chars: int = 2000) -> None:
        if max_lines < 1:
            raise ValueError("max_lines must be at least 1")
        self._lines: deque[str] = deque(maxlen=max_lines)
        self._max_line_chars = max_line_chars
        self.total_lines = 0

    def add(self, line: str) -> None:
        if len(line) > self._max_line_chars:
            line = line[: self._max_line_chars] + f" ...[{len(line) - self._max_line_chars} more chars]"
        self._lines.append(line)
        self.total_lines += 1

    @property
    def lines(self) -> list[str]:
        return list(self._lines)

    @property
    def dropped(self) -> int:
        return self.total_lines - len(self._lines)

    def text(self) -> str:
        head = f"[... {self.dropped} earlier lines]\n" if self.dropped else ""
        return head + "\n".join(self._lines)


class LineSplitter:
    """Bytes arriving in arbitrary chunks -> complete text lines, as soon as each line ends.

    `\\r` ends a line too: progress bars (pip, rsync) rewrite one line with carriage returns and
    would otherwise only show up when the whole bar is done."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        parts = re.split(rb"\r\n|\n|\r", self._buf)
        self._buf = parts.pop()
        return [p.decode("utf-8", "replace") for p in parts]

    def flush(self) -> list[str]:
        rest, self._buf = self._buf, b""
        return [rest.decode("utf-8", "replace")] if rest else []


class LogBatcher:
    """A command's output lines -> a bounded number of log events.

    A 90-minute build prints ~100k lines; one Dagster event per line grows the event log without
    bound. The first line after a quiet spell goes out at once (sparse output stays live); lines
    that follow within `max_seconds` are joined into one event, flushed at `max_lines` lines or
    after `max_seconds`. After `max_events` events the rest is only counted, and `finish` ends with
    one event naming how many lines went to the output file, with the last few of them.
    Pure: the caller passes the clock, so the policy is testable without sleeping."""

    def __init__(self, max_lines: int = 500, max_seconds: float = 2.0, max_events: int = 100,
                 closing_lines: int = 20) -> None:
        if max_lines < 1 or max_events < 1 or max_seconds < 0:
            raise ValueError("max_lines and max_events must be at least 1, max_seconds not negative")
        self.max_lines, self.max_seconds, self.max_events = max_lines, max_seconds, max_events
        self.events = 0  # events handed out so far
        self.suppressed = 0  # lines past the event budget
        self._pending: list[str] = []
        self._pending_since = 0.0
        self._last_flush: float | None = None
        self._closing: deque[str] = deque(maxlen=closing_lines)

    def _flush(self, now: float) -> list[str]:
        if not self._pending:
            return []
        text, self._pending = "\n".join(self._pending), []
        self.events += 1
        self._last_flush = now
        return [text]

    def add(self, line: str, now: float) -> list[str]:
        """Events ready to be logged after this line (usually none)."""
        if self.events >= self.max_events:
            self.suppressed += 1
            self._closing.append(line)
            return []
        if not self._pending:
            self._pending_since = now
            self._pending.append(line)
            if self._last_flush is None or now - self._last_flush >= self.max_seconds:
                return self._flush(now)
            return []
        self._pending.append(line)
        if len(self._pending) >= self.max_lines or now - self._pending_since >= self.max_seconds:
            return self._flush(now)
        return []

    def tick(self, now: float) -> list[str]:
        """Called while the command is quiet: a batch does not wait for the next line."""
        if self._pending and now - self._pending_since >= self.max_seconds:
            return self._flush(now)
        return []

    def finish(self, now: float, where: str) -> list[str]:
        """The last batch, and the one closing event if lines were held back."""
        out = self._flush(now)
        if self.suppressed:
            last = "\n".join(self._closing)
            out.append(f"... {self.suppressed} more lines in {where}; the last {len(self._closing)}:\n{last}")
        return out


# -- ssh and rsync between nodes ------------------------------------------------------------------

PEER_KEY_NAME = "spark-pipelines-peer_ed25519"
PEER_KNOWN_HOSTS_NAME = "spark-pipelines-peer_known_hosts"
# rsync keeps an interrupted file here (inside the destination directory) and reuses it as the
# basis of the next attempt; files appear under their final names only once complete.
RSYNC_PARTIAL_DIR = ".rsync-partial"


def known_hosts_name(host: str, port: int) -> str:
    """How OpenSSH (and paramiko) names a host in known_hosts: `[host]:port` unless port 22."""
    return host if port == 22 else f"[{host}]:{port}"


def known_hosts_line(host: str, port: int, key_type: str, key_base64: str) -> str:
    names.check_host(host)
    if not re.match(r"^[a-z0-9@.-]+$", key_type) or not re.match(r"^[A-Za-z0-9+/=]+$", key_base64):
        raise ValueError(f"not a public key: type {key_type!r}")
    return f"{known_hosts_name(host, port)} {key_type} {key_base64}"


def authorized_keys_line(public_key: str, comment: str, from_address: str | None = None) -> str:
    """A peer key that may run commands but not forward ports, agents or X11, nor get a pty;
    with `from_address` (an IP literal: sshd matches names only with UseDNS) only from there."""
    parts = public_key.split()
    if len(parts) < 2 or not re.match(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp\d+)$", parts[0]):
        raise ValueError(f"not an OpenSSH public key: {public_key[:40]!r}")
    names.check(re.compile(r"^[A-Za-z0-9@._-]+$"), comment, "key comment")
    options = "restrict"
    if from_address is not None:
        options += f',from="{ipaddress.ip_address(from_address)}"'
    return f"{options} {parts[0]} {parts[1]} {comment}"


@dataclass(frozen=True)
class PeerRoute:
    """How a source node reaches a destination node with its dedicated peer key."""

    user: str
    host: str
    port: int
    key_path: str  # on the source node, absolute
    known_hosts: str  # on the source node, absolute

    def ssh_argv(self) -> list[str]:
        """The ssh client command (no destination, no remote command)."""
        return [
            "ssh",
            "-i", self.key_path,
            "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "StrictHostKeyChecking=yes",  # the peer's key was written from a verified source
            "-o", "BatchMode=yes",  # never prompt: fail instead
            "-o", "ConnectTimeout=20",
            "-o", "ServerAliveInterval=15",  # a dead link fails within ~1 min instead of hanging
            "-o", "ServerAliveCountMax=4",
            "-p", str(self.port),
        ]

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.host}"

    def remote_argv(self, argv: Sequence[str]) -> list[str]:
        """ssh ... user@host 'quoted remote command' (ssh joins its args with spaces: quote once)."""
        return [*self.ssh_argv(), self.destination, quote_argv(argv)]


def rsync_argv(
    src_dir: str,
    route: PeerRoute,
    dst_dir: str,
    *,
    bwlimit_kib: int | None = None,
    io_timeout_s: int = 120,
    link_dest: str | None = None,
) -> list[str]:
    """rsync of a directory's contents, run on the source node, pushing to the destination node.
    `link_dest`: a directory on the destination whose files equal to the source's (size and mtime,
    as -a keeps them) are hard-linked instead of sent: a new checkpoint version costs only the
    files that changed (core/versions.py; every file is hashed against the manifest after).

    Choice: `--partial-dir` rather than `--inplace`/`--append`. An interrupted 5 GB shard is kept
    aside and used as the delta basis on the rerun, so only the missing part crosses the wire;
    `--inplace` would leave a truncated shard under its real name, where a loader could find it.
    Whole-file mode stays off (rsync's default between hosts), which is what makes the basis count."""
    for what, p in (("source directory", src_dir), ("destination directory", dst_dir),
                    *((("link-dest directory", link_dest),) if link_dest else ())):
        names.check(names.PATH, p, what)
        if not p.startswith("/"):
            raise ValueError(f"{what} {p!r} must be absolute (expand ~ for the node's user first)")
    argv = [
        "rsync",
        "-a",
        f"--partial-dir={RSYNC_PARTIAL_DIR}",
        f"--timeout={io_timeout_s}",  # a stalled link ends the copy (then rerun resumes) instead of hanging
        "--info=name1,stats2",
        "-e", shlex.join(route.ssh_argv()),
    ]
    if bwlimit_kib:
        argv.append(f"--bwlimit={int(bwlimit_kib)}")
    if link_dest:
        argv.append(f"--link-dest={link_dest.rstrip('/')}")
    argv += [src_dir.rstrip("/") + "/", f"{route.destination}:{dst_dir.rstrip('/')}/"]
    return argv


_STAT = re.compile(r"^(Total bytes sent|Total bytes received|Total file size|Total transferred file size|"
                   r"Literal data|Matched data|Number of regular files transferred):\s+([\d,.]+)", re.M)


def parse_rsync_stats(text: str) -> dict[str, int]:
    """`--stats` lines -> {'total_bytes_sent': ..., 'literal_data': ..., ...}."""
    out: dict[str, int] = {}
    for m in _STAT.finditer(text):
        key = m.group(1).lower().replace(" ", "_")
        out[key] = int(m.group(2).replace(",", "").split(".")[0])
    return out


def image_stream_argv(image: str, route: PeerRoute) -> list[str]:
    """`docker save IMAGE | ssh dest docker load`, run on the source node.

    A pipe needs a shell: each side is quoted on its own and pipefail makes a failing `docker save`
    fail the whole command instead of loading a truncated stream."""
    names.check(names.IMAGE_REF, image, "image reference")
    pipeline = f"{quote_argv(['docker', 'save', image])} | {quote_argv(route.remote_argv(['docker', 'load']))}"
    return ["bash", "-o", "pipefail", "-c", pipeline]


# -- verification -----------------------------------------------------------------------------------


def list_files_argv(directory: str) -> list[str]:
    """Relative path and size of every regular file under directory, rsync's partial dir excluded."""
    return [
        "find", directory, "-path", f"*/{RSYNC_PARTIAL_DIR}", "-prune", "-o",
        "-type", "f", "-printf", "%P\\t%s\\n",
    ]


def parse_file_sizes(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        path, _, size = line.rpartition("\t")
        if not path or not size.isdigit():
            raise ValueError(f"unexpected line in a file listing: {line!r}")
        out[path] = int(size)
    return out


def compare_trees(src: Mapping[str, int], dst: Mapping[str, int]) -> list[str]:
    """What differs between two {relative path: size} listings, as sentences."""
    problems = []
    for path in sorted(src):
        if path not in dst:
            problems.append(f"{path}: missing on the destination")
        elif dst[path] != src[path]:
            problems.append(f"{path}: {dst[path]} bytes on the destination, {src[path]} on the source")
    extra = sorted(set(dst) - set(src))
    if extra:
        problems.append(f"{len(extra)} file(s) on the destination that the source does not have, e.g. {extra[0]}")
    return problems


# rsync writes each file as `.NAME.XXXXXX` beside NAME and renames it at the end; a receiver killed
# hard (SIGKILL, an OOM, a power cut) leaves that temp file behind, and no later rsync removes it.
_RSYNC_TEMP = re.compile(r"^(?P<dir>(?:.*/)?)\.(?P<name>[^/]+)\.[A-Za-z0-9]{6}$")


def rsync_leftovers(dst: Mapping[str, int]) -> list[str]:
    """Files of a {relative path: size} listing that are a killed rsync's temp copies of a file the
    listing also holds (`dir/.NAME.XXXXXX` beside `dir/NAME`): safe to remove once NAME is whole."""
    out = []
    for path in dst:
        m = _RSYNC_TEMP.match(path)
        if m and f"{m['dir']}{m['name']}" in dst:
            out.append(path)
    return sorted(out)


def check_index(index_text: str, sizes: Mapping[str, int], index_name: str) -> tuple[int, list[str]]:
    """(number of keys, problems): every shard the safetensors index names must exist, non-empty."""
    try:
        index = json.loads(index_text)
        weight_map = index["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise TypeError("weight_map is empty or not an object")
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        return 0, [f"{index_name}: unreadable ({exc})"]
    problems = []
    for shard in sorted(set(map(str, weight_map.values()))):
        if shard not in sizes:
            problems.append(f"{index_name} names {shard}, which is not on the destination")
        elif sizes[shard] < 8:
            problems.append(f"{shard}: {sizes[shard]} bytes, too short for a safetensors file")
    return len(weight_map), problems


def header_span(header_len: int, header_json: bytes) -> int:
    """Bytes a safetensors file must have, from its header: 8 + header + the last tensor's end."""
    header = json.loads(header_json.decode("utf-8"))
    header.pop("__metadata__", None)
    end = max((int(v["data_offsets"][1]) for v in header.values()), default=0)
    return 8 + header_len + end


# -- rollback names ---------------------------------------------------------------------------------

PREVIOUS_SUFFIX = "-previous"
PREVIOUS_TAG = "previous"


def image_repository(ref: str) -> str:
    """`repo[:tag]` -> repo (a ':' before the last '/' is a registry port, not a tag)."""
    names.check(names.IMAGE_REF, ref, "image reference")
    head, sep, tail = ref.rpartition(":")
    return head if sep and "/" not in tail else ref


def previous_container_name(name: str) -> str:
    names.check(names.CONTAINER_NAME, name, "container name")
    return name + PREVIOUS_SUFFIX


def previous_image_tag(ref: str) -> str:
    """Where the image of the replaced container is kept: `<repo>:previous`."""
    return f"{image_repository(ref)}:{PREVIOUS_TAG}"
