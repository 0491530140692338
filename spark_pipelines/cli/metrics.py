"""spark-pipelines metrics: the fleet's recorded state for Prometheus, and the scrape config for it.

  metrics serve [--fleet FILE] [--host 127.0.0.1] [--port 9464]
                                                   the fleet exporter: /metrics read from the Dagster
                                                   instance ($DAGSTER_HOME, else the demo's .dagster-home)
                                                   on each scrape (cached 5 s); any other path is a 404
  metrics show                                     the same metrics once, on stdout
  metrics scrape-config --out DIR [--exporter HOST:PORT] [--alertmanager HOST:PORT]
                                                   file_sd targets from the fleet file, a prometheus.yml
                                                   naming them and the alert rules (deploy/prometheus)

The exporter reads only the instance (the health sweep's verdicts, the gateway's rotation, the
benches, the healing runs): no SSH, so a scrape costs milliseconds and never touches a node.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import yaml
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from spark_pipelines.core import fleet_metrics, scrape_config
from spark_pipelines.core.errors import first_line
from spark_pipelines.core.fleet import Fleet, FleetError, load_fleet

DEFAULT_PORT = 9464
CACHE_S = 5.0  # Prometheus and a person's curl at once read the instance once
RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / scrape_config.RULES_FILE


class FleetCollector(Collector):
    """The fleet's metric families, read from the instance at most once per CACHE_S."""

    def __init__(self, fleet: Fleet, instance: Callable[[], Any], cache_s: float = CACHE_S) -> None:
        self.fleet, self._instance, self.cache_s = fleet, instance, cache_s
        self._lock = threading.Lock()
        self._at: float | None = None
        self._families: list[fleet_metrics.Family] = []
        self._ok = 0.0
        self._said = ""  # the last read problem printed (each is said once, not every scrape)

    def families(self) -> list[fleet_metrics.Family]:
        from spark_pipelines.state import records  # the Dagster side, only once something is read

        with self._lock:
            now = time.monotonic()  # the cache's age: a wall clock stepped back would freeze it
            if self._at is None or now - self._at >= self.cache_s:
                problem = ""
                try:
                    instance = self._instance()
                    recorded = records.fleet_recorded(instance, self.fleet)
                    self._families = fleet_metrics.families(
                        records.fleet_metric_facts(instance, self.fleet, time.time()))
                    if not recorded:
                        names = ", ".join(n.name for n in self.fleet.serve_nodes)
                        problem = (f"the Dagster instance holds no record of this fleet's nodes ({names}): "
                                   "is DAGSTER_HOME the instance the chain records in (make demo: .dagster-home; "
                                   "the team's: $SPARK_TEAM_ROOT/home)?")
                except Exception as e:  # the exporter keeps answering: the read failure is a metric
                    problem = f"the Dagster instance could not be read: {first_line(e)}"
                    self._families = []
                self._ok = 0.0 if problem else 1.0
                if problem and problem != self._said:
                    print(f"metrics: {problem}", file=sys.stderr)
                self._said = problem
                self._at = now
            read = fleet_metrics.Family("spark_exporter_instance_read_ok", "1 when the last read of the Dagster "
                                        "instance worked and found this fleet in it",
                                        (fleet_metrics.Sample({}, self._ok),))
            return [*self._families, read]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for fam in self.families():
            names = sorted({k for s in fam.samples for k in s.labels})
            g = GaugeMetricFamily(fam.name, fam.help, labels=names)
            for s in fam.samples:
                g.add_metric([s.labels.get(k, "") for k in names], s.value)
            yield g


def registry_for(fleet: Fleet, instance: Callable[[], Any], cache_s: float = CACHE_S) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(fleet, instance, cache_s))
    return reg


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        """A scrape every few seconds is not news."""


def exporter_app(registry: CollectorRegistry) -> Callable[..., Any]:
    """/metrics (and / naming it); any other path is a 404, not the metrics under another name."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        path = environ.get("PATH_INFO") or "/"
        if path == "/metrics":
            return metrics(environ, start_response)
        if path == "/":
            start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8")])
            return [b"spark-pipelines fleet exporter: the metrics are at /metrics\n"]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"not found: the fleet exporter serves /metrics\n"]

    return app


def serve(fleet: Fleet, instance: Callable[[], Any], host: str, port: int, cache_s: float = CACHE_S) -> Any:
    """Start the exporter's HTTP server in a thread; returns the server (shutdown() stops it).
    OSError when the address cannot be bound (in use, not this host's)."""
    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = make_server(host, port, exporter_app(registry_for(fleet, instance, cache_s)), Server,
                         handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True, name="fleet-exporter").start()
    return server


def tcp_port(text: str) -> int:
    """--port, checked while parsing (one line, exit 2)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number; give 1-65535") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port; give 1-65535")
    return port


def _instance_from_env() -> Callable[[], Any]:
    import dagster as dg

    if not os.environ.get("DAGSTER_HOME"):
        raise FleetError("metrics: DAGSTER_HOME is not set: point it at the instance the chain records in "
                         "(make demo uses .dagster-home)")
    holder: list[Any] = []

    def get() -> Any:
        if not holder:
            holder.append(dg.DagsterInstance.get())
        return holder[0]

    return get


def write_scrape_config(fleet: Fleet, out: Path, exporter: str, alertmanager: str | None) -> list[Path]:
    """The file_sd JSON files (rewritten atomically: Prometheus may read them at any moment), the
    rules file beside them and a prometheus.yml naming both by absolute path (Prometheus resolves
    a relative one against its own config's directory, not the shell's); returns what was written."""
    out = Path(out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, groups in scrape_config.targets(fleet, exporter).items():
        path = out / name
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(groups, indent=2) + "\n")
        os.replace(tmp, path)
        written.append(path)
    rules = out / scrape_config.RULES_FILE
    shutil.copyfile(RULES, rules)
    config = out / "prometheus.yml"
    config.write_text(yaml.safe_dump(scrape_config.prometheus_config(str(out), str(rules), alertmanager),
                                     sort_keys=False))
    return [*written, rules, config]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from spark_pipelines.cli.console import FLEET_HELP

    sub = ap.add_subparsers(dest="what", required=True, metavar="serve|show|scrape-config")
    s = sub.add_parser("serve", help="the fleet exporter on HOST:PORT/metrics",
                       description="The fleet exporter: /metrics read from the Dagster instance on each scrape "
                                   f"(cached {CACHE_S:g} s); any other path is a 404. Ctrl-C stops it.")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1; 0.0.0.0 for a Prometheus on another host)")
    s.add_argument("--port", type=tcp_port, default=DEFAULT_PORT,
                   help=f"TCP port to listen on, 1-65535 (default: {DEFAULT_PORT}, the exporter's usual port)")
    show = sub.add_parser("show", help="the fleet's metrics once, in the text format")
    c = sub.add_parser("scrape-config", help="file_sd targets + prometheus.yml + alert rules into --out")
    for each in (s, show, c):
        each.add_argument("--fleet", default=None, help=FLEET_HELP)
    c.add_argument("--out", required=True, type=Path, metavar="DIR",
                   help="directory for the files (created; its absolute path is written into prometheus.yml)")
    c.add_argument("--exporter", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="HOST:PORT",
                   help=f"where `metrics serve` listens (default: 127.0.0.1:{DEFAULT_PORT})")
    c.add_argument("--alertmanager", default=None, metavar="HOST:PORT",
                   help="the Alertmanager (default: none, no alerting block)")


def metrics_run(args: argparse.Namespace) -> int:
    fleet = load_fleet(args.fleet)
    if args.what == "scrape-config":
        for path in write_scrape_config(fleet, args.out, args.exporter, args.alertmanager):
            print(path)
        return 0
    instance = _instance_from_env()
    if args.what == "show":
        sys.stdout.write(fleet_metrics.exposition(FleetCollector(fleet, instance, 0).families()))
        return 0
    try:
        server = serve(fleet, instance, args.host, args.port)
    except OSError as e:
        why = "in use (another exporter?)" if e.errno == errno.EADDRINUSE else (e.strerror or str(e))
        print(f"metrics serve: cannot listen on {args.host}:{args.port}: {why}; stop what holds it or give "
              f"another --port", file=sys.stderr)
        return 1
    print(f"metrics: the fleet exporter on http://{args.host}:{args.port}/metrics (Ctrl-C stops it)", flush=True)
    try:
        threading.Event().wait()
    finally:
        server.shutdown()
        server.server_close()
    return 0
