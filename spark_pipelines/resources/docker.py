"""Docker on a node, through the docker CLI over the node's SSH connection.

One code path for real and simulated nodes: whatever `docker` on the node talks to (its DOCKER_HOST
or the default socket) is what we drive. Rollback keeps the replaced container, stopped, as
`<name>-previous` and its image as `<repo>:previous` until the new one is healthy; the kept one is
known by its container id, image id and launch-spec label (`core.launch.DEPLOY_LABEL`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import names, remote
from spark_pipelines.core.launch import DEPLOY_LABEL
from spark_pipelines.resources.ssh import CommandResult, FleetSession, RemoteCommandError, RemoteError

_NO_SUCH = ("No such image", "No such object", "No such container", "no such image", "no such container")


class DockerError(RemoteError):
    """A docker operation on a node that cannot proceed; the message says what to do."""


@dataclass
class LogWatch:
    """Result of following a container's log until a line matched, it ended, or time ran out."""

    matched: str | None
    lines_seen: int
    tail: list[str] = field(default_factory=list)
    ended: bool = False  # `docker logs -f` ended: the container stopped
    timed_out: bool = False
    seconds: float = 0.0


@dataclass(frozen=True)
class PreviousDeploy:
    """The kept (rollback) deployment, named by what it is: container id and image id, plus the
    launch-spec fingerprint its label carries. Every rollback step acts on these ids, never on
    `<name>-previous` alone, so a leftover container under that name cannot take its place."""

    container: str  # `<name>-previous`, stopped
    image_id: str
    image_tag: str  # `<repo>:previous`
    container_id: str = ""
    fingerprint: str = ""  # its DEPLOY_LABEL ("" for a container deployed before the labels)


def _running(c: dict[str, Any]) -> bool:
    return bool(c.get("State", {}).get("Running"))


def container_labels(container: dict[str, Any] | None) -> dict[str, str]:
    return dict(((container or {}).get("Config") or {}).get("Labels") or {})


class NodeDocker:
    def __init__(self, session: FleetSession) -> None:
        self.session = session

    def _docker(self, node: str, args: Sequence[str], **kw: Any) -> CommandResult:
        return self.session.run(node, ["docker", *args], **kw)

    @staticmethod
    def _missing(r: CommandResult) -> bool:
        return r.exit_status != 0 and any(m in r.stderr for m in _NO_SUCH)

    # -- images --

    def image_id(self, node: str, ref: str) -> str | None:
        """The image's id (sha256:...) on node, or None when node does not have it."""
        names.check(names.IMAGE_REF, ref, "image reference")
        r = self._docker(node, ["image", "inspect", "--format", "{{.Id}}", ref], check=False, log=False,
                         timeout=remote.PROBE_TIMEOUT_S)
        if self._missing(r):
            return None
        if r.exit_status != 0:
            raise RemoteCommandError(r.node, r.command, r.exit_status, r.tail)
        return r.stdout.strip()

    def image_size(self, node: str, ref: str) -> int | None:
        """The image's size in bytes as docker counts it (about what `docker save` writes), or None."""
        names.check(names.IMAGE_REF, ref, "image reference")
        r = self._docker(node, ["image", "inspect", "--format", "{{.Size}}", ref], check=False, log=False,
                         timeout=remote.PROBE_TIMEOUT_S)
        text = r.stdout.strip()
        return int(text) if r.exit_status == 0 and text.isdigit() else None

    def image_labels(self, node: str, ref: str) -> dict[str, str]:
        names.check(names.IMAGE_REF, ref, "image reference")
        r = self._docker(node, ["image", "inspect", "--format", "{{json .Config.Labels}}", ref], check=False, log=False,
                         timeout=remote.PROBE_TIMEOUT_S)
        if self._missing(r):
            raise DockerError(f"node {node}: image {ref} does not exist there; build or copy it first")
        if r.exit_status != 0:
            raise RemoteCommandError(r.node, r.command, r.exit_status, r.tail)
        return json.loads(r.stdout.strip() or "null") or {}

    def image_env(self, node: str, ref: str) -> list[str]:
        """The image's own environment (`KEY=VALUE`), which a container inherits beside its `-e`."""
        names.check(names.IMAGE_REF, ref, "image reference")
        r = self._docker(node, ["image", "inspect", "--format", "{{json .Config.Env}}", ref], check=False, log=False,
                         timeout=remote.PROBE_TIMEOUT_S)
        if self._missing(r):
            raise DockerError(f"node {node}: image {ref} does not exist there")
        if r.exit_status != 0:
            raise RemoteCommandError(r.node, r.command, r.exit_status, r.tail)
        return [str(e) for e in json.loads(r.stdout.strip() or "null") or []]

    def tag(self, node: str, source: str, target: str) -> None:
        self._docker(node, ["tag", source, target], log=False)

    def untag(self, node: str, ref: str) -> bool:
        """Remove a tag (the image itself goes when no tag or container uses it). False if absent."""
        r = self._docker(node, ["image", "rm", ref], check=False, log=False)
        if self._missing(r):
            return False
        if r.exit_status != 0:
            raise RemoteCommandError(r.node, r.command, r.exit_status, r.tail)
        return True

    # -- containers --

    def inspect_container(self, node: str, name: str) -> dict[str, Any] | None:
        names.check(names.CONTAINER_NAME, name, "container name")
        r = self._docker(node, ["container", "inspect", name], check=False, log=False, timeout=remote.PROBE_TIMEOUT_S)
        if self._missing(r):
            return None
        if r.exit_status != 0:
            raise RemoteCommandError(r.node, r.command, r.exit_status, r.tail)
        data = json.loads(r.stdout)
        return data[0] if data else None

    def run_container(self, node: str, argv: Sequence[str]) -> str:
        """Run the argv `core.launch.docker_run_argv` rendered (detached); returns the container id."""
        argv = remote.check_argv(argv)
        if argv[:2] != ["docker", "run"] or "-d" not in argv:
            raise DockerError(
                f"node {node}: run_container takes a detached `docker run -d ...` argv, got {remote.quote_argv(argv[:4])} ..."
            )
        r = self.session.run(node, argv)
        return r.stdout.strip().splitlines()[-1]

    def start(self, node: str, name: str) -> None:
        self._docker(node, ["start", name])

    def stop(self, node: str, name: str, timeout_s: int = 30) -> None:
        self._docker(node, ["stop", "-t", str(timeout_s), name])

    def remove(self, node: str, name: str, *, force: bool = False) -> bool:
        """Remove a container; False when there was none. An absent container is the expected
        case (no rollback point yet), so it is a debug line, not docker's "Error response" on stderr."""
        r = self._docker(node, ["rm", *(["-f"] if force else []), name], check=False, log=False)
        if self._missing(r):
            self.session.log.debug(f"[{node}] no container {name} to remove")
            return False
        if r.exit_status == 0:
            self.session.log.info(f"[{node}] removed container {name}")
        if r.exit_status != 0:
            raise RemoteCommandError(r.node, r.command, r.exit_status, r.tail)
        return True

    def rename(self, node: str, old: str, new: str) -> None:
        names.check(names.CONTAINER_NAME, new, "container name")
        self._docker(node, ["rename", old, new])

    def logs(self, node: str, name: str, tail: int | str = 200) -> str:
        """The container's last log lines, stdout and stderr together."""
        r = self._docker(node, ["logs", "--tail", str(tail), name], log=False)
        return r.stdout + r.stderr

    def follow_logs(
        self,
        node: str,
        name: str,
        *,
        until: Callable[[str], bool],
        timeout: float,
        since_tail: int | str = "all",
        log: Any = True,
    ) -> LogWatch:
        """Stream the container's log line by line until `until(line)` is true, the container
        stops, or timeout seconds pass (timed_out=True, never an exception: the caller decides)."""
        tail = remote.OutputTail(max_lines=40)
        found: list[str] = []

        def on_line(_stream: str, line: str) -> bool:
            tail.add(line)
            if until(line):
                found.append(line)
                return True
            return False

        started = time.monotonic()
        r = self._docker(
            node, ["logs", "-f", "--tail", str(since_tail), name],
            timeout=timeout, check=False, on_line=on_line, log=log,
        )
        if r.exit_status not in (0, None) and r.exit_status not in remote.TIMEOUT_EXIT_CODES:
            raise RemoteCommandError(r.node, r.command, r.exit_status, r.tail)
        return LogWatch(
            matched=found[0] if found else None,
            lines_seen=tail.total_lines,
            tail=tail.lines,
            ended=not found and r.exit_status == 0,
            timed_out=not found and r.exit_status in remote.TIMEOUT_EXIT_CODES,
            seconds=round(time.monotonic() - started, 2),
        )

    # -- rollback --

    def keep_previous(
        self, node: str, name: str, image: str, *, serving: bool | None = None, stop_timeout_s: int = 30
    ) -> PreviousDeploy | None:
        """Before a new launch: set the last good deployment aside, stopped, as `<name>-previous`
        with its image tagged `<repo>:previous`. Returns None when there is nothing to keep.

        `serving` is the caller's /health verdict on the live container (None: trust Running).
        When both names exist, the live one is kept only if it runs and serves; otherwise it is
        the debris of a failed deploy (a `Created` container of a `docker run` that exited 125,
        say) and goes, while `<name>-previous` stays the rollback point."""
        current = self.inspect_container(node, name)
        prev_name = remote.previous_container_name(name)
        prev = self.inspect_container(node, prev_name)
        if current is not None and prev is not None and current.get("Id") != prev.get("Id"):
            if _running(current) and serving is not False:
                self.remove(node, str(prev["Id"]), force=True)  # an older rollback point, superseded
                prev = None
            else:
                self.session.log.warning(
                    f"[{node}] {name} ({str(current.get('Id'))[:12]}, "
                    f"{current.get('State', {}).get('Status', '?')}) is left over from a failed deploy; "
                    f"removing it and keeping {prev_name} ({str(prev.get('Id'))[:12]}) as the rollback point")
                self.remove(node, str(current["Id"]), force=True)
                current = None
        kept = current if current is not None else prev
        if kept is None:
            return None
        kept_id = str(kept["Id"])
        if _running(kept):
            self.stop(node, kept_id, timeout_s=stop_timeout_s)
        if kept is current:
            self.rename(node, kept_id, prev_name)
        image_id = str(kept["Image"])
        prev_tag = remote.previous_image_tag(image)
        self.tag(node, image_id, prev_tag)
        return PreviousDeploy(prev_name, image_id, prev_tag, kept_id,
                              container_labels(kept).get(DEPLOY_LABEL, ""))

    def find_previous(self, node: str, name: str, image: str) -> PreviousDeploy | None:
        """The rollback point a crashed run left under `<name>-previous`, if any."""
        prev_name = remote.previous_container_name(name)
        prev = self.inspect_container(node, prev_name)
        if prev is None:
            return None
        return PreviousDeploy(prev_name, str(prev["Image"]), remote.previous_image_tag(image), str(prev["Id"]),
                              container_labels(prev).get(DEPLOY_LABEL, ""))

    def restore_previous(self, node: str, name: str, image: str, kept: PreviousDeploy | None = None) -> str:
        """Roll back: drop whatever runs under `name`, put the kept container back under `name`
        with its image re-tagged as `image` (by image id: right even if `<repo>:previous` is
        gone), and start it. Returns the restored container's id."""
        prev_name = remote.previous_container_name(name)
        kept = kept or self.find_previous(node, name, image)
        info = self.inspect_container(node, kept.container_id or kept.container) if kept else None
        if kept is None or info is None:
            raise DockerError(
                f"node {node}: no {prev_name} container to roll back to (it was dropped after a healthy "
                f"deploy, or never made); redeploy a known-good image instead"
            )
        kept_id = str(info["Id"])
        live = self.inspect_container(node, name)
        if live is not None and live.get("Id") != kept_id:
            self.remove(node, str(live["Id"]), force=True)
        if str(info.get("Name", "")).lstrip("/") != name:
            self.rename(node, kept_id, name)
        self.tag(node, kept.image_id, image)
        self.untag(node, kept.image_tag)
        self.start(node, kept_id)
        return kept_id

    def drop_previous(self, node: str, name: str, image: str, kept: PreviousDeploy | None = None) -> bool:
        """After the new container is healthy (the commit): remove the rollback container and tag."""
        target = (kept.container_id or kept.container) if kept else remote.previous_container_name(name)
        removed = self.remove(node, target, force=True)
        untagged = self.untag(node, remote.previous_image_tag(image))
        return removed or untagged
