"""Runbook steps 3-4 on the build host as procedures: the vLLM base image (spark-vllm-docker at
its pin, the Dockerfile edits, build-and-copy.sh; NOT install.sh's build path) and the serving
image (the recipe's docker/Dockerfile.v2 with the starlette/fastapi pin).

Both skip on a marker on the build host (the image id and the signature of the inputs it was
built from), never on an image label: a hand-built image carries none, and rebuilding it only to
add one gives it a new id, which is then copied whole to every node again. What each image holds
is read from the image itself (`probe_image`: the torch triple, patch 03's INT8 LM head marker,
the build metadata build-and-copy.sh keeps in it), for the blocking checks and for adoption.

The Dockerfile edits come from core/dockerfile.py, each refusing to go on when its anchor is gone
(a silent sed no-op would build the wrong torch or miss a patch).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import dockerfile as dockerfile_core
from spark_pipelines.core import layout, remote
from spark_pipelines.core.artifacts import BuiltImage
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.core.fleet import Fleet, Node
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.ssh import FleetSession, RemoteCommandError
from spark_pipelines.runbook.build_steps import checkout
from spark_pipelines.state import markers

BASE_IMAGE, SERVING_IMAGE = "base_image", "serving_image"
# Patch 03's marker: proves the INT8 LM head v2 is baked into the serving image.
LMHEAD_MARKER = "DGX_SPARK_INT8_LMHEAD_V2"
# Put on the images this tool builds, for a person reading `docker inspect`; no step reads it
# except to recognise an image built before the serving_image marker existed.
SIGNATURE_LABEL = "org.spark-pipelines.signature"
BUILD_METADATA = "/workspace/build-metadata.yaml"  # written by build-and-copy.sh, kept in the image
IMAGE_PROBE_TIMEOUT_S = 180  # a throwaway container importing torch and vLLM

# One container run reads everything a check or adoption needs from an image.
PROBE_PY = (
    "import json, os\n"
    "out = {}\n"
    "for m in ('torch', 'torchvision', 'torchaudio', 'starlette', 'fastapi'):\n"
    "    try:\n"
    "        out[m] = __import__(m).__version__\n"
    "    except Exception as e:\n"
    "        out[m] = None\n"
    "        if m.startswith('torch'):\n"
    "            out.setdefault('errors', []).append('%s: %s: %s' % (m, type(e).__name__, e))\n"
    "try:\n"
    "    import vllm\n"
    "    p = os.path.join(os.path.dirname(vllm.__file__), 'model_executor', 'layers', 'logits_processor.py')\n"
    f"    out['lmhead'] = '{LMHEAD_MARKER}' in open(p).read()\n"
    "except Exception as e:\n"
    "    out['lmhead'] = None; out.setdefault('errors', []).append('vllm: %s: %s' % (type(e).__name__, e))\n"
    "try:\n"
    f"    out['build_metadata'] = open('{BUILD_METADATA}').read()\n"
    "except OSError:\n"
    "    out['build_metadata'] = None\n"
    "print(json.dumps(out))\n"
)


@dataclass(frozen=True)
class ImageProbe:
    """What an image holds, read from a throwaway container of it."""

    torch: str | None = None
    torchvision: str | None = None
    torchaudio: str | None = None
    starlette: str | None = None
    fastapi: str | None = None
    lmhead: bool | None = None  # None: vLLM could not be read
    build_metadata: dict[str, str] = field(default_factory=dict)
    errors: tuple[str, ...] = ()

    @property
    def vllm_ref(self) -> str | None:
        return self.build_metadata.get("vllm_ref")


def parse_build_metadata(text: str | None) -> dict[str, str]:
    """build-metadata.yaml's flat `key: value` lines (nested under build_args or not)."""
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        key, sep, value = line.strip().partition(":")
        value = value.strip().strip('"')
        if sep and value:
            out[key.strip()] = value
    return out


def probe_image(session: FleetSession, node: Node, ref: str) -> ImageProbe:
    r = session.run(node.name, ["docker", "run", "--rm", "--entrypoint", "python3", ref, "-c", PROBE_PY],
              check=False, log=False, timeout=IMAGE_PROBE_TIMEOUT_S)
    lines = r.stdout.strip().splitlines()
    try:
        data = json.loads(lines[-1])
    except (IndexError, ValueError):
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return ImageProbe(errors=(f"python3 in {ref} did not run: {tail[:300]}",))
    return ImageProbe(torch=data.get("torch"), torchvision=data.get("torchvision"), torchaudio=data.get("torchaudio"),
                      starlette=data.get("starlette"), fastapi=data.get("fastapi"), lmhead=data.get("lmhead"), build_metadata=parse_build_metadata(data.get("build_metadata")),
                      errors=tuple(data.get("errors") or ()))


def torch_differences(probe: ImageProbe, fleet: Fleet) -> list[str]:
    """The torch triple (and the vLLM ref, transformers 5 flag when the image says) against the pins."""
    p = fleet.pins
    out = []
    for name in ("torch", "torchvision", "torchaudio"):
        have, want = getattr(probe, name), getattr(p.torch, name)
        if have != want:
            out.append(f"{name}: {have or 'does not import'} (pins.torch: {want})")
    ref = probe.vllm_ref
    if ref is not None and not (ref.startswith(p.vllm_ref) or p.vllm_ref.startswith(ref)):
        out.append(f"vLLM ref: {ref} (pins.vllm_ref: {p.vllm_ref})")
    tf5 = probe.build_metadata.get("transformers_5")
    if tf5 is not None and (tf5 == "true") != p.build.tf5:
        out.append(f"transformers 5: {tf5} (pins.build.tf5: {str(p.build.tf5).lower()})")
    return out


def torch_advice(probe: ImageProbe, fleet: Fleet, tag: str) -> str:
    """What mends a base image whose torch is not the pinned +cu build (no marker was written, so
    the next build_job builds it again: this says what must change first)."""
    p = fleet.pins
    commit = p.build_repo.commit[:12]
    v = probe.torch
    if v is None:
        why = "; ".join(probe.errors) or "it does not import"
        return (f"torch does not import in {tag} ({why}): an ABI or wheel mix between the build stages; the Dockerfile "
                f"edits (core/dockerfile.py) pin the same triple in both stages and guard it with --override, so "
                f"check that they still apply to spark-vllm-docker at pins.build_repo {commit}, then rerun build_job")
    if v.endswith("+cpu"):
        return (f"torch in {tag} is {v}: uv replaced the pinned CUDA wheel by the CPU one (libtorch_cuda.so "
                f"ImportError at serve time); the --override guard did not hold at pins.build_repo {commit}: check "
                "the Dockerfile edits, then rerun build_job")
    return (f"torch in {tag} is {v}, the fleet pins {p.torch.torch}: the torch pin edit did not apply to the "
            f"Dockerfile at pins.build_repo {commit}, or pins.torch names a build the index {p.torch.index_url} does "
            "not have; fix the pin or the build repo, then rerun build_job")


def serving_differences(probe: ImageProbe, fleet: Fleet) -> list[str]:
    """Patch 03's marker and the starlette/fastapi pins of the runbook's Dockerfile.v2 edit."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    out = []
    if probe.lmhead is not True:
        out.append(f"{LMHEAD_MARKER}: {'missing' if probe.lmhead is False else 'vLLM unreadable'} in logits_processor.py")
    for name in ("starlette", "fastapi"):
        have, want = getattr(probe, name), getattr(fleet.pins.serving, name)
        try:
            ok = have is not None and Version(have) in SpecifierSet(want)
        except (InvalidSpecifier, InvalidVersion):
            ok = False
        if not ok:
            out.append(f"{name}: {have or 'not installed'} (pins.serving: {want})")
    return out


def image_layers(session: FleetSession, node: Node, ref: str) -> list[str]:
    r = session.run(node.name, ["docker", "image", "inspect", "--format", "{{json .RootFS.Layers}}", ref], check=False,
              log=False, timeout=remote.PROBE_TIMEOUT_S)
    try:
        return list(json.loads(r.stdout.strip() or "[]") or []) if r.ok else []
    except ValueError:
        return []


def lmhead_advice(fleet: Fleet, tag: str, probe: ImageProbe, build_output: str | None) -> str:
    p = fleet.pins
    if probe.lmhead is None:
        return (f"vLLM could not be read in {tag} ({'; '.join(probe.errors) or 'no output'}): the serving image is "
                "broken; rerun build_job after checking the base image")
    where = f" (build output: {build_output})" if build_output else ""
    return (f"{LMHEAD_MARKER} missing from vLLM's logits_processor.py in {tag}: patch 03 "
            f"(patches/03-int8-lm-head/patch_int8_lmhead.py, run by docker/Dockerfile.v2) did not apply at the recipe "
            f"commit {p.recipe_repo.commit[:12]} on the base image's vLLM {p.vllm_ref}{where}. Rebuilding from the "
            "same pins gives the same image: fix pins.recipe_repo or pins.vllm_ref, then rerun build_job")


@dataclass(frozen=True)
class ImageOutcome:
    image: BuiltImage
    skipped: bool
    passed: bool  # the blocking check
    check_text: str
    probe: ImageProbe
    metadata: dict[str, Any] = field(default_factory=dict)


def base_image_signature(cv: dict[str, str]) -> str:
    return markers.signature(cv[BASE_IMAGE])


def serving_image_signature(cv: dict[str, str], base_image_id: str) -> str:
    return markers.signature(cv[SERVING_IMAGE], base_image_id)


def write_base_image_marker(session: FleetSession, node: Node, sig: str, image_id: str, torch: str | None) -> None:
    markers.write(session, node, BASE_IMAGE, sig, image_id=image_id, torch=torch)


def write_serving_image_marker(session: FleetSession, node: Node, sig: str, image_id: str) -> None:
    markers.write(session, node, SERVING_IMAGE, sig, image_id=image_id)


def base_tag(fleet: Fleet) -> str:
    return f"{fleet.pins.build.base_tag}:latest"


def torch_ok(probe: ImageProbe, fleet: Fleet) -> bool:
    return probe.torch == fleet.pins.torch.torch and "+cu" in (probe.torch or "")


# ------------------------------------------------------------------------------ step 3


def build_base_image(session: FleetSession, node: Node) -> tuple[str | None, list[dockerfile_core.EditRecord]]:
    """spark-vllm-docker at its pin, the Dockerfile edits, the patch diffs, build-and-copy.sh:
    (the build's output file, the edits made). Raises RunbookError."""
    fleet = session.fleet
    build_dir = layout.build_repo_dir(node)
    recipe = layout.recipe_dir(node)
    checkout(session, node, fleet.pins.build_repo, build_dir)
    checkout(session, node, fleet.pins.recipe_repo, recipe)
    original = session.read_text(node.name, f"{build_dir}/Dockerfile")
    patches = [dockerfile_core.LocalPatch(p.name) for p in fleet.pins.patches]
    try:
        edited, edits = dockerfile_core.apply_build_edits(original, dockerfile_core.TorchPins.of(fleet.pins.torch), patches)
    except dockerfile_core.DockerfileEditError as e:
        raise RunbookError(f"{node.name}: {e} (build repo {fleet.pins.build_repo.commit})") from None
    session.put_text(node.name, f"{build_dir}/Dockerfile", edited)
    for pin, patch in zip(fleet.pins.patches, patches):
        session.run(node.name, ["cp", f"{recipe}/{pin.path}", f"{build_dir}/{patch.file_name}"])
    argv = ["env", "-C", build_dir, "./build-and-copy.sh", "-t", fleet.pins.build.base_tag,
            "--vllm-ref", fleet.pins.vllm_ref, "-j", str(fleet.pins.build.jobs)]
    if fleet.pins.build.tf5:
        argv.insert(argv.index("-j"), "--tf5")
    try:
        output = session.run(node.name, argv, timeout=remote.IMAGE_BUILD_TIMEOUT_S).output_path
    except RemoteCommandError as e:
        raise RunbookError(f"{node.name}: build-and-copy.sh failed ({first_line(e)}); fix what its output says "
                           "(an edit that no longer fits the build repo, a pin the index lacks), then rerun build_job",
                           {"last output": f"```\n{e.tail[-3000:]}\n```"}) from None
    return output, edits


def base_image(session: FleetSession, cv: dict[str, str]) -> ImageOutcome:
    """Step 3: skip when the marker's signature and image id match the tagged image; else build.
    The torch triple is read from the image either way (the blocking check)."""
    fleet = session.fleet
    node = fleet.build_node
    tag = base_tag(fleet)
    docker = NodeDocker(session)
    sig = base_image_signature(cv)
    current = docker.image_id(node.name, tag)
    marker = markers.matches(session, node, BASE_IMAGE, sig)
    skipped = bool(marker and current and marker.get("image_id") == current)
    meta: dict[str, Any] = {}
    edits: list[dockerfile_core.EditRecord] = []
    if not skipped:
        output, edits = build_base_image(session, node)
        meta["build_output"] = output
        current = docker.image_id(node.name, tag)
        if not current:
            raise RunbookError(f"{node.name}: build-and-copy.sh finished but {tag} does not exist; "
                               "check its output for the tag it built, then rerun build_job")
    assert current is not None
    probe = probe_image(session, node, tag)
    ok = torch_ok(probe, fleet)
    if ok and not skipped:
        write_base_image_marker(session, node, sig, current, probe.torch)
    meta["dockerfile_edits"] = [f"{e.edit}: {e.detail}" for e in edits]
    text = f"torch {probe.torch} in the image" if ok else torch_advice(probe, fleet, tag)
    return ImageOutcome(BuiltImage(node=node.name, ref=tag, image_id=current, torch=probe.torch), skipped, ok, text,
                        probe, meta)


# ------------------------------------------------------------------------------ step 4


def build_serving_image(session: FleetSession, node: Node, sig: str) -> str | None:
    fleet = session.fleet
    recipe = layout.recipe_dir(node)
    checkout(session, node, fleet.pins.recipe_repo, recipe)
    path = f"{recipe}/docker/Dockerfile.v2"
    try:
        edited = dockerfile_core.pin_serving_deps(session.read_text(node.name, path), dockerfile_core.ServingPins.of(fleet.pins.serving))
    except dockerfile_core.DockerfileEditError as e:
        raise RunbookError(f"{node.name}: {e} (recipe {fleet.pins.recipe_repo.commit})") from None
    session.put_text(node.name, path, edited)
    try:
        return session.run(node.name, ["env", "-C", recipe, "docker", "build", "--build-arg", f"VLLM_BASE={base_tag(fleet)}",
                                 "--label", f"{SIGNATURE_LABEL}={sig}", "-t", fleet.launch.image, "-f",
                                 "docker/Dockerfile.v2", "."], timeout=remote.IMAGE_BUILD_TIMEOUT_S).output_path
    except RemoteCommandError as e:
        raise RunbookError(f"{node.name}: docker build of {fleet.launch.image} failed ({first_line(e)}); fix what its "
                           "output says, then rerun build_job", {"last output": f"```\n{e.tail[-3000:]}\n```"}) from None


def serving_image(session: FleetSession, cv: dict[str, str], base: BuiltImage) -> ImageOutcome:
    """Step 4: skip when the serving_image marker's signature (inputs + base image id) and image
    id match the tagged image; else build. Patch 03's marker is read from the image either way."""
    fleet = session.fleet
    node = fleet.build_node
    image = fleet.launch.image
    docker = NodeDocker(session)
    sig = serving_image_signature(cv, base.image_id)
    image_id = docker.image_id(node.name, image)
    marker = markers.matches(session, node, SERVING_IMAGE, sig)
    skipped = bool(marker and image_id and marker.get("image_id") == image_id)
    probe: ImageProbe | None = None
    if not skipped and not marker and image_id and docker.image_labels(node.name, image).get(SIGNATURE_LABEL) == sig:
        # Built by a version of this tool that kept the signature in the label only: take it over.
        probe = probe_image(session, node, image)
        if probe.lmhead:
            write_serving_image_marker(session, node, sig, image_id)
            skipped = True
    meta: dict[str, Any] = {}
    if not skipped:
        meta["build_output"] = build_serving_image(session, node, sig)
        image_id = docker.image_id(node.name, image)
        if not image_id:
            raise RunbookError(f"{node.name}: docker build finished but {image} does not exist; rerun build_job")
        probe = None
    assert image_id is not None
    probe = probe or probe_image(session, node, image)
    found = bool(probe.lmhead)
    if found and not skipped:
        write_serving_image_marker(session, node, sig, image_id)
    text = (f"{LMHEAD_MARKER} found in logits_processor.py" if found
            else lmhead_advice(fleet, image, probe, meta.get("build_output")))
    return ImageOutcome(BuiltImage(node=node.name, ref=image, image_id=image_id), skipped, found, text, probe, meta)
