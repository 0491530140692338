"""The health sweep at scale, next to ansible, measured in the same run (issue 11, "Scale").

Brings up N light simulated nodes (spark_sim.light: a real sshd per loopback address, the sim's
GB10 nvidia-smi, the engine's /health and /metrics from the captures, a docker double), then per
round: the product's own sweep (runbook.sweep.sweep, a fresh session as `spark-pipelines doctor`
opens) with all nodes healthy and with 10% of them unreachable (their address drops packets), and
`ansible all -m raw -a "<the sweep's nvidia-smi query>" -f 50` over the same nodes and the same
unreachable ones, host keys checked against the light fleet's known_hosts, ssh ConnectTimeout equal
to the sweep's connect timeout. `-m raw` is one ssh exec per host, like the sweep's one command:
`-m command` would also measure ansible shipping a Python module to every host (tmp dir, copy,
interpreter start), a slower reference and a flattering ratio. ControlMaster=no: every round of
both is a cold connection. ansible-core lives in its own venv (scripts/bootstrap.sh ansible).

Targets: sweep < 3 s all healthy, < 10 s with 10 unreachable, sweep/ansible <= 0.5. Figures only;
the last line is the ratio. Run as root: `.venv/bin/python benchmarks/sweep_scale.py [--nodes 100]`.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.runbook import sweep
from spark_pipelines.runbook.preflight import GPU_QUERY
from spark_sim.layout import SimError
from spark_sim.light import LightFleet

ANSIBLE_VENV = Path(os.environ.get("SPARK_ANSIBLE_VENV", "/opt/spark-pipelines/ansible"))


def timed_sweep(fleet_path: Path) -> tuple[float, Counter[str]]:
    fleet = load_fleet(str(fleet_path))
    t = time.perf_counter()
    with sweep.open_session(fleet) as s:
        reports = sweep.sweep(s)
    return time.perf_counter() - t, Counter(r.verdict.verdict for r in reports.values())


def timed_ansible(light: LightFleet, forks: int) -> tuple[float, Counter[str]]:
    exe = ANSIBLE_VENV / "bin" / "ansible"
    if not exe.exists():
        raise SimError(f"{exe} is missing; run `scripts/bootstrap.sh ansible`")
    with tempfile.TemporaryDirectory(prefix="sweep-scale-ansible-") as home:
        env = {**os.environ, "ANSIBLE_HOST_KEY_CHECKING": "True", "ANSIBLE_TIMEOUT": f"{sweep.SSH_CONNECT_TIMEOUT_S:g}",
               "ANSIBLE_SSH_RETRIES": "0", "ANSIBLE_LOCAL_TEMP": home, "ANSIBLE_HOME": home,
               "ANSIBLE_SSH_ARGS": f"-o ControlMaster=no -o UserKnownHostsFile={light.known_hosts} "
                                   "-o StrictHostKeyChecking=yes -o GlobalKnownHostsFile=/dev/null",
               "ANSIBLE_STDOUT_CALLBACK": "oneline", "ANSIBLE_LOAD_CALLBACK_PLUGINS": "1"}
        argv = [str(exe), "all", "-i", str(light.inventory_path), "-m", "raw", "-a", " ".join(GPU_QUERY),
                "-f", str(forks)]
        t = time.perf_counter()
        p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
        seconds = time.perf_counter() - t
    outcome: Counter[str] = Counter()
    for line in p.stdout.splitlines():
        if " | " in line:
            word = line.split(" | ", 1)[1].split()[0].lower().rstrip("!:")
            outcome["ok" if word in ("changed", "success") else word] += 1
    return seconds, outcome


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=100)
    ap.add_argument("--unreachable", type=int, default=None, help="default: a tenth of the nodes (at least 1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--forks", type=int, default=50)
    args = ap.parse_args(argv)
    cut_count = args.unreachable if args.unreachable is not None else max(1, args.nodes // 10)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # teardown runs on SIGTERM too (Ctrl-C: KeyboardInterrupt)
    light = LightFleet(args.nodes, slot=int(os.environ.get("SPARK_SIM_SLOT", "20")))
    rows: dict[str, list[float]] = {"sweep, all healthy": [], "sweep, unreachable": [],
                                    "ansible, all healthy": [], "ansible, unreachable": []}
    seen: dict[str, Counter[str]] = {}
    try:
        t = time.perf_counter()
        light.up()
        print(f"{args.nodes} light nodes up in {time.perf_counter() - t:.1f} s; load {os.getloadavg()[0]:.2f}")
        step = max(1, args.nodes // cut_count)
        cut = [m.name for m in light.members[step - 1::step]][:cut_count]
        for _ in range(args.rounds):
            light.mend()
            for label, run in (("sweep, all healthy", lambda: timed_sweep(light.fleet_path)),
                               ("ansible, all healthy", lambda: timed_ansible(light, args.forks))):
                s, c = run()
                rows[label].append(s)
                seen[label] = c
            light.cut(cut)
            for label, run in (("sweep, unreachable", lambda: timed_sweep(light.fleet_path)),
                               ("ansible, unreachable", lambda: timed_ansible(light, args.forks))):
                s, c = run()
                rows[label].append(s)
                seen[label] = c
    except SimError as e:
        print(f"sweep_scale: {e}", file=sys.stderr)
        return 1
    finally:
        light.down()
    print(f"\n{args.nodes} nodes, {cut_count} unreachable, {args.rounds} rounds, ansible -m raw -f {args.forks}, "
          f"connect timeout {sweep.SSH_CONNECT_TIMEOUT_S:g} s; load after {os.getloadavg()[0]:.2f} (2 cores shared)")
    print(f"{'':24} {'median s':>9} {'min s':>7} {'max s':>7}  outcome")
    for label, xs in rows.items():
        print(f"{label:24} {statistics.median(xs):9.2f} {min(xs):7.2f} {max(xs):7.2f}  {dict(seen[label])}")
    healthy = statistics.median(rows["sweep, all healthy"]) / statistics.median(rows["ansible, all healthy"])
    dead = statistics.median(rows["sweep, unreachable"]) / statistics.median(rows["ansible, unreachable"])
    print(f"ratio sweep/ansible all healthy {healthy:.2f}, with unreachable {dead:.2f} (goal <= 0.5)")
    print(f"ratio {max(healthy, dead):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
