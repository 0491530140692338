"""The names that cross layers, once: asset keys, jobs, ops, checks, run tags, sensors, schedules.

A policy in core decides "redeploy" and names the job; a sensor requests it; an asset module
defines it; the demo and the doctor read what it recorded. Each of them spells the name from
here, so a rename cannot leave one of them asking for a job or an asset that no longer exists.
Pure strings: nothing here imports Dagster.
"""

from __future__ import annotations

# Assets: the runbook's steps, in chain order (each one's code version comes from core/pins.py).
BASE_MODEL = "base_model"  # step 0: the INT4 checkpoint downloaded to the build host
HYBRID_CHECKPOINT = "hybrid_checkpoint"  # step 1: the hybrid INT4+FP8 checkpoint built there
MTP_WEIGHTS = "mtp_weights"  # step 2: the MTP head added; the checkpoint the nodes receive
BASE_IMAGE = "base_image"  # step 3: the vLLM base image
SERVING_IMAGE = "serving_image"  # step 4: the image every node runs
NODE_OS = "node_os"  # per node: Phase 0 (headless, services masked, sysctls, swap off, earlyoom) and its reboot
NODE_LAUNCH = "node_launch"  # per node: the launch spec the fleet file gives it, as data (observed)
NODE_ARTIFACTS = "node_artifacts"  # per node: checkpoint and image copied, verified on the node
ARTIFACT_DISTRIBUTION = "artifact_distribution"  # the copies fanned out along a tree (fleet-wide)
NODE_DEPLOYMENT = "node_deployment"  # per node: Phase 4; also where health sweeps are observed
JIT_CACHE = "jit_cache"  # per node: the compiled kernels archived on the build host
GATEWAY = "gateway"  # Phase 5: the LiteLLM config; drains and restores are observed on it
BENCH_RESULTS = "bench_results"  # per node: the isolated bench and its promotion gate
FLEET_ROLLOUT = "fleet_rollout"  # a new checkpoint or image onto the fleet as canary + waves
NODE_JOIN = "node_join"  # per node: a node new to the fleet file from nothing to benched and in the gateway
FLEET_ADOPTION = "fleet_adoption"  # first contact: a hand-built fleet's steps recorded as the tool's own
FLEET_SUMMARY = "fleet_summary"  # one row per node, read from what the others recorded
WEDGE_EVIDENCE = "wedge_evidence"  # per node: the pre-drain capture of a suspected wedge
COLD_DRAIN = "cold_drain"  # per node: the AC cold drain a person approves by launching it
AB_EXPERIMENTS = "ab_experiments"  # prefix of the A/B results' keys: ab_experiments/<node>

# The steps whose code version the pins sensor compares (and their order of rebuild).
BUILD_STEPS = (BASE_MODEL, HYBRID_CHECKPOINT, MTP_WEIGHTS, BASE_IMAGE, SERVING_IMAGE)  # unpartitioned
NODE_STEPS = (NODE_ARTIFACTS, NODE_DEPLOYMENT)  # per node; a change reaches the fleet as a rollout

# Jobs: what sensors, schedules, the healing policies and the demo ask the instance to run.
ADOPT_JOB = "adopt_job"  # fleet_adoption: first contact with a fleet built by hand
BUILD_JOB = "build_job"  # steps 0-4 on the build host
DISTRIBUTE_JOB = "distribute_job"  # the tree's copies before the per-node deploys
ADD_NODE_JOB = "add_node_job"  # node_join: Phase 0, artifacts, deploy, bench, gateway for one new node
NODE_OS_JOB = "node_os_job"  # Phase 0 of one node: changes what differs, reboots when needed
DEPLOY_JOB = "deploy_node_job"  # artifacts + deployment + JIT cache of one node (a partition)
GATEWAY_JOB = "gateway_job"  # Phase 5
BENCH_JOB = "bench_job"  # the isolated bench of one node
ROLLOUT_JOB = "rollout_job"  # fleet_rollout: the pins sensor's answer to a changed launch profile
QUARANTINE_JOB = "quarantine_job"  # a healing policy's quarantine (and the rollback decision)
RELEASE_JOB = "release_quarantine_job"  # an operator ends a quarantine
RECONCILE_JOB = "gateway_reconcile_job"  # node_health's gateway reconcile plan applied
WEDGE_CAPTURE_JOB = "wedge_capture_job"  # wedge_watch's request: quarantine + evidence
COLD_DRAIN_JOB = "cold_drain_job"  # a person's approval of a cold drain
AB_JOB = "ab_experiment_job"  # two launch-profile variants compared on one node
CHECKPOINT_GC_JOB = "checkpoint_gc_job"  # checkpoint versions no node needs, removed (check mode by default)

# Procedures that keep a journal in the ledger while they have a node out, stopped, rebooting or
# partly set aside (runbook/journal.py). A dead run's is finished by the next run on the node, or
# by a run of the procedure's own job the health sweep requests (its rerun finds what is done).
PROC_NODE_OS = NODE_OS  # Phase 0's drained reboot
PROC_JOIN = NODE_JOIN  # a newcomer: not routed before its bench promotes it
PROC_BENCH = "bench"  # the bench's drain
PROC_COLD_DRAIN = COLD_DRAIN  # docker stop, poweroff, AC off and on, docker start
PROC_ADOPTION = "adoption"  # hand-made JIT cache folders renamed into slots
FINISHED_BY = {PROC_NODE_OS: NODE_OS_JOB, PROC_JOIN: ADD_NODE_JOB, PROC_BENCH: BENCH_JOB,
               PROC_COLD_DRAIN: COLD_DRAIN_JOB, PROC_ADOPTION: DEPLOY_JOB}

# Ops whose config a run request carries (an asset's op is named as the asset).
QUARANTINE_OP = "quarantine_node"  # quarantine_job's op: QuarantineConfig
RELEASE_OP = "release_quarantine"  # release_quarantine_job's op
RECONCILE_OP = "reconcile_gateway"  # gateway_reconcile_job's op: ReconcileConfig
AB_OP = "ab_experiment"  # ab_experiment_job's op: ABConfig
DEPLOY_OP = NODE_DEPLOYMENT  # deploy_node_job's config goes to node_deployment: DeployConfig

# Asset checks read or reported outside the module that declares them.
HEALTH_CHECK = "health"  # on node_deployment: node_health reports one evaluation per node per sweep
ABOVE_FLOOR_CHECK = "above_floor"  # on bench_results: the promotion gate

# Concurrency pools (Dagster's, on the assets themselves, so a limit holds however a step is
# launched: its job, the asset page's Materialize (__ASSET_JOB), a backfill, a sensor, a schedule).
# The instance gives every pool one slot (team/dagster.yaml `concurrency.pools.default_limit`).
DRAIN_POOL = "gateway_drain"  # a step that takes a serving node out of the gateway for long: one at a time
BUILD_POOL = "image_build"  # an image build on the build host: one at a time

# Run tags. The instance's run queue limits the first three (team/dagster.yaml).
BENCH_TAG = "spark/bench"  # one bench at a time: a drained node is measured alone
BUILD_TAG = "spark/build"  # one build at a time on the build host
ROLLOUT_TAG = "spark/rollout"  # one rollout at a time
HEALTH_TAG = "spark/health"  # a run the healing policies own (quarantine)
HEALTH_ACTION_TAG = "spark/health-action"  # which policy action requested the run
REASON_TAG = "reason"  # why a sensor requested the run; a quarantine's `by` names it
EVIDENCE_TAG = "evidence"  # wedge_watch's first reason, read by wedge_evidence
PINS_TAG = "pins"  # the stale steps a pins_changed request runs for
NODES_TAG = "nodes"  # the nodes a pins_changed rollout is for (their pins or their launch changed)
# Dagster's own: the daemon puts a sensor request's run key on its run (node_health reads it back
# to retry a failed reconcile; the soak, which launches requests itself, puts it there too).
RUN_KEY_TAG = "dagster/run_key"

# Sensors and schedules (the UI, the demo's console and the tests start them by name).
HEALTH_SENSOR = "node_health"
PINS_SENSOR = "pins_changed"
ROLLOUT_SENSOR = "rollout"  # declarative automation of fleet_rollout
WEDGE_SENSOR = "wedge_watch"
SUMMARY_JOB = "fleet_summary_job"  # the demo's last run: the summary as the chain left the fleet
SUMMARY_SENSOR = "fleet_summary_refresh"
SUMMARY_AUTOMATION = "fleet_summary_automation"
WEEKLY_REBUILD = "weekly_rebuild"
NIGHTLY_BENCH = "nightly_bench"
