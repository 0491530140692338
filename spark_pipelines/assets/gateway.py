"""Phase 5: the LiteLLM config for every healthy, promoted node, written to the gateway host and reloaded.

Only the entries spark-pipelines owns are rewritten; a hand entry identical to what it would write is
taken over rather than doubled; an operator's own entries, comments and settings stay (see
core/gateway.py). A rotation below gateway.min_in_rotation (at least 1) is refused and the
proxy keeps its current config."""


import dagster as dg
import httpx

from spark_pipelines.assets import left_out_table, retry_unreachable, step_session
from spark_pipelines.assets.metadata import table
from spark_pipelines.core import steps
from spark_pipelines.core import record_keys as keys
from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core.fleet import Fleet
from spark_pipelines.core.pins import code_versions
from spark_pipelines.resources.gateway import LiteLLMGateway
from spark_pipelines.resources.ssh import FleetSSH
from spark_pipelines.state import markers
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.runbook.rotation import write_promotion


POOL_COLUMNS = (
    ("pool", "string", "LiteLLM model name clients ask for"),
    ("node", "string", "the serve node behind this entry"),
    ("api_base", "string", "the node's vLLM endpoint"),
    ("model", "string", "what LiteLLM calls upstream"),
    ("entry", "string", "spark-pipelines (owned) or operator (a hand-written route to the node, kept as it is)"),
)


def pool_rows(config: dict, fleet: Fleet | None = None) -> list[dict]:
    """Every route to a fleet node (owned, or hand-written with the node's api_base), one row
    each: the gateway's pools readable inline."""
    rows = []
    for entry in config.get("model_list") or []:
        node = gateway_core.route(entry, fleet)
        if not node:
            continue
        params = entry.get("litellm_params") or {}
        rows.append({"pool": entry.get("model_name"), "node": node, "api_base": params.get("api_base"),
                     "model": params.get("model"),
                     "entry": "spark-pipelines" if gateway_core.owner(entry) else "operator"})
    return rows


def gateway_definitions(fleet: Fleet) -> dg.Definitions:
    cv = code_versions(fleet)

    @dg.asset(
        group_name="4_gateway",
        kinds={"litellm"},
        code_version=cv[steps.GATEWAY],
        deps=[steps.NODE_DEPLOYMENT],
        check_specs=[dg.AssetCheckSpec(
            "routes_through_proxy", asset=steps.GATEWAY,
            description="One streamed chat request through the first LiteLLM pool reaches a live vLLM backend "
                        "(HTTP 200 with SSE data): the proxy routes after its reload.")],
        # bench_results comes after the gateway (it drains its node through it); its gate reaches
        # the gateway through the bench marker on the node, read by promotion() on the next write.
        description="Phase 5: LiteLLM pools (fast / reasoning / code) over every node whose vLLM answers /health "
                    "and whose last bench did not hold it out (a node never benched is in; bench_results, "
                    "downstream, drains each node and keeps one below its floor out). Each bench's drain and "
                    "restore is recorded here as an observation with the rotation after it.",
    )
    @retry_unreachable(fleet.ssh)
    def gateway(context: dg.AssetExecutionContext, ssh: FleetSSH, litellm: LiteLLMGateway):
        step_session(context, ssh, litellm)
        host = litellm.host()
        f = host.fleet
        try:
            rotation, left_out, config, reloaded = write_promotion(host)
        except RunbookError as e:
            raise dg.Failure(description=e.description) from None
        drift = gateway_core.settings_drift(config, f)
        view = gateway_core.owned_view(config, f)
        report = host.last_report or gateway_core.Report()
        # One streamed request through the first pool proves the proxy routes to a live backend.
        pool = f.gateway.pools[0]
        key = litellm.master_key or ""
        routed, detail = False, ""
        try:
            with httpx.stream(
                "POST", f"{host.base_url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"} if key else {},
                json={"model": pool, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "stream": True},
                timeout=120,
            ) as r:
                body = "".join(r.iter_text())
                routed = r.status_code == 200 and "data:" in body
                detail = f"HTTP {r.status_code} via {r.headers.get('x-litellm-model-api-base', '?')}"
        except httpx.HTTPError as e:
            detail = first_line(e)
        yield dg.Output(
            {"rotation": rotation, "left_out": left_out},
            data_version=dg.DataVersion(markers.signature(config)),
            metadata={
                "nodes_in_rotation": dg.MetadataValue.int(len(rotation)),
                "reloaded": reloaded,
                keys.ROTATION: ", ".join(rotation),
                "left_out": "; ".join(f"{k}: {v}" for k, v in left_out.items()) or "none",
                keys.LEFT_OUT_BY_NODE: left_out_table(left_out),
                "proxy": dg.MetadataValue.url(host.base_url),
                "config_path": dg.MetadataValue.path(host.config_path),
                # Only what spark-pipelines owns: an operator's entries may carry literal api keys.
                "config": dg.MetadataValue.md("```yaml\n" + gateway_core.dump(view) + "```"),
                "pools": table(POOL_COLUMNS, pool_rows(config, f)),
                # Entries routing to no fleet node: a hand route to a node is not "the operator's, kept".
                "operator_entries_kept": len(view["operator_entries"]),
                "routes_not_owned": dg.MetadataValue.md(
                    "\n".join(f"- {r}" for r in view["routes_not_owned"]) or "none"),
                "taken_over": len(report.taken_over),
                "duplicates_removed": len(report.collapsed),
                "changes": dg.MetadataValue.md("\n".join(f"- {line}" for line in report.lines()) or "none"),
                "settings_drift": dg.MetadataValue.md("\n".join(f"- {d}" for d in drift) or "none"),
            },
        )
        yield dg.AssetCheckResult(
            check_name="routes_through_proxy",
            passed=routed,
            severity=dg.AssetCheckSeverity.ERROR,
            description=f"streamed request to pool {pool!r}: {detail}",
            metadata={"pool": pool, "route": detail},
        )

    gateway_job = dg.define_asset_job(
        steps.GATEWAY_JOB, selection=dg.AssetSelection.assets(steps.GATEWAY),
        description="Phase 5: write the LiteLLM pools (fast / reasoning / code) over every healthy, promoted "
                    "node to the gateway host, reload the proxy, and prove it routes.")
    return dg.Definitions(assets=[gateway], jobs=[gateway_job])
