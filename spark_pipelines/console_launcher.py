"""The run launcher of the demo's instance (`make demo`, `make ui`, the e2e console): Dagster's
DefaultRunLauncher (each run in a process the code server starts), which also answers the daemon's
run monitoring: is the run's process still alive?

Dagster 1.13's DefaultRunLauncher does not support run-worker health checks, so its run
monitoring only times out starts and long runs. A code server that is alive marks a run whose
process it started and saw die as failed; but a run whose code server died with it (the console
killed, the machine restarted) or a run executed in-process by another process on the instance
stays STARTED forever, and the run queue (one run per `dagster/partition`) then holds the node's
next run QUEUED while the node is out of service. Every run records its process id as an engine
event ("Started process for run (pid: N)", or its executor's "parent process (pid: N)"), so the
launcher checks that process on this machine (the demo runs everything locally): gone, a zombie,
or a newer process under a recycled pid is a dead run, and the daemon marks it failed within
`run_monitoring.poll_interval_seconds`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from dagster import DagsterEventType, DefaultRunLauncher
from dagster._core.launcher import CheckRunHealthResult, WorkerStatus
from dagster._core.storage.dagster_run import DagsterRun

# The process started at most this long after its event was written: more is a recycled pid.
START_SLACK_S = 5.0


def run_process(instance: object, run_id: str) -> tuple[int, float] | None:
    """(pid, when the event naming it was written) of the run's own process, or None when the
    run has not recorded it (yet). Step processes are not the run's: their events carry a step."""
    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.ENGINE_EVENT, limit=50).records  # type: ignore[attr-defined]
    for rec in records:
        entry = rec.event_log_entry
        event = entry.dagster_event
        if event is None or event.step_key:
            continue
        meta = getattr(event.event_specific_data, "metadata", None) or {}
        raw = meta.get("pid")
        value = getattr(raw, "value", raw)
        if value is not None and str(value).isdigit():
            return int(str(value)), entry.timestamp
    return None


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def process_alive(pid: int, recorded_at: float) -> bool:
    """Whether `pid` is a live (not zombie) process that already existed when `recorded_at` was."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X", "x"):
        return False
    started = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return started <= recorded_at + START_SLACK_S


class LocalRunLauncher(DefaultRunLauncher):
    """DefaultRunLauncher + `check_run_worker_health` for runs whose processes run on this machine."""

    @property
    def supports_check_run_worker_health(self) -> bool:
        return True

    def check_run_worker_health(self, run: DagsterRun) -> CheckRunHealthResult:
        found = run_process(self._instance, run.run_id)
        if found is None:  # not recorded yet (a start in progress): the start timeout covers it
            return CheckRunHealthResult(WorkerStatus.RUNNING, "the run's process is not recorded yet")
        pid, at = found
        if process_alive(pid, at):
            return CheckRunHealthResult(WorkerStatus.RUNNING, f"its process (pid {pid}) runs")
        return CheckRunHealthResult(
            WorkerStatus.FAILED,
            f"the run's process (pid {pid}, recorded {time.strftime('%H:%M:%S', time.localtime(at))}) is gone: "
            f"killed, or its code server stopped with it; the run's node lease ended with it, and the next run on "
            f"the node finishes what it left")
