"""The fleet file's smaller settings sections (preflight, bench, cold drain, rollout, distribution,
health, SSH retries, node pairs): each a model with its defaults and the runbook's reasons beside them."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator

from spark_pipelines.core import names
from spark_pipelines.core.bench import REFERENCE_MEAN_TOK_S
from spark_pipelines.core.fleet_types import Float, Host, Int, NodeName, Port, Strict, Text, shaped
from spark_pipelines.core.wedge import COLD_DRAIN_MIN_OFF_S


class PreflightSettings(Strict):
    # "need ~170GB for models + build" on the build host; a serving node holds the ~71 GB
    # checkpoint, the ~20 GB image and the JIT caches.
    build_host_disk_gib: Float = Field(default=170.0, ge=0, le=1e6)
    serve_node_disk_gib: Float = Field(default=100.0, ge=0, le=1e6)


class BenchSettings(Strict):
    suite: Literal["recipe", "loaded", "all"] = "all"
    # ge=1: every figure is divided by it (vs_reference); 1e-320 would make each ratio infinite.
    reference_tok_s: Float = Field(default=REFERENCE_MEAN_TOK_S, ge=1, le=1e5, description="albond's published mean (GX10, 0.90 GMU)")
    loaded_concurrency: Int = Field(default=8, ge=1, le=512)
    repeats: Int = Field(default=2, ge=1, le=20, description="runs per phase; with 2+ the first is a warm-up")
    floor_tok_s: Float = Field(default=40.0, ge=0, le=1e5, description="below this a node is not promoted to the gateway")
    # Runbook: MTP-2 gives ~95% acceptance; far below, the MTP weights or the speculative config
    # are wrong and tok/s alone may still pass. None: no acceptance floor.
    floor_mtp_acceptance: Float | None = Field(default=None, ge=0, le=1,
                                               description="spec-decode accepted/drafted below this: not promoted")
    # The quality phase (core/quality.py, scored /100): a node below the floor, or failing one of its
    # deterministic checks (smoke answer, reasoning parser, tool call), is not promoted. None: the
    # score has no floor, but a failed check, a phase that measured nothing and a rollout's drop
    # below the fleet's baseline still hold the node.
    floor_quality: Float | None = Field(default=None, ge=0, le=100,
                                        description="quality score (/100) below this, or a failed check: not promoted")
    quality_noise: Float = Field(default=20.0, ge=0, le=100,
                                 description="points a rollout's quality may fall below the fleet's baseline "
                                             "before its gate fails (the measured noise band)")
    # Forcing (vLLM's ignore_eos + min_tokens) makes every request decode max_tokens: early EOS
    # otherwise changes the tok/s mix, which flatters or hides MTP (core/protocol.py).
    force_output_length: bool = Field(default=True, description="bench requests decode exactly max_tokens")


def _check_plug_argv(v: tuple[str, ...]) -> tuple[str, ...]:
    if not v:
        raise ValueError("empty: give the argv that switches the plug, e.g. [kasa, --host, 10.0.0.50, off]")
    if not (v[0].startswith("/") and names.PATH.fullmatch(v[0])) and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", v[0]):
        raise ValueError(f"{names.shown(v[0])} is not a program (a name or an absolute path); the argv runs without a shell")
    return v


PlugArgv = Annotated[tuple[str, ...], AfterValidator(_check_plug_argv)]


class SmartPlug(Strict):
    """The node's brick on a smart plug (runbook: "future cold-drains are a phone tap"): argv run on the
    machine that runs the pipeline, only by cold_drain_job, without a shell."""

    off_command: PlugArgv
    on_command: PlugArgv
    timeout_s: Int = Field(default=60, ge=1, le=600, description="limit of each plug command")


class ColdDrainSettings(Strict):
    """The PD-firmware wedge's cold drain (cold_drain_job)."""

    smart_plugs: dict[NodeName, SmartPlug] = Field(default={}, description="none: the job asks the operator to unplug")
    off_s: Int = Field(default=120, ge=COLD_DRAIN_MIN_OFF_S, le=3600,
                       description="AC off at the wall: the runbook's 90-120 s (60 s is the minimum, often not enough)")
    power_down_timeout_s: Int = Field(default=300, ge=10, le=3600, description="after `sudo poweroff`, until SSH stops answering")
    operator_timeout_s: Int = Field(default=3600, ge=60, le=24 * 3600, description="no plug: until the operator's unit answers SSH again")
    boot_timeout_s: Int = Field(default=900, ge=10, le=3600, description="with a plug: from power on until SSH answers")
    engine_timeout_s: Int = Field(default=900, ge=10, le=6 * 3600, description="docker start until /health (warm 7-10 min)")


class NodeOsSettings(Strict):
    """Phase 0 (node_os_job): an operator's choices per fleet. The runbook's values themselves (the
    service lists, the nine sysctls, swap, earlyoom) are invariants in core/node_os.py."""

    # "Disable tailscale if not needed": kept by default, SSH to a node often rides on it.
    disable_tailscale: bool = False
    keep_services: tuple[Annotated[str, shaped(names.UNIT_NAME, "service name")], ...] = Field(
        default=(), description="units of the runbook's lists this fleet keeps (e.g. dgx-dashboard-admin)")
    # "Hard reset > waiting when SSH locks up for >10 min" (lesson 5).
    reboot_ssh_timeout_s: Int = Field(default=600, ge=30, le=3600, description="after `sudo reboot`, until SSH answers")
    power_cycle: Literal["ask", "auto"] = Field(
        default="ask", description="a node that does not come back: auto cuts AC through its smart plug "
                                   "(cold_drain.smart_plugs), ask quarantines it with the runbook's advice")


class GatewayFront(Strict):
    """nginx on gateway.proxy_port in front of LiteLLM (core/gateway_front.py says why): the
    clients' connections survive LiteLLM's graceful reloads."""

    litellm_port: Port = Field(default=4001, description="LiteLLM's port on the gateway host's loopback, behind the front")
    idle_timeout_s: Int = Field(default=900, ge=10, le=86400,
                                description="silence allowed within a request (a long prompt's first token) and on "
                                            "an idle client connection")


class RolloutSettings(Strict):
    """How a new image or checkpoint reaches the serving nodes (core/rollout.py)."""

    max_unavailable: Int = Field(default=1, ge=1, le=64, description="nodes out of the gateway at once during a rollout")
    deploy_wait_s: Float = Field(default=1800, ge=0, le=86400,
                                 description="how long a deploy waits for its turn out of the gateway (other nodes "
                                             "deploying or benched) before it is refused, nothing changed")
    canary: NodeName | None = Field(default=None, description="the node that goes first, alone (default: the first serving one)")
    max_regression: Float = Field(default=0.05, ge=0, le=1,
                                  description="slower than the fleet's baseline on the previous version by more than this "
                                              "(and its spread): the gate fails")


class DistributionSettings(Strict):
    """How the checkpoint and image are pipelined down the tree from the build host (core/distribution.py)."""

    fan_out: Int = Field(default=1, ge=1, le=16, description="children one node feeds at once; 1 gives each its full "
                                                             "link (one source: the tree is a chain)")
    max_attempts: Int = Field(default=2, ge=1, le=10, description="tries per receiver in one run before it is left for a rerun")


class AdoptionSettings(Strict):
    """First contact (runbook/adoption.py): the nodes are read at once, each under its own lease."""

    # Each node hashes its own copy on its own disk (minutes for ~71 GB): the disks are the limit,
    # not the orchestrator, so several at once; fewer where nodes share storage (an NFS models dir).
    max_hashing: Int = Field(default=8, ge=1, le=64, description="nodes whose checkpoint adoption hashes at once")


class VersionSettings(Strict):
    """Checkpoint versions kept on each node (core/versions.py)."""

    # The serving version and the one before it: a rollout's revert and a deploy's rollback point
    # back to it without a copy. Whatever a rollout point, a deploy journal or the last known good
    # names is kept on top of this count.
    keep: Int = Field(default=2, ge=1, le=20, description="newest checkpoint versions checkpoint_gc_job leaves on a node")


class HealthSettings(Strict):
    """The node_health sensor's healing policy (core/healing.py)."""

    restart_budget: Int = Field(default=3, ge=0, le=100, description="redeploys of one node per window; past it the node is quarantined")
    restart_window_s: Int = Field(default=6 * 3600, ge=60, le=7 * 86400)
    backoff_s: Int = Field(default=600, ge=0, le=86400, description="wait after a redeploy before the next one, doubled each time")
    backoff_factor: Float = Field(default=2.0, ge=1, le=10)
    failed_sweeps: Int = Field(default=2, ge=1, le=20, description="sweeps in a row a verdict must hold before a policy acts on it")
    bench_max_s: Int = Field(default=1800, ge=60, le=86400, description="a drain older than this is no bench any more: a healthy node is put back; "
                                                                          "a bench's speed phases end within it")


class StepRetrySettings(Strict):
    """The fleet file's `ssh:` section: how Dagster retries a whole step (not the connection's own
    attempts within one session, resources.ssh.SshSettings.connect_retries). A step whose SSH
    session could not be opened (refused, timed out, no route: nothing on the node changed yet) is
    retried with backoff; a host key that does not match never is, nor is any failure after the
    session opened (a failed launch has run its undo: a blind rerun would repeat it)."""

    connect_retries: Int = Field(default=2, ge=0, le=10, description="retries of a step that could not connect")
    connect_backoff_s: Int = Field(default=20, ge=1, le=3600,
                                   description="wait before the first retry, doubled for each next one")


class RetentionSettings(Strict):
    """Local files written for people, never read back (core/retention.py): each command's whole
    output (0600, $DAGSTER_HOME/storage/command-output) and the bench-history PNGs
    ($DAGSTER_HOME/storage/bench-charts). Pruned where they are written: beyond the newest N, or
    older than max_age_days (the run's own event log keeps what it said)."""

    max_age_days: Int = Field(default=30, ge=1, le=3650, description="files older than this are removed")
    command_outputs: Int = Field(default=20000, ge=100, le=10_000_000,
                                 description="command output files kept (a deploy writes ~50, a build ~100)")
    bench_charts: Int = Field(default=500, ge=1, le=100_000, description="bench-history PNGs kept (one per bench)")



# Phase 4-alt: "Order matters: WORKER (rank 1) FIRST, then HEAD (rank 0) after ~15s", rendezvous on
# --master-port 29501 at the head's address on the link (the runbook's SPARK1_IP).
PAIR_MASTER_PORT = 29501
# The image the runbook validated TP=2 with: "NCCL 2.30.4". A pip NCCL of the same version but
# another build hangs every 20-26 minutes (vLLM issues 41725, 42354): the pair's preflight compares.
VALIDATED_NCCL = "2.30.4"


class PairLink(Strict):
    """The direct link between a pair's two nodes (the runbook's DAC between the CX-7 ports)."""

    head_address: Host = Field(description="the head's address on the link: --master-addr (the runbook's SPARK1_IP)")
    worker_address: Host = Field(description="the worker's address on the link")
    # A link at 1500 instead of jumbo frames moves ~3 GB/s instead of ~24 (dgx-spark-playbooks issue 102).
    mtu: Int = Field(default=9000, ge=1280, le=65535, description="frames the link must carry whole, both ways")

    @model_validator(mode="after")
    def _two_ends(self) -> PairLink:
        if self.head_address == self.worker_address:
            raise ValueError(f"head_address and worker_address are both {self.head_address}: give each end its own")
        return self


class NodePair(Strict):
    """Two nodes serving one model with --tensor-parallel-size 2 (Phase 4-alt): a launch profile of
    node pairs. Off by default: the runbook keeps it "for reference only", the nodes are no longer
    DAC-connected. On, its head serves the API as one gateway backend and its worker runs headless."""

    name: NodeName
    head: NodeName = Field(description="rank 0: serves the API; its link address is --master-addr")
    worker: NodeName = Field(description="rank 1: --headless, launched first")
    enabled: bool = False
    reason: Text = Field(default="", description="why the pair is off, shown by `plan`")
    # Declared after `enabled`: its check reads it (validate_default: a missing link is checked too).
    link: PairLink | None = Field(default=None, validate_default=True)
    master_port: Port = PAIR_MASTER_PORT
    worker_ready_s: Int = Field(default=300, ge=5, le=3600,
                                description="the worker's headless milestone within this, or the head is not "
                                            "launched (the runbook sleeps ~15 s, then reads its log)")
    nccl: Annotated[str, shaped(names.GIT_REF, "NCCL version")] = Field(
        default=VALIDATED_NCCL, description="the NCCL the image must load (the runbook's validated build)")

    @field_validator("link")
    @classmethod
    def _link_to_turn_on(cls, v: PairLink | None, info: ValidationInfo) -> PairLink | None:
        if v is None and info.data.get("enabled"):
            why = info.data.get("reason") or "no link"
            raise ValueError(f"the pair cannot be turned on (enabled: true) without its link (off because: "
                             f"{why}); add link: {{head_address, worker_address, mtu}} once the nodes are connected")
        return v

    @model_validator(mode="after")
    def _two_nodes(self) -> NodePair:
        if self.head == self.worker:
            raise ValueError(f"head and worker are both {self.head}: a pair is two nodes")
        return self


def check_pairs(pairs: tuple[NodePair, ...], nodes: list[str], serve_nodes: list[str]) -> None:
    """Across pairs: names unique, each node in one pair at most and, once the pair is on, a serve
    node of the fleet (an off pair may name nodes a smaller fleet made from the seed left out)."""
    seen: dict[str, str] = {}
    names_seen: set[str] = set()
    for i, p in enumerate(pairs):
        where = f"pairs[{i}] ({p.name})"
        if p.name in names_seen:
            raise ValueError(f"{where}: pair name {p.name!r} appears twice: pair names must be unique")
        names_seen.add(p.name)
        for role in ("head", "worker"):
            node = getattr(p, role)
            if p.enabled and node not in nodes:
                raise ValueError(f"{where}.{role}: no node named {node!r} in the fleet (nodes: {', '.join(nodes)})")
            if p.enabled and node not in serve_nodes:
                raise ValueError(f"{where}.{role}: {node} has no 'serve' role: a pair that is on serves on both nodes")
            if node in seen:
                raise ValueError(f"{where}.{role}: {node} is in pair {seen[node]} already: a node is in one pair at most")
            seen[node] = p.name
