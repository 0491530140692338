"""The fleet file's smaller settings sections (preflight, bench, cold drain, rollout, distribution,
health, SSH retries): each a model with its defaults and the runbook's reasons beside them."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from spark_pipelines.core import names
from spark_pipelines.core.bench import REFERENCE_MEAN_TOK_S
from spark_pipelines.core.fleet_types import Float, Int, NodeName, Port, Strict, _shape
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
    keep_services: tuple[Annotated[str, _shape(names.UNIT_NAME, "service name")], ...] = Field(
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
    """How the checkpoint and image fan out from the build host (core/distribution.py)."""

    fan_out: Int = Field(default=1, ge=1, le=16, description="copies one holder sends at once; 1 gives each its full link")
    max_attempts: Int = Field(default=2, ge=1, le=10, description="tries per receiver in one run before it is left for a rerun")


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

