"""Domain errors of the runbook procedures. The asset layer turns them into `dg.Failure`."""

from __future__ import annotations


def first_line(e: BaseException | str) -> str:
    """An exception as one line for a log or a message: its type and the first line of its text.
    A message (str): its first line, "" when it has none."""
    text = str(e).strip().splitlines()
    if isinstance(e, str):
        return text[0][:300] if text else ""
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


class RunbookError(Exception):
    """A procedure could not go on. `description` names the node and the fix; `details` holds
    markdown blocks (diagnosis, log tail, preflight) that the UI shows as metadata."""

    def __init__(self, description: str, details: dict[str, str] | None = None) -> None:
        super().__init__(description)
        self.description = description
        self.details = dict(details or {})


class DeployFailed(RunbookError):
    """A deploy did not leave the new launch serving; the message says what was put back."""
