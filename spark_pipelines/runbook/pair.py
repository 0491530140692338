"""Phase 4-alt on a node pair: TP=2 over two nodes, as one transaction over both.

- preflight of the pair (nothing changed yet): the link carries frames of its MTU both ways, the
  master port is free on the head and reachable from the worker over the link, both nodes hold the
  same image id and checkpoint version, the image loads the validated NCCL (a pip / system NCCL
  mismatch named). core/pair.py judges; the scripts here only observe.
- the deploy holds both nodes' leases for the whole pair and drains both from the gateway, then runs
  runbook/transaction.py's transaction once per node: the worker (rank 1) first, set aside, per-node
  preflight and memory gate at its GMU, launched, until its headless milestone (the runbook sleeps
  ~15 s and reads the log); then the head (rank 0), until vLLM's startup line, /health and the smoke
  test; the worker still running. Then both commit; the head is the pair's one gateway backend, the
  worker stays out (headless: it serves nothing itself). Any failure, a terminated run included,
  rolls both back (head first) to what they served before, with the pair's diagnosis of both logs.
  Each node keeps its own deploy journal: a run that dies mid-way is finished by the next run that
  takes that node's lease, as a single node's deploy is.
- separate: the pair turned off again; its head leaves the gateway (requests in flight end), then
  each node is deployed at TP=1 by runbook.deploy and put back.
- bench: the pair's head at 1 and 2 streams, beside the runbook's TP=2 row and two TP=1 nodes.
"""

from __future__ import annotations

import posixpath
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core import pair as core
from spark_pipelines.core.errors import DeployFailed, RunbookError, first_line
from spark_pipelines.core.fleet import Node, NodePair
from spark_pipelines.core.launch import DEPLOY_LABEL, IMAGE_LABEL, LaunchSpec, launch_spec
from spark_pipelines.core.pair_launch import PairLaunch, pair_launch
from spark_pipelines.core.preflight import PreflightReport
from spark_pipelines.resources import engine, lease
from spark_pipelines.resources.docker import NodeDocker, container_labels
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook import deploy, preflight, versions
from spark_pipelines.runbook.rotation import Drain, drained, put_back
from spark_pipelines.runbook.transaction import (Deployed, NotServing, Transaction, TransactionJournal,
                                                 launch_and_wait)

# vLLM's headless worker, once its executor starts: "Launching vLLM (v...) headless multiproc
# executor, with head node address ADDR:PORT for torch.distributed process group." It then waits
# for the head: the runbook's "Waiting 15s for init" is this line's time.
WORKER_MILESTONE = "headless multiproc executor"
PROBE_S = 15  # the link probe's listener on the head stays this long; the worker's tries within it

# The head's side of the link probe: listen on the master port as torch's store does (every
# address), and on the link address for the MTU echo; report, then exit.
LINK_LISTEN = r"""
import json, socket, sys, time
addr, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
v6 = ":" in addr
fam = socket.AF_INET6 if v6 else socket.AF_INET
out = {"listened": False, "error": None, "error_kind": None, "echoed": False}
try:
    u = socket.socket(fam, socket.SOCK_DGRAM)
    u.bind((addr, port))
    u.setsockopt(socket.IPPROTO_IPV6 if v6 else socket.IPPROTO_IP, 23 if v6 else 10, 2)  # never fragment
except OSError as e:
    out.update(error="%s: %s" % (addr, e.strerror or e), error_kind="address")
    print(json.dumps(out)); sys.exit(0)
t = None
try:
    t = socket.socket(fam, socket.SOCK_STREAM)
    # As torch's store: else a probe connection in TIME_WAIT here keeps the head's store off the port
    # for a minute (EADDRINUSE). A listening socket still holds it: a head left running is seen.
    t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    t.bind(("::" if v6 else "0.0.0.0", port))
    t.listen(4)
    t.settimeout(0.2)
    out["listened"] = True
except OSError as e:  # the echo still runs: the link is judged apart from the port
    out.update(error="port %d: %s" % (port, e.strerror or e), error_kind="in-use")
    t = None
u.settimeout(0.2)
end, accepted = time.monotonic() + seconds, t is None
while time.monotonic() < end and not (accepted and out["echoed"]):
    try:
        if t is not None:
            c, _ = t.accept(); accepted = True
            c.settimeout(1.0)  # the worker closes first: its side keeps the TIME_WAIT
            try:
                c.recv(1)
            except OSError:
                pass
            c.close()
    except OSError:
        pass
    try:
        data, peer = u.recvfrom(65535)
        u.sendto(data, peer)
        out["echoed"] = True
    except socket.timeout:
        pass
    except OSError as e:
        out["error"] = "echo: %s" % (e.strerror or e)
print(json.dumps(out))
"""
# The worker's side: a datagram filling the link's MTU (never fragmented) to the head and back, and
# a TCP connection to the master port, each tried until the listener answers.
LINK_PROBE = r"""
import json, socket, sys, time
addr, port, mtu, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
v6 = ":" in addr
fam = socket.AF_INET6 if v6 else socket.AF_INET
size = mtu - (48 if v6 else 28)
out = {"udp_ok": False, "udp_error": None, "local_mtu": None, "tcp_ok": False, "tcp_error": None}
end = time.monotonic() + seconds
u = socket.socket(fam, socket.SOCK_DGRAM)
u.settimeout(0.5)
try:
    u.setsockopt(socket.IPPROTO_IPV6 if v6 else socket.IPPROTO_IP, 23 if v6 else 10, 2)
    u.connect((addr, port))
    out["local_mtu"] = u.getsockopt(socket.IPPROTO_IPV6 if v6 else socket.IPPROTO_IP, 24 if v6 else 14)
except OSError as e:
    out["udp_error"] = "%s: %s" % (addr, e.strerror or e)
while out["local_mtu"] and not out["udp_ok"] and time.monotonic() < end:
    try:
        u.send(b"\0" * size)
    except OSError as e:
        out["udp_error"] = "a %d-byte datagram cannot leave: %s" % (size, e.strerror or e)
        break
    try:
        out["udp_ok"] = len(u.recv(65535)) == size
    except OSError as e:
        out["udp_error"] = "no echo of a %d-byte datagram (%s)" % (size, e.strerror or "timed out")
        time.sleep(0.2)
while not out["tcp_ok"] and time.monotonic() < end:
    try:
        socket.create_connection((addr, port), timeout=1).close()
        out["tcp_ok"], out["tcp_error"] = True, None
    except OSError as e:
        out["tcp_error"] = e.strerror or str(e)
        time.sleep(0.3)
print(json.dumps(out))
"""
# Run in the serving image: the NCCL torch loads, and the pip and system libraries beside it.
NCCL_PROBE = r"""
import glob, hashlib, json, os, re
out = {"loaded": None, "pip": None, "pip_sha256": None, "system": None, "system_sha256": None, "error": None}
def sha(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()
try:
    import torch
    v = torch.cuda.nccl.version()
    out["loaded"] = ".".join(str(x) for x in v) if isinstance(v, (tuple, list)) else "%d.%d.%d" % (
        v // 10000, v // 100 % 100, v % 100) if v >= 10000 else "%d.%d.%d" % (v // 1000, v // 100 % 10, v % 100)
except Exception as e:
    out["error"] = "%s: %s" % (type(e).__name__, e)
try:
    from importlib import metadata
    for d in metadata.distributions():
        if (d.metadata["Name"] or "").lower().startswith("nvidia-nccl"):
            out["pip"] = d.version
            for f in d.files or []:
                if str(f).endswith("libnccl.so.2"):
                    out["pip_sha256"] = sha(d.locate_file(f))
except Exception:
    pass
for p in sorted(glob.glob("/usr/lib/*/libnccl.so.2*") + glob.glob("/usr/lib/libnccl.so.2*")
                + glob.glob("/usr/local/cuda*/lib*/libnccl.so.2*")):
    m = re.search(r"libnccl\.so\.(\d+\.\d+\.\d+)$", os.path.realpath(p))
    if m:
        out["system"], out["system_sha256"] = m.group(1), sha(os.path.realpath(p))
        break
print(json.dumps(out))
"""


def _python(session: FleetSession, node: str, script: str, args: list[str], timeout: float) -> str:
    r = session.run(node, ["python3", "-c", script, *args], check=False, log=False, timeout=timeout)
    return r.stdout if r.stdout.strip() else (r.stderr or r.tail or f"exit {r.exit_status}")


def observe(session: FleetSession, pair: NodePair, launch: PairLaunch) -> core.PairObservations:
    """Read-only (a listener on the head for PROBE_S at most): what the pair's preflight judges."""
    docker = NodeDocker(session)
    image = launch.head.image
    nodes = (pair.worker, pair.head)
    ids = {n: docker.image_id(n, image) for n in nodes}
    checkpoints = {n: versions.serving_digest(session, session.fleet.node(n)) for n in nodes}
    nccl = {}
    for n in nodes:
        if ids[n] is None:
            nccl[n] = core.NcclReport(None, None, None, None, None, f"no image {image} on {n}")
            continue
        out = session.run(n, ["docker", "run", "--rm", "--entrypoint", "python3", image, "-c", NCCL_PROBE],
                    check=False, log=False, timeout=300)
        nccl[n] = core.NcclReport.parse(out.stdout or out.tail)
    link = pair.link
    if link is None:
        return core.PairObservations(None, None, ids, checkpoints, nccl, probe_error="the pair has no link")
    heard: dict[str, str] = {}

    def listen() -> None:
        try:
            heard["out"] = _python(session, pair.head, LINK_LISTEN, [link.head_address, str(pair.master_port), str(PROBE_S)],
                                   timeout=PROBE_S + 30)
        except Exception as e:  # reported as the probe's error
            heard["error"] = first_line(e)

    listener = threading.Thread(target=listen, daemon=True, name=f"pair-{pair.name}-listen")
    listener.start()
    probe = _python(session, pair.worker, LINK_PROBE,
                    [link.head_address, str(pair.master_port), str(link.mtu), str(PROBE_S - 3)], timeout=PROBE_S + 30)
    listener.join(PROBE_S + 40)
    if "error" in heard or "out" not in heard:
        return core.PairObservations(None, None, ids, checkpoints, nccl,
                                     probe_error=heard.get("error", "the head's listener did not answer"))
    live = docker.inspect_container(pair.head, launch.head.container_name)
    ours = bool(live and live.get("State", {}).get("Running")
                and container_labels(live).get(DEPLOY_LABEL) == launch.head.fingerprint)
    return core.PairObservations(core.LinkProbe.parse(probe), core.MasterListen.parse(heard["out"], held_by_pair=ours),
                                 ids, checkpoints, nccl)


def preflight_pair(session: FleetSession, pair: NodePair, launch: PairLaunch | None = None) -> PreflightReport:
    return core.evaluate(pair, observe(session, pair, launch or pair_launch(session.fleet, pair)))


@dataclass
class PairDeployed:
    pair: str
    head_container_id: str
    worker_container_id: str
    preflight: str  # the pair's report, then each node's
    smoke_tokens: int
    seconds: float
    specs: dict[str, LaunchSpec] = field(default_factory=dict)  # node -> as launched (labels included)


def _refuse_off(pair: NodePair) -> None:
    if not pair.enabled or pair.link is None:
        raise DeployFailed(f"node pair {pair.name} is off ({pair.reason or 'enabled: false'}); nothing was changed: "
                           "turn it on in the fleet file (pairs[].enabled: true, with its link) first")


def pair_serves(session: FleetSession, pair: NodePair) -> tuple[bool, dict[str, dict[str, Any] | None]]:
    """(the pair serves as deployed: both nodes run its launch, labelled so, and the head answers
    /health; each node's container as docker inspects it, None when absent). A pair that serves
    is left as it is by node_deployment."""
    fleet = session.fleet
    launch = pair_launch(fleet, pair)
    docker = NodeDocker(session)
    live = {name: docker.inspect_container(name, spec.container_name)
            for name, spec in ((pair.head, launch.head), (pair.worker, launch.worker))}
    serving = (all(c is not None and c.get("State", {}).get("Running") for c in live.values())
               and container_labels(live[pair.head]).get(DEPLOY_LABEL) == launch.head.fingerprint
               and container_labels(live[pair.worker]).get(DEPLOY_LABEL) == launch.worker.fingerprint
               and engine.healthy(fleet, fleet.node(pair.head)))
    return serving, live


def deploy_pair(session: FleetSession, pair: NodePair, log: Any, *, run_id: str = "") -> PairDeployed:
    """The pair's deploy as one transaction over both nodes (module doc). Raises DeployFailed with
    the pair's diagnosis and what the rollback left; NodeBusy when a run holds either node."""
    _refuse_off(pair)
    fleet = session.fleet
    launch = pair_launch(fleet, pair)
    head, worker = fleet.node(pair.head), fleet.node(pair.worker)
    purpose = f"pair {pair.name} deploy"
    with node_lease(session, worker.name, purpose, run_id=run_id), node_lease(session, head.name, purpose, run_id=run_id):
        for n in (worker, head):
            deploy.finish_interrupted(session, n, log, run_id=run_id)
        report = preflight_pair(session, pair, launch)
        log.info(report.explain())
        if not report.passed:
            raise DeployFailed(f"pair {pair.name}: preflight blocked, nothing was changed: " + "; ".join(
                f"{c.name}: {c.detail} -> {c.fix}" for c in report.failures()), {"preflight": report.explain()})
        gw = deploy.gateway_of(session, head)
        reason = f"{gateway_core.DEPLOY_DRAIN} pair {pair.name} (run {run_id[:8] or '-'})"
        journals = {n.name: TransactionJournal.begin(session, n, spec, run_id, keep_previous=False,
                                                 drain_reason=reason if gw is not None else None)
                    for n, spec in ((worker, launch.worker), (head, launch.head))}
        try:
            with ExitStack() as stack:
                drains: dict[str, Drain] = {}
                if gw is not None:
                    # The head first: the node clients reach. One deploy for rollout.max_unavailable.
                    for n, first in ((head, True), (worker, False)):
                        dead = not engine.healthy(fleet, n)
                        drains[n.name] = stack.enter_context(drained(
                            gw, n.name, reason=reason, wait_s=fleet.rollout.deploy_wait_s, dead=dead,
                            deploying=first and not dead))
                done = _transaction(session, pair, launch, log, journals, drains, report.explain())
                if worker.name in drains:
                    drains[worker.name].keep_out = True  # headless: the pair serves through its head
                return done
        finally:
            for j in journals.values():
                j.end()


def _transaction(session: FleetSession, pair: NodePair, launch: PairLaunch, log: Any, journals: dict[str, Any],
                 drains: dict[str, Drain], pair_report: str) -> PairDeployed:
    fleet = session.fleet
    started = time.monotonic()
    txns: list[Any] = []  # Transaction, in launch order
    reports = [pair_report]
    logs: dict[str, str] = {}
    try:
        try:
            ids = _launch_both(session, pair, launch, log, journals, drains, txns, reports, logs)
            smoke = engine.smoke_test(fleet, fleet.node(pair.head))
        except BaseException as e:
            _roll_back(session, pair, txns, e, logs, log)  # raises
        for txn in txns:  # verified on both nodes: each drops what it set aside
            txn.commit()
            txn.journal.try_update(phase="ending", outcome="committed")
    finally:
        for txn in txns:  # after the commit or the rollback: the serving vLLM claims its memory first
            txn.restore_exporters()
    return PairDeployed(pair.name, ids[pair.head], ids[pair.worker], "\n".join(reports),
                        int(smoke.get("completion_tokens", 0)), round(time.monotonic() - started, 1),
                        {t.node.name: t.spec for t in txns})


def _launch_both(session: FleetSession, pair: NodePair, launch: PairLaunch, log: Any, journals: dict[str, Any],
                 drains: dict[str, Drain], txns: list[Any], reports: list[str], logs: dict[str, str]) -> dict[str, str]:
    """Both nodes set aside and through their own preflight and memory gate first, then the worker
    launched, then the head right after its milestone (each transaction added to `txns` as it
    starts: the rollback's list); returns node -> the container verified there."""
    fleet = session.fleet
    docker = NodeDocker(session)
    for node_name, spec in ((pair.worker, launch.worker), (pair.head, launch.head)):
        n = fleet.node(node_name)
        image_id = docker.image_id(n.name, spec.image)
        if image_id is None:
            raise NotServing(f"image {spec.image} is gone from {n.name}", {})
        spec = deploy.labelled(spec, image_id, None, deploy.version_to_launch(session, n, None))
        txn = Transaction(session, n, spec, log, drains.get(n.name))
        txn.journal = journals[n.name]
        txn.journal.update(new_fingerprint=spec.fingerprint, new_image_id=image_id)
        txns.append(txn)
        txn.set_aside()
        txn.prepare()
        assert txn.prepared is not None
        rep = preflight.evaluate(session, n, preflight.observe(session, n, spec.image, txn.prepared), spec.gpu_memory_utilization)
        reports.append(rep.explain())
        if not rep.passed:
            raise NotServing(f"preflight blocked {n.name}: " + "; ".join(
                f"{c.name}: {c.detail} -> {c.fix}" for c in rep.failures()), {"preflight": rep.explain()})
        if spec.model_source:
            txn.point_checkpoint(posixpath.basename(spec.model_source))
    worker_txn, head_txn = txns
    _launch_worker(session, pair, worker_txn.node, worker_txn.spec, logs)
    _launch_head(session, pair, head_txn.node, head_txn.spec, logs)
    ids = {}
    for txn in txns:  # the worker too, once the head came up: a worker that went is a pair that is down
        live = docker.inspect_container(txn.node.name, txn.spec.container_name) or {}
        if not live.get("State", {}).get("Running") or live.get("Image") != txn.spec.labels.get(IMAGE_LABEL):
            raise NotServing(f"{txn.node.name}'s pair container is not running the image it was launched "
                                    "with after the head came up", {})
        ids[txn.node.name] = str(live.get("Id", ""))
        txn.note(phase="committing", new_container_id=ids[txn.node.name])
    return ids


def _launch_worker(session: FleetSession, pair: NodePair, n: Node, spec: LaunchSpec, logs: dict[str, str]) -> None:
    docker = NodeDocker(session)
    session.run(n.name, ["mkdir", "-p", *spec.host_dirs], log=False, timeout=60)
    docker.run_container(n.name, spec.docker_run_argv())
    watch = docker.follow_logs(n.name, spec.container_name, until=lambda line: WORKER_MILESTONE in line,
                               timeout=pair.worker_ready_s)
    if not watch.matched:
        logs[n.name] = docker.logs(n.name, spec.container_name, tail="all")
        how = "its container exited" if watch.ended else f"within {pair.worker_ready_s} s (pairs[].worker_ready_s)"
        raise NotServing(f"the worker {n.name} did not reach its headless milestone: {how}", {})
    session.log.info(f"[{n.name}] worker (rank 1) up: {watch.matched.strip()[:160]}; launching the head {pair.head}")


def _launch_head(session: FleetSession, pair: NodePair, n: Node, spec: LaunchSpec, logs: dict[str, str]) -> None:
    ok, log_text, _ = launch_and_wait(session, n, spec, session.fleet.launch_for(n).health_timeout_s)
    logs[n.name] = log_text
    if not ok:
        raise NotServing(f"the head {n.name} did not become healthy", {})


def _roll_back(session: FleetSession, pair: NodePair, txns: list[Any], cause: BaseException, logs: dict[str, str],
               log: Any) -> None:
    """Both nodes back to what they served before (head first), with the pair's diagnosis; raises."""
    docker = NodeDocker(session)
    for txn in txns:  # both logs before the rollback removes the containers
        if txn.node.name not in logs:
            try:
                logs[txn.node.name] = docker.logs(txn.node.name, txn.spec.container_name, tail="all")
            except Exception:  # noqa: BLE001 - a log not read is a diagnosis not made, never a stop
                logs[txn.node.name] = ""
    worker_running = None
    if any(t.node.name == pair.worker for t in txns):
        try:
            live = docker.inspect_container(pair.worker, txns[0].spec.container_name)
            worker_running = bool(live and live.get("State", {}).get("Running"))
        except Exception:  # noqa: BLE001
            pass
    diag = core.diagnose(pair, logs.get(pair.head, ""), logs.get(pair.worker, ""), worker_running=worker_running)
    gone = [t.node.name for t in txns if lease.lost(session, t.node.name) is not None]
    why = cause.description if isinstance(cause, RunbookError) else f"failed: {first_line(cause)}"
    why = f"pair {pair.name}: {why}"
    outcomes: list[str] = []
    for txn in reversed(txns):
        n = txn.node.name
        if n in gone:
            txn.prepared = None  # the next holder of its lease finishes its journal, exporters included
            outcomes.append(f"{n}: its lease ended under this run: nothing rolled back there (the next run does)")
            continue
        log.warning(f"[{n}] {why}; rolling back")
        if txn.journal.phase != "draining":
            txn.journal.try_update(phase="rolling-back")
        back, outcome = txn.roll_back()
        if not back:
            outcome += "; " + txn.take_out_of_gateway(f"{why}; {outcome}")
        txn.journal.try_update(phase="ending", outcome=outcome)
        outcomes.append(outcome)
    done = "; ".join(outcomes) or "nothing had changed on either node"
    details = {"diagnosis": "\n".join(f"- {node}: **{f.signature.id}** line {f.line_number}: `{f.line.strip()[:200]}`"
                                      for node, f in diag.findings) or diag.headline,
               **{f"log_tail_{node}": "```\n" + "\n".join(text.splitlines()[-30:]) + "\n```"
                  for node, text in logs.items()}}
    if not isinstance(cause, Exception):
        log.warning(f"pair {pair.name}: interrupted ({type(cause).__name__}); {done}")
        raise cause
    raise DeployFailed(f"{why}; {done}. Diagnosis: {diag.headline}", details) from (
        None if isinstance(cause, RunbookError) else cause)


# ----------------------------------------------------------------- the pair turned off again


def separate(session: FleetSession, pair: NodePair, log: Any, *, run_id: str = "") -> list[Deployed]:
    """Both nodes back to TP=1 serving, each its own gateway backend again. The head leaves the
    gateway first and its requests in flight end (nothing a client sent fails); then each node is
    deployed at its own launch (runbook.deploy) and put back. Holds both leases throughout."""
    fleet = session.fleet
    head, worker = fleet.node(pair.head), fleet.node(pair.worker)
    purpose = f"pair {pair.name} off"
    with node_lease(session, worker.name, purpose, run_id=run_id), node_lease(session, head.name, purpose, run_id=run_id):
        gw = deploy.gateway_of(session, head)
        done: list[Deployed] = []
        with ExitStack() as stack:
            if gw is not None:
                stack.enter_context(drained(gw, head.name, reason=f"pair {pair.name} off (run {run_id[:8] or '-'})",
                                            wait_s=fleet.rollout.deploy_wait_s, dead=not engine.healthy(fleet, head)))
            for n in (worker, head):  # the worker's container going takes the (drained) head down with it
                done.append(deploy.deploy(session, n, launch_spec(fleet, n), log, run_id=run_id))
                if gw is not None and n is worker:
                    put_back(gw, n.name)
        return done




# ------------------------------------------------------------------------------------ bench


def bench_pair(session: FleetSession, pair: NodePair, log: Any, *, tp1_tok_s: dict[str, float] | None = None,
               repeats: int | None = None) -> tuple[core.PairBench, Any]:
    """The pair's head at 1 stream (the recipe's five prompts) and 2 streams (two requests at
    once), drained from the gateway (its requests in flight end first, as every bench), then put
    back. `tp1_tok_s`: each node's own TP=1 single-stream figure (its latest bench), when known."""
    from spark_pipelines.resources.bench_client import run_bench

    fleet = session.fleet
    head = fleet.node(pair.head)
    gw = deploy.gateway_of(session, head)
    with ExitStack() as stack:
        if gw is not None:
            stack.enter_context(drained(gw, head.name, reason=f"bench pair {pair.name}", idle=True))
        report = run_bench(f"{engine.api_root(fleet, head)}/v1", fleet.launch_for(head).served_model_name, suite="all",
                           concurrency=2, loaded_requests=2, repeats=repeats or fleet.bench.repeats,
                           ignore_eos=fleet.bench.force_output_length, max_s=fleet.health.bench_max_s,
                           reference_mean_tok_s=core.RUNBOOK_TP2_TOK_S)
    single = report.recipe_mean_tok_s
    loaded = next((p.aggregate_tok_s for p in report.phases if p.concurrency == 2), None)
    result = core.PairBench(single.median if single else None, loaded.median if loaded else None, dict(tp1_tok_s or {}))
    for line in result.lines():
        log.info(f"pair {pair.name}: {line}")
    return result, report
