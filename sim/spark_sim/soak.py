"""A seeded chaos soak of a deployed simulated fleet (issue 37): the team's automation live, client
traffic through the gateway the whole time, faults at seeded random times, operator actions
between them, and a checker that reads the real parts, not the pipeline's records.

- Automation: the node_health, wedge_watch and pins_changed sensors are evaluated every `tick_s`
  on the soak's Dagster instance with the fleet file's budgets (as the daemon would, at a faster
  cadence), and the runs they request are executed (one worker per run, leases keep one run per
  node), deduplicated by run key as the daemon does.
- Traffic: spark_sim.traffic's clients (pooled, fresh connection, OpenAI SDK) streaming, and a
  pooled one asking for non-streaming answers.
- Faults (soak_faults.FAULTS, spark_sim.faults' injectors and the simulator's own switches): each held for a
  seeded time, then undone as the world would (SIGCONT, link up, power back); what stays broken
  is the pipeline's to heal or quarantine. An operator releases a quarantine once its cause is gone.
- Checker: every request classified (served; failed in a fault's blame window; failed during a
  pipeline run; unexplained), the proxy's live routes and each engine's /health sampled, per fault
  the time to detect and to settle, and the end state (every node serving and routed or out with
  a ledger reason, no STARTED run, no lease held, no stray `-previous` container).
The report (markdown + PNG timeline) is spark_sim.soak_report's.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import dagster as dg
import httpx
import yaml

from spark_pipelines.core import steps
from spark_sim import faults as fx
from spark_sim.fleet import SimFleet
from spark_sim.faults import engine_healthy, engine_started_at
from spark_sim.soak_end import end_state
from spark_sim.soak_faults import FAULTS, prepare
from spark_sim.traffic import FRESH, OPENAI, POOLED, WHOLE, Traffic

HEALTH, WEDGE, PINS = "node_health", "wedge_watch", "pins_changed"
LEVELS = ("INFO", "DEBUG", "WARNING", "ERROR")
# Jobs whose run changes what the gateway routes or what a node serves: a request failing while one
# runs (and outside every fault's blame window) is the pipeline's.
PIPELINE_JOBS = ("deploy_node_job", "bench_job", "rollout_job", "gateway_job", "gateway_reconcile_job",
                 "quarantine_job", "release_quarantine_job", "wedge_capture_job", "add_node_job", "node_os_job")
SLACK_S = 5.0  # a blame window's tail: a request failing this soon after it ended is still the fault's
QUIET = {"console": {"config": {"log_level": "WARNING"}}}  # the run's own event log keeps the rest


@dataclass
class Mark:
    """A fault, an operator action or a pipeline run on the timeline (wall-clock seconds)."""

    kind: str  # fault | action | run
    name: str
    node: str | None
    start: float
    end: float | None = None
    ok: bool | None = None
    detail: str = ""
    detected: float | None = None  # fault: the first sweep verdict other than healthy on its node
    out_at: float | None = None  # fault: the proxy stopped routing to its node
    settled: float | None = None  # fault: serving and routed again, or quarantined
    outcome: str = ""  # fault: healed | quarantined | unsettled


@dataclass
class SoakConfig:
    seed: int = 1
    duration_s: float = 600.0
    tick_s: float = 10.0
    fault_gap_s: tuple[float, float] = (40.0, 80.0)
    action_every_s: float = 180.0
    first_action_s: float = 20.0
    actions: tuple[str, ...] = ("rollout", "bench", "reload", "bench")
    faults: tuple[str, ...] = ()  # empty: the whole catalogue
    settle_s: float = 300.0
    clients: dict[str, int] = field(default_factory=lambda: {POOLED: 1, FRESH: 1, OPENAI: 1, WHOLE: 1})
    max_tokens: int = 24
    pause_s: float = 0.3
    # A planned (fault, node, at_s) list instead of the seeded draw: the CI soak's overlap.
    plan: tuple[tuple[str, str, float], ...] = ()
    # A planned fault waits (from at_s, up to plan_wait_s) until a pipeline run has its node out of
    # the routes: the overlap then does not hang on how fast the run got there, and a run that
    # changes a node without draining it first meets the fault later, so the checker blames the
    # requests it failed on the run.
    plan_when_drained: bool = False
    plan_wait_s: float = 120.0


class Soak:
    def __init__(self, sim: SimFleet, fleet_path: str, instance: dg.DagsterInstance, cfg: SoakConfig,
                 key: str, log: Callable[[str], None] | None = None) -> None:
        from spark_pipelines.core.fleet import load_fleet

        self.sim, self.path, self.instance, self.cfg, self.key = sim, fleet_path, instance, cfg, key
        # An in-process run points this process's fd 1 and 2 at its compute log while it runs:
        # the soak's own lines go to a copy of stdout taken now.
        self._out = os.fdopen(os.dup(1), "w", buffering=1) if log is None else None
        self.log = log or (lambda line: self._out.write(line + "\n"))
        self.rng = random.Random(cfg.seed)
        self.fleet = load_fleet(fleet_path)
        self.nodes = [n.name for n in self.fleet.serve_nodes]
        self.marks: list[Mark] = []
        self.routes: list[tuple[float, list[str] | None]] = []
        self.health: list[tuple[float, str, bool]] = []
        self.engines: list[tuple[float, str, float]] = []  # (when, node, its engine's process start)
        self.verdicts: list[tuple[float, str, str]] = []
        self.ticks: list[tuple[float, str, float, str]] = []
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.defs = self._load_defs()
        self.cursors: dict[str, str | None] = {}
        self.seen_keys: set[str] = set()
        self.pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="soak-run")
        self.futures: list[Any] = []
        self.reserved: set[str] = set()
        self.t0 = time.time()

    # -- the code location, reloaded after a fleet-file edit --------------------------------

    def _load_defs(self) -> dg.Definitions:
        from spark_pipelines.definitions import build_definitions

        return build_definitions(self.path)

    def edit_fleet(self, change: Callable[[dict[str, Any]], None]) -> None:
        doc = yaml.safe_load(Path(self.path).read_text())
        change(doc)
        tmp = Path(self.path + ".soak-tmp")
        tmp.write_text(yaml.safe_dump(doc, sort_keys=False))
        os.replace(tmp, self.path)  # never half a file under the sensors
        self.defs = self._load_defs()

    # -- runs ---------------------------------------------------------------------------------

    def run(self, job: str, partition: str | None = None, *, run_config: Any = None, tags: Any = None,
            source: str = "operator") -> Mark:
        m = Mark("run", job, partition, time.time(), detail=source)
        with self.lock:
            self.marks.append(m)
        try:
            if hasattr(run_config, "to_config_dict"):
                run_config = run_config.to_config_dict()
            config = dict(run_config or {})
            config.setdefault("loggers", QUIET)
            res = self.defs.resolve_job_def(job).execute_in_process(
                instance=self.instance, partition_key=partition, run_config=config,
                tags=tags or None, raise_on_error=False)
            m.ok = res.success
            if not res.success:
                m.detail += ": " + _failure(res)
        except Exception as e:  # a run that could not even start is one more failed run
            m.ok, m.detail = False, f"{source}: {type(e).__name__}: {e}"[:400]
        m.end = time.time()
        self.log(f"  [{self.rel(m.start):6.0f}] run {job}{f'[{partition}]' if partition else ''} ({source}): "
                 f"{'ok' if m.ok else 'FAILED ' + m.detail[:200]} in {m.end - m.start:.0f} s")
        return m

    def rel(self, t: float) -> float:
        return t - self.t0

    # -- automation: the sensors -------------------------------------------------------------

    def _tick(self, name: str) -> None:
        defs = self.defs
        sensor = defs.get_repository_def().get_sensor_def(name)
        res_keys = sensor.required_resource_keys or set()
        resources = {k: defs.resources[k] for k in res_keys if k in (defs.resources or {})}
        started = time.time()
        with dg.build_sensor_context(instance=self.instance, cursor=self.cursors.get(name), definitions=defs,
                                     resources=resources) as ctx:
            res = sensor(ctx)
        took = time.time() - started
        if isinstance(res, dg.SensorResult):
            for event in res.asset_events or []:
                self.instance.report_runless_asset_event(event)
                if name == HEALTH and isinstance(event, dg.AssetObservation) and event.partition:
                    v = event.metadata.get("verdict")
                    if v is not None:
                        self.verdicts.append((started, event.partition, str(v.value)))
            if res.cursor is not None:
                self.cursors[name] = res.cursor
            requests = list(res.run_requests or [])
            said = str(res.skip_reason or "")
        else:
            requests = [r for r in (res if isinstance(res, list) else [res]) if isinstance(r, dg.RunRequest)]
            said = ""
        self.ticks.append((started, name, took, said[:200]))
        for r in requests:
            k = f"{name}:{r.run_key}"
            if r.run_key and k in self.seen_keys:
                continue
            self.seen_keys.add(k)
            job = r.job_name or ("build_job" if r.asset_selection else "?")
            # The run carries its key as the daemon's runs do (a sensor reads it back: a failed
            # reconcile is asked again).
            tags = {**(r.tags or {}), **({steps.RUN_KEY_TAG: r.run_key} if r.run_key else {})}
            self.futures.append(self.pool.submit(self.run, job, r.partition_key, run_config=r.run_config,
                                                 tags=tags, source=f"{name} {r.run_key or ''}".strip()))

    def _automation(self) -> None:
        n = 0
        while not self.stop.is_set():
            for name in (HEALTH, WEDGE) + ((PINS,) if n % 2 == 0 else ()):
                try:
                    self._tick(name)
                except Exception as e:  # a tick that raised: recorded, the next one runs
                    self.ticks.append((time.time(), name, 0.0, f"raised {type(e).__name__}: {e}"[:200]))
                    self.log(f"  [{self.rel(time.time()):6.0f}] {name} tick raised {type(e).__name__}: {e}"[:300])
            n += 1
            self.stop.wait(self.cfg.tick_s)

    # -- the checker's samples -----------------------------------------------------------------

    def proxy_routes(self) -> list[str] | None:
        """The nodes the running proxy routes to (its /model/info api_base), None when it does not answer."""
        try:
            r = httpx.get(f"http://{self.sim.gateway.ip}:{fx.PROXY_PORT}/model/info",
                          headers={"Authorization": f"Bearer {self.key}"}, timeout=3)
            if r.status_code != 200:
                return None
            by_ip = {m.ip: m.name for m in self.sim.nodes}
            out: list[str] = []
            for e in r.json().get("data") or []:
                base = (e.get("litellm_params") or {}).get("api_base") or ""
                host = base.split("//", 1)[-1].split(":", 1)[0]
                if host in by_ip and by_ip[host] not in out:
                    out.append(by_ip[host])
            return out
        except (httpx.HTTPError, ValueError):
            return None

    def _sampler(self) -> None:
        n = 0
        while not self.stop.is_set():
            self.routes.append((time.time(), self.proxy_routes()))
            if n % 3 == 0:
                for name in self.nodes:
                    member = self.sim.node(name)
                    ok = engine_healthy(member, timeout=2)
                    self.health.append((time.time(), name, ok))
                    started = engine_started_at(member, timeout=2) if ok else None
                    if started is not None:
                        self.engines.append((time.time(), name, started))
            n += 1
            self.stop.wait(1.0)

    def running(self) -> list[Mark]:
        """The pipeline's runs in progress."""
        with self.lock:
            return [m for m in self.marks if m.kind == "run" and m.end is None]

    def routed(self, node: str, since: float = 0.0) -> bool | None:
        for t, nodes in reversed(self.routes):
            if t >= since and nodes is not None:
                return node in nodes
        return None

    def ledger_quarantined(self) -> dict[str, str]:
        from spark_pipelines.resources.ssh import FleetSession
        from spark_pipelines.runbook import quarantine

        with FleetSession(self.fleet) as s:
            return {n: q.summary() for n, q in quarantine.quarantined(s).items()}

    def held_out(self) -> dict[str, str]:
        """Nodes out of the gateway with a reason on the gateway host: the quarantine ledger, and
        the config's drain notes (a bench gate holding a node out says why there)."""
        from spark_pipelines.resources.gateway import GatewayHost
        from spark_pipelines.resources.ssh import FleetSession

        out = self.ledger_quarantined()
        with FleetSession(self.fleet) as s:
            for n, note in GatewayHost(s).read().drains.items():
                out.setdefault(n, f"drain note: {note}")
        return out

    # -- faults ------------------------------------------------------------------------------

    def _fault_when_free(self, kind: str, node: str | None) -> None:
        """A fault whose every candidate is busy with an earlier one waits (up to the largest gap);
        a planned one with plan_when_drained waits for a run to have its node out of the routes."""
        if node is not None and self.cfg.plan_when_drained:
            until = time.time() + self.cfg.plan_wait_s
            while time.time() < until and not (self.running() and self.routed(node) is False):
                time.sleep(0.5)
        deadline = time.time() + self.cfg.fault_gap_s[1]
        with self.lock:
            node = node or self.pick(kind)
        while node is None and time.time() < deadline:
            time.sleep(3)
            with self.lock:
                node = self.pick(kind)
        if node is None:
            self.log(f"  [{self.rel(time.time()):6.0f}] fault {kind}: no node free for it, skipped")
            return
        self._fault(kind, node)

    def _fault(self, kind: str, node: str) -> None:
        """Inject, hold, undo, then follow the node until it serves and is routed, or is quarantined."""
        spec = FAULTS[kind]
        m = Mark("fault", kind, node if spec.scope == "node" else "gateway", time.time())
        with self.lock:
            self.marks.append(m)
            self.reserved.discard(m.node)
        hold = self.rng.uniform(*spec.hold_s)
        self.log(f"  [{self.rel(m.start):6.0f}] fault {kind} on {m.node} for {hold:.0f} s")
        try:
            undo = spec.inject(self, node)
        except Exception as e:
            m.end, m.outcome, m.detail = time.time(), "not injected", f"{type(e).__name__}: {e}"[:300]
            self.log(f"    {kind}: not injected: {m.detail}")
            return
        time.sleep(hold)
        try:
            if undo:
                undo()
        except Exception as e:
            m.detail = f"undo raised {type(e).__name__}: {e}"[:300]
        m.end = time.time()
        self._settle(m, deadline=m.end + self.cfg.settle_s)

    def _settle(self, m: Mark, deadline: float) -> None:
        node = m.node
        while time.time() < deadline:
            now = time.time()
            if node == "gateway":
                if fx.proxy_ready(self.sim) and self.proxy_routes():
                    m.settled, m.outcome = now, "healed"
                    return
            else:
                first = next((t for t, n, v in self.verdicts if n == node and t >= m.start and v != "healthy"), None)
                m.detected = m.detected or first
                if m.out_at is None:
                    m.out_at = next((t for t, nodes in self.routes if t >= m.start and nodes is not None
                                     and node not in nodes), None)
                if engine_healthy(self.sim.node(node), timeout=2) and self.routed(node, since=now - 2):
                    m.settled, m.outcome = now, "healed"
                    return
                try:
                    held = self.ledger_quarantined()
                except Exception:
                    held = {}
                if node in held:
                    m.settled, m.outcome, m.detail = now, "quarantined", (m.detail + " " + held[node]).strip()
                    self.release(node, held[node])
                    # Released: the node is the sweep's again; follow it to serving.
                    m2 = Mark("action", "release", node, time.time(), detail=held[node][:200])
                    self.marks.append(m2)
                    m2.end = time.time()
                    continue_deadline = time.time() + self.cfg.settle_s
                    while time.time() < continue_deadline and not self.stop.is_set():
                        if engine_healthy(self.sim.node(node), timeout=2) and self.routed(node, time.time() - 2):
                            m.detail += f"; serving again {time.time() - m2.start:.0f} s after the release"
                            return
                        time.sleep(3)
                    m.detail += "; not serving again after the release"
                    return
            time.sleep(2)
        m.outcome = m.outcome or "unsettled"

    def release(self, node: str, why: str) -> None:
        """The operator: the fault's cause is gone (undone above), so the quarantine is ended."""
        self.log(f"  [{self.rel(time.time()):6.0f}] operator: {node} quarantined ({why[:120]}): releasing")
        self.sim.set_gpu(node, "healthy")
        self.run("release_quarantine_job", node, source="operator release")

    def busy_nodes(self) -> set[str]:
        return {m.node for m in list(self.marks) if m.kind == "fault" and m.settled is None
                and m.outcome != "not injected" and m.node}

    # -- operator actions ---------------------------------------------------------------------

    def action(self, what: str, i: int) -> None:
        m = Mark("action", what, None, time.time())
        with self.lock:
            self.marks.append(m)
        self.log(f"  [{self.rel(m.start):6.0f}] operator: {what}")
        if what == "rollout":
            level = LEVELS[(i + 1) % len(LEVELS)]
            self.edit_fleet(lambda d: d["launch"]["env"].__setitem__("VLLM_LOGGING_LEVEL", level))
            m.detail = f"launch env VLLM_LOGGING_LEVEL={level}; fleet file reloaded"
            # pins_changed asks for the rollout of the reloaded launch (the team's flow); the
            # operator launches it only when the sensor did not within three of its ticks.
            since, deadline = time.time(), time.time() + 6 * self.cfg.tick_s + 30
            r = None
            while time.time() < deadline and r is None:
                time.sleep(1)
                with self.lock:
                    r = next((x for x in self.marks if x.kind == "run" and x.name == "rollout_job"
                              and x.start >= since), None)
            if r is None:
                m.detail += "; pins_changed asked for no rollout: launched by the operator"
                r = self.run("rollout_job", source="operator rollout")
            while r.end is None:
                time.sleep(1)
            if not r.ok and "refused" in r.detail:
                # Refused with nothing changed (a node out): the operator launches it again once
                # every node serves, as a person reading the refusal would.
                self.wait_whole(self.cfg.settle_s)
                m.detail += "; refused, launched again by the operator once the fleet was whole"
                r = self.run("rollout_job", source="operator rollout (again)")
            m.ok = r.ok
        elif what == "bench":
            node = self.rng.choice([n for n in self.nodes if n not in self.busy_nodes()] or self.nodes)
            m.node = node
            m.ok = self.run("bench_job", node, source="operator bench").ok
        elif what == "add_node":
            m.node, m.ok = self.add_node(), None
            m.ok = self.run("add_node_job", m.node, source="operator add_node").ok
        elif what == "reload":
            backoff = 60 + 30 * (i % 3)
            self.edit_fleet(lambda d: d.setdefault("health", {}).__setitem__("backoff_s", backoff))
            m.detail, m.ok = f"health.backoff_s={backoff}; fleet file reloaded", True
        m.end = time.time()

    def add_node(self) -> str:
        """A GB10 joins: the simulator starts it, the operator adds it to the fleet file (as its
        neighbours are written) and reloads; add_node_job is the pipeline's."""
        member = self.sim.add_node()

        def add(d: dict[str, Any]) -> None:
            like = dict(next(n for n in d["nodes"] if n["name"] == self.nodes[-1]))
            like.update(name=member.name, host=member.ip, user=member.user, home=str(member.home),
                        hardware=member.hardware, roles=["serve"])
            d["nodes"].append(like)

        self.edit_fleet(add)
        from spark_pipelines.core.fleet import load_fleet

        self.fleet = load_fleet(self.path)
        with self.lock:
            self.nodes.append(member.name)
        return member.name

    # -- the soak ----------------------------------------------------------------------------

    def schedule(self) -> list[tuple[float, str, str | None]]:
        """(seconds from the start, 'fault:<kind>' | 'action:<what>', node) sorted; from the seed."""
        out: list[tuple[float, str, str | None]] = []
        if self.cfg.plan:
            out += [(at, f"fault:{kind}", node) for kind, node, at in self.cfg.plan]
        else:
            kinds = list(self.cfg.faults or FAULTS)
            t = self.rng.uniform(*self.cfg.fault_gap_s) / 2
            i = 0
            while t < self.cfg.duration_s:
                # Every kind once before any twice, in a seeded order: the catalogue is covered.
                if i % len(kinds) == 0:
                    order = kinds[:]
                    self.rng.shuffle(order)
                out.append((t, f"fault:{order[i % len(kinds)]}", None))
                t += self.rng.uniform(*self.cfg.fault_gap_s)
                i += 1
        t, i = self.cfg.first_action_s, 0
        while t < self.cfg.duration_s and self.cfg.actions:
            out.append((t, f"action:{self.cfg.actions[i % len(self.cfg.actions)]}", None))
            t += self.cfg.action_every_s
            i += 1
        return sorted(out)

    def run_soak(self) -> None:
        prepare(self)
        plan = self.schedule()
        self.log(f"soak: seed {self.cfg.seed}, {self.cfg.duration_s:.0f} s, {len(self.nodes)} nodes, "
                 f"{sum(1 for _, w, _ in plan if w.startswith('fault'))} faults and "
                 f"{sum(1 for _, w, _ in plan if w.startswith('action'))} operator actions planned")
        threads = [threading.Thread(target=self._automation, daemon=True, name="soak-sensors"),
                   threading.Thread(target=self._sampler, daemon=True, name="soak-samples")]
        with Traffic.through(self.sim, self.key, self.cfg.clients, max_tokens=self.cfg.max_tokens,
                             pause_s=self.cfg.pause_s) as traffic:
            self.t0 = time.time()
            for th in threads:
                th.start()
            workers: list[threading.Thread] = []
            actions = 0
            for at, what, node in plan:
                delay = self.t0 + at - time.time()
                if delay > 0:
                    time.sleep(delay)
                kind, name = what.split(":", 1)
                if kind == "action":
                    th = threading.Thread(target=self.action, args=(name, actions), daemon=True, name=f"soak-{name}")
                    actions += 1
                else:
                    th = threading.Thread(target=self._fault_when_free, args=(name, node), daemon=True,
                                          name=f"soak-{name}")
                th.start()
                workers.append(th)
                time.sleep(1)  # a fault's first mark before the next pick
            delay = self.t0 + self.cfg.duration_s - time.time()
            if delay > 0:
                time.sleep(delay)
            self.log(f"  [{self.rel(time.time()):6.0f}] duration over: waiting for faults to settle and runs to end")
            for th in workers:
                th.join(self.cfg.settle_s + 600)
            self.settle_end()
            self.stop.set()
            for th in threads:
                th.join(60)
        for f in self.futures:
            f.result(timeout=1200)
        self.pool.shutdown()
        self.requests = [request_row(s) for s in traffic.results()]
        self.t_end = time.time()

    def pick(self, kind: str) -> str | None:
        spec = FAULTS[kind]
        if spec.scope == "gateway":
            if "gateway" in self.busy_nodes() | self.reserved:
                return None
            self.reserved.add("gateway")
            return "gateway"
        busy = self.busy_nodes() | self.reserved
        # Half the nodes at most are faulted at once (one of two): the gateway's last backends are
        # the pipeline's to keep, not the chaos's to take.
        if len([n for n in self.nodes if n in busy]) >= max(1, len(self.nodes) // 2):
            return None
        free = [n for n in self.nodes if n not in busy and (spec.build_ok or n != self.fleet.build_node.name)]
        node = self.rng.choice(free) if free else None
        if node:
            self.reserved.add(node)  # until its fault's mark is in
        return node

    def settle_end(self) -> None:
        """After the last fault: the sweep gets settle_s to bring every node back (or hold it out)."""
        self.wait_whole(self.cfg.settle_s, held_ok=True)

    def wait_whole(self, seconds: float, held_ok: bool = False) -> bool:
        """Until every node serves and is routed (or, held_ok, is quarantined), up to `seconds`."""
        deadline = time.time() + seconds
        while time.time() < deadline:
            routes = self.proxy_routes() or []
            try:
                held = self.ledger_quarantined() if held_ok else {}
            except Exception:
                held = {}
            if all((n in routes and engine_healthy(self.sim.node(n))) or n in held for n in list(self.nodes)):
                return True
            time.sleep(5)
        return False

    # -- the checker -------------------------------------------------------------------------

    def check(self) -> dict[str, Any]:
        faults = [m for m in self.marks if m.kind == "fault"]
        runs = [m for m in self.marks if m.kind == "run"]
        causes: dict[str, int] = {}
        for r in self.requests:
            r["cause"] = classify(r, faults, runs, self.routes)
            causes[r["cause"].split(":")[0]] = causes.get(r["cause"].split(":")[0], 0) + 1
        samples = [(t, nodes) for t, nodes in self.routes if nodes is not None]
        empty = [round(self.rel(t), 1) for t, nodes in samples if not nodes]
        stale = stale_routes(self)
        replaced = replaced_while_routed(self)
        unanswered = sum(1 for _, nodes in self.routes if nodes is None)
        end = end_state(self)
        by_kind: dict[str, int] = {}
        for f in faults:
            if f.outcome != "not injected":
                by_kind[f.name] = by_kind.get(f.name, 0) + 1
        pipeline_failed = [r for r in self.requests if r["cause"].startswith(("pipeline", "unexplained"))]
        problems = []
        if pipeline_failed:
            problems.append(f"{len(pipeline_failed)} requests failed by the pipeline's own action or unexplained")
        if empty:
            problems.append(f"the proxy routed to no node in {len(empty)} samples (first at {empty[0]} s)")
        if stale:
            problems.append(f"the proxy routed to a node down longer than the sweep's detection time "
                            f"({detect_budget(self):.0f} s) in {len(stale)} samples (first: {stale[0]})")
        if replaced:
            problems.append(f"an engine was replaced while the proxy routed to its node, no fault on it: "
                            f"{'; '.join(replaced)}")
        problems += end["problems"]
        return {"seed": self.cfg.seed, "duration_s": round(self.t_end - self.t0), "nodes": self.nodes,
                "faults_by_kind": by_kind, "faults": len(faults), "requests": len(self.requests),
                "causes": causes, "route_samples": len(samples), "route_unanswered": unanswered,
                "empty_samples": empty, "stale_routes": stale, "replaced_while_routed": replaced, "detect_budget_s": round(detect_budget(self)), "end": end, "problems": problems,
                "verdict": "PASS" if not problems else "FAIL",
                "runs": {"ok": sum(1 for m in runs if m.ok), "failed": sum(1 for m in runs if m.ok is False)}}

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps({"t0": self.t0, "config": {k: v for k, v in asdict(self.cfg).items()},
                                    "marks": [asdict(m) for m in self.marks], "routes": self.routes,
                                    "health": self.health, "engines": self.engines, "verdicts": self.verdicts, "ticks": self.ticks,
                                    "requests": self.requests}, default=str))


def detect_budget(soak: Soak) -> float:
    """How long a dead node may stay routed: the sweeps that must agree, one more tick, and the
    reconcile run (its reload)."""
    return soak.cfg.tick_s * (soak.fleet.health.failed_sweeps + 1) + 45.0


def stale_routes(soak: Soak) -> list[str]:
    """Route samples naming a node whose /health had failed for longer than detect_budget."""
    budget, out = detect_budget(soak), []
    down_since: dict[str, float | None] = {}
    events = sorted([(t, "h", n, ok) for t, n, ok in soak.health] + [(t, "r", None, nodes) for t, nodes in soak.routes],
                    key=lambda e: e[0])
    for t, what, node, value in events:
        if what == "h":
            down_since[node] = None if value else (down_since.get(node) or t)
        elif value:
            for n in value:
                since = down_since.get(n)
                if since is not None and t - since > budget:
                    out.append(f"{n} at {soak.rel(t):.0f} s, down since {soak.rel(since):.0f} s")
    return out


def replaced_while_routed(soak: Soak) -> list[str]:
    """Engines replaced while the proxy routed to their node the whole time, with no fault on the
    node: the pipeline stopped a routed engine (every procedure that stops one drains it first).
    Read from the nodes and the proxy alone, so it holds whether or not a request failed then."""
    out = []
    faults = [m for m in soak.marks if m.kind == "fault" and m.outcome != "not injected"]
    for node in sorted({n for _, n, _ in soak.engines}):
        seen = [(t, started) for t, n, started in soak.engines if n == node]
        for (t1, old), (t2, new) in zip(seen, seen[1:]):
            if new == old:
                continue
            if any(f.node == node and f.start <= t2 and t1 <= (f.settled or f.end or time.time()) for f in faults):
                continue
            routed = [nodes for t, nodes in soak.routes if t1 <= t <= t2 and nodes is not None]
            if routed and all(node in nodes for nodes in routed):
                out.append(f"{node} between {soak.rel(t1):.0f} s and {soak.rel(t2):.0f} s "
                           f"({len(routed)} route samples, every one with it)")
    return out


def request_row(s: Any) -> dict[str, Any]:
    end = s.at + max(0.0, s.ended - s.started)
    return {"kind": s.kind, "node": s.node, "at": s.at, "end": end, "ok": not s.dropped, "error": s.error[:200],
            "resent": len(s.resent)}


def classify(r: dict[str, Any], faults: list[Mark], runs: list[Mark],
             routes: list[tuple[float, list[str] | None]] = ()) -> str:
    if r["ok"]:
        return "served"
    a, b = r["at"], r["end"]
    for f in faults:
        if f.outcome == "not injected":
            continue
        if f.node != "gateway" and r["node"] not in (None, f.node):
            continue
        # Blame: from the injection until the node left the routes or came back (the sweep saw it).
        # Never before it: the mark is taken before the injector acts, so a request that had failed
        # by then failed of something else (a run that stopped a routed node's engine just before).
        until = min(x for x in (f.out_at, f.settled, f.end and f.end + 60, time.time()) if x is not None)
        if f.start <= b and a <= until + SLACK_S:
            return f"fault:{f.name}"
    active = [m for m in runs if m.name in PIPELINE_JOBS and m.start - 2 <= b and a <= (m.end or time.time()) + 2]
    # The proxy's routes when it failed: only nodes under a fault not yet settled (or none)?
    seen = [nodes for t, nodes in routes if a - 2 <= t <= b + 1 and nodes is not None]
    for f in faults:
        # Taken out already, not back yet, while a run had the other nodes out: nothing was left to
        # serve because of the fault and the run together (two nodes: the canary out, the other dead).
        unsettled = {g.node for g in faults if g.start <= b and a <= (g.settled or time.time())}
        if (f.outcome != "not injected" and f.start <= b and a <= (f.settled or time.time()) and active
                and r["node"] in (None, f.node) and seen and all(set(n) <= unsettled for n in seen)):
            return f"compound:{f.name}+{active[0].name}"
    if active:
        return f"pipeline:{active[0].name}"
    return "unexplained"


def _failure(res: Any) -> str:
    for e in res.all_events:
        if e.is_step_failure:
            d = e.step_failure_data
            if d.user_failure_data and d.user_failure_data.description:
                return d.user_failure_data.description[:300]
            return f"{d.error.cls_name}: {d.error.message}"[:300] if d.error else "step failed"
    return "run failed"
