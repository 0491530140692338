"""LiteLLM gateway config: pools x nodes -> model_list, and the drain / restore transforms.

The runbook paused nodes by `sed`-commenting every `api_base` line of the config, which paused
ALL spark nodes at once and depended on IP prefixes. Here every entry spark-pipelines writes is
marked as its own with `model_info.spark_pipelines_node: <node>`, so one node can leave and
re-enter rotation while the others keep serving, and an operator's config survives:

- only marked ("owned") `model_list` entries are ever added, replaced or removed; every other
  entry keeps its content and its order among the others;
- `litellm_settings`, `router_settings`, `general_settings` and unknown top-level keys of an
  existing config are kept exactly (defaults are written only into a config that does not exist
  yet); where the host's value differs from the fleet file, `settings_drift` says so;
- the rotation (nodes with owned entries) never shrinks below `gateway.min_in_rotation`
  (`rotation_refusal`); a change that does not shrink it is never refused.

YAML comments are not kept by a rewrite (the previous file is kept as a backup on the host); the
header comments spark-pipelines writes carry the drain notes: which node is out, by whom, since when.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

import yaml

from spark_pipelines.core.fleet import Fleet, Node

OWNER_TAG = "spark_pipelines_node"  # in model_info; LiteLLM passes unknown model_info keys through
# Configs written before entries were marked as owned used this key; read as owned, rewritten with OWNER_TAG.
LEGACY_OWNER_TAGS = ("spark_node",)
DRAIN_NOTE = "# spark-pipelines drained "  # header line: "<prefix><node>: <who> since <when>"


class RotationRefused(ValueError):
    """A change would leave fewer nodes in the gateway's rotation than the fleet allows."""


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


def owner(entry: Any) -> str | None:
    """The node an owned entry routes to; None for an entry spark-pipelines did not write."""
    info = entry.get("model_info") if isinstance(entry, dict) else None
    if not isinstance(info, dict):
        return None
    for tag in (OWNER_TAG, *LEGACY_OWNER_TAGS):
        if isinstance(info.get(tag), str) and info[tag]:
            return info[tag]
    return None


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
            "model_info": {"id": f"{node.name}-{gw.model_id_stem}-{pool}", OWNER_TAG: node.name},
        }
        for pool in gw.pools
    ]


def default_settings(fleet: Fleet) -> dict[str, Any]:
    """What a config that does not exist yet gets besides its model_list."""
    gw = fleet.gateway
    return {
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


def _model_list(config: dict[str, Any] | None) -> list[Any]:
    entries = (config or {}).get("model_list") or []
    if not isinstance(entries, list):
        raise ValueError("the LiteLLM config's model_list is not a list: fix the file on the gateway host")
    return entries


def render_config(fleet: Fleet, nodes: list[str], current: dict[str, Any] | None = None) -> dict[str, Any]:
    """The proxy config with exactly `nodes` (in fleet order) as the owned entries.

    With `current` (the config on the host) every entry spark-pipelines does not own and every
    other key is kept as it is; the owned block takes the place of the first owned entry (or goes
    last). Without it (no config yet) the fleet's default settings are written."""
    unknown = sorted(set(nodes) - set(fleet.node_names))
    if unknown:
        raise ValueError(f"unknown node(s) {unknown}; known: {fleet.node_names}")
    ours: list[dict[str, Any]] = []
    for node in fleet.serve_nodes:
        if node.name in nodes:
            ours += node_entries(fleet, node)
    if not current:
        return {"model_list": ours, **default_settings(fleet)}
    out = copy.deepcopy(current)
    entries = _model_list(current)
    owned_at = [i for i, e in enumerate(entries) if owner(e)]
    foreign = [copy.deepcopy(e) for e in entries if not owner(e)]
    at = sum(1 for e in entries[: owned_at[0]] if not owner(e)) if owned_at else len(foreign)
    out["model_list"] = foreign[:at] + ours + foreign[at:]
    return out


def nodes_in_rotation(config: dict[str, Any] | None) -> list[str]:
    """Nodes with at least one owned entry, in config order."""
    seen: list[str] = []
    for entry in _model_list(config):
        node = owner(entry)
        if node and node not in seen:
            seen.append(node)
    return seen


def drain(config: dict[str, Any], node: str) -> dict[str, Any]:
    """Take one node out of every pool; every other entry and key stays untouched."""
    out = copy.deepcopy(config)
    out["model_list"] = [e for e in _model_list(out) if owner(e) != node]
    return out


def restore(config: dict[str, Any], fleet: Fleet, node: str) -> dict[str, Any]:
    """Put one node back into every pool (idempotent): its entries are rendered afresh and placed
    among the owned ones in fleet order; every other entry and key stays untouched."""
    fresh = node_entries(fleet, fleet.node(node))
    out = drain(config, node)
    entries = out["model_list"]
    order = {n: i for i, n in enumerate(fleet.node_names)}
    mine = order[node]
    owned = [i for i, e in enumerate(entries) if owner(e)]
    before = [i for i in owned if order.get(owner(entries[i]) or "", len(order)) < mine]
    after = [i for i in owned if i not in before]
    at = before[-1] + 1 if before else (after[0] if after else len(entries))
    out["model_list"] = entries[:at] + fresh + entries[at:]
    return out


def rotation_refusal(fleet: Fleet, before: list[str], after: list[str],
                     drains: dict[str, str] | None = None) -> str | None:
    """Why a change of the rotation from `before` to `after` must not be made, or None.

    Only a change that shrinks the rotation below `gateway.min_in_rotation` is refused: putting a
    node back, or a rotation already at or below the floor that does not shrink, always passes."""
    floor = fleet.gateway.min_in_rotation
    if len(after) >= floor or len(set(after)) >= len(set(before)):
        return None
    removed = [n for n in before if n not in after]
    drains = drains or {}
    out = [n for n in fleet.node_names if n not in after and n not in removed
           and any(x.name == n for x in fleet.serve_nodes)]
    why = "; ".join(f"{n} is out ({drains.get(n) or 'not in the gateway config: left out by the gateway step'})"
                    for n in out)
    serve = len(fleet.serve_nodes)
    hint = (f"the fleet has only {serve} serve node(s): lower gateway.min_in_rotation in the fleet file"
            if serve <= floor else "wait until the other node(s) are back in rotation, then retry")
    return (f"taking {', '.join(removed)} out of the gateway would leave {len(after)} node(s) in rotation "
            f"({', '.join(after) or 'none'}), below gateway.min_in_rotation={floor}"
            + (f"; {why}" if why else "") + f"; {hint}")


DEPLOY_DRAIN = "deploying"  # the drain note a deploy writes: how rollout.max_unavailable is counted


def deploy_refusal(fleet: Fleet, node: str, drains: dict[str, str]) -> str | None:
    """Why `node` must not be drained for a deploy now, or None: at most rollout.max_unavailable
    nodes are out of the gateway for a deploy at once (each drain note says who is)."""
    others = sorted(n for n, note in drains.items() if n != node and note.startswith(DEPLOY_DRAIN))
    limit = fleet.rollout.max_unavailable
    if len(others) < limit:
        return None
    return (f"{', '.join(others)} {'is' if len(others) == 1 else 'are'} out of the gateway for a deploy already "
            f"(rollout.max_unavailable={limit}): {node} waits for {'it' if len(others) == 1 else 'them'} to finish; "
            f"raise rollout.max_unavailable in the fleet file to deploy more nodes at once")


def check_rotation(fleet: Fleet, before: list[str], after: list[str], drains: dict[str, str] | None = None) -> None:
    reason = rotation_refusal(fleet, before, after, drains)
    if reason:
        raise RotationRefused(reason)


def settings_drift(config: dict[str, Any] | None, fleet: Fleet) -> list[str]:
    """Where the host's settings differ from what the fleet file would write (kept as they are)."""
    if not config:
        return []
    notes = []
    gw = fleet.gateway
    router = config.get("router_settings") if isinstance(config.get("router_settings"), dict) else {}
    general = config.get("general_settings") if isinstance(config.get("general_settings"), dict) else {}
    if router.get("routing_strategy", "simple-shuffle") != gw.routing_strategy:
        notes.append(f"router_settings.routing_strategy on the gateway host is "
                     f"{router.get('routing_strategy', 'unset (simple-shuffle)')!s}, the fleet file says "
                     f"{gw.routing_strategy}: the host's value is kept (edit the config to change it)")
    if "master_key" not in general:
        notes.append("general_settings.master_key is not set on the gateway host: the proxy accepts "
                     "requests without a key (kept as it is)")
    return notes


def owned_view(config: dict[str, Any]) -> dict[str, Any]:
    """What may be shown in logs and metadata: the owned entries, and only the names of the
    operator's own entries (they may carry literal api keys)."""
    entries = _model_list(config)
    return {
        "model_list": [e for e in entries if owner(e)],
        "operator_entries": [e.get("model_name", "?") if isinstance(e, dict) else "?"
                             for e in entries if not owner(e)],
        "kept_keys": [k for k in config if k != "model_list"],
    }


_NOTE_SAFE = re.compile(r"[^\w .:,/@()+=-]")


def dump(config: dict[str, Any], drains: dict[str, str] | None = None) -> str:
    """The config file's text; `drains` (node -> who and since when) go in header comments,
    which LiteLLM ignores and which change the file's digest with the config they belong to."""
    head = "".join(f"{DRAIN_NOTE}{n}: {_NOTE_SAFE.sub('_', why)[:200]}\n" for n, why in sorted((drains or {}).items()))
    return head + yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


def load(text: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"LiteLLM config is not valid YAML ({str(e).splitlines()[0]}): fix the file on "
                         "the gateway host or put its backup (<config>.previous) back") from None
    if not isinstance(data, dict):
        raise ValueError("LiteLLM config is not a mapping: fix the file on the gateway host")
    return data


def load_drains(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            break  # only the header: an operator's comment further down is not a note
        if line.startswith(DRAIN_NOTE) and ":" in line[len(DRAIN_NOTE):]:
            node, why = line[len(DRAIN_NOTE):].split(":", 1)
            out[node.strip()] = why.strip()
    return out
