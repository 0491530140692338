"""How long a run of each long job may take: the sum of the bounds its steps can wait on, one
after another, read where each bound lives (the fleet file's settings, the module constants of
the procedures and resources). The jobs carry it as `dagster/max_runtime`, so the instance's run
monitoring (team/dagster.yaml) cancels a run only past its own worst case, never a GX10's
download and builds or a four-node rollout of a new image (one node after another) that is
still inside its bounds, while a hung short run still ends at the instance-wide default.

Every remote command has a limit; a command that reaches it fails its step, whose undo runs a
few more. SHORT_COMMANDS_S covers that chain of default-limited commands per node step (probes,
markers, exporters, the cache links) so that only the long waits need naming here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from spark_pipelines.core import node_os as os_core
from spark_pipelines.core import remote, steps
from spark_pipelines.core.fleet import Fleet, Node
from spark_pipelines.resources import engine, gateway
from spark_pipelines.resources.transfer import DIGEST_TIMEOUT_S
from spark_pipelines.runbook import bench, build_steps, images, jit_cache, node_os, transaction, wedge

MAX_RUNTIME_TAG = "dagster/max_runtime"  # read by Dagster's run monitoring, seconds
SHORT_COMMANDS_S = 10 * remote.DEFAULT_COMMAND_TIMEOUT_S
# A gateway change: the lock, the reload (and the reload of the config put back), the proxy ready.
GATEWAY_CHANGE_S = gateway.change_limit_s() + gateway.READY_TIMEOUT_S


@dataclass(frozen=True)
class Limit:
    """A job's worst case, term by term (what it waits on, seconds)."""

    job: str
    terms: tuple[tuple[str, float], ...]

    @property
    def seconds(self) -> int:
        return int(sum(s for _, s in self.terms)) + 1

    def tags(self) -> dict[str, str]:
        return {MAX_RUNTIME_TAG: str(self.seconds)}


def _sum(*parts: Iterable[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    return tuple(t for p in parts for t in p)


def _retries(fleet: Fleet, step_count: int) -> list[tuple[str, float]]:
    """A step that could not open its SSH session waits connect_backoff_s, doubling, before each retry."""
    wait = sum(fleet.ssh.connect_backoff_s * 2 ** i for i in range(fleet.ssh.connect_retries))
    return [("ssh.connect_backoff_s retries", float(wait * step_count))] if wait else []


def _gateway_changes(n: int, what: str) -> list[tuple[str, float]]:
    return [(f"{what}: {n} gateway change(s)", n * GATEWAY_CHANGE_S)]


def finish_interrupted_terms(what: str) -> list[tuple[str, float]]:
    """A dead run's deploy finished first (once per node and run: the next step finds no journal):
    its rollback's /health wait, its drain undone."""
    return [(f"{what}: a dead run's rollback (ROLLBACK_HEALTH_S)", float(transaction.ROLLBACK_HEALTH_S)),
            *_gateway_changes(1, f"{what}: its drain"), (f"{what}: commands", SHORT_COMMANDS_S)]


def deploy_terms(fleet: Fleet, node: Node) -> list[tuple[str, float]]:
    """One node's deploy transaction: its turn out of the gateway, the drain, the launch to /health
    and the smoke test, the rollback of a launch that failed, the restore."""
    return [("deploy: rollout.deploy_wait_s (its turn)", fleet.rollout.deploy_wait_s),
            *_gateway_changes(2, "deploy: drain and restore"),
            ("deploy: requests in flight end (gateway.in_flight_wait_s)", float(fleet.gateway.in_flight_wait_s)),
            ("deploy: launch health_timeout_s", float(fleet.launch_for(node).health_timeout_s)),
            ("deploy: smoke test", engine.SMOKE_TIMEOUT_S),
            ("deploy: rollback's /health (ROLLBACK_HEALTH_S)", float(transaction.ROLLBACK_HEALTH_S)),
            ("deploy: commands", SHORT_COMMANDS_S)]


def bench_terms(fleet: Fleet) -> list[tuple[str, float]]:
    """One node's isolated bench: the drain's wait for the rotation, zero requests in flight, the
    speed phases (bounded by health.bench_max_s), the quality phase, the restore."""
    return [("bench: drain waits for the rotation (ROTATION_WAIT_S)", gateway.ROTATION_WAIT_S),
            *_gateway_changes(2, "bench: drain and restore"),
            ("bench: zero requests in flight (gateway.in_flight_wait_s)", float(fleet.gateway.in_flight_wait_s)),
            ("bench: speed phases (health.bench_max_s)", float(fleet.health.bench_max_s)),
            ("bench: quality phase (QUALITY_MAX_S)", float(bench.QUALITY_MAX_S)),
            ("bench: commands", SHORT_COMMANDS_S)]


def _copy_terms(what: str, copies: int) -> list[tuple[str, float]]:
    """`copies` checkpoint + image copies one after another, each verified by content on its receiver."""
    one = remote.COPY_TIMEOUT_S + remote.IMAGE_COPY_TIMEOUT_S + DIGEST_TIMEOUT_S + SHORT_COMMANDS_S
    return [(f"{what}: {copies} copy round(s) of checkpoint + image, verified", copies * one)]


def distribution_terms(fleet: Fleet, receivers: int) -> list[tuple[str, float]]:
    # The pipeline's worst case: each receiver waits for the ones above it and gets
    # distribution.max_attempts tries, so receivers x attempts whole copies one after another.
    return _copy_terms("distribution", receivers * fleet.distribution.max_attempts) if receivers else []


def node_os_terms(fleet: Fleet, node: Node) -> list[tuple[str, float]]:
    """Phase 0: every change of a node out of the box and its undo, the drained reboot, the power
    cycle (smart plug) or the quarantine, the verify and memcheck, the engine back."""
    commands = os_core.most_commands(node_os.choices(fleet))
    cd = fleet.cold_drain
    plug = cd.smart_plugs.get(node.name)
    cycle = (2 * plug.timeout_s + cd.off_s + cd.boot_timeout_s) if plug and fleet.node_os.power_cycle == "auto" else 0
    return [("node_os: reads", 20 * float(node_os.READ_TIMEOUT_S)),
            (f"node_os: {commands} change and undo commands (CHANGE_TIMEOUT_S)", commands * float(node_os.CHANGE_TIMEOUT_S)),
            ("node_os: drain waits for the rotation", gateway.ROTATION_WAIT_S),
            *_gateway_changes(3, "node_os: drain, quarantine, restore"),
            ("node_os: down after reboot (DOWN_TIMEOUT_S)", float(node_os.DOWN_TIMEOUT_S)),
            ("node_os: node_os.reboot_ssh_timeout_s", float(fleet.node_os.reboot_ssh_timeout_s)),
            ("node_os: power cycle by its smart plug", float(cycle)),
            ("node_os: nvidia-persistenced", wedge.PERSISTENCED_WAIT_S),
            ("node_os: memcheck", float(node_os.MEMCHECK_TIMEOUT_S)),
            ("node_os: engine back (cold_drain.engine_timeout_s)", float(cd.engine_timeout_s)),
            ("node_os: commands", SHORT_COMMANDS_S)]


def build_terms() -> list[tuple[str, float]]:
    """Steps 0-4 on the build host, each hashed and verified."""
    verify = build_steps.VERIFY_TIMEOUT_S + DIGEST_TIMEOUT_S + build_steps.FS_TIMEOUT_S + SHORT_COMMANDS_S
    return [("base_model: download (DOWNLOAD_TIMEOUT_S)", remote.DOWNLOAD_TIMEOUT_S),
            ("base_model: verified, hashed", verify),
            ("hybrid_checkpoint: clone + build (CHECKPOINT_BUILD_TIMEOUT_S)",
             build_steps.GIT_TIMEOUT_S + remote.CHECKPOINT_BUILD_TIMEOUT_S),
            ("hybrid_checkpoint: verified, hashed, switched", verify),
            ("mtp_weights: staged + built (CHECKPOINT_BUILD_TIMEOUT_S)",
             build_steps.FS_TIMEOUT_S + remote.CHECKPOINT_BUILD_TIMEOUT_S),
            ("mtp_weights: verified, hashed, switched", verify),
            ("base_image: clone + build (IMAGE_BUILD_TIMEOUT_S)", build_steps.GIT_TIMEOUT_S + remote.IMAGE_BUILD_TIMEOUT_S),
            ("base_image: probe", images.IMAGE_PROBE_TIMEOUT_S + SHORT_COMMANDS_S),
            ("serving_image: clone + build (IMAGE_BUILD_TIMEOUT_S)", build_steps.GIT_TIMEOUT_S + remote.IMAGE_BUILD_TIMEOUT_S),
            ("serving_image: probe", images.IMAGE_PROBE_TIMEOUT_S + SHORT_COMMANDS_S)]


def limits(fleet: Fleet) -> dict[str, Limit]:
    """The long jobs' worst cases for this fleet (the per-node jobs: its slowest node). A job not
    listed ends well inside the instance-wide max_runtime_seconds."""
    serve = fleet.serve_nodes
    receivers = sum(1 for n in serve if "build" not in n.roles)
    jit = [("jit_cache: archive to the build host", remote.COPY_TIMEOUT_S + jit_cache.WIPE_TIMEOUT_S + SHORT_COMMANDS_S)]

    def slowest(terms_of) -> tuple[tuple[str, float], ...]:
        return max((tuple(terms_of(n)) for n in fleet.nodes), key=lambda t: sum(s for _, s in t))

    deploy_node = slowest(lambda n: _sum(finish_interrupted_terms("deploy"), _copy_terms("node_artifacts", 1),
                                         deploy_terms(fleet, n), jit, _retries(fleet, 3)))
    bench_one = _sum(finish_interrupted_terms("bench"), bench_terms(fleet), _retries(fleet, 1))
    # A rollout: the fan-out, then each serving node deployed and gated one after another, one
    # reverted (the first failed gate stops it), each finished.
    per_node = [t for n in serve for t in _sum(finish_interrupted_terms(n.name), deploy_terms(fleet, n), bench_terms(fleet),
                                               [(f"finish {n.name}", SHORT_COMMANDS_S)])]
    revert = [("revert: the kept deployment's /health", float(transaction.ROLLBACK_HEALTH_S)),
              *_gateway_changes(2, "revert: drain and restore"), ("revert: commands", SHORT_COMMANDS_S)]
    rollout = _sum(distribution_terms(fleet, receivers), per_node, revert, _retries(fleet, 1))
    add_node = slowest(lambda n: _sum(node_os_terms(fleet, n), distribution_terms(fleet, 1), finish_interrupted_terms(n.name),
                                      deploy_terms(fleet, n),
                                      bench_terms(fleet), _retries(fleet, 1)))
    cd = fleet.cold_drain
    plug_cycle = max((2 * p.timeout_s + cd.off_s + cd.boot_timeout_s for p in cd.smart_plugs.values()), default=0)
    cold_drain = _sum(_gateway_changes(1, "cold_drain: quarantine"),
                      [("cold_drain: power down", float(cd.power_down_timeout_s)),
                       ("cold_drain: AC off and back (operator or smart plug)", float(max(cd.operator_timeout_s, plug_cycle))),
                       ("cold_drain: nvidia-persistenced", wedge.PERSISTENCED_WAIT_S),
                       ("cold_drain: engine back (cold_drain.engine_timeout_s)", float(cd.engine_timeout_s)),
                       ("cold_drain: post-drain evidence", 40 * wedge.EVIDENCE_TIMEOUT_S + wedge.STORE_TIMEOUT_S)],
                      bench_terms(fleet), _retries(fleet, 2))
    adopt = _sum([("adopt: the build host's copy verified and hashed",
                   build_steps.VERIFY_TIMEOUT_S + 2 * DIGEST_TIMEOUT_S + 2 * images.IMAGE_PROBE_TIMEOUT_S)],
                 [(f"adopt {n.name}: its copy hashed", DIGEST_TIMEOUT_S + SHORT_COMMANDS_S) for n in serve],
                 _gateway_changes(1, "adopt: the gateway's take-over"), _retries(fleet, 1))
    ab = slowest(lambda n: _sum(
        finish_interrupted_terms(n.name), [t for _ in range(3) for t in deploy_terms(fleet, n)],  # two variants, then production back
        [("ab: zero requests in flight, twice", 2.0 * fleet.gateway.in_flight_wait_s),
         ("ab: two benches (health.bench_max_s)", 2.0 * fleet.health.bench_max_s)],
        _gateway_changes(2, "ab: drain and restore")))
    jobs = {
        steps.BUILD_JOB: _sum(build_terms(), _retries(fleet, 5)),
        steps.DEPLOY_JOB: deploy_node,
        steps.DISTRIBUTE_JOB: _sum(distribution_terms(fleet, receivers), _retries(fleet, 1)),
        steps.BENCH_JOB: bench_one,
        steps.ROLLOUT_JOB: rollout,
        steps.ADD_NODE_JOB: add_node,
        steps.NODE_OS_JOB: slowest(lambda n: _sum(node_os_terms(fleet, n), _retries(fleet, 1))),
        steps.COLD_DRAIN_JOB: cold_drain,
        steps.ADOPT_JOB: adopt,
        steps.AB_JOB: ab,
    }
    return {job: Limit(job, terms) for job, terms in jobs.items()}


def tags(fleet: Fleet, job: str) -> dict[str, str]:
    """The job's `dagster/max_runtime` tag ({} for a job the instance-wide default covers)."""
    limit = limits(fleet).get(job)
    return limit.tags() if limit is not None else {}
