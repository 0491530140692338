"""The quality phase's run time per node and its noise over repeated runs on the same node.

    .venv/bin/python benchmarks/quality_noise.py [--repeats 5] [--real-vllm]

Starts the vLLM stand-in at the runbook's pace (52 tok/s, MTP-2, reasoning parser) and runs the
quality suite (core/quality.py: sequential, then 4 at once) `--repeats` times on it; with
--real-vllm, the same against a real vLLM CPU server (tiny random-weight Llama, no tool-call
parser: the phase is reported, not crashed). Prints per run: score of each pass and seconds; then
the noise (mean +- sd, range) and how many runs per side an honest verdict needs for a drop of
the fleet's quality_noise (core.quality.repeats_needed), beside the runbook's tool-eval-bench
repeats (60/73/80/80/87, sd 10.2).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from spark_pipelines.core import quality
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.resources import bench_client
from spark_sim.servers import MANDATORY_ENV, StandinFactory, make_tiny_model, start_real_vllm

RUNBOOK_SCORES = (73, 60, 80, 87, 80)  # tool-eval-bench --short, same configs repeated (runbook)


def measure(name: str, base_url: str, model: str, repeats: int, noise_band: float) -> None:
    scores, seconds = [], []
    for i in range(repeats):
        t0 = time.monotonic()
        q = bench_client.run_quality(base_url, model, max_s=600)
        took = time.monotonic() - t0
        seconds.append(took)
        scores.append(q.score if q.score is not None else 0.0)
        print(f"{name} run {i + 1}: " + ", ".join(f"{r.mode} {r.score:g}/100 {r.seconds:.1f} s" for r in q.runs)
              + f"; phase {took:.1f} s; failed checks: {', '.join(q.failed_checks()) or 'none'}")
    n = quality.noise_of(scores)
    print(f"{name}: phase time per node {min(seconds):.1f}-{max(seconds):.1f} s; score {n.text()}; "
          f"runs per side to judge a {noise_band:g}-point drop honestly: {quality.repeats_needed(n.sd, noise_band)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--real-vllm", action="store_true")
    args = ap.parse_args()
    band = load_fleet("fleets/seed.yaml").bench.quality_noise
    root = Path(tempfile.mkdtemp(prefix="quality-noise-"))
    factory = StandinFactory(root)
    try:
        s = factory(env=dict(MANDATORY_ENV))
        measure("stand-in (52 tok/s)", s.base_url, s.model, args.repeats, band)
    finally:
        factory.stop_all()
    if args.real_vllm:
        served = start_real_vllm(make_tiny_model(root / "tiny"), root / "vllm.log")
        try:
            measure("real vLLM CPU (tiny)", served.base_url, served.model, args.repeats, band)
        finally:
            served.stop()
    rb = quality.noise_of(RUNBOOK_SCORES)
    print(f"runbook tool-eval-bench --short repeats: {rb.text()}; runs per side for a {band:g}-point drop: "
          f"{quality.repeats_needed(rb.sd, band)}, for 10 points: {quality.repeats_needed(rb.sd, 10)}")


if __name__ == "__main__":
    main()
