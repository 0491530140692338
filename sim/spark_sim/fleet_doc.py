"""The fleet file `sim up` writes: the seed fleet with only what must differ to reach the
simulated members (addresses, users, keys, homes, gateway paths, repo URLs and commits)."""

from __future__ import annotations

import copy
from typing import Any

import yaml

from spark_pipelines.core.fleet_settings import GatewayFront
from spark_sim.layout import SEED_FLEET, SSH_PORT, Layout, Member, SimError


def read_seed() -> dict[str, Any]:
    try:
        return yaml.safe_load(SEED_FLEET.read_text())
    except OSError as e:
        raise SimError(f"seed fleet {SEED_FLEET} cannot be read: {e.strerror}") from None


def gateway_of(seed: dict[str, Any]) -> dict[str, Any]:
    """What the simulated gateway host runs, from the seed's gateway section (the fleet file the
    sim writes keeps it): its client port, and the front before LiteLLM when the seed has one."""
    gw = seed.get("gateway") or {}
    front = gw.get("front")
    return {"proxy_port": int(gw.get("proxy_port", 4000)),
            "front": GatewayFront.model_validate(front) if front is not None else None}


def fleet_doc(lay: Layout, seed: dict[str, Any], members: list[Member], pins: dict[str, Any],
              pair_links: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    doc = copy.deepcopy(seed)
    templates = {n["hardware"]: n for n in seed["nodes"]}

    def target(m: Member) -> dict[str, Any]:
        return {"host": m.ip, "port": SSH_PORT, "user": m.user, "key_path": str(lay.key_path),
                "known_hosts": str(lay.known_hosts), "home": str(m.home)}

    nodes = []
    for m in members:
        if m.is_gateway:
            continue
        first = not nodes  # the first node builds (the seed's build+serve node), every other one serves
        template = copy.deepcopy(templates.get(m.hardware) or seed["nodes"][-1])
        # Same key order as the seed, with the reach fields where an operator looks for them.
        node = {"name": m.name, **target(m)}
        node.update({k: v for k, v in template.items() if k not in node})
        if not first:
            node["roles"] = ["serve"]
        nodes.append(node)
    doc["nodes"] = nodes
    gw = next(m for m in members if m.is_gateway)
    work = gw.home / "litellm"
    doc["gateway"].update({
        **target(gw),
        "config_path": str(work / "config.yaml"),
        "reload_dir": str(work),
        "reload": "graceful",
        "reload_command": [str(gw.bin / "litellm-reload")],
        "restart_command": [str(gw.bin / "litellm-restart")],  # when a graceful reload is not confirmed
    })
    # The stand-in checkpoint is a few MB, not ~71 GB: the runbook's disk floors do not apply.
    doc["preflight"] = {"build_host_disk_gib": 1, "serve_node_disk_gib": 1}
    # Every node's brick on the sim's smart plug (power.py), AC off for the runbook's minimum.
    plug = str(lay.client_dir / "smart-plug")
    doc["cold_drain"] = {"off_s": 60, "smart_plugs": {
        n["name"]: {"off_command": [plug, n["name"], "off"], "on_command": [plug, n["name"], "on"]} for n in nodes}}
    # The stand-in needs no warm-up (no JIT, no graph capture): one measured run keeps the demo short.
    doc["bench"]["repeats"] = 1
    # One attempt per step: the fault tests bound how long a step takes against a dead node, and
    # the connect-retry test turns retries on for itself.
    doc["ssh"] = {"connect_retries": 0, "connect_backoff_s": 1}
    # A pair whose nodes are simulated gets its link (the sim made it); it stays off as in the seed.
    serving = {n["name"] for n in nodes}
    doc["pairs"] = [{**p, **({"link": pair_links[p["name"]]} if p["name"] in (pair_links or {}) else {})}
                    for p in doc.get("pairs") or [] if {p.get("head"), p.get("worker")} <= serving]
    if pins:
        doc["pins"]["recipe_repo"] = pins["recipe_repo"]
        doc["pins"]["build_repo"] = pins["build_repo"]
        doc["pins"]["base_model"]["revision"] = pins["base_model_revision"]
        doc["pins"]["fp8_model"]["revision"] = pins["fp8_model_revision"]
    return doc
