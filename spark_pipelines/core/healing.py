"""What the fleet does about a verdict: the runbook's healing policies, with budgets, as data.

Pure decisions over a node's verdict (core.health), what earlier sweeps saw of it (`NodeMemory`,
kept in the node_health sensor's cursor) and the fleet's `health:` settings:

- engine-down: redeploy, at most `restart_budget` times in `restart_window_s` per node, with a
  backoff after each (10 min, then doubling); past the budget, quarantine. No redeploy loops.
- crash-loop / residue: never a relaunch: quarantine (the deploy's preflight refuses a residue
  node with "reboot the node" until free memory is back at the profile's clean baseline).
- unreachable: recorded; the gateway reconcile keeps it out once it failed two sweeps; past 10 min
  the advice is a hard reset (a person's job: nothing here can reach the node).
- regressed: a confirming bench; confirmed -> redeploy (budgeted) -> a verifying bench; still
  slow -> the rollback to the previous image, recorded as a quarantine whose reason says so.
- wedged: recorded only (wedge_watch and its jobs own the wedge).

A policy acts only once a verdict held `failed_sweeps` sweeps in a row (one failed probe can be
a hiccup), and each action carries a run key of node + episode start + action, so one episode
never gets the same request twice. `reconcile` plans the gateway's rotation: exactly the healthy,
promoted, not-quarantined nodes, never below gateway.min_in_rotation (dead nodes excepted).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from spark_pipelines.core import diagnosis as d
from spark_pipelines.core.fleet_settings import HealthSettings
from spark_pipelines.core.health import NodeVerdict
from spark_pipelines.core.steps import (BENCH_JOB, DEPLOY_JOB, FINISHED_BY, NODE_OS_JOB,  # the jobs the actions run
                                       PROC_COLD_DRAIN, QUARANTINE_JOB)

FRESH_JIT_CACHE = "fresh_jit_cache"  # node_deployment's config field (assets/nodes.py DeployConfig)
NODE_OS_CHECK = "check"  # node_os's config field (assets/node_os.py NodeOsConfig)
# Verdicts that quarantine: relaunching cannot help (a reboot or an operator must).
QUARANTINE_VERDICTS = frozenset({"crash-loop", "residue"})
# Verdicts that count as a failed sweep for the gateway (the node does not serve, or cannot be
# managed). `wedged` and `regressed` nodes still answer: their benches keep them out or in.
FAILING = frozenset({"engine-down", "crash-loop", "residue", "unreachable"})
# Verdicts that neither start nor end an episode (a deploy in progress, a probe that could not decide).
NEUTRAL = frozenset({"starting", "unknown"})
# Drain notes written by these policies start with this: their cause is ours, undone once healthy.
NOTE_PREFIX = "health: "

ActionKind = Literal["redeploy", "quarantine", "bench", "rollback", "finish"]


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    job: str
    run_key: str
    reason: str
    config: Mapping[str, Any] = field(default_factory=dict)  # the job's op config (quarantine: verdict, reason)


@dataclass
class NodeMemory:
    """What earlier sweeps knew of one node (JSON in the sensor's cursor)."""

    verdict: str | None = None
    streak: int = 0  # sweeps in a row with this verdict
    failing: int = 0  # sweeps in a row with a FAILING verdict (any)
    since: float | None = None  # start of the current episode (first sweep that left healthy)
    redeploys: list[float] = field(default_factory=list)  # when each redeploy was requested (any episode)
    done: list[str] = field(default_factory=list)  # actions requested in this episode
    stage: str | None = None  # regressed: confirm -> redeployed -> verify -> rolled-back
    stage_at: float | None = None
    benches_at: int = 0  # bench count when the stage began
    earlier: dict[str, Any] = field(default_factory=dict)  # core.health.with_earlier's inputs
    held: bool = False  # quarantined at the last sweep (its release starts a new episode)

    def to_json(self) -> dict[str, Any]:
        """Only what differs from a fresh memory, times to the second: the cursor is shown on the
        sensor's page and stays short (from_json fills the rest with the defaults)."""
        return {k: _compact(v) for k, v in asdict(self).items() if v not in (None, 0, [], {}, "")}

    @classmethod
    def from_json(cls, raw: Any) -> NodeMemory:
        """Tolerant: the older cursor's bare count or {"failures", "since", "requested"} start afresh
        (keeping its episode start), and unknown keys are ignored."""
        if not isinstance(raw, Mapping):
            return cls()
        m = cls()
        for key, kind in (("verdict", str), ("stage", str)):
            if isinstance(raw.get(key), kind):
                setattr(m, key, raw[key])
        for key in ("streak", "failing", "benches_at"):
            if isinstance(raw.get(key), int) and not isinstance(raw.get(key), bool):
                setattr(m, key, raw[key])
        for key in ("since", "stage_at"):
            if isinstance(raw.get(key), (int, float)) and not isinstance(raw.get(key), bool):
                setattr(m, key, float(raw[key]))
        if isinstance(raw.get("redeploys"), list):
            m.redeploys = [float(t) for t in raw["redeploys"] if isinstance(t, (int, float))]
        if isinstance(raw.get("done"), list):
            m.done = [str(a) for a in raw["done"]]
        if isinstance(raw.get("earlier"), Mapping):
            m.earlier = dict(raw["earlier"])
        m.held = raw.get("held") is True
        return m


def _compact(value: Any) -> Any:
    """Floats to whole seconds (epoch times) or 4 significant decimals; Nones dropped from dicts."""
    if isinstance(value, float):
        return round(value) if abs(value) > 1e6 else round(value, 4)
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_compact(v) for v in value]
    return value


@dataclass(frozen=True)
class Decision:
    node: str
    verdict: str
    note: str  # what the policy decided, for the record (observation metadata, skip reason)
    memory: NodeMemory
    action: Action | None = None


def backoff_s(settings: HealthSettings, redeploys_in_window: int) -> float:
    """The wait after the n-th redeploy of the window before the next: backoff_s, doubling."""
    if redeploys_in_window <= 0:
        return 0.0
    return float(settings.backoff_s) * settings.backoff_factor ** (redeploys_in_window - 1)


def _min(seconds: float) -> str:
    return f"{seconds / 60:.0f} min"


def _key(node: str, m: NodeMemory, action: str) -> str:
    return f"heal-{node}-{int(m.since or 0)}-{action}"


def _act(node: str, verdict: str, m: NodeMemory, kind: ActionKind, job: str, name: str, reason: str,
         config: Mapping[str, Any] | None = None) -> Decision:
    m.done.append(name)
    return Decision(node, verdict, reason, m, Action(kind, job, _key(node, m, name), reason, dict(config or {})))


def _redeploy_or_quarantine(node: str, verdict: str, m: NodeMemory, settings: HealthSettings, now: float,
                            why: str, deploy_config: Mapping[str, Any] | None = None) -> Decision:
    """The budgeted redeploy: within the budget and past the backoff, redeploy; past the budget, quarantine.
    `deploy_config`: the node_deployment config the redeploy runs with."""
    window = [t for t in m.redeploys if now - t < settings.restart_window_s]
    m.redeploys = window
    hours = f"{settings.restart_window_s / 3600:g} h"
    if len(window) >= settings.restart_budget:
        reason = (f"restart budget spent: {len(window)} redeploy(s) in the last {hours} (budget "
                  f"{settings.restart_budget}), {why}: quarantined instead of redeployed again")
        return _act(node, verdict, m, "quarantine", QUARANTINE_JOB, "quarantine", reason,
                    {"verdict": verdict, "reason": reason})
    wait = backoff_s(settings, len(window))
    if window and now - window[-1] < wait:
        return Decision(node, verdict, f"{why}: backoff, the next redeploy is allowed "
                                       f"{_min(window[-1] + wait - now)} from now (redeploy {len(window)} of "
                                       f"{settings.restart_budget} in {hours} was {_min(now - window[-1])} ago)", m)
    m.redeploys = [*window, now]
    n = sum(1 for a in m.done if a.startswith("redeploy")) + 1
    return _act(node, verdict, m, "redeploy", DEPLOY_JOB, f"redeploy{n}",
                f"{why}: redeploy {len(m.redeploys)} of {settings.restart_budget} in {hours}", deploy_config)


def _regressed(node: str, m: NodeMemory, settings: HealthSettings, now: float, benches: int,
               started_at: float | None) -> Decision:
    v = "regressed"
    if m.stage is None:
        m.stage, m.stage_at, m.benches_at = "confirm", now, benches
        return _act(node, v, m, "bench", BENCH_JOB, "bench-confirm",
                    "slower than its bench history: a confirming bench (bench_job) is requested")
    if m.stage == "confirm":
        if benches <= m.benches_at:
            return Decision(node, v, "waiting for the confirming bench", m)
        # A node that still serves would skip a plain redeploy (marker, container and /health all
        # match): the runbook's fix for a slow node at full clocks is a relaunch on a fresh JIT
        # cache (a stale ~/.cache/vllm), which the deploy does even when nothing else changed.
        d = _redeploy_or_quarantine(node, v, m, settings, now, "the confirming bench is slow too",
                                    {FRESH_JIT_CACHE: True})
        if d.action is not None and d.action.kind == "redeploy":
            m.stage, m.stage_at = "redeployed", now
        return d
    if m.stage == "redeployed":
        if started_at is None or m.stage_at is None or started_at <= m.stage_at:
            return Decision(node, v, "waiting for the redeploy (after a confirmed regression) to start", m)
        m.stage, m.stage_at, m.benches_at = "verify", now, benches
        return _act(node, v, m, "bench", BENCH_JOB, "bench-verify",
                    "redeployed after a confirmed regression: a bench verifies the redeploy")
    if m.stage == "verify":
        if benches <= m.benches_at:
            return Decision(node, v, "waiting for the bench after the redeploy", m)
        m.stage, m.stage_at = "rolled-back", now
        reason = ("the redeploy did not restore its throughput: roll the node back to its previous image "
                  "(retag the image it served before as the launch profile's image, then deploy_node_job)")
        return _act(node, v, m, "rollback", QUARANTINE_JOB, "rollback", reason, {"verdict": v, "reason": reason})
    return Decision(node, v, f"regressed after a redeploy and the rollback decision ({m.stage}): "
                             "no further automatic action", m)


def repair_key(node: str, run_id: str) -> str:
    """The run key of the repair of one dead run's deploy: one request per interrupted deploy."""
    return f"repair-{node}-{run_id[:8] or 'unknown'}"


@dataclass(frozen=True)
class Unfinished:
    """A procedure's journal a dead run left on a node (runbook/journal.py): which, whose, where."""

    procedure: str  # core.steps.PROC_*
    run_id: str
    phase: str
    describe: str  # for the record: "the node os of run ... (phase ...)"


def finish_action(node: str, verdict: str, u: Unfinished) -> Action:
    """What finishes a dead run's procedure: a run of the procedure's own job (its rerun finishes
    the journal first and redoes nothing done), one per dead run. A node that does not come back
    from a dead Phase 0 reboot cannot be finished over SSH: it is quarantined with the runbook's
    hard-reset advice instead (a dead cold drain's rerun turns the plug on itself)."""
    key = f"finish-{node}-{u.procedure}-{u.run_id[:8] or 'unknown'}"
    job = FINISHED_BY.get(u.procedure, DEPLOY_JOB)
    if verdict == "unreachable" and u.procedure != PROC_COLD_DRAIN:
        reason = (f"{u.describe} died and {node} does not answer SSH: hard reset (runbook lesson 5: power-cycle "
                  f"it), then {job} for it (it finishes what the dead run left)")
        return Action("quarantine", QUARANTINE_JOB, key, reason, {"verdict": "unreachable", "reason": reason})
    # Phase 0's job only reads by default (check: true); its finisher applies, as the dead run did.
    config = {NODE_OS_CHECK: False} if job == NODE_OS_JOB else {}
    return Action("finish", job, key, f"{u.describe} died on {node}: {job} finishes it (the engine it stopped "
                                      f"started, its drain undone, or the node held out with the reason)", config)


def decide(verdict: NodeVerdict, memory: NodeMemory | None, settings: HealthSettings, *, now: float,
           quarantined: str | None = None, benches: int = 0, started_at: float | None = None,
           interrupted: str | None = None, unfinished: Unfinished | None = None) -> Decision:
    """The policy's answer to one sweep's verdict of one node. `quarantined` is the node's
    quarantine reason (None: not quarantined); `benches` how many benches its history holds;
    `started_at` when its serving container last started (the regressed flow waits for it);
    `interrupted` the run id of a deploy that died on the node (its journal is there and nobody
    holds the node's lease): its repair, a deploy_node_job that finishes it, is requested at once,
    whatever the verdict (the owner is known dead: nothing to wait for), outside the restart
    budget (it is not a relaunch), and before any other policy of this sweep. `unfinished`: another
    procedure a dead run left (its journal in the ledger), finished the same way by a run of its
    own job (`finish_action`), after a dead deploy's repair."""
    m = replace(memory) if memory is not None else NodeMemory()
    m.redeploys, m.done = list(m.redeploys), list(m.done)
    name, node = verdict.verdict, verdict.node
    m.streak = m.streak + 1 if m.verdict == name else 1
    m.verdict = name
    m.failing = m.failing + 1 if name in FAILING else 0
    if quarantined:
        m.held = True
    elif m.held:
        # Released since the last sweep: a person fixed the cause, so a new episode starts with the
        # whole restart budget. Kept, the episode's "quarantine" and a spent budget left a node
        # released with its engine down neither redeployed nor quarantined again (the 60-minute
        # soak's finding).
        m.held, m.since, m.done, m.redeploys, m.stage, m.stage_at = False, None, [], [], None, None
    if interrupted is not None:
        if name == "healthy":
            m.since, m.done, m.stage, m.stage_at = None, [], None, None
        elif m.since is None and name not in NEUTRAL:
            m.since, m.done = now, []
        reason = (f"the deploy of run {interrupted[:8] or '-'} died on {node}: deploy_node_job finishes it (the "
                  f"previous deployment back, or its verified one committed) and puts {node} back in the gateway"
                  + (f"; {node} stays quarantined ({quarantined})" if quarantined else ""))
        return Decision(node, name, reason, m, Action("redeploy", DEPLOY_JOB, repair_key(node, interrupted), reason))
    if unfinished is not None:
        if name == "healthy":
            m.since, m.done, m.stage, m.stage_at = None, [], None, None
        elif m.since is None and name not in NEUTRAL:
            m.since, m.done = now, []
        a = finish_action(node, name, unfinished)
        return Decision(node, name, a.reason, m, a)
    if name == "healthy":
        m.since, m.done, m.stage, m.stage_at = None, [], None, None
        return Decision(node, name, "nothing to do", m)
    if name in NEUTRAL:
        return Decision(node, name, "recorded; no action for this verdict", m)
    if m.since is None:
        m.since, m.done = now, []
    if quarantined:
        return Decision(node, name, f"quarantined ({quarantined}); no automatic action until it is released", m)
    if name == "wedged":
        return Decision(node, name, "recorded; the wedge policy (wedge_watch) acts on a wedge", m)
    if name == "unreachable":
        return Decision(node, name, f"recorded; out of the gateway once it failed {settings.failed_sweeps} "
                                    "sweeps in a row; a hard reset is a person's job", m)
    if m.streak < settings.failed_sweeps:
        return Decision(node, name, f"{name} on {m.streak} of {settings.failed_sweeps} sweeps: "
                                    "no action before it holds", m)
    if name in QUARANTINE_VERDICTS:
        if "quarantine" in m.done:
            return Decision(node, name, "quarantine already requested in this episode", m)
        reason = f"{name}: relaunching cannot help; {'reboot the node' if name == 'residue' else 'fix the failure the log names'}"
        return _act(node, name, m, "quarantine", QUARANTINE_JOB, "quarantine", f"no relaunch: quarantined ({reason})",
                    {"verdict": name, "reason": reason})
    if name == "engine-down":
        if "quarantine" in m.done:
            return Decision(node, name, "quarantine already requested in this episode", m)
        return _redeploy_or_quarantine(node, name, m, settings, now, f"engine-down on {m.streak} sweeps")
    if name == "regressed":
        return _regressed(node, m, settings, now, benches, started_at)
    return Decision(node, name, "recorded", m)


# ------------------------------------------------------------------ figures for the record

METRIC_KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # 0.19+ name, then the older one


# Fewer tokens drafted since the last sweep than this say nothing about MTP: the lifetime figure then.
MIN_DRAFTED_IN_WINDOW = 200


def engine_figures(metrics: Mapping[str, float] | None, earlier: Mapping[str, float] | None = None,
                   seconds: float | None = None) -> dict[str, float | str]:
    """The numbers one /metrics read gives, each with its unit in its name: requests running /
    waiting, KV-cache usage and MTP acceptance in percent (since the last read when it drafted
    enough tokens to say, else since the engine started), the generation rate in tok/s (only with
    an earlier read `seconds` ago: a counter alone is no rate); and `engine`, the same in one line
    that says which window each figure covers (a rate on an idle node is short requests between
    two sweeps, the gateway's own health checks among them)."""
    if not metrics:
        return {}
    out: dict[str, float | str] = {}
    for key, metric in (("requests_running", d.METRIC_RUNNING), ("requests_waiting", d.METRIC_WAITING)):
        if metric in metrics:
            out[key] = float(metrics[metric])
    said = []
    if "requests_running" in out or "requests_waiting" in out:
        said.append(f"{out.get('requests_running', 0):g} running / {out.get('requests_waiting', 0):g} waiting now")
    kv = next((metrics[k] for k in METRIC_KV_CACHE if k in metrics), None)

    def delta(metric: str) -> float | None:
        if metric not in metrics:
            return None
        if earlier and metric in earlier and metrics[metric] >= earlier[metric]:
            return metrics[metric] - earlier[metric]
        return None

    window = f"over the last {seconds:.0f} s" if seconds else "since the last sweep"
    generated = delta(d.METRIC_GENERATION)
    if generated is not None and seconds and seconds > 0:
        out["generation_tok_s"] = round(generated / seconds, 2)
        idle = not out.get("requests_running") and not out.get("requests_waiting")
        said.append(f"{out['generation_tok_s']:g} tok/s generated {window}"
                    + (" (short requests between sweeps; the gateway's health checks count)"
                       if idle and generated else ""))
    drafted, accepted = delta(d.METRIC_DRAFTED), delta(d.METRIC_ACCEPTED)
    mtp_window = window
    if not drafted or drafted < MIN_DRAFTED_IN_WINDOW or accepted is None:
        drafted, accepted = metrics.get(d.METRIC_DRAFTED), metrics.get(d.METRIC_ACCEPTED)
        mtp_window = "since the engine started"
    if drafted and accepted is not None:
        out["mtp_acceptance_pct"] = round(min(1.0, accepted / drafted) * 100, 1)
        said.append(f"MTP acceptance {out['mtp_acceptance_pct']:g}% {mtp_window}")
    if kv is not None:
        out["kv_cache_usage_pct"] = round(float(kv) * 100, 1)
        said.append(f"KV cache {out['kv_cache_usage_pct']:g}% used")
    if said:
        out["engine"] = "; ".join(said)
    return out


# ------------------------------------------------------------------ the gateway's rotation


@dataclass(frozen=True)
class NodeState:
    """One serve node as the reconcile sees it."""

    verdict: str
    failing: int = 0  # sweeps in a row with a FAILING verdict
    serving: bool = False  # /health 200 on this sweep
    promoted: bool = True  # its last bench did not hold it out
    quarantined: str | None = None
    busy: str | None = None  # a procedure in flight (its journal): not put back meanwhile


@dataclass(frozen=True)
class Move:
    node: str
    reason: str
    dead: bool = False  # not serving: a drain may go below the floor (a dead backend is no backend)


@dataclass(frozen=True)
class ReconcilePlan:
    take_out: tuple[Move, ...] = ()
    put_back: tuple[Move, ...] = ()
    held: tuple[str, ...] = ()  # changes the rules wanted but did not make, and why

    @property
    def empty(self) -> bool:
        return not self.take_out and not self.put_back

    def describe(self) -> str:
        parts = [f"take {m.node} out ({m.reason})" for m in self.take_out]
        parts += [f"put {m.node} back ({m.reason})" for m in self.put_back]
        return "; ".join(parts + list(self.held)) or "the rotation is as it should be"

    def to_config(self) -> dict[str, Any]:
        """The gateway_reconcile_job's run config for its op."""
        return {"take_out": [asdict(m) for m in self.take_out], "put_back": [asdict(m) for m in self.put_back]}


_SINCE = re.compile(r"since (\d{4}-\d\d-\d\dT\d\d[:_]\d\d[:_]\d\dZ)\s*$")


def drained_at(note: str) -> float | None:
    """When a drain note ("<reason> since <UTC ISO>", resources.gateway) was written."""
    match = _SINCE.search(note or "")
    if match is None:
        return None
    text = match.group(1).replace("_", ":")
    return dt.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc).timestamp()


def _back_because(note: str | None) -> str:
    """Why a node out by no drain, or by a drain these policies made, goes back: said from the
    note the drain left (a released quarantine is not "the health drain is over")."""
    if note is None:
        return "healthy and promoted, and out of the gateway config"
    what = _SINCE.sub("", note[len(NOTE_PREFIX):]).strip()
    at = _SINCE.search(note)
    since = f", out since {at.group(1)}" if at else ""
    quarantine = re.fullmatch(r"quarantined \((.+)\)", what)
    if quarantine:
        return f"its quarantine ({quarantine.group(1)}) was released and it is healthy and promoted{since}"
    return f"healthy and promoted again after the health policy took it out ({what[:80]}){since}"


def reconcile(nodes: Mapping[str, NodeState], rotation: Sequence[str], drains: Mapping[str, str], *,
              settings: HealthSettings, min_in_rotation: int, now: float) -> ReconcilePlan:
    """What to change so the rotation holds exactly the healthy, promoted, not-quarantined nodes.

    Taken out: a quarantined node, a node failing `failed_sweeps` sweeps in a row, a node its
    bench holds out. Put back: a healthy, promoted, not-quarantined node that is out, unless a
    drain note younger than `bench_max_s` says a bench may still be running (a drain these
    policies made is undone as soon as the node is healthy). A node that still serves is never
    taken out below `min_in_rotation`; a dead one is (the gateway's drain allows it with dead=True)."""
    take_out: list[Move] = []
    put_back: list[Move] = []
    held: list[str] = []
    current = [n for n in rotation if n in nodes]
    for name, st in nodes.items():
        if name in current:
            continue
        if st.verdict != "healthy" or not st.serving or not st.promoted or st.quarantined:
            continue
        if st.busy:
            held.append(f"{name} stays out: {st.busy} is in flight")
            continue
        note = drains.get(name)
        if note is None or note.startswith(NOTE_PREFIX):
            put_back.append(Move(name, _back_because(note)))
            continue
        at = drained_at(note)
        if at is None:
            held.append(f"{name} stays out: its drain note has no time ({note[:80]})")
        elif now - at > settings.bench_max_s:
            put_back.append(Move(name, f"drained {_min(now - at)} ago ({note[:80]}), longer than a bench takes "
                                       f"({_min(settings.bench_max_s)}), and healthy"))
        else:
            held.append(f"{name} stays out: drained {_min(now - at)} ago, a bench may still be running")
    wanted: list[Move] = []
    for name in current:
        st = nodes[name]
        dead = not st.serving
        if st.quarantined:
            wanted.append(Move(name, f"quarantined: {st.quarantined}", dead))
        elif st.verdict in FAILING and st.failing >= settings.failed_sweeps:
            wanted.append(Move(name, f"{st.verdict} on {st.failing} sweeps in a row", dead))
        elif not st.promoted:
            wanted.append(Move(name, "held out by its last bench", dead))
    remaining = len(current) + len(put_back) - sum(1 for m in wanted if m.dead)
    for m in sorted(wanted, key=lambda m: not m.dead):  # the dead first: they never count
        if m.dead:
            take_out.append(m)
        elif remaining - 1 >= min_in_rotation:
            take_out.append(m)
            remaining -= 1
        else:
            held.append(f"{m.node} stays in ({m.reason}): taking it out would leave fewer than "
                        f"gateway.min_in_rotation={min_in_rotation} node(s) serving")
    return ReconcilePlan(tuple(take_out), tuple(put_back), tuple(held))


__all__ = [
    "Action", "Decision", "Move", "NodeMemory", "NodeState", "ReconcilePlan", "Unfinished", "backoff_s", "decide",
    "drained_at", "engine_figures", "finish_action", "reconcile",
]
