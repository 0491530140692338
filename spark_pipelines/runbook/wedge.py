"""The PD-firmware wedge on one node (runbook "Known Firmware Issues"): quarantine, the pre-drain
evidence, the AC cold drain and the post-drain validation. Framework-free; `core.wedge` judges.

- `quarantine_node`: the node's quarantine in the ledger, then out of every pool (the gateway step
  keeps it out until the quarantine is lifted).
- `capture_evidence`: BEFORE anything else changes the state, every reading the runbook's capture
  script takes (full `nvidia-smi -q`, clocks, power, throttle reasons, the SW power-cap counter, the
  clock-lock-ignored test under load, kernel log, BIOS string, container log), packed into a tarball
  stored off-node on the build host under a dated folder, with its manifest. The clock lock has its
  undo (`-rgc`) in a finally, on every path.
- `cold_drain`: docker stop (the container is kept), `sudo poweroff`, AC off at the wall (a smart plug
  from the fleet file, or the operator), boot, nvidia-persistenced, docker start, /health.
- `validate`: a post-drain capture and a bench against the node's floor -> WEDGE RESOLVED (back to
  serving, hold-out lifted) or WEDGE PERSISTS (stays out, the runbook's next step).
"""

from __future__ import annotations

import io
import socket
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from spark_pipelines.core import gpu
from spark_pipelines.core import wedge as wedge_core
from spark_pipelines.core.diagnosis import METRIC_RUNNING
from spark_pipelines.core.fleet import Node
from spark_pipelines.core.fleet_settings import SmartPlug
from spark_pipelines.core.polling import poll_until
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession, RemoteError
from spark_pipelines.resources import engine
from spark_pipelines.core import steps as steps_
from spark_pipelines.resources.lease import NodeBusy, node_lease
from spark_pipelines.runbook import journal, quarantine, rotation
from spark_pipelines.state import ledger
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.runbook.preflight import GPU_QUERY

WEDGED = "wedged"  # the verdict a quarantine records (core.health's name)
EVIDENCE_TIMEOUT_S = 60.0  # each evidence command: a read, seconds
STORE_TIMEOUT_S = 120.0
LOAD_STREAMS = 4
LOAD_MAX_TOKENS = 512
LOAD_REQUEST_TIMEOUT_S = 120.0
LOAD_REACH_S = 60.0  # until vLLM reports a request running
SAMPLES = 3
SAMPLE_EVERY_S = 2.0
LOG_TAIL = 2000
QUERY_FIELDS = ("name,utilization.gpu,clocks.current.sm,clocks.max.sm,power.draw,clocks_event_reasons.active,"
                "clocks_event_reasons_counters.sw_power_cap,pstate,persistence_mode")
PERSISTENCED_WAIT_S = 120.0
SSH_PROBE_S = 3.0


# ------------------------------------------------------------------------------ quarantine


def quarantine_node(session: FleetSession, node: Node, verdict: str, reason: str, gw: GatewayHost | None = None) -> str:
    """The node's quarantine in the ledger (the gateway step keeps it out until `lift_quarantine`),
    then out of every pool. A drain that would leave fewer than gateway.min_in_rotation nodes is
    refused (a wedged node still serves, slowly): the quarantine stays recorded and the refusal
    is said. Returns what was done, one line."""
    try:
        done = quarantine.quarantine(session, node, verdict, reason, by="wedge_watch", gw=gw)
    except RunbookError as e:
        return f"{node.name} could NOT be quarantined ({e})"
    return f"{done.note} (quarantined: {verdict})"


def lift_quarantine(session: FleetSession, node: Node, reason: str, gw: GatewayHost, **facts: Any) -> None:
    """The quarantine ends (the cold drain's validation proved the wedge over) and the node is
    back in every pool (never refused)."""
    ledger.end_quarantine(session, node.name)
    session.log.info(f"[{node.name}] quarantine lifted: {reason}" + "".join(f"; {k} {v}" for k, v in facts.items()))
    rotation.admit(gw, node.name)


def in_rotation(gw: GatewayHost, node: Node) -> bool:
    return node.name in gw.rotation()


# ---------------------------------------------------------------------------- the load


class SustainedLoad:
    """Inference load straight at the node's vLLM (it is out of the gateway): the wedge only shows
    under load. Threads, every request bounded; stopped on exit."""

    def __init__(self, session: FleetSession, node: Node, streams: int = LOAD_STREAMS) -> None:
        fleet = session.fleet
        self._fleet, self._node = fleet, node
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name=f"wedge-load-{node.name}-{i}", daemon=True)
                         for i in range(streams)]
        self.errors: list[str] = []

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                engine.complete(self._fleet, self._node, "Write a long story about a lighthouse keeper.",
                                LOAD_MAX_TOKENS, timeout=LOAD_REQUEST_TIMEOUT_S)
            except engine.EngineError as e:
                self.errors.append(first_line(e))
                self._stop.wait(1.0)

    def __enter__(self) -> SustainedLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=LOAD_REQUEST_TIMEOUT_S + 5)

    def reached(self, timeout_s: float = LOAD_REACH_S) -> bool:
        def running() -> float:
            m = engine.engine_metrics(self._fleet, self._node, timeout=5)
            return 0.0 if m is None else m.get(METRIC_RUNNING, 0.0)

        return poll_until(running, lambda r: r > 0, timeout_s=timeout_s, every_s=0.5).done


LoadFactory = Callable[[FleetSession, Node], Any]  # -> a context manager with .reached() and .errors


# ----------------------------------------------------------------------------- evidence


@dataclass
class Capture:
    """One evidence tarball on the build host, and what its readings say."""

    node: str
    label: str
    host: str  # the build host it is stored on
    path: str  # absolute, on `host`
    sha256: str
    size: int
    manifest: list[wedge_core.ManifestEntry]
    evidence: wedge_core.EvidenceVerdict
    under_load: list[gpu.GpuReading] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class _Evidence:
    """The files of one capture, each command's output as it came (stderr appended)."""

    def __init__(self, session: FleetSession, node: Node) -> None:
        self.s, self.node = session, node
        self.files: dict[str, bytes] = {}
        self.commands: list[str] = []

    def take(self, name: str | None, argv: list[str], *, sudo: bool = False,
             timeout: float = EVIDENCE_TIMEOUT_S) -> Any:
        r = self.s.run(self.node.name, argv, sudo=sudo, check=False, log=False, timeout=timeout)
        self.commands.append(f"{datetime.now(UTC):%H:%M:%SZ} exit {r.exit_status} {r.seconds:.1f}s $ {r.command}")
        if name is not None:
            text = r.stdout + (f"\n--- stderr ---\n{r.stderr}" if r.stderr.strip() else "")
            self.add(name, text if text.strip() else f"(no output, exit {r.exit_status})\n", append=True)
        return r

    def add(self, name: str, text: str, append: bool = False) -> None:
        old = self.files.get(name, b"") if append else b""
        self.files[name] = old + text.encode()

    def gpu_samples(self, name: str, n: int = SAMPLES, every_s: float = SAMPLE_EVERY_S) -> list[gpu.GpuReading]:
        """`n` reads of the signature fields (`-q -d PERFORMANCE,CLOCK,POWER,UTILIZATION` + the CSV)."""
        out: list[gpu.GpuReading] = []
        for i in range(n):
            if i:
                time.sleep(every_s)
            q = self.take(f"{name}-{i + 1}.txt", list(GPU_QUERY))
            csv = self.take(f"{name}.csv", ["nvidia-smi", f"--query-gpu={QUERY_FIELDS}", "--format=csv"])
            try:
                reading = gpu.parse_reading(q.stdout)
                if csv.ok:
                    reading = reading.combined_with(gpu.parse_reading(csv.stdout))
                out.append(reading)
            except gpu.GpuFormatError as e:
                self.add(f"{name}-{i + 1}.txt", f"\n(unreadable: {e})\n", append=True)
        return out


def _reset_clocks(ev: _Evidence, persistence_was_off: bool) -> list[str]:
    """The lock test's undo: `-rgc`, and persistence mode back off if it was off. Returns failures."""
    failed = []
    for argv in (["nvidia-smi", "-rgc"], *([["nvidia-smi", "-pm", "0"]] if persistence_was_off else [])):
        try:
            r = ev.take("lock-test.txt", argv, sudo=True)
            if not r.ok:
                failed.append(f"`sudo {' '.join(argv)}` exited {r.exit_status}: {(r.stderr or r.stdout).strip()[:160]}")
        except RemoteError as e:
            failed.append(f"`sudo {' '.join(argv)}` failed: {first_line(e)}")
    return failed


def _lock_test(ev: _Evidence, persistence_on: bool | None) -> tuple[wedge_core.LockVerdict, list[gpu.GpuReading]]:
    """`sudo nvidia-smi -pm 1; sudo nvidia-smi -lgc 2418,3003`, read clocks under load, `-rgc`: the
    reset runs in every outcome, a failure or a terminated run included."""
    lo, hi = wedge_core.LOCK_CLOCKS_MHZ
    pm_set = False
    ok = True
    try:
        if persistence_on is False:
            pm_set = True  # set below; undone in finally even if the command's answer is lost
            ev.take("lock-test.txt", ["nvidia-smi", "-pm", "1"], sudo=True)
        r = ev.take("lock-test.txt", ["nvidia-smi", "-lgc", f"{lo},{hi}"], sudo=True)
        readings = ev.gpu_samples("nvidia-smi-locked-load")
        verdict = wedge_core.judge_lock_test(r.ok, readings, refusal=(r.stderr or r.stdout).strip()[:200])
    except BaseException:
        ok = False
        raise
    finally:
        failed = _reset_clocks(ev, pm_set)
        if failed:
            ev.add("lock-test.txt", "\nUNDO FAILED: " + "; ".join(failed) + "\n", append=True)
            ev.s.log.warning(f"[{ev.node.name}] the clock lock was NOT reset: {'; '.join(failed)}; "
                             f"run `sudo nvidia-smi -rgc` on {ev.node.name}")
            if ok:
                raise RunbookError(f"{ev.node.name}: the clock-lock test's undo failed ({failed[0]}); run "
                                   f"`sudo nvidia-smi -rgc` on {ev.node.name} by hand")
    ev.add("lock-test.txt", f"\nverdict: {verdict.state}: {verdict.reason}\n", append=True)
    return verdict, readings


def capture_evidence(session: FleetSession, node: Node, *, label: str = "pre-drain",
                     load: LoadFactory = SustainedLoad, now: datetime | None = None) -> Capture:
    """The runbook's pre-drain capture (see the module doc); `load` drives the inference load
    (default: requests straight to the node's vLLM). Raises RemoteError when the node does not
    answer, RunbookError when the tarball cannot be stored."""
    f, n = session.fleet, node.name
    when = now or datetime.now(UTC)
    ev = _Evidence(session, node)
    container = f.launch_for(node).container_name
    # First, untouched: the full -q and an idle read of the signature fields.
    q = ev.take("nvidia-smi-q.txt", ["nvidia-smi", "-q"])
    try:
        persistence_on = gpu.parse_reading(q.stdout).persistence_mode
    except gpu.GpuFormatError:
        persistence_on = None
    ev.gpu_samples("nvidia-smi-perf-idle", n=1)
    notes: list[str] = []
    with load(session, node) as driver:
        if not driver.reached():
            notes.append(f"the load did not reach {n}'s engine within {LOAD_REACH_S:.0f} s "
                         f"({'; '.join(driver.errors[-2:]) or 'no request running'})")
        under_load = ev.gpu_samples("nvidia-smi-perf-load")
        lock, locked = _lock_test(ev, persistence_on)
    kernel = ev.take("kernel.log", ["dmesg", "--ctime"])
    if not kernel.ok:
        kernel = ev.take("kernel.log", ["journalctl", "-k", "-n", str(LOG_TAIL), "--no-pager"])
    bios = ev.take("bios.txt", ["cat", "/sys/class/dmi/id/bios_version", "/sys/class/dmi/id/bios_date",
                                "/sys/class/dmi/id/board_name"])
    bios_text = bios.stdout if bios.stdout.strip() else ""
    if not bios_text:
        bios_text = ev.take("bios.txt", ["dmidecode", "-s", "bios-version"], sudo=True).stdout
    ev.take("container.log", ["docker", "logs", "--tail", str(LOG_TAIL), container])
    ev.take("container-inspect.json", ["docker", "container", "inspect", container])
    verdict = wedge_core.judge_evidence(under_load, lock, kernel.stdout if kernel.ok else "",
                                        wedge_core.bios_string(bios_text))
    if n == f.build_node.name:
        notes.append(f"{n} is the build host itself: copy the tarball off it before the cold drain")
    ev.add("VERDICT.txt", "\n".join([*verdict.summary, *notes]) + "\n")
    ev.add("commands.txt", "\n".join(ev.commands) + "\n")
    return _store(session, node, label, when, ev.files, verdict, under_load + locked, notes)


def capture(session: FleetSession, node: Node, gw: GatewayHost, reason: str, log: Any, *,
            run_id: str = "") -> Capture:
    """The wedge_evidence step under the node's lease: the node is quarantined first (a suspected
    wedge leaves the gateway before anything else, and no dead run's drain can put it back once
    the ledger holds it), then what dead runs left is finished, then the evidence captured."""
    with node_lease(session, node.name, "wedge capture", run_id=run_id):
        log.info(quarantine_node(session, node, WEDGED, reason, gw))
        for done in journal.finish_dead(session, node, log, run_id=run_id):
            log.warning(f"[{node.name}] {done.line}")
        return capture_evidence(session, node)


def _tarball(top: str, files: dict[str, bytes], when: datetime) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mtime, info.mode = len(data), int(when.timestamp()), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


_STORE = 'set -e; mkdir -p -- "$(dirname -- "$1")"; cat > "$1.tmp"; chmod 600 "$1.tmp"; mv -f -- "$1.tmp" "$1"; sha256sum -- "$1"'


def _store(session: FleetSession, node: Node, label: str, when: datetime, files: dict[str, bytes],
           verdict: wedge_core.EvidenceVerdict, under_load: list[gpu.GpuReading], notes: list[str]) -> Capture:
    """The tarball onto the build host (off the node), its sha256 read back there."""
    build = session.fleet.build_node
    path = session.expand(build, wedge_core.evidence_path(node.name, label, when))
    entries = wedge_core.manifest(files)
    files = {**files, "MANIFEST.sha256": "".join(f"{e.sha256}  {e.name}\n" for e in entries).encode()}
    blob = _tarball(path.rsplit("/", 1)[-1].removesuffix(".tar.gz"), files, when)
    want = wedge_core.manifest({"tarball": blob})[0].sha256
    try:
        r = session.run(build.name, ["sh", "-c", _STORE, "store-wedge-evidence", path], stdin=blob,
                  timeout=STORE_TIMEOUT_S, log=False)
    except RemoteError as e:
        raise RunbookError(f"{node.name}: the wedge evidence could not be stored on the build host {build.name} "
                           f"({first_line(e)}); nothing was changed on {node.name}: run the capture again") from None
    got = r.stdout.split()[0] if r.stdout.split() else ""
    if got != want:
        raise RunbookError(f"{node.name}: the evidence tarball on {build.name} ({path}) reads back as sha256 "
                           f"{got[:12] or '?'} instead of {want[:12]}; check the build host's disk, run the capture again")
    return Capture(node.name, label, build.name, path, want, len(blob), entries, verdict, under_load, notes)


# ----------------------------------------------------------------------------- cold drain


def ssh_answers(node: Node, timeout_s: float = SSH_PROBE_S) -> bool:
    """The node's sshd greets (a banner): up, as far as a power cycle is concerned."""
    try:
        with socket.create_connection((node.host, node.port), timeout=timeout_s) as c:
            c.settimeout(timeout_s)
            return c.recv(64).startswith(b"SSH-")
    except OSError:
        return False


def run_plug(node: Node, plug: SmartPlug, which: str) -> str:
    """One smart-plug command, here (where the pipeline runs), argv without a shell, bounded."""
    argv = list(plug.off_command if which == "off" else plug.on_command)
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=plug.timeout_s, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise RunbookError(f"{node.name}: cold_drain.smart_plugs.{node.name}.{which}_command: {argv[0]} is not "
                           "installed here; fix the fleet file or unplug by hand") from None
    except subprocess.TimeoutExpired:
        raise RunbookError(f"{node.name}: the smart plug's {which} command did not end within {plug.timeout_s} s: "
                           f"{' '.join(argv)}") from None
    if p.returncode != 0:
        why = (p.stderr or p.stdout).strip().splitlines()
        raise RunbookError(f"{node.name}: the smart plug's {which} command exited {p.returncode} "
                           f"({why[-1][:200] if why else 'no output'}): {' '.join(argv)}")
    return (p.stdout.strip().splitlines() or [f"plug {which}"])[-1][:200]


def wait_ssh(node: Node, up: bool, timeout_s: float) -> bool:
    """Until the node's SSH port answers (`up`) or stops answering, up to `timeout_s`: whether it did."""
    return poll_until(lambda: ssh_answers(node), lambda a: a == up, timeout_s=timeout_s, every_s=2.0).done


@dataclass
class Drained:
    steps: list[str]
    seconds: float


def power_off(session: FleetSession, node: Node) -> list[str]:
    """`sudo poweroff` (the runbook's "Halt OS"); the connection may end with the OS."""
    n = node.name
    try:
        r = session.run(n, ["poweroff"], sudo=True, check=False, timeout=30)
    except RemoteError as e:
        return [f"sudo poweroff: connection ended ({first_line(e)[:80]})"]
    if not r.ok and "password" in (r.stderr + r.tail).lower():
        raise RunbookError(f"{n}: `sudo -n poweroff` wants a password; add `{node.user} ALL=(root) NOPASSWD: "
                           f"/usr/sbin/poweroff` to the sudoers on {n}; its vLLM container is stopped: "
                           "`docker start` it to serve again")
    return [f"sudo poweroff: exit {r.exit_status}"]


Noted = Callable[[str, float], None]  # (phase "power-off" | "booting", when): the journal's


def power_cycle(session: FleetSession, node: Node, say: Callable[[str], None], *, noted: Noted | None = None,
                off_s: float | None = None) -> list[str]:
    """AC off at the wall for the runbook's time (`off_s`: what is left of it) and back on: the
    fleet's smart plug, else the operator. Waits (bounded) until the node's SSH answers again.
    `noted` is told when the AC goes off and when it comes back (a journal's phases)."""
    cd = session.fleet.cold_drain
    plug = cd.smart_plugs.get(node.name)
    n = node.name
    tell = noted or (lambda phase, at: None)
    if plug is None:
        tell("power-off", time.time())
        say(f"OPERATOR: {wedge_core.OPERATOR_STEPS.format(node=n)} (waiting up to {cd.operator_timeout_s} s)")
        if not wait_ssh(node, True, cd.operator_timeout_s):
            raise RunbookError(f"{n} did not answer SSH within {cd.operator_timeout_s} s of the request to unplug "
                               f"it at the wall; power it on, then run cold_drain_job for {n} again")
        tell("booting", time.time())
        return [f"operator power-cycled {n} at the wall"]
    off = cd.off_s if off_s is None else off_s
    tell("power-off", time.time())  # before the plug: a run that dies with the AC off must have said so
    steps = [f"smart plug off: {run_plug(node, plug, 'off')}"]
    try:
        say(f"{n}: AC off at the wall for {off:.0f} s (runbook: 90-120 s, 60 s is often not enough)")
        time.sleep(off)
    finally:  # AC back in every outcome, a terminated run included
        steps.append(f"smart plug on: {run_plug(node, plug, 'on')}")
        tell("booting", time.time())
    if not wait_ssh(node, True, cd.boot_timeout_s):
        raise RunbookError(f"{n} did not answer SSH within {cd.boot_timeout_s} s of its power coming back; check "
                           f"the unit (the plug's on command ran: {' '.join(plug.on_command)})")
    return steps


def boot_to_serving(session: FleetSession, node: Node, say: Callable[[str], None]) -> list[str]:
    """After the boot: nvidia-persistenced active, `docker start` of the kept container, /health."""
    f, n = session.fleet, node.name
    container = f.launch_for(node).container_name
    steps = []
    persisted = poll_until(
        lambda: session.run(n, ["systemctl", "is-active", "nvidia-persistenced"], check=False, log=False, timeout=30).stdout.strip(),
        lambda state: state == "active", timeout_s=PERSISTENCED_WAIT_S, every_s=3.0)
    steps.append(f"nvidia-persistenced {persisted.value or 'unknown'}")
    if not persisted.done:
        say(f"{n}: nvidia-persistenced is {persisted.value!r} after {PERSISTENCED_WAIT_S:.0f} s; starting vLLM anyway")
    session.run(n, ["docker", "start", container], timeout=120)
    timeout = f.cold_drain.engine_timeout_s
    say(f"{n}: docker start {container}; waiting up to {timeout} s for /health (JIT + graph capture, 5-10 min)")
    if not engine.wait_healthy(f, node, timeout):
        tail = session.run(n, ["docker", "logs", "--tail", "20", container], check=False, log=False, timeout=60)
        raise RunbookError(f"{n}: vLLM did not answer /health within {timeout} s of docker start after the cold "
                           "drain; the node stays out of the gateway",
                           details={"log_tail": f"```\n{(tail.stdout + tail.stderr)[-3000:]}\n```"})
    steps.append(f"docker start {container}: /health 200")
    return steps


# The cold drain's journal phases while its node is down (runbook/journal.py: `down_until`).
POWER_PHASES = ("powering-off", "power-off", "booting")


def _down_s(session: FleetSession, node: Node) -> float:
    """How long this run may wait for its node once it powers it off (the journal's `down_until`)."""
    cd = session.fleet.cold_drain
    cycle = cd.off_s + cd.boot_timeout_s if node.name in cd.smart_plugs else cd.operator_timeout_s
    return cd.power_down_timeout_s + cycle + 60


def resume_dead(session: FleetSession, node: Node, say: Callable[[str], None]) -> list[str]:
    """Before anything needs SSH: a cold drain whose run died while its node was down (its journal
    in the ledger says so) has its power cycle finished: the AC kept off for the rest of
    cold_drain.off_s and back on by the plug (else the operator is asked again), SSH awaited, the
    times written to that journal. Returns the steps ([]: the node answers, or no such journal);
    NodeBusy when that run may still be alive and waiting for the node."""
    n = node.name
    if ssh_answers(node):
        return []
    try:
        procs = ledger.read(session).procedures(n)
    except RunbookError:
        return []  # the lease below fails on the node as it would have; the next run tries again
    p = next((q for q in reversed(procs) if q.procedure == steps_.PROC_COLD_DRAIN and q.phase in POWER_PHASES
              and not journal.is_live(q)), None)
    if p is None:
        return []
    waiting = journal.still_waiting(session, p)
    if waiting:
        raise NodeBusy(f"node {n} is busy: {waiting}")
    facts = dict(p.facts)

    def noted(phase: str, at: float) -> None:
        if phase == "power-off" and facts.get("ac_off_at"):
            return  # the dead run's AC-off time stands: the cycle is its, finished here
        facts["ac_off_at" if phase == "power-off" else "ac_on_at"] = at
        try:
            ledger.update_procedure(session, n, p.token, facts=facts)
        except RunbookError as e:
            session.log.warning(f"[{n}] the dead cold drain's journal was not updated ({first_line(e)})")

    off_at = facts.get("ac_off_at")
    left = max(0.0, float(off_at) + session.fleet.cold_drain.off_s - time.time()) if off_at else None
    say(f"{p.describe()} died with {n} down: finishing its power cycle first"
        + (f" (AC off since {time.strftime('%H:%M:%S', time.localtime(float(off_at)))}, {left:.0f} s left)"
           if left is not None else ""))
    return [f"the power cycle of {p.describe()} finished", *power_cycle(session, node, say, noted=noted, off_s=left)]


def cold_drain(session: FleetSession, node: Node, gw: GatewayHost, say: Callable[[str], None], j: journal.Journal, *,
               run_id: str = "") -> Drained:
    """The runbook's AC cold drain of a quarantined node, up to a serving engine again, each step
    written to its journal `j` first. A dead cold drain on the node is finished first (its power
    cycle, its engine started); when its AC was off for cold_drain.off_s, the cycle is not repeated."""
    started = time.monotonic()
    f, n = session.fleet, node.name
    steps = resume_dead(session, node, say)
    if in_rotation(gw, node):
        done = quarantine_node(session, node, WEDGED, "cold drain", gw)
        if in_rotation(gw, node):
            raise RunbookError(f"{n} is still in the gateway and cannot leave it ({done}); nothing was "
                               "changed: bring another node into the rotation first")
    with journal.claimed(session, node, "cold drain", session.log, run_id=run_id) as finished:
        steps += [x.line for x in finished]
        cycled = next((x for x in finished if x.procedure == steps_.PROC_COLD_DRAIN and x.serving
                       and float(x.facts.get("ac_on_at", 0)) - float(x.facts.get("ac_off_at", 1e18)) >= f.cold_drain.off_s),
                      None)
        if cycled is not None:
            steps.append(f"the AC was off for {float(cycled.facts['ac_on_at']) - float(cycled.facts['ac_off_at']):.0f} s "
                         f"in the dead run's cold drain: not repeated; validating")
            return Drained(steps, round(time.monotonic() - started, 1))
        container = f.launch_for(node).container_name
        j.update(phase="stopping", engine=container)
        j.keep = True  # from here the engine is this run's (or the next run's) to start again
        r = session.run(n, ["docker", "stop", "-t", "60", container], check=False, timeout=120)
        steps.append(f"docker stop {container}: exit {r.exit_status}")
        j.update(phase="powering-off", down_until=time.time() + _down_s(session, node))
        steps += power_off(session, node)
    session.close()  # the node's connections went with it; the next command reconnects
    if not wait_ssh(node, False, f.cold_drain.power_down_timeout_s):
        raise RunbookError(f"{n} still answers SSH {f.cold_drain.power_down_timeout_s} s after "
                           "`sudo poweroff`; check the unit (LEDs, fan) before cutting power; its vLLM container "
                           "is stopped, the node stays out of the gateway")
    say(f"{n} is down (SSH no longer answers)")

    def noted(phase: str, at: float) -> None:
        key = "ac_off_at" if phase == "power-off" else "ac_on_at"
        j.try_update(phase=phase, facts={**j.entry.facts, key: at})

    steps += power_cycle(session, node, say, noted=noted)
    with node_lease(session, n, "cold drain (after boot)", run_id=run_id):
        j.update(phase="starting", down_until=None)  # gone: another run finished it meanwhile
        steps += boot_to_serving(session, node, say)
    j.keep = False
    return Drained(steps, round(time.monotonic() - started, 1))


# ----------------------------------------------------------------------------- validation


@dataclass
class Validation:
    verdict: wedge_core.DrainVerdict
    capture: Capture
    bench_mean_tok_s: float | None
    floor_tok_s: float
    verdict_path: str
    gateway: str


BenchRunner = Callable[[FleetSession, Node], tuple[float | None, list[gpu.GpuReading]]]


def bench_after_drain(session: FleetSession, node: Node) -> tuple[float | None, list[gpu.GpuReading]]:
    """The fleet's bench straight at the node (it is out of the gateway), GPU sampled under load."""
    from spark_pipelines.resources.bench_client import run_bench
    from spark_pipelines.runbook.bench import GpuSampler
    from spark_pipelines.runbook.rotation import wait_idle

    fleet = session.fleet
    wait_idle(fleet, node)
    with GpuSampler(session, node) as sampler:
        report = run_bench(engine.api_root(fleet, node), fleet.launch_for(node).served_model_name, suite=fleet.bench.suite,
                           concurrency=fleet.bench.loaded_concurrency, repeats=fleet.bench.repeats,
                           reference_mean_tok_s=fleet.bench.reference_tok_s)
    mean = report.recipe_mean_tok_s.median if report.recipe_mean_tok_s else None
    return mean, sampler.readings


def validate(session: FleetSession, node: Node, gw: GatewayHost, *, bench: BenchRunner = bench_after_drain,
             load: LoadFactory = SustainedLoad) -> Validation:
    """The runbook's post-drain validation: a post-drain capture (the lock test again, and the
    tarball that proves the drain was attempted), a bench against the node's floor, the verdict
    (VERDICT.txt next to the tarball). RESOLVED: back in the gateway, hold-out lifted; PERSISTS:
    kept out with the runbook's next step."""
    fleet = session.fleet
    post = capture_evidence(session, node, label="post-drain", load=load)
    mean, samples = bench(session, node)
    floor = fleet.bench_floor(node)
    verdict = wedge_core.post_drain_verdict(post.under_load + samples, post.evidence.lock, mean, floor,
                                            post.evidence.bios)
    verdict_path = post.path.removesuffix(".tar.gz") + ".VERDICT.txt"
    session.put_text(fleet.build_node.name, verdict_path, verdict.text(), mode=0o600)
    if verdict.resolved:
        lift_quarantine(session, node, f"{wedge_core.RESOLVED} after the cold drain: {verdict.reasons[0]}", gw,
                        mean_tok_s=mean)
        where = f"{node.name} back in the gateway"
    else:
        where = quarantine_node(session, node, WEDGED, f"{wedge_core.PERSISTS} after the cold drain: {verdict.advice}", gw)
    return Validation(verdict, post, mean, floor, verdict_path, where)


def drain_and_validate(session: FleetSession, node: Node, gw: GatewayHost, say: Callable[[str], None], *,
                       run_id: str) -> tuple[Drained, Validation]:
    """The cold_drain step, approved by its launch: the journal from before docker stop until
    validated (a run that dies with the node powered off is finished by the next cold_drain_job,
    which the health sweep requests), the cold drain, then the post-drain validation under the
    node's lease."""
    with journal.journaled(session, node.name, steps_.PROC_COLD_DRAIN, run_id, phase="approved") as j:
        drained = cold_drain(session, node, gw, say, j, run_id=run_id)
        with node_lease(session, node.name, "post-drain validation", run_id=run_id):
            j.update(phase="validating")
            return drained, validate(session, node, gw)
