"""Phase 0 on one node (node_os_job): read the facts, change only what differs, reboot when a mask
or the target needs it, verify the clean boot and measure the memcheck baseline.

- The changes run in the runbook's order; when one fails, the ones already made are undone in
  reverse (each has its undo in core/node_os.py) and nothing reboots.
- The reboot is drained (never below gateway.min_in_rotation) and leased. The engine is stopped
  before it and started after it (`docker start`, as the runbook does after a boot).
- The reboot keeps a journal (runbook/journal.py) from its drain until the node serves again: a run
  that dies while the node reboots, or before its engine starts, is finished by the next run on the
  node (its engine started, its drain undone) or by the health sweep's node_os_job. A reboot after
  which the node is not clean or does not serve holds it out in the ledger (`node_os`) with the
  advice; the next node_os_job that finds it clean starts its engine, lifts the hold, puts it back.
- A node whose SSH does not answer within node_os.reboot_ssh_timeout_s (the runbook's ">10 min:
  hard reset") is power-cycled through its smart plug when node_os.power_cycle is auto, and
  otherwise quarantined with the step and the runbook's advice.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from spark_pipelines.core import node_os, steps
from spark_pipelines.core.errors import RunbookError, first_line
from spark_pipelines.core.fleet import Fleet, Node
from spark_pipelines.core.polling import poll_until
from spark_pipelines.resources import engine
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources import lease
from spark_pipelines.resources.lease import node_lease
from spark_pipelines.resources.ssh import FleetSession, RemoteError
from spark_pipelines.runbook import journal, quarantine, rotation, wedge
from spark_pipelines.runbook.preflight import MEMCHECK_PY
from spark_pipelines.state import ledger, markers

READ_TIMEOUT_S = 30
CHANGE_TIMEOUT_S = 300  # apt-get purge is the slow one
DOWN_TIMEOUT_S = 120  # after `sudo reboot`, until SSH stops answering
MEMCHECK_TIMEOUT_S = 300
UNREACHABLE = "unreachable"  # the quarantine verdict of a node that did not come back
REBOOT_DRAIN = "node_os reboot"  # the drain note's reason (the run's id follows it)
ADVICE = ("runbook lesson 5: hard reset > waiting when SSH locks up for >10 min (power-cycle it at the wall or "
          "through its smart plug, then run node_os_job for it again and deploy_node_job: its engine was stopped "
          "for the reboot)")


def choices(fleet: Fleet) -> node_os.Choices:
    s = fleet.node_os
    return node_os.Choices(disable_tailscale=s.disable_tailscale, keep_services=frozenset(s.keep_services))


def _read(session: FleetSession, n: str, argv: list[str]):
    return session.run(n, argv, check=False, log=False, timeout=READ_TIMEOUT_S)


def _file(session: FleetSession, n: str, path: str) -> str | None:
    r = _read(session, n, ["cat", path])
    if r.ok:
        return r.stdout
    if "No such file" in r.stderr:
        return None
    raise RunbookError(f"{n}: `cat {path}` exited {r.exit_status} ({first_line(r.stderr) or 'no output'}); "
                       "check the file's permissions on the node")


def read_facts(session: FleetSession, node: Node) -> node_os.OsFacts:
    """Read-only: everything Phase 0 sets, as the node reports it."""
    n = node.name
    units = sorted({node_os.unit_name(u) for u in (*node_os.DISABLE, *node_os.MASK)} | {node_os.TAILSCALE})
    target = _read(session, n, ["systemctl", "get-default"])
    enabled = _read(session, n, ["systemctl", "is-enabled", *units])
    running = _read(session, n, ["systemctl", "list-units", "--type=service", "--state=running", "--no-legend", "--plain"])
    keys = list(node_os.SYSCTLS)
    live = _read(session, n, ["sysctl", "-n", *keys])
    swaps = _read(session, n, ["swapon", "--show=NAME", "--noheadings"])
    earlyoom = _read(session, n, ["dpkg-query", "-W", "-f", "${Status}", node_os.EARLYOOM])
    free = _read(session, n, ["free", "-g"])
    if not target.stdout.strip():
        raise RunbookError(f"{n}: `systemctl get-default` printed nothing (exit {target.exit_status}): "
                           "Phase 0 needs a systemd node")
    try:
        enablement = node_os.parse_enablement(units, enabled.stdout)
    except ValueError as e:
        raise RunbookError(f"{n}: {e}; run `systemctl is-enabled` there to see why") from None
    return node_os.OsFacts(
        default_target=target.stdout.strip(),
        enablement=enablement,
        running=node_os.parse_running(running.stdout),
        sysctl_file=_file(session, n, node_os.SYSCTL_PATH),
        sysctl_live=node_os.parse_sysctls(keys, live.stdout),
        swap_active=tuple(swaps.stdout.split()),
        fstab=_file(session, n, node_os.FSTAB) or "",
        earlyoom_installed="install ok installed" in earlyoom.stdout,
        used_gib=node_os.parse_free_used_gib(free.stdout),
    )


def _run_root(session: FleetSession, node: Node, argv: tuple[str, ...]) -> None:
    n = node.name
    r = session.run(n, list(argv), sudo=True, check=False, timeout=CHANGE_TIMEOUT_S)
    if r.ok:
        return
    why = first_line(r.stderr or r.tail) or "no output"
    if "password" in why.lower():
        raise RunbookError(f"{n}: `sudo -n {' '.join(argv)}` wants a password; add the Phase 0 sudoers lines of "
                           f"docs/real-nodes.md (step 3; `spark-pipelines sudoers` prints them) for user "
                           f"{node.user} on {n}")
    raise RunbookError(f"{n}: `sudo -n {' '.join(argv)}` exited {r.exit_status} ({why})")


def undo(session: FleetSession, node: Node, done: list[node_os.OsChange]) -> list[str]:
    """The made changes undone in reverse; returns the undos that failed (each is tried)."""
    failed = []
    for c in reversed(done):
        for argv in c.undo:
            try:
                _run_root(session, node, argv)
            except (RunbookError, RemoteError) as e:
                failed.append(f"{c.setting}: {first_line(e)}")
    return failed


def apply(session: FleetSession, node: Node, changes: list[node_os.OsChange]) -> list[str]:
    """Each change in order; on any failure the made ones are undone, a change whose first
    command ran and a later one failed (mask, then stop) included, and the error names both. A
    run whose lease on the node ended undoes nothing there (another run may hold it now; the next
    node_os_job reads the node again and changes only what differs)."""
    done: list[node_os.OsChange] = []
    try:
        for c in changes:
            for i, argv in enumerate(c.argvs):
                if i == 1:
                    done.append(c)  # half-applied from here: its undo puts the setting back as a whole
                _run_root(session, node, argv)
            if len(c.argvs) < 2:
                done.append(c)
            session.log.info(f"[{node.name}] Phase 0: {c.line}")
    except BaseException as e:
        if lease.lost(session, node.name) is not None:
            raise
        failed = undo(session, node, done)
        if isinstance(e, RunbookError):
            e.description = (f"{e.description}; the {len(done)} change(s) made before it were undone"
                             + (f", except: {'; '.join(failed)}" if failed else ""))
            e.args = (e.description,)
        raise
    return [c.line for c in done]


def memcheck(session: FleetSession, node: Node) -> float | None:
    """The runbook's memcheck container (free CUDA memory, GiB), when the serving image is on the node."""
    image = session.fleet.launch_for(node).image
    n = node.name
    if not _read(session, n, ["docker", "image", "inspect", "--format", "{{.Id}}", image]).ok:
        return None
    r = session.run(n, ["docker", "run", "--rm", "--gpus", "all", "--entrypoint", "python3", image, "-c", MEMCHECK_PY],
              check=False, log=False, timeout=MEMCHECK_TIMEOUT_S)
    if not r.ok or len(r.stdout.split()) < 2:
        raise RunbookError(f"{n}: the memcheck container exited {r.exit_status} "
                           f"({first_line(r.stderr) or 'no output'}); is the GPU visible to docker there?")
    return round(float(r.stdout.split()[-2]), 2)


def _engine_running(session: FleetSession, node: Node) -> bool:
    name = session.fleet.launch_for(node).container_name
    r = _read(session, node.name, ["docker", "inspect", "--format", "{{.State.Running}}", name])
    return r.ok and r.stdout.strip() == "true"


@dataclass
class Provisioned:
    node: str
    planned: list[str]
    applied: list[str] = field(default_factory=list)
    rebooted: bool = False
    remasked: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    clean_boot_free_gib: float | None = None
    steps: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # said, not changed (the operator's exporter)
    check_only: bool = False


def _back_up(session: FleetSession, node: Node, gw: GatewayHost, say: Callable[[str], None], d: rotation.Drain) -> list[str]:
    """Wait for SSH after the reboot; past the bound, the smart plug by policy or the quarantine."""
    f, n = session.fleet, node.name
    bound = f.node_os.reboot_ssh_timeout_s
    if wedge.wait_ssh(node, True, bound):
        return ["SSH answers again after the reboot"]
    plug = f.cold_drain.smart_plugs.get(n)
    if plug is not None and f.node_os.power_cycle == "auto":
        say(f"{n}: SSH dead {bound} s after `sudo reboot`: power-cycling it through its smart plug (node_os.power_cycle: auto)")
        try:
            return wedge.power_cycle(session, node, say)
        except RunbookError as e:
            why = f"did not come back from its Phase 0 reboot, nor from a power cycle ({first_line(e)})"
    else:
        why = f"did not answer SSH within {bound} s of its Phase 0 reboot (step: reboot)"
    d.keep_out = True
    held = quarantine.quarantine(session, node, UNREACHABLE, f"node_os: {why}", by="node_os", gw=gw)
    raise RunbookError(f"{n} {why}; it is quarantined ({held.note}); {ADVICE}")


def _down_s(fleet: Fleet) -> float:
    """How long this run may wait for its node after `sudo reboot` (SSH down, back up, a power cycle
    by policy): while the journal says so, no other run finishes the reboot unless this run ended."""
    cycle = fleet.cold_drain.off_s + fleet.cold_drain.boot_timeout_s if fleet.node_os.power_cycle == "auto" else 0
    return DOWN_TIMEOUT_S + fleet.node_os.reboot_ssh_timeout_s + cycle + 60


def _reboot(session: FleetSession, node: Node, result: Provisioned, run_id: str, j: journal.Journal) -> bool:
    """Stop the engine and `sudo reboot` (leased), each written to the journal first. Returns
    whether the engine ran; when the reboot cannot be issued, the engine is started again before
    the error leaves."""
    n = node.name
    container = session.fleet.launch_for(node).container_name
    with node_lease(session, n, "Phase 0 reboot", run_id=run_id):
        was_running = _engine_running(session, node)
        if was_running:
            j.update(phase="stopping", engine=container)
            session.run(n, ["docker", "stop", "-t", "60", container], timeout=120)
            result.steps.append(f"docker stop {container}")
        try:
            j.update(phase="rebooting", down_until=time.time() + _down_s(session.fleet))
            r = session.run(n, ["reboot"], sudo=True, check=False, timeout=30)
            if not r.ok and "password" in (r.stderr + r.tail).lower():
                raise RunbookError(f"{n}: `sudo -n reboot` wants a password; add the Phase 0 sudoers lines of "
                                   f"docs/real-nodes.md (step 3; `spark-pipelines sudoers` prints them) for user "
                                   f"{node.user} on {n}")
            result.steps.append(f"sudo reboot: exit {r.exit_status}")
        except RemoteError as e:  # the connection may end with the OS
            result.steps.append(f"sudo reboot: connection ended ({first_line(e)[:60]})")
        except BaseException:
            if was_running:  # nothing rebooted: serve again before the drain ends
                session.run(n, ["docker", "start", container], check=False, timeout=120)
                engine.wait_healthy(session.fleet, node, session.fleet.cold_drain.engine_timeout_s)
            raise
    session.close()  # the node's connections end with its OS
    return was_running


def _hold(session: FleetSession, n: str, why: str, **facts: object) -> None:
    """Out of the gateway with the reason where its promotion reads it (node_os's hold-out)."""
    try:
        ledger.hold(session, n, ledger.BY_NODE_OS, why, **facts)
    except Exception as e:  # the drain keeps it out; the run's error says why
        session.log.warning(f"[{n}] its hold-out was not recorded ({first_line(e)}): {why}")


def _after_held(session: FleetSession, node: Node, gw: GatewayHost, result: Provisioned) -> None:
    """A node an earlier Phase 0 held out after its reboot, verified clean now: its engine started
    again, the hold lifted, its drain undone (the promise that reboot made)."""
    n = node.name
    try:
        held = ledger.read(session).entry(n).holds.get(ledger.BY_NODE_OS)
    except RunbookError as e:  # Phase 0 itself does not need the gateway host
        result.notes.append(f"the ledger was not read ({first_line(e)}): a Phase 0 hold-out on {n} is lifted by "
                            "the next node_os_job")
        return
    if held is None or result.problems:
        return
    container = held.facts.get("engine")
    if container and not engine.healthy(session.fleet, node):
        session.run(n, ["docker", "start", str(container)], check=False, timeout=120)
        if not engine.wait_healthy(session.fleet, node, journal.engine_timeout_s(session, node)):
            result.steps.append(f"docker start {container}: vLLM does not answer /health; {n} stays held out")
            return
        result.steps.append(f"docker start {container}: /health 200")
    ledger.lift(session, n, ledger.BY_NODE_OS)
    note = gw.read().drains.get(n, "")
    if note.startswith(str(held.facts.get("drain_reason") or "\0")):
        rotation.put_back(gw, n)
        result.steps.append(f"{n} is clean and serves: its Phase 0 hold-out lifted, back in the gateway")
    else:
        result.steps.append(f"{n} is clean and serves: its Phase 0 hold-out lifted")


def _verify(session: FleetSession, node: Node, result: Provisioned, *, measure: bool) -> None:
    """The runbook's "verify clean baseline": facts judged, socket-activated returners masked
    again, and (engine stopped) the memcheck as the node's measured clean-boot baseline."""
    ch = choices(session.fleet)
    verdict = node_os.verify(read_facts(session, node), ch)
    if verdict.remask:
        result.remasked = apply(session, node, node_os.remask_changes(verdict.remask))
        verdict = node_os.verify(read_facts(session, node), ch)
    result.problems = verdict.problems
    args = _read(session, node.name, ["docker", "inspect", "--format", "{{json .Args}}", node_os.GPU_EXPORTER])
    advice = node_os.gpu_exporter_advice(json.loads(args.stdout) if args.ok and args.stdout.strip() else None)
    if advice:
        result.notes.append(advice)
    if measure and not result.problems and not _engine_running(session, node):
        result.clean_boot_free_gib = memcheck(session, node)
        if result.clean_boot_free_gib is not None:
            markers.write_clean_boot(session, node, markers.CleanBoot(free_gib=result.clean_boot_free_gib, measured_at=ledger.now()))


def provision(session: FleetSession, node: Node, gw: GatewayHost, say: Callable[[str], None], *,
              check_only: bool = False, run_id: str = "") -> Provisioned:
    """Phase 0 on `node`: plan, apply (undone on failure), reboot if needed (drained, bounded,
    quarantined when it does not come back), verify, measure, serve again. What a dead run left
    on the node is finished first (not in check mode: it touches nothing)."""
    f, n = session.fleet, node.name
    ch = choices(f)
    finished: list[journal.Finished] = []
    with node_lease(session, n, "Phase 0 facts", run_id=run_id):
        if not check_only:
            finished = journal.finish_dead(session, node, session.log, run_id=run_id)
        facts = read_facts(session, node)
    changes = node_os.plan(facts, ch)
    result = Provisioned(n, [c.line for c in changes], check_only=check_only)
    result.steps += [x.line for x in finished]
    must_reboot = node_os.needs_reboot(changes, facts, ch)
    if check_only:
        if must_reboot:
            result.steps.append("a reboot would follow: drained, engine stopped, SSH awaited up to "
                                f"{f.node_os.reboot_ssh_timeout_s} s")
        return result
    with node_lease(session, n, "Phase 0", run_id=run_id):
        result.applied = apply(session, node, changes)
        if not must_reboot:
            _verify(session, node, result, measure=False)
            _after_held(session, node, gw, result)
            return result
    say(f"{n}: Phase 0 changed {len(result.applied)} setting(s); a reboot applies the masks and the target")
    reason = f"{REBOOT_DRAIN} (run {run_id[:8] or '-'})"
    container = f.launch_for(node).container_name
    with journal.journaled(session, n, steps.PROC_NODE_OS, run_id, phase="draining", was_in=n in gw.rotation(),
                           drain_reason=reason) as j, rotation.drained(gw, n, reason=reason) as d:
        was_running = _reboot(session, node, result, run_id, j)
        d.keep_out = j.keep = True  # out until it serves again; this run's or the next run's to bring back
        if not wedge.wait_ssh(node, False, DOWN_TIMEOUT_S):
            if was_running:  # the undo of the stop: the node never went down
                session.run(n, ["docker", "start", container], check=False, timeout=120)
                engine.wait_healthy(f, node, f.cold_drain.engine_timeout_s)
            d.keep_out = not engine.healthy(f, node)
            if d.keep_out:
                _hold(session, n, f"its Phase 0 reboot did not happen and vLLM does not answer /health after docker "
                            f"start: read `docker logs {container}` there, then node_os_job for {n} again",
                      engine=container if was_running else None, drain_reason=reason)
            j.keep = False
            raise RunbookError(f"{n} still answers SSH {DOWN_TIMEOUT_S} s after `sudo reboot`: nothing rebooted; "
                               "`journalctl -b` there says what holds the shutdown")
        result.rebooted = True
        say(f"{n} is rebooting (SSH awaited up to {f.node_os.reboot_ssh_timeout_s} s)")
        try:
            result.steps += _back_up(session, node, gw, say, d)
        except RunbookError:
            j.keep = False  # quarantined with the step and the advice
            raise
        with node_lease(session, n, "Phase 0 verify", run_id=run_id):
            j.update(phase="verifying", down_until=None)  # gone: another run finished it meanwhile
            persisted = poll_until(
                lambda: _read(session, n, ["systemctl", "is-active", "nvidia-persistenced"]).stdout.strip(),
                lambda state: state == "active", timeout_s=wedge.PERSISTENCED_WAIT_S, every_s=2.0)
            result.steps.append(f"nvidia-persistenced {persisted.value or 'unknown'}")
            _verify(session, node, result, measure=True)
            if result.problems:
                _hold(session, n, f"not clean after its Phase 0 reboot: {'; '.join(result.problems)}: fix these, then "
                            f"node_os_job for {n} (it starts the engine again and puts {n} back)",
                      engine=container if was_running else None, drain_reason=reason)
                j.keep = False
                raise RunbookError(f"{n} is not clean after its Phase 0 reboot: {'; '.join(result.problems)}; it stays "
                                   "out of the gateway: fix these and run node_os_job for it again")
            if was_running:
                try:
                    result.steps += wedge.boot_to_serving(session, node, say)
                except RunbookError as e:
                    _hold(session, n, f"vLLM does not serve after its Phase 0 reboot ({first_line(e)}): read `docker logs "
                                f"{container}` there, then node_os_job for {n} again", engine=container,
                          drain_reason=reason)
                    j.keep = False
                    raise
        j.keep = False
        d.keep_out = not d.was_in
    _after_held(session, node, gw, result)  # an earlier reboot's hold-out: this one ended clean and serving
    return result
