"""The fleet summary: the page an operator opens first, one row per node (core/summary.py decides it).

It only reads what the other steps recorded on the instance (no SSH, no resources), so it is cheap
to refresh: declarative automation after each deploy and bench (a run), and a small sensor after each
observation (health sweeps on node_deployment, drains and restores on gateway), which declarative
automation does not count as an update: the sensor records the summary itself, with no run, so a
sweep each minute does not fill the Runs list.
"""


import dagster as dg

from spark_pipelines.assets.metadata import count, table
from spark_pipelines.core import steps
from spark_pipelines.core import summary
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.state import records

GROUP = "0_fleet"
SUMMARY_KEY = dg.AssetKey(steps.FLEET_SUMMARY)


def summary_metadata(instance: dg.DagsterInstance, fleet: Fleet) -> dict:
    """The summary's tables, read from what the other steps recorded (the asset and the refresh
    sensor record the same)."""
    rows = summary.summary_rows(records.node_facts(instance, fleet), records.latest_rotation(instance))
    inside = sum(1 for r in rows if r["gateway"] == "in")
    return {
        "nodes": table(summary.COLUMNS, rows),
        "detail": table(summary.DETAIL_COLUMNS, rows),
        "bench": table(summary.BENCH_COLUMNS, rows),
        "versions": table(summary.VERSION_COLUMNS, rows),
        "when": table(summary.WHEN_COLUMNS, rows),
        "headline": summary.headline(rows),
        "nodes_in_gateway": count(inside),
        "nodes_total": count(len(rows)),
    }


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
        description="One row per node, in tables narrow enough to read whole. nodes: health (the sweep's verdict, "
                    "or the deploy's own check when newer), in or out of the gateway (who put it out), last bench "
                    "tok/s and its floor. detail: why it is out, a failed bench, what the sweep saw and the advice. "
                    "bench: trend, tok/s against the reference, MTP acceptance, quality. versions: image id, "
                    "checkpoint. when: last bench and deploy. Refreshed after every deploy, bench (a failed one "
                    "too), drain/restore and health sweep.",
    )
    def fleet_summary(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        return dg.MaterializeResult(metadata=summary_metadata(context.instance, fleet))

    @dg.sensor(name=steps.SUMMARY_SENSOR, minimum_interval_seconds=30,
               default_status=dg.DefaultSensorStatus.RUNNING,
               description="Records fleet_summary again when a new observation lands on node_deployment (a health "
                           "sweep's verdict) or on gateway (a bench's drain or restore): read from the instance "
                           "and recorded by the sensor itself, so a sweep each minute adds no run to the Runs list; "
                           "cursor by event storage id.")
    def fleet_summary_refresh(context: dg.SensorEvaluationContext) -> dg.SensorResult:
        after = int(context.cursor) if context.cursor else None
        newest = records.newest_observation_id(context.instance, after)
        if newest is None:
            # A failed bench records nothing on an asset: the summary says it once, with its why.
            made_at = records.latest(context.instance, steps.FLEET_SUMMARY)
            failed = [n.name for n in fleet.serve_nodes if records.failed_bench(
                context.instance, n.name, made_at.timestamp if made_at else None)]
            if not failed:
                return dg.SensorResult(skip_reason="no new health sweep, gateway observation or failed bench")
            return dg.SensorResult(asset_events=[dg.AssetMaterialization(
                SUMMARY_KEY, description=f"refreshed after a failed bench of {', '.join(failed)} (no run)",
                metadata=summary_metadata(context.instance, fleet))])
        running = records.run_in_progress_for(context.instance, steps.FLEET_SUMMARY)
        if running is not None:  # the automation sensor asked for one on the same change: it will read this
            return dg.SensorResult(skip_reason=f"a fleet_summary run is already on its way ({running[:8]})")
        made = records.newest_materialization_id(context.instance, steps.FLEET_SUMMARY)
        if made is not None and made > newest:
            # The summary was made after that observation (the demo's last run, or the automation
            # sensor on the same change): it already shows it; recording it again would repeat it.
            return dg.SensorResult(skip_reason="fleet_summary is newer than the last observation", cursor=str(newest))
        return dg.SensorResult(
            asset_events=[dg.AssetMaterialization(SUMMARY_KEY, description="refreshed after a health sweep or a "
                                                  "drain/restore (recorded by fleet_summary_refresh, no run)",
                                                  metadata=summary_metadata(context.instance, fleet))],
            cursor=str(newest))

    automation = dg.AutomationConditionSensorDefinition(
        steps.SUMMARY_AUTOMATION, target=dg.AssetSelection.assets(SUMMARY_KEY),
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Declarative automation of fleet_summary: refreshed once a deploy, artifacts copy, gateway "
                    "write or bench has materialized (read-only, no node touched).")
    summary_job = dg.define_asset_job(steps.SUMMARY_JOB, selection=[SUMMARY_KEY],
                                      description="fleet_summary now (read-only): the demo's last run, or by hand.")
    return dg.Definitions(assets=[fleet_summary], sensors=[fleet_summary_refresh, automation], jobs=[summary_job])
