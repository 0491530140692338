"""One module per runbook phase; each returns the dg.Definitions of its assets, checks and jobs."""

from __future__ import annotations

from typing import NoReturn

import dagster as dg

from spark_pipelines.runbook.errors import RunbookError


def fail(e: RunbookError) -> NoReturn:
    """A runbook procedure's domain error as the step failure the UI shows (details as markdown)."""
    raise dg.Failure(description=e.description,
                     metadata={k: dg.MetadataValue.md(v) for k, v in e.details.items()}) from None
