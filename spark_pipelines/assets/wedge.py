"""The PD-firmware wedge per node: the evidence (requested by `wedge_watch`) and the cold drain
(launched by a person). Short wiring around `runbook.wedge`; `core.wedge` judges the readings."""


from typing import Any

import dagster as dg

from spark_pipelines.assets import node_partitions, fail, retry_unreachable, step_session
from spark_pipelines.assets.metadata import num
from spark_pipelines.core import steps
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.ssh import FleetSSH, RemoteError
from spark_pipelines.runbook import wedge
from spark_pipelines.runbook.run_limits import tags as max_runtime
from spark_pipelines.core.errors import RunbookError

MANIFEST_SCHEMA = dg.TableSchema(columns=[dg.TableColumn("file", "string"), dg.TableColumn("bytes", "int"),
                                          dg.TableColumn("sha256", "string")])


def _capture_metadata(c: wedge.Capture) -> dict[str, Any]:
    return {
        "tarball": dg.MetadataValue.path(c.path),
        "stored_on": c.host,
        "tarball_sha256": c.sha256,
        "tarball_bytes": c.size,
        "manifest": dg.MetadataValue.table(
            [dg.TableRecord({"file": e.name, "bytes": e.size, "sha256": e.sha256}) for e in c.manifest],
            schema=MANIFEST_SCHEMA),
        "wedge_confirmed": c.evidence.confirmed,
        "gpu_under_load": c.evidence.gpu.state,
        "clock_lock_test": c.evidence.lock.state,
        "bios": c.evidence.bios or "not readable",
        "evidence": dg.MetadataValue.md("\n".join(f"- {line}" for line in [*c.evidence.summary, *c.notes])),
    }


def wedge_definitions(fleet: Fleet) -> dg.Definitions:
    partitions = node_partitions(fleet)

    @dg.asset(
        group_name="6_wedge",
        kinds={"ssh", "nvidia"},
        partitions_def=partitions,
        description="The runbook's pre-drain capture of a node suspected of the PD-firmware wedge: the node is "
                    "quarantined (out of the gateway, held out), then nvidia-smi -q, clocks, power, throttle reasons, "
                    "the SW power-cap counter, the clock-lock-ignored test under load (-lgc, always reset with -rgc), "
                    "kernel log, BIOS string and container log go into a tarball on the build host.",
    )
    @retry_unreachable(fleet.ssh)
    def wedge_evidence(context: dg.AssetExecutionContext, ssh: FleetSSH, litellm: LiteLLMGateway):
        s = ssh.session
        node = s.fleet.node(context.partition_key)
        reason = context.run.tags.get(steps.EVIDENCE_TAG) or "wedge suspected"
        try:
            capture = wedge.capture(s, node, litellm.host(), reason, context.log, run_id=context.run.run_id)
        except RunbookError as e:
            fail(e)
        except RemoteError as e:
            raise dg.Failure(description=f"{node.name}: the wedge evidence was not captured: {e}; the node stays "
                                         "quarantined, run wedge_capture_job again once it answers") from None
        for line in capture.evidence.summary:
            context.log.info(f"[{node.name}] {line}")
        return dg.MaterializeResult(metadata=_capture_metadata(capture))

    @dg.asset(
        group_name="6_wedge",
        kinds={"ssh", "nvidia"},
        partitions_def=partitions,
        deps=[wedge_evidence],
        description="The runbook's AC cold drain of one node, then its post-drain validation -> WEDGE RESOLVED "
                    "(back in the gateway) or WEDGE PERSISTS (kept out, next step: the ASUS ticket). Runs only "
                    "when a person launches it: launching is the approval.",
    )
    def cold_drain(context: dg.AssetExecutionContext, ssh: FleetSSH, litellm: LiteLLMGateway):
        s = step_session(context, ssh, litellm)
        node = s.fleet.node(context.partition_key)
        gw = litellm.host()
        run_id = context.run.run_id
        plug = s.fleet.cold_drain.smart_plugs.get(node.name)
        context.log.info(f"cold drain of {node.name} approved by run {run_id} "
                         f"({'smart plug' if plug else 'the operator unplugs at the wall'})")
        try:
            drained, v = wedge.drain_and_validate(s, node, gw, context.log.info, run_id=run_id)
        except RunbookError as e:
            fail(e)
        except RemoteError as e:
            raise dg.Failure(description=f"{node.name}: the cold drain stopped: {e}; the node stays out of the "
                                         "gateway") from None
        verdict = v.verdict
        context.log.info(f"[{node.name}] {verdict.verdict}: {'; '.join(verdict.reasons)}; next: {verdict.advice}")
        return dg.MaterializeResult(metadata={
            "verdict": verdict.verdict,
            "reasons": dg.MetadataValue.md("\n".join(f"- {r}" for r in verdict.reasons)),
            "next": verdict.advice,
            "gateway": v.gateway,
            "verdict_file": dg.MetadataValue.path(v.verdict_path),
            "post_drain_tarball": dg.MetadataValue.path(v.capture.path),
            "bench_mean_tok_s": num(v.bench_mean_tok_s),  # null: no bench could run after the drain
            "floor_tok_s": num(v.floor_tok_s),
            "steps": dg.MetadataValue.md("\n".join(f"1. {step}" for step in drained.steps)),
            "drain_seconds": num(drained.seconds, 1),
        })

    capture_job = dg.define_asset_job(
        steps.WEDGE_CAPTURE_JOB, selection=[wedge_evidence],
        description="Quarantine a node suspected of the PD-firmware wedge and capture the runbook's pre-drain "
                    "evidence to the build host (requested by wedge_watch; safe to launch by hand).")
    drain_job = dg.define_asset_job(
        steps.COLD_DRAIN_JOB, selection=[cold_drain], tags=max_runtime(fleet, steps.COLD_DRAIN_JOB),
        description="APPROVAL: launching this run for a node IS the operator's approval of its AC cold drain "
                    "(docker stop, sudo poweroff, AC off 90-120 s by the fleet's smart plug or by you at the wall, "
                    "boot, docker start), then the post-drain validation: WEDGE RESOLVED or WEDGE PERSISTS. "
                    "Nothing requests it automatically, except the health sweep to finish an approved one whose run "
                    "died (its journal in the ledger). No config: pick the node's partition.")
    return dg.Definitions(assets=[wedge_evidence, cold_drain], jobs=[capture_job, drain_job])
