"""Our bench harness side by side with `vllm bench serve`, and against a stand-in of known pace.

    .venv/bin/python benchmarks/bench_vs_vllm.py [--prompts 64] [--concurrency 8] [--output-len 128]

1. Starts a real vLLM (CPU, tiny random-weight Llama) on 127.0.0.1. Runs the same load with both
   clients, alternating (ours, theirs, ours, theirs): N requests, C at once, fixed output length
   (ignore_eos), temperature 0, streaming chat completions. Each client runs in its own process
   on cores apart from the server's (a CPU-bound server sharing a core would run slower under
   the heavier client). CPU is read with getrusage (whole process) and time.process_time around
   the benchmark call itself (which leaves out interpreter and import start-up: vLLM's import
   alone costs seconds).
   Prints our output tok/s over theirs (should agree within 3%) and our client CPU seconds per
   1,000 streamed tokens over theirs (target <= 1.0).
2. Starts the vLLM stand-in at a known pace and measures it at 1, 8, 64 and 256 concurrent
   streams: measured decode rate / configured rate.
Figures are printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spark_sim.servers import (  # the same launchers the tests use
    MANDATORY_ENV,
    TINY_MODEL_NAME,
    VLLM_PYTHON,
    StandinFactory,
    loopback_env,
    make_tiny_model,
    start_real_vllm,
)

OUR_PYTHON = sys.executable

# Runs in a child process so its CPU is measured apart from this script's.
OURS = r"""
import json, sys, time
from spark_pipelines.resources import bench_client
base, model, n, c, out_len, result = sys.argv[1:7]
t0 = time.process_time()
report = bench_client.run_bench(base, model, "loaded", int(c), 1, loaded_requests=int(n),
                                loaded_max_tokens=int(out_len), ignore_eos=True)
cpu = time.process_time() - t0
ph = report.phases[0]
json.dump({"output_tok_s": ph.aggregate_tok_s.median, "cpu_in_call": cpu,
           "tokens": report.counters.client_completion_tokens if report.counters else None,
           "server_tokens": report.counters.generation_tokens if report.counters else None,
           "failures": report.failures}, open(result, "w"))
"""

THEIRS = r"""
import json, sys, time
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
parser = FlexibleArgumentParser()
add_cli_args(parser)
result = sys.argv[1]
args = parser.parse_args(sys.argv[2:])
t0 = time.process_time()
out = main(args)
cpu = time.process_time() - t0
json.dump({"output_tok_s": out["output_throughput"], "cpu_in_call": cpu,
           "tokens": out["total_output_tokens"], "completed": out["completed"]}, open(result, "w"))
"""


# A CPU-bound server sharing cores with the client runs slower under a heavier client, which
# would turn a client's CPU cost into a throughput "difference". With two or more cores the
# server gets core 0 and every client the rest, so the server's pace is the same for both.
CORES = sorted(os.sched_getaffinity(0))
SERVER_CORES = CORES[:1] if len(CORES) >= 2 else CORES
CLIENT_CORES = CORES[1:] if len(CORES) >= 2 else CORES


def pinned(argv: list[str], cores: list[int]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cores)), *argv]


def run_child(argv: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run argv to completion on the client cores: (wall seconds, CPU seconds user+sys)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(pinned(argv, CLIENT_CORES), env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{argv[:3]} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def compare_clients(args: argparse.Namespace, work: Path, base: str, model: str,
                    tokenizer: Path, label: str) -> dict[str, object]:
    """Alternate ours / theirs on the same server and load; medians and a verdict."""
    ours_env = loopback_env()
    theirs_env = loopback_env()
    rows: dict[str, list[dict[str, float]]] = {"ours": [], "theirs": []}
    slug = "".join(ch if ch.isalnum() else "-" for ch in label)
    for i in range(args.rounds):
        res = work / f"{slug}-ours-{i}.json"
        wall, cpu = run_child([OUR_PYTHON, "-c", OURS, base, model, str(args.prompts),
                               str(args.concurrency), str(args.output_len), str(res)], ours_env)
        r = json.loads(res.read_text())
        assert not r["failures"], r["failures"]
        r.update(wall=wall, cpu_process=cpu)
        rows["ours"].append(r)
        print(f"  [{label}] ours   round {i + 1}: {r['output_tok_s']:.1f} tok/s, {r['tokens']} "
              f"tokens (server counted {r['server_tokens']:.0f}), CPU in call "
              f"{r['cpu_in_call']:.2f} s, process {cpu:.2f} s", flush=True)
        res = work / f"{slug}-theirs-{i}.json"
        wall, cpu = run_child(
            [str(VLLM_PYTHON), "-c", THEIRS, str(res), "--backend", "openai-chat",
             "--endpoint", "/v1/chat/completions", "--base-url", base,
             "--model", model, "--tokenizer", str(tokenizer),
             "--dataset-name", "random", "--random-input-len", str(args.input_len),
             "--random-output-len", str(args.output_len), "--num-prompts", str(args.prompts),
             "--max-concurrency", str(args.concurrency), "--ignore-eos",
             "--temperature", "0", "--disable-tqdm", "--num-warmups", "0",
             "--ready-check-timeout-sec", "0"], theirs_env)
        r = json.loads(res.read_text())
        r.update(wall=wall, cpu_process=cpu)
        rows["theirs"].append(r)
        print(f"  [{label}] theirs round {i + 1}: {r['output_tok_s']:.1f} tok/s, {r['tokens']} "
              f"tokens, CPU in call {r['cpu_in_call']:.2f} s, process {cpu:.2f} s", flush=True)

    def med(side: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[side])

    def per_k(side: str, key: str) -> float:
        return statistics.median(r[key] / (r["tokens"] / 1000) for r in rows[side])

    from spark_pipelines.core.bench import Spread, compare

    verdict = compare(Spread.of(r["output_tok_s"] for r in rows["ours"]),
                      Spread.of(r["output_tok_s"] for r in rows["theirs"]),
                      names=("ours", "vllm bench serve"), noise_floor=0.03)
    pair_ratios = [o["output_tok_s"] / t["output_tok_s"] for o, t in zip(rows["ours"], rows["theirs"])]
    return {
        "label": label,
        "verdict": verdict.text,
        "pair_ratio_median": statistics.median(pair_ratios),
        "pair_ratio_min": min(pair_ratios),
        "pair_ratio_max": max(pair_ratios),
        "ours_tok_s": med("ours", "output_tok_s"),
        "theirs_tok_s": med("theirs", "output_tok_s"),
        "ours_cpu_per_k_call": per_k("ours", "cpu_in_call"),
        "theirs_cpu_per_k_call": per_k("theirs", "cpu_in_call"),
        "ours_cpu_per_k_process": per_k("ours", "cpu_process"),
        "theirs_cpu_per_k_process": per_k("theirs", "cpu_process"),
    }


def make_tiny(work: Path) -> Path:
    model_dir = work / "tiny"
    return model_dir if model_dir.exists() else make_tiny_model(model_dir)


def real_vllm_comparison(args: argparse.Namespace, work: Path) -> dict[str, object]:
    model_dir = make_tiny(work)
    print("starting vLLM (CPU) ...", flush=True)
    served = start_real_vllm(model_dir, work / "vllm.log", timeout=400,
                             wrap=lambda argv: pinned(argv, SERVER_CORES))
    print(f"vLLM (CPU) answers on {served.base_url}", flush=True)
    try:
        return compare_clients(args, work, served.base_url, TINY_MODEL_NAME, model_dir, "real vLLM")
    finally:
        served.stop()


def standin_comparison(args: argparse.Namespace, work: Path) -> dict[str, object]:
    """Same load on the stand-in: its pace does not depend on CPU, so only the clients differ."""
    model_dir = make_tiny(work)
    factory = StandinFactory(work / "standin-cmp")
    (work / "standin-cmp").mkdir()
    try:
        served = factory(env={**MANDATORY_ENV, "SIM_TOKENS_PER_SECOND": str(args.compare_rate)})
        return compare_clients(args, work, served.base_url, served.model, model_dir,
                               f"stand-in {args.compare_rate:g} tok/s")
    finally:
        factory.stop_all()


def standin_pacing(args: argparse.Namespace, work: Path) -> list[tuple[int, float, float, float]]:
    from spark_pipelines.resources import bench_client

    factory = StandinFactory(work)
    rows = []
    try:
        served = factory(env={**MANDATORY_ENV, "SIM_TOKENS_PER_SECOND": str(args.standin_rate)})
        for n in (1, 8, 64, 256):
            report = bench_client.run_bench(served.base_url, served.model, "loaded", n, 1,
                                            loaded_requests=n, loaded_max_tokens=args.output_len)
            assert not report.failures, report.failures[:3]
            p, ph = report.prompts[0], report.phases[0]
            rows.append((n, p.decode_tok_s.median / args.standin_rate,
                         p.decode_tok_s.min / args.standin_rate, ph.aggregate_tok_s.median))
            print(f"  stand-in, {n:3d} streams: decode {p.decode_tok_s.text(1)} tok/s per stream, "
                  f"aggregate {ph.aggregate_tok_s.median:.0f} tok/s, counters "
                  f"{'ok' if report.counters.tokens_match else 'MISMATCH'}", flush=True)
    finally:
        factory.stop_all()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--standin-rate", type=float, default=52.0)
    ap.add_argument("--compare-rate", type=float, default=208.0,
                    help="stand-in pace for the client comparison (4x the runbook's 52: quicker)")
    ap.add_argument("--skip-vllm", action="store_true", help="compare clients on the stand-in only")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vs-vllm-") as tmp:
        work = Path(tmp)
        comparisons = []
        if not VLLM_PYTHON.exists():
            print(f"real vLLM venv missing: {VLLM_PYTHON}", file=sys.stderr)
            return 2
        print(f"1. ours vs vllm bench serve: {args.prompts} requests, {args.concurrency} at once, "
              f"{args.output_len} tokens each, {args.rounds} rounds per client; server on CPU "
              f"{SERVER_CORES}, clients on CPU {CLIENT_CORES}", flush=True)
        if not args.skip_vllm:
            comparisons.append(real_vllm_comparison(args, work))
        comparisons.append(standin_comparison(args, work))
        print(f"2. stand-in at {args.standin_rate:g} tok/s per stream", flush=True)
        (work / "standin").mkdir()
        pacing = standin_pacing(args, work / "standin")

    print("\n=== Figures ===")
    for f in comparisons:
        print(f"[{f['label']}] output tok/s, ours / vllm bench serve: {f['ours_tok_s']:.1f} / "
              f"{f['theirs_tok_s']:.1f} = {f['ours_tok_s'] / f['theirs_tok_s']:.3f} "
              "(agree within 3%: "
              f"{'yes' if abs(f['ours_tok_s'] / f['theirs_tok_s'] - 1) <= 0.03 else 'NO'})")
        print(f"  per-round ratio (ours_i / theirs_i, run back to back): median "
              f"{f['pair_ratio_median']:.3f}, range {f['pair_ratio_min']:.3f}-{f['pair_ratio_max']:.3f}")
        print(f"  verdict (ranges widened 3%): {f['verdict']}")
        print(f"[{f['label']}] client CPU s per 1,000 streamed tokens, in the benchmark call: ours "
              f"{f['ours_cpu_per_k_call']:.3f} / theirs {f['theirs_cpu_per_k_call']:.3f} = "
              f"{f['ours_cpu_per_k_call'] / f['theirs_cpu_per_k_call']:.2f} (target <= 1.0)")
        print(f"[{f['label']}] client CPU s per 1,000 streamed tokens, whole process: ours "
              f"{f['ours_cpu_per_k_process']:.3f} / theirs {f['theirs_cpu_per_k_process']:.3f} = "
              f"{f['ours_cpu_per_k_process'] / f['theirs_cpu_per_k_process']:.2f}")
    for n, ratio, worst, agg in pacing:
        print(f"stand-in {n:3d} streams: measured / true decode rate = {ratio:.3f} "
              f"(slowest stream {worst:.3f}), aggregate {agg:.0f} tok/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
