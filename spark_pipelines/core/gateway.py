"""LiteLLM gateway config: pools x nodes -> model_list, and the drain / restore transforms.

The runbook paused nodes by `sed`-commenting every `api_base` line of the config, which paused
ALL spark nodes at once and depended on IP prefixes. Here every entry is tagged with its node, so
one node can leave and re-enter rotation while the others keep serving.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import yaml

from spark_pipelines.core.fleet import Fleet, Node

NODE_TAG = "spark_node"  # kept in model_info; LiteLLM passes unknown model_info keys through


@dataclass(frozen=True)
class Backend:
    node: str
    api_base: str


def backend_for(fleet: Fleet, node: Node) -> Backend:
    host = fleet.gateway.api_host_overrides.get(node.name, node.host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal in a URL
    port = fleet.launch_for(node).port
    return Backend(node=node.name, api_base=f"http://{host}:{port}/v1")


def node_entries(fleet: Fleet, node: Node) -> list[dict[str, Any]]:
    gw = fleet.gateway
    backend = backend_for(fleet, node)
    served = fleet.launch_for(node).served_model_name
    return [
        {
            "model_name": pool,
            "litellm_params": {
                "model": f"openai/{served}",
                "api_base": backend.api_base,
                "api_key": gw.backend_api_key,
            },
            "model_info": {"id": f"{node.name}-{gw.model_id_stem}-{pool}", NODE_TAG: node.name},
        }
        for pool in gw.pools
    ]


def render_config(fleet: Fleet, nodes: list[str]) -> dict[str, Any]:
    """The whole proxy config with `nodes` in rotation, in fleet order (stable diffs)."""
    unknown = sorted(set(nodes) - set(fleet.node_names))
    if unknown:
        raise ValueError(f"unknown node(s) {unknown}; known: {fleet.node_names}")
    gw = fleet.gateway
    model_list: list[dict[str, Any]] = []
    for node in fleet.serve_nodes:
        if node.name in nodes:
            model_list += node_entries(fleet, node)
    return {
        "model_list": model_list,
        "router_settings": {
            "routing_strategy": gw.routing_strategy,
            # Without these a dead backend stays in rotation (LiteLLM has no DB here to disable it).
            "enable_health_check_routing": True,
        },
        "general_settings": {
            # LiteLLM resolves os.environ/ references itself: the key never lands in the file.
            "master_key": f"os.environ/{gw.master_key_env}",
            "background_health_checks": True,
            "health_check_interval": 30,
        },
    }


def nodes_in_rotation(config: dict[str, Any]) -> list[str]:
    seen: list[str] = []
    for entry in config.get("model_list") or []:
        node = (entry.get("model_info") or {}).get(NODE_TAG)
        if node and node not in seen:
            seen.append(node)
    return seen


def drain(config: dict[str, Any], node: str) -> dict[str, Any]:
    """Take one node out of every pool; entries of other nodes and unknown entries stay untouched."""
    out = copy.deepcopy(config)
    out["model_list"] = [
        e for e in out.get("model_list") or [] if (e.get("model_info") or {}).get(NODE_TAG) != node
    ]
    return out


def restore(config: dict[str, Any], fleet: Fleet, node: str) -> dict[str, Any]:
    """Put one node back into every pool (idempotent), keeping fleet order."""
    target = fleet.node(node)
    out = drain(config, node)
    order = {n: i for i, n in enumerate(fleet.node_names)}
    tagged = out["model_list"] + node_entries(fleet, target)
    # Foreign entries (no node tag) keep their place at the front; ours follow fleet order.
    foreign = [e for e in tagged if NODE_TAG not in (e.get("model_info") or {})]
    ours = [e for e in tagged if NODE_TAG in (e.get("model_info") or {})]
    ours.sort(key=lambda e: order.get(e["model_info"][NODE_TAG], len(order)))
    out["model_list"] = foreign + ours
    return out


def dump(config: dict[str, Any]) -> str:
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def load(text: str) -> dict[str, Any]:
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise ValueError("LiteLLM config is not a mapping")
    return data
