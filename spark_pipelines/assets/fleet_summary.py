"""The fleet summary: the page an operator opens first, one row per node (core/summary.py decides it).

It only reads what the other steps recorded on the instance (no SSH, no resources), so it is cheap
to refresh: declarative automation after each deploy and bench, and a small sensor after each
observation (health sweeps on node_deployment, drains and restores on gateway), which declarative
automation does not count as an update.
"""


from typing import Any

import dagster as dg

from spark_pipelines.assets.metadata import count, table
from spark_pipelines.core import steps
from spark_pipelines.core import summary
from spark_pipelines.core.fleet import Fleet

GROUP = "0_fleet"
SUMMARY_KEY = dg.AssetKey(steps.FLEET_SUMMARY)
# The observations that change a row without any materialization.
OBSERVED = (dg.AssetKey(steps.NODE_DEPLOYMENT), dg.AssetKey(steps.GATEWAY))


def _values(event: Any) -> dict[str, Any]:
    return {k: v.value for k, v in event.metadata.items()} if event is not None else {}


def _latest(instance: dg.DagsterInstance, asset: str, node: str | None, observation: bool = False):
    flt = dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[node] if node else None)
    fetch = instance.fetch_observations if observation else instance.fetch_materializations
    records = fetch(flt, limit=1).records
    return records[0] if records else None


def latest_rotation(instance: dg.DagsterInstance) -> summary.Rotation:
    """The gateway's rotation as of its newest event: its materialization or a bench's observation."""
    recs = [r for r in (_latest(instance, steps.GATEWAY, None), _latest(instance, steps.GATEWAY, None, observation=True)) if r]
    if not recs:
        return summary.Rotation()
    rec = max(recs, key=lambda r: r.storage_id)
    event = rec.asset_materialization or rec.event_log_entry.asset_observation
    meta = _values(event)
    nodes = [n.strip() for n in str(meta.get("rotation") or "").split(",") if n.strip()]
    left = meta.get("left_out_by_node")
    return summary.Rotation(nodes=nodes, left_out=dict(left) if isinstance(left, dict) else {}, known=True)


def _health(instance: dg.DagsterInstance, node: str, look_back: int = 20) -> dict[str, Any] | None:
    """The newest sweep's verdict and evidence, with the newest quarantine state over it: a
    quarantine or release observation (no verdict of its own) must not blank the health column."""
    records = instance.fetch_observations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey(steps.NODE_DEPLOYMENT), asset_partitions=[node]), limit=look_back).records
    seen = [_values(r.event_log_entry.asset_observation) for r in records]
    if not seen:
        return None
    swept = next((v for v in seen if "verdict" in v), {})
    return {**swept, **{k: seen[0][k] for k in ("quarantined",) if k in seen[0]}}


def node_facts(instance: dg.DagsterInstance, fleet: Fleet) -> list[summary.NodeFacts]:
    facts = []
    for node in fleet.serve_nodes:
        dep = _latest(instance, steps.NODE_DEPLOYMENT, node.name)
        art = _latest(instance, steps.NODE_ARTIFACTS, node.name)
        bench = _latest(instance, steps.BENCH_RESULTS, node.name)
        health = _health(instance, node.name)
        facts.append(summary.NodeFacts(
            node=node.name,
            deployment=_values(dep.asset_materialization) if dep else None,
            deployed_at=dep.timestamp if dep else None,
            artifacts=_values(art.asset_materialization) if art else None,
            bench=_values(bench.asset_materialization) if bench else None,
            benched_at=bench.timestamp if bench else None,
            health=health,
            floor_tok_s=fleet.bench_floor(node),
            reference_tok_s=fleet.bench.reference_tok_s,
        ))
    return facts


def newest_observation_id(instance: dg.DagsterInstance, after: int | None) -> int | None:
    """The storage id of the newest observation on node_deployment or gateway after `after`."""
    newest = None
    for key in OBSERVED:
        recs = instance.fetch_observations(dg.AssetRecordsFilter(asset_key=key, after_storage_id=after),
                                           limit=1).records
        if recs and (newest is None or recs[0].storage_id > newest):
            newest = recs[0].storage_id
    return newest


def fleet_summary_definitions(fleet: Fleet) -> dg.Definitions:
    @dg.asset(
        key=SUMMARY_KEY,
        group_name=GROUP,
        kinds={"table"},
        deps=[steps.NODE_ARTIFACTS, steps.NODE_DEPLOYMENT, steps.GATEWAY, steps.BENCH_RESULTS],
        automation_condition=dg.AutomationCondition.any_deps_updated() & ~dg.AutomationCondition.in_progress(),
        description="One row per node: health sweep verdict and evidence, in or out of the gateway and why, the "
                    "image id and checkpoint it serves, last bench tok/s against the reference and its floor, MTP "
                    "acceptance, last bench and deploy. Refreshed after every deploy, bench, drain/restore and "
                    "health sweep.",
    )
    def fleet_summary(context: dg.AssetExecutionContext) -> dg.MaterializeResult:
        rows = summary.summary_rows(node_facts(context.instance, fleet), latest_rotation(context.instance))
        inside = sum(1 for r in rows if r["gateway"] == "in")
        return dg.MaterializeResult(metadata={
            "nodes": table(summary.COLUMNS, rows),
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
        newest = newest_observation_id(context.instance, after)
        if newest is None:
            return dg.SensorResult(skip_reason="no new health sweep or gateway observation")
        return dg.SensorResult(run_requests=[dg.RunRequest(run_key=f"fleet-summary-{newest}",
                                                           asset_selection=[SUMMARY_KEY])],
                               cursor=str(newest))

    automation = dg.AutomationConditionSensorDefinition(
        steps.SUMMARY_AUTOMATION, target=dg.AssetSelection.assets(SUMMARY_KEY),
        default_status=dg.DefaultSensorStatus.RUNNING,
        description="Declarative automation of fleet_summary: refreshed once a deploy, artifacts copy, gateway "
                    "write or bench has materialized (read-only, no node touched).")
    return dg.Definitions(assets=[fleet_summary], sensors=[fleet_summary_refresh, automation])
