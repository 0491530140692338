"""The health sweep: probe every serve node at once, read-only, and judge each with `core.health`.

A probe of one node reads /health and /metrics (resources.engine.probe, beside the SSH part), and over
SSH: reachability, nvidia-smi (preflight's GPU_QUERY), `docker inspect` of the serving container
and the tail of its log, in one command (GATHER_SCRIPT). Every step has its own short timeout, so
a dead node costs one connect timeout, not the default connect retries. Nothing on a node is changed. Nodes are probed in parallel threads: a
FleetSession opens one connection per node under a per-node lock and one channel per command,
so threads probing different nodes never share a channel.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from spark_pipelines.core import gpu, health, remote
from spark_pipelines.core import pair as pair_core
from spark_pipelines.core.fleet import Fleet, Node
from spark_pipelines.core.launch import expand_home
from spark_pipelines.core.errors import first_line
from spark_pipelines.resources.ssh import (
    FleetSession,
    HostKeyError,
    NodeConnectError,
    NodeUnreachable,
    RemoteError,
    SshSettings,
)
from spark_pipelines.resources import engine
from spark_pipelines.resources.lease import lock_paths
from spark_pipelines.core.layout import marker_path
from spark_pipelines.runbook.preflight import GPU_QUERY
from spark_pipelines.state import markers

# Per-step limits: a probe is a glance, not a wait.
SSH_CONNECT_TIMEOUT_S = 5.0
GPU_TIMEOUT_S = 15.0
INSPECT_TIMEOUT_S = 15.0
LOG_TIMEOUT_S = 20.0
HEALTH_TIMEOUT_S = 5.0
METRICS_TIMEOUT_S = 5.0
LOG_TAIL_LINES = 400
# Threads of a sweep: sized so that 100 nodes with 10 of them dead (each holding a thread for the
# connect timeout) still finish in one timeout or so; the work itself is CPU (SSH handshakes).
MAX_PARALLEL = 64
# One remote command per node reads the GPU, the container and its log tail (one channel, not
# four: each channel is a session, a shell and a `timeout` on the node). A fixed script, its
# inputs as positional arguments (never spliced into it); sections framed by a per-call nonce so
# no log line can forge one.
GATHER_SCRIPT = (
    'n=$1; tg=$2; ti=$3; tl=$4; c=$5; lines=$6; j=$7; lk=$8; cb=$9; shift 9; exec 3>&1; '
    'printf "%s begin gpu\n" "$n"; timeout -k 2 "$tg" "$@"; printf "\n%s end gpu %s\n" "$n" "$?"; '
    'printf "%s begin inspect\n" "$n"; e=$(timeout -k 2 "$ti" docker container inspect "$c" 2>&1 >&3); rc=$?; '
    'printf "\n%s end inspect %s\n%s begin inspect-err\n%s\n%s end inspect-err %s\n" "$n" "$rc" "$n" "$e" "$n" "$rc"; '
    'if [ "$rc" -eq 0 ]; then printf "%s begin logs\n" "$n"; '
    'timeout -k 2 "$tl" docker logs --tail "$lines" "$c" 2>&1; printf "\n%s end logs %s\n" "$n" "$?"; fi; '
    # A deploy journal (rare), and whether anyone holds the node's run lease, read from the
    # kernel's lock table (taking the lock, even for a moment, could refuse a starting deploy): a
    # journal with the lease free is a dead run's (the deploy's here, the others' in the ledger).
    'if [ -f "$j" ]; then printf "%s begin journal\n" "$n"; cat -- "$j"; printf "\n%s end journal 0\n" "$n"; fi; '
    'printf "%s begin lease\n" "$n"; if [ -e "$lk" ]; then stat -c "%d %i" -- "$lk"; '
    'grep -E "FLOCK +ADVISORY +WRITE +[0-9]+ +[0-9a-f]+:[0-9a-f]+:$(stat -c %i -- "$lk") " /proc/locks; '
    'else echo absent; fi; printf "\n%s end lease 0\n" "$n"; '
    # The node's own clean-boot memcheck (node_os), the residue verdict's baseline when present.
    'if [ -f "$cb" ]; then printf "%s begin cleanboot\n" "$n"; cat -- "$cb"; printf "\n%s end cleanboot 0\n" "$n"; fi'
)

_NO_SUCH = ("No such container", "No such object", "no such container")


def probe_settings(base: SshSettings | None = None) -> SshSettings:
    """SSH settings for a sweep: a short connect timeout and no connect retries (a dead node must
    be reported in seconds; the next sweep is the retry)."""
    fields = (base or SshSettings()).model_dump(include=set(SshSettings.model_fields))
    return SshSettings(**{**fields, "connect_timeout_s": SSH_CONNECT_TIMEOUT_S, "connect_retries": 0})


def _warm_start(session: FleetSession, fleet: Fleet, node: Node) -> bool | None:
    """Whether the torch.compile cache the launch mounts holds anything (a warm 7-10 min boot)."""
    mounts = [m.host for m in fleet.launch_for(node).cache_mounts if "vllm" in m.host]
    if not mounts:
        return None
    path = expand_home(mounts[0], node.home_dir)
    # -H: the mount is a symlink to its keyed slot (core/jit_cache.py); look inside the slot.
    r = session.run(node.name, ["find", "-H", path, "-mindepth", "1", "-maxdepth", "1", "-print", "-quit"],
              check=False, log=False, timeout=INSPECT_TIMEOUT_S)
    return bool(r.stdout.strip()) if r.ok else False


def _inspect(session: FleetSession, node: Node, container: str) -> tuple[health.ContainerState | None, str | None]:
    """(state, None), or (None, why it could not be read)."""
    try:
        r = session.run(node.name, ["docker", "container", "inspect", container], check=False, log=False,
                  timeout=INSPECT_TIMEOUT_S)
        if r.ok:
            data = json.loads(r.stdout)
            return health.container_state(data[0] if data else None), None
        if any(m in r.stderr for m in _NO_SUCH):
            return health.container_state(None), None
        return None, f"docker inspect {container} exited {r.exit_status}: {r.tail.strip()[-200:]}"
    except (RemoteError, ValueError) as e:
        return None, first_line(e)[:300]


def sections(stdout: str, nonce: str) -> dict[str, tuple[str, int | None]]:
    """The gather script's output -> {section: (text, exit status)}."""
    out: dict[str, tuple[str, int | None]] = {}
    name, buf = None, []
    for line in stdout.split("\n"):
        words = line.split(" ")
        if len(words) >= 3 and words[0] == nonce and words[1] == "begin":
            name, buf = words[2], []
        elif len(words) >= 4 and words[0] == nonce and words[1] == "end" and name == words[2]:
            text = "\n".join(buf)
            out[name] = (text[:-1] if text.endswith("\n") else text,
                         int(words[3]) if words[3].lstrip("-").isdigit() else None)
            name = None
        elif name is not None:
            buf.append(line)
    return out


def _gather(session: FleetSession, node: Node, container: str, fields: dict[str, Any]) -> None:
    nonce = secrets.token_hex(8)
    argv = ["sh", "-c", GATHER_SCRIPT, "sh", nonce, f"{GPU_TIMEOUT_S:g}", f"{INSPECT_TIMEOUT_S:g}", f"{LOG_TIMEOUT_S:g}",
            container, str(LOG_TAIL_LINES), marker_path(node, markers.DEPLOY_JOURNAL), lock_paths(session, node.name)[0],
            marker_path(node, markers.CLEAN_BOOT), *GPU_QUERY]
    try:
        r = session.run(node.name, argv, check=False, log=False,
                  timeout=GPU_TIMEOUT_S + INSPECT_TIMEOUT_S + LOG_TIMEOUT_S + 10)
    except RemoteError as e:
        fields["gpu_error"] = fields["container_error"] = first_line(e)[:300]
        return
    got = sections(r.stdout, nonce)
    gpu_text, _ = got.get("gpu", ("", None))
    try:
        fields["gpu"] = gpu.parse_reading(gpu_text)
    except gpu.GpuFormatError as e:
        fields["gpu_error"] = first_line(e)[:300]
    text, rc = got.get("inspect", ("", None))
    err, _ = got.get("inspect-err", ("", None))
    if rc is None:
        fields["container"], fields["container_error"] = None, (
            f"docker inspect {container}: no answer (exit {r.exit_status}): {r.tail.strip()[-200:]}")
    elif rc == 0:
        try:
            data = json.loads(text)
            fields["container"], fields["container_error"] = health.container_state(data[0] if data else None), None
        except ValueError as e:
            fields["container"], fields["container_error"] = None, first_line(e)[:300]
    elif any(m in err for m in _NO_SUCH):
        fields["container"], fields["container_error"] = health.container_state(None), None
    else:
        fields["container"], fields["container_error"] = None, (
            f"docker inspect {container} exited {rc}: {err.strip()[-200:]}")
    if "logs" in got:
        fields["log_tail"] = got["logs"][0]
    lease_text = got.get("lease", ("", None))[0]
    fields["lease_held"] = lease_held(lease_text) if "lease" in got else None
    if "journal" in got:
        fields["deploy_journal"] = deploy_in_flight(got["journal"][0], lease_text)
    if "cleanboot" in got:
        try:
            fields["clean_boot_free_gib"] = markers.CleanBoot.model_validate_json(got["cleanboot"][0]).free_gib
        except ValueError:
            pass  # torn or another version's: the profile's figure stands


def deploy_in_flight(journal_text: str, lease_text: str) -> health.DeployInFlight | None:
    """The gather script's journal and lease sections -> what the sweep knows of a deploy in
    flight (None: the journal does not parse, as for the deploy that would finish it), with the
    lease section as `lease_held` reads it."""
    try:
        j = markers.DeployJournal.model_validate_json(journal_text)
    except ValueError:
        return None
    return health.DeployInFlight(j.run_id, j.phase, j.started, j.owner or None, lease_held(lease_text))


def lease_held(lease_text: str) -> bool | None:
    """The gather script's lease section: whether a process holds the node's run lease (None: not
    read). It is the lock file's `device inode` and the kernel's FLOCK lines for that inode
    (/proc/locks names a file MAJOR:MINOR:INODE, device numbers in hex), or `absent`."""
    lines = [ln.split() for ln in lease_text.splitlines() if ln.strip()]
    if lines and lines[0] == ["absent"]:
        return False
    if lines and len(lines[0]) == 2 and all(x.isdigit() for x in lines[0]):
        dev, ino = int(lines[0][0]), int(lines[0][1])
        want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
        return any(want in ln for ln in lines[1:])
    return None  # not read: say so, decide nothing


def probe(session: FleetSession, node: Node, *, bench: health.BenchHistory | None = None,
          clock: Callable[[], float] = time.time) -> health.Observation:
    """Read one node. Never raises for what the node does; the errors become observations.

    /health and /metrics run beside the SSH part (a dead node costs one timeout, not two)."""
    fleet = session.fleet
    container = fleet.launch_for(node).container_name
    fields: dict[str, Any] = {
        "node": node.name, "probed_at": clock(), "bench": bench,
        "clean_boot_free_gib": fleet.profile_of(node).clean_boot_free_gib,  # node_os's measured one when read
    }
    http: dict[str, Any] = {}
    side = threading.Thread(target=lambda: http.update(engine.probe(fleet, node, HEALTH_TIMEOUT_S, METRICS_TIMEOUT_S)),
                            name=f"health-http-{node.name}", daemon=True)
    side.start()
    try:
        try:
            session.connection(node.name)  # reachability: a verified, authenticated session
        except (HostKeyError, NodeConnectError) as e:
            # Only a node that does not answer is unreachable; the rest (host key, credentials, a
            # host name that does not resolve) is the fleet file's or the operator's to fix.
            refused = not isinstance(e, NodeUnreachable)
            fields.update(ssh_ok=False, ssh_error=first_line(e)[:300], ssh_refused=refused)
            return _observation(fields, side, http)
        except (RemoteError, OSError, EOFError) as e:
            fields.update(ssh_ok=False, ssh_error=first_line(e)[:300])
            return _observation(fields, side, http)
        fields["ssh_ok"] = True
        _gather(session, node, container, fields)
        side.join(HEALTH_TIMEOUT_S + METRICS_TIMEOUT_S + 5)
        fields.update(http)
        state = fields.get("container")
        if state is not None and not state.exists:
            fields["previous_container"] = _inspect(session, node, remote.previous_container_name(container))[0]
        if state is not None and state.exists and (not state.running or not fields.get("health_ok")):
            try:
                fields["warm_start"] = _warm_start(session, fleet, node)
            except RemoteError:
                pass
        return health.Observation(**fields)
    finally:
        side.join(HEALTH_TIMEOUT_S + METRICS_TIMEOUT_S + 5)


def _observation(fields: dict[str, Any], side: threading.Thread, http: dict[str, Any]) -> health.Observation:
    side.join(HEALTH_TIMEOUT_S + METRICS_TIMEOUT_S + 5)
    return health.Observation(**{**fields, **http})


@dataclass(frozen=True)
class NodeReport:
    observation: health.Observation
    verdict: health.NodeVerdict


def probe_and_judge(session: FleetSession, node: Node, *, bench: health.BenchHistory | None = None,
                    earlier: health.Observation | None = None,
                    clock: Callable[[], float] = time.time) -> NodeReport:
    try:
        obs = health.with_earlier(probe(session, node, bench=bench, clock=clock), earlier)
    except Exception as e:  # one node's surprise must not hide the others' verdicts
        obs = health.Observation(node=node.name, probed_at=clock(), ssh_ok=True, ssh_error=None)
        return NodeReport(obs, health.NodeVerdict(node.name, "unknown", (f"the probe failed: {first_line(e)[:300]}",),
                                                  health.ADVICE["unknown"]))
    return NodeReport(obs, health.judge(obs))


def sweep(session: FleetSession, nodes: Iterable[Node] | None = None, *,
          bench: Mapping[str, health.BenchHistory] | None = None,
          earlier: Mapping[str, health.Observation] | None = None,
          max_parallel: int = MAX_PARALLEL,
          clock: Callable[[], float] = time.time) -> dict[str, NodeReport]:
    """Probe and judge the nodes (default: every serve node) in parallel, in fleet order."""
    targets = list(nodes) if nodes is not None else session.fleet.serve_nodes
    if not targets:
        return {}
    bench, earlier = bench or {}, earlier or {}
    with ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(targets))),
                            thread_name_prefix="health-probe") as pool:
        futures = {n.name: pool.submit(probe_and_judge, session, n, bench=bench.get(n.name),
                                       earlier=earlier.get(n.name), clock=clock) for n in targets}
        return pairs_judged(session.fleet, {name: f.result() for name, f in futures.items()})


def pairs_judged(fleet: Fleet, reports: dict[str, NodeReport]) -> dict[str, NodeReport]:
    """A node pair that is on is judged as one engine (core.pair.judge_pair): its headless worker
    answers no /health of its own."""
    for p in fleet.pairs:
        if not p.enabled or p.head not in reports or p.worker not in reports:
            continue
        h, w = reports[p.head], reports[p.worker]

        def running(r: NodeReport) -> bool | None:
            c = r.observation.container
            return None if c is None else c.running

        hv, wv = pair_core.judge_pair(p, h.verdict, w.verdict, head_running=running(h), worker_running=running(w))
        reports[p.head], reports[p.worker] = NodeReport(h.observation, hv), NodeReport(w.observation, wv)
    return reports


def open_session(fleet: Fleet, logger: Any = None, base: SshSettings | None = None) -> FleetSession:
    """A FleetSession with the sweep's short timeouts (the caller closes it)."""
    return FleetSession(fleet, probe_settings(base), logger)
