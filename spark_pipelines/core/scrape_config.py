"""Prometheus' scrape configuration, from the fleet file.

Targets go through file-based service discovery: one JSON file per job (every serve node's vLLM
/metrics, the LiteLLM gateway, the fleet exporter), which Prometheus re-reads when it changes. An
edited fleet file rewritten with `spark-pipelines metrics scrape-config` changes the targets
without a Prometheus restart; the prometheus.yml around them only names the files.

Pure: returns plain data (the JSON target groups, the config as a dict); the face writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spark_pipelines.core.fleet import Fleet

# job name -> its file_sd file. Jobs are what the alert rules and the dashboard select on.
JOB_VLLM, JOB_GATEWAY, JOB_EXPORTER = "spark-vllm", "spark-gateway", "spark-fleet"
SD_FILES = {JOB_VLLM: "spark-vllm.json", JOB_GATEWAY: "spark-gateway.json", JOB_EXPORTER: "spark-fleet.json"}
RULES_FILE = "spark-alerts.yml"


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def targets(fleet: Fleet, exporter: str) -> dict[str, list[dict[str, Any]]]:
    """{sd file name: its target groups}: each serve node's vLLM (labels node, hardware), the
    gateway's proxy, and the exporter at `exporter` (host:port)."""
    vllm = [{"targets": [_hostport(n.host, fleet.launch_for(n).port)],
             "labels": {"node": n.name, "hardware": fleet.profile_of(n).name}} for n in fleet.serve_nodes]
    gateway = [{"targets": [_hostport(fleet.gateway.host, fleet.gateway.proxy_port)], "labels": {"gateway": "litellm"}}]
    return {SD_FILES[JOB_VLLM]: vllm, SD_FILES[JOB_GATEWAY]: gateway,
            SD_FILES[JOB_EXPORTER]: [{"targets": [exporter], "labels": {}}]}


def scrape_configs(sd_dir: str, refresh: str = "30s") -> list[dict[str, Any]]:
    """The scrape_configs entries for an existing prometheus.yml: one job per sd file."""
    return [{"job_name": job, "metrics_path": "/metrics",
             "file_sd_configs": [{"files": [str(Path(sd_dir) / name)], "refresh_interval": refresh}]}
            for job, name in SD_FILES.items()]


def prometheus_config(sd_dir: str, rules: str, alertmanager: str | None = None, *, scrape_interval: str = "15s",
                      evaluation_interval: str = "15s") -> dict[str, Any]:
    """A whole prometheus.yml: the three jobs, the alert rules file, and the Alertmanager (host:port)."""
    config: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval,
                   "scrape_timeout": min(scrape_interval, "10s", key=_seconds)},
        "rule_files": [rules],
        "scrape_configs": scrape_configs(sd_dir),
    }
    if alertmanager:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    return config


def _seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for unit in ("ms", "s", "m", "h"):
        if duration.endswith(unit) and duration[: -len(unit)].replace(".", "", 1).isdigit():
            return float(duration[: -len(unit)]) * units[unit]
    raise ValueError(f"{duration!r} is not a Prometheus duration like 15s or 1m")
