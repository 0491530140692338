"""Drain and restore a node while clients stream through the real LiteLLM proxy: today's restart
vs the graceful reload.

    .venv/bin/python benchmarks/gateway_drain.py [--rounds 3] [--streams 8] [--tokens 1000]

Brings up a simulated fleet (2 nodes + the gateway host) in SPARK_SIM_SLOT / SPARK_SIM_ROOT
(default slot 22, /var/lib/spark-sim-bench-gateway), the vLLM stand-in on both nodes at the
runbook's 52 tok/s, and both nodes in the gateway. For each reload mode (restart: the runbook's
`docker compose restart litellm`, here `litellm-restart`, which stops the proxy as compose does:
SIGTERM, 10 s, SIGKILL; graceful: SIGHUP to the proxy's gunicorn master), each round:
--streams streams of --tokens tokens start through the gateway (routing: simple-shuffle, two more
until both nodes carry one: spark_sim.traffic); then spark2 is drained (GatewayHost.drain, confirmed
on the proxy's /model/info), then restored (confirmed likewise); then every stream's end is read.

Figures per mode: streams in flight on spark1 (the node that stays) and how many of them were
dropped, all streams dropped, and the drain-to-drained latency (from the drain call to the
proxy confirmed without spark2, SSH and the config write included) and the restore's. The last
line compares the two modes (goal: 0 dropped, drain under 1 s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_sim.fleet import SimFleet
from spark_sim.traffic import engines_on, on_every_engine, traffic_fleet

PORT = 18000


def one_round(host: GatewayHost, engines, key: str, n: int, tokens: int):
    streams = on_every_engine(host.base_url, key, engines, max_tokens=tokens, first=n)
    t0 = time.monotonic()
    host.drain("spark2", "benchmark drain")
    drain_s = time.monotonic() - t0
    t1 = time.monotonic()
    host.restore("spark2")
    restore_s = time.monotonic() - t1
    return drain_s, restore_s, streams.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8, help="streams in flight per round (even)")
    ap.add_argument("--tokens", type=int, default=1000, help="tokens per stream (~19 s at 52 tok/s)")
    ap.add_argument("--keep", action="store_true", help="leave the simulated fleet up afterwards")
    args = ap.parse_args()
    os.environ.setdefault("SPARK_SIM_SLOT", "22")
    os.environ.setdefault("SPARK_SIM_ROOT", "/var/lib/spark-sim-bench-gateway")
    os.environ.setdefault("LITELLM_MASTER_KEY", "sk-bench-" + os.urandom(12).hex())
    key = os.environ["LITELLM_MASTER_KEY"]
    sim = SimFleet()
    sim.down()
    t0 = time.monotonic()
    sim.up(nodes=2, fleet_out=sim.layout.root.parent / f"{sim.layout.root.name}.yaml")
    print(f"sim up: 2 nodes + gateway in {time.monotonic() - t0:.1f} s")
    figures: dict[str, tuple[float, float, int, int, int]] = {}
    try:
        with tempfile.TemporaryDirectory() as work, \
                engines_on(sim, PORT, traffic_fleet(sim, PORT).launch.served_model_name, Path(work)) as engines:
            for mode in ("restart", "graceful"):
                fleet = traffic_fleet(sim, PORT, mode)
                with FleetSession(fleet) as s:
                    host = GatewayHost(s, master_key=key, poll_s=0.5)
                    host.set_rotation(["spark1", "spark2"])
                    drains, restores, on1, dropped1, dropped = [], [], 0, 0, 0
                    for i in range(args.rounds):
                        d, r, results = one_round(host, engines, key, args.streams, args.tokens)
                        drains.append(d)
                        restores.append(r)
                        mine = [x for x in results if x.node == "spark1"]
                        lost = [x for x in results if x.dropped]
                        on1 += len(mine)
                        dropped1 += sum(x.dropped for x in mine)
                        dropped += len(lost)
                        print(f"{mode:8s} round {i + 1}: drain {d:5.2f} s  restore {r:5.2f} s  streams {len(results)} "
                              f"(spark1 {len(mine)}), dropped {len(lost)} (spark1 {sum(x.dropped for x in mine)})"
                              + (f"  e.g. {lost[0].error[:80]}" if lost else ""))
                    figures[mode] = (statistics.median(drains), statistics.median(restores), on1, dropped1, dropped)
                    print(f"{mode:8s}: streams in flight on spark1 {on1}, dropped {dropped1}; all streams dropped "
                          f"{dropped}; drain-to-drained median {figures[mode][0]:.2f} s, restore {figures[mode][1]:.2f} s")
    finally:
        if not args.keep:
            sim.down()
    rs, gr = figures["restart"], figures["graceful"]
    print(f"spark1's streams dropped while spark2 was drained and restored: restart {rs[3]}/{rs[2]} vs graceful "
          f"{gr[3]}/{gr[2]}; drain-to-drained: restart {rs[0]:.2f} s vs graceful {gr[0]:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
