"""node_health: the health sweep every minute, each verdict recorded, the runbook's policies applied.

Each tick sweeps every serve node at once (runbook.sweep: read-only, short per-step timeouts,
no connect retries, so a dead node costs seconds and the tick stays well inside Dagster's 60 s),
then per node:

- an `AssetObservation` on `node_deployment` (partition = node): verdict, evidence, advice,
  in_gateway, quarantined, the policy's decision, and /metrics figures with their units;
- an evaluation of the `health` asset check on `node_deployment` for that partition;
- the policy's run request (core.healing.decide): redeploy, quarantine, bench, or the rollback
  decision, each with a run key of node + episode start + action; and, first of all, the repair
  of a deploy whose run died on the node (its journal there, its node lease free): one
  deploy_node_job keyed by the dead run, which finishes the rollback or the commit and puts the
  node back in the gateway.

Then the gateway reconcile plan (core.healing.reconcile) becomes a gateway_reconcile_job request
when it changes anything. The cursor keeps each node's memory (episodes, budgets, what the last
sweep saw) as JSON; the older cursor ({node: {"failures", "since", ...}}) is read and restarted.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from typing import Any

import dagster as dg

from spark_pipelines.assets.health import QuarantineConfig, ReconcileConfig
from spark_pipelines.assets.node_os import NodeOsConfig
from spark_pipelines.assets.nodes import DeployConfig
from spark_pipelines.core import health, healing, steps
from spark_pipelines.core import record_keys as keys
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.ssh import FleetSSH, RemoteError
from spark_pipelines.runbook import journal as procedure_journal
from spark_pipelines.runbook import reconcile, sweep
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.state import records

ASSET = dg.AssetKey(steps.NODE_DEPLOYMENT)
# The same reconcile plan is asked again only after this long while its run may still be on its
# way; at once (the next sweep) when that run failed: a take-out of a dead node whose reload
# failed must not wait ten minutes (a soak with the reload failing and a node powered off left
# the node routed 60 s after it died, the plan unchanged and not asked again).
RECONCILE_RETRY_S = 600
# After a failed reconcile run the same plan waits this long before it is asked again, doubling with
# each failure up to RECONCILE_RETRY_S: a fault that outlasts a few sweeps (the reload refused)
# costs a handful of failed runs, not one per sweep.
RECONCILE_FAILED_RETRY_S = 15


def _earlier(raw: dict[str, Any], node: str) -> health.Observation | None:
    """What the last sweep saw, as core.health.with_earlier reads it."""
    if not isinstance(raw.get("probed_at"), (int, float)):
        return None
    started, restarts = raw.get("started_at"), raw.get("restart_count")
    container = (health.ContainerState(exists=True, started_at=started, restart_count=int(restarts or 0))
                 if started is not None or restarts is not None else None)
    return health.Observation(node=node, probed_at=float(raw["probed_at"]), ssh_ok=bool(raw.get("ssh_ok", True)),
                              ssh_dead_since=raw.get("ssh_dead_since"), container=container,
                              last_started_at=raw.get("last_started_at"),
                              previous_restart_count=raw.get("previous_restart_count"),
                              served_at=raw.get("served_at"))


def _remember(obs: health.Observation) -> dict[str, Any]:
    c = obs.container if obs.container is not None and obs.container.exists else None
    keep = ("vllm:generation_tokens_total", "vllm:spec_decode_num_draft_tokens_total",
            "vllm:spec_decode_num_accepted_tokens_total")
    return {"probed_at": obs.probed_at, "ssh_ok": obs.ssh_ok,
            "ssh_dead_since": obs.ssh_dead_since if not obs.ssh_ok else None,
            "started_at": c.started_at if c else None, "restart_count": c.restart_count if c else None,
            "last_started_at": obs.last_started_at, "previous_restart_count": obs.previous_restart_count,
            "served_at": obs.probed_at if obs.health_ok else obs.served_at,
            "metrics": {k: obs.metrics[k] for k in keep if obs.metrics and k in obs.metrics}}


def read_cursor(text: str | None) -> tuple[dict[str, healing.NodeMemory], dict[str, Any]]:
    """(each node's memory, the last reconcile request); tolerant of the older cursor and of junk."""
    try:
        data = json.loads(text) if text else {}
    except ValueError:
        data = {}
    if not isinstance(data, dict):
        data = {}
    nodes = data.get("nodes") if isinstance(data.get("nodes"), dict) else {
        k: v for k, v in data.items() if k != "reconcile"}  # the older cursor: {node: episode}
    last = data.get("reconcile") if isinstance(data.get("reconcile"), dict) else {}
    return {k: healing.NodeMemory.from_json(v) for k, v in nodes.items()}, last


def _metadata(v: health.NodeVerdict, d: healing.Decision, in_gateway: bool | None, quarantined: str,
              figures: dict[str, float | str]) -> dict[str, Any]:
    meta: dict[str, Any] = {
        keys.VERDICT: dg.MetadataValue.text(v.verdict),
        # One line, its parts "; "-separated: a table cell or a metadata row reads it whole.
        keys.EVIDENCE: dg.MetadataValue.text("; ".join(v.evidence)),
        keys.ADVICE: dg.MetadataValue.text(v.advice),
        keys.IN_GATEWAY: dg.MetadataValue.bool(bool(in_gateway)),
        keys.QUARANTINED: dg.MetadataValue.text(quarantined or "no"),
        keys.POLICY: dg.MetadataValue.text(d.note),
    }
    for key, value in figures.items():
        meta[key] = (dg.MetadataValue.text(value) if isinstance(value, str)
                     else dg.MetadataValue.int(int(value)) if key.startswith("requests_")
                     else dg.MetadataValue.float(float(value)))
    return meta


# The op and its config type each action's job takes (the policies in core say only the fields).
ACTION_CONFIG: dict[str, tuple[str, type[dg.Config]]] = {
    steps.QUARANTINE_JOB: (steps.QUARANTINE_OP, QuarantineConfig),
    steps.DEPLOY_JOB: (steps.DEPLOY_OP, DeployConfig),
    steps.NODE_OS_JOB: (steps.NODE_OS, NodeOsConfig),
}


def _request(node: str, a: healing.Action, verdict: str) -> dg.RunRequest:
    tags = {steps.REASON_TAG: f"health-{verdict}", steps.HEALTH_ACTION_TAG: a.kind}
    config = None
    if a.config and a.job in ACTION_CONFIG:
        op, schema = ACTION_CONFIG[a.job]
        config = dg.RunConfig(ops={op: schema(**a.config)})
    return dg.RunRequest(run_key=a.run_key, job_name=a.job, partition_key=node, tags=tags, run_config=config)


def health_sensors(fleet: Fleet, jobs: Sequence[Any] = ()) -> dg.Definitions:
    """`fleet` is the one loaded with the code location; `jobs` the job definitions the policies
    request (deploy_node_job, bench_job, quarantine_job, gateway_reconcile_job: definitions.py
    passes the very objects the other factories made)."""
    settings = fleet.health

    @dg.sensor(name=steps.HEALTH_SENSOR, minimum_interval_seconds=60, jobs=list(jobs) or None,
               default_status=dg.DefaultSensorStatus.STOPPED,
               description="The health sweep of every serve node at once (SSH, nvidia-smi, docker inspect, the "
                           "container's log tail, /health, /metrics, its bench history), each verdict recorded on "
                           "node_deployment. engine-down: redeploy, at most restart_budget times per window with backoff, then "
                           "quarantine; crash-loop / residue: quarantine, never a relaunch; regressed: a confirming "
                           "bench, then a redeploy on a fresh JIT cache, then the rollback decision; unreachable / "
                           "wedged: recorded; a deploy whose run died (its journal on the node, its lease free): "
                           "deploy_node_job finishes it at once; another procedure whose run died (Phase 0's "
                           "reboot, a bench's drain, a newcomer, a cold drain: its journal in the ledger): a run "
                           "of its own job finishes it. "
                           "The gateway keeps exactly the healthy, promoted, not-quarantined nodes.")
    def node_health(context: dg.SensorEvaluationContext, ssh: FleetSSH) -> dg.SensorResult:
        memory, last_reconcile = read_cursor(context.cursor)
        names = [n.name for n in fleet.serve_nodes]
        history = records.bench_histories(names, context.instance)
        earlier = {n: e for n in names if (e := _earlier(memory.get(n, healing.NodeMemory()).earlier, n))}
        events: list[Any] = []
        requests: list[dg.RunRequest] = []
        said: list[str] = []
        for run_id in records.fail_dead_runs(context.instance):
            context.log.warning(f"run {run_id} was STARTED but its process is gone (killed): marked failed")
        with sweep.open_session(fleet, context.log, base=ssh) as s:
            s.run_ended = lambda run_id: records.run_ended(context.instance, run_id)
            reports = sweep.sweep(s, bench=history, earlier=earlier)
            healthy_names = [n for n, r in reports.items() if r.verdict.verdict == "healthy"]
            try:
                view: reconcile.View | None = reconcile.read_view(s, healthy_names)
                gateway_note = ""
            except (RunbookError, RemoteError, ValueError) as e:
                view, gateway_note = None, f"gateway not read ({first_line(e)[:200]}): no reconcile"
        now = time.time()
        rotation = set(view.snapshot.rotation) if view else set()
        for name, report in reports.items():
            v, obs = report.verdict, report.observation
            held = view.quarantined.get(name) if view else None
            c = obs.container
            journal = obs.deploy_journal
            dead = [p for p in (view.procedures.get(name, []) if view else [])
                    if procedure_journal.dead_in_sweep(s, p, reachable=obs.ssh_ok, lease_held=obs.lease_held)]
            unfinished = (healing.Unfinished(dead[-1].procedure, dead[-1].run_id, dead[-1].phase, dead[-1].describe())
                          if dead else None)
            d = healing.decide(v, memory.get(name), settings, now=now,
                               quarantined=held.summary() if held else None,
                               benches=len(history[name].tok_s) if name in history else 0,
                               started_at=c.started_at if c is not None and c.exists else None,
                               interrupted=journal.run_id if journal is not None and journal.dead else None,
                               unfinished=unfinished)
            before = d.memory.earlier
            seconds = obs.probed_at - before["probed_at"] if isinstance(before.get("probed_at"), (int, float)) else None
            figures = healing.engine_figures(obs.metrics, before.get("metrics"), seconds)
            d.memory.earlier = _remember(obs)
            memory[name] = d.memory
            meta = _metadata(v, d, name in rotation if view else None, held.summary() if held else "", figures)
            events.append(records.observation(steps.NODE_DEPLOYMENT, name, meta, f"{v.verdict}: {d.note}"))
            # Not partition=name: runless evaluations share run_id "", and a second one for the same
            # partition violates asset_check_executions' unique (asset, check, run_id, partition) in
            # Dagster 1.13. The node is in the description and the metadata instead.
            events.append(dg.AssetCheckEvaluation(
                asset_key=ASSET, check_name=steps.HEALTH_CHECK, passed=not v.needs_action,
                severity=dg.AssetCheckSeverity.WARN,
                description=f"{name}: {v.verdict}; {'; '.join(v.evidence)[:300]} -> {v.advice[:200]} ({d.note})",
                metadata={"node": name, "verdict": v.verdict, "policy": d.note}))
            said.append(f"{name}: {v.verdict} ({d.note})")
            if d.action is not None:
                requests.append(_request(name, d.action, v.verdict))
                context.log.info(f"{name}: {v.verdict}: {d.action.reason} -> {d.action.job}")

        if view is not None:
            plan = reconcile.plan(fleet, reports, {n: m.failing for n, m in memory.items()}, view, now=now)
            said.append(f"gateway: {plan.describe()}")
            if not plan.empty:
                # The moves, not their wording (a streak's count changes every sweep).
                moves = [[m.node, m.dead] for m in plan.take_out], [m.node for m in plan.put_back]
                digest = hashlib.sha256(json.dumps(moves).encode()).hexdigest()[:12]
                same = last_reconcile.get("digest") == digest
                tries = int(last_reconcile.get("tries", 0)) if same else 0
                since = now - float(last_reconcile.get("at", 0))
                again = (not same or since > RECONCILE_RETRY_S
                         or (since >= min(RECONCILE_RETRY_S, RECONCILE_FAILED_RETRY_S * 2 ** max(0, tries - 1))
                             and records.run_key_failed(context.instance, str(last_reconcile.get("key", "")))))
                if again:
                    tries += 1
                    key = f"reconcile-{digest}-{int(now)}-{tries}"  # a retry never reuses a key
                    last_reconcile = {"digest": digest, "at": int(now), "tries": tries, "key": key}
                    requests.append(dg.RunRequest(
                        run_key=key, job_name=steps.RECONCILE_JOB,
                        run_config=dg.RunConfig(ops={steps.RECONCILE_OP: ReconcileConfig(**plan.to_config())}),
                        tags={steps.REASON_TAG: "health-reconcile"}))
        else:
            said.append(gateway_note)
        cursor = json.dumps({"nodes": {n: m.to_json() for n, m in memory.items() if n in names},
                             "reconcile": last_reconcile}, sort_keys=True, separators=(",", ":"))
        summary = "; ".join(said) or "no serve node"
        # On the tick itself (its logs), whether or not it requested runs: a request Dagster drops
        # as already made (its run key) would otherwise leave only "0 runs requested".
        context.log.info(summary)
        return dg.SensorResult(run_requests=requests, asset_events=events, cursor=cursor,
                               skip_reason=None if requests else summary)

    return dg.Definitions(sensors=[node_health])
