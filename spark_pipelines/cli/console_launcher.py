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

import time

from dagster import DefaultRunLauncher
from dagster._core.launcher import CheckRunHealthResult, WorkerStatus
from dagster._core.storage.dagster_run import DagsterRun

from spark_pipelines.state.records import process_alive, run_process


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
