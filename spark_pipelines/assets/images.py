"""Runbook step 3 (base image from spark-vllm-docker, NOT install.sh's build path) and the serving image.

The Dockerfile edits come from core/dockerfile.py, each refusing to go on when its anchor is gone
(a silent sed no-op would build the wrong torch or miss a patch).
"""


import dagster as dg

from spark_pipelines.assets import retry_unreachable, step_session
from spark_pipelines.core import steps
from spark_pipelines.core import dockerfile as dockerfile_core
from spark_pipelines.core import layout
from spark_pipelines.core.artifacts import BuiltImage
from spark_pipelines.core import remote
from spark_pipelines.core.pins import code_versions
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.state import markers
from spark_pipelines.runbook.build_steps import checkout

# Patch 03's marker: proves the INT8 LM head v2 is baked into the serving image.
LMHEAD_MARKER = "DGX_SPARK_INT8_LMHEAD_V2"
SIGNATURE_LABEL = "org.spark-pipelines.signature"

TORCH_VERSION_PY = "import torch; print(torch.__version__)"
LMHEAD_PY = (
    "import os, vllm; p = os.path.join(os.path.dirname(vllm.__file__), 'model_executor', 'layers', "
    "'logits_processor.py'); print('FOUND' if '" + LMHEAD_MARKER + "' in open(p).read() else 'MISSING')"
)


def _torch_pins(fleet: Fleet) -> dockerfile_core.TorchPins:
    return dockerfile_core.TorchPins.of(fleet.pins.torch)


def image_definitions(fleet: Fleet) -> dg.Definitions:
    cv = code_versions(fleet)
    base_tag = f"{fleet.pins.build.base_tag}:latest"

    @dg.asset(
        group_name="2_images",
        kinds={"docker", "ssh"},
        code_version=cv[steps.BASE_IMAGE],
        check_specs=[dg.AssetCheckSpec(
            "torch_is_pinned_cuda_build", asset=steps.BASE_IMAGE, blocking=True,
            description="Blocking: torch in the base image is the pinned +cu build (uv did not swap it, which fails "
                        "at serve time with the libtorch_cuda.so ImportError); a failure stops the serving image.")],
        description="Step 3: vLLM base image (spark-vllm-docker at its pin, edited Dockerfile, pinned vLLM ref).",
    )
    @retry_unreachable(fleet.ssh)
    def base_image(context: dg.AssetExecutionContext, ssh: FleetSSH):
        s = step_session(context, ssh)
        f = s.fleet
        node = f.build_node
        docker = NodeDocker(s)
        sig = markers.signature(cv[steps.BASE_IMAGE])
        current = docker.image_id(node.name, base_tag)
        marker = markers.matches(s, node, steps.BASE_IMAGE, sig)
        skipped = bool(marker and current and marker.get("image_id") == current)
        edits: list[dockerfile_core.EditRecord] = []
        build_output: str | None = None
        if not skipped:
            build_dir = layout.build_repo_dir(node)
            recipe = layout.recipe_dir(node)
            checkout(s, node, f.pins.build_repo, build_dir)
            checkout(s, node, f.pins.recipe_repo, recipe)
            original = s.read_text(node.name, f"{build_dir}/Dockerfile")
            patches = [dockerfile_core.LocalPatch(p.name) for p in f.pins.patches]
            try:
                edited, edits = dockerfile_core.apply_build_edits(original, _torch_pins(f), patches)
            except dockerfile_core.DockerfileEditError as e:
                raise dg.Failure(description=f"{node.name}: {e} (build repo {f.pins.build_repo.commit})") from None
            s.put_text(node.name, f"{build_dir}/Dockerfile", edited)
            for pin, patch in zip(f.pins.patches, patches):
                s.run(node.name, ["cp", f"{recipe}/{pin.path}", f"{build_dir}/{patch.file_name}"])
            argv = ["env", "-C", build_dir, "./build-and-copy.sh", "-t", f.pins.build.base_tag,
                    "--vllm-ref", f.pins.vllm_ref, "-j", str(f.pins.build.jobs)]
            if f.pins.build.tf5:
                argv.insert(argv.index("-j"), "--tf5")
            build_output = s.run(node.name, argv, timeout=remote.IMAGE_BUILD_TIMEOUT_S).output_path
            current = docker.image_id(node.name, base_tag)
            if not current:
                raise dg.Failure(description=f"{node.name}: build-and-copy.sh finished but {base_tag} does not exist")
        version = s.run(
            node.name, ["docker", "run", "--rm", "--entrypoint", "python3", base_tag, "-c", TORCH_VERSION_PY], log=False
        ).stdout.strip().splitlines()[-1]
        ok = version == f.pins.torch.torch and "+cu" in version
        if ok and not skipped:
            markers.write(s, node, steps.BASE_IMAGE, sig, image_id=current)
        yield dg.Output(
            BuiltImage(node=node.name, ref=base_tag, image_id=current, torch=version),
            data_version=dg.DataVersion(current),
            metadata={
                "image_id": current,
                "torch": version,
                "vllm_ref": f.pins.vllm_ref,
                "skipped": skipped,
                **({"build_output": dg.MetadataValue.path(build_output)} if not skipped and build_output else {}),
                "dockerfile_edits": dg.MetadataValue.md(
                    "\n".join(f"- {e.edit}: {e.detail}" for e in edits) or "(unchanged image reused)"
                ),
            },
        )
        yield dg.AssetCheckResult(
            check_name="torch_is_pinned_cuda_build",
            passed=ok,
            severity=dg.AssetCheckSeverity.ERROR,
            description=(
                f"torch {version} in the image"
                if ok
                else f"torch in the image is {version!r}, expected {f.pins.torch.torch}: uv swapped torch "
                "(libtorch_cuda.so ImportError at serve time) or the pin edit did not apply"
            ),
        )

    @dg.asset(
        group_name="2_images",
        kinds={"docker", "ssh"},
        code_version=cv[steps.SERVING_IMAGE],
        check_specs=[dg.AssetCheckSpec(
            "int8_lm_head_present", asset=steps.SERVING_IMAGE, blocking=True,
            description="Blocking: patch 03's INT8 LM head v2 marker is in the serving image's vLLM "
                        "logits_processor.py; a failure stops the copies to the nodes.")],
        description="Step 4: the serving image (recipe's Dockerfile.v2 + the starlette/fastapi pin).",
    )
    @retry_unreachable(fleet.ssh)
    def serving_image(context: dg.AssetExecutionContext, ssh: FleetSSH, base_image: BuiltImage):
        s = step_session(context, ssh)
        f = s.fleet
        node = f.build_node
        docker = NodeDocker(s)
        image = f.launch.image
        sig = markers.signature(cv[steps.SERVING_IMAGE], base_image.image_id)
        labels = docker.image_labels(node.name, image) if docker.image_id(node.name, image) else {}
        skipped = labels.get(SIGNATURE_LABEL) == sig
        if not skipped:
            recipe = layout.recipe_dir(node)
            checkout(s, node, f.pins.recipe_repo, recipe)
            path = f"{recipe}/docker/Dockerfile.v2"
            pins = dockerfile_core.ServingPins.of(f.pins.serving)
            try:
                edited = dockerfile_core.pin_serving_deps(s.read_text(node.name, path), pins)
            except dockerfile_core.DockerfileEditError as e:
                raise dg.Failure(description=f"{node.name}: {e}") from None
            s.put_text(node.name, path, edited)
            s.run(node.name, ["env", "-C", recipe, "docker", "build", "--build-arg", f"VLLM_BASE={base_tag}",
                              "--label", f"{SIGNATURE_LABEL}={sig}", "-t", image, "-f", "docker/Dockerfile.v2", "."],
                  timeout=remote.IMAGE_BUILD_TIMEOUT_S)
        image_id = docker.image_id(node.name, image)
        probe = s.run(node.name, ["docker", "run", "--rm", "--entrypoint", "python3", image, "-c", LMHEAD_PY], log=False)
        found = probe.stdout.strip().endswith("FOUND")
        yield dg.Output(
            BuiltImage(node=node.name, ref=image, image_id=image_id),
            data_version=dg.DataVersion(image_id),
            metadata={"image_id": image_id, "base_image_id": base_image.image_id, "skipped": skipped},
        )
        yield dg.AssetCheckResult(
            check_name="int8_lm_head_present",
            passed=found,
            severity=dg.AssetCheckSeverity.ERROR,
            description=(
                f"{LMHEAD_MARKER} found in logits_processor.py"
                if found
                else f"{LMHEAD_MARKER} missing: patch 03 did not apply; rebuild the serving image from the recipe pin"
            ),
        )

    build_job = dg.define_asset_job(
        steps.BUILD_JOB,
        selection=dg.AssetSelection.assets(steps.BASE_MODEL, steps.HYBRID_CHECKPOINT, steps.MTP_WEIGHTS, steps.BASE_IMAGE,
                                           steps.SERVING_IMAGE),
        description="Steps 0-4 on the build host: base model, hybrid checkpoint, MTP weights, base and serving "
                    "images. Each step re-verifies its output and skips the heavy work when nothing changed.",
        # The instance's run queue lets one run with this tag go at a time (team/dagster.yaml).
        tags={steps.BUILD_TAG: "build-host"})
    return dg.Definitions(assets=[base_image, serving_image], jobs=[build_job])
