"""The metadata keys a recorded step carries that other code reads back, once.

The bench asset writes `mean_tok_s`; the doctor's history, the demo's table, the fleet summary
and the next bench's side-by-side read it. Each of them spells the key from here (the writers in
assets/ and runbook/, the readers in state/records.py and core/summary.py), so a renamed key
cannot leave a reader finding nothing. Keys only the UI reads are not listed.
"""

from __future__ import annotations

# bench_results (assets/bench.py: bench_metadata)
MEAN_TOK_S = "mean_tok_s"  # the recipe's mean output tok/s: the history, the demo, the summary
VS_REFERENCE = "vs_reference"  # mean / the recipe's reference
REFERENCE_TOK_S = "reference_tok_s"
FLOOR_TOK_S = "floor_tok_s"  # the node's promotion floor at the time
PROMOTED = "promoted"  # passed the promotion gate: in the gateway
GATE = "gate"  # the gate's reason, said when a node is out
GPU_UNDER_LOAD = "gpu_under_load"  # healthy | wedged | ...: the health verdict's latest GPU state
SPEC_ACCEPTANCE_RATE = "spec_acceptance_rate"  # MTP acceptance, 0..1: `regressed` reads its history
LOADED_AGGREGATE_TOK_S = "loaded_aggregate_tok_s"
BENCH_RECORD = "bench_record"  # core.baseline.BenchRecord as JSON: what makes benches comparable
QUALITY_SCORE = "quality_score"  # the quality phase's score /100 (the lower of its two passes)
QUALITY_CHECKS = "quality_checks"  # "all passed" or the deterministic checks that failed
BENCH_PROTOCOL = "bench_protocol"  # core.protocol key: benches under different ones never compare

# node_os (assets/node_os.py): the memcheck after the Phase 0 reboot, null when not measured
CLEAN_BOOT_FREE_GIB = "clean_boot_free_gib"

# node_deployment / node_artifacts (assets/nodes.py, runbook/deploy.py)
IMAGE_ID = "image_id"
CHECKPOINT = "checkpoint"  # node_artifacts: the index digest, first 12
KV_CACHE_TOKENS = "kv_cache_tokens"
STARTUP_SECONDS = "startup_seconds"
BOOT_SECONDS = "boot_seconds"  # docker run to healthy (the engine's boot alone, a shipped cache's retry included)
FREE_GIB_AT_PREFLIGHT = "free_gib_at_preflight"  # free CUDA memory the deploy's preflight read
ROLLOUT_RUN = "rollout_run"  # a deploy or bench recorded by a rollout: its run id

# node_deployment observations (sensors/health.py, assets/health.py)
VERDICT = "verdict"
EVIDENCE = "evidence"
ADVICE = "advice"
IN_GATEWAY = "in_gateway"
QUARANTINED = "quarantined"
POLICY = "policy"

# gateway materializations and observations (assets/gateway.py)
ROTATION = "rotation"  # "spark1, spark2": who the proxy routes to
LEFT_OUT_BY_NODE = "left_out_by_node"  # {node: why out}
