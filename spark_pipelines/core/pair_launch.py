"""A node pair's launch: the runbook's Phase 4-alt (TP=2 over two nodes) as two `docker run` argvs.

Rendered from each node's own launch (the fleet's profile with that node's overrides), so a pair
serves the same image, checkpoint, GMU and flags as its nodes do at TP=1, with what Phase 4-alt
adds: the container's `--privileged --network host --ipc host --shm-size 64g`, the ulimits and
`/dev/infiniband` for NCCL over the link, the HF cache mount, `--host 0.0.0.0`,
`--tensor-parallel-size 2` and the multi-node flags (`--distributed-executor-backend mp --nnodes 2
--node-rank R --master-addr HEAD --master-port 29501`, `--headless` on the worker).

One difference from the runbook's text: the launch profile's env (`-e`) is kept. Phase 4-alt
predates the 2026-06-18 fix, whose six variables the fleet file requires on every Founders node.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from spark_pipelines.core.fleet import Fleet, FleetError, NodePair
from spark_pipelines.core.launch import LaunchSpec, expand_home, launch_spec

# Phase 4-alt's docker flags, in its order (`--gpus all` first, as Phase 4's).
PAIR_RUN_FLAGS: tuple[str, ...] = (
    "--gpus", "all", "--privileged", "--network", "host", "--ipc", "host", "--shm-size", "64g",
    "--ulimit", "memlock=-1", "--ulimit", "stack=67108864",
    "--device", "/dev/infiniband:/dev/infiniband",
)
# Phase 4-alt mounts the HF cache beside the models (its second -v).
HF_CACHE_MOUNT = ("~/.cache/huggingface", "/root/.cache/huggingface")
# The head listens on every address: clients reach it at its fleet address, the worker on the link.
PAIR_HOST = "0.0.0.0"
TENSOR_PARALLEL = 2
HEAD_RANK, WORKER_RANK = 0, 1
# `plan` of a pair without a link (off): where --master-addr goes once the link exists.
NO_LINK_ADDRESS = "<link.head_address>"


@dataclass(frozen=True)
class PairLaunch:
    """What a pair's deploy runs: the worker (rank 1, first) and the head (rank 0)."""

    pair: str
    head: LaunchSpec
    worker: LaunchSpec
    master_addr: str
    master_port: int

    @property
    def specs(self) -> tuple[LaunchSpec, LaunchSpec]:
        """In launch order: the worker first."""
        return self.worker, self.head


def pair_of(fleet: Fleet, node: str) -> NodePair | None:
    """The pair `node` is in (on or off), or None."""
    return next((p for p in fleet.pairs if node in (p.head, p.worker)), None)


def enabled_pair_of(fleet: Fleet, node: str) -> NodePair | None:
    """The pair `node` serves in now (enabled in the fleet file), or None."""
    p = pair_of(fleet, node)
    return p if p is not None and p.enabled else None


def pair_named(fleet: Fleet, name: str) -> NodePair:
    for p in fleet.pairs:
        if p.name == name:
            return p
    known = ", ".join(p.name for p in fleet.pairs) or "none (add one under pairs:)"
    raise FleetError(f"no node pair named {name!r} in the fleet; known pairs: {known}")


def _rank_args(spec: LaunchSpec, rank: int, master_addr: str, master_port: int) -> list[str]:
    """Phase 4-alt's serve arguments from the node's TP=1 ones: --host before --port,
    --tensor-parallel-size after it, the multi-node flags last."""
    args = list(spec.serve_args)
    at = args.index("--port")
    args[at:at + 2] = ["--host", PAIR_HOST, *args[at:at + 2], "--tensor-parallel-size", str(TENSOR_PARALLEL)]
    args += ["--distributed-executor-backend", "mp", "--nnodes", "2", "--node-rank", str(rank),
             "--master-addr", master_addr, "--master-port", str(master_port)]
    if rank != HEAD_RANK:
        args.append("--headless")
    return args


def _rank_spec(fleet: Fleet, node: str, rank: int, master_addr: str, master_port: int) -> LaunchSpec:
    n = fleet.node(node)
    spec = launch_spec(fleet, n)
    hf = (expand_home(HF_CACHE_MOUNT[0], n.home_dir), HF_CACHE_MOUNT[1])
    mounts = [spec.mounts[0], hf, *spec.mounts[1:]]
    return replace(spec, mounts=mounts, host_dirs=[h for h, _ in mounts], run_flags=PAIR_RUN_FLAGS,
                   serve_args=_rank_args(spec, rank, master_addr, master_port))


def pair_launch(fleet: Fleet, pair: NodePair) -> PairLaunch:
    """Both ranks' launch specs. A pair without a link (off) renders with a placeholder address:
    what `plan` shows; a deploy refuses it (runbook.pair)."""
    addr = pair.link.head_address if pair.link is not None else NO_LINK_ADDRESS
    return PairLaunch(
        pair=pair.name,
        head=_rank_spec(fleet, pair.head, HEAD_RANK, addr, pair.master_port),
        worker=_rank_spec(fleet, pair.worker, WORKER_RANK, addr, pair.master_port),
        master_addr=addr,
        master_port=pair.master_port,
    )
