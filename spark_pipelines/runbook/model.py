"""Runbook steps 0-2 on the build host as procedures: the base model download, the hybrid INT4+FP8
checkpoint (build-hybrid-checkpoint.py) and the MTP weights (add-mtp-weights.py).

A rebuild never touches the directory the serving containers mount (runbook/build_steps.py):
- step 1 builds into the staging directory beside it, verifies there (index, shard headers, the
  144 FP8 scales) and records itself as staged (its marker: `staged: true`);
- step 2 adds the MTP weights in that staging directory (or, when step 1 did not rebuild, in a
  fresh staging copy of the serving one: shards hard-linked, the small files copied, so the
  serving index is never rewritten in place), verifies (MTP keys), hashes it (the manifest),
  switches it into place, verifies it there, records both steps and removes the replaced one.
On a skip, step 2 (which owns the manifest) re-hashes the serving checkpoint against it: a file
changed in place, its size and mtime kept, is found and rebuilt beside, the file named.

Procedures raise RunbookError (the asset turns it into the step failure); a verification that
fails after a build is returned in the outcome, with the advice that mends it, for the blocking
check to report.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import checkpoint as checkpoint_core
from spark_pipelines.core import layout, remote
from spark_pipelines.core.artifacts import Checkpoint, ModelSnapshot
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.core.fleet import Node
from spark_pipelines.resources.hub import HubError, ModelHub
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSession, RemoteCommandError
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
    switch_into_place,
    verify_on_node,
)
from spark_pipelines.state import markers

EXPECTED_FP8_SCALES = checkpoint_core.EXPECTED_FP8_SCALES
HYBRID_BUILDER = "patches/01-hybrid-int4-fp8/build-hybrid-checkpoint.py"
MTP_ADDER = "patches/02-mtp-speculative/add-mtp-weights.py"
BASE_MODEL, HYBRID, MTP = "base_model", "hybrid_checkpoint", "mtp_weights"
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


def _verify(s: FleetSession, node: Node, directory: str, mtp: bool) -> checkpoint_core.CheckpointReport:
    return verify_on_node(s, node, directory, expected_scales=EXPECTED_FP8_SCALES, require_mtp=mtp)


def base_model_signature(cv: dict[str, str], revision: str) -> str:
    return markers.signature(cv[BASE_MODEL], revision)


def hybrid_signature(cv: dict[str, str], revision: str) -> str:
    return markers.signature(cv[HYBRID], revision)


def mtp_signature(cv: dict[str, str], hybrid_index: str, revision: str) -> str:
    # Not the step-1 manifest: a rebuilt step 1 has a new index digest already, and adding it
    # would rerun step 2 once on every existing build host for nothing.
    return markers.signature(cv[MTP], hybrid_index, revision)


# ------------------------------------------------------------------------------ step 0


def base_model(s: FleetSession, hub: ModelHub, cv: dict[str, str]) -> ModelOutcome:
    """The Intel snapshot at the pinned revision on the build host. It lives where its marker says
    (the runbook's HF cache snapshot, when adoption found it there) or at core.layout's place."""
    node = s.fleet.build_node
    pin = s.fleet.pins.base_model
    try:
        sha = hub.resolve(pin.repo, pin.revision)
    except HubError as e:
        raise RunbookError(str(e)) from None
    sig = base_model_signature(cv, sha)
    marker = markers.matches(s, node, BASE_MODEL, sig)
    dest = layout.base_model_dir(s.fleet, node)
    if marker:
        where = str(marker.get("path") or dest)
        report = verify_on_node(s, node, where, expected_scales=0, require_mtp=False)
        if report.ok:
            return ModelOutcome(ModelSnapshot(node.name, where, pin.repo, sha), report, True)
        s.log.warning(f"base_model: {node.name}:{where} fails verification ({report.problems[0]}); downloading")
    s.log.info(f"downloading {pin.repo}@{sha} to {node.name}:{dest} (resumable: hf skips complete files)")
    try:
        s.run(node.name, hub.download_argv(pin.repo, sha, dest), secret_env=hub.secret_env() or None,
              timeout=remote.DOWNLOAD_TIMEOUT_S)
    except RemoteCommandError as e:
        raise RunbookError(f"{node.name}: hf download of {pin.repo}@{sha[:12]} failed ({first_line(e)}); "
                           "check the hub (HF_TOKEN, network) and rerun build_job: it resumes") from None
    report = verify_on_node(s, node, dest, expected_scales=0, require_mtp=False)
    if not report.ok:
        raise RunbookError(f"base model on {node.name} is incomplete after download: {report.problems[0]}; "
                           f"{base_model_advice(dest)}")
    write_base_model_marker(s, node, sig, sha, dest)
    return ModelOutcome(ModelSnapshot(node.name, dest, pin.repo, sha), report, False)


def write_base_model_marker(s: FleetSession, node: Node, sig: str, revision: str, path: str) -> None:
    markers.write(s, node, BASE_MODEL, sig, revision=revision, path=path)


# ------------------------------------------------------------------------------ step 1


def build_hybrid_beside(s: FleetSession, hub: ModelHub, node: Node, base: ModelSnapshot
                        ) -> tuple[str | None, checkpoint_core.CheckpointReport]:
    """build-hybrid-checkpoint.py into a fresh staging directory beside the serving checkpoint,
    verified there: (its "hybrid" index digest, report), or (None, report) with the staging
    directory removed when it does not verify. Raises RunbookError (staging removed)."""
    f = s.fleet
    serving = layout.hybrid_dir(f, node)
    staging = staging_dir(serving)
    recipe = layout.recipe_dir(node)
    require_free_space(s, node, serving, "build the hybrid checkpoint")
    remove_dir(s, node, staging)
    checkout(s, node, f.pins.recipe_repo, recipe)
    try:
        s.run(node.name, ["mkdir", "-p", staging], log=False)
        s.run(node.name, ["env", "-C", recipe, "python3", HYBRID_BUILDER, "--gptq-dir", base.path,
                          "--fp8-repo", f.pins.fp8_model.repo, "--output", staging, "--force"],
              secret_env=hub.secret_env() or None, timeout=remote.CHECKPOINT_BUILD_TIMEOUT_S)
        report = _verify(s, node, staging, mtp=False)
        if not report.ok:
            remove_dir(s, node, staging)
            return None, report
        return index_digests(s, node, staging)["hybrid"], report
    except RemoteCommandError as e:
        remove_quietly(s, node, staging)
        raise RunbookError(f"{node.name}: build-hybrid-checkpoint.py failed ({first_line(e)}); the serving "
                           f"checkpoint was not touched and the staging directory was removed. {HYBRID_ADVICE}",
                           {"last output": f"```\n{e.tail[-3000:]}\n```"}) from None
    except BaseException:
        remove_quietly(s, node, staging)
        raise


def hybrid_checkpoint(s: FleetSession, hub: ModelHub, base: ModelSnapshot, cv: dict[str, str]) -> StepOutcome:
    """Step 1: skip when its marker matches and its output verifies where the marker says (staged
    beside the serving checkpoint, or switched in); else build beside and record it as staged."""
    f = s.fleet
    node = f.build_node
    serving = layout.hybrid_dir(f, node)
    staging = staging_dir(serving)
    recover_switch(s, node, serving)
    sig = hybrid_signature(cv, base.revision)
    marker = markers.matches(s, node, HYBRID, sig)
    if marker:
        where = staging if marker.get("staged") else serving
        report = _verify(s, node, where, mtp=False)
        if report.ok:
            return StepOutcome(Checkpoint(node.name, where, str(marker["index"])), report, True,
                               metadata={"staged": where == staging})
        s.log.warning(f"hybrid_checkpoint: {node.name}:{where} fails verification ({report.problems[0]}); "
                      "rebuilding beside the serving checkpoint")
    index, report = build_hybrid_beside(s, hub, node, base)
    if index is None:
        return StepOutcome(Checkpoint(node.name, staging, "invalid"), report, False, HYBRID_ADVICE)
    markers.write(s, node, HYBRID, sig, index=index, staged=True)
    return StepOutcome(Checkpoint(node.name, staging, index), report, False, metadata={"staged": True})


# ------------------------------------------------------------------------------ step 2


def mtp_weights(s: FleetSession, hub: ModelHub, base: ModelSnapshot, hybrid: Checkpoint, cv: dict[str, str], *,
                run_id: str = "") -> StepOutcome:
    """Step 2 and the switch. Skip: marker matches, the serving checkpoint verifies and hashes to
    the recorded manifest. Otherwise add the MTP weights beside it (after rebuilding step 1 too
    when a file step 1 wrote changed), verify, hash, switch in, record."""
    f = s.fleet
    node = f.build_node
    serving = layout.hybrid_dir(f, node)
    staging = staging_dir(serving)
    recover_switch(s, node, serving)
    sig = mtp_signature(cv, hybrid.index, base.revision)
    staged = hybrid.path != serving  # step 1 built (or kept) it beside: finish it, never skip
    meta: dict[str, Any] = {}
    full = False
    if not staged:
        marker = markers.matches(s, node, MTP, sig)
        if marker:
            report = _verify(s, node, serving, mtp=True)
            if report.ok:
                check = content_check(s, node, serving, marker.get("manifest"))
                meta.update(hashed_gib=round(check.bytes / 2**30, 3), hash_seconds=check.seconds,
                            hash_s_per_gib=check.seconds_per_gib, manifest_restored=check.restored_manifest)
                if check.ok:
                    manifest = str(marker.get("manifest") or check.manifest)
                    if not marker.get("manifest"):  # a marker from before manifests: keep what was hashed
                        markers.write(s, node, MTP, sig, index=marker["index"], manifest=manifest)
                    return StepOutcome(Checkpoint(node.name, serving, str(marker["index"]), manifest), report, True,
                                       metadata=meta)
                full = check.differing is None or not set(check.differing) <= STEP2_FILES
                meta["rebuilt_because"] = "; ".join(check.problems[:3])
                s.log.warning(f"mtp_weights: {node.name}'s checkpoint does not match its manifest: "
                              f"{'; '.join(check.problems[:3])}; rebuilding "
                              f"{'steps 1 and 2' if full else 'step 2'} beside the serving checkpoint")
            else:
                meta["rebuilt_because"] = report.problems[0]
                s.log.warning(f"mtp_weights: {serving} fails verification ({report.problems[0]}); "
                              "adding the MTP weights again beside it")
    keep_for_resume = staged  # step 1's output in staging is ~20 min of work: a failure keeps it
    if full:
        index, report = build_hybrid_beside(s, hub, node, base)
        if index is None:
            return StepOutcome(Checkpoint(node.name, staging, "invalid"), report, False, HYBRID_ADVICE, meta)
        markers.write(s, node, HYBRID, hybrid_signature(cv, base.revision), index=index, staged=True)
        sig = mtp_signature(cv, index, base.revision)
        keep_for_resume = True
    elif not staged:
        stage_linked_copy(s, node, serving)
    meta["rebuilt"] = "steps 1 and 2" if full else "step 2"
    try:
        s.run(node.name, ["env", "-C", layout.recipe_dir(node), "python3", MTP_ADDER, "--source", base.path,
                          "--target", staging], timeout=remote.CHECKPOINT_BUILD_TIMEOUT_S)
        report = _verify(s, node, staging, mtp=True)
        if not report.ok:
            if not keep_for_resume:
                remove_dir(s, node, staging)
            return StepOutcome(Checkpoint(node.name, staging, "invalid"), report, False, mtp_advice(base.path), meta)
        _, manifest = write_manifest(s, node.name, staging)
        index = index_digests(s, node, staging)["full"]
        with node_lease(s, node.name, "checkpoint switch", run_id=run_id):
            switch = switch_into_place(s, node, staging, serving, lambda: _verify(s, node, serving, mtp=True))
            hybrid_marker = markers.read(s, node, HYBRID)
            if hybrid_marker and hybrid_marker.get("staged"):
                markers.write(s, node, HYBRID, str(hybrid_marker["signature"]), index=hybrid_marker.get("index"))
            markers.write(s, node, MTP, sig, index=index, manifest=manifest)
        if switch.previous:
            remove_quietly(s, node, switch.previous)
    except RemoteCommandError as e:
        if not keep_for_resume:
            remove_quietly(s, node, staging)
        kept = "kept for the rerun" if keep_for_resume else "removed"
        raise RunbookError(f"{node.name}: adding the MTP weights beside the serving checkpoint failed "
                           f"({first_line(e)}); the serving checkpoint was not touched, the staging directory "
                           f"{kept}: rerun build_job", {"last output": f"```\n{e.tail[-3000:]}\n```"}) from None
    except BaseException:
        if not keep_for_resume:
            remove_quietly(s, node, staging)
        raise
    meta.update(switched=True, atomic_switch=switch.atomic)
    return StepOutcome(Checkpoint(node.name, serving, index, manifest), report, False, metadata=meta)


# ------------------------------------------------------------------------------ the build host's own copy


def verify_build_host_copy(s: FleetSession, node: Node, directory: str, manifest: str | None) -> dict[str, Any]:
    """Before a deploy on the build host uses its checkpoint: headers, then every file's sha256
    against the manifest mtp_weights recorded. Raises RunbookError naming the file; returns the
    figures of the hashing."""
    report = _verify(s, node, directory, mtp=True)
    if not report.ok:
        raise RunbookError(f"{node.name}: checkpoint does not verify: {report.problems[0]}; {BUILD_HOST_COPY_ADVICE}")
    check = content_check(s, node, directory, manifest)
    if not check.ok:
        raise RunbookError(f"{node.name}: its own checkpoint does not match the manifest mtp_weights recorded: "
                           f"{'; '.join(check.problems[:3])}; {BUILD_HOST_COPY_ADVICE}")
    return {"hashed_gib": round(check.bytes / 2**30, 3), "hash_seconds": check.seconds,
            "hash_s_per_gib": check.seconds_per_gib}
