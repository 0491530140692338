"""First contact, timed: `adopt --check` and `adopt` on a fleet built by hand, 2 and 8 nodes.

    .venv/bin/python benchmarks/adoption.py [--nodes 2 8] [--keep]

For each size: a simulated fleet (SPARK_SIM_SLOT / SPARK_SIM_ROOT, default slot 23,
/var/lib/spark-sim-bench-adopt) brought to the runbook's hand-run state by `spark_sim.hand`
(the recipe's scripts, `docker run` without labels, the six hand LiteLLM entries), then, with a
client streaming through the gateway all along:
  1. `adopt --check` (the survey, touching nothing),
  2. `adopt` (adopt_job on a throwaway Dagster instance): markers, manifests, the gateway taken over,
  3. `adopt` again (every step current: the cost of a rerun).
Figures per size: the seconds of each, container restarts (ids before vs after), checkpoint files
rewritten (inode/mtime/size), image ids changed, the heavy commands the tool ran by kind (its
command log: rsync, docker save/load/build, docker run -d; `docker run --rm` are adoption's
throwaway readers and seals), client requests sent / failed. The reference is the hand build of the
same fleet in the same run (what a rebuild-and-redeploy would have to redo at the least).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spark_pipelines.cli import adopt as adopt_command
from spark_pipelines.resources.ssh import read_command_log
from spark_sim.fleet import SimFleet
from spark_sim.hand import build_by_hand
from spark_sim.traffic import Clients

# What would rebuild, copy or relaunch. Adoption's own throwaway containers (`docker run --rm`:
# reading an image's torch triple, sealing a root-owned JIT cache) are counted apart.
HEAVY = ("rsync ", "docker save", "docker load", "docker build", "install.sh", "hf download", "docker run -d",
         "docker run --rm")


def _docker(sim: SimFleet, node: str, *args: str) -> str:
    env = {**os.environ, "DOCKER_HOST": sim.node(node).docker_host}
    return subprocess.run(["docker", *args], capture_output=True, text=True, env=env, timeout=60).stdout.strip()


def _files(sim: SimFleet, node: str) -> dict[str, tuple[int, int, int]]:
    d = sim.node(node).home / "models" / "qwen35-122b-hybrid-int4fp8"
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size) for p in d.iterdir() if p.is_file()}


def _snapshot(sim: SimFleet) -> dict[str, tuple]:
    return {m.name: (_docker(sim, m.name, "inspect", "--format", "{{.Id}}", "vllm-qwen35-v2"),
                     _docker(sim, m.name, "image", "inspect", "--format", "{{.Id}}", "vllm-qwen35-v2"),
                     _files(sim, m.name)) for m in sim.nodes}


def one_size(n: int, work: Path) -> dict[str, object]:
    sim = SimFleet()
    sim.down()
    t0 = time.monotonic()
    sim.up(nodes=n, fleet_out=work / f"fleet-{n}.yaml", tokens_per_second=1000)
    up_s = time.monotonic() - t0
    try:
        t0 = time.monotonic()
        build_by_hand(sim)
        hand_s = time.monotonic() - t0
        fleet = str(sim.fleet_file)
        log = work / f"commands-{n}.jsonl"
        os.environ["SPARK_COMMAND_LOG"] = str(log)
        os.environ["DAGSTER_HOME"] = str(work / f"dagster-{n}")
        before = _snapshot(sim)
        with Clients(sim, os.environ["LITELLM_MASTER_KEY"], every_s=0.5, max_tokens=32) as clients:
            t0 = time.monotonic()
            findings = adopt_command.check(fleet)
            check_s = time.monotonic() - t0
            t0 = time.monotonic()
            ok, adopted, failure = adopt_command.adopt(fleet)
            adopt_s = time.monotonic() - t0
            t0 = time.monotonic()
            ok2, again, failure2 = adopt_command.adopt(fleet)
            again_s = time.monotonic() - t0
        after = _snapshot(sim)
        heavy: dict[str, int] = {}
        for r in read_command_log(log) if log.exists() else []:
            line = " ".join(r.argv)
            if line.startswith("find "):
                continue
            for h in HEAVY:
                if h in line:
                    heavy[h] = heavy.get(h, 0) + 1
        results = clients.streams.results
        return {
            "nodes": n, "sim_up_s": round(up_s, 1), "hand_build_s": round(hand_s, 1),
            "check_s": round(check_s, 1), "adopt_s": round(adopt_s, 1), "adopt_again_s": round(again_s, 1),
            "adopt_ok": ok and ok2, "failure": "" if ok and ok2 else (failure if not ok else failure2),
            "would": sorted({f.action for f in findings}),
            "current_after_rerun": all(f.action == "current" for f in again),
            "container_restarts": sum(before[k][0] != after[k][0] for k in before),
            "images_changed": sum(before[k][1] != after[k][1] for k in before),
            "checkpoint_files_rewritten": sum(1 for k in before for f, st in before[k][2].items() if after[k][2].get(f) != st),
            "heavy_commands": heavy,
            "client_requests": len(results), "client_failed": sum(1 for r in results if r.dropped),
        }
    finally:
        os.environ.pop("SPARK_COMMAND_LOG", None)
        sim.down()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--keep-work", action="store_true", help="keep the command logs and instances")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("benchmarks/adoption.py: run as root (the simulated fleet needs namespaces and users)", file=sys.stderr)
        return 2
    os.environ.setdefault("SPARK_SIM_SLOT", "23")
    os.environ.setdefault("SPARK_SIM_ROOT", "/var/lib/spark-sim-bench-adopt")
    os.environ.setdefault("LITELLM_MASTER_KEY", "sk-bench-" + secrets.token_hex(12))
    rows = []
    work = Path(tempfile.mkdtemp(prefix="adopt-bench-"))
    for n in args.nodes:
        row = one_size(n, work)
        rows.append(row)
        print(json.dumps(row))
        print(f"{n} nodes: hand build {row['hand_build_s']} s; adopt --check {row['check_s']} s, adopt "
              f"{row['adopt_s']} s, again {row['adopt_again_s']} s ({row['adopt_s'] / row['hand_build_s']:.2f} of the "
              f"hand build); restarts {row['container_restarts']}, images changed {row['images_changed']}, "
              f"checkpoint files rewritten {row['checkpoint_files_rewritten']}, heavy commands {row['heavy_commands']}; "
              f"client requests {row['client_requests']}, failed {row['client_failed']}", flush=True)
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        print(f"adopt {b['nodes']} vs {a['nodes']} nodes: {b['adopt_s'] / a['adopt_s']:.2f}x the time for "
              f"{b['nodes'] / a['nodes']:.0f}x the nodes")
    if not args.keep_work:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0 if all(r["adopt_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
