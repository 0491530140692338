"""SSH to the fleet's nodes: one verified paramiko connection per node, commands streamed and bounded.

By concern: `connection` (the settings, host-key checks, the dead-peer watchdog), `session` (the
session and its commands), `files` (SFTP), `output` (capture, output files, batched log events),
`errors`. This module holds the Dagster resource and is the one import path for all of it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import dagster as dg
from pydantic import PrivateAttr

from spark_pipelines.core.errors import RunbookError
from spark_pipelines.core.fleet import Fleet, SshTarget, fleet_digest, load_fleet, load_fleet_text, read_fleet_text
from spark_pipelines.resources.ssh.connection import SshSettings
from spark_pipelines.resources.ssh.errors import (
    HostKeyError,
    NodeConnectError,
    NodeUnreachable,
    NodeUnresponsive,
    RemoteCommandError,
    RemoteCommandTimeout,
    RemoteError,
    RemoteFileError,
    SudoPasswordRequired,
)
from spark_pipelines.resources.ssh.files import SECRETS_DIR
from spark_pipelines.resources.ssh.output import STDOUT_CAPTURE_BYTES
from spark_pipelines.resources.ssh.session import GATEWAY_KEY, CommandRecord, CommandResult, FleetSession


class FleetChanged(RunbookError):
    """A run launched from a code location that loaded another version of the fleet file."""


class FleetSSH(dg.ConfigurableResource, SshSettings):
    """SSH to every node of the fleet (and the gateway host); see FleetSession for the behaviour.

    Its settings are the `SshSettings` fields (declared there, once); the session reads them from here."""

    fleet_path: str
    # The digest of the fleet file's text the code location loaded (definitions.py sets it): a run
    # whose file differs from it is refused before it touches anything (see setup_for_execution).
    fleet_digest: str | None = None

    _session: FleetSession | None = PrivateAttr(default=None)

    def open_session(self, logger: Any = None) -> FleetSession:
        """A new session, for use outside a Dagster step (the CLI): `with res.open_session() as s:`."""
        return FleetSession(load_fleet(self.fleet_path), self, logger or dg.get_dagster_logger())

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        """A run's session, on the fleet the code location loaded: the file is read once here and a
        run whose file is no longer that one is refused (FleetChanged), so partitions, code versions
        and sensors (the loaded fleet) and what the run does to the nodes can never disagree."""
        if self.fleet_digest is None or context.run is None:  # no loaded digest, or not a run (a sensor)
            self._session = self.open_session(context.log)
            return
        text = read_fleet_text(self.fleet_path)
        now = fleet_digest(text)
        if now != self.fleet_digest:
            raise FleetChanged(
                f"the fleet file changed since the code location loaded: reload the code location (UI Reload) "
                f"and launch again ({self.fleet_path} is {now} now, the code location loaded {self.fleet_digest}; "
                f"nothing was touched)")
        self._session = FleetSession(load_fleet_text(text, self.fleet_path), self, context.log)

    def teardown_after_execution(self, context: dg.InitResourceContext) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    @property
    def session(self) -> FleetSession:
        if self._session is None:
            self._session = self.open_session()
        return self._session

    @property
    def fleet(self) -> Fleet:
        return self.session.fleet

    @property
    def commands(self) -> list[CommandRecord]:
        return self.session.commands

    def run(self, node: str | SshTarget, argv: Sequence[str], **kwargs: Any) -> CommandResult:
        return self.session.run(node, argv, **kwargs)

    def put_text(self, node: str | SshTarget, path: str, text: str, mode: int = 0o644) -> str:
        return self.session.put_text(node, path, text, mode)

    def read_text(self, node: str | SshTarget, path: str) -> str:
        return self.session.read_text(node, path)


def read_command_log(path: str | os.PathLike[str]) -> list[CommandRecord]:
    """The records a FleetSSH with command_log_path wrote (every step process of a run)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        d = json.loads(line)
        out.append(CommandRecord(d["node"], tuple(d["argv"]), d["exit"], d["seconds"], d.get("output")))
    return out


__all__ = [
    "GATEWAY_KEY",
    "SECRETS_DIR",
    "STDOUT_CAPTURE_BYTES",
    "CommandRecord",
    "CommandResult",
    "FleetChanged",
    "FleetSSH",
    "FleetSession",
    "HostKeyError",
    "NodeConnectError",
    "NodeUnreachable",
    "NodeUnresponsive",
    "RemoteCommandError",
    "RemoteCommandTimeout",
    "RemoteError",
    "RemoteFileError",
    "SshSettings",
    "SudoPasswordRequired",
    "read_command_log",
]
