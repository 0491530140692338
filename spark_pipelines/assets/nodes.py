"""Per-node steps (partitioned by node): artifacts on the node, then the deployment.

Deployment order follows Phase 4 of the runbook: preflight (Phase 0 state, GPU holders, earlyoom,
exporters, page cache, disk, free memory vs GMU x total), launch, readiness (vLLM milestones +
log diagnosis), smoke test. The previous container is kept (stopped) until the new one is
healthy and put back if it is not, so a failed deploy leaves the previous deployment serving.
"""


import shlex
import time
from dataclasses import dataclass
from typing import Any

import dagster as dg
import httpx

from spark_pipelines.assets import markers
from spark_pipelines.assets.model import StepFailed, verify_on_node
from spark_pipelines.core import diagnosis, gpu, layout, preflight
from spark_pipelines.core.launch import LaunchSpec, launch_spec
from spark_pipelines.core.pins import code_versions
from spark_pipelines.fleet import Fleet, Node
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.ssh import FleetSession, FleetSSH
from spark_pipelines.resources.transfer import NodeStreams

READY_LINE = "Application startup complete"
SMOKE_PROMPT = "What is 2+2? Be concise."
MEMCHECK_PY = "import torch; f, t = torch.cuda.mem_get_info(); print(f / 2**30, t / 2**30)"
GPU_DEVICE = "/dev/nvidia0"
# One read gives every field of the wedge signature, counters included (CSV lacks them on 580).
GPU_QUERY = ("nvidia-smi", "-q", "-d", "PERFORMANCE,CLOCK,POWER,UTILIZATION")
# The runbook's flush, verbatim, so the sudoers line operators already have keeps matching.
DROP_CACHES = "sync; echo 3 > /proc/sys/vm/drop_caches"
GIB = 2**30


def node_partitions(fleet: Fleet) -> dg.StaticPartitionsDefinition:
    return dg.StaticPartitionsDefinition([n.name for n in fleet.serve_nodes])


# -- preflight (read-only observations + the two runbook actions: stop exporters, flush cache) --


@dataclass
class PreflightRun:
    report: preflight.PreflightReport
    stopped_exporters: list[str]


def read_gpu(s: FleetSession, node: str, timeout: float = 30) -> gpu.GpuReading:
    """One nvidia-smi read of the node (raises GpuFormatError on output it cannot parse)."""
    return gpu.parse_reading(s.run(node, list(GPU_QUERY), check=False, log=False, timeout=timeout).stdout)


def observe(s: FleetSession, node: Node, image: str, gmu: float) -> PreflightRun:
    n = node.name
    docker = NodeDocker(s)
    try:
        reading = read_gpu(s, n)
        verdict = gpu.classify(reading, under_load=(reading.utilization_pct or 0) >= 50)
        gpu_state = verdict.state
    except gpu.GpuFormatError:
        gpu_state = "unknown"
    holders = s.run(n, ["sudo", "-n", "fuser", GPU_DEVICE], check=False, log=False)
    holder_pids = [int(p) for p in holders.stdout.split() if p.strip().isdigit()]
    persist = s.run(n, ["pgrep", "-x", "nvidia-persistenced"], check=False, log=False)
    persist_pids = [int(p) for p in persist.stdout.split() if p.isdigit()]
    earlyoom = s.run(n, ["dpkg-query", "-W", "-f", "${Status}", "earlyoom"], check=False, log=False)
    running = s.run(n, ["docker", "ps", "--format", "{{.Names}}"], log=False).stdout.split()
    stopped = [c for c in preflight.EXPORTER_CONTAINERS if c in running]
    for c in stopped:  # they hold a CUDA context (~9 GiB): stop now, restart once healthy
        docker.stop(n, c)
    # Flush the page cache (MANDATORY before every launch): sync as the user, drop as root.
    s.run(n, ["sync"], log=False)
    flushed = s.run(n, ["sudo", "-n", "sh", "-c", DROP_CACHES], check=False)
    if not flushed.ok and "password" in (flushed.stderr + flushed.tail).lower():
        from spark_pipelines.core import remote

        s.log.warning(remote.sudo_advice(n, node.user, f"/bin/sh -c {DROP_CACHES}"))
    df = s.run(n, ["df", "-Pk", node.home_dir], log=False).stdout.splitlines()[-1].split()
    disk_free_gib = int(df[3]) / 2**20
    mem = s.run(n, ["docker", "run", "--rm", "--gpus", "all", "--entrypoint", "python3", image, "-c", MEMCHECK_PY],
                check=False, log=False)
    free_gib = total_gib = None
    if mem.ok and mem.stdout.split():
        free_gib, total_gib = (round(float(x), 2) for x in mem.stdout.split()[-2:])
    obs = preflight.Observations(
        free_gib=free_gib,
        total_gib=total_gib,
        gpu_state=gpu_state,
        gpu_holder_pids=holder_pids,
        persistenced_pids=persist_pids,
        earlyoom_installed="install ok installed" in earlyoom.stdout,
        running_exporters=[],  # stopped above
        disk_free_gib=disk_free_gib,
        page_cache_flushed=flushed.ok,
    )
    fleet = s.fleet
    prof = fleet.profile_of(node)
    report = preflight.evaluate(
        n, obs, gmu=gmu, max_gmu=prof.max_gmu, profile_total_gib=prof.cuda_total_gib,
        min_disk_gib=(fleet.preflight.build_host_disk_gib if node.name == fleet.build_node.name
                      else fleet.preflight.serve_node_disk_gib),
    )
    return PreflightRun(report, stopped)


# -- health -----------------------------------------------------------------------------------


def api_root(fleet: Fleet, node: Node) -> str:
    host = node.host if ":" not in node.host else f"[{node.host}]"
    return f"http://{host}:{fleet.launch_for(node).port}"


def engine_metrics(fleet: Fleet, node: Node, timeout: float = 10.0) -> dict[str, float] | None:
    """The node's vLLM /metrics (parsed), or None when the engine does not answer."""
    try:
        return diagnosis.parse_metrics(httpx.get(f"{api_root(fleet, node)}/metrics", timeout=timeout).text)
    except httpx.HTTPError:
        return None


def healthy(fleet: Fleet, node: Node, timeout: float = 5.0) -> bool:
    try:
        return httpx.get(f"{api_root(fleet, node)}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def smoke_test(fleet: Fleet, node: Node) -> dict[str, Any]:
    launch = fleet.launch_for(node)
    r = httpx.post(
        f"{api_root(fleet, node)}/v1/chat/completions",
        json={"model": launch.served_model_name, "messages": [{"role": "user", "content": SMOKE_PROMPT}],
              "max_tokens": 64},
        timeout=120,
    )
    r.raise_for_status()
    body = r.json()
    tokens = int(body["usage"]["completion_tokens"])
    if tokens <= 0 or not body.get("choices"):
        raise ValueError("the smoke test got no completion tokens (Engine init failed?)")
    return {"completion_tokens": tokens}


def wait_healthy(fleet: Fleet, node: Node, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if healthy(fleet, node):
            return True
        time.sleep(1)
    return False


# -- the deploy procedure -----------------------------------------------------------------------


class DeployFailed(dg.Failure):
    pass


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
    s.run(node.name, ["mkdir", "-p", *spec.host_dirs], log=False)
    docker.run_container(node.name, spec.docker_run_argv())
    watch = docker.follow_logs(node.name, spec.container_name, until=lambda line: READY_LINE in line, timeout=timeout_s)
    log_text = docker.logs(node.name, spec.container_name, tail="all")
    ready = diagnosis.milestones(log_text)
    ok = bool(watch.matched) and wait_healthy(s.fleet, node, 60)
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
    pre = observe(s, node, spec.image, spec.gpu_memory_utilization)
    log.info(pre.report.explain())

    def roll_back(why: str) -> str:
        if previous is None:
            return f"{why}; no previous deployment on {node.name} to put back"
        docker.restore_previous(node.name, spec.container_name, spec.image)
        back = wait_healthy(f, node, min(600, f.launch_for(node).health_timeout_s))
        return f"{why}; previous deployment put back on {node.name} ({'healthy' if back else 'NOT healthy yet'})"

    if not pre.report.passed:
        for c in pre.stopped_exporters:
            docker.start(node.name, c)
        msg = roll_back(f"preflight blocked {node.name}: " + "; ".join(
            f"{c.name}: {c.detail} -> {c.fix}" for c in pre.report.failures()))
        raise DeployFailed(description=msg, metadata={"preflight": dg.MetadataValue.md(pre.report.explain())})

    ok, log_text, ready = launch_and_wait(s, node, spec, f.launch_for(node).health_timeout_s)
    findings = diagnosis.diagnose(log_text)
    if ok:
        try:
            smoke = smoke_test(f, node)
        except (httpx.HTTPError, ValueError, KeyError) as e:
            ok, smoke = False, {"error": f"{type(e).__name__}: {e}"}
    if not ok:
        docker.remove(node.name, spec.container_name, force=True)
        msg = roll_back(f"launch on {node.name} did not become healthy")
        for c in pre.stopped_exporters:
            docker.start(node.name, c)
        first = findings[0] if findings else None
        headline = (f"{msg}. Diagnosis: {first.signature.cause} -> {first.signature.fix} "
                    f"(runbook: {first.signature.runbook_ref})" if first else msg)
        raise DeployFailed(
            description=headline,
            metadata={"diagnosis": dg.MetadataValue.md(diagnosis_md(findings)),
                      "log_tail": dg.MetadataValue.md("```\n" + "\n".join(log_text.splitlines()[-40:]) + "\n```")},
        )

    docker.drop_previous(node.name, spec.container_name, spec.image)
    for c in pre.stopped_exporters:  # back on now that the node is healthy
        docker.start(node.name, c)
    container = docker.inspect_container(node.name, spec.container_name) or {}
    meta = {
        "kv_cache_tokens": ready.kv_tokens or 0,
        "max_concurrency": ready.concurrency or 0.0,
        "startup_seconds": round(time.monotonic() - started, 1),
        "free_gib_at_preflight": pre.report.memory.free_gib if pre.report.memory else 0.0,
        "graph_mode": ready.graph_mode or "unknown",
    }
    return Deployed(container.get("Id", ""), meta, pre.report.explain(), findings, int(smoke.get("completion_tokens", 0)))


def build_node_assets(fleet: Fleet) -> list[dg.AssetsDefinition]:
    cv = code_versions(fleet)
    partitions = node_partitions(fleet)

    @dg.asset(
        group_name="nodes",
        kinds={"ssh", "docker"},
        partitions_def=partitions,
        code_version=cv["node_artifacts"],
        # A new checkpoint or image rolls out to every node once the build host has it.
        automation_condition=dg.AutomationCondition.eager(),
        check_specs=[dg.AssetCheckSpec("same_image_as_build_host", asset="node_artifacts", blocking=True)],
        description="Checkpoint and serving image on the node, streamed node-to-node from the build host.",
    )
    def node_artifacts(context: dg.AssetExecutionContext, ssh: FleetSSH, mtp_weights: dict, serving_image: dict):
        s = ssh.session
        f = s.fleet
        node = f.node(context.partition_key)
        build = f.build_node
        src_dir = mtp_weights["path"]
        dst_dir = layout.hybrid_dir(f, node)
        image = serving_image["image"]
        meta: dict[str, Any] = {}
        if node.name == build.name:
            report = verify_on_node(s, node, dst_dir, expected_scales=144, require_mtp=True)
            if not report.ok:
                raise StepFailed(description=f"{node.name}: checkpoint does not verify: {report.problems[0]}")
            meta["copied"] = False
        else:
            streams = NodeStreams(s)
            sig = markers.signature(cv["node_artifacts"], mtp_weights["index"])
            if markers.matches(s, node, "node_artifacts", sig) and streams.verify_tree(build.name, node.name, src_dir, dst_dir).ok:
                meta["copied"] = False
            else:
                copy = streams.copy_tree(build.name, node.name, src_dir, dst_dir)
                markers.write(s, node, "node_artifacts", sig)
                meta.update(copied=True, bytes_sent=copy.bytes_sent, copy_seconds=copy.seconds,
                            files=copy.verification.files)
            img = streams.copy_image(build.name, node.name, image)
            meta.update(image_copied=not img.skipped, image_copy_seconds=img.seconds)
        node_image = NodeDocker(s).image_id(node.name, image)
        same = node_image == serving_image["image_id"]
        yield dg.Output(
            {"node": node.name, "path": dst_dir, "image": image, "image_id": node_image, "index": mtp_weights["index"]},
            data_version=dg.DataVersion(f"{mtp_weights['index']}-{(node_image or 'none')[7:19]}"),
            metadata={"image_id": node_image or "missing", **meta},
        )
        yield dg.AssetCheckResult(
            check_name="same_image_as_build_host",
            passed=same,
            severity=dg.AssetCheckSeverity.ERROR,
            description=("image id identical to the build host's" if same else
                         f"{node.name} holds {node_image} but the build host built {serving_image['image_id']}; "
                         "rerun node_artifacts for this node"),
        )

    @dg.asset(
        group_name="nodes",
        kinds={"docker", "vllm"},
        partitions_def=partitions,
        code_version=cv["node_deployment"],
        automation_condition=dg.AutomationCondition.eager(),
        check_specs=[dg.AssetCheckSpec("serving", asset="node_deployment", blocking=True)],
        description="Phase 4 on one node: preflight, launch, readiness + diagnosis, smoke test; rollback on failure.",
    )
    def node_deployment(context: dg.AssetExecutionContext, ssh: FleetSSH, node_artifacts: dict):
        s = ssh.session
        f = s.fleet
        node = f.node(context.partition_key)
        docker = NodeDocker(s)
        spec = launch_spec(f, node)
        sig = markers.signature(cv["node_deployment"], spec.fingerprint, node_artifacts["image_id"], node_artifacts["index"])
        current = docker.inspect_container(node.name, spec.container_name)
        marker = markers.matches(s, node, "node_deployment", sig)
        if (marker and current and current.get("State", {}).get("Running")
                and marker.get("container_id") == current.get("Id") and healthy(f, node)):
            yield dg.Output(
                {"node": node.name, "container_id": current["Id"], "fingerprint": spec.fingerprint},
                data_version=dg.DataVersion(sig),
                metadata={"skipped": True, "container_id": current["Id"][:12], **marker.get("metadata", {})},
            )
            yield dg.AssetCheckResult(check_name="serving", passed=True, description="already serving this launch spec")
            return

        done = deploy(s, node, spec, context.log)
        meta = done.metadata
        container = {"Id": done.container_id}
        markers.write(s, node, "node_deployment", sig, container_id=container.get("Id"), metadata=meta)
        yield dg.Output(
            {"node": node.name, "container_id": container.get("Id"), "fingerprint": spec.fingerprint},
            data_version=dg.DataVersion(sig),
            metadata={
                "skipped": False,
                **meta,
                "docker_run": dg.MetadataValue.text(shlex.join(spec.docker_run_argv())),
                "preflight": dg.MetadataValue.md(done.preflight),
                "warnings": dg.MetadataValue.md(diagnosis_md(done.findings) if done.findings else "none"),
                "smoke_completion_tokens": done.smoke_tokens,
            },
        )
        yield dg.AssetCheckResult(check_name="serving", passed=True,
                                  description=f"healthy; smoke test answered {done.smoke_tokens} tokens")

    return [node_artifacts, node_deployment]
