"""Runbook steps 0-2 on the build host: base model download, hybrid INT4+FP8 checkpoint, MTP weights.

Each step verifies its output by reading the safetensors index and shard headers ON the node, not
by file existence: install.sh's skip test passes a half-built checkpoint whose index is stale. A
rebuild is made beside the checkpoint the serving containers mount and becomes a new checkpoint
version once verified (runbook/model.py, core/versions.py); mtp_weights hashes the result (the
digest manifest) and re-hashes it on every skip. The procedures are runbook/model.py; here: one call each, then the recording.
"""

from typing import Any

import dagster as dg

from spark_pipelines.assets import retry_unreachable, step_session
from spark_pipelines.core import checkpoint as checkpoint_core
from spark_pipelines.core import steps
from spark_pipelines.core.artifacts import Checkpoint, ModelSnapshot
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.core.pins import code_versions
from spark_pipelines.resources.hub import ModelHub
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.runbook import model as model_runbook

EXPECTED_FP8_SCALES = checkpoint_core.EXPECTED_FP8_SCALES


def report_metadata(report: checkpoint_core.CheckpointReport) -> dict[str, Any]:
    return {
        "directory": dg.MetadataValue.path(report.directory),
        "shards": len(report.shards),
        "size_gib": dg.MetadataValue.float(round(report.total_bytes / 2**30, 2)),
        "tensors": report.tensor_count,
        "fp8_tensors": report.fp8_count,
        "fp8_scales": report.scale_count,
        "mtp_keys_mapped": report.mtp_keys_mapped,
        "problems": dg.MetadataValue.md("\n".join(f"- {p}" for p in report.problems) or "none"),
    }


def step_metadata(out: model_runbook.StepOutcome) -> dict[str, Any]:
    c = out.checkpoint
    extra = {k: v for k, v in out.metadata.items() if v is not None}
    return {"skipped": out.skipped, "index": c.index,
            **({"manifest": c.manifest[:16]} if c.manifest else {}), **extra, **report_metadata(out.report)}


def model_definitions(fleet: Fleet) -> dg.Definitions:
    cv = code_versions(fleet)

    @dg.asset(
        group_name="1_model",
        kinds={"huggingface", "ssh"},
        code_version=cv[steps.BASE_MODEL],
        description="Step 0: Intel's AutoRound INT4 checkpoint on the build host, at the pinned revision "
                    "(where its marker says: the runbook's HF cache snapshot once adopted, else ~/models).",
    )
    @retry_unreachable(fleet.ssh)
    def base_model(context: dg.AssetExecutionContext, ssh: FleetSSH, hub: ModelHub) -> dg.Output[ModelSnapshot]:
        s = step_session(context, ssh)
        out = model_runbook.base_model(s, hub, cv)
        return dg.Output(out.snapshot, data_version=dg.DataVersion(out.snapshot.revision),
                         metadata={"revision": out.snapshot.revision, "skipped": out.skipped,
                                   "provenance": "proven" + (" (by content against the hub, this run)" if out.proved
                                                             else ""),
                                   **report_metadata(out.report)})

    @dg.asset(
        group_name="1_model",
        kinds={"python", "ssh"},
        code_version=cv[steps.HYBRID_CHECKPOINT],
        check_specs=[dg.AssetCheckSpec(
            "checkpoint_consistent", asset=steps.HYBRID_CHECKPOINT, blocking=True,
            description="Blocking: the safetensors index, the shard headers and the 144 FP8 scales agree (no stale "
                        "index of a half-built run); a failure stops the MTP step and every node copy. A failed "
                        "build never reaches the serving checkpoint: rerunning builds again beside it.")],
        description="Step 1: the recipe's hybrid INT4+FP8 checkpoint (~71 GB, ~20 min), built in a staging "
                    "directory beside the serving one and verified from headers; mtp_weights makes it a version.",
    )
    @retry_unreachable(fleet.ssh)
    def hybrid_checkpoint(context: dg.AssetExecutionContext, ssh: FleetSSH, hub: ModelHub, base_model: ModelSnapshot):
        s = step_session(context, ssh)
        out = model_runbook.hybrid_checkpoint(s, hub, base_model, cv)
        yield dg.Output(out.checkpoint, data_version=dg.DataVersion(out.data_version), metadata=step_metadata(out))
        yield dg.AssetCheckResult(
            check_name="checkpoint_consistent", passed=out.ok, severity=dg.AssetCheckSeverity.ERROR,
            description="index, shards and FP8 scales agree" if out.ok else out.check_text,
            metadata={"problems": len(out.report.problems), "fp8_scales": out.report.scale_count})

    @dg.asset(
        group_name="1_model",
        kinds={"python", "ssh"},
        code_version=cv[steps.MTP_WEIGHTS],
        check_specs=[dg.AssetCheckSpec(
            "mtp_keys_mapped", asset=steps.MTP_WEIGHTS, blocking=True,
            description="Blocking: the MTP head's mtp.* keys are in the checkpoint index, so MTP-2 speculative "
                        "decoding loads them; a failure stops the copies to the nodes.")],
        description="Step 2: MTP head weights added in a staging copy, which becomes a checkpoint version named by "
                    "its content (no version a container mounts is ever rewritten; a deploy points a node at it). "
                    "Owns the sha256 manifest: every run re-hashes the version against it and rebuilds beside on "
                    "a mismatch.",
    )
    @retry_unreachable(fleet.ssh)
    def mtp_weights(context: dg.AssetExecutionContext, ssh: FleetSSH, hub: ModelHub, base_model: ModelSnapshot,
                    hybrid_checkpoint: Checkpoint):
        s = step_session(context, ssh)
        out = model_runbook.mtp_weights(s, hub, base_model, hybrid_checkpoint, cv, run_id=context.run.run_id)
        yield dg.Output(out.checkpoint, data_version=dg.DataVersion(out.data_version), metadata=step_metadata(out))
        yield dg.AssetCheckResult(
            check_name="mtp_keys_mapped", passed=out.ok and out.report.mtp_keys_mapped > 0,
            severity=dg.AssetCheckSeverity.ERROR,
            description=(f"{out.report.mtp_keys_mapped} mtp. keys mapped" if out.ok
                         else out.check_text))

    return dg.Definitions(assets=[base_model, hybrid_checkpoint, mtp_weights])
