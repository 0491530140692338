"""A/B experiments: one node benchmarked under two launch-profile variants, honestly compared.

The runbook's MTP-2 vs MTP-3 and env-var verdicts were once contaminated by gateway traffic. Here
the node leaves the gateway for the whole experiment, each variant is deployed with the same
rollback-safe procedure as production, benched `repeats` times, and compared with
`core.bench.compare`, which declines to name a winner when the spreads overlap. The node's
production launch is put back in every outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from spark_pipelines.core import protocol as bench_protocol
from spark_pipelines.core import bench as bench_core
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.core import jit_cache as jit_core
from spark_pipelines.core.fleet import Fleet, FleetError, Node, parse_fleet
from spark_pipelines.core.launch import LaunchSpec, launch_spec
from spark_pipelines.resources.bench_client import run_bench
from spark_pipelines.resources.engine import api_root
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook import jit_cache
from spark_pipelines.runbook.rotation import wait_idle
from spark_pipelines.runbook.deploy import deploy
from spark_pipelines.runbook.journal import claimed
from spark_pipelines.runbook.rotation import drained


class Variant(Protocol):
    """A launch-profile variant (the A/B job's config gives one per side)."""

    name: str
    num_speculative_tokens: int | None
    gpu_memory_utilization: float | None
    env: dict[str, str]
    unset_env: list[str]


@dataclass
class Compared:
    """An experiment's outcome: each variant's bench report, the verdicts, the table."""

    node: str
    reports: dict[str, bench_core.BenchReport]
    verdicts: list[str]
    table: str


def variant_fleet(fleet: Fleet, node: str, variant: Variant) -> Fleet:
    """The fleet with this node's launch changed by the variant, validated like any fleet file
    (a variant cannot smuggle --enable-prefix-caching or a GMU the hardware refuses)."""
    data = fleet.model_dump(mode="json")
    n = next(x for x in data["nodes"] if x["name"] == node)
    # A fleet of this node alone: the variant's launch must validate for its hardware, not others'.
    n["roles"] = ["build", "serve"]
    data["nodes"] = [n]
    # Settings that name the other nodes do not apply to a fleet of this node alone.
    data["cold_drain"]["smart_plugs"] = {k: p for k, p in data["cold_drain"]["smart_plugs"].items() if k == node}
    data["gateway"]["api_host_overrides"] = {k: h for k, h in data["gateway"]["api_host_overrides"].items() if k == node}
    if data["rollout"]["canary"] not in (None, node):
        data["rollout"]["canary"] = None
    launch = fleet.launch_for(fleet.node(node))
    over: dict[str, Any] = dict(n.get("overrides") or {})
    env = {k: val for k, val in launch.env.items() if k not in variant.unset_env}
    env.update(variant.env)
    data["launch"]["env"] = env
    over["env"] = {}
    if variant.num_speculative_tokens is not None:
        over["speculative"] = {"method": launch.speculative.method if launch.speculative else "mtp",
                               "num_speculative_tokens": variant.num_speculative_tokens}
    if variant.gpu_memory_utilization is not None:
        over["gpu_memory_utilization"] = variant.gpu_memory_utilization
    n["overrides"] = over
    return parse_fleet(data, f"variant {variant.name!r}")


def comparison_md(node: str, reports: dict[str, bench_core.BenchReport], verdicts: list[str]) -> str:
    lines = [f"### A/B on {node}", "", "| variant | recipe mean tok/s (min-max) | loaded aggregate tok/s | acceptance |",
             "|---|---|---|---|"]
    for name, r in reports.items():
        loaded = next((p.aggregate_tok_s for p in r.phases if p.phase != bench_core.PHASE_RECIPE and p.aggregate_tok_s), None)
        acc = r.counters.acceptance_rate if r.counters and r.counters.acceptance_rate is not None else None
        lines.append(f"| {name} | {r.recipe_mean_tok_s.text(2) if r.recipe_mean_tok_s else '-'} | "
                     f"{loaded.text(2) if loaded else '-'} | {f'{acc:.1%}' if acc is not None else '-'} |")
    lines += ["", *[f"- {v}" for v in verdicts]]
    return "\n".join(lines)


def protocol_key(report: bench_core.BenchReport) -> str | None:
    return bench_protocol.key_of(report.protocol)


def _loaded(r: bench_core.BenchReport) -> Any:
    return next((p.aggregate_tok_s for p in r.phases if p.phase != bench_core.PHASE_RECIPE and p.aggregate_tok_s), None)


def serving_jit_key(session: FleetSession, node: Node, spec: LaunchSpec) -> str | None:
    """The JIT cache key the node's production launch runs on: the slot its cache mounts point at
    (None: not one of our slots, e.g. a hand deploy's plain directories)."""
    mounts = jit_cache.cache_mounts(spec)
    states = jit_cache.read(session, node, "0" * jit_core.KEY_LEN, mounts)
    keys = {jit_core.key_of_target(st.path, st.target) for st in states}
    return keys.pop() if len(keys) == 1 else None


def variant_jit_key(production_key: str | None, production: LaunchSpec, variant: LaunchSpec) -> str | None:
    """The slot a variant boots on: production's own when their kernels are alike, else a slot of
    its own derived from production's key (a variant never boots on, nor compiles into, the
    kernels production reloads after the experiment: another configuration's cache fails the
    boot, the runbook's stale-cache rows)."""
    if production_key is None:
        return None
    if jit_core.launch_hash(variant.serve_args, variant.env) == jit_core.launch_hash(production.serve_args, production.env):
        return production_key
    return jit_core.cache_key(production_key, production_key, variant.serve_args, variant.env)


def run_experiment(session: FleetSession, gw: GatewayHost, node_name: str | None, variants: list[Variant], log: Any, *,
                   suite: str = "all", repeats: int = 3, run_id: str = "") -> Compared:
    """Drain the node, deploy and bench each variant, compare them, then put the production launch
    back and restore the node (in every outcome). Holds the node's run lease. Raises RunbookError
    for variants that do not validate, and for a deploy or bench that fails."""
    fleet = session.fleet
    name = node_name or fleet.serve_nodes[0].name
    try:
        node = fleet.node(name)
        fleets = {v.name: variant_fleet(fleet, name, v) for v in variants}
    except FleetError as e:
        raise RunbookError(f"A/B config refused: {e}") from None
    if len(fleets) != 2:
        raise RunbookError("the two variants need different names")
    reports: dict[str, bench_core.BenchReport] = {}
    with claimed(session, node, "experiment", log, run_id=run_id):  # dead runs' work first: production serving
        production = launch_spec(fleet, node)
        key = serving_jit_key(session, node, production)
        with drained(gw, node.name):
            try:
                for vname, vf in fleets.items():
                    vnode = vf.node(node.name)
                    spec = launch_spec(vf, vnode)
                    log.info(f"variant {vname}: deploying")
                    deploy(session, vnode, spec, log, run_id=run_id, jit_key=variant_jit_key(key, production, spec))
                    wait_idle(vf, vnode)
                    reports[vname] = run_bench(api_root(vf, vnode), vf.launch_for(vnode).served_model_name,
                                               suite=suite, concurrency=fleet.bench.loaded_concurrency,
                                               repeats=repeats + 1, ignore_eos=fleet.bench.force_output_length,
                                               max_s=fleet.health.bench_max_s)
            finally:
                log.info(f"restoring the production launch on {node.name}")
                deploy(session, node, production, log, run_id=run_id, jit_key=key)
    (na, ra), (nb, rb) = reports.items()
    verdicts = []
    # MTP-2 vs MTP-3 under a length one server honoured and the other did not would crown the mix.
    same, why = bench_protocol.comparable(protocol_key(ra), protocol_key(rb))
    if not same:
        verdicts.append(f"not compared: {why}")
    elif ra.recipe_mean_tok_s and rb.recipe_mean_tok_s:
        verdicts.append("single-stream: " + bench_core.compare(ra.recipe_mean_tok_s, rb.recipe_mean_tok_s,
                                                               names=(na, nb)).text)
    la, lb = _loaded(ra), _loaded(rb)
    if same and la and lb:
        verdicts.append(f"loaded N={fleet.bench.loaded_concurrency}: " + bench_core.compare(la, lb, names=(na, nb)).text)
    return Compared(node.name, reports, verdicts, comparison_md(node.name, reports, verdicts))
