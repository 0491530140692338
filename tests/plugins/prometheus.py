"""A real Prometheus and Alertmanager on loopback (Debian's packages), each with its own config, data
dir and free port, plus a webhook receiver the test runs: what the metrics e2e test drives.

Never the packages' own services: the processes started here are stopped (by their pid) when the
block ends. The alert rules are deploy/prometheus/spark-alerts.yml with every `for:` divided by
FOR_SCALE, so an alert's window is seconds here and the test can measure latency against it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import yaml

from spark_sim.servers import free_port
from tests.plugins import unavailable

FOR_SCALE = 20  # 2m -> 6 s, 10m -> 30 s
INTERVAL = "1s"  # scrape and rule evaluation


def seconds(duration: str) -> float:
    total = 0.0
    for amount, unit in re.findall(r"(\d+)(ms|s|m|h)", duration):
        total += int(amount) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
    return total


def scaled_rules(src: Path, dst: Path) -> dict[str, float]:
    """The rules with each `for:` divided by FOR_SCALE; returns {alert: its window in seconds}."""
    doc = yaml.safe_load(src.read_text())
    windows = {}
    for group in doc["groups"]:
        for rule in group["rules"]:
            window = seconds(rule.get("for", "0s")) / FOR_SCALE
            rule["for"] = f"{int(window * 1000)}ms"
            windows[rule["alert"]] = window
    dst.write_text(yaml.safe_dump(doc, sort_keys=False))
    return windows


@dataclass
class Notification:
    at: float
    status: str  # firing | resolved
    alertname: str
    labels: dict[str, str]
    annotations: dict[str, str]


@dataclass
class Webhook:
    port: int
    got: list[Notification] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait(self, alertname: str, status: str, node: str | None, after: float, timeout: float) -> Notification:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                for n in self.got:
                    if (n.alertname == alertname and n.status == status and n.at >= after
                            and (node is None or n.labels.get("node") == node)):
                        return n
            time.sleep(0.2)
        with self.lock:
            seen = [(n.alertname, n.status, n.labels.get("node")) for n in self.got]
        raise AssertionError(f"no {status} {alertname} for {node} within {timeout:.0f} s; received {seen}")


@dataclass
class Stack:
    prometheus: str
    alertmanager: str
    webhook: Webhook
    windows: dict[str, float]
    dir: Path
    pid: int

    def query(self, expr: str) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.prometheus}/api/v1/query", params={"query": expr}, timeout=10)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def targets(self) -> list[dict[str, Any]]:
        r = httpx.get(f"{self.prometheus}/api/v1/targets", timeout=10)
        r.raise_for_status()
        return r.json()["data"]["activeTargets"]


def _receiver(hook: Webhook) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            now = time.time()
            with hook.lock:
                for a in body.get("alerts", []):
                    hook.got.append(Notification(now, a.get("status", ""), a["labels"].get("alertname", ""),
                                                 a.get("labels", {}), a.get("annotations", {})))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", hook.port), Handler)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, seconds_: float = 30) -> None:
    deadline = time.monotonic() + seconds_
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"{url} exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready in {seconds_:.0f} s: {log.read_text()[-2000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@contextmanager
def prometheus_stack(root: Path, scrape_dir: Path, rules: Path) -> Iterator[Stack]:
    """Prometheus reading `scrape_dir`/prometheus.yml's file_sd files (written by `metrics
    scrape-config`), with `rules` scaled; Alertmanager routing every alert to a webhook here."""
    prom_bin, am_bin = shutil.which("prometheus"), shutil.which("prometheus-alertmanager")
    if prom_bin is None or am_bin is None:
        unavailable("prometheus / prometheus-alertmanager are not installed (scripts/bootstrap.sh prometheus)")
    hook = Webhook(free_port())
    server = _receiver(hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    am_port, prom_port = free_port(), free_port()
    am_conf = root / "alertmanager.yml"
    am_conf.write_text(yaml.safe_dump({
        "route": {"receiver": "test", "group_by": ["alertname", "node"], "group_wait": "1s",
                  "group_interval": "1s", "repeat_interval": "1h"},
        "receivers": [{"name": "test", "webhook_configs": [
            {"url": f"http://127.0.0.1:{hook.port}/", "send_resolved": True}]}]}))
    windows = scaled_rules(rules, root / "spark-alerts.yml")
    config = yaml.safe_load((scrape_dir / "prometheus.yml").read_text())
    config["global"].update({"scrape_interval": INTERVAL, "evaluation_interval": INTERVAL, "scrape_timeout": INTERVAL})
    config["rule_files"] = [str(root / "spark-alerts.yml")]
    config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]}
    for job in config["scrape_configs"]:
        for sd in job["file_sd_configs"]:
            sd["refresh_interval"] = INTERVAL
    (root / "prometheus.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    procs: list[subprocess.Popen] = []
    try:
        am_log = root / "alertmanager.log"
        procs.append(subprocess.Popen(
            [am_bin, f"--config.file={am_conf}", f"--storage.path={root / 'am-data'}",
             f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
            stdout=am_log.open("w"), stderr=subprocess.STDOUT))
        _wait_ready(f"http://127.0.0.1:{am_port}/-/ready", procs[-1], am_log)
        prom_log = root / "prometheus.log"
        procs.append(subprocess.Popen(
            [prom_bin, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'prom-data'}",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=prom_log.open("w"), stderr=subprocess.STDOUT))
        _wait_ready(f"http://127.0.0.1:{prom_port}/-/ready", procs[-1], prom_log)
        yield Stack(f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{am_port}", hook, windows, root, procs[-1].pid)
    finally:
        for p in reversed(procs):
            _stop(p)
        server.shutdown()
        server.server_close()
