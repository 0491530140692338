"""Runbook steps 0-2 on the build host as procedures: the base model download, the hybrid INT4+FP8
checkpoint (build-hybrid-checkpoint.py) and the MTP weights (add-mtp-weights.py).

A rebuild never touches a checkpoint a container mounts: its output is a new checkpoint version
(core/versions.py) beside the runbook's path, which only a deploy points at it:
- step 1 builds into the staging directory beside it, verifies there (index, shard headers, the
  144 FP8 scales) and records itself as staged (its marker: `staged: true`);
- step 2 adds the MTP weights in that staging directory (or, when step 1 did not rebuild, in a
  fresh staging copy of the newest version: shards hard-linked, the small files copied, so no
  version's index is ever rewritten in place), verifies (MTP keys), hashes it (the manifest) and
  renames it to the version its manifest names, verified there. A rebuild whose manifest is a
  version the build host holds already IS that version: the staging copy goes, nothing else moves.
On a skip, step 2 (which owns the manifest) re-hashes its version against it: a file changed in
place, its size and mtime kept, is found and rebuilt beside, the file named.

Procedures raise RunbookError (the asset turns it into the step failure); a verification that
fails after a build is returned in the outcome, with the advice that mends it, for the blocking
check to report.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import checkpoint as checkpoint_core
from spark_pipelines.core import jit_cache as jit_core
from spark_pipelines.core import layout, remote
from spark_pipelines.core import versions as versions_core
from spark_pipelines.core.artifacts import Checkpoint, ModelSnapshot
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.core.fleet import Node
from spark_pipelines.resources.hub import HubError, ModelHub
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSession, RemoteCommandError, RemoteError
from spark_pipelines.resources.transfer import write_manifest
from spark_pipelines.runbook.build_steps import (
    checkout,
    content_check,
    index_digests,
    recover_switch,
    remove_dir,
    remove_quietly,
    require_free_space,
    stage_linked_copy,
    staging_dir,
    verify_on_node,
)
from spark_pipelines.runbook import versions
from spark_pipelines.state import markers

EXPECTED_FP8_SCALES = checkpoint_core.EXPECTED_FP8_SCALES
HYBRID_BUILDER = "patches/01-hybrid-int4-fp8/build-hybrid-checkpoint.py"
MTP_ADDER = "patches/02-mtp-speculative/add-mtp-weights.py"
BASE_MODEL, HYBRID, MTP = "base_model", "hybrid_checkpoint", "mtp_weights"
# The base model's provenance in its marker: proven (downloaded by hf at the revision, or its
# metadata says so) or unknown (adopted from a copy without huggingface_hub's metadata).
PROVEN, UNKNOWN = "proven", "unknown"
# What add-mtp-weights.py writes: a mismatch confined to these is mended by step 2 alone.
STEP2_FILES = frozenset({checkpoint_core.MTP_FILE, checkpoint_core.INDEX_NAME})


def base_model_advice(directory: str) -> str:
    return (f"rerun build_job: base_model's hf download fetches what is missing or incomplete in {directory} "
            "(a file damaged with its size kept is not fetched again: delete that file first)")


HYBRID_ADVICE = (
    "the serving checkpoint was not touched and the failed build was removed. Rerun build_job: "
    "hybrid_checkpoint builds again beside the serving checkpoint, in a fresh staging directory "
    "(nothing to delete by hand). If it fails the same way, its inputs are at fault: rematerialize "
    "base_model (the Intel snapshot at the pinned revision) and check pins.recipe_repo")


def mtp_advice(source: str) -> str:
    return ("the serving checkpoint was not touched. add-mtp-weights.py copies model_extra_tensors.safetensors "
            f"and its mtp. keys from the base model snapshot ({source}): rematerialize base_model at the pinned "
            "revision if that snapshot lacks them, then rerun build_job (mtp_weights adds them beside the serving "
            "checkpoint and switches it in)")


BUILD_HOST_COPY_ADVICE = (
    "rerun build_job: mtp_weights hashes the build host's checkpoint against its manifest and rebuilds it "
    "beside the serving one when a file differs; then deploy again")


@dataclass(frozen=True)
class ModelOutcome:
    snapshot: ModelSnapshot
    report: checkpoint_core.CheckpointReport
    skipped: bool
    proved: bool = False  # an adopted snapshot of unknown provenance was checked against the hub


@dataclass(frozen=True)
class StepOutcome:
    """What a checkpoint step leaves: its output, the last verification, and what mends it."""

    checkpoint: Checkpoint
    report: checkpoint_core.CheckpointReport
    skipped: bool
    advice: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.report.ok

    @property
    def data_version(self) -> str:
        c = self.checkpoint
        return f"{c.index}-{c.manifest[:16]}" if c.manifest else c.index

    @property
    def check_text(self) -> str:
        return "; ".join([self.report.problems[0], self.advice]) if self.report.problems else ""


def _verify(session: FleetSession, node: Node, directory: str, mtp: bool) -> checkpoint_core.CheckpointReport:
    return verify_on_node(session, node, directory, expected_scales=EXPECTED_FP8_SCALES, require_mtp=mtp)


def base_model_signature(cv: dict[str, str], revision: str) -> str:
    return markers.signature(cv[BASE_MODEL], revision)


def hybrid_signature(cv: dict[str, str], revision: str) -> str:
    return markers.signature(cv[HYBRID], revision)


def mtp_signature(cv: dict[str, str], hybrid_index: str, revision: str) -> str:
    # Not the step-1 manifest: a rebuilt step 1 has a new index digest already, and adding it
    # would rerun step 2 once on every existing build host for nothing.
    return markers.signature(cv[MTP], hybrid_index, revision)


# ------------------------------------------------------------------------------ step 0


def base_model(session: FleetSession, hub: ModelHub, cv: dict[str, str]) -> ModelOutcome:
    """The Intel snapshot at the pinned revision on the build host. It lives where its marker says
    (the runbook's HF cache snapshot, when adoption found it there) or at core.layout's place."""
    node = session.fleet.build_node
    pin = session.fleet.pins.base_model
    try:
        sha = hub.resolve(pin.repo, pin.revision)
    except HubError as e:
        raise RunbookError(str(e)) from None
    sig = base_model_signature(cv, sha)
    marker = markers.matches(session, node, BASE_MODEL, sig)
    dest = layout.base_model_dir(session.fleet, node)
    proving = False
    if marker:
        where = str(marker.get("path") or dest)
        report = verify_on_node(session, node, where, expected_scales=0, require_mtp=False)
        if report.ok and marker.get("provenance") != UNKNOWN:
            return ModelOutcome(ModelSnapshot(node.name, where, pin.repo, sha), report, True)
        if report.ok:
            # Adopted without proof of its revision: hf download into the same folder checks each
            # file against the hub by content, fetches only what differs and writes the metadata.
            session.log.info(f"base_model: {node.name}:{where} was adopted with its provenance unknown; proving it "
                       f"(hf download at {sha[:12]} checks every file by content, fetches only what differs)")
            dest, proving = where, True
        else:
            session.log.warning(f"base_model: {node.name}:{where} fails verification ({report.problems[0]}); downloading")
    session.log.info(f"downloading {pin.repo}@{sha} to {node.name}:{dest} (resumable: hf skips complete files)")
    try:
        session.run(node.name, hub.download_argv(pin.repo, sha, dest), secret_env=hub.secret_env() or None,
              timeout=remote.DOWNLOAD_TIMEOUT_S)
    except RemoteCommandError as e:
        raise RunbookError(f"{node.name}: hf download of {pin.repo}@{sha[:12]} failed ({first_line(e)}); "
                           "check the hub (HF_TOKEN, network) and rerun build_job: it resumes") from None
    report = verify_on_node(session, node, dest, expected_scales=0, require_mtp=False)
    if not report.ok:
        raise RunbookError(f"base model on {node.name} is incomplete after download: {report.problems[0]}; "
                           f"{base_model_advice(dest)}")
    write_base_model_marker(session, node, sig, sha, dest)
    return ModelOutcome(ModelSnapshot(node.name, dest, pin.repo, sha), report, False, proved=proving)


def write_base_model_marker(session: FleetSession, node: Node, sig: str, revision: str, path: str,
                            provenance: str = PROVEN) -> None:
    markers.write(session, node, BASE_MODEL, sig, revision=revision, path=path, provenance=provenance)


# ------------------------------------------------------------------------------ step 1


def build_hybrid_beside(session: FleetSession, hub: ModelHub, node: Node, base: ModelSnapshot
                        ) -> tuple[str | None, checkpoint_core.CheckpointReport]:
    """build-hybrid-checkpoint.py into a fresh staging directory beside the serving checkpoint,
    verified there: (its "hybrid" index digest, report), or (None, report) with the staging
    directory removed when it does not verify. Raises RunbookError (staging removed)."""
    fleet = session.fleet
    serving = layout.hybrid_dir(fleet, node)
    staging = staging_dir(serving)
    recipe = layout.recipe_dir(node)
    require_free_space(session, node, serving, "build the hybrid checkpoint")
    remove_dir(session, node, staging)
    checkout(session, node, fleet.pins.recipe_repo, recipe)
    try:
        session.run(node.name, ["mkdir", "-p", staging], log=False)
        session.run(node.name, ["env", "-C", recipe, "python3", HYBRID_BUILDER, "--gptq-dir", base.path,
                          "--fp8-repo", fleet.pins.fp8_model.repo, "--output", staging, "--force"],
              secret_env=hub.secret_env() or None, timeout=remote.CHECKPOINT_BUILD_TIMEOUT_S)
        report = _verify(session, node, staging, mtp=False)
        if not report.ok:
            remove_dir(session, node, staging)
            return None, report
        return index_digests(session, node, staging)["hybrid"], report
    except RemoteCommandError as e:
        remove_quietly(session, node, staging)
        raise RunbookError(f"{node.name}: build-hybrid-checkpoint.py failed ({first_line(e)}); the serving "
                           f"checkpoint was not touched and the staging directory was removed. {HYBRID_ADVICE}",
                           {"last output": f"```\n{e.tail[-3000:]}\n```"}) from None
    except BaseException:
        remove_quietly(session, node, staging)
        raise


def hybrid_checkpoint(session: FleetSession, hub: ModelHub, base: ModelSnapshot, cv: dict[str, str]) -> StepOutcome:
    """Step 1: skip when its marker matches and its output verifies where the marker says (staged
    beside the serving checkpoint, or switched in); else build beside and record it as staged."""
    fleet = session.fleet
    node = fleet.build_node
    serving = layout.hybrid_dir(fleet, node)
    staging = staging_dir(serving)
    recover_switch(session, node, serving)
    sig = hybrid_signature(cv, base.revision)
    marker = markers.matches(session, node, HYBRID, sig)
    if marker:
        where = staging if marker.get("staged") else str(marker.get("path") or serving)
        report = _verify(session, node, where, mtp=False)
        if report.ok:
            return StepOutcome(Checkpoint(node.name, where, str(marker["index"])), report, True,
                               metadata={"staged": where == staging})
        session.log.warning(f"hybrid_checkpoint: {node.name}:{where} fails verification ({report.problems[0]}); "
                      "rebuilding beside the serving checkpoint")
    index, report = build_hybrid_beside(session, hub, node, base)
    if index is None:
        return StepOutcome(Checkpoint(node.name, staging, "invalid"), report, False, HYBRID_ADVICE)
    markers.write(session, node, HYBRID, sig, index=index, staged=True)
    return StepOutcome(Checkpoint(node.name, staging, index), report, False, metadata={"staged": True})


# ------------------------------------------------------------------------------ step 2


def mtp_weights(session: FleetSession, hub: ModelHub, base: ModelSnapshot, hybrid: Checkpoint, cv: dict[str, str], *,
                run_id: str = "") -> StepOutcome:
    """Step 2, into a version. Skip: marker matches, its version verifies and hashes to the
    recorded manifest. Otherwise add the MTP weights beside it (after rebuilding step 1 too when a
    file step 1 wrote changed), verify, hash, rename to the version the manifest names, record."""
    fleet = session.fleet
    node = fleet.build_node
    serving = layout.hybrid_dir(fleet, node)
    staging = staging_dir(serving)
    recover_switch(session, node, serving)
    sig = mtp_signature(cv, hybrid.index, base.revision)
    staged = hybrid.path == staging  # step 1 built (or kept) it beside: finish it, never skip
    source = hybrid.path  # what step 2 starts from when step 1 did not rebuild
    meta: dict[str, Any] = {}
    full = False
    if not staged:
        marker = markers.matches(session, node, MTP, sig)
        if marker:
            where = str(marker.get("path") or serving)
            source = where
            report = _verify(session, node, where, mtp=True)
            if report.ok:
                check = content_check(session, node, where, marker.get("manifest"))
                meta.update(hashed_gib=round(check.bytes / 2**30, 3), hash_seconds=check.seconds,
                            hash_s_per_gib=check.seconds_per_gib, manifest_restored=check.restored_manifest)
                if check.ok:
                    manifest = str(marker.get("manifest") or check.manifest)
                    where = _as_version(session, node, where, manifest, run_id)
                    if where != marker.get("path") or not marker.get("manifest"):
                        markers.write(session, node, MTP, sig, index=marker["index"], manifest=manifest, path=where)
                        _record_hybrid_path(session, node, where)
                    return StepOutcome(Checkpoint(node.name, where, str(marker["index"]), manifest,
                                                  architecture_of(session, node, where)), report, True, metadata=meta)
                full = check.differing is None or not set(check.differing) <= STEP2_FILES
                meta["rebuilt_because"] = "; ".join(check.problems[:3])
                session.log.warning(f"mtp_weights: {node.name}'s checkpoint {where} does not match its manifest: "
                              f"{'; '.join(check.problems[:3])}; rebuilding "
                              f"{'steps 1 and 2' if full else 'step 2'} into a new version beside it")
            else:
                meta["rebuilt_because"] = report.problems[0]
                session.log.warning(f"mtp_weights: {where} fails verification ({report.problems[0]}); "
                              "adding the MTP weights again into a new version beside it")
    keep_for_resume = staged  # step 1's output in staging is ~20 min of work: a failure keeps it
    if full:
        index, report = build_hybrid_beside(session, hub, node, base)
        if index is None:
            return StepOutcome(Checkpoint(node.name, staging, "invalid"), report, False, HYBRID_ADVICE, meta)
        markers.write(session, node, HYBRID, hybrid_signature(cv, base.revision), index=index, staged=True)
        sig = mtp_signature(cv, index, base.revision)
        keep_for_resume = True
    elif not staged:
        stage_linked_copy(session, node, source, staging)
    meta["rebuilt"] = "steps 1 and 2" if full else "step 2"
    try:
        session.run(node.name, ["env", "-C", layout.recipe_dir(node), "python3", MTP_ADDER, "--source", base.path,
                          "--target", staging], timeout=remote.CHECKPOINT_BUILD_TIMEOUT_S)
        report = _verify(session, node, staging, mtp=True)
        if not report.ok:
            if not keep_for_resume:
                remove_dir(session, node, staging)
            return StepOutcome(Checkpoint(node.name, staging, "invalid"), report, False, mtp_advice(base.path), meta)
        files, manifest = write_manifest(session, node.name, staging)
        index = index_digests(session, node, staging)["full"]
        final = versions_core.version_path(serving, manifest)
        with node_lease(session, node.name, "checkpoint version", run_id=run_id):
            held = content_check(session, node, final, manifest) if versions.read(session, node).holds(manifest) else None
            if held is not None and held.ok:
                # The rebuild reproduced a version the build host holds: it is that version.
                remove_dir(session, node, staging)
                meta["same_as_held_version"] = True
            elif held is not None:
                # A version of that content was damaged in place (a container may mount it): its
                # differing files are replaced one by one by rename, each atomically.
                meta.update(same_as_held_version=True, repaired=_repair_from(session, node, staging, final, held))
                remove_dir(session, node, staging)
            else:
                session.run(node.name, ["mv", "-T", "--", staging, final], timeout=60)
                meta["same_as_held_version"] = False
            report = _verify(session, node, final, mtp=True)
            repaired = held is not None and not held.ok
            if not report.ok or (repaired and not content_check(session, node, final, manifest).ok):
                raise RunbookError(f"{node.name}: the version {final} did not verify after the rebuild "
                                   f"({(report.problems or ['its content does not hash to its manifest'])[0]}): "
                                   "rerun build_job")
            _record_hybrid_path(session, node, final)
            markers.write(session, node, MTP, sig, index=index, manifest=manifest, path=final)
    except RemoteCommandError as e:
        if not keep_for_resume:
            remove_quietly(session, node, staging)
        kept = "kept for the rerun" if keep_for_resume else "removed"
        raise RunbookError(f"{node.name}: adding the MTP weights beside the serving checkpoint failed "
                           f"({first_line(e)}); no checkpoint a container mounts was touched, the staging directory "
                           f"{kept}: rerun build_job", {"last output": f"```\n{e.tail[-3000:]}\n```"}) from None
    except BaseException:
        if not keep_for_resume:
            remove_quietly(session, node, staging)
        raise
    meta.update(version=versions_core.version_name(posixpath.basename(serving), manifest))
    return StepOutcome(Checkpoint(node.name, final, index, manifest, jit_core.architecture(files["files"])),
                       report, False, metadata=meta)


def _repair_from(session: FleetSession, node: Node, staging: str, final: str, check: Any) -> list[str]:
    """Replace the files of `final` whose content is not its manifest's by the rebuilt ones in
    `staging` (rename: each file swapped whole; a reader keeps the inode it holds); a file the
    manifest does not list goes. Returns the files replaced or removed."""
    wrong = check.differing if check.differing is not None else sorted(
        checkpoint_core.parse_manifest(session.read_text(node.name, f"{staging}/{checkpoint_core.MANIFEST_NAME}"))["files"])
    done = []
    for rel in wrong:
        if not checkpoint_core.safe_relative(rel):
            continue
        if session.exists(node.name, f"{staging}/{rel}"):
            session.run(node.name, ["mv", "-f", "--", f"{staging}/{rel}", f"{final}/{rel}"], timeout=60)
        else:
            session.run(node.name, ["rm", "-f", "--", f"{final}/{rel}"], timeout=60)
        done.append(rel)
    session.log.warning(f"[{node.name}] {final}: {len(done)} damaged file(s) replaced by their rebuilt copies: "
                  f"{', '.join(done[:5])}")
    return done


def _record_hybrid_path(session: FleetSession, node: Node, path: str) -> None:
    """Step 1's output now lives in the version step 2 made (its marker no longer says staged)."""
    hybrid_marker = markers.read(session, node, HYBRID)
    if hybrid_marker:
        markers.write(session, node, HYBRID, str(hybrid_marker["signature"]), index=hybrid_marker.get("index"), path=path)


def _as_version(session: FleetSession, node: Node, where: str, manifest: str, run_id: str) -> str:
    """A build host laid out as the runbook does (its checkpoint a plain directory at the runbook's
    path) has it renamed into the version its manifest names, the path linked to it: nothing is
    copied, and what serves keeps reading the same files."""
    serving = layout.hybrid_dir(session.fleet, node)
    if where.rstrip("/") != serving:
        return where
    with node_lease(session, node.name, "checkpoint version", run_id=run_id):
        made = versions.make_version(session, node, manifest)
    return f"{posixpath.dirname(serving)}/{made}" if made else where


def architecture_of(session: FleetSession, node: Node, directory: str) -> str | None:
    """The kernel-shaping digest (core.jit_cache.architecture) of a checkpoint's manifest file."""
    try:
        text = session.read_text(node.name, f"{directory}/{checkpoint_core.MANIFEST_NAME}")
        return jit_core.architecture(checkpoint_core.parse_manifest(text)["files"])
    except (RemoteError, ValueError, OSError):
        return None


# ------------------------------------------------------------------------------ the build host's own copy


def verify_build_host_copy(session: FleetSession, node: Node, directory: str, manifest: str | None) -> dict[str, Any]:
    """Before a deploy on the build host uses its checkpoint: headers, then every file's sha256
    against the manifest mtp_weights recorded. Raises RunbookError naming the file; returns the
    figures of the hashing."""
    report = _verify(session, node, directory, mtp=True)
    if not report.ok:
        raise RunbookError(f"{node.name}: checkpoint does not verify: {report.problems[0]}; {BUILD_HOST_COPY_ADVICE}")
    check = content_check(session, node, directory, manifest)
    if not check.ok:
        raise RunbookError(f"{node.name}: its own checkpoint does not match the manifest mtp_weights recorded: "
                           f"{'; '.join(check.problems[:3])}; {BUILD_HOST_COPY_ADVICE}")
    return {"hashed_gib": round(check.bytes / 2**30, 3), "hash_seconds": check.seconds,
            "hash_s_per_gib": check.seconds_per_gib}
