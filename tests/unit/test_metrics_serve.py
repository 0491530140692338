"""`metrics serve` and `metrics scrape-config` at their edges (issue 35, item 14): a port out of
range and a busy port are one line, not a traceback; only /metrics serves the metrics; the
written prometheus.yml names its files by absolute path, so promtool accepts it from anywhere."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import yaml

from spark_pipelines.core.fleet import SEED_FLEET, load_fleet
from spark_pipelines.cli.metrics import serve
from tests.plugins import unavailable

SEED = str(Path(SEED_FLEET).resolve())


def cli(*args: str, cwd: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spark_pipelines.cli", "metrics", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env={**os.environ, **(env or {})})


def test_a_port_out_of_range_is_refused_in_one_line():
    for port, said in (("99999", "99999 is not a TCP port; give 1-65535"), ("0", "0 is not a TCP port"),
                       ("http", "'http' is not a port number")):
        p = cli("serve", "--fleet", SEED, "--port", port)
        assert p.returncode == 2 and said in p.stderr, (port, p.stderr)
        assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_busy_port_is_one_line_naming_it(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        p = cli("serve", "--fleet", SEED, "--port", str(port), env={"DAGSTER_HOME": str(tmp_path)})
    assert p.returncode == 1, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last == (f"metrics serve: cannot listen on 127.0.0.1:{port}: in use (another exporter?); stop what "
                    f"holds it or give another --port"), p.stderr
    assert "Traceback" not in p.stderr


def test_only_metrics_serves_the_metrics():
    server = serve(load_fleet(SEED), lambda: (_ for _ in ()).throw(RuntimeError("no instance")), "127.0.0.1", 0,
                   cache_s=0)
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        metrics = httpx.get(f"{base}/metrics", timeout=10)
        assert metrics.status_code == 200 and "spark_exporter_instance_read_ok 0.0" in metrics.text
        for path in ("/nope", "/metrics/extra", "/favicon.ico"):
            r = httpx.get(f"{base}{path}", timeout=10)
            assert r.status_code == 404 and "spark_" not in r.text, (path, r.status_code, r.text)
        root = httpx.get(base + "/", timeout=10)
        assert root.status_code == 200 and "/metrics" in root.text and "spark_" not in root.text
    finally:
        server.shutdown()
        server.server_close()


def test_scrape_config_with_a_relative_out_names_absolute_paths(tmp_path):
    """`--out a/b` from one directory, promtool run from another: Prometheus resolves relative paths
    against the config file's directory, so they must be absolute."""
    p = cli("scrape-config", "--fleet", SEED, "--out", "a/b", cwd=str(tmp_path))
    assert p.returncode == 0, p.stderr
    out = tmp_path / "a" / "b"
    config = yaml.safe_load((out / "prometheus.yml").read_text())
    files = [f for job in config["scrape_configs"] for sd in job["file_sd_configs"] for f in sd["files"]]
    assert files and all(f.startswith(str(out) + "/") for f in files), files
    assert all(Path(f).is_absolute() for f in config["rule_files"]), config["rule_files"]
    assert p.stdout.split() == [str(out / n) for n in ("spark-vllm.json", "spark-gateway.json", "spark-fleet.json",
                                                        "spark-alerts.yml", "prometheus.yml")]
    tool = shutil.which("promtool")
    if tool is None:
        unavailable("promtool is not installed (scripts/bootstrap.sh prometheus)")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    check = subprocess.run([tool, "check", "config", str(out / "prometheus.yml")], capture_output=True, text=True,
                           timeout=60, cwd=elsewhere)
    assert check.returncode == 0, check.stdout + check.stderr
