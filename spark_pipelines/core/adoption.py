"""First contact with a fleet spark-pipelines did not build: what the chain would do to it.

The runbook's own fleet is already serving, built by hand: its checkpoint and images carry no
markers, its containers no labels, its gateway config no owned entries. Adoption reads what is
there and compares it with what the fleet file asks for; each step of each node gets one
`Finding`: already the tool's, adoptable (equal to what the step would produce: its markers are
written as if it had run, nothing that serves is touched), to be built or relaunched, or
different (reported field by field and left as it is: the next deploy of that node is an
ordinary drained deploy or rollout). Pure: the facts come in, the verdicts go out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core.launch import LaunchSpec

# What the chain would do with a step on a node.
CURRENT = "current"  # already recorded by spark-pipelines and verified: the step skips
ADOPT = "adopt"  # found as the pins say and verified by content: recorded, nothing changed
BUILD = "build"  # missing or not verifiable: the step builds it (beside what serves)
RELAUNCH = "relaunch"  # the node serves nothing: the deploy launches it
DIFFERS = "differs"  # found, but not what the fleet file asks for: reported, left as it is
ACTIONS = (CURRENT, ADOPT, BUILD, RELAUNCH, DIFFERS)


@dataclass(frozen=True)
class Finding:
    """One step on one node (or the gateway) against the fleet file."""

    node: str
    step: str
    action: str
    why: str
    differences: tuple[str, ...] = ()
    # What the step's output would carry (image id, index and manifest digests, container id, ...):
    # adoption records exactly these, so the step's next run skips on them.
    facts: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown adoption action {self.action!r}; one of {', '.join(ACTIONS)}")

    @property
    def changes_nothing(self) -> bool:
        return self.action in (CURRENT, ADOPT, DIFFERS)

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "step": self.step, "action": self.action, "why": self.why,
                "differences": list(self.differences), "facts": dict(self.facts)}


def render_text(findings: Sequence[Finding]) -> str:
    """One block per node, one line per step, the differences under the step."""
    out: list[str] = []
    node = None
    for f in findings:
        if f.node != node:
            node = f.node
            out.append(f"== {node}")
        out.append(f"  {f.step:<20} {f.action:<9} {f.why}")
        out += [f"      - {d}" for d in f.differences]
    return "\n".join(out)


def summary(findings: Iterable[Finding]) -> dict[str, int]:
    counts = {a: 0 for a in ACTIONS}
    for f in findings:
        counts[f.action] += 1
    return {a: n for a, n in counts.items() if n}


# ------------------------------------------------------------------------------ containers


def split_flags(args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
    """A serve argv as (positionals, {--flag: value}); a flag without a value maps to ""."""
    positional: list[str] = []
    flags: dict[str, str] = {}
    i = 0
    while i < len(args):
        a = args[i]
        if a.startswith("--"):
            name, eq, value = a.partition("=")
            if eq:
                flags[name] = value
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                flags[name] = args[i + 1]
                i += 1
            else:
                flags[name] = ""
        else:
            positional.append(a)
        i += 1
    return positional, flags


def _same_value(flag: str, have: str, want: str) -> bool:
    if have == want:
        return True
    if flag == "--speculative-config":  # the runbook quotes the JSON its own way
        try:
            return json.loads(have) == json.loads(want)
        except ValueError:
            return False
    try:
        return float(have) == float(want)  # 0.85 vs 0.850
    except ValueError:
        return False


def _env(entries: Iterable[str] | None) -> dict[str, str]:
    out = {}
    for e in entries or ():
        k, _, v = str(e).partition("=")
        out[k] = v
    return out


def container_differences(spec: LaunchSpec, container: Mapping[str, Any], image_env: Iterable[str] = (),
                          image_id: str | None = None) -> list[str]:
    """How a running container (docker inspect) differs from the launch spec, field by field:
    name, image, serve flags, environment (what `docker run -e` set, beyond the image's own),
    mounts, GPUs, host network and IPC. Labels are not compared: a hand deploy has none."""
    cfg = container.get("Config") or {}
    host = container.get("HostConfig") or {}
    diffs: list[str] = []
    name = str(container.get("Name") or "").lstrip("/")
    if name != spec.container_name:
        diffs.append(f"container name: {name or '?'} (fleet file: {spec.container_name})")
    if image_id and container.get("Image") != image_id:
        diffs.append(f"image: {str(container.get('Image'))[7:19] or '?'} (the serving image is {image_id[7:19]})")
    pos, flags = split_flags([str(a) for a in cfg.get("Cmd") or []])
    want_pos, want_flags = split_flags(spec.serve_args)
    if pos != want_pos:
        diffs.append(f"serve arguments: {' '.join(pos) or '(none)'} (fleet file: {' '.join(want_pos)})")
    for flag in sorted(set(flags) | set(want_flags)):
        have, want = flags.get(flag), want_flags.get(flag)
        if have is None:
            diffs.append(f"{flag}: missing (fleet file: {want or 'set'})")
        elif want is None:
            diffs.append(f"{flag}: {have or 'set'} (not in the fleet file)")
        elif not _same_value(flag, have, want):
            diffs.append(f"{flag}: {have} (fleet file: {want})")
    base = _env(image_env)
    env = {k: v for k, v in _env(cfg.get("Env")).items() if base.get(k) != v}
    for k in sorted(set(env) | set(spec.env)):
        have, want = env.get(k), spec.env.get(k)
        if have is None:
            diffs.append(f"env {k}: not set (fleet file: {want})")
        elif want is None:
            diffs.append(f"env {k}={have} (not in the fleet file)")
        elif have != want:
            diffs.append(f"env {k}={have} (fleet file: {want})")
    binds = {str(b).split(":")[1]: str(b).split(":")[0] for b in host.get("Binds") or [] if str(b).count(":") >= 1}
    for hpath, cpath in spec.mounts:
        if cpath not in binds:
            diffs.append(f"mount {cpath}: missing (fleet file: {hpath}:{cpath})")
        elif binds[cpath].rstrip("/") != hpath.rstrip("/"):
            diffs.append(f"mount {cpath}: from {binds[cpath]} (fleet file: {hpath})")
    for cpath in sorted(set(binds) - {c for _, c in spec.mounts}):
        diffs.append(f"mount {binds[cpath]}:{cpath} (not in the fleet file)")
    if not any("gpu" in (cap or []) for req in host.get("DeviceRequests") or [] for cap in req.get("Capabilities") or []):
        diffs.append("GPUs: not requested (fleet file: --gpus all)")
    if host.get("NetworkMode") != "host":
        diffs.append(f"network: {host.get('NetworkMode') or 'default'} (fleet file: --net=host)")
    if host.get("IpcMode") != "host":
        diffs.append(f"IPC: {host.get('IpcMode') or 'default'} (fleet file: --ipc=host)")
    return diffs
