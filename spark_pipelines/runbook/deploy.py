"""Phase 4 on one node: preflight, launch, readiness (vLLM milestones + log diagnosis), smoke test.

The previous container is kept (stopped) until the new one is healthy and put back if it is not.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx

from spark_pipelines.core import diagnosis
from spark_pipelines.core.fleet import Node
from spark_pipelines.core.launch import LaunchSpec
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook import engine, preflight
from spark_pipelines.runbook.errors import DeployFailed

READY_LINE = "Application startup complete"


def diagnosis_md(findings: list[diagnosis.Finding]) -> str:
    if not findings:
        return "no known failure signature matched; read the container log"
    return "\n".join(
        f"- **{f.signature.id}** (runbook: {f.signature.runbook_ref}) line {f.line_number}: `{f.line.strip()[:200]}`"
        f"\n  - cause: {f.signature.cause}\n  - fix: {f.signature.fix}"
        for f in findings
    )


def launch_and_wait(s: FleetSession, node: Node, spec: LaunchSpec, timeout_s: float) -> tuple[bool, str, diagnosis.Readiness]:
    docker = NodeDocker(s)
    s.run(node.name, ["mkdir", "-p", *spec.host_dirs], log=False, timeout=60)
    docker.run_container(node.name, spec.docker_run_argv())
    watch = docker.follow_logs(node.name, spec.container_name, until=lambda line: READY_LINE in line, timeout=timeout_s)
    log_text = docker.logs(node.name, spec.container_name, tail="all")
    ready = diagnosis.milestones(log_text)
    ok = bool(watch.matched) and engine.wait_healthy(s.fleet, node, 60)
    return ok, log_text, ready


@dataclass
class Deployed:
    container_id: str
    metadata: dict[str, Any]
    preflight: str
    findings: list[diagnosis.Finding]
    smoke_tokens: int


def deploy(s: FleetSession, node: Node, spec: LaunchSpec, log: Any) -> Deployed:
    """Replace whatever runs on the node by `spec`, keeping the previous deployment until the new
    one is healthy and putting it back otherwise (raises DeployFailed with the diagnosis)."""
    f = s.fleet
    docker = NodeDocker(s)
    started = time.monotonic()
    previous = docker.keep_previous(node.name, spec.container_name, spec.image)
    prepared = preflight.prepare(s, node)
    report = preflight.evaluate(s, node, preflight.observe(s, node, spec.image, prepared), spec.gpu_memory_utilization)
    log.info(report.explain())

    def roll_back(why: str) -> str:
        if previous is None:
            return f"{why}; no previous deployment on {node.name} to put back"
        docker.restore_previous(node.name, spec.container_name, spec.image)
        back = engine.wait_healthy(f, node, min(600, f.launch_for(node).health_timeout_s))
        return f"{why}; previous deployment put back on {node.name} ({'healthy' if back else 'NOT healthy yet'})"

    if not report.passed:
        preflight.restore_exporters(s, node, prepared)
        msg = roll_back(f"preflight blocked {node.name}: " + "; ".join(
            f"{c.name}: {c.detail} -> {c.fix}" for c in report.failures()))
        raise DeployFailed(msg, {"preflight": report.explain()})

    ok, log_text, ready = launch_and_wait(s, node, spec, f.launch_for(node).health_timeout_s)
    findings = diagnosis.diagnose(log_text)
    smoke: dict[str, Any] = {}
    if ok:
        try:
            smoke = engine.smoke_test(f, node)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            ok, smoke = False, {"error": f"{type(e).__name__}: {e}"}
    if not ok:
        docker.remove(node.name, spec.container_name, force=True)
        msg = roll_back(f"launch on {node.name} did not become healthy")
        preflight.restore_exporters(s, node, prepared)
        first = findings[0] if findings else None
        headline = (f"{msg}. Diagnosis: {first.signature.cause} -> {first.signature.fix} "
                    f"(runbook: {first.signature.runbook_ref})" if first else msg)
        raise DeployFailed(headline, {
            "diagnosis": diagnosis_md(findings),
            "log_tail": "```\n" + "\n".join(log_text.splitlines()[-40:]) + "\n```",
        })

    docker.drop_previous(node.name, spec.container_name, spec.image)
    preflight.restore_exporters(s, node, prepared)  # back on now that the node is healthy
    container = docker.inspect_container(node.name, spec.container_name) or {}
    meta = {
        "kv_cache_tokens": ready.kv_tokens or 0,
        "max_concurrency": ready.concurrency or 0.0,
        "startup_seconds": round(time.monotonic() - started, 1),
        "free_gib_at_preflight": report.memory.free_gib if report.memory else 0.0,
        "graph_mode": ready.graph_mode or "unknown",
    }
    return Deployed(container.get("Id", ""), meta, report.explain(), findings, int(smoke.get("completion_tokens", 0)))
