"""First contact with a serve node deployed by hand: adopt what serves, change nothing that does.

`adopt_deployment`: the running container (`docker inspect`) is compared with the fleet's launch
spec for the node (core.adoption.container_differences). Equal and healthy: recorded as the
node's deployment (its deploy marker, `adopted`, with the labels a deploy would have put on it),
so node_deployment skips and benches and rollouts know which launch spec it runs; no restart.
Different: listed field by field and left as it is; the node's next deploy is an ordinary drained
deploy or rollout.

`adopt_jit_cache`: a hand deploy mounts real directories (`~/.cache/vllm`, ...) where a deploy of
spark-pipelines mounts links to keyed slots. Each becomes the slot of the key the running
container compiled for (its image, checkpoint and kernel-shaping flags): renamed beside itself
(same parent: a rename, never a copy; the running container's bind mount follows the directory)
and linked back, sealed when the engine is healthy. The next deploy with the same key boots warm
on it instead of setting it aside as "unkeyed" and wiping it after the commit.

Both hold the node's lease and take `check=True` to say what they would do and touch nothing.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

from spark_pipelines.core import adoption as core
from spark_pipelines.core import jit_cache as jit_core
from spark_pipelines.core.adoption import Finding
from spark_pipelines.core.errors import first_line
from spark_pipelines.core.fleet import Node
from spark_pipelines.core import versions as versions_core
from spark_pipelines.core.launch import (CHECKPOINT_LABEL, CHECKPOINT_VERSION_LABEL, DEPLOY_LABEL, IMAGE_LABEL,
                                         KERNELS_LABEL, expand_home, launch_spec)
from spark_pipelines.core.layout import STATE_DIR
from spark_pipelines.core.remote import PROBE_TIMEOUT_S
from spark_pipelines.core.steps import GATEWAY, JIT_CACHE, MTP_WEIGHTS, NODE_ARTIFACTS, NODE_DEPLOYMENT, SERVING_IMAGE
from spark_pipelines.resources import engine
from spark_pipelines.resources.docker import NodeDocker, container_labels
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.core.steps import PROC_ADOPTION
from spark_pipelines.runbook import jit_cache, journal
from spark_pipelines.runbook.adoption_build import adopt_build_host, adopt_node_artifacts, asset_value
from spark_pipelines.state import markers
from spark_pipelines.state.markers import DeployMarker, deploy_signature

DEPLOYMENT, JIT = NODE_DEPLOYMENT, JIT_CACHE
MAX_NODES_AT_ONCE = 32  # SSH sessions this process drives at once (each node's lease, reads, hash)


def adopt_deployment(session: FleetSession, node: Node, *, code_version: str, image_id: str | None, index: str,
                     manifest: str | None, check: bool) -> Finding:
    """The node's running container against its launch spec (see the module doc). `image_id`,
    `index`, `manifest`: the serving image and checkpoint node_artifacts records for the node."""
    fleet = session.fleet
    spec = launch_spec(fleet, node)
    docker = NodeDocker(session)
    container = docker.inspect_container(node.name, spec.container_name)
    sig = deploy_signature(code_version, spec.fingerprint, image_id, index)
    if container is None or not container.get("State", {}).get("Running"):
        return Finding(node.name, DEPLOYMENT, core.RELAUNCH,
                       f"no running {spec.container_name}: the deploy launches it (drained, with rollback)")
    cid = str(container.get("Id"))
    marker = markers.read_deploy(session, node)
    if marker and marker.signature == sig and marker.container_id == cid:
        return Finding(node.name, DEPLOYMENT, core.CURRENT, "recorded by spark-pipelines and still running",
                       facts={"container_id": cid, "data_version": sig})
    labels = container_labels(container)
    if labels.get(DEPLOY_LABEL):
        return Finding(node.name, DEPLOYMENT, core.DIFFERS,
                       f"a spark-pipelines deploy of launch spec {labels[DEPLOY_LABEL]} (the fleet file gives "
                       f"{spec.fingerprint}): the next rollout or deploy replaces it",
                       facts={"container_id": cid})
    image_env = docker.image_env(node.name, str(container.get("Image")))
    diffs = core.container_differences(spec, container, image_env, image_id)
    healthy = engine.healthy(fleet, node)
    if not healthy:
        diffs.append("vLLM /health does not answer")
    if diffs:
        return Finding(node.name, DEPLOYMENT, core.DIFFERS,
                       f"{spec.container_name} ({cid[:12]}) is not what the fleet file asks for: left as it is; "
                       f"its next deploy or rollout replaces it through a drain", tuple(diffs),
                       facts={"container_id": cid})
    adopted = DeployMarker(signature=sig, container_id=cid, adopted=True, labels={
        DEPLOY_LABEL: spec.fingerprint, IMAGE_LABEL: str(container.get("Image")),
        KERNELS_LABEL: jit_core.launch_hash(spec.serve_args, spec.env),
        **({CHECKPOINT_LABEL: index} if index else {}),
        **({CHECKPOINT_VERSION_LABEL: versions_core.short(manifest)} if manifest else {})},
        metadata={"adopted_from": "a hand deploy (no labels)", "container": spec.container_name})
    if not check:
        markers.write_deploy(session, node, adopted)
    return Finding(node.name, DEPLOYMENT, core.ADOPT,
                   f"{spec.container_name} ({cid[:12]}) runs the fleet's launch spec {spec.fingerprint} on the "
                   f"serving image and answers /health: recorded as the node's deployment, not restarted",
                   facts={"container_id": cid, "data_version": sig, "fingerprint": spec.fingerprint})


def running_key(session: FleetSession, node: Node, container: dict[str, Any], checkpoint: str | None) -> str | None:
    """The JIT cache key of what the container runs (its own image, args and `-e` env)."""
    if not checkpoint:
        return None
    image = str(container.get("Image") or "")
    base = dict(e.partition("=")[::2] for e in NodeDocker(session).image_env(node.name, image))
    env = {k: v for k, v in (str(e).partition("=")[::2] for e in (container.get("Config") or {}).get("Env") or [])
           if base.get(k) != v}
    args = [str(a) for a in (container.get("Config") or {}).get("Cmd") or []]
    return jit_core.cache_key(image, checkpoint, args, env) if image else None


def adopt_jit_cache(session: FleetSession, node: Node, *, checkpoint: str | None, check: bool, run_id: str = "") -> Finding:
    """The node's hand-made cache folders as the slots of the key its container compiled for. The
    renames keep a journal (runbook/journal.py): a run that dies between a folder's rename and its
    link has the folder renamed back by the next run on the node."""
    spec = launch_spec(session.fleet, node)
    mounts = jit_cache.cache_mounts(spec)
    container = NodeDocker(session).inspect_container(node.name, spec.container_name)
    if container is None:
        return Finding(node.name, JIT, core.BUILD, "nothing runs: the first deploy compiles or restores the cache")
    key = running_key(session, node, container, checkpoint)
    if key is None:
        return Finding(node.name, JIT, core.DIFFERS, "the checkpoint is not verified, so no cache key can be "
                                                     "named: the cache folders are left as they are")
    states = jit_cache.read(session, node, key, mounts)
    if all(st.kind == "link" and jit_core.key_of_target(st.path, st.target) == key for st in states):
        return Finding(node.name, JIT, core.CURRENT, f"the mounts point at the slots of key {key}", facts={"key": key})
    bad = [st.path for st in states if st.kind == "other" or (st.kind == "dir" and st.slot_exists)]
    if bad:
        return Finding(node.name, JIT, core.DIFFERS, f"cannot become the slots of key {key} (not a folder, or the "
                                                     f"slot exists already): left as they are",
                       tuple(bad), facts={"key": key})
    dirs = [st for st in states if st.kind == "dir"]
    if not dirs:
        return Finding(node.name, JIT, core.CURRENT, "no hand-made cache folder to adopt", facts={"key": key})
    healthy = engine.healthy(session.fleet, node)
    what = (f"{', '.join(st.path for st in dirs)} become the slots of key {key} (renamed beside themselves, linked "
            f"back{'; sealed: the engine that compiled them is healthy' if healthy else ''})")
    if check:
        return Finding(node.name, JIT, core.ADOPT, what, facts={"key": key})
    done: list[tuple[str, str]] = []
    renames = [(st.path, jit_core.slot_path(st.path, key)) for st in dirs]
    try:
        with journal.journaled(session, node.name, PROC_ADOPTION, run_id, phase="renaming", renames=renames):
            try:
                for mount, slot in renames:
                    session.run(node.name, ["mv", "-T", "--", mount, slot], log=False, timeout=PROBE_TIMEOUT_S)
                    done.append((mount, slot))
                    session.run(node.name, ["ln", "-s", "--", posixpath.basename(slot), mount], log=False,
                          timeout=PROBE_TIMEOUT_S)
                if healthy:
                    _seal(session, node.name, [slot for _, slot in done], str(container.get("Image")))
            except BaseException as e:
                undone = _put_back(session, node.name, done)
                if isinstance(e, Exception):
                    return Finding(node.name, JIT, core.DIFFERS, f"adopting the cache failed ({first_line(e)}); {undone}")
                raise
    except RunbookError as e:  # its journal could not be written: nothing renamed
        return Finding(node.name, JIT, core.DIFFERS, f"not adopted: {first_line(e)}", facts={"key": key})
    return Finding(node.name, JIT, core.ADOPT, what, facts={"key": key})


def _seal(session: FleetSession, n: str, slots: list[str], image: str) -> None:
    """Mark the slots sealed. Hand-made cache folders are root's (docker made them for the bind
    mounts and the container wrote into them): then the marks are written as root in one throwaway
    container of the image that runs there (no network), as the wipe of stale slots is; one
    container for every slot, since on a fleet adopted at once each start costs every node's CPU."""
    marks = [posixpath.join(slot, jit_core.SEALED) for slot in slots]
    if session.run(n, ["touch", *marks], check=False, log=False, timeout=PROBE_TIMEOUT_S).ok:
        return
    volumes = [arg for i, slot in enumerate(slots) for arg in ("-v", f"{slot}:/jit{i}")]
    session.run(n, ["docker", "run", "--rm", "--network", "none", "--entrypoint", "touch", *volumes, image,
                    *(f"/jit{i}/{jit_core.SEALED}" for i in range(len(slots)))],
                log=False, timeout=jit_cache.WIPE_TIMEOUT_S)


def _put_back(session: FleetSession, n: str, done: list[tuple[str, str]]) -> str:
    failed = []
    for mount, slot in reversed(done):
        try:
            session.run(n, ["rm", "-f", "--", mount], log=False, timeout=PROBE_TIMEOUT_S)
            session.run(n, ["mv", "-T", "--", slot, mount], log=False, timeout=PROBE_TIMEOUT_S)
        except Exception as e:  # noqa: PERF203 - each mount on its own
            failed.append(f"{mount} (now {slot}): {first_line(e)}")
    return "put back as it was" if not failed else "NOT all put back: " + "; ".join(failed)


# ------------------------------------------------------------------------------ the fleet


def adopt_gateway(session: FleetSession, *, check: bool, gw: GatewayHost | None = None) -> Finding:
    """The hand-written LiteLLM entries that route to fleet nodes, taken over (see
    GatewayHost.take_over): routing unchanged, confirmed on the running proxy."""
    gw = gw or GatewayHost(session)
    if gw.read().config is None:
        return Finding(GATEWAY, GATEWAY, core.BUILD, f"no config at {gw.config_path}: gateway_job writes it")
    report = gw.take_over(check=check)
    lines = tuple(report.lines())
    if report.differing:
        return Finding(GATEWAY, GATEWAY, core.DIFFERS, "routes to fleet nodes that are not what the fleet file would "
                       "write: kept as the operator's (still drained with their node)", lines)
    if report.taken_over or report.collapsed:
        return Finding(GATEWAY, GATEWAY, core.ADOPT, f"{len(report.taken_over)} hand entr(y/ies) taken over"
                       + (f", {len(report.collapsed)} duplicate(s) collapsed" if report.collapsed else "")
                       + "; routing unchanged", lines)
    return Finding(GATEWAY, GATEWAY, core.CURRENT, "every route to a fleet node is spark-pipelines' own", lines)


# The state folder's nearest existing ancestor must be the node user's to write: dockerd creates a
# bind mount's missing host folders as root, so a first `docker run -v ~/.cache/vllm:...` on a fresh
# home leaves ~/.cache root's and no marker could be written there.
_WRITABLE = 'd=$1; while [ ! -e "$d" ]; do d=$(dirname "$d"); done; [ -w "$d" ] && echo ok || echo "$d"'


def state_unwritable(session: FleetSession, node: Node) -> Finding | None:
    """Why spark-pipelines could not record its state on the node (None: it can)."""
    state = expand_home(STATE_DIR, node.home_dir)
    out = session.run(node.name, ["sh", "-c", _WRITABLE, "state-writable", state], log=False,
                timeout=PROBE_TIMEOUT_S).stdout.strip()
    if out == "ok":
        return None
    return Finding(node.name, "state", core.DIFFERS,
                   f"{out} is not writable by {node.user} (docker created it as root for a cache mount): run "
                   f"`sudo chown {node.user}: {out}` on {node.name}, then adopt again; nothing was recorded there")


def adopt_fleet(session: FleetSession, code_versions: Mapping[str, str], *, check: bool, nodes: Sequence[str] | None = None,
                hub: Any = None, gw: GatewayHost | None = None, run_id: str = "", log: Any = None) -> list[Finding]:
    """Every step of the chain against the live fleet, build host first (its verified checkpoint and
    image are what each node is compared with), then the serve nodes at once, each under its own
    lease, at most `adoption.max_hashing` of them hashing their copy at a time (each hashes on its
    own disk: the disks are the limit, not this process), then the gateway's routes. `check`: say
    what would be done, write nothing. Findings come in fleet order whatever finished first."""
    say = log.info if log is not None else (lambda _line: None)
    blocked = [f for f in (state_unwritable(session, n) for n in {session.fleet.build_node.name: session.fleet.build_node,
                                                             **{n.name: n for n in _targets(session, nodes)}}.values()) if f]
    if blocked:  # nothing is adopted on a fleet where the record of it could not be kept
        for f in blocked:
            say(f"[{f.node}] {f.why}")
        return blocked
    findings = adopt_build_host(session, code_versions, check=check, hub=hub)
    for f in findings:
        say(f"[{f.node}] {f.step}: {f.action}: {f.why}")
    by = {f.step: f for f in findings}
    mtp, serving = asset_value(by[MTP_WEIGHTS]), asset_value(by[SERVING_IMAGE])
    hashing = threading.BoundedSemaphore(session.fleet.adoption.max_hashing)

    def one(node: Node) -> list[Finding]:
        with nullcontext() if check else node_lease(session, node.name, "adopt", run_id=run_id):
            finished = [] if check else journal.finish_dead(session, node, session.log, run_id=run_id)
            for x in finished:
                say(f"[{node.name}] {x.line}")
            if mtp is None or serving is None:
                here = [Finding(node.name, NODE_ARTIFACTS, core.DIFFERS, "the build host's checkpoint or serving image "
                                "is not verified: nothing to compare the node with")]
            else:
                with hashing:  # the node's copy is hashed against the build host's manifest
                    copy = adopt_node_artifacts(session, node, mtp, serving, code_versions, check=check)
                here = [copy,
                        adopt_deployment(session, node, code_version=code_versions[NODE_DEPLOYMENT],
                                         image_id=serving.image_id, index=mtp.index, manifest=mtp.manifest, check=check),
                        adopt_jit_cache(session, node, checkpoint=mtp.architecture or mtp.manifest or mtp.index,
                                        check=check, run_id=run_id)]
        for f in here:
            say(f"[{f.node}] {f.step}: {f.action}: {f.why}")
        return here

    targets = _targets(session, nodes)
    with ThreadPoolExecutor(max_workers=max(1, min(MAX_NODES_AT_ONCE, len(targets))), thread_name_prefix="adopt") as pool:
        futures = [pool.submit(one, node) for node in targets]
        errors = []
        for fut in futures:  # every node finishes (its lease released) before an error is raised
            try:
                findings += fut.result()
            except BaseException as e:  # noqa: PERF203 - each node on its own
                errors.append(e)
    if errors:
        raise errors[0]
    findings.append(adopt_gateway(session, check=check, gw=gw))
    say(f"[gateway] {findings[-1].action}: {findings[-1].why}")
    return findings


def _targets(session: FleetSession, nodes: Sequence[str] | None) -> list[Node]:
    if not nodes:
        return list(session.fleet.serve_nodes)
    return [session.fleet.node(n) for n in nodes]  # an unknown name is a FleetError naming the known ones
