"""LiteLLM gateway config: pools x nodes -> model_list, routes to nodes, drain / restore / take-over.

The runbook paused nodes by `sed`-commenting every `api_base` line of the config, which paused
ALL spark nodes at once and depended on IP prefixes. Here one node leaves and re-enters rotation
while the others keep serving, and an operator's config survives (core/gateway_text.py keeps it
line for line, comments included):

- an entry routes to node N when spark-pipelines wrote it for N (`model_info.spark_pipelines_node`,
  "owned") OR its `litellm_params.api_base` is N's endpoint (`route`): a hand-written entry for a
  fleet node is a route like any other. The rotation, the floor and the running proxy's pools all
  count routes; an entry routing to no fleet node is the operator's and never touched;
- a drain takes the node out of EVERY route to it: its entries stay in the file where they were,
  commented out as stash lines, and a restore puts back exactly those bytes (owned entries that no
  longer match the fleet file are rendered afresh);
- the gateway step renders one owned entry per node and pool, never a second route beside a hand
  entry identical to what it would write: that entry is taken over (marked, content and place
  kept); `take_over` does only that, and reports the hand routes that differ, field by field;
- `litellm_settings`, `router_settings`, `general_settings` and unknown top-level keys of an
  existing config are kept exactly (defaults are written only into a config that does not exist
  yet); where the host's value differs from the fleet file, `settings_drift` says so;
- the rotation never shrinks below `gateway.min_in_rotation` (`rotation_refusal`); a change that
  does not shrink it is never refused.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from spark_pipelines.core import gateway_text
from spark_pipelines.core.fleet import Fleet, Node
# The text layer's names callers reach through this module (DRAIN_NOTE, STASH, Doc, parse, fresh).
from spark_pipelines.core.gateway_text import DRAIN_NOTE, STASH, Doc, dump_yaml, fresh, parse, parse_notes  # noqa: F401

OWNER_TAG = "spark_pipelines_node"  # in model_info; LiteLLM passes unknown model_info keys through
# Configs written before entries were marked as owned used this key; read as owned, rewritten with OWNER_TAG.
LEGACY_OWNER_TAGS = ("spark_node",)


class RotationRefused(ValueError):
    """A change would leave fewer nodes in the gateway's rotation than the fleet allows."""


class RouteUnaccounted(RotationRefused):
    """A drain cannot tell whether some entries route to the node: nothing was changed."""


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


_URL = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)://(?:[^@/?#]*@)?(?P<host>\[[^\]/?#]*\]|[^:/?#]*)"
                  r"(?::(?P<port>[0-9]*))?(?P<path>[^?#]*)(?:\?[^#]*)?(?:#.*)?$")
_DEFAULT_PORTS = {"http": 80, "https": 443}


def endpoint(api_base: Any) -> tuple[str, str, int, str] | None:
    """An api_base as (scheme, host, port, path) for comparison: scheme and host case, the default
    port, a trailing slash and a trailing /v1 do not make another endpoint. None: not a literal
    http(s) URL (an `os.environ/...` reference, say)."""
    m = _URL.match(api_base.strip()) if isinstance(api_base, str) else None
    if not m:
        return None
    scheme = m["scheme"].lower()
    host = m["host"].lower().strip("[]")
    if scheme not in _DEFAULT_PORTS or not host:
        return None
    port = int(m["port"]) if m["port"] else _DEFAULT_PORTS[scheme]
    path = m["path"].rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3].rstrip("/")
    return scheme, host, port, path


def owner(entry: Any) -> str | None:
    """The node an owned entry routes to; None for an entry spark-pipelines did not write."""
    info = entry.get("model_info") if isinstance(entry, dict) else None
    if not isinstance(info, dict):
        return None
    for tag in (OWNER_TAG, *LEGACY_OWNER_TAGS):
        if isinstance(info.get(tag), str) and info[tag]:
            return info[tag]
    return None


def _endpoints(fleet: Fleet) -> dict[tuple[str, str, int, str], str]:
    return {endpoint(backend_for(fleet, n).api_base): n.name for n in fleet.serve_nodes}  # type: ignore[misc]


def route(entry: Any, fleet: Fleet | None) -> str | None:
    """The node an entry sends requests to: its owner, else the serve node whose endpoint its
    api_base is; None for an entry routing to no fleet node (the operator's own)."""
    node = owner(entry)
    if node or fleet is None or not isinstance(entry, dict):
        return node
    params = entry.get("litellm_params")
    return _endpoints(fleet).get(endpoint(params.get("api_base")) if isinstance(params, dict) else None)  # type: ignore[arg-type]


def _model_list(config: dict[str, Any] | None) -> list[Any]:
    entries = (config or {}).get("model_list") or []
    if not isinstance(entries, list):
        raise ValueError("the LiteLLM config's model_list is not a list: fix the file on the gateway host")
    return entries


def _pool(entry: Any) -> str:
    return str(entry.get("model_name", "?")) if isinstance(entry, dict) else "?"


def _id(entry: Any) -> str:
    info = entry.get("model_info") if isinstance(entry, dict) else None
    return str(info.get("id", "-")) if isinstance(info, dict) else "-"


def routes(config: dict[str, Any] | None, fleet: Fleet | None = None) -> dict[str, list[str]]:
    """Pool (model_name) -> the nodes its entries route to, each once, in config order; entries
    routing to no fleet node are left out. Without `fleet`, owned entries only."""
    out: dict[str, list[str]] = {}
    for entry in _model_list(config):
        node = route(entry, fleet)
        if node:
            nodes = out.setdefault(_pool(entry), [])
            if node not in nodes:
                nodes.append(node)
    return out


def nodes_in_rotation(config: dict[str, Any] | None, fleet: Fleet | None = None) -> list[str]:
    """Nodes with at least one route (with `fleet`: owned or by api_base; without: owned), in config order."""
    seen: list[str] = []
    for entry in _model_list(config):
        node = route(entry, fleet)
        if node and node not in seen:
            seen.append(node)
    return seen


def rendered(fleet: Fleet, node: Node, pool: str) -> dict[str, Any]:
    """The entry spark-pipelines writes for `node` in `pool`."""
    gw = fleet.gateway
    return {
        "model_name": pool,
        "litellm_params": {
            "model": f"openai/{fleet.launch_for(node).served_model_name}",
            "api_base": backend_for(fleet, node).api_base,
            "api_key": gw.backend_api_key,
        },
        "model_info": {"id": f"{node.name}-{gw.model_id_stem}-{pool}", OWNER_TAG: node.name},
    }


def node_entries(fleet: Fleet, node: Node) -> list[dict[str, Any]]:
    return [rendered(fleet, node, pool) for pool in fleet.gateway.pools]


def differences(entry: Any, fleet: Fleet, node: str) -> list[tuple[str, str, str]]:
    """Where `entry` differs from what spark-pipelines would write for `node` in the entry's pool,
    as (field, in the config, from the fleet file); api keys are never shown. Owner tags aside."""
    n = fleet.node(node)
    pools = fleet.gateway.pools
    pool = _pool(entry)
    out: list[tuple[str, str, str]] = []
    if pool not in pools:
        out.append(("model_name", pool, f"one of the gateway pools ({', '.join(pools)})"))
    want = rendered(fleet, n, pool if pool in pools else pools[0])
    entry = entry if isinstance(entry, dict) else {}
    for k in entry:
        if k not in want:
            out.append((k, "set", "not written by spark-pipelines"))
    for part in ("litellm_params", "model_info"):
        have = entry.get(part) if isinstance(entry.get(part), dict) else {}
        if part == "model_info":
            have = {k: v for k, v in have.items() if k not in (OWNER_TAG, *LEGACY_OWNER_TAGS)}
            want[part] = {k: v for k, v in want[part].items() if k != OWNER_TAG}
        for k in dict.fromkeys([*want[part], *have]):
            field_ = f"{part}.{k}"
            if k not in have:
                out.append((field_, "missing", _shown(k, want[part][k])))
            elif k not in want[part]:
                out.append((field_, _shown(k, have[k]), "not written by spark-pipelines"))
            elif k == "api_base":
                if endpoint(have[k]) != endpoint(want[part][k]):
                    out.append((field_, str(have[k]), str(want[part][k])))
            elif have[k] != want[part][k]:
                out.append((field_, _shown(k, have[k]), _shown(k, want[part][k])))
    return out


def _shown(key: str, value: Any) -> str:
    return "(hidden)" if "key" in key.lower() or "secret" in key.lower() or "token" in key.lower() else str(value)


def identical(entry: Any, fleet: Fleet, node: str) -> bool:
    """`entry` is what spark-pipelines would write for `node` in its pool (owner tag aside)."""
    return route(entry, fleet) == node and not differences(entry, fleet, node)


def _owned_properly(entry: Any, node: str) -> bool:
    info = entry.get("model_info") if isinstance(entry, dict) else None
    return isinstance(info, dict) and info.get(OWNER_TAG) == node and not any(t in info for t in LEGACY_OWNER_TAGS)


# -------------------------------------------------------------------- what a transform did


@dataclass
class Report:
    """What one transform did to the config, for logs and asset metadata (never an api key)."""

    taken_over: list[dict[str, Any]] = field(default_factory=list)  # hand entries marked as a node's own
    collapsed: list[dict[str, Any]] = field(default_factory=list)  # duplicate routes removed
    differing: list[dict[str, Any]] = field(default_factory=list)  # routes to a node that are not what we would write
    added: list[dict[str, Any]] = field(default_factory=list)
    rewritten: list[dict[str, Any]] = field(default_factory=list)
    stashed: list[dict[str, Any]] = field(default_factory=list)
    unstashed: list[dict[str, Any]] = field(default_factory=list)
    removed: list[dict[str, Any]] = field(default_factory=list)
    routes_before: dict[str, list[str]] = field(default_factory=dict)
    routes_after: dict[str, list[str]] = field(default_factory=dict)
    proxy_before: dict[str, list[str]] | None = None  # set by the gateway host (its running proxy)
    proxy_after: dict[str, list[str]] | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def lines(self) -> list[str]:
        out = []
        for what, rows in (("taken over", self.taken_over), ("duplicate removed", self.collapsed),
                           ("added", self.added), ("rewritten", self.rewritten), ("stashed", self.stashed),
                           ("put back", self.unstashed), ("removed", self.removed)):
            out += [f"{what}: {_row(r)}" for r in rows]
        for r in self.differing:
            fields = "; ".join(f"{f}: {have} (fleet file: {want})" for f, have, want in r["fields"])
            whose = "owned, rewritten by the next gateway step" if r.get("owned") else "stays the operator's"
            out.append(f"differs ({whose}): {_row(r)}: {fields}")
        return out


def _row(r: dict[str, Any]) -> str:
    return f"model_list[{r.get('index', '?')}] {r.get('pool', '?')} -> {r.get('node', '?')} (id {r.get('id', '-')})"


def _event(doc: Doc, i: int, node: str | None, fleet: Fleet | None = None, **kw: Any) -> dict[str, Any]:
    """One report row for region element `i`; `index` is its position among model_list's entries
    (stashed ones included) in the config the transform began with; a new entry's, where it went."""
    it = doc.region[i]
    e = it.entry  # type: ignore[union-attr]
    index = doc.positions.get(id(it), sum(1 for j, _ in doc.items() if j < i))
    return {"index": index, "pool": _pool(e), "node": node or route(e, fleet), "id": _id(e), **kw}


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


# -------------------------------------------------------------------- transforms of the config text


def _check_nodes(fleet: Fleet, nodes: list[str]) -> None:
    unknown = sorted(set(nodes) - set(fleet.node_names))
    if unknown:
        raise ValueError(f"unknown node(s) {unknown}; known: {fleet.node_names}")


def render_config(fleet: Fleet, nodes: list[str], current: dict[str, Any] | None = None) -> dict[str, Any]:
    """The proxy config routing to exactly `nodes` (see `rotate`), as a mapping. Without `current`
    (no config yet) the owned entries in fleet order and the fleet's default settings."""
    _check_nodes(fleet, nodes)
    if not current:
        ours = [e for n in fleet.serve_nodes if n.name in nodes for e in node_entries(fleet, n)]
        return {"model_list": ours, **default_settings(fleet)}
    return rotate(fresh(current), fleet, nodes).config


def new_doc(fleet: Fleet, nodes: list[str]) -> Doc:
    """The config for a gateway host that has none yet."""
    return fresh(render_config(fleet, nodes))


def unaccounted(doc: Doc, fleet: Fleet) -> list[str]:
    """Entries that may route to a fleet node without saying so: the fleet's served model behind
    an api_base that is not a literal URL (an `os.environ/` reference): a drain cannot tell."""
    served = {f"openai/{fleet.launch_for(n).served_model_name}" for n in fleet.serve_nodes}
    out = []
    for k, (_, it) in enumerate(doc.items()):
        e = it.entry
        if it.out is not None or owner(e) or not isinstance(e, dict) or not isinstance(e.get("litellm_params"), dict):
            continue
        base = e["litellm_params"].get("api_base")
        if base is not None and endpoint(base) is None and e["litellm_params"].get("model") in served:
            out.append(f"model_list[{k}] ({_pool(e)}, id {_id(e)}): api_base {str(base)[:80]!r} is not a literal URL")
    return out


def drain(doc: Doc, fleet: Fleet, node: str, note: str | None = None) -> Doc:
    """`node` out of every route to it, owned or not: each such entry is stashed where it is (with
    the comment lines describing it); every other line stays. `note` becomes its drain note.
    Refused (RouteUnaccounted, nothing changed) while an entry's route cannot be told."""
    bad = unaccounted(doc, fleet)
    if bad:
        raise RouteUnaccounted(
            f"{node} not taken out of the gateway: these entries serve the fleet's model through an api_base "
            f"that is not a literal URL, so they may route to it: {'; '.join(bad)}; write the node's endpoint "
            f"literally (e.g. {backend_for(fleet, fleet.node(node)).api_base}) or remove the entries")
    out = doc.copy()
    rep = Report(routes_before=routes(doc.config, fleet))
    _take_out(out, fleet, node, rep)
    if note is not None:
        out.notes[node] = note
    rep.routes_after = routes(out.config, fleet)
    out.report = rep
    return out


def restore(doc: Doc, fleet: Fleet, node: str) -> Doc:
    """`node` back into every pool (idempotent), its drain note cleared: its stashed entries are put
    back where they were, byte for byte; an owned entry that no longer matches the fleet file is
    rendered afresh in its place; a pool with no route to it gets an owned entry. Nothing is taken
    over or collapsed: what was there before the drain is what is there after."""
    fleet.node(node)  # a FleetError names the known nodes
    out = doc.copy()
    rep = Report(routes_before=routes(doc.config, fleet))
    _put_back(out, fleet, node, rep, adopt=False)
    out.notes.pop(node, None)
    rep.routes_after = routes(out.config, fleet)
    out.report = rep
    return out


def rotate(doc: Doc, fleet: Fleet, nodes: list[str]) -> Doc:
    """The gateway step: every serve node in `nodes` routed once per pool, every other one out.

    A node in: its stashed entries back, then per pool the first entry identical to what
    spark-pipelines would write (a hand entry is taken over: marked, kept in place) or its owned
    entry (rendered afresh if it differs), duplicates of it removed; a pool routed only by an
    operator's entry that differs keeps that entry and gets no second one; a pool with no route
    gets an owned entry next to the node's others (else in fleet order). A node out: stashed as
    by a drain. Owned entries of nodes the fleet no longer serves are removed. Drain notes are
    the caller's."""
    _check_nodes(fleet, nodes)
    out = doc.copy()
    rep = Report(routes_before=routes(doc.config, fleet))
    for n in fleet.serve_nodes:
        if n.name in nodes:
            _put_back(out, fleet, n.name, rep, adopt=True)
        else:
            _take_out(out, fleet, n.name, rep)
    serving = {n.name for n in fleet.serve_nodes}
    for i, it in reversed(out.items()):
        o = owner(it.entry)
        if it.out is None and o and o not in serving:
            rep.removed.append(_event(out, i, o, reason="not a serve node of the fleet"))
            out.remove(i)
    rep.differing = _differing(out, fleet)
    rep.routes_after = routes(out.config, fleet)
    out.report = rep
    return out


def take_over(doc: Doc, fleet: Fleet) -> tuple[Doc, Report]:
    """Adopt the hand-written routes: an entry routing to a fleet node that is exactly what
    spark-pipelines would write for that node and pool (owner tag aside) is marked as the node's
    own, one added line, its content, comments and place unchanged. Duplicate routes for one
    node and pool (an owned entry beside an identical hand one) collapse to one (a present one
    first, then the first in the file). Routes that differ are reported field by field and stay
    the operator's. No route is added or lost: the nodes per pool are the same before and after."""
    out = doc.copy()
    rep = Report(routes_before=routes(doc.config, fleet))
    for n in fleet.serve_nodes:
        for pool in fleet.gateway.pools:
            cands = [i for i, it in out.items() if route(it.entry, fleet) == n.name and _pool(it.entry) == pool]
            same = sorted((i for i in cands if identical(out.region[i].entry, fleet, n.name)),  # type: ignore[union-attr]
                          key=lambda i: (out.region[i].out is not None, i))
            if not same:
                continue
            keep = same[0]
            drop = [i for i in cands if i != keep and (i in same or owner(out.region[i].entry) == n.name)]  # type: ignore[union-attr]
            if owner(out.region[keep].entry) is None:  # type: ignore[union-attr]
                rep.taken_over.append(_event(out, keep, n.name))
                out.add_key(keep, "model_info", OWNER_TAG, n.name)
            kept = _event(out, keep, n.name)["index"]
            for i in sorted(drop, reverse=True):
                rep.collapsed.append(_event(out, i, n.name, kept=kept))
                out.remove(i)
    rep.differing = _differing(out, fleet)
    rep.routes_after = routes(out.config, fleet)
    out.report = rep
    return out, rep


def _take_out(doc: Doc, fleet: Fleet, node: str, rep: Report) -> None:
    for i, it in doc.items():
        if it.out is None and route(it.entry, fleet) == node:
            rep.stashed.append(_event(doc, i, node))
            doc.stash(i, node)


def _put_back(doc: Doc, fleet: Fleet, node: str, rep: Report, *, adopt: bool) -> None:
    rep.unstashed += [_event(doc, i, node) for i, it in doc.items() if it.out == node]
    doc.unstash(node)
    n = fleet.node(node)
    pools = fleet.gateway.pools
    for pool in pools:
        _fill(doc, fleet, n, pool, rep, adopt)
    for i, it in reversed(doc.items()):
        if it.out is None and owner(it.entry) == node and _pool(it.entry) not in pools:
            rep.removed.append(_event(doc, i, node, reason="not a gateway pool"))
            doc.remove(i)


def _fill(doc: Doc, fleet: Fleet, n: Node, pool: str, rep: Report, adopt: bool) -> None:
    """One route for `n` in `pool` (see rotate; adopt=False, a restore: nothing taken over or removed)."""
    cands = [i for i, it in doc.items() if it.out is None and route(it.entry, fleet) == n.name and _pool(it.entry) == pool]
    entries = {i: doc.region[i].entry for i in cands}  # type: ignore[union-attr]
    same = [i for i in cands if identical(entries[i], fleet, n.name)]
    owned = [i for i in cands if owner(entries[i]) == n.name]
    want = rendered(fleet, n, pool)
    if adopt and same:
        keep = same[0]
        if owner(entries[keep]) is None:
            rep.taken_over.append(_event(doc, keep, n.name))
            doc.add_key(keep, "model_info", OWNER_TAG, n.name)
        elif not _owned_properly(entries[keep], n.name):
            rep.rewritten.append(_event(doc, keep, n.name, reason="older owner mark"))
            doc.replace(keep, want)
        kept = _event(doc, keep, n.name)["index"]
        for i in sorted((i for i in cands if i != keep and (i in same or i in owned)), reverse=True):
            rep.collapsed.append(_event(doc, i, n.name, kept=kept))
            doc.remove(i)
    elif owned:
        for i in sorted(owned[1:] if adopt else [], reverse=True):
            rep.collapsed.append(_event(doc, i, n.name, kept=_event(doc, owned[0], n.name)["index"]))
            doc.remove(i)
        for i in owned[:1] if adopt else owned:
            if i not in same or not _owned_properly(entries[i], n.name):
                rep.rewritten.append(_event(doc, i, n.name))
                doc.replace(i, want)
    elif not cands:
        at = _insert_at(doc, fleet, n.name)
        doc.insert(at, want)
        rep.added.append(_event(doc, at, n.name))
    # else: the operator's own route to n in this pool, which differs: kept, no second one (reported)


def _insert_at(doc: Doc, fleet: Fleet, node: str) -> int:
    """Where a new entry for `node` goes: after its other entries, else after the last entry of a
    node before it in the fleet, else before the first of a node after it, else last."""
    order = {n.name: k for k, n in enumerate(fleet.serve_nodes)}
    mine = order.get(node, len(order))
    items = [(i, order.get(route(it.entry, fleet) or "")) for i, it in doc.items()]
    own = [i for i, k in items if k == mine and doc.region[i].out is None]
    if own:
        return own[-1] + 1
    before = [i for i, k in items if k is not None and k < mine]
    if before:
        return before[-1] + 1
    after = [i for i, k in items if k is not None and k > mine]
    return doc.start_of(after[0]) if after else len(doc.region)


def _differing(doc: Doc, fleet: Fleet) -> list[dict[str, Any]]:
    serving = {n.name for n in fleet.serve_nodes}
    out = []
    for i, it in doc.items():
        node = route(it.entry, fleet)
        if node in serving:
            diff = differences(it.entry, fleet, node)  # type: ignore[arg-type]
            if diff:
                out.append(_event(doc, i, node, owned=owner(it.entry) is not None, stashed=it.out is not None,
                                  fields=[list(d) for d in diff]))
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
FAILED_DEPLOY = "failed deploy"  # the note that replaces it when the node cannot serve after the deploy


def deploy_note(note: str | None, run_id: str | None = None) -> bool:
    """Whether a drain note is a deploy's (its drain, or a failed deploy's keep-out), and with
    `run_id` that run's own: what a deploy that leaves the node serving its spec undoes."""
    if not note or not (note.startswith(DEPLOY_DRAIN) or note.startswith(FAILED_DEPLOY)):
        return False
    return run_id is None or f"(run {run_id[:8] or '-'})" in note.split(":", 1)[0]


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


def owned_view(config: dict[str, Any], fleet: Fleet | None = None) -> dict[str, Any]:
    """What may be shown in logs and metadata: the owned entries, and only the names of the
    operator's own entries (they may carry literal api keys). With `fleet`, the hand-written
    routes to fleet nodes are listed apart (`routes_not_owned`), not as operator entries."""
    entries = _model_list(config)
    view: dict[str, Any] = {
        "model_list": [e for e in entries if owner(e)],
        "operator_entries": [_pool(e) for e in entries if not route(e, fleet)],
        "kept_keys": [k for k in config if k != "model_list"],
    }
    if fleet is not None:
        view["routes_not_owned"] = [f"{_pool(e)} -> {route(e, fleet)} (id {_id(e)})"
                                    for e in entries if not owner(e) and route(e, fleet)]
    return view


def dump(config: dict[str, Any], drains: dict[str, str] | None = None) -> str:
    """A config as fresh text (a plan, metadata; the host's file is changed through `Doc`);
    `drains` (node -> who and since when) go in header comments."""
    head = "".join(gateway_text.note_line(n, why) + "\n" for n, why in sorted((drains or {}).items()))
    return head + dump_yaml(config)


def load(text: str) -> dict[str, Any]:
    return gateway_text.load(text)


def load_drains(text: str) -> dict[str, str]:
    return parse_notes(text.split("\n"))[0]
