"""The Dagster instance, read and written from one place.

Every materialization recorded outside an asset's own output (a rollout's deploys and benches,
an adopted step), every observation, and every read of what the steps recorded (the bench
history, the fleet summary's facts, the code version the pins sensor compares, the demo's table)
goes through here, with the metadata keys of core/record_keys.py.

A step recorded here carries what Dagster writes on an asset's own output: its code version,
its data version and its inputs' data versions and event pointers. Without them the pins sensor
reads "never materialized" and the UI's staleness has nothing to compare, so a launch-profile
change after a rollout would go unseen. A deploy's record points at the node_launch observation of
the launch it deployed (observed first when the newest one says otherwise): Dagster then marks a
node stale exactly when its own launch is observed to change.

Dagster-side: assets, sensors, schedules and the faces import this; runbook/ and below never do.
"""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dagster as dg
from dagster._core.definitions.data_version import (  # the tags Dagster itself writes on an output
    CODE_VERSION_TAG,
    DATA_VERSION_IS_USER_PROVIDED_TAG,
    DATA_VERSION_TAG,
    DEFAULT_DATA_VERSION,
    NULL_EVENT_POINTER,
    compute_logical_data_version,
    get_input_data_version_tag,
    get_input_event_pointer_tag,
)

from spark_pipelines.core import baseline, fleet_metrics, health, steps, summary
from spark_pipelines.core import record_keys as keys
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.state import markers

Where = dg.AssetExecutionContext | dg.OpExecutionContext | dg.DagsterInstance
Record = dg.EventLogRecord

# A step's upstream steps, as the asset graph declares them (tests/unit/test_records.py holds
# these against the definitions): the provenance a recorded deploy or bench carries.
DEPLOY_INPUTS = (steps.NODE_ARTIFACTS, steps.NODE_LAUNCH)  # per node
BENCH_INPUTS = (steps.NODE_DEPLOYMENT, steps.GATEWAY)  # per node, and the fleet's one gateway
PER_NODE = frozenset({steps.NODE_LAUNCH, steps.NODE_ARTIFACTS, steps.NODE_DEPLOYMENT, steps.JIT_CACHE,
                      steps.BENCH_RESULTS})
SOURCES = frozenset({steps.NODE_LAUNCH})  # observed, never materialized: their versions are on observations

BENCH_HISTORY_LIMIT = 20


# ---- writing ------------------------------------------------------------------------------------

def _instance(where: Where) -> dg.DagsterInstance:
    return where if isinstance(where, dg.DagsterInstance) else where.instance


def _emit(where: Where, event: dg.AssetMaterialization | dg.AssetObservation) -> None:
    if isinstance(where, dg.DagsterInstance):
        where.report_runless_asset_event(event)
    else:
        where.log_event(event)


def provenance_tags(instance: dg.DagsterInstance, code_version: str, data_version: str | None,
                    inputs: Mapping[str, str | None]) -> dict[str, str]:
    """The tags Dagster writes on an asset output: code version, each input's data version and
    event pointer (its latest materialization for that partition, or observation for a source),
    and the data version (given, or derived from the code version and the inputs' versions as
    Dagster derives it)."""
    tags: dict[str, str] = {CODE_VERSION_TAG: code_version}
    versions: dict[dg.AssetKey, dg.DataVersion] = {}
    for asset, partition in inputs.items():
        key = dg.AssetKey(asset)
        rec = latest(instance, asset, partition, observation=asset in SOURCES)
        version = dg.DataVersion(data_version_of(rec) or DEFAULT_DATA_VERSION.value)
        versions[key] = version
        tags[get_input_data_version_tag(key)] = version.value
        tags[get_input_event_pointer_tag(key)] = str(rec.storage_id) if rec else NULL_EVENT_POINTER
    if data_version is None:
        tags[DATA_VERSION_TAG] = compute_logical_data_version(code_version, versions).value
    else:
        tags[DATA_VERSION_TAG] = data_version
        tags[DATA_VERSION_IS_USER_PROVIDED_TAG] = "true"
    return tags


def record_step(where: Where, asset: str, partition: str | None, code_version: str, data_version: str | None,
                metadata: Mapping[str, Any], description: str | None = None, *,
                inputs: Mapping[str, str | None] | None = None) -> dg.AssetMaterialization:
    """Record `asset` (of `partition`) as materialized by a step that ran outside the asset (a
    rollout's deploy, an adopted step): a materialization carrying the code version, the data
    version (None: derived from the code version and the inputs) and the provenance of `inputs`
    ({upstream asset: its partition, None when unpartitioned}), so the pins sensor and the UI's
    staleness read it exactly as an output of the asset. Logged in the run of `where` (a step's
    context), or runless on an instance. Returns what was recorded."""
    tags = provenance_tags(_instance(where), code_version, data_version, inputs or {})
    mat = dg.AssetMaterialization(asset, partition=partition, metadata=dict(metadata), description=description,
                                  tags=tags)
    _emit(where, mat)
    return mat


def launch_observation(node: str, launch: str) -> dg.AssetObservation:
    """node_launch observed for `node` at `launch` (core.pins.launch_versions), tagged as the
    source asset's own observation is."""
    return dg.AssetObservation(asset_key=steps.NODE_LAUNCH, partition=node,
                               tags={DATA_VERSION_TAG: launch, DATA_VERSION_IS_USER_PROVIDED_TAG: "true"})


def launch_changes(instance: dg.DagsterInstance, launch: Mapping[str, str]) -> list[dg.AssetObservation]:
    """The observations that bring node_launch to `launch` (node -> version): one per node whose
    newest observation says otherwise or that was never observed."""
    return [launch_observation(node, version) for node, version in launch.items()
            if data_version_of(latest(instance, steps.NODE_LAUNCH, node, observation=True)) != version]


def observe_launch(where: Where, node: str, launch: str) -> Record:
    """The node_launch observation of `node` that says `launch`: the newest one when it does, else
    a new one. What a deploy's provenance points at."""
    rec = latest(_instance(where), steps.NODE_LAUNCH, node, observation=True)
    if rec is None or data_version_of(rec) != launch:
        _emit(where, launch_observation(node, launch))
        rec = latest(_instance(where), steps.NODE_LAUNCH, node, observation=True)
    if rec is None:
        raise RuntimeError(f"the Dagster instance did not store node_launch[{node}]'s observation")
    return rec


def launch_input_tags(where: Where, node: str, launch: str) -> dict[str, str]:
    """The node_launch provenance tags of node_deployment's own output: Dagster would point them at
    the newest observation of any node before the step, which need not be this node's launch (the
    fleet file reloaded, nothing observed yet: a deploy recorded against the old launch, marked
    stale once the new one is observed; never observed: no pointer, never stale at all)."""
    rec = observe_launch(where, node, launch)
    key = dg.AssetKey(steps.NODE_LAUNCH)
    return {get_input_data_version_tag(key): launch, get_input_event_pointer_tag(key): str(rec.storage_id)}


def record_deploy(where: Where, node: str, code_version: str, data_version: str, metadata: Mapping[str, Any],
                  description: str | None = None, *, launch: str) -> dg.AssetMaterialization:
    """A node's deploy of `launch` on node_deployment (a rollout's; node_deployment's own run
    records its output through Dagster, with the same tags)."""
    observe_launch(where, node, launch)
    return record_step(where, steps.NODE_DEPLOYMENT, node, code_version, data_version, metadata, description,
                       inputs=_inputs(DEPLOY_INPUTS, node))


def record_as_serving(where: Where, fleet: Fleet, nodes: list[str], new: Mapping[str, str], code_version: str,
                      image_id: str, index: str, run_id: str) -> list[str]:
    """Each of `nodes` a rollout leaves as it is because it serves the new version already,
    recorded on node_deployment at the loaded code version and launch when its record says
    otherwise (a record from before node_launch existed, or a procedure revision): recorded
    nothing, it would stay stale in the UI and the pins sensor would ask again for a rollout that
    changes nothing. What the deploy that made it recorded (KV cache, startup, preflight) stays.
    Returns the nodes recorded."""
    instance, done = _instance(where), []
    for name in nodes:
        spec = launch_spec(fleet, fleet.node(name))
        if (recorded_code_version(instance, steps.NODE_DEPLOYMENT, name) == code_version
                and recorded_launch(instance, name) == spec.fingerprint):
            continue
        prev = latest(instance, steps.NODE_DEPLOYMENT, name)
        made = dict(prev.asset_materialization.metadata) if prev and prev.asset_materialization else {}
        record_deploy(where, name, code_version, markers.deploy_signature(code_version, spec.fingerprint, image_id, index),
                      {**made, "skipped": True, keys.IMAGE_ID: image_id, "container": spec.container_name,
                       keys.ROLLOUT_RUN: run_id},
                      description=f"{name} serves this version already ({new[name]}), healthy: recorded by the "
                                  "rollout at the loaded code version and launch, not redeployed",
                      launch=spec.fingerprint)
        done.append(name)
    return done


def record_bench(where: Where, node: str, code_version: str, metadata: Mapping[str, Any],
                 data_version: str | None = None, description: str | None = None) -> dg.AssetMaterialization:
    """A node's bench on bench_results (a rollout's bench gate); the data version, as for the
    asset's own output, is derived from its code version and its inputs unless given."""
    return record_step(where, steps.BENCH_RESULTS, node, code_version, data_version, metadata, description,
                       inputs=_inputs(BENCH_INPUTS, node))


def _inputs(assets: tuple[str, ...], node: str) -> dict[str, str | None]:
    return {a: node if a in PER_NODE else None for a in assets}


def observation(asset: str, partition: str | None, metadata: Mapping[str, Any],
                description: str | None = None) -> dg.AssetObservation:
    """What happened to an asset without a new materialization (a health sweep's verdict, a drain)."""
    return dg.AssetObservation(asset_key=asset, partition=partition, metadata=dict(metadata), description=description)


def observe(where: Where, asset: str, partition: str | None, metadata: Mapping[str, Any],
            description: str | None = None) -> None:
    _emit(where, observation(asset, partition, metadata, description))


def record_experiment(where: Where, node: str, metadata: Mapping[str, Any], description: str) -> None:
    """An A/B experiment's comparison, under ab_experiments/<node> (no step of the chain)."""
    _emit(where, dg.AssetMaterialization(asset_key=dg.AssetKey([steps.AB_EXPERIMENTS, node]),
                                         description=description, metadata=dict(metadata)))


# ---- reading ------------------------------------------------------------------------------------

def latest(instance: dg.DagsterInstance, asset: str, partition: str | None = None,
           observation: bool = False) -> Record | None:
    """The newest materialization (or observation) of `asset` for `partition`, or None."""
    flt = dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition] if partition else None)
    fetch = instance.fetch_observations if observation else instance.fetch_materializations
    records = fetch(flt, limit=1).records
    return records[0] if records else None


def data_version_of(rec: Record | None) -> str | None:
    """The data version a materialization or observation record carries (None: none)."""
    entry = rec.event_log_entry if rec else None
    event = entry and (entry.asset_materialization or entry.asset_observation)
    return (event.tags or {}).get(DATA_VERSION_TAG) if event else None


def values(event: Any) -> dict[str, Any]:
    """An event's metadata as plain values."""
    return {k: v.value for k, v in event.metadata.items()} if event is not None else {}


def latest_metadata(instance: dg.DagsterInstance, asset: str, partition: str | None = None) -> dict[str, Any]:
    """The newest materialization's metadata as plain values; {} when never materialized."""
    rec = latest(instance, asset, partition)
    return values(rec.asset_materialization) if rec else {}


def recorded_code_version(instance: dg.DagsterInstance, asset: str, partition: str | None = None) -> str | None:
    """The code version of the newest materialization of `asset` (of one node), None if never built."""
    rec = latest(instance, asset, partition)
    if rec is None or rec.asset_materialization is None:
        return None
    return (rec.asset_materialization.tags or {}).get(CODE_VERSION_TAG)


def recorded_launch(instance: dg.DagsterInstance, node: str) -> str | None:
    """The launch (node_launch's data version) `node`'s newest node_deployment was made from: the
    observation its provenance points at, as Dagster's staleness reads it. None when there is no
    deployment or it names none (recorded before node_launch existed)."""
    rec = latest(instance, steps.NODE_DEPLOYMENT, node)
    tags = (rec.asset_materialization.tags or {}) if rec and rec.asset_materialization else {}
    pointer = tags.get(get_input_event_pointer_tag(dg.AssetKey(steps.NODE_LAUNCH)))
    if not pointer or not pointer.isdigit():
        return None
    at = instance.fetch_observations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey(steps.NODE_LAUNCH), asset_partitions=[node], before_storage_id=int(pointer) + 1),
        limit=1).records
    return data_version_of(at[0]) if at else None


def bench_records(instance: dg.DagsterInstance, node: str, limit: int = 50) -> list[Record]:
    """The node's bench materializations, newest first."""
    return list(instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(steps.BENCH_RESULTS), asset_partitions=[node]), limit=limit
    ).records)


def bench_points(instance: dg.DagsterInstance, node: str) -> list[tuple[float, float]]:
    """(when, mean tok/s) of the node's benches that measured something, newest first."""
    points = []
    for rec in bench_records(instance, node):
        mean = values(rec.asset_materialization).get(keys.MEAN_TOK_S)
        if mean is not None and float(mean) > 0:
            points.append((rec.timestamp, float(mean)))
    return points


def recorded_benches(instance: dg.DagsterInstance, node: str, limit: int = 20) -> list[baseline.BenchRecord]:
    """The node's benches as they recorded what makes them comparable (bench_record), newest first."""
    out = []
    for r in bench_records(instance, node, limit=limit):
        v = r.asset_materialization.metadata.get(keys.BENCH_RECORD) if r.asset_materialization else None
        if v is not None and isinstance(v.value, dict):
            out.append(baseline.BenchRecord.from_dict(v.value))
    return out


def baseline_of_others(instance: dg.DagsterInstance, fleet: Fleet, node: str) -> baseline.Baseline | None:
    """The fleet's baseline from every other serve node's recorded benches: the yardstick of a
    node judged against the fleet (a newcomer, a node its bench held out below it)."""
    return baseline.fleet_baseline(r for m in fleet.serve_nodes if m.name != node
                                   for r in recorded_benches(instance, m.name))


def bench_histories(names: list[str], instance: dg.DagsterInstance | None = None) -> dict[str, health.BenchHistory]:
    """The nodes' last benches, oldest first, for the health verdicts (`regressed`). Without an
    instance, the one in DAGSTER_HOME when set; {} when there is none to read: a missing history
    only means `regressed` cannot be judged."""
    if instance is None:
        if not os.environ.get("DAGSTER_HOME"):
            return {}
        try:
            instance = dg.DagsterInstance.get()
        except Exception:  # an unusable DAGSTER_HOME must not stop the sweep
            return {}
    out: dict[str, health.BenchHistory] = {}
    for name in names:
        tok_s: list[float] = []
        acceptance: list[float] = []
        latest_gpu = None
        for rec in reversed(bench_records(instance, name, limit=BENCH_HISTORY_LIMIT)):  # newest first stored
            meta = values(rec.asset_materialization)
            mean = meta.get(keys.MEAN_TOK_S)
            if mean is None or not float(mean):
                continue  # a bench that measured nothing is not a point of the history
            tok_s.append(float(mean))
            rate = meta.get(keys.SPEC_ACCEPTANCE_RATE)
            if rate is not None:
                acceptance.append(float(rate))
            state = meta.get(keys.GPU_UNDER_LOAD)
            latest_gpu = None if state is None else str(state)
        if tok_s:
            out[name] = health.BenchHistory(tuple(tok_s), tuple(acceptance) if len(acceptance) == len(tok_s)
                                            else (), latest_gpu)
    return out


def latest_rotation(instance: dg.DagsterInstance) -> summary.Rotation:
    """The gateway's rotation as of its newest event: its materialization or a bench's observation."""
    recs = [r for r in (latest(instance, steps.GATEWAY), latest(instance, steps.GATEWAY, observation=True)) if r]
    if not recs:
        return summary.Rotation()
    rec = max(recs, key=lambda r: r.storage_id)
    meta = values(rec.asset_materialization or rec.event_log_entry.asset_observation)
    nodes = [n.strip() for n in str(meta.get(keys.ROTATION) or "").split(",") if n.strip()]
    left = meta.get(keys.LEFT_OUT_BY_NODE)
    if isinstance(left, dg.TableMetadataValue):  # node | why (JSON before: {node: why})
        left = {str(r.data.get("node")): str(r.data.get("why")) for r in left.records}
    return summary.Rotation(nodes=nodes, left_out=dict(left) if isinstance(left, dict) else {}, known=True,
                            at=rec.timestamp)


def latest_health(instance: dg.DagsterInstance, node: str, look_back: int = 20) -> tuple[dict[str, Any] | None, float | None]:
    """The newest sweep's verdict and evidence, with the newest quarantine state over it (a
    quarantine or release observation, no verdict of its own, must not blank the health column),
    and when that verdict was recorded; (None, None) when nothing was observed."""
    records = instance.fetch_observations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey(steps.NODE_DEPLOYMENT), asset_partitions=[node]), limit=look_back).records
    seen = [(values(r.event_log_entry.asset_observation), r.timestamp) for r in records]
    if not seen:
        return None, None
    swept, at = next(((v, t) for v, t in seen if keys.VERDICT in v), ({}, None))
    return {**swept, **{k: seen[0][0][k] for k in (keys.QUARANTINED,) if k in seen[0][0]}}, at


def failed_bench(instance: dg.DagsterInstance, node: str, after: float | None) -> tuple[float, str] | None:
    """(when, the first line of why) of the node's newest bench run when it failed after `after`
    (the last recorded bench): launched from its job or the asset page, a failed bench records no
    materialization, and the summary must not look as if nothing happened."""
    key = dg.AssetKey(steps.BENCH_RESULTS)
    for rec in instance.get_run_records(dg.RunsFilter(tags={"dagster/partition": node}), limit=10):
        run = rec.dagster_run
        if run.job_name != steps.BENCH_JOB and key not in (run.asset_selection or ()):
            continue
        if run.status != dg.DagsterRunStatus.FAILURE:
            return None  # the newest bench run did not fail
        at = rec.end_time or rec.update_timestamp.timestamp()
        if after is not None and at <= after:
            return None
        why = "run failed"
        for event in instance.get_records_for_run(run.run_id, of_type=dg.DagsterEventType.STEP_FAILURE).records:
            data = event.event_log_entry.dagster_event.step_failure_data
            text = (data.user_failure_data.description if data.user_failure_data and data.user_failure_data.description
                    else data.error.message if data.error else "")
            why = (text.strip().splitlines() or [why])[0][:300]
        return at, why
    return None


def node_facts(instance: dg.DagsterInstance, fleet: Fleet) -> list[summary.NodeFacts]:
    """Each serve node's latest recorded facts, as core/summary.py decides a row from them."""
    facts = []
    for node in fleet.serve_nodes:
        dep = latest(instance, steps.NODE_DEPLOYMENT, node.name)
        art = latest(instance, steps.NODE_ARTIFACTS, node.name)
        bench = latest(instance, steps.BENCH_RESULTS, node.name)
        health, health_at = latest_health(instance, node.name)
        failed = failed_bench(instance, node.name, bench.timestamp if bench else None)
        facts.append(summary.NodeFacts(
            node=node.name,
            deployment=values(dep.asset_materialization) if dep else None,
            deployed_at=dep.timestamp if dep else None,
            artifacts=values(art.asset_materialization) if art else None,
            bench=values(bench.asset_materialization) if bench else None,
            benched_at=bench.timestamp if bench else None,
            health=health,
            health_at=health_at,
            bench_means=[mean for _, mean in reversed(bench_points(instance, node.name))],
            floor_tok_s=fleet.bench_floor(node),
            reference_tok_s=fleet.bench.reference_tok_s,
            bench_failed_at=failed[0] if failed else None,
            bench_failure=failed[1] if failed else None,
        ))
    return facts


# The observations that change a fleet summary row without any materialization.
OBSERVED = (steps.NODE_DEPLOYMENT, steps.GATEWAY)


def newest_materialization_id(instance: dg.DagsterInstance, asset: str) -> int | None:
    """The storage id of the asset's newest materialization (None: never materialized)."""
    recs = instance.fetch_materializations(dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset)), limit=1).records
    return recs[0].storage_id if recs else None


# The job that materializes an asset when a run is requested by its name (a sensor's RunRequest,
# a schedule, the launchpad): such a run carries no asset_selection, only the job's name.
JOB_OF = {steps.FLEET_ROLLOUT: steps.ROLLOUT_JOB, steps.FLEET_SUMMARY: steps.SUMMARY_JOB}


def run_in_progress_for(instance: dg.DagsterInstance, asset: str) -> str | None:
    """The id of a queued or running run that will materialize `asset` (None: none): a run whose
    asset selection names it, or a run of the job that materializes it (JOB_OF)."""
    waiting = [dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
               dg.DagsterRunStatus.STARTED]
    key = dg.AssetKey(asset)
    for run in instance.get_runs(dg.RunsFilter(statuses=waiting), limit=50):
        if run.asset_selection and key in run.asset_selection:
            return run.run_id
        if not run.asset_selection and run.job_name == JOB_OF.get(asset):
            return run.run_id
    return None


def fleet_recorded(instance: dg.DagsterInstance, fleet: Fleet) -> bool:
    """Whether the instance holds any record of this fleet's serve nodes (a deploy, an adoption, a
    health sweep's observation): an empty instance, or another fleet's, holds none."""
    nodes = [n.name for n in fleet.serve_nodes]
    flt = dg.AssetRecordsFilter(asset_key=dg.AssetKey(steps.NODE_DEPLOYMENT), asset_partitions=nodes)
    return bool(instance.fetch_materializations(flt, limit=1).records
                or instance.fetch_observations(flt, limit=1).records)


def newest_observation_id(instance: dg.DagsterInstance, after: int | None) -> int | None:
    """The storage id of the newest observation on node_deployment or gateway after `after`."""
    newest = None
    for asset in OBSERVED:
        recs = instance.fetch_observations(dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), after_storage_id=after),
                                           limit=1).records
        if recs and (newest is None or recs[0].storage_id > newest):
            newest = recs[0].storage_id
    return newest


# ---- the fleet's metrics (core/fleet_metrics.py decides the samples) ---------------------------

def healing_redeploys(instance: dg.DagsterInstance, node: str, since: float) -> int:
    """The healing policy's redeploys of `node` requested since `since` (epoch seconds): the runs
    node_health asked for with action `redeploy`, as the restart budget counts them."""
    after = dt.datetime.fromtimestamp(since, tz=dt.timezone.utc)
    runs = instance.get_run_records(dg.RunsFilter(
        tags={steps.HEALTH_ACTION_TAG: "redeploy", "dagster/partition": node}, created_after=after), limit=1000)
    return len(runs)


def last_good_bench_at(instance: dg.DagsterInstance, node: str) -> float | None:
    """When the node's newest bench that measured something and passed its gate was recorded."""
    for rec in bench_records(instance, node):
        meta = values(rec.asset_materialization)
        mean = meta.get(keys.MEAN_TOK_S)
        if mean is not None and float(mean) > 0 and meta.get(keys.PROMOTED) is not False:
            return rec.timestamp
    return None


def out_of_rotation_since(instance: dg.DagsterInstance, node: str, look_back: int = 200) -> float | None:
    """When the health sweeps began to find the node out of the gateway (the oldest of the newest
    run of sweeps with in_gateway false; at most `look_back` sweeps back); None while it is in."""
    records = instance.fetch_observations(dg.AssetRecordsFilter(
        asset_key=dg.AssetKey(steps.NODE_DEPLOYMENT), asset_partitions=[node]), limit=look_back).records
    since = None
    for rec in records:  # newest first
        seen = values(rec.event_log_entry.asset_observation).get(keys.IN_GATEWAY)
        if seen is None:
            continue  # a quarantine or release observation: no sweep
        if seen in (True, "true", "True"):
            break
        since = rec.timestamp
    return since


def measured_clean_boot(instance: dg.DagsterInstance, node: str, look_back: int = 10) -> float | None:
    """The node's newest clean-boot memcheck recorded on node_os (after a Phase 0 reboot), or None."""
    flt = dg.AssetRecordsFilter(asset_key=dg.AssetKey(steps.NODE_OS), asset_partitions=[node])
    for rec in instance.fetch_materializations(flt, limit=look_back).records:
        free = values(rec.event_log_entry.asset_materialization).get(keys.CLEAN_BOOT_FREE_GIB)
        if isinstance(free, (int, float)):
            return float(free)
    return None


def fleet_metric_facts(instance: dg.DagsterInstance, fleet: Fleet, now: float) -> fleet_metrics.FleetFacts:
    """Everything the fleet's metrics read, from the instance alone (no SSH: a scrape stays cheap)."""
    window_start = now - fleet.health.restart_window_s
    extra = {n.name: fleet_metrics.NodeExtra(
        redeploys_in_window=healing_redeploys(instance, n.name, window_start),
        last_good_bench_at=last_good_bench_at(instance, n.name),
        out_since=out_of_rotation_since(instance, n.name),
        clean_boot_free_gib=measured_clean_boot(instance, n.name) or fleet.profile_of(n).clean_boot_free_gib)
        for n in fleet.serve_nodes}
    return fleet_metrics.FleetFacts(
        nodes=node_facts(instance, fleet), rotation=latest_rotation(instance),
        min_in_rotation=fleet.gateway.min_in_rotation, restart_budget=fleet.health.restart_budget,
        bench_max_s=fleet.health.bench_max_s, extra=extra,
        rollout_in_progress=run_in_progress_for(instance, steps.FLEET_ROLLOUT) is not None, now=now)


# ---- runs whose process is gone -----------------------------------------------------------------
#
# A run killed under `dagster job execute`, or executed in-process (`spark-pipelines adopt`, a
# test), stays STARTED: no daemon launched it, so no run monitoring looks at it, and a run queue
# (one run per node) would hold the node's next run behind it. Every run records its own process
# id as an engine event ("Started process for run (pid: N)", its executor's "parent process (pid:
# N)" or "Executing steps in process (pid: N)"); on an instance whose runs all run on this machine
# (the default launcher and the demo's), the next run that starts, and the health sweep, mark a
# STARTED run whose process is gone as failed. The demo's daemon does the same through its
# launcher (spark_pipelines/cli/console_launcher.py); the team's run containers are its launcher's.

# The process started at most this long after its event was written: more is a recycled pid.
START_SLACK_S = 5.0
IN_PROGRESS = frozenset({dg.DagsterRunStatus.QUEUED, dg.DagsterRunStatus.NOT_STARTED, dg.DagsterRunStatus.STARTING,
                         dg.DagsterRunStatus.STARTED, dg.DagsterRunStatus.CANCELING})


def run_process(instance: dg.DagsterInstance, run_id: str) -> tuple[int, float] | None:
    """(pid, when the event naming it was written) of the run's own process, or None when the
    run has not recorded it (yet). Step processes are not the run's: their events carry a step."""
    found = instance.get_records_for_run(run_id, of_type=dg.DagsterEventType.ENGINE_EVENT, limit=50).records
    for rec in found:
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
    """Whether `pid` is a live (not zombie) process here that already existed when `recorded_at` was."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X", "x"):
        return False
    started = _boot_time() + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return started <= recorded_at + START_SLACK_S


def runs_here(instance: dg.DagsterInstance) -> bool:
    """Whether every run of the instance runs on this machine (a process launcher, not containers
    or another host), so a run's recorded pid names a process here."""
    try:
        return isinstance(instance.run_launcher, dg.DefaultRunLauncher)
    except Exception:  # a launcher that cannot be loaded here decides nothing
        return False


def fail_dead_runs(instance: dg.DagsterInstance, besides: str | None = None) -> list[str]:
    """Mark failed every STARTED run (but `besides`) whose process on this machine is gone; returns
    their ids. Nothing on an instance whose runs run elsewhere."""
    if not runs_here(instance):
        return []
    failed = []
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=[dg.DagsterRunStatus.STARTED]), limit=100):
        if run.run_id == besides:
            continue
        found = run_process(instance, run.run_id)
        if found is None or process_alive(*found):
            continue
        pid, at = found
        instance.report_run_failed(run, message=(
            f"the run's process (pid {pid}, recorded {time.strftime('%H:%M:%S', time.localtime(at))}) is gone: "
            f"killed; marked failed by the next run on this instance. Its node lease ended with it, and the next "
            f"run on its node finishes what it left (its journal)"))
        failed.append(run.run_id)
    return failed


def run_ended(instance: dg.DagsterInstance, run_id: str) -> bool:
    """Whether the instance knows the run `run_id` ended (False: in progress, or not a run of it)."""
    run = instance.get_run_by_id(run_id) if run_id else None
    return run is not None and run.status not in IN_PROGRESS


def run_key_failed(instance: dg.DagsterInstance, run_key: str) -> bool:
    """Whether the newest run a sensor requested with `run_key` ended without success (failed or
    canceled): the request it stood for was not carried out."""
    if not run_key:
        return False
    runs = instance.get_runs(filters=dg.RunsFilter(tags={steps.RUN_KEY_TAG: run_key}), limit=1)
    return bool(runs) and runs[0].status in (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)
