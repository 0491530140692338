"""`spark-pipelines bench`: the bench harness against any OpenAI-compatible endpoint, for a terminal
(the client itself is `resources.bench_client`)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from spark_pipelines.core import bench as core
from spark_pipelines.core import quality
from spark_pipelines.resources.bench_client import BenchError, run_bench, run_quality


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (vLLM or LiteLLM)")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--suite", choices=core.SUITES, default="recipe",
                   help=f"recipe: the runbook's {len(core.RECIPE_PROMPTS)} single-stream prompts, mean tok/s "
                        f"against the reference; loaded: --concurrency requests at once, aggregate tok/s; all: "
                        f"both (default: recipe)")
    p.add_argument("--concurrency", type=int, default=core.LOADED_CONCURRENCY, metavar="N",
                   help=f"requests in flight at once in the loaded phase, 1-{core.MAX_CONCURRENCY} "
                        f"(vLLM's default max_num_seqs) (default: {core.LOADED_CONCURRENCY}, the runbook's probe)")
    p.add_argument("--repeats", type=int, default=core.RECIPE_RUNS, metavar="K",
                   help=f"runs per phase; run 1 is the warm-up (default: {core.RECIPE_RUNS}, as the recipe)")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="text (markdown tables) for a person, json for a program (default: text)")
    p.add_argument("--api-key-env", metavar="VAR",
                   help="environment variable holding the API key (default: none, no key sent)")
    p.add_argument("--metrics-url", metavar="URL",
                   help="vLLM /metrics when --base-url is a gateway (default: --base-url's /metrics)")
    p.add_argument("--no-stream", action="store_true", help="the recipe's non-streaming requests")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds one request may take (default 600: 16k tokens at the runbook's ~52 tok/s with room)")
    p.add_argument("--max-time", type=float, default=3600.0, metavar="S",
                   help="seconds the whole bench may take (default 3600)")
    p.add_argument("--quality", action="store_true",
                   help=f"then the quality phase ({quality.SUITE_VERSION}: sequential and parallel "
                        f"{quality.PARALLEL}, the runbook's fourth phase)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


class Progress:
    """Progress on stderr: a live status line and timed lines through rich on a terminal, plain
    lines otherwise (a log file, CI, a pipe), so a long bench is never silent."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.console = None
        self.status = None
        if not quiet and sys.stderr.isatty():
            from rich.console import Console

            self.console = Console(stderr=True, log_path=False)

    def __enter__(self) -> Progress:
        if self.console is not None:
            self.status = self.console.status("bench: starting")
            self.status.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.status is not None:
            self.status.__exit__(*exc)

    def __call__(self, line: str) -> None:
        if self.quiet:
            return
        if self.console is not None:
            self.console.log(line)
            if self.status is not None:
                self.status.update(f"bench: {line}")
        else:
            print(f"bench: {line}", file=sys.stderr, flush=True)


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
        for name, value in (("--timeout", args.timeout), ("--max-time", args.max_time)):
            if not 1 <= value <= 86400:
                raise core.BenchRefused(f"{name} {value:g}: give seconds between 1 and 86400")
        with Progress(args.quiet) as progress:
            report = run_bench(
                args.base_url,
                args.model,
                args.suite,
                args.concurrency,
                args.repeats,
                api_key,
                metrics_url=args.metrics_url,
                stream=not args.no_stream,
                timeout_s=args.timeout,
                max_s=args.max_time,
                on_progress=progress,
            )
            scored = None
            if args.quality:
                scored = run_quality(args.base_url, args.model, api_key, max_s=args.max_time,
                                     timeout_s=args.timeout, on_progress=progress)
    except (core.BenchRefused, BenchError) as exc:
        print(f"spark-pipelines bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # 128 + SIGINT, as shells report an interrupted command
        print("spark-pipelines bench: interrupted", file=sys.stderr)
        return 130
    if args.format == "json":
        doc = report.to_dict()
        if scored is not None:
            doc["quality"] = scored.to_dict()
        print(json.dumps(doc, indent=2))
    else:
        print(core.render_markdown(report))
        if scored is not None:
            print(quality.render_markdown(scored))
    # A failed deterministic check is a broken deployment, whatever the tok/s: say so in the code.
    return 1 if scored is not None and scored.failed_checks() else 0

