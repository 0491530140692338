"""What one runbook step hands the next: typed, frozen values instead of dicts read by key.

Each is the output of one asset (pickled by Dagster's I/O manager) and the input of the next.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelSnapshot:
    """Step 0: the base model on the build host, at a resolved revision."""

    node: str
    path: str
    repo: str
    revision: str


@dataclass(frozen=True)
class Checkpoint:
    """Steps 1-2: a checkpoint directory on the build host, with the digest of its index and of its
    content manifest (per-file sha256)."""

    node: str
    path: str
    index: str
    manifest: str | None = None
    # What of the checkpoint shapes compiled kernels (core/jit_cache.py architecture): the JIT key
    # takes this, not the manifest, so new weights on the same architecture keep a warm cache.
    architecture: str | None = None


@dataclass(frozen=True)
class BuiltImage:
    """Steps 3-4: an image on the build host."""

    node: str
    ref: str
    image_id: str
    torch: str | None = None


@dataclass(frozen=True)
class NodeArtifacts:
    """The checkpoint and serving image as one node holds them."""

    node: str
    path: str
    image: str
    image_id: str | None
    index: str
    manifest: str | None = None
    architecture: str | None = None


@dataclass(frozen=True)
class Deployment:
    """What serves on a node: its container and the launch spec it runs."""

    node: str
    container_id: str | None
    fingerprint: str
