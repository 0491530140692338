"""A node pair (Phase 4-alt, TP=2 over two nodes): its preflight verdicts, its diagnosis and its
bench against the runbook's figures, judged from observations (runbook/pair.py observes and acts).

What breaks TP=2 across two GB10s is the link and NCCL, rarely vLLM: a link that does not carry
jumbo frames (~3 GB/s instead of ~24), the master port taken or firewalled, the head started before
the worker or pointed at the wrong master address (the runbook's row "NCCL timeout on worker
connect"), two nodes on different images or checkpoints, and a pip NCCL of the validated version
but another build than the system's, which hangs every 20-26 minutes (vLLM issues 41725, 42354).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from spark_pipelines.core import diagnosis
from spark_pipelines.core.fleet import NodePair
from spark_pipelines.core.health import ADVICE, NodeVerdict
from spark_pipelines.core.preflight import Check, PreflightReport

# The runbook's figures: "TP=2 dual-node ... ~56 tok/s per-request"; "Two independent TP=1
# provides ~95 tok/s aggregate for 2 concurrent requests".
RUNBOOK_TP2_TOK_S = 56.0
RUNBOOK_TP1_PAIR_AGGREGATE_TOK_S = 95.0
# IPv4 + UDP headers: the link probe's datagram of (mtu - this) bytes fills one frame exactly.
IPV4_UDP_HEADERS, IPV6_UDP_HEADERS = 28, 48
# Why a pair's worker is never a gateway backend of its own (runbook.rotation.promotion says it).
WORKER_OUT = "the worker of node pair {pair} (headless, rank 1): the pair serves through its head {head}"

# What `plan` lists, in the order evaluate checks them.
CHECKS: tuple[tuple[str, str], ...] = (
    ("link", "the link answers between the two addresses with frames of its MTU, both ways"),
    ("master-port", "the master port is free on the head and reachable from the worker over the link"),
    ("image", "both nodes hold the same serving image id"),
    ("checkpoint", "both nodes serve the same checkpoint version"),
    ("nccl", "the NCCL the image loads is the validated one; a pip / system NCCL mismatch is named"),
    ("memory", "each node passes its own preflight and memory gate at its GMU (the deploy's per-node preflight)"),
)


@dataclass(frozen=True)
class LinkProbe:
    """The worker's probe of the head over the link (runbook/pair.py's LINK_PROBE script)."""

    udp_ok: bool  # a datagram filling the MTU went to the head and came back whole
    udp_error: str | None
    local_mtu: int | None  # the worker's path MTU toward the head, as the kernel has it
    tcp_ok: bool  # the master port on the head's link address accepted a connection
    tcp_error: str | None

    @classmethod
    def parse(cls, text: str) -> LinkProbe:
        d = _last_json(text)
        return cls(bool(d.get("udp_ok")), d.get("udp_error"), d.get("local_mtu"), bool(d.get("tcp_ok")),
                   d.get("tcp_error"))


@dataclass(frozen=True)
class MasterListen:
    """The head's side of the probe: could it listen on the master port, did the worker arrive."""

    listened: bool
    error: str | None
    echoed_mtu: bool  # it sent the worker's full-size datagram back
    error_kind: str | None = None  # "address": the head has no such address; "in-use": the port is taken
    held_by_pair: bool = False  # the port's holder is this pair's own head, running (a redeploy sets it aside)

    @classmethod
    def parse(cls, text: str, held_by_pair: bool = False) -> MasterListen:
        d = _last_json(text)
        return cls(bool(d.get("listened")), d.get("error"), bool(d.get("echoed")), d.get("error_kind"), held_by_pair)


@dataclass(frozen=True)
class NcclReport:
    """What the serving image loads (runbook/pair.py's NCCL_PROBE, run in the image on a node)."""

    loaded: str | None  # torch.cuda.nccl.version() as x.y.z
    pip: str | None  # the nvidia-nccl-cu* wheel's version, when installed
    pip_sha256: str | None  # its libnccl.so.2
    system: str | None  # the system libnccl.so.2's version (from its file name), when present
    system_sha256: str | None
    error: str | None = None

    @classmethod
    def parse(cls, text: str) -> NcclReport:
        d = _last_json(text)
        return cls(d.get("loaded"), d.get("pip"), d.get("pip_sha256"), d.get("system"), d.get("system_sha256"),
                   d.get("error"))


@dataclass(frozen=True)
class PairObservations:
    probe: LinkProbe | None  # None: the probe could not run (its error in `probe_error`)
    listen: MasterListen | None
    image_ids: dict[str, str | None]  # node -> image id of the serving image there
    checkpoints: dict[str, str | None]  # node -> manifest digest of the checkpoint its runbook path serves
    nccl: dict[str, NcclReport]  # node -> what its copy of the image loads
    probe_error: str | None = None


def _last_json(text: str) -> dict[str, Any]:
    for line in reversed(text.strip().splitlines()):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict):
            return d
    return {"error": f"no report in the probe's output: {text.strip()[-200:]!r}"}


def nccl_check(node: str, r: NcclReport, validated: str) -> Check:
    """The NCCL `node`'s image loads against the validated version; a pip wheel beside a system
    library is named when their versions or builds differ (the 20-26 minute hang)."""
    if r.error or r.loaded is None:
        return Check("nccl", "fail", f"{node}: the NCCL the image loads could not be read ({r.error or 'no version'})",
                     "run the image with `python3 -c 'import torch; print(torch.cuda.nccl.version())'` on the node")
    if r.pip and r.system and (r.pip != r.system or (r.pip_sha256 and r.system_sha256
                                                      and r.pip_sha256 != r.system_sha256)):
        what = (f"pip NCCL {r.pip} and system NCCL {r.system}" if r.pip != r.system else
                f"pip NCCL {r.pip} and system NCCL {r.system} are the same version but different builds "
                f"({r.pip_sha256[:12]} vs {r.system_sha256[:12]})")  # type: ignore[index]
        return Check("nccl", "fail", f"{node}: the image carries {what}; torch loads {r.loaded}",
                     "keep one NCCL in the image (remove the nvidia-nccl wheel or the system libnccl2, or pin both "
                     "to one build): mismatched NCCL builds hang TP=2 every 20-26 minutes (vLLM 41725, 42354)")
    if r.loaded != validated:
        return Check("nccl", "fail", f"{node}: the image loads NCCL {r.loaded}, not the validated {validated}",
                     f"rebuild the image on the runbook's NCCL {validated}, or set pairs[].nccl after validating "
                     "this build on the pair")
    return Check("nccl", "ok", f"{node}: NCCL {r.loaded} (validated)")


def evaluate(pair: NodePair, obs: PairObservations) -> PreflightReport:
    """The pair's own checks (each node's memory gate is the deploy's per-node preflight)."""
    checks: list[Check] = []
    link = pair.link
    mtu = link.mtu if link else 0
    fix_row = (f"check the cable and both ends' addresses ({link.head_address if link else '?'} on {pair.head}, "
               f"{link.worker_address if link else '?'} on {pair.worker}) and their MTU ({mtu}) on both interfaces")
    p, listen = obs.probe, obs.listen
    if p is None or listen is None:
        checks.append(Check("link", "fail", f"the link probe did not run: {obs.probe_error or 'no answer'}",
                            "check that python3 runs on both nodes, then the link"))
    elif listen.error_kind == "address":
        checks.append(Check("link", "fail", f"{pair.head} has no address {link.head_address if link else '?'} "
                                            f"(pairs[].link.head_address, the --master-addr): {listen.error}",
                            f"{diagnosis.PAIR_ROW} (runbook: 'NCCL timeout on worker connect (TP=2 only)')"))
    else:
        if p.udp_ok and listen.echoed_mtu:
            checks.append(Check("link", "ok", f"{pair.worker} -> {pair.head} and back with {mtu}-byte frames"))
        else:
            small = (f"; the worker's path MTU is {p.local_mtu}" if p.local_mtu and p.local_mtu < mtu else "")
            checks.append(Check("link", "fail", f"no {mtu}-byte frame crossed the link both ways "
                                                f"({p.udp_error or 'no echo'}{small})",
                                fix_row + ": a link at 1500 moves ~3 GB/s instead of ~24 (dgx-spark-playbooks 102)"))
        port = pair.master_port
        to = f"{link.head_address if link else '?'}:{port}"
        if not listen.listened and not listen.held_by_pair:
            checks.append(Check("master-port", "fail", f"port {port} is not free on {pair.head}: {listen.error}",
                                f"stop what listens on {port} there (a head left running?) or change pairs[].master_port"))
        elif listen.held_by_pair:  # its own worker joined it there: reachable, and free once set aside
            checks.append(Check("master-port", "ok", f"port {port} held by this pair's running head (set aside before "
                                                     "the launch)"))
        elif not p.tcp_ok:
            checks.append(Check("master-port", "fail", f"{pair.worker} cannot reach {to}: {p.tcp_error}",
                                f"{diagnosis.PAIR_ROW} (runbook: 'NCCL timeout on worker connect (TP=2 only)')"))
        else:
            checks.append(Check("master-port", "ok", f"port {port} free on {pair.head}, reachable from {pair.worker}"))
    ids = obs.image_ids
    if None in ids.values() or len(set(ids.values())) != 1:
        shown = ", ".join(f"{n}: {(i or 'missing')[7:19] or i}" for n, i in ids.items())
        checks.append(Check("image", "fail", f"the serving image differs between the nodes ({shown})",
                            "run node_artifacts for both nodes (one image, copied from the build host)"))
    else:
        checks.append(Check("image", "ok", f"image {next(iter(ids.values()))[7:19]} on both"))  # type: ignore[index]
    cps = obs.checkpoints
    if None in cps.values() or len(set(cps.values())) != 1:
        shown = ", ".join(f"{n}: {(d or 'unknown')[:12]}" for n, d in cps.items())
        checks.append(Check("checkpoint", "fail", f"the checkpoint version differs between the nodes ({shown})",
                            "run node_artifacts for both nodes, then deploy each once (the version is switched in)"))
    else:
        checks.append(Check("checkpoint", "ok", f"checkpoint version {next(iter(cps.values()))[:12]} on both"))  # type: ignore[index]
    for node, r in obs.nccl.items():
        checks.append(nccl_check(node, r, pair.nccl))
    return PreflightReport(node=f"pair {pair.name}", checks=checks)


# ------------------------------------------------------------------------- diagnosis


@dataclass(frozen=True)
class PairDiagnosis:
    findings: list[tuple[str, diagnosis.Finding]]  # (node, finding), the cause first
    headline: str  # "<cause> -> <fix> (runbook: ...)", or what is known without a signature


def diagnose(pair: NodePair, head_log: str, worker_log: str, *, worker_running: bool | None) -> PairDiagnosis:
    """Both ranks' logs as one diagnosis: the worker's failure to connect comes before the head's
    wait that it caused; a head that waited alone while no worker ran is the head started alone."""
    head = [(pair.head, f) for f in diagnosis.diagnose(head_log)]
    worker = [(pair.worker, f) for f in diagnosis.diagnose(worker_log)]
    order = {"pair-worker-never-connects": 0, "pair-head-alone": 1, "nccl-timeout": 2}
    found = sorted(worker + head, key=lambda nf: (order.get(nf[1].signature.id, 9), nf[1].line_number))
    if not found:
        return PairDiagnosis([], "no known failure signature matched; read both containers' logs")
    node, first = found[0]
    sig = first.signature
    cause = sig.cause
    if sig.id == "pair-head-alone" and worker_running:
        cause = (f"the head waited on --master-port and the worker, running on {pair.worker}, never joined: it "
                 "cannot reach the master address")
    elif sig.id == "pair-head-alone" and worker_running is False:
        cause = f"the head was started alone: no worker ran on {pair.worker}"
    return PairDiagnosis(found, f"{node}: {cause} -> {sig.fix} (runbook: {sig.runbook_ref})")


# ---------------------------------------------------------------------------- health


def pair_health(head_healthy: bool, worker_running: bool) -> tuple[bool, str]:
    """A pair serves only with both ranks: the worker down is the pair down."""
    if head_healthy and worker_running:
        return True, "the head answers /health and the worker runs"
    if not worker_running:
        return False, "the worker's container is not running: the pair is down (TP=2 needs both nodes)"
    return False, "the head does not answer /health"


# ----------------------------------------------------------------------------- bench


@dataclass(frozen=True)
class PairBench:
    """The pair's bench beside the runbook's TP=2 row and two TP=1 nodes at 2 streams."""

    pair_tok_s: float | None  # single stream (the recipe's mean)
    pair_two_streams_tok_s: float | None  # aggregate of 2 concurrent requests
    tp1_tok_s: dict[str, float] = field(default_factory=dict)  # each node's own TP=1 single-stream figure, if known

    @property
    def tp1_two_streams_tok_s(self) -> float:
        """Two independent TP=1 nodes at 2 streams: one stream each (measured when both are known,
        else the runbook's ~95)."""
        if len(self.tp1_tok_s) == 2:
            return sum(self.tp1_tok_s.values())
        return RUNBOOK_TP1_PAIR_AGGREGATE_TOK_S

    @property
    def better(self) -> str:
        """Which serves more at 2 streams (the runbook's decision: concurrent capacity)."""
        if self.pair_two_streams_tok_s is None:
            return "unknown"
        return "pair" if self.pair_two_streams_tok_s > self.tp1_two_streams_tok_s else "tp1"

    def lines(self) -> list[str]:
        tp1_src = (f"measured {' + '.join(f'{v:.1f}' for v in self.tp1_tok_s.values())}" if len(self.tp1_tok_s) == 2
                   else "the runbook's ~95")
        one = "-" if self.pair_tok_s is None else f"{self.pair_tok_s:.1f}"
        two = "-" if self.pair_two_streams_tok_s is None else f"{self.pair_two_streams_tok_s:.1f}"
        out = [f"pair, 1 stream: {one} tok/s (runbook TP=2 ~{RUNBOOK_TP2_TOK_S:.0f}"
               + (f": x{self.pair_tok_s / RUNBOOK_TP2_TOK_S:.2f})" if self.pair_tok_s else ")"),
               f"pair, 2 streams: {two} tok/s; two TP=1 nodes, 2 streams: {self.tp1_two_streams_tok_s:.1f} tok/s "
               f"({tp1_src})"]
        if self.better == "pair":
            out.append("the pair serves more at 2 streams than its two nodes at TP=1: keep the pair")
        elif self.better == "tp1":
            speed = (f"; the pair is x{self.pair_tok_s / (sum(self.tp1_tok_s.values()) / 2):.2f} per request"
                     if self.pair_tok_s and len(self.tp1_tok_s) == 2 else "")
            out.append(f"two TP=1 nodes serve x{self.tp1_two_streams_tok_s / self.pair_two_streams_tok_s:.2f} more at "  # type: ignore[operator]
                       f"2 streams{speed}: the runbook's choice (TP=1) stands unless single-request latency matters more")
        return out


def judge_pair(pair: NodePair, head: NodeVerdict, worker: NodeVerdict, *, head_running: bool | None,
               worker_running: bool | None) -> tuple[NodeVerdict, NodeVerdict]:
    """The health sweep's verdicts on a pair that is on, as one engine: the worker (headless) has
    no /health of its own and is healthy while its container runs and the head serves; a worker
    whose container stopped is the pair down, its head included (TP=2 needs both)."""
    if worker_running is False:
        why = f"the worker {pair.worker} of pair {pair.name} is not running: the pair is down (TP=2 needs both nodes)"
        if head.verdict in ("healthy", "starting"):
            head = NodeVerdict(head.node, "engine-down", (why, *head.evidence), ADVICE_PAIR_DOWN)
        return head, NodeVerdict(worker.node, worker.verdict, (why, *worker.evidence), ADVICE_PAIR_DOWN)
    if worker_running and head.verdict in ("healthy", "starting"):
        return head, NodeVerdict(worker.node, head.verdict, (
            f"rank 1 of pair {pair.name}: its container runs headless; the pair answers through its head {pair.head} "
            f"({head.verdict})",), ADVICE[head.verdict])
    if worker_running and head_running is not None:
        return head, NodeVerdict(worker.node, head.verdict, (
            f"rank 1 of pair {pair.name}: the pair's head {pair.head} is {head.verdict}", *head.evidence), head.advice)
    return head, worker


ADVICE_PAIR_DOWN = ("deploy the pair again (deploy_node_job for either node: the worker is launched first, then the "
                    "head); read both containers' logs: an NCCL timeout names the link or the master address")
