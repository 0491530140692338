"""First contact with a build host and its copies that spark-pipelines did not build: steps 0-4
(base model, hybrid checkpoint, MTP weights, base and serving images) and a serve node's copy of
the checkpoint and image, judged by content, recorded as if the steps had run.

For each step: what is there (nothing, a marker of ours, or the runbook's hand-built artifact), and
what the step itself would verify, read by content: the snapshot's revision, index, shard headers,
the 144 FP8 scales, the MTP keys, the tie of the checkpoint to that base model (same tensors,
the MTP file byte for byte), the images' ids, the torch triple and the vLLM ref in the base image,
patch 03's INT8 LM head marker and the starlette/fastapi pins in the serving image, built FROM
that base image. Equal to the pins -> "adopt": the markers (and the checkpoint's manifest) are
written exactly as the steps write them, through the steps' own functions, so the next build_job
skips every step and copies nothing. Already ours -> "current". Different -> "differs", field by
field, nothing written. Absent or not verifiable -> "build". `check=True` writes nothing.

Where the runbook puts the base model: `hf download Intel/Qwen3.5-122B-A10B-int4-AutoRound` (the
recipe's install.sh, step 0) has no --local-dir, so the snapshot is in the user's Hugging Face
cache, `~/.cache/huggingface/hub/models--Intel--Qwen3.5-122B-A10B-int4-AutoRound/snapshots/<sha>/`,
and the snapshot directory's name is the commit it was downloaded at (`refs/main` names the
commit `main` resolved to then). It is adopted where it is: the base_model marker records the
path, and the step reads the snapshot there from then on (no 75 GB copy).
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Mapping
from typing import Any

from spark_pipelines.core import checkpoint as checkpoint_core
from spark_pipelines.core import jit_cache as jit_core
from spark_pipelines.core import layout, names
from spark_pipelines.core import versions as versions_core
from spark_pipelines.core.adoption import ADOPT, BUILD, CURRENT, DIFFERS, Finding
from spark_pipelines.core.artifacts import BuiltImage, Checkpoint, ModelSnapshot, NodeArtifacts
from spark_pipelines.core.fleet import Node
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.hub import HubError, ModelHub
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.resources.transfer import (DIGEST_TIMEOUT_S, NodeStreams, checkpoint_script, digests_on_node,
                                                hash_progress, write_manifest)
from spark_pipelines.runbook import images as img
from spark_pipelines.runbook import model as mdl
from spark_pipelines.runbook import versions
from spark_pipelines.runbook.build_steps import (content_check, head_commit, index_digests, manifest_text, staging_dir,
                                                 verify_on_node)
from spark_pipelines.state import markers

NODE_ARTIFACTS = "node_artifacts"
HF_CACHE = "~/.cache/huggingface/hub"  # huggingface_hub's default cache, where `hf download` puts snapshots


def hf_snapshot_dir(session: FleetSession, node: Node, repo: str, revision: str) -> str:
    return session.expand(node.name, f"{HF_CACHE}/models--{repo.replace('/', '--')}/snapshots/{revision}")


def _facts(output: Any, data_version: str, code_version: str, **more: Any) -> dict[str, Any]:
    return {"output": {"type": type(output).__name__, **output.__dict__}, "data_version": data_version,
            "code_version": code_version, **more}


_TYPES = {t.__name__: t for t in (ModelSnapshot, Checkpoint, BuiltImage, NodeArtifacts)}


def asset_value(finding: Finding) -> ModelSnapshot | Checkpoint | BuiltImage | NodeArtifacts | None:
    """The typed output the step's asset would have returned (for recording it on the Dagster
    instance with finding.facts["data_version"] and ["code_version"]); None without one."""
    out = dict(finding.facts.get("output") or {})
    kind = _TYPES.get(str(out.pop("type", "")))
    return kind(**out) if kind else None


def _revision(session: FleetSession, node: Node, hub: ModelHub | None) -> tuple[str | None, str]:
    """The pinned base model revision as a commit sha, and how it was known."""
    pin = session.fleet.pins.base_model
    if names.FULL_SHA.match(pin.revision):
        return pin.revision, "pinned by sha"
    if hub is not None:
        try:
            return hub.resolve(pin.repo, pin.revision), f"{pin.revision} resolved on the hub"
        except HubError as e:
            return None, str(e)
    ref = session.expand(node.name, f"{HF_CACHE}/models--{pin.repo.replace('/', '--')}/refs/{pin.revision}")
    if session.exists(node.name, ref):
        return session.read_text(node.name, ref).strip(), f"{pin.revision} as the HF cache resolved it ({ref})"
    return None, f"pins.base_model.revision {pin.revision} is not a commit sha and no hub was given to resolve it"


def _local_dir_revision(session: FleetSession, node: Node, directory: str) -> str | None:
    """The commit an `hf download --local-dir` fetched, from huggingface_hub's metadata files
    (`.cache/huggingface/download/<file>.metadata`, first line); None when absent or mixed."""
    meta = f"{directory}/.cache/huggingface/download"
    if not session.exists(node.name, meta):
        return None
    r = session.run(node.name, ["sh", "-c", 'for f in "$1"/*.metadata; do head -n 1 "$f"; done', "sh", meta],
              check=False, log=False, timeout=60)
    shas = {ln.strip() for ln in r.stdout.splitlines() if ln.strip()}
    return shas.pop() if len(shas) == 1 else None


# ------------------------------------------------------------------------------ steps 0-2


def _base_model(session: FleetSession, cv: Mapping[str, str], hub: ModelHub | None, check: bool) -> Finding:
    f = session.fleet
    node = f.build_node
    pin = f.pins.base_model
    step = mdl.BASE_MODEL
    sha, how = _revision(session, node, hub)
    if sha is None:
        return Finding(node.name, step, BUILD, how)
    sig = mdl.base_model_signature(dict(cv), sha)

    def found(path: str, action: str, why: str) -> Finding:
        snap = ModelSnapshot(node.name, path, pin.repo, sha)
        return Finding(node.name, step, action, why, facts=_facts(snap, sha, cv[step], signature=sig))

    marker = markers.matches(session, node, step, sig)
    if marker:
        where = str(marker.get("path") or layout.base_model_dir(f, node))
        if verify_on_node(session, node, where, expected_scales=0, require_mtp=False).ok:
            return found(where, CURRENT, f"{pin.repo}@{sha[:12]} at {where}, recorded")
    candidates = [(hf_snapshot_dir(session, node, pin.repo, sha), "the HF cache snapshot `hf download` made"),
                  (layout.base_model_dir(f, node), "the step's --local-dir")]
    for path, what in candidates:
        if not session.exists(node.name, path):
            continue
        report = verify_on_node(session, node, path, expected_scales=0, require_mtp=False)
        if not report.ok:
            return Finding(node.name, step, BUILD, f"{path} ({what}) does not verify: {report.problems[0]}; "
                           "the step downloads what is missing")
        provenance = mdl.PROVEN
        if path == candidates[1][0]:
            seen = _local_dir_revision(session, node, path)
            if seen is not None and seen != sha:
                return Finding(node.name, step, DIFFERS, f"{path} was downloaded at another revision",
                               (f"revision: {seen[:12]} (pins.base_model.revision: {sha[:12]})",))
            if seen is None:
                # Copied without huggingface_hub's metadata (rsync between machines leaves none): its
                # content verifies, its revision cannot be proven here. Adopted as the pinned one and
                # said so; the next build_job's base_model proves it (hf download checks every file
                # against the hub by content and fetches only what differs) before anything is built.
                provenance = mdl.UNKNOWN
        if not check:
            mdl.write_base_model_marker(session, node, sig, sha, path, provenance=provenance)
        why = f"{pin.repo}@{sha[:12]} at {path} ({what}; {how}): index and shard headers verify"
        if provenance == mdl.UNKNOWN:
            why += ("; provenance unknown (no huggingface_hub metadata: the revision it was downloaded at cannot be "
                    "proven; build_job's base_model proves it by content before any rebuild, nothing that serves "
                    "is touched)")
        f = found(path, ADOPT, why)
        f.facts["provenance"] = provenance
        return f
    others = session.run(node.name, ["ls", "-1", hf_snapshot_dir(session, node, pin.repo, "")], check=False, log=False, timeout=60)
    held = [x for x in others.stdout.split() if x != sha] if others.ok else []
    if held:
        return Finding(node.name, step, DIFFERS, f"{pin.repo} is in the HF cache at another revision",
                       (f"revision: {', '.join(h[:12] for h in held)} (pins.base_model.revision: {sha[:12]})",))
    return Finding(node.name, step, BUILD, f"no {pin.repo} on {node.name}; the step downloads it")


def _hash_manifest(session: FleetSession, node: Node, directory: str, check: bool) -> tuple[str, float, str | None]:
    """The manifest digest of the directory as it is, the seconds it took and the checkpoint's
    architecture (core.jit_cache.architecture); written there (as the step does) unless check."""
    started = time.monotonic()
    if check:
        files = {p: e for p, e in digests_on_node(session, node.name, directory).items() if p != checkpoint_core.MANIFEST_NAME}
        manifest = checkpoint_core.make_manifest(files)
        digest = checkpoint_core.manifest_digest(manifest)
    else:
        manifest, digest = write_manifest(session, node.name, directory)
    return digest, round(time.monotonic() - started, 2), jit_core.architecture(manifest["files"])


def _as_version(session: FleetSession, node: Node, serving: str, manifest: str, check: bool) -> str:
    """Where the adopted checkpoint lives as a version: the runbook's plain directory is renamed to
    the version its manifest names and the path linked to it (nothing copied, the running container
    reads the same files; core/versions.py). In check mode: where it is now."""
    held = versions.read(session, node)
    if held.kind == "link":
        found = held.holds(held.serving) if held.serving else None
        return f"{posixpath.dirname(serving)}/{found.name}" if found else serving
    if held.kind != "dir" or check:  # check mode renames nothing: the checkpoint is still where it is
        return serving
    made = versions.make_version(session, node, manifest)
    return f"{posixpath.dirname(serving)}/{made}" if made else serving


def _checkpoint(session: FleetSession, cv: Mapping[str, str], base: Finding, check: bool) -> list[Finding]:
    """hybrid_checkpoint and mtp_weights: one directory holds both steps' output."""
    fleet = session.fleet
    node = fleet.build_node
    serving = layout.hybrid_dir(fleet, node)
    h, m = mdl.HYBRID, mdl.MTP
    snap = asset_value(base) if base.action in (CURRENT, ADOPT) else None
    if not session.exists(node.name, serving):
        why = f"no checkpoint at {serving}; the steps build it"
        return [Finding(node.name, h, BUILD, why), Finding(node.name, m, BUILD, why)]
    if not isinstance(snap, ModelSnapshot):
        why = ("the base model it must come from is not on the build host at the pinned revision: the steps rebuild "
               "it beside the serving checkpoint once base_model downloaded it")
        return [Finding(node.name, h, BUILD, why), Finding(node.name, m, BUILD, why)]
    sig1 = mdl.hybrid_signature(dict(cv), snap.revision)
    m1 = markers.matches(session, node, h, sig1)
    step1 = verify_on_node(session, node, serving, expected_scales=mdl.EXPECTED_FP8_SCALES, require_mtp=False)
    full = verify_on_node(session, node, serving, expected_scales=mdl.EXPECTED_FP8_SCALES, require_mtp=True)
    if m1 and m1.get("staged"):
        why = "a rebuild is staged beside the serving checkpoint; mtp_weights finishes and switches it in"
        hyb = Checkpoint(node.name, staging_dir(serving), str(m1["index"]))
        return [Finding(node.name, h, CURRENT, why, facts=_facts(hyb, hyb.index, cv[h], signature=sig1)),
                Finding(node.name, m, BUILD, why)]
    if not step1.ok:
        why = f"{serving} does not verify: {step1.problems[0]}; the steps rebuild it beside"
        return [Finding(node.name, h, BUILD, why), Finding(node.name, m, BUILD, why)]

    # The tie to the base model and the recipe, by content.
    tie = checkpoint_script(session, node.name, [serving, "--compare-source", snap.path], DIGEST_TIMEOUT_S)
    differences = list(tie["differences"])
    if tie.get("source_fp8") and tie["source_fp8"] != fleet.pins.fp8_model.repo:
        differences.append(f"FP8 source: {tie['source_fp8']} (pins.fp8_model.repo: {fleet.pins.fp8_model.repo})")
    recipe_head = head_commit(session, node, layout.recipe_dir(node))
    if recipe_head and recipe_head != fleet.pins.recipe_repo.commit:
        differences.append(f"recipe checkout: {recipe_head[:12]} (pins.recipe_repo.commit: "
                           f"{fleet.pins.recipe_repo.commit[:12]})")
    digests = index_digests(session, node, serving)
    if m1:
        index1 = str(m1["index"])
        hybrid = Finding(node.name, h, CURRENT, f"{serving}: recorded, index and FP8 scales verify",
                         facts=_facts(Checkpoint(node.name, serving, index1), index1, cv[h], signature=sig1))
    elif differences:
        hybrid = Finding(node.name, h, DIFFERS, f"{serving} verifies but is not what the pins build",
                         tuple(differences))
    elif recipe_head is None:
        hybrid = Finding(node.name, h, BUILD, f"no recipe checkout at {layout.recipe_dir(node)}: the recipe commit "
                         f"{serving} was built with is unknown; the step rebuilds it beside")
    else:
        index1 = digests["hybrid"]
        hybrid = Finding(node.name, h, ADOPT, f"{serving}: index, shard headers and {step1.scale_count} FP8 scales "
                         f"verify; same tensors as {snap.repo}@{snap.revision[:12]}, recipe {recipe_head[:12]}",
                         facts=_facts(Checkpoint(node.name, serving, index1), index1, cv[h], signature=sig1))
    if hybrid.action not in (CURRENT, ADOPT):
        return [hybrid, Finding(node.name, m, BUILD if hybrid.action == BUILD else DIFFERS,
                                "follows hybrid_checkpoint", hybrid.differences)]
    index1 = str(hybrid.facts["output"]["index"])
    sig2 = mdl.mtp_signature(dict(cv), index1, snap.revision)
    m2 = markers.matches(session, node, m, sig2)
    if m2 and full.ok:
        c = content_check(session, node, serving, m2.get("manifest"), restore=not check)
        if c.ok:
            where = str(m2.get("path") or serving)
            out = Checkpoint(node.name, where, str(m2["index"]), str(m2.get("manifest") or c.manifest),
                             mdl.architecture_of(session, node, where))
            return [hybrid, Finding(node.name, m, CURRENT, f"{serving}: recorded; {c.files} files hash to the manifest",
                                    facts=_facts(out, f"{out.index}-{(out.manifest or '')[:16]}", cv[m],
                                                 signature=sig2, hash_seconds=c.seconds))]
        return [hybrid, Finding(node.name, m, BUILD, f"recorded, but {c.problems[0]}; the step rebuilds it beside")]
    if not full.ok:
        return [hybrid, Finding(node.name, m, BUILD, f"{full.problems[0]}; mtp_weights adds them beside the serving "
                                "checkpoint and switches it in")]
    if differences:
        return [hybrid, Finding(node.name, m, DIFFERS, "the MTP weights are not the base model's", tuple(differences))]
    manifest, seconds, arch = _hash_manifest(session, node, serving, check)
    index2 = digests["full"]
    where = _as_version(session, node, serving, manifest, check)
    if not check and hybrid.action == ADOPT:
        markers.write(session, node, h, sig1, index=index1, path=where)
    if not check:
        markers.write(session, node, m, sig2, index=index2, manifest=manifest, path=where)
    out = Checkpoint(node.name, where, index2, manifest, arch)
    return [hybrid, Finding(node.name, m, ADOPT, f"{serving}: {full.mtp_keys_mapped} mtp. keys mapped to the base "
                            f"model's {checkpoint_core.MTP_FILE}; manifest of the checkpoint as it is",
                            facts=_facts(out, f"{index2}-{manifest[:16]}", cv[m], signature=sig2,
                                         hash_seconds=seconds))]


# ------------------------------------------------------------------------------ steps 3-4


def _base_image(session: FleetSession, cv: Mapping[str, str], check: bool) -> Finding:
    fleet = session.fleet
    node = fleet.build_node
    tag = img.base_tag(fleet)
    step = img.BASE_IMAGE
    image_id = NodeDocker(session).image_id(node.name, tag)
    if image_id is None:
        return Finding(node.name, step, BUILD, f"no {tag} on {node.name}; the step builds it")
    sig = img.base_image_signature(dict(cv))
    probe = img.probe_image(session, node, tag)

    def facts() -> dict[str, Any]:
        return _facts(BuiltImage(node.name, tag, image_id, probe.torch), image_id, cv[step], signature=sig,
                      vllm_ref=probe.vllm_ref)

    marker = markers.matches(session, node, step, sig)
    if marker and marker.get("image_id") == image_id:
        return Finding(node.name, step, CURRENT, f"{tag} {image_id[7:19]}, recorded; torch {probe.torch}", facts=facts())
    differences = img.torch_differences(probe, fleet)
    commit = probe.build_metadata.get("build_script_commit") or head_commit(session, node, layout.build_repo_dir(node))
    if commit and commit != "unknown" and commit != fleet.pins.build_repo.commit:
        differences.append(f"spark-vllm-docker: {commit[:12]} (pins.build_repo.commit: {fleet.pins.build_repo.commit[:12]})")
    if differences:
        return Finding(node.name, step, DIFFERS, f"{tag} {image_id[7:19]} is not what the pins build",
                       tuple(differences))
    if not check:
        img.write_base_image_marker(session, node, sig, image_id, probe.torch)
    ref = f"vLLM {probe.vllm_ref}" if probe.vllm_ref else "vLLM ref not recorded in the image"
    return Finding(node.name, step, ADOPT, f"{tag} {image_id[7:19]}: torch triple {probe.torch} / {probe.torchvision} / "
                   f"{probe.torchaudio}, {ref}", facts=facts())


def _serving_image(session: FleetSession, cv: Mapping[str, str], base: Finding, check: bool) -> Finding:
    fleet = session.fleet
    node = fleet.build_node
    image = fleet.launch.image
    step = img.SERVING_IMAGE
    docker = NodeDocker(session)
    image_id = docker.image_id(node.name, image)
    if image_id is None:
        return Finding(node.name, step, BUILD, f"no {image} on {node.name}; the step builds it")
    base_value = asset_value(base) if base.action in (CURRENT, ADOPT) else None
    if not isinstance(base_value, BuiltImage):
        return Finding(node.name, step, BUILD, f"{image} is built FROM the base image, which is not adoptable "
                       f"({base.action}): the step builds both")
    sig = img.serving_image_signature(dict(cv), base_value.image_id)
    out = BuiltImage(node.name, image, image_id)
    facts = _facts(out, image_id, cv[step], signature=sig)
    marker = markers.matches(session, node, step, sig)
    if marker and marker.get("image_id") == image_id:
        return Finding(node.name, step, CURRENT, f"{image} {image_id[7:19]}, recorded", facts=facts)
    probe = img.probe_image(session, node, image)
    differences = img.serving_differences(probe, fleet)
    layers, base_layers = img.image_layers(session, node, image), img.image_layers(session, node, base_value.ref)
    if not base_layers or layers[: len(base_layers)] != base_layers:
        differences.append(f"base: not built FROM {base_value.ref} {base_value.image_id[7:19]} (its layers differ)")
    recipe_head = head_commit(session, node, layout.recipe_dir(node))
    if recipe_head and recipe_head != fleet.pins.recipe_repo.commit:
        differences.append(f"recipe checkout: {recipe_head[:12]} (pins.recipe_repo.commit: "
                           f"{fleet.pins.recipe_repo.commit[:12]})")
    if differences:
        return Finding(node.name, step, DIFFERS, f"{image} {image_id[7:19]} is not what the pins build",
                       tuple(differences))
    if not check:
        img.write_serving_image_marker(session, node, sig, image_id)
    return Finding(node.name, step, ADOPT, f"{image} {image_id[7:19]}: built FROM {base_value.ref}, "
                   f"{img.LMHEAD_MARKER} present, starlette {probe.starlette}, fastapi {probe.fastapi}", facts=facts)


def adopt_build_host(session: FleetSession, code_versions: Mapping[str, str], *, check: bool,
                     hub: ModelHub | None = None) -> list[Finding]:
    """Steps 0-4 on the build host, in chain order: base_model, hybrid_checkpoint, mtp_weights,
    base_image, serving_image. `code_versions`: core.pins.code_versions(fleet) of the loaded
    fleet. `hub` resolves a base model revision that is not pinned by sha (else the HF cache's
    refs/ answer it). Nothing that serves is touched; with check=True nothing is written at all."""
    base = _base_model(session, code_versions, hub, check)
    findings = [base, *_checkpoint(session, code_versions, base, check)]
    base_img = _base_image(session, code_versions, check)
    return [*findings, base_img, _serving_image(session, code_versions, base_img, check)]


# ------------------------------------------------------------------------------ a serve node's copy


def _build_manifest(session: FleetSession, build: Node, mtp: Checkpoint) -> str | None:
    """The build host's manifest text with the digest mtp_weights recorded: its file, or (before
    adoption wrote it, in check mode) the one its content hashes to; None when neither matches."""
    if not mtp.manifest:
        return None
    path = f"{mtp.path}/{checkpoint_core.MANIFEST_NAME}"
    if session.exists(build.name, path):
        text = session.read_text(build.name, path)
        try:
            if checkpoint_core.manifest_digest(checkpoint_core.parse_manifest(text)) == mtp.manifest:
                return text
        except ValueError:
            pass
    files = {p: e for p, e in digests_on_node(session, build.name, mtp.path).items() if p != checkpoint_core.MANIFEST_NAME}
    manifest = checkpoint_core.make_manifest(files)
    return manifest_text(manifest) if checkpoint_core.manifest_digest(manifest) == mtp.manifest else None


def adopt_node_artifacts(session: FleetSession, node: Node, mtp: Checkpoint, serving: BuiltImage,
                         code_versions: Mapping[str, str], *, check: bool) -> Finding:
    """A serve node's checkpoint and serving image against the build host's (`mtp`, `serving`:
    what mtp_weights and serving_image output, e.g. asset_value() of adopt_build_host's findings):
    every file's sha256 against the build host's manifest, the image id equal. Adopted: the build
    host's manifest file is put beside the node's copy (as a copy would bring it) and the
    node_artifacts marker written as assets/nodes.py writes it, so node_artifacts skips."""
    fleet = session.fleet
    build = fleet.build_node
    step = NODE_ARTIFACTS
    serving_path = layout.hybrid_dir(fleet, node)
    # The node's copy as a version of its own (core/versions.py): the version of the build host's
    # manifest when it holds it, else the runbook's plain directory, which adoption renames to it.
    version = versions_core.version_path(serving_path, mtp.manifest) if mtp.manifest else serving_path
    holds = node.name != build.name and bool(mtp.manifest) and versions.read(session, node).holds(mtp.manifest) is not None
    dst = version if holds else serving_path
    node_image = NodeDocker(session).image_id(node.name, serving.ref)
    value = NodeArtifacts(node.name, version if node.name != build.name else mtp.path, serving.ref, node_image,
                          mtp.index, mtp.manifest, mtp.architecture)
    data_version = f"{mtp.index}-{(mtp.manifest or 'none')[:12]}-{(node_image or 'none')[7:19]}"
    facts = _facts(value, data_version, code_versions[step])
    if node.name == build.name:
        verdict = (CURRENT if node_image == serving.image_id else DIFFERS)
        return Finding(node.name, step, verdict, "the build host's own copy (mtp_weights checks it by content)",
                       () if verdict == CURRENT else (f"image: {node_image} (serving_image: {serving.image_id})",),
                       facts=facts)
    sig = markers.signature(code_versions[step], mtp.index, mtp.manifest)
    if not session.exists(node.name, dst) and node_image is None:
        return Finding(node.name, step, BUILD, f"no checkpoint and no {serving.ref} on {node.name}; the step copies them")
    hashed = hash_progress(node.name, dst)
    recorded = markers.matches(session, node, step, sig) and node_image == serving.image_id and NodeStreams(session).verify_tree(
        build.name, node.name, mtp.path, dst, manifest=mtp.manifest, progress=hashed).ok
    if hashed.done:  # how long the hash took, for the adoption's figures
        facts.update(hashed.figures(time.monotonic(), "hash"))
    if recorded:
        return Finding(node.name, step, CURRENT, f"{dst} and {serving.ref}: recorded, every file hashes to the "
                       "build host's manifest", facts=facts)
    text = _build_manifest(session, build, mtp)
    if text is None:
        return Finding(node.name, step, BUILD, f"{build.name}'s checkpoint does not hash to the manifest mtp_weights "
                       "recorded (or has none): adopt the build host or run build_job first")
    expected = checkpoint_core.parse_manifest(text)["files"]
    differences: list[str] = []
    if node_image != serving.image_id:
        differences.append(f"image {serving.ref}: {(node_image or 'missing')[7:19] or 'missing'} "
                           f"(the build host's: {serving.image_id[7:19]})")
    if session.exists(node.name, dst):
        actual = {p: e for p, e in digests_on_node(session, node.name, dst, progress=hashed).items()
                  if p != checkpoint_core.MANIFEST_NAME}
        facts.update(hashed.figures(time.monotonic(), "hash"))
        diff = checkpoint_core.diff_manifests(expected, actual)
        differences += diff.problems(node.name, expected, actual)
    else:
        differences.append(f"{dst}: missing on {node.name}")
    if differences:
        return Finding(node.name, step, DIFFERS if session.exists(node.name, dst) else BUILD,
                       f"{node.name}'s copy is not the build host's: node_artifacts copies only what differs",
                       tuple(differences))
    if not check:
        session.put_text(node.name, f"{dst}/{checkpoint_core.MANIFEST_NAME}", text)
        if dst != version:
            versions.make_version(session, node, mtp.manifest)
        markers.write(session, node, step, sig, manifest=mtp.manifest, path=version)
    return Finding(node.name, step, ADOPT, f"{dst}: {len(expected)} files hash to {build.name}'s manifest"
                   + (f" (becomes the checkpoint version {posixpath.basename(version)}, renamed, nothing copied)"
                      if dst != version else "")
                   + f"; {serving.ref} {serving.image_id[7:19]} as on {build.name}", facts=facts)
