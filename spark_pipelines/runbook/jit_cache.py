"""Keep, restore and back up a node's JIT cache (see core/jit_cache.py for the layout and key).

`switch()` runs inside the deploy transaction, after preflight and before `docker run`: the
cache mounts are pointed at the slot of the deployment's key (restored from the build host's
archive when the node has none), and `undo()` points them back on every rollback path, so the
previous deployment restarts on its own warm cache. `seal()` marks the slot after a healthy boot;
`back_up()` (the `jit_cache` asset) copies a sealed slot to the build host's archive once per key.
Stale slots are never mounted; `prune()` wipes them once a deploy has committed (their files are
root's, written in the container, so the wipe runs as root in a throwaway container).
"""

from __future__ import annotations

import posixpath
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import jit_cache as core
from spark_pipelines.core import remote
from spark_pipelines.core.fleet import Node
from spark_pipelines.core.launch import MODELS_MOUNT, LaunchSpec, expand_home
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.resources.transfer import NodeStreams
from spark_pipelines.core.errors import RunbookError, first_line

COMPLETE = "COMPLETE"  # written last into an archived key: a half-copied backup is never restored
_T = remote.PROBE_TIMEOUT_S
WIPE_TIMEOUT_S = 900  # deleting GBs of kernels on a busy disk


def cache_mounts(spec: LaunchSpec) -> list[str]:
    """The host side of the launch's cache mounts (everything but the models mount)."""
    return [host for host, container in spec.mounts if container != MODELS_MOUNT]


def store_dir(s: FleetSession) -> str:
    f = s.fleet
    return expand_home(f.launch.jit_cache_store, f.build_node.home_dir)


def archived_dir(s: FleetSession, key: str) -> str:
    return posixpath.join(store_dir(s), key)


def _entry(i: int, mount: str) -> str:
    """The archive's name for a mount: `0_vllm`, `1_flashinfer`, `2_triton`."""
    return f"{i}_{posixpath.basename(mount.rstrip('/')).lstrip('.')}"


def is_archived(s: FleetSession, key: str) -> bool:
    build = s.fleet.build_node.name
    return s.exists(build, posixpath.join(archived_dir(s, key), COMPLETE))


def read(s: FleetSession, node: Node, key: str, mounts: list[str]) -> list[core.MountState]:
    r = s.run(node.name, core.probe_argv(key, mounts), log=False, timeout=_T)
    return core.parse_probe(r.stdout, mounts, key)


@dataclass
class Switch:
    """What `switch` changed, for `undo`."""

    node: str
    plan: core.Plan
    before: list[core.MountState]
    slots: list[str]
    set_aside: list[tuple[str, str]] = field(default_factory=list)  # (mount, where it went)
    retired: list[tuple[str, str]] = field(default_factory=list)  # (slot, where it went): a fresh cache
    linked: list[str] = field(default_factory=list)
    fresh: bool = False  # the operator asked for a fresh cache: the build host's archive of the key goes too


def switch(s: FleetSession, node: Node, spec: LaunchSpec, key: str, log: Any, *, fresh: bool = False,
           noted: Callable[[Switch], None] | None = None) -> Switch:
    """Point the node's cache mounts at `key`'s slots (restored when archived). Undone on error.
    `fresh`: the runbook's stale-cache fix (wipe ~/.cache/vllm, relaunch): the key's slots are
    renamed aside (kept until the deploy commits, so a rollback boots warm) and nothing is restored.
    `noted(switch)` is told what `undo` would need before the mounts change and after each change
    of their folders (the deploy's journal: a run that dies here is undone by the next one)."""
    note = noted or (lambda _sw: None)
    mounts = cache_mounts(spec)
    n = node.name
    retired: list[tuple[str, str]] = []
    if fresh:
        stamp = time.strftime("%Y%m%d%H%M%S")
        for slot in (core.slot_path(m, key) for m in mounts):
            if s.exists(n, slot):
                s.run(n, ["mv", "-T", slot, f"{slot}.stale-{stamp}"], log=False, timeout=_T)
                retired.append((slot, f"{slot}.stale-{stamp}"))
    states = read(s, node, key, mounts)
    plan = core.plan(key, states, archived=not fresh and is_archived(s, key))
    sw = Switch(n, plan, states, [core.slot_path(m, key) for m in mounts], retired=retired, fresh=fresh)
    note(sw)
    try:
        for m in plan.set_aside:
            aside = core.slot_path(m, core.UNKEYED)
            if s.exists(n, aside):
                raise RunbookError(f"{n}: {m} is a real directory and {aside} exists already (two hand-made "
                                   f"caches): move one away (or sudo rm -rf it), then deploy again")
            s.run(n, ["mv", "-T", m, aside], log=False, timeout=_T)
            sw.set_aside.append((m, aside))
            note(sw)
        if plan.restore:  # an unsealed slot (a boot that never got healthy) holds root's files:
            for st, slot in zip(states, sw.slots):  # rsync cannot replace them, so it goes aside
                if st.slot_exists:
                    _set_aside(s, n, slot, "unsealed", sw)
        for m, slot in zip(mounts, sw.slots):
            s.run(n, ["mkdir", "-p", slot], log=False, timeout=_T)
        if plan.restore:
            try:
                restore(s, node, key, mounts, sw.slots)
            except Exception as e:  # a cache is an optimisation: a failed restore costs a cold boot
                for slot in sw.slots:  # never boot on a half-restored cache
                    _set_aside(s, n, slot, "failed", sw)
                    s.run(n, ["mkdir", "-p", slot], log=False, timeout=_T)
                why = first_line(e)[:200]
                plan = sw.plan = core.Plan(key, "cold", f"restoring key {key} from the build host failed ({why}): "
                                                        f"a first boot (25-45 min) compiles it", plan.set_aside)
        for m, slot in zip(mounts, sw.slots):
            # Relative target: the link stays right when the home is mounted elsewhere.
            s.run(n, ["ln", "-sfn", "--", posixpath.basename(slot), m], log=False, timeout=_T)
            sw.linked.append(m)
    except BaseException:
        undo(s, sw, log)
        raise
    log.info(f"[{n}] JIT cache {plan.verdict}: {plan.why}")
    return sw


def _set_aside(s: FleetSession, n: str, slot: str, why: str, sw: Switch) -> None:
    """Rename a slot out of the way (`prune` wipes it after the commit). Not `rm -rf` here: the
    container wrote its files as root and the node's user may not delete them, but renaming needs
    only the user's own parent folder, and a rollback may still want it."""
    if not s.exists(n, slot):
        return
    s.run(n, ["mv", "-T", "--", slot, f"{slot}.{why}-{time.strftime('%Y%m%d%H%M%S')}"], log=False, timeout=_T)


def undo(s: FleetSession, sw: Switch, log: Any) -> None:
    """Put every mount back as it was before `switch` (best effort per mount; says what failed)."""
    n = sw.node
    failed = []
    by_path = {st.path: st for st in sw.before}
    for m in sw.linked:
        st = by_path[m]
        try:
            if st.kind == "link" and st.target:
                s.run(n, ["ln", "-sfn", "--", st.target, m], log=False, timeout=_T)
            else:
                s.run(n, ["rm", "-f", "--", m], log=False, timeout=_T)
        except Exception as e:
            failed.append(f"{m}: {first_line(e)[:160]}")
    for slot, aside in sw.retired:  # the fresh slot the failed launch wrote goes aside in its turn
        try:
            s.run(n, ["mv", "-T", slot, f"{aside}.failed"], check=False, log=False, timeout=_T)
            s.run(n, ["mv", "-T", aside, slot], log=False, timeout=_T)
        except Exception as e:
            failed.append(f"{slot} (kept as {aside}): {first_line(e)[:160]}")
    for m, aside in reversed(sw.set_aside):
        try:
            s.run(n, ["mv", "-T", aside, m], log=False, timeout=_T)
        except Exception as e:
            failed.append(f"{m} (kept as {aside}): {first_line(e)[:160]}")
    if failed:
        log.warning(f"[{n}] JIT cache mounts not all put back: {'; '.join(failed)}; the next deploy re-links them")


def seal(s: FleetSession, sw: Switch) -> list[str]:
    """A healthy boot ran on these slots: they may be backed up and reused. After a fresh cache
    the build host's archive of the key (made from the stale one) is deleted (rsync wrote it as
    the build host's user). Returns what was removed from the build host."""
    for slot in sw.slots:
        s.run(sw.node, ["touch", posixpath.join(slot, core.SEALED)], log=False, timeout=_T)
    if sw.fresh and is_archived(s, sw.plan.key):
        build, src = s.fleet.build_node.name, archived_dir(s, sw.plan.key)
        s.run(build, ["rm", "-rf", "--", src], log=False, timeout=WIPE_TIMEOUT_S)
        return [f"{build}:{src}"]
    return []


def linked_slots(s: FleetSession, node: Node, spec: LaunchSpec) -> list[str]:
    """The slots the cache mounts point at now (a rollout's finish keeps them)."""
    return [st.target for st in read(s, node, "-", cache_mounts(spec)) if st.kind == "link" and st.target]


def prune(s: FleetSession, sw: Switch, spec: LaunchSpec) -> list[str]:
    """After a committed deploy: wipe every slot of the cache mounts except the running key's and
    the replaced deployment's (the previous container, kept as the rollback point, boots on it).
    Other keys' slots and those set aside (stale, failed, unsealed) would only fill the disk. The
    wipe runs `rm -rf` as root in a throwaway container of the serving image (no network), since
    the container wrote the files as root. Returns what was wiped (node:path)."""
    return prune_slots(s, sw.node, spec, [*sw.slots, *(st.target for st in sw.before if st.kind == "link" and st.target)])


def prune_slots(s: FleetSession, n: str, spec: LaunchSpec, keep: list[str]) -> list[str]:
    """Wipe every slot of the cache mounts on node `n` but those named in `keep` (see `prune`)."""
    by_parent: dict[str, list[str]] = {}
    for m in cache_mounts(spec):
        parent = posixpath.dirname(m.rstrip("/"))
        entries = s.run(n, ["ls", "-A", "--", parent], log=False, timeout=_T).stdout.split()
        by_parent.setdefault(parent, []).extend(core.stale_slots(m, entries, keep))
    wiped = []
    for parent, stale in by_parent.items():
        if not stale:
            continue
        s.run(n, ["docker", "run", "--rm", "--network", "none", "--entrypoint", "rm", "-v", f"{parent}:/jit",
                  spec.image, "-rf", "--", *(posixpath.join("/jit", e) for e in stale)],
              log=False, timeout=WIPE_TIMEOUT_S)
        wiped += [f"{n}:{posixpath.join(parent, e)}" for e in stale]
    return wiped


def restore(s: FleetSession, node: Node, key: str, mounts: list[str], slots: list[str]) -> None:
    """Copy the archived cache of `key` from the build host into the node's slots."""
    build = s.fleet.build_node.name
    src = archived_dir(s, key)
    for i, (m, slot) in enumerate(zip(mounts, slots)):
        _copy(s, build, posixpath.join(src, _entry(i, m)), node.name, slot)
    for slot in slots:  # the archive was made from a healthy boot
        s.run(node.name, ["touch", posixpath.join(slot, core.SEALED)], log=False, timeout=_T)


def back_up(s: FleetSession, node: Node, spec: LaunchSpec, key: str) -> dict[str, Any]:
    """Archive the node's sealed slots of `key` on the build host (once per key). Returns what
    happened: {"action": "archived" | "present" | "not-sealed", ...}."""
    mounts = cache_mounts(spec)
    dest = archived_dir(s, key)
    build = s.fleet.build_node.name
    if is_archived(s, key):
        return {"action": "present", "archive": dest}
    states = read(s, node, key, mounts)
    unsealed = [st.path for st in states if not (st.slot_exists and st.slot_sealed)]
    if unsealed:
        return {"action": "not-sealed", "archive": dest,
                "why": f"no healthy boot on key {key} yet ({', '.join(unsealed)}): nothing to back up"}
    s.run(build, ["mkdir", "-p", dest], log=False, timeout=_T)
    for i, m in enumerate(mounts):
        _copy(s, node.name, core.slot_path(m, key) + "/", build, posixpath.join(dest, _entry(i, m)))
    s.run(build, ["touch", posixpath.join(dest, COMPLETE)], log=False, timeout=_T)
    r = s.run(build, ["du", "-sk", dest], log=False, timeout=_T * 4)
    size_kib = int(r.stdout.split()[0]) if r.stdout.split() else 0
    return {"action": "archived", "archive": dest, "size_mib": round(size_kib / 1024, 1)}


def _copy(s: FleetSession, src: str, src_dir: str, dst: str, dst_dir: str) -> None:
    """rsync a cache tree between nodes; on the same node, locally. The JIT cache is not a
    checkpoint: no index or shard checks, rsync's own checksums suffice."""
    src_dir, dst_dir = src_dir.rstrip("/") + "/", dst_dir.rstrip("/")
    if src == dst:
        s.run(src, ["mkdir", "-p", dst_dir], log=False, timeout=_T)
        s.run(src, ["rsync", "-a", "--delete", src_dir, dst_dir + "/"], timeout=remote.COPY_TIMEOUT_S)
        return
    streams = NodeStreams(s)
    if src == s.fleet.build_node.name:  # restore: the build host pushes, as for the checkpoint
        streams.copy_tree(src, dst, src_dir.rstrip("/"), dst_dir, verify=False)
        return
    # Back-up: the build host pulls over its own peer route to the node, so no serving node ever
    # holds a key that opens the build host.
    route = streams.ensure_peer_access(dst, src)
    s.run(dst, ["mkdir", "-p", dst_dir], log=False, timeout=_T)
    argv = ["rsync", "-a", "--delete", f"--partial-dir={remote.RSYNC_PARTIAL_DIR}", "--timeout=120",
            "-e", shlex.join(route.ssh_argv()), f"{route.destination}:{src_dir}", dst_dir + "/"]
    s.run(dst, argv, timeout=remote.COPY_TIMEOUT_S)
