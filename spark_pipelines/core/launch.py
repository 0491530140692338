"""Launch profile x node -> the exact `docker run` argv of the runbook's Phase 4.

The argv is a list: it is carried to the node quoted argument by argument, never glued into a
shell string (the runbook needed base64 launch scripts because PowerShell mangled the JSON of
--speculative-config; argv quoting makes that whole class of breakage impossible).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from spark_pipelines.core.fleet import Fleet, LaunchProfile, Node

MODELS_MOUNT = "/models"
# Labels a deploy puts on its container: which launch spec and image it runs, so the kept
# (rollback) deployment is found by what it is, not by its name alone.
DEPLOY_LABEL = "org.spark-pipelines.deploy"
IMAGE_LABEL = "org.spark-pipelines.image"
CHECKPOINT_LABEL = "org.spark-pipelines.checkpoint"  # the index digest node_artifacts verified
# The checkpoint version the container mounts (core/versions.py: its manifest digest, short).
CHECKPOINT_VERSION_LABEL = "org.spark-pipelines.checkpoint-version"
KERNELS_LABEL = "org.spark-pipelines.kernels"  # core.jit_cache.launch_hash: alike on nodes launched alike
# Phase 4's `docker run` flags (one node, TP=1).
PHASE4_RUN_FLAGS: tuple[str, ...] = ("--gpus", "all", "--net=host", "--ipc=host")


def expand_home(path: str, home: str) -> str:
    """`~/x` -> `<home>/x` for the node's user: docker does not expand `~` in -v, the shell did."""
    if path == "~":
        return home
    if path.startswith("~/"):
        return home.rstrip("/") + path[1:]
    return path


@dataclass(frozen=True)
class LaunchSpec:
    """What a deploy runs on one node, in plain data (also what the plan prints)."""

    node: str
    container_name: str
    image: str
    env: dict[str, str]
    mounts: list[tuple[str, str]]  # (host path on the node, container path)
    serve_args: list[str]
    port: int
    served_model_name: str
    gpu_memory_utilization: float
    host_dirs: list[str]  # directories that must exist on the node before launch
    labels: dict[str, str] = field(default_factory=dict)  # container labels; not part of the fingerprint
    # The checkpoint version a deploy launches on (core/versions.py), bound read-only at the model's
    # container path instead of the whole models directory: a restart of the container loads this
    # version whatever the runbook's path points at later. Not part of the fingerprint: the launch
    # spec is the fleet file's; the version is the node's data (its own label).
    model_source: str | None = None
    # docker run's own flags before the env and mounts; None: Phase 4's (`PHASE4_RUN_FLAGS`). A node
    # pair's launch gives Phase 4-alt's (core/pair_launch.py).
    run_flags: tuple[str, ...] | None = None

    @property
    def model_path(self) -> str:
        """The model's path in the container (`/models/<model_dir>`, serve's first argument)."""
        return self.serve_args[1]

    def docker_run_argv(self, *, name: str | None = None) -> list[str]:
        argv = ["docker", "run", "-d", "--name", name or self.container_name,
                *(PHASE4_RUN_FLAGS if self.run_flags is None else self.run_flags)]
        for k, v in self.env.items():
            argv += ["-e", f"{k}={v}"]
        for host, container in self.mounts:
            if container == MODELS_MOUNT and self.model_source:
                argv += ["-v", f"{self.model_source}:{self.model_path}:ro"]
                continue
            argv += ["-v", f"{host}:{container}"]
        for k, v in self.labels.items():
            argv += ["--label", f"{k}={v}"]
        argv.append(self.image)
        argv += self.serve_args
        return argv

    @property
    def fingerprint(self) -> str:
        """Stable digest of everything that shapes the running server: the deploy's code version."""
        shape: dict[str, object] = {"image": self.image, "env": self.env, "mounts": self.mounts, "args": self.serve_args}
        if self.run_flags is not None:  # Phase 4's launches keep the fingerprints they always had
            shape["run_flags"] = list(self.run_flags)
        blob = json.dumps(shape, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def serve_args(profile: LaunchProfile) -> list[str]:
    args = [
        "serve",
        f"{MODELS_MOUNT}/{profile.model_dir}",
        "--served-model-name",
        profile.served_model_name,
        "--port",
        str(profile.port),
        "--max-model-len",
        str(profile.max_model_len),
        "--gpu-memory-utilization",
        f"{profile.gpu_memory_utilization:g}",
    ]
    if profile.reasoning_parser:
        args += ["--reasoning-parser", profile.reasoning_parser]
    if profile.attention_backend:
        args += ["--attention-backend", profile.attention_backend]
    if profile.speculative is not None:
        spec = {"method": profile.speculative.method, "num_speculative_tokens": profile.speculative.num_speculative_tokens}
        args += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    args += list(profile.extra_flags)
    return args


def launch_spec(fleet: Fleet, node: Node, profile: LaunchProfile | None = None) -> LaunchSpec:
    """The node's launch: the fleet's profile with the node's overrides, `~` expanded for its user."""
    profile = profile or fleet.launch_for(node)
    home = node.home_dir
    models = expand_home(profile.models_dir, home)
    mounts = [(models, MODELS_MOUNT)] + [(expand_home(m.host, home), m.container) for m in profile.cache_mounts]
    return LaunchSpec(
        node=node.name,
        container_name=profile.container_name,
        image=profile.image,
        env=dict(profile.env),
        mounts=mounts,
        serve_args=serve_args(profile),
        port=profile.port,
        served_model_name=profile.served_model_name,
        gpu_memory_utilization=profile.gpu_memory_utilization,
        host_dirs=[h for h, _ in mounts],
    )


def docker_run_argv(fleet: Fleet, node: Node) -> list[str]:
    return launch_spec(fleet, node).docker_run_argv()
