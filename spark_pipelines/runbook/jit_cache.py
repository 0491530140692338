"""Keep, ship and back up a node's JIT cache (see core/jit_cache.py for the layout and key).

`switch()` runs inside the deploy transaction, after preflight and before `docker run`: the
cache mounts are pointed at the slot of the deployment's key, and `undo()` points them back on
every rollback path, so the previous deployment restarts on its own warm cache. `seal()` marks the
slot after a healthy boot; `back_up()` (the `jit_cache` asset, and a rollout once its canary
passed) copies a sealed slot to the build host's archive once per key, with a manifest of its
files hashed where they were compiled, checked again on the build host.

A compile cache is a shipped artifact: a node about to boot a key it holds no sealed slot of (a
newcomer, a rollout's wave node, a node whose reboot lost its cache) gets the key's archive, made
from another node's sealed slot first when there is none yet (`ensure_archived`), copied into its
slots and hashed there against the manifest before anything mounts it. Never another key's: an
archive whose manifest names another key is refused and marked bad. A shipped cache that makes
the boot fail is dropped (`drop_shipped`: set aside, the boot retried cold by the deploy) and its
key's archive marked bad (`mark_bad`: a BAD file beside it), never shipped again; a deploy with
`fresh_jit_cache` removes the archive, mark included. `launch.ship_jit_cache: false`: every node
compiles its own. Stale slots are never mounted; `prune()` wipes them once a deploy has committed
(their files are root's, written in the container, so the wipe runs as root in a throwaway
container).
"""

from __future__ import annotations

import json
import posixpath
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import diagnosis
from spark_pipelines.core import jit_cache as core
from spark_pipelines.core import remote
from spark_pipelines.core.fleet import Node
from spark_pipelines.core.launch import MODELS_MOUNT, LaunchSpec, expand_home, launch_spec
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSession, RemoteError
from spark_pipelines.resources.transfer import NodeStreams, digests_on_node
from spark_pipelines.core.errors import RunbookError, first_line

COMPLETE = "COMPLETE"  # written last into an archived key: a half-copied backup is never restored
MANIFEST = "MANIFEST.json"  # the key and each entry's files (size, sha256), hashed on the node that compiled them
BAD = "BAD"  # a shipped copy failed a boot, or the archive is not its key's: never shipped again
ARCHIVE_FORMAT = "spark-jit-archive/1"
_T = remote.PROBE_TIMEOUT_S
WIPE_TIMEOUT_S = 900  # deleting GBs of kernels on a busy disk


def cache_mounts(spec: LaunchSpec) -> list[str]:
    """The host side of the launch's cache mounts (everything but the models mount)."""
    return [host for host, container in spec.mounts if container != MODELS_MOUNT]


def store_dir(session: FleetSession) -> str:
    fleet = session.fleet
    return expand_home(fleet.launch.jit_cache_store, fleet.build_node.home_dir)


def archived_dir(session: FleetSession, key: str) -> str:
    return posixpath.join(store_dir(session), key)


def _entry(i: int, mount: str) -> str:
    """The archive's name for a mount: `0_vllm`, `1_flashinfer`, `2_triton`."""
    return f"{i}_{posixpath.basename(mount.rstrip('/')).lstrip('.')}"


class ShipRefused(RunbookError):
    """The key's archive is not that key's (its manifest names another): never mounted."""


# One POSIX sh program, constant text: the archive directory arrives as $1.
_STATE = ('d=$1; if [ -e "$d/BAD" ]; then echo bad; elif [ -f "$d/COMPLETE" ] && [ -f "$d/MANIFEST.json" ]; '
          'then echo complete; elif [ -f "$d/COMPLETE" ]; then echo unverifiable; else echo absent; fi')


def archive_state(session: FleetSession, key: str) -> str:
    """complete | bad | unverifiable (an archive made before manifests: never shipped, made again)
    | absent."""
    r = session.run(session.fleet.build_node.name, ["sh", "-c", _STATE, "jit-archive", archived_dir(session, key)], log=False,
              timeout=_T)
    return r.stdout.strip() or "absent"


def is_archived(session: FleetSession, key: str) -> bool:
    return archive_state(session, key) == "complete"


def bad_reason(session: FleetSession, key: str) -> str:
    build = session.fleet.build_node.name
    path = posixpath.join(archived_dir(session, key), BAD)
    try:
        return json.loads(session.read_text(build, path)).get("why", "marked bad")
    except (RemoteError, ValueError, AttributeError):
        return "marked bad"


def mark_bad(session: FleetSession, key: str, why: str, node: str = "") -> None:
    """Never ship this key's archive again (a BAD file beside it, with why and where)."""
    build = session.fleet.build_node.name
    d = archived_dir(session, key)
    session.run(build, ["mkdir", "-p", d], log=False, timeout=_T)
    session.put_text(build, posixpath.join(d, BAD), json.dumps({
        "why": why[:500], "node": node, "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
    session.log.warning(f"[{build}] the JIT cache archive of key {key} is marked bad and not shipped again: {why[:300]}")


def archive_digests(session: FleetSession, key: str, entries: list[str]) -> dict[str, dict]:
    """{entry: {path: {size, sha256}}} of the archive as it lies on the build host."""
    build = session.fleet.build_node.name
    return {e: digests_on_node(session, build, posixpath.join(archived_dir(session, key), e)) for e in entries}


def write_archive_manifest(session: FleetSession, key: str, entries: dict[str, dict], source: str) -> None:
    """The archive's manifest (the key and each entry's files), then COMPLETE: shippable from now."""
    build = session.fleet.build_node.name
    d = archived_dir(session, key)
    session.put_text(build, posixpath.join(d, MANIFEST), json.dumps(
        {"format": ARCHIVE_FORMAT, "key": key, "source": source, "entries": entries}, sort_keys=True))
    session.run(build, ["touch", posixpath.join(d, COMPLETE)], log=False, timeout=_T)


def read_archive_manifest(session: FleetSession, key: str) -> dict:
    """The archive's manifest; ShipRefused when it is not `key`'s, RunbookError when unreadable."""
    build = session.fleet.build_node.name
    path = posixpath.join(archived_dir(session, key), MANIFEST)
    try:
        data = json.loads(session.read_text(build, path))
    except (RemoteError, ValueError) as e:
        raise RunbookError(f"{build}:{path} is unreadable ({first_line(e)})") from None
    if not isinstance(data, dict) or data.get("format") != ARCHIVE_FORMAT or not isinstance(data.get("entries"), dict):
        raise RunbookError(f"{build}:{path} is not a {ARCHIVE_FORMAT} manifest")
    if data.get("key") != key:
        raise ShipRefused(f"the archive under key {key} holds the cache of key {data.get('key')!r} "
                          f"(from {data.get('source') or 'unknown'}): another key's cache is never mounted")
    return data


def read(session: FleetSession, node: Node, key: str, mounts: list[str]) -> list[core.MountState]:
    r = session.run(node.name, core.probe_argv(key, mounts), log=False, timeout=_T)
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
    shipped: dict[str, Any] = field(default_factory=dict)  # the shipped cache: source, bytes, seconds


def switch(session: FleetSession, node: Node, spec: LaunchSpec, key: str, log: Any, *, fresh: bool = False,
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
            if session.exists(n, slot):
                session.run(n, ["mv", "-T", slot, f"{slot}.stale-{stamp}"], log=False, timeout=_T)
                retired.append((slot, f"{slot}.stale-{stamp}"))
    states = read(session, node, key, mounts)
    warm = bool(states) and all(st.slot_exists and st.slot_sealed and not st.slot_empty for st in states)
    shippable, not_shipped = (False, "") if fresh or warm else _shippable(session, node, key, log)
    plan = core.plan(key, states, archived=shippable)
    if not_shipped and plan.verdict == "cold":
        plan = core.Plan(key, "cold", f"{plan.why}; {not_shipped}", plan.set_aside)
    sw = Switch(n, plan, states, [core.slot_path(m, key) for m in mounts], retired=retired, fresh=fresh)
    note(sw)
    try:
        for m in plan.set_aside:
            aside = core.slot_path(m, core.UNKEYED)
            if session.exists(n, aside):
                raise RunbookError(f"{n}: {m} is a real directory and {aside} exists already (two hand-made "
                                   f"caches): move one away (or sudo rm -rf it), then deploy again")
            session.run(n, ["mv", "-T", m, aside], log=False, timeout=_T)
            sw.set_aside.append((m, aside))
            note(sw)
        if plan.restore:  # an unsealed slot (a boot that never got healthy) holds root's files:
            for st, slot in zip(states, sw.slots):  # rsync cannot replace them, so it goes aside
                if st.slot_exists:
                    _set_aside(session, n, slot, "unsealed", sw)
        for m, slot in zip(mounts, sw.slots):
            session.run(n, ["mkdir", "-p", slot], log=False, timeout=_T)
        if plan.restore:
            try:
                sw.shipped = restore(session, node, key, mounts, sw.slots)
                plan = sw.plan = core.Plan(key, "restore", f"{plan.why} (shipped: {sw.shipped['bytes']} bytes from "
                                                           f"{sw.shipped['source']}'s sealed cache, every file hashed "
                                                           "to its manifest on this node)", plan.set_aside, restore=True)
            except Exception as e:  # a cache is an optimisation: a failed restore costs a cold boot
                for slot in sw.slots:  # never boot on a half-restored cache
                    _set_aside(session, n, slot, "failed", sw)
                    session.run(n, ["mkdir", "-p", slot], log=False, timeout=_T)
                why = first_line(e)[:300]
                if isinstance(e, ShipRefused):
                    mark_bad(session, key, why, n)
                plan = sw.plan = core.Plan(key, "cold", f"shipping key {key} from the build host failed ({why}): "
                                                        f"a first boot (25-45 min) compiles it", plan.set_aside)
        for m, slot in zip(mounts, sw.slots):
            # Relative target: the link stays right when the home is mounted elsewhere.
            session.run(n, ["ln", "-sfn", "--", posixpath.basename(slot), m], log=False, timeout=_T)
            sw.linked.append(m)
    except BaseException:
        undo(session, sw, log)
        raise
    log.info(f"[{n}] JIT cache {plan.verdict}: {plan.why}")
    return sw


def _set_aside(session: FleetSession, n: str, slot: str, why: str, sw: Switch) -> None:
    """Rename a slot out of the way (`prune` wipes it after the commit). Not `rm -rf` here: the
    container wrote its files as root and the node's user may not delete them, but renaming needs
    only the user's own parent folder, and a rollback may still want it."""
    if not session.exists(n, slot):
        return
    session.run(n, ["mv", "-T", "--", slot, f"{slot}.{why}-{time.strftime('%Y%m%d%H%M%S')}"], log=False, timeout=_T)


def undo(session: FleetSession, sw: Switch, log: Any) -> None:
    """Put every mount back as it was before `switch` (best effort per mount; says what failed)."""
    n = sw.node
    failed = []
    by_path = {st.path: st for st in sw.before}
    for m in sw.linked:
        st = by_path[m]
        try:
            if st.kind == "link" and st.target:
                session.run(n, ["ln", "-sfn", "--", st.target, m], log=False, timeout=_T)
            else:
                session.run(n, ["rm", "-f", "--", m], log=False, timeout=_T)
        except Exception as e:
            failed.append(f"{m}: {first_line(e)[:160]}")
    for slot, aside in sw.retired:  # the fresh slot the failed launch wrote goes aside in its turn
        try:
            session.run(n, ["mv", "-T", slot, f"{aside}.failed"], check=False, log=False, timeout=_T)
            session.run(n, ["mv", "-T", aside, slot], log=False, timeout=_T)
        except Exception as e:
            failed.append(f"{slot} (kept as {aside}): {first_line(e)[:160]}")
    for m, aside in reversed(sw.set_aside):
        try:
            session.run(n, ["mv", "-T", aside, m], log=False, timeout=_T)
        except Exception as e:
            failed.append(f"{m} (kept as {aside}): {first_line(e)[:160]}")
    if failed:
        log.warning(f"[{n}] JIT cache mounts not all put back: {'; '.join(failed)}; the next deploy re-links them")


def seal(session: FleetSession, sw: Switch) -> list[str]:
    """A healthy boot ran on these slots: they may be backed up and reused. After a fresh cache
    the build host's archive of the key (made from the stale one) is deleted (rsync wrote it as
    the build host's user). Returns what was removed from the build host."""
    for slot in sw.slots:
        session.run(sw.node, ["touch", posixpath.join(slot, core.SEALED)], log=False, timeout=_T)
    if sw.fresh and archive_state(session, sw.plan.key) != "absent":  # a bad mark goes with it
        build, src = session.fleet.build_node.name, archived_dir(session, sw.plan.key)
        session.run(build, ["rm", "-rf", "--", src], log=False, timeout=WIPE_TIMEOUT_S)
        return [f"{build}:{src}"]
    return []


def linked_slots(session: FleetSession, node: Node, spec: LaunchSpec) -> list[str]:
    """The slots the cache mounts point at now (a rollout's finish keeps them)."""
    return [st.target for st in read(session, node, "-", cache_mounts(spec)) if st.kind == "link" and st.target]


def prune(session: FleetSession, sw: Switch, spec: LaunchSpec) -> list[str]:
    """After a committed deploy: wipe every slot of the cache mounts except the running key's and
    the replaced deployment's (the previous container, kept as the rollback point, boots on it).
    Other keys' slots and those set aside (stale, failed, unsealed) would only fill the disk. The
    wipe runs `rm -rf` as root in a throwaway container of the serving image (no network), since
    the container wrote the files as root. Returns what was wiped (node:path)."""
    return prune_slots(session, sw.node, spec, [*sw.slots, *(st.target for st in sw.before if st.kind == "link" and st.target)])


def prune_slots(session: FleetSession, node: str, spec: LaunchSpec, keep: list[str]) -> list[str]:
    """Wipe every slot of the cache mounts on `node` but those named in `keep` (see `prune`)."""
    by_parent: dict[str, list[str]] = {}
    for m in cache_mounts(spec):
        parent = posixpath.dirname(m.rstrip("/"))
        entries = session.run(node, ["ls", "-A", "--", parent], log=False, timeout=_T).stdout.split()
        by_parent.setdefault(parent, []).extend(core.stale_slots(m, entries, keep))
    wiped = []
    for parent, stale in by_parent.items():
        if not stale:
            continue
        session.run(node, ["docker", "run", "--rm", "--network", "none", "--entrypoint", "rm", "-v", f"{parent}:/jit",
                  spec.image, "-rf", "--", *(posixpath.join("/jit", e) for e in stale)],
              log=False, timeout=WIPE_TIMEOUT_S)
        wiped += [f"{node}:{posixpath.join(parent, e)}" for e in stale]
    return wiped


# One POSIX sh program, constant text: $1 the staging folder, $2 the seal file's name, then pairs of
# (entry, slot). Each entry is renamed into its (empty) slot and sealed; the staging folder goes.
_PLACE = ('set -e; s=$1; seal=$2; shift 2; while [ $# -gt 1 ]; do rmdir -- "$2" 2>/dev/null || true; '
          'mv -T -- "$s/$1" "$2"; touch -- "$2/$seal"; shift 2; done; rm -rf -- "$s"')


def restore(session: FleetSession, node: Node, key: str, mounts: list[str], slots: list[str]) -> dict[str, Any]:
    """Ship the archived cache of `key` from the build host into the node's slots, each file
    hashed there against the archive's manifest before anything mounts it. Raises ShipRefused
    (before a byte is copied) when the archive is another key's, RunbookError when the copy does not
    verify. Returns {source, bytes, seconds}.

    The archive goes in one rsync to a staging folder beside the first slot (a `.jit-` name, so
    `prune` wipes one a dead run left), is hashed there in one pass, and is renamed into the slots
    in one command: a handful of round trips whatever the number of mounts, since on a newcomer
    these seconds are the shipped boot's overhead."""
    build = session.fleet.build_node.name
    started = time.monotonic()
    manifest = read_archive_manifest(session, key)
    entries = [_entry(i, m) for i, m in enumerate(mounts)]
    missing = [e for e in entries if e not in manifest["entries"]]
    if missing:
        raise RunbookError(f"the archive of key {key} has no {missing[0]} (made for other cache mounts)")
    staging = f"{slots[0]}.incoming"
    try:
        session.run(node.name, ["rm", "-rf", "--", staging], log=False, timeout=WIPE_TIMEOUT_S)
        _copy(session, build, archived_dir(session, key), node.name, staging)  # the build host itself: a local copy
        got = digests_on_node(session, node.name, staging)
        for entry in entries:
            want = manifest["entries"][entry]
            mine = {p[len(entry) + 1:]: d for p, d in got.items() if p.startswith(entry + "/")}
            if mine != want:
                differ = sorted(p for p in set(mine) | set(want) if mine.get(p) != want.get(p))
                raise RunbookError(f"the shipped cache of key {key} does not hash to its manifest on {node.name} "
                                   f"({len(differ)} file(s), e.g. {entry}/{differ[0]}): not mounted")
        pairs = [part for entry, slot in zip(entries, slots) for part in (entry, slot)]
        session.run(node.name, ["sh", "-c", _PLACE, "jit-ship", staging, core.SEALED, *pairs], log=False,
                    timeout=_T)
    finally:  # gone on success already; after a failure nothing of it is mounted
        session.run(node.name, ["rm", "-rf", "--", staging], check=False, log=False, timeout=WIPE_TIMEOUT_S)
    copied = sum(int(f["size"]) for e in entries for f in manifest["entries"][e].values())
    return {"source": manifest.get("source") or build, "bytes": copied,
            "seconds": round(time.monotonic() - started, 2)}


def _shippable(session: FleetSession, node: Node, key: str, log: Any) -> tuple[bool, str]:
    """(the key's archive can be shipped to `node`, why not when it cannot and that is news)."""
    if not session.fleet.launch.ship_jit_cache:
        return False, "launch.ship_jit_cache is off: every node compiles its own"
    state = archive_state(session, key)
    if state == "bad":
        return False, f"the archive of key {key} is marked bad ({bad_reason(session, key)}): not shipped"
    if state == "complete":
        return True, ""
    return bool(ensure_archived(session, key, exclude=node.name, log=log)), ""


def ensure_archived(session: FleetSession, key: str, *, exclude: str = "", log: Any = None) -> str | None:
    """Archive `key` from a serve node whose slots of it are sealed (a healthy boot compiled them),
    under that node's lease (a busy node is passed over). Returns the node archived from, or None."""
    say = (log or session.log).info
    for other in session.fleet.serve_nodes:
        if other.name == exclude:
            continue
        spec = launch_spec(session.fleet, other)
        try:
            states = read(session, other, key, cache_mounts(spec))
        except (RemoteError, ValueError):
            continue
        if not states or not all(st.slot_exists and st.slot_sealed and not st.slot_empty for st in states):
            continue
        try:
            with node_lease(session, other.name, f"jit-cache back-up of key {key}"):
                done = back_up(session, other, spec, key)
        except (RunbookError, RemoteError) as e:
            say(f"[{other.name}] its sealed cache of key {key} was not archived: {first_line(e)}")
            continue
        if done["action"] in ("archived", "present"):
            say(f"[{other.name}] its sealed cache of key {key} is archived on the build host to be shipped "
                f"({done['action']})")
            return other.name
    return None


def drop_shipped(session: FleetSession, sw: Switch, why: str) -> None:
    """The boot on a shipped cache failed: its slots go aside (`failed-shipped`, wiped after the
    commit) and empty ones take their place, so the retry compiles (a cold boot). The caller marks
    the archive bad once the cold boot served."""
    for slot in sw.slots:
        _set_aside(session, sw.node, slot, "failed-shipped", sw)
        session.run(sw.node, ["mkdir", "-p", slot], log=False, timeout=_T)
    key = sw.plan.key
    sw.plan = core.Plan(key, "cold", f"the cache shipped for key {key} failed the boot ({why[:200]}): dropped, "
                                     "booted cold; its archive is marked bad and not shipped again", sw.plan.set_aside)


def boot_cold_after_shipped(session: FleetSession, node: Node, spec: LaunchSpec, sw: Switch, log_text: str, log: Any,
                            launch: Callable[[], tuple[bool, str, Any]]) -> tuple[bool, str, Any]:
    """The boot on a shipped cache failed (`log_text`): the failed container goes, the cache is
    dropped and `launch` (the deploy's) runs once more, cold; when that serves, the cache was the
    cause and its key's archive is marked bad. Returns what `launch` returned."""
    findings = diagnosis.diagnose(log_text)
    picked = next((f for f in findings if f.signature.severity == diagnosis.Severity.ERROR),
                  findings[0] if findings else None)
    why = picked.line.strip() if picked is not None else "the engine did not become healthy"
    log.warning(f"[{node.name}] the boot on the shipped JIT cache failed ({why[:200]}): dropping it, booting cold")
    docker = NodeDocker(session)
    failed = docker.inspect_container(node.name, spec.container_name)
    if failed is not None:  # the deploy's own launch (the kept deployment has a name of its own)
        docker.remove(node.name, str(failed["Id"]), force=True)
    drop_shipped(session, sw, why)
    ok, text, ready = launch()
    if ok:
        mark_bad(session, sw.plan.key, f"a boot on it failed on {node.name} ({why[:300]}) and a cold boot served", node.name)
    return ok, text, ready


def back_up(session: FleetSession, node: Node, spec: LaunchSpec, key: str) -> dict[str, Any]:
    """Archive the node's sealed slots of `key` on the build host (once per key): each slot hashed
    on the node, copied, hashed again on the build host; the manifest and COMPLETE written only
    when both agree. Returns {"action": "archived" | "present" | "bad" | "not-sealed" | "failed", ...}."""
    mounts = cache_mounts(spec)
    dest = archived_dir(session, key)
    build = session.fleet.build_node.name
    state = archive_state(session, key)
    if state == "complete":
        return {"action": "present", "archive": dest}
    if state == "bad":
        return {"action": "bad", "archive": dest, "why": f"marked bad ({bad_reason(session, key)}): not archived again "
                                                         "(a deploy with fresh_jit_cache removes the mark)"}
    states = read(session, node, key, mounts)
    unsealed = [st.path for st in states if not (st.slot_exists and st.slot_sealed)]
    if unsealed:
        return {"action": "not-sealed", "archive": dest,
                "why": f"no healthy boot on key {key} yet ({', '.join(unsealed)}): nothing to back up"}
    started = time.monotonic()
    entries = {_entry(i, m): core.slot_path(m, key) for i, m in enumerate(mounts)}
    try:
        theirs = {e: digests_on_node(session, node.name, slot) for e, slot in entries.items()}
    except RemoteError as e:
        return {"action": "failed", "archive": dest, "why": f"the slots could not be hashed on {node.name}: "
                                                            f"{first_line(e)}"}
    session.run(build, ["rm", "-rf", "--", dest], log=False, timeout=WIPE_TIMEOUT_S)  # a partial or unverifiable one
    session.run(build, ["mkdir", "-p", dest], log=False, timeout=_T)
    for e, slot in entries.items():
        _copy(session, node.name, slot + "/", build, posixpath.join(dest, e))
    ours = archive_digests(session, key, list(entries))
    if ours != theirs:
        session.run(build, ["rm", "-rf", "--", dest], log=False, timeout=WIPE_TIMEOUT_S)
        return {"action": "failed", "archive": dest, "why": "the copy on the build host does not hash to the node's "
                                                            "slots (a file changed while copying?): not kept"}
    write_archive_manifest(session, key, theirs, node.name)
    size = sum(int(f["size"]) for files in theirs.values() for f in files.values())
    return {"action": "archived", "archive": dest, "size_mib": round(size / (1 << 20), 1), "source": node.name,
            "seconds": round(time.monotonic() - started, 2)}


def _copy(session: FleetSession, src: str, src_dir: str, dst: str, dst_dir: str) -> None:
    """rsync a cache tree between nodes; on the same node, locally. The JIT cache is not a
    checkpoint: no index or shard checks, rsync's own checksums suffice."""
    src_dir, dst_dir = src_dir.rstrip("/") + "/", dst_dir.rstrip("/")
    if src == dst:
        session.run(src, ["mkdir", "-p", dst_dir], log=False, timeout=_T)
        session.run(src, ["rsync", "-a", "--delete", src_dir, dst_dir + "/"], timeout=remote.COPY_TIMEOUT_S)
        return
    streams = NodeStreams(session)
    if src == session.fleet.build_node.name:  # restore: the build host pushes, as for the checkpoint
        streams.copy_tree(src, dst, src_dir.rstrip("/"), dst_dir, verify=False)
        return
    # Back-up: the build host pulls over its own peer route to the node, so no serving node ever
    # holds a key that opens the build host.
    route = streams.ensure_peer_access(dst, src)
    session.run(dst, ["mkdir", "-p", dst_dir], log=False, timeout=_T)
    argv = ["rsync", "-a", "--delete", f"--partial-dir={remote.RSYNC_PARTIAL_DIR}", "--timeout=120",
            "-e", shlex.join(route.ssh_argv()), f"{route.destination}:{src_dir}", dst_dir + "/"]
    session.run(dst, argv, timeout=remote.COPY_TIMEOUT_S)
