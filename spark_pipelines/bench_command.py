"""`spark-pipelines bench`: the bench harness against any OpenAI-compatible endpoint, for a terminal
(the client itself is `resources.bench_client`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from spark_pipelines.core import bench as core
from spark_pipelines.resources.bench_client import BenchError, run_bench

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (vLLM or LiteLLM)")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--suite", choices=core.SUITES, default="recipe")
    p.add_argument("--concurrency", type=int, default=core.LOADED_CONCURRENCY)
    p.add_argument("--repeats", type=int, default=core.RECIPE_RUNS, help="runs per phase; run 1 is warm-up")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the API key")
    p.add_argument("--metrics-url", help="vLLM /metrics when --base-url is a gateway")
    p.add_argument("--no-stream", action="store_true", help="the recipe's non-streaming requests")


def bench_run(args: argparse.Namespace) -> int:
    """The bench of parsed arguments (spark_pipelines.cli parses them)."""
    try:
        api_key = None
        if args.api_key_env:
            if args.api_key_env not in os.environ:
                raise core.BenchRefused(
                    f"--api-key-env {args.api_key_env}: that environment variable is not set"
                )
            api_key = os.environ[args.api_key_env]
        report = run_bench(
            args.base_url,
            args.model,
            args.suite,
            args.concurrency,
            args.repeats,
            api_key,
            metrics_url=args.metrics_url,
            stream=not args.no_stream,
        )
    except (core.BenchRefused, BenchError) as exc:
        print(f"spark-pipelines bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spark-pipelines bench: interrupted", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(core.render_markdown(report))
    return 0

