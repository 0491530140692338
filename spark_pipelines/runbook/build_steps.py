"""Build-host steps shared by the model and image phases: checkouts at a pin, checkpoint
verification on the node, and the "reuse when marker matches AND output verifies" rule."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spark_pipelines.core import checkpoint as checkpoint_core
from spark_pipelines.core.fleet import GitPin, Node
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.resources.transfer import write_manifest
from spark_pipelines.state import markers

GIT_TIMEOUT_S = 1800  # a first clone of a large repo over a slow uplink
VERIFY_TIMEOUT_S = 600  # reading 14 shard headers of a ~71 GB checkpoint (hashing: transfer.DIGEST_TIMEOUT_S)


def verify_on_node(
    session: FleetSession, node: Node, directory: str, *, expected_scales: int, require_mtp: bool
) -> checkpoint_core.CheckpointReport:
    """core/checkpoint.py is stdlib-only: it is piped to the node's python3 and reads there."""
    argv = ["python3", "-", directory, "--expected-scales", str(expected_scales)]
    if not require_mtp:
        argv.append("--no-mtp")
    source = Path(checkpoint_core.__file__).read_text()
    r = session.run(node.name, argv, stdin=source, log=False, timeout=VERIFY_TIMEOUT_S)
    data = json.loads(r.stdout.strip().splitlines()[-1])
    return checkpoint_core.CheckpointReport(**data)


def checkout(session: FleetSession, node: Node, pin: GitPin, dest: str) -> str:
    """Clone once, then fetch only when the pinned commit is missing; always a clean detached tree."""
    if not session.exists(node.name, f"{dest}/.git"):
        session.run(node.name, ["git", "clone", "--quiet", pin.url, dest], timeout=GIT_TIMEOUT_S)
    has = session.run(node.name, ["git", "-C", dest, "cat-file", "-e", f"{pin.commit}^{{commit}}"],
                      check=False, log=False, timeout=60)
    if not has.ok:
        session.run(node.name, ["git", "-C", dest, "fetch", "--quiet", "origin"], timeout=GIT_TIMEOUT_S)
    session.run(node.name, ["git", "-C", dest, "checkout", "--quiet", "--force", "--detach", pin.commit], timeout=300)
    session.run(node.name, ["git", "-C", dest, "clean", "-fdq", "-e", ".venv"], timeout=300)
    return session.run(node.name, ["git", "-C", dest, "rev-parse", "HEAD"], log=False, timeout=60).stdout.strip()


def index_digest(session: FleetSession, node: Node, directory: str) -> str:
    r = session.run(node.name, ["sha256sum", f"{directory}/{checkpoint_core.INDEX_NAME}"], log=False, timeout=60)
    return r.stdout.split()[0][:16]


def _disk_manifest(s: FleetSession, node: Node, directory: str) -> str | None:
    path = f"{directory}/{checkpoint_core.MANIFEST_NAME}"
    if not s.exists(node.name, path):
        return None
    try:
        return checkpoint_core.manifest_digest(checkpoint_core.parse_manifest(s.read_text(node.name, path)))
    except ValueError:
        return None


@dataclass(frozen=True)
class StepOutcome:
    report: checkpoint_core.CheckpointReport
    index: str  # digest of the index, as recorded when the step built it
    manifest: str  # digest of the content manifest made right after the step built it
    skipped: bool

    @property
    def data_version(self) -> str:
        return f"{self.index}-{self.manifest[:16]}"


def checkpoint_step(
    s: FleetSession, node: Node, step: str, sig: str, directory: str,
    verify: Callable[[], checkpoint_core.CheckpointReport], build: Callable[[], Any], *,
    owns_manifest: bool = False,
) -> StepOutcome:
    """Reuse the step's output when its marker matches AND it still verifies; else build and verify.

    The digests are the ones recorded at build time: step 2 rewrites the index (and the manifest)
    in place, and step 1's data version must not move because of it. Right after a build the
    directory is hashed on the node (`.spark-manifest.json` next to the checkpoint, digest in the
    marker): receivers are checked against it file by file. The step that writes the directory
    last (owns_manifest) also checks, on a skip, that the manifest file on disk is still its own."""
    marker = markers.matches(s, node, step, sig)
    if marker:
        report = verify()
        if report.ok and owns_manifest and marker.get("manifest") and _disk_manifest(s, node, directory) != marker["manifest"]:
            _, now = write_manifest(s, node.name, directory)  # missing or replaced: hash what is there
            if now != marker["manifest"]:
                report = checkpoint_core.CheckpointReport(directory=directory, problems=[
                    f"content changed since {step} built it (manifest {now[:16]}, recorded {marker['manifest'][:16]})"])
        if report.ok:
            manifest = marker.get("manifest")
            if not manifest:  # a marker from before manifests: hash what is there once, keep it
                _, manifest = write_manifest(s, node.name, directory)
                markers.write(s, node, step, sig, index=marker["index"], manifest=manifest)
            return StepOutcome(report, marker["index"], manifest, True)
        s.log.warning(f"{step}: marker matches but the output fails verification, rebuilding: {report.problems[0]}")
    build()
    report = verify()
    if not report.ok:
        return StepOutcome(report, "invalid", "invalid", False)
    digest = index_digest(s, node, directory)
    _, manifest = write_manifest(s, node.name, directory)
    markers.write(s, node, step, sig, index=digest, manifest=manifest)
    return StepOutcome(report, digest, manifest, False)
