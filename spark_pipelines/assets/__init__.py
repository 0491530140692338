"""One module per runbook phase; each returns the dg.Definitions of its assets, checks and jobs."""

from __future__ import annotations

from typing import NoReturn

import dagster as dg

from spark_pipelines.runbook.errors import RunbookError


def fail(e: RunbookError) -> NoReturn:
    """A runbook procedure's domain error as the step failure the UI shows (details as markdown)."""
    raise dg.Failure(description=e.description,
                     metadata={k: dg.MetadataValue.md(v) for k, v in e.details.items()}) from None


def step_session(context: dg.AssetExecutionContext, *resources: object):
    """The resources' SSH session, its log lines attached to this step: the resource was opened
    with the run's log (no step), so every ssh/docker line would otherwise float above the steps.
    Pass each resource holding a FleetSSH (ssh, litellm); returns the first one's session."""
    sessions = []
    for r in resources:
        ssh = getattr(r, "ssh", r)
        s = ssh.session  # type: ignore[attr-defined]
        s.log = context.log
        sessions.append(s)
    return sessions[0]
