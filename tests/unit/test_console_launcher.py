"""The demo's run launcher answers the run monitoring from the run's own process: alive, gone, a
zombie or a recycled pid (spark_pipelines/cli/console_launcher.py)."""

import os
import subprocess
import time

import dagster as dg
from dagster._core.events import EngineEventData
from dagster._core.launcher import WorkerStatus

from spark_pipelines.cli.console_launcher import LocalRunLauncher, process_alive, run_process


def test_process_alive_gone_zombie_and_recycled():
    assert process_alive(os.getpid(), time.time())
    done = subprocess.Popen(["true"])
    done.wait()
    assert not process_alive(done.pid, time.time())  # reaped: gone
    zombie = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            time.sleep(0.05)
        assert not process_alive(zombie.pid, time.time())  # exited, not yet reaped
    finally:
        zombie.wait()
    # Our process started long before this "record": a pid recorded an hour before it started is a recycled one.
    assert not process_alive(os.getpid(), time.time() - 3600 * 24 * 365)


def test_the_runs_own_pid_decides_not_its_steps():
    @dg.op
    def noop():
        return 1

    @dg.job
    def one():
        noop()

    with dg.instance_for_test() as instance:
        launcher = LocalRunLauncher()
        launcher.register_instance(instance)
        res = one.execute_in_process(instance=instance)
        run = instance.get_run_by_id(res.run_id)
        assert run_process(instance, res.run_id)[0] == os.getpid()  # "Executing steps in process (pid: ...)"
        assert launcher.check_run_worker_health(run).status == WorkerStatus.RUNNING
        gone = subprocess.Popen(["true"])
        gone.wait()
        dead = instance.create_run_for_job(one)
        assert launcher.check_run_worker_health(dead).status == WorkerStatus.RUNNING  # nothing recorded yet
        instance.report_engine_event("Started process for run (pid: x).", dead, EngineEventData.in_process(gone.pid))
        health = launcher.check_run_worker_health(dead)
        assert health.status == WorkerStatus.FAILED and f"pid {gone.pid}" in health.msg
