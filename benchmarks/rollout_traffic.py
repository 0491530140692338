"""Client requests through the gateway while rollout_job rolls a new launch spec out to 4 nodes.

    .venv/bin/python benchmarks/rollout_traffic.py [--rollouts 3] [--nodes 4] [--tokens 64] [--keep]

Brings up a simulated fleet (SPARK_SIM_SLOT / SPARK_SIM_ROOT, default slot 22,
/var/lib/spark-sim-bench-rollout; the stand-in at 1000 tok/s so that a bench takes seconds), runs
the chain on a throwaway Dagster instance (build, deploy each node, gateway, bench each node: the
fleet's baseline), then `--rollouts` rollouts of a new launch spec each (VLLM_LOGGING_LEVEL
changes), one after another. During each rollout clients send streaming requests (--tokens long,
0.2 s apart) back to back
through the gateway (the front, then LiteLLM): 2 on pooled keep-alive connections that never
resend (httpx), 2 on a fresh connection each, and 2 through the OpenAI SDK's default client when it
is installed (`.[test]`).

Figures per rollout and in all: requests sent and failed per client kind (and the SDK's own
resends); requests served by a node's new version before its gate promoted it (the client saw the
node's address in `x-litellm-model-api-base`, and the response head arrived after the new container
started and before its bench logged "restore <node>: <verdict>"; a request sent earlier that waited
in LiteLLM's queue and was routed after the verdict is not one); and samples of the running proxy's
routes (/model/info, every 0.1 s) listing a node in that same interval. Goal: 0 and 0.
The audit before these changes (issue 34): 15 of 556 requests failed in one 4-node rollout, and
every node's new version was routed for 1.5-6.5 s before its gate.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import dagster as dg
import yaml

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.core.launch import launch_spec
from spark_pipelines.definitions import build_definitions
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_sim.fleet import SimFleet
from spark_sim.traffic import FRESH, KINDS, OPENAI, POOLED, Traffic

LEVELS = ("INFO", "DEBUG", "WARNING", "ERROR", "CRITICAL")


def run(defs: dg.Definitions, instance: dg.DagsterInstance, job: str, partition: str | None = None):
    res = defs.resolve_job_def(job).execute_in_process(instance=instance, partition_key=partition,
                                                       raise_on_error=False)
    if not res.success:
        failure = next((e for e in res.all_events if e.is_step_failure), None)
        why = failure.step_failure_data.user_failure_data.description if failure and failure.step_failure_data \
            and failure.step_failure_data.user_failure_data else "see the run's events"
        raise SystemExit(f"{job}{' ' + partition if partition else ''} failed: {why}")
    return res


class Routes:
    """The running proxy's routes every 0.1 s: (wall clock, nodes)."""

    def __init__(self, fleet) -> None:
        self.fleet, self.seen, self._stop = fleet, [], threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with FleetSession(self.fleet) as s:
            gw = GatewayHost(s)
            while not self._stop.wait(0.1):
                try:
                    self.seen.append((time.time(), set(gw.serving_nodes())))
                except Exception:  # a reload in progress: no sample
                    pass

    def __enter__(self) -> Routes:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(10)


def started_at(sim: SimFleet, node: str, container: str) -> float:
    env = {**os.environ, "DOCKER_HOST": sim.node(node).docker_host}
    out = subprocess.run(["docker", "inspect", "--format", "{{json .State.StartedAt}}", container],
                         capture_output=True, text=True, env=env, timeout=60, check=True).stdout
    stamp = json.loads(out)[:26].rstrip("Z")  # RFC 3339 with nanoseconds: microseconds are enough
    return dt.datetime.fromisoformat(stamp).replace(tzinfo=dt.timezone.utc).timestamp()


def gate_promoted(instance: dg.DagsterInstance, run_id: str) -> dict[str, float]:
    """node -> when its bench gate promoted it: the bench's "restore <node>: <verdict>" line,
    logged once the gate judged and before the node is put back in the gateway."""
    out: dict[str, float] = {}
    for entry in instance.all_logs(run_id):
        words = (entry.user_message or "").split(" ", 2)
        if len(words) == 3 and words[0] == "restore" and words[1].endswith(":"):
            out[words[1][:-1]] = entry.timestamp
    return out


def one_rollout(i: int, sim: SimFleet, base: str, work: Path, instance: dg.DagsterInstance, key: str,
                kinds: dict[str, int], tokens: int) -> dict[str, int]:
    doc = yaml.safe_load(Path(base).read_text())
    doc["launch"]["env"] = {**doc["launch"]["env"], "VLLM_LOGGING_LEVEL": LEVELS[i % len(LEVELS)]}
    path = work / f"fleet-rollout-{i + 1}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    fleet = load_fleet(path)
    t0 = time.monotonic()
    with Routes(fleet) as routes, Traffic.through(sim, key, kinds, max_tokens=tokens, pause_s=0.2) as traffic:
        time.sleep(2)
        res = run(build_definitions(str(path)), instance, "rollout_job")
    took = time.monotonic() - t0
    outcome = res.asset_materializations_for_node("fleet_rollout")[-1].metadata["outcome"].value
    promoted = gate_promoted(instance, res.run_id)
    early_requests = early_samples = 0
    for n in fleet.serve_nodes:
        new_since = started_at(sim, n.name, launch_spec(fleet, n).container_name)
        until = promoted.get(n.name)
        if until is None:
            print(f"  {n.name}: its bench never promoted it in run {res.run_id[:8]} ({outcome})")
            continue
        early = [s for s in traffic.results() if s.node == n.name and new_since <= s.head_at < until]
        for s in early:
            print(f"  {n.name} served a request before its gate: sent {s.at - new_since:+.2f} s after its new "
                  f"container started, answered {until - s.head_at:.2f} s before its verdict ({s.kind})")
        early_requests += len(early)
        early_samples += sum(1 for t, nodes in routes.seen if n.name in nodes and new_since <= t < until)
    figures = {f"{k} sent": len(traffic.results(k)) for k in kinds}
    figures.update({f"{k} failed": len(traffic.failed(k)) for k in kinds})
    if OPENAI in kinds:
        figures["openai resent"] = len(traffic.resent(OPENAI))
    figures.update({"served before gate": early_requests, "routed before gate (samples)": early_samples})
    print(f"rollout {i + 1} ({took:.0f} s, {outcome}): " + ", ".join(f"{k} {v}" for k, v in figures.items()),
          flush=True)
    for line in traffic.failed()[:10]:
        print(f"  failed: {line}")
    return figures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rollouts", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per client request (streamed)")
    ap.add_argument("--keep", action="store_true", help="leave the simulated fleet up afterwards")
    args = ap.parse_args()
    os.environ.setdefault("SPARK_SIM_SLOT", "22")
    os.environ.setdefault("SPARK_SIM_ROOT", "/var/lib/spark-sim-bench-rollout")
    os.environ.setdefault("LITELLM_MASTER_KEY", "sk-bench-" + secrets.token_urlsafe(12))
    key = os.environ["LITELLM_MASTER_KEY"]
    kinds = {POOLED: 2, FRESH: 2}
    try:
        import openai  # noqa: F401 - the test extra

        kinds[OPENAI] = 2
    except ImportError:
        print("the OpenAI SDK is not installed (.venv/bin/pip install -e '.[test]'): its clients are left out")
    sim = SimFleet()
    sim.down()
    t0 = time.monotonic()
    path = str(sim.up(nodes=args.nodes, fleet_out=sim.layout.root.parent / f"{sim.layout.root.name}.yaml",
                      tokens_per_second=1000))
    print(f"sim up: {args.nodes} nodes + gateway in {time.monotonic() - t0:.0f} s", flush=True)
    totals: dict[str, int] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            (work / "dagster").mkdir()
            instance = dg.DagsterInstance.local_temp(str(work / "dagster"))
            try:
                defs = build_definitions(path)
                t0 = time.monotonic()
                run(defs, instance, "build_job")
                nodes = [n.name for n in load_fleet(path).serve_nodes]
                for n in nodes:
                    run(defs, instance, "deploy_node_job", n)
                run(defs, instance, "gateway_job")
                for n in nodes:
                    run(defs, instance, "bench_job", n)
                print(f"chain (build, {len(nodes)} deploys, gateway, {len(nodes)} benches): "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
                for i in range(args.rollouts):
                    for k, v in one_rollout(i, sim, path, work, instance, key, kinds, args.tokens).items():
                        totals[k] = totals.get(k, 0) + v
            finally:
                instance.dispose()
    finally:
        if not args.keep:
            sim.down()
    order = [f"{k} {what}" for k in KINDS if k in kinds for what in ("sent", "failed")]
    print(f"all {args.rollouts} rollouts of {args.nodes} nodes: "
          + ", ".join(f"{k} {totals.get(k, 0)}" for k in [*order, "openai resent", "served before gate",
                                                          "routed before gate (samples)"] if k in totals))
    bad = sum(v for k, v in totals.items() if k.endswith(("failed", "before gate", "(samples)")))
    print("goal (0 failed, 0 before a gate): " + ("met" if bad == 0 else "NOT met"))
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
