"""The fleet summary: the page an operator opens first, one row per node (core/summary.py decides it).

It only reads what the other steps recorded on the instance (no SSH, no resources), so it is cheap
to refresh: declarative automation after each deploy and bench, and a small sensor after each
observation (health sweeps on node_deployment, drains and restores on gateway), which declarative
automation does not count as an update.
"""


import dagster as dg

from spark_pipelines.assets.metadata import count, table
from spark_pipelines.core import steps
from spark_pipelines.core import summary
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.state import records

GROUP = "0_fleet"
SUMMARY_KEY = dg.AssetKey(steps.FLEET_SUMMARY)


def fleet_summary_definitions(fleet: Fleet) -> dg.Definitions:
    @dg.asset(
        key=SUMMARY_KEY,
        group_name=GROUP,
        kinds={"table"},
        deps=[steps.NODE_ARTIFACTS, steps.NODE_DEPLOYMENT, steps.GATEWAY, steps.BENCH_RESULTS],
        # Not when it was itself made since the last tick (the demo's last run, the refresh sensor's):
        # opening the UI after a demo launches nothing.
        automation_condition=(dg.AutomationCondition.any_deps_updated() & ~dg.AutomationCondition.newly_updated()
                              & ~dg.AutomationCondition.in_progress()),
        description="One row per node in two tables. nodes: health (the sweep's verdict, or the deploy's own "
                    "check when newer), in or out of the gateway and why, last bench tok/s and its floor. detail: "
                    "evidence, the bench trend, tok/s against the reference, MTP acceptance, image id, checkpoint, "
                    "last bench and deploy. Refreshed after every deploy, bench, drain/restore and health sweep.",
    )
    def fleet_summary(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        rows = summary.summary_rows(records.node_facts(context.instance, fleet),
                                    records.latest_rotation(context.instance))
        inside = sum(1 for r in rows if r["gateway"] == "in")
        return dg.MaterializeResult(metadata={
            "nodes": table(summary.COLUMNS, rows),
            "detail": table(summary.DETAIL_COLUMNS, rows),
            "headline": summary.headline(rows),
            "nodes_in_gateway": count(inside),
            "nodes_total": count(len(rows)),
        })

    @dg.sensor(name=steps.SUMMARY_SENSOR, minimum_interval_seconds=30, asset_selection=[SUMMARY_KEY],
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Requests fleet_summary when a new observation lands on node_deployment (a health "
                           "sweep's verdict) or on gateway (a bench's drain or restore); read-only, cursor by "
                           "event storage id.")
    def fleet_summary_refresh(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        after = int(context.cursor) if context.cursor else None
        newest = records.newest_observation_id(context.instance, after)
        if newest is None:
            return dg.SensorResult(skip_reason="no new health sweep or gateway observation")
        running = records.run_in_progress_for(context.instance, steps.FLEET_SUMMARY)
        if running is not None:  # the automation sensor asked for one on the same change: it will read this
            return dg.SensorResult(skip_reason=f"a fleet_summary run is already on its way ({running[:8]})")
        made = records.newest_materialization_id(context.instance, steps.FLEET_SUMMARY)
        if made is not None and made > newest:
            # The summary was made after that observation (the demo's last run, or the automation
            # sensor on the same change): it already shows it; a second run would repeat it.
            return dg.SensorResult(skip_reason="fleet_summary is newer than the last observation", cursor=str(newest))
        return dg.SensorResult(run_requests=[dg.RunRequest(run_key=f"fleet-summary-{newest}",
                                                           asset_selection=[SUMMARY_KEY])],
                               cursor=str(newest))

    automation = dg.AutomationConditionSensorDefinition(
        steps.SUMMARY_AUTOMATION, target=dg.AssetSelection.assets(SUMMARY_KEY),
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Declarative automation of fleet_summary: refreshed once a deploy, artifacts copy, gateway "
                    "write or bench has materialized (read-only, no node touched).")
    summary_job = dg.define_asset_job(steps.SUMMARY_JOB, selection=[SUMMARY_KEY],
                                      description="fleet_summary now (read-only): the demo's last run, or by hand.")
    return dg.Definitions(assets=[fleet_summary], sensors=[fleet_summary_refresh, automation], jobs=[summary_job])
