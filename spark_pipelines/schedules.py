"""Rebuilds and benches on a clock.

The weekly rebuild is cheap when nothing changed (each step re-verifies its output and skips the
heavy work), so it doubles as a weekly integrity check of the checkpoint and images. The bench
runs when the gateway is quietest and drains one node at a time.
"""

import dagster as dg

from spark_pipelines.core import steps
from spark_pipelines.core.fleet import Fleet


def schedule_definitions(fleet: Fleet) -> dg.Definitions:
    nodes = [n.name for n in fleet.serve_nodes]
    weekly_rebuild = dg.ScheduleDefinition(
        name=steps.WEEKLY_REBUILD, job_name=steps.BUILD_JOB, cron_schedule="0 3 * * 0",
        default_status=dg.DefaultScheduleStatus.STOPPED,
        description="Sundays 03:00: build_job re-verifies the checkpoint and images and rebuilds only what a pin "
                    "or a failed verification says is stale.",
    )

    @dg.schedule(name=steps.NIGHTLY_BENCH, job_name=steps.BENCH_JOB, cron_schedule="30 4 * * *",
                 default_status=dg.DefaultScheduleStatus.STOPPED,
                 description=f"04:30 daily: benches every serve node ({', '.join(nodes)}), one bench_job run per "
                             "node, one at a time: each drained from the gateway while measured, then restored or, "
                             "below its floor, kept out.")
    def nightly_bench(context: dg.ScheduleEvaluationContext):
        stamp = context.scheduled_execution_time.strftime("%Y%m%d")
        for node in nodes:
            # The run queue's limit on steps.BENCH_TAG (1) is what makes it one node at a time.
            yield dg.RunRequest(run_key=f"bench-{node}-{stamp}", partition_key=node, tags={steps.BENCH_TAG: "nightly"})

    return dg.Definitions(schedules=[weekly_rebuild, nightly_bench])
