"""Rebuilds and benches on a clock.

The weekly rebuild is cheap when nothing changed (each step re-verifies its output and skips the
heavy work), so it doubles as a weekly integrity check of the checkpoint and images. The bench
runs when the gateway is quietest: it drains one node at a time.
"""


from typing import Any

import dagster as dg


def build_schedules(build_job: Any, bench_job: Any,
                    nodes: list[str]) -> list[dg.ScheduleDefinition]:
    weekly_rebuild = dg.ScheduleDefinition(
        name="weekly_rebuild", job=build_job, cron_schedule="0 3 * * 0",
        default_status=dg.DefaultScheduleStatus.STOPPED,
    )

    @dg.schedule(name="nightly_bench", job=bench_job, cron_schedule="30 4 * * *",
                 default_status=dg.DefaultScheduleStatus.STOPPED)
    def nightly_bench(context: dg.ScheduleEvaluationContext):
        stamp = context.scheduled_execution_time.strftime("%Y%m%d")
        for node in nodes:
            yield dg.RunRequest(run_key=f"bench-{node}-{stamp}", partition_key=node)

    return [weekly_rebuild, nightly_bench]
