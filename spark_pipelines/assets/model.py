"""Runbook steps 0-2 on the build host: base model download, hybrid INT4+FP8 checkpoint, MTP weights.

Each step verifies its output by reading the safetensors index and shard headers ON the node
(`runbook.build_steps.verify_on_node`), not by file existence: install.sh's skip test passes a
half-built checkpoint whose index is stale. After a build the checkpoint is hashed there too
(digest manifest); its digest is part of the data version, and receivers are checked against it.
"""

from typing import Any

import dagster as dg

from spark_pipelines.assets import retry_unreachable, step_session
from spark_pipelines.core import steps
from spark_pipelines.core import checkpoint as checkpoint_core
from spark_pipelines.core import layout
from spark_pipelines.core.artifacts import Checkpoint, ModelSnapshot
from spark_pipelines.core import remote
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.core.pins import code_versions
from spark_pipelines.resources.hub import ModelHub
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.state import markers
from spark_pipelines.runbook.build_steps import checkout, checkpoint_step, verify_on_node

EXPECTED_FP8_SCALES = checkpoint_core.EXPECTED_FP8_SCALES

HYBRID_BUILDER = "patches/01-hybrid-int4-fp8/build-hybrid-checkpoint.py"
MTP_ADDER = "patches/02-mtp-speculative/add-mtp-weights.py"


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


def model_definitions(fleet: Fleet) -> dg.Definitions:
    cv = code_versions(fleet)

    @dg.asset(
        group_name="1_model",
        kinds={"huggingface", "ssh"},
        code_version=cv[steps.BASE_MODEL],
        description="Step 0: Intel's AutoRound INT4 checkpoint on the build host, at the pinned revision.",
    )
    @retry_unreachable(fleet.ssh)
    def base_model(context: dg.AssetExecutionContext, ssh: FleetSSH, hub: ModelHub) -> dg.Output[ModelSnapshot]:
        s = step_session(context, ssh)
        node = s.fleet.build_node
        pin = s.fleet.pins.base_model
        sha = hub.resolve(pin.repo, pin.revision)
        dest = layout.base_model_dir(s.fleet, node)
        sig = markers.signature(cv[steps.BASE_MODEL], sha)
        skipped = bool(markers.matches(s, node, steps.BASE_MODEL, sig))
        if skipped:
            report = verify_on_node(s, node, dest, expected_scales=0, require_mtp=False)
            skipped = report.ok
        if not skipped:
            context.log.info(f"downloading {pin.repo}@{sha} to {node.name}:{dest} (resumable: hf skips complete files)")
            s.run(node.name, hub.download_argv(pin.repo, sha, dest), secret_env=hub.secret_env() or None,
                  timeout=remote.DOWNLOAD_TIMEOUT_S)
            report = verify_on_node(s, node, dest, expected_scales=0, require_mtp=False)
            if not report.ok:
                raise dg.Failure(
                    description=f"base model on {node.name} is incomplete after download: {report.problems[0]}",
                    metadata=report_metadata(report),
                )
            markers.write(s, node, steps.BASE_MODEL, sig, revision=sha)
        return dg.Output(
            ModelSnapshot(node=node.name, path=dest, repo=pin.repo, revision=sha),
            data_version=dg.DataVersion(sha),
            metadata={"revision": sha, "skipped": skipped, **report_metadata(report)},
        )

    @dg.asset(
        group_name="1_model",
        kinds={"python", "ssh"},
        code_version=cv[steps.HYBRID_CHECKPOINT],
        check_specs=[dg.AssetCheckSpec(
            "checkpoint_consistent", asset=steps.HYBRID_CHECKPOINT, blocking=True,
            description="Blocking: the safetensors index, the shard headers and the 144 FP8 scales agree (no stale "
                        "index of a half-built run); a failure stops the MTP step and every node copy.")],
        description="Step 1: the recipe's hybrid INT4+FP8 checkpoint (~71 GB, ~20 min), verified from headers.",
    )
    @retry_unreachable(fleet.ssh)
    def hybrid_checkpoint(context: dg.AssetExecutionContext, ssh: FleetSSH, hub: ModelHub, base_model: ModelSnapshot):
        s = step_session(context, ssh)
        f = s.fleet
        node = f.build_node
        recipe = layout.recipe_dir(node)
        out = layout.hybrid_dir(f, node)
        sig = markers.signature(cv[steps.HYBRID_CHECKPOINT], base_model.revision)

        def build() -> None:
            checkout(s, node, f.pins.recipe_repo, recipe)
            # The builder's --force removes model.safetensors* and config.json but not the
            # model-*-of-* shards: leftovers of another build would mix in. Remove them first.
            s.run(node.name, ["find", out, "-maxdepth", "1", "-name", "model-*-of-*.safetensors", "-delete"], check=False)
            s.run(
                node.name,
                ["env", "-C", recipe, "python3", HYBRID_BUILDER, "--gptq-dir", base_model.path,
                 "--fp8-repo", f.pins.fp8_model.repo, "--output", out, "--force"],
                secret_env=hub.secret_env() or None, timeout=remote.CHECKPOINT_BUILD_TIMEOUT_S,
            )

        step = checkpoint_step(
            s, node, steps.HYBRID_CHECKPOINT, sig, out,
            lambda: verify_on_node(s, node, out, expected_scales=EXPECTED_FP8_SCALES, require_mtp=False), build)
        report = step.report
        yield dg.Output(
            Checkpoint(node=node.name, path=out, index=step.index, manifest=step.manifest),
            data_version=dg.DataVersion(step.data_version),
            metadata={"skipped": step.skipped, "manifest": step.manifest[:16], **report_metadata(report)},
        )
        yield dg.AssetCheckResult(
            check_name="checkpoint_consistent",
            passed=report.ok,
            severity=dg.AssetCheckSeverity.ERROR,
            description=("index, shards and FP8 scales agree" if report.ok else report.problems[0]),
            metadata={"problems": len(report.problems), "fp8_scales": report.scale_count},
        )

    @dg.asset(
        group_name="1_model",
        kinds={"python", "ssh"},
        code_version=cv[steps.MTP_WEIGHTS],
        check_specs=[dg.AssetCheckSpec(
            "mtp_keys_mapped", asset=steps.MTP_WEIGHTS, blocking=True,
            description="Blocking: the MTP head's mtp.* keys are in the checkpoint index, so MTP-2 speculative "
                        "decoding loads them; a failure stops the copies to the nodes.")],
        description="Step 2: MTP head weights added to the hybrid checkpoint (for MTP-2 speculative decoding).",
    )
    @retry_unreachable(fleet.ssh)
    def mtp_weights(context: dg.AssetExecutionContext, ssh: FleetSSH, base_model: ModelSnapshot,
                    hybrid_checkpoint: Checkpoint):
        s = step_session(context, ssh)
        node = s.fleet.build_node
        out = hybrid_checkpoint.path
        # Not the step-1 manifest: a rebuilt step 1 has a new index digest already, and adding it
        # would rerun step 2 once on every existing build host for nothing.
        sig = markers.signature(cv[steps.MTP_WEIGHTS], hybrid_checkpoint.index, base_model.revision)
        recipe = layout.recipe_dir(node)
        step = checkpoint_step(
            s, node, steps.MTP_WEIGHTS, sig, out,
            lambda: verify_on_node(s, node, out, expected_scales=EXPECTED_FP8_SCALES, require_mtp=True),
            lambda: s.run(node.name, ["env", "-C", recipe, "python3", MTP_ADDER, "--source", base_model.path,
                                      "--target", out], timeout=remote.CHECKPOINT_BUILD_TIMEOUT_S),
            owns_manifest=True,  # step 2 writes the directory last: the manifest on disk is its own
        )
        report = step.report
        yield dg.Output(
            Checkpoint(node=node.name, path=out, index=step.index, manifest=step.manifest),
            data_version=dg.DataVersion(step.data_version),
            metadata={"skipped": step.skipped, "manifest": step.manifest[:16], **report_metadata(report)},
        )
        yield dg.AssetCheckResult(
            check_name="mtp_keys_mapped",
            passed=report.ok and report.mtp_keys_mapped > 0,
            severity=dg.AssetCheckSeverity.ERROR,
            description=(f"{report.mtp_keys_mapped} mtp. keys mapped" if report.ok else report.problems[0]),
        )

    return dg.Definitions(assets=[base_model, hybrid_checkpoint, mtp_weights])


