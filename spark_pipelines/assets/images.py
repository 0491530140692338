"""Runbook step 3 (base image from spark-vllm-docker, NOT install.sh's build path) and the serving image.

The procedures (skip on a marker, build, read the torch triple and patch 03's marker from the
image) are runbook/images.py; here: one call each, then what Dagster records.
"""


import dagster as dg

from spark_pipelines.assets import retry_unreachable, step_session
from spark_pipelines.core import steps
from spark_pipelines.core.artifacts import BuiltImage
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.core.pins import code_versions
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.runbook import images as images_runbook
from spark_pipelines.runbook.run_limits import tags as max_runtime



def image_definitions(fleet: Fleet) -> dg.Definitions:
    cv = code_versions(fleet)

    @dg.asset(
        group_name="2_images",
        kinds={"docker", "ssh"},
        code_version=cv[steps.BASE_IMAGE],
        pool=steps.BUILD_POOL,  # one image build at a time on the build host, however it is launched
        check_specs=[dg.AssetCheckSpec(
            "torch_is_pinned_cuda_build", asset=steps.BASE_IMAGE, blocking=True,
            description="Blocking: torch in the base image is the pinned +cu build (uv did not swap it, which fails "
                        "at serve time with the libtorch_cuda.so ImportError); a failure stops the serving image "
                        "and says what to change before the next build_job builds it again.")],
        description="Step 3: vLLM base image (spark-vllm-docker at its pin, edited Dockerfile, pinned vLLM ref). "
                    "Skipped while its marker on the build host names the tagged image and the same pins.",
    )
    @retry_unreachable(fleet.ssh)
    def base_image(context: dg.AssetExecutionContext, ssh: FleetSSH):
        s = step_session(context, ssh)
        out = images_runbook.base_image(s, cv)
        meta = out.metadata
        yield dg.Output(
            out.image,
            data_version=dg.DataVersion(out.image.image_id),
            metadata={
                "image_id": out.image.image_id,
                "torch": out.image.torch or "does not import",
                "vllm_ref": out.probe.vllm_ref or s.fleet.pins.vllm_ref,
                "skipped": out.skipped,
                **({"build_output": dg.MetadataValue.path(meta["build_output"])} if meta.get("build_output") else {}),
                "dockerfile_edits": dg.MetadataValue.md(
                    "\n".join(f"- {e}" for e in meta["dockerfile_edits"]) or "(unchanged image reused)"),
            },
        )
        yield dg.AssetCheckResult(check_name="torch_is_pinned_cuda_build", passed=out.passed,
                                  severity=dg.AssetCheckSeverity.ERROR, description=out.check_text)

    @dg.asset(
        group_name="2_images",
        kinds={"docker", "ssh"},
        code_version=cv[steps.SERVING_IMAGE],
        pool=steps.BUILD_POOL,
        check_specs=[dg.AssetCheckSpec(
            "int8_lm_head_present", asset=steps.SERVING_IMAGE, blocking=True,
            description="Blocking: patch 03's INT8 LM head v2 marker is in the serving image's vLLM "
                        "logits_processor.py; a failure stops the copies to the nodes.")],
        description="Step 4: the serving image (recipe's Dockerfile.v2 + the starlette/fastapi pin). Skipped while "
                    "its marker on the build host names the tagged image, the same pins and the same base image "
                    "(no image label needed: a hand-built image is adopted, not rebuilt).",
    )
    @retry_unreachable(fleet.ssh)
    def serving_image(context: dg.AssetExecutionContext, ssh: FleetSSH, base_image: BuiltImage):
        s = step_session(context, ssh)
        out = images_runbook.serving_image(s, cv, base_image)
        yield dg.Output(
            out.image,
            data_version=dg.DataVersion(out.image.image_id),
            metadata={"image_id": out.image.image_id, "base_image_id": base_image.image_id, "skipped": out.skipped,
                      **({"build_output": dg.MetadataValue.path(out.metadata["build_output"])}
                         if out.metadata.get("build_output") else {})},
        )
        yield dg.AssetCheckResult(check_name="int8_lm_head_present", passed=out.passed,
                                  severity=dg.AssetCheckSeverity.ERROR, description=out.check_text)

    build_job = dg.define_asset_job(
        steps.BUILD_JOB,
        selection=dg.AssetSelection.assets("base_model", "hybrid_checkpoint", "mtp_weights", "base_image",
                                           "serving_image"),
        description="Steps 0-4 on the build host: base model, hybrid checkpoint, MTP weights, base and serving "
                    "images. Each step re-verifies its output and skips the heavy work when nothing changed.",
        # The instance's run queue lets one run with this tag go at a time (team/dagster.yaml).
        tags={steps.BUILD_TAG: "build-host", **max_runtime(fleet, steps.BUILD_JOB)})
    return dg.Definitions(assets=[base_image, serving_image], jobs=[build_job])
