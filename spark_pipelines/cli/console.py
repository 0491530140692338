"""The Dagster console on one instance: a code server for the `spark_pipelines` code location, the
webserver (UI and GraphQL) and the daemon (run queue, sensors, schedules), started together.

Runs the demo submits go through the code location like the UI's, a schedule's or a sensor's:
`launchRun` on the webserver, queued under the instance's `run_queue` limits, launched by the
daemon from the code server. So each run carries the location's origin and appears on its job's
page and on the Overview timeline, and "Re-execute" finds the same job.

Processes start in their own sessions (a Ctrl-C in the terminal reaches the caller, which asks
Dagster to terminate its run, follows it while its undo runs and says how it ended), write their logs under <home>/console/, and are
recorded with their start times in <home>/console/console.json so that a console a killed
caller left behind is stopped by the next start or by `spark-pipelines demo --stop`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from spark_pipelines.core.errors import first_line
from spark_pipelines.core.fleet import SEED_FLEET

# The names `make ui` (workspace.yaml) gives the same code: runs started here match its jobs.
LOCATION = "spark_pipelines"
REPOSITORY = "__repository__"
HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 240.0  # three Dagster processes importing on two busy cores
STOP_GRACE_S = 20.0
# A daemon heartbeat this recent means a daemon (e.g. `make ui`'s) serves the instance now.
DAEMON_FRESH_S = 50.0
# How long an interrupted demo follows the run it asked to terminate: a deploy's rollback restarts
# the previous container (the team instance gives a terminated run 600 s for its undo).
TERMINATE_WAIT_S = 600.0


# ---------------------------------------------------------------------------------------------
# Which fleet file, gateway key and instance a command reads. Every command (plan, doctor, adopt,
# metrics, sudoers, team, `make ui`) finds them one way and names what it read; the demo records
# its own on its instance for the commands after it (spark_pipelines/cli/demo.py writes the records).

# What the demo leaves on its instance for the commands after it (plan, doctor, adopt, metrics,
# `make ui`): the fleet file its runs were made with, and where the simulator keeps the gateway's
# master key (the path, never the key).
DEMO_FLEET_RECORD = "demo-fleet-file"
DEMO_KEY_RECORD = "demo-gateway-key-file"
DEMO_HOME = ".dagster-home"  # the demo's instance when DAGSTER_HOME is not set (the Makefile's too)
FLEET_HELP = (f"fleet file (default: $SPARK_FLEET, else the one `make demo` recorded in {DEMO_HOME}/"
              f"{DEMO_FLEET_RECORD} while it exists, else {SEED_FLEET})")


@dataclass(frozen=True)
class FleetChoice:
    """The fleet file a command reads and why that one; `warning` when it is not the file the
    demo's recorded runs were made with."""

    path: str
    how: str
    warning: str | None = None

    def named(self) -> str:
        return f"{self.path} ({self.how})"


def read_hint(choice: FleetChoice) -> str:
    """The end of a "could not read the fleet" line: which file was read, and where the demo's is."""
    hint = f"fleet file {choice.named()}"
    if choice.how.startswith("the default"):
        hint += ("; for the simulated fleet run `make demo` first (later commands find its fleet file), "
                 "or give --fleet FILE")
    return hint


def demo_home(environ: Mapping[str, str] | None = None) -> Path:
    """The instance the demo records in: $DAGSTER_HOME, else ./.dagster-home."""
    env = os.environ if environ is None else environ
    return Path(env.get("DAGSTER_HOME") or DEMO_HOME).resolve()


def _recorded(home: Path, name: str) -> str:
    record = home / name
    try:
        return record.read_text().strip() if record.is_file() else ""
    except OSError:
        return ""


def find_fleet(given: str | None = None, environ: Mapping[str, str] | None = None,
               home: Path | None = None) -> FleetChoice:
    """The one order every command finds its fleet file in: --fleet, $SPARK_FLEET, the demo's own
    file while it exists, a simulated fleet's file here, the seed. After `make sim-down` the demo's
    file is gone: the seed then, with a warning (its hosts are real nodes, not the recorded demo's)."""
    env = os.environ if environ is None else environ
    if given:
        return FleetChoice(given, "--fleet")
    if env.get("SPARK_FLEET"):
        return FleetChoice(env["SPARK_FLEET"], "$SPARK_FLEET")
    home = demo_home(env) if home is None else home
    recorded = _recorded(home, DEMO_FLEET_RECORD)
    if recorded and Path(recorded).is_file():
        return FleetChoice(recorded, f"the demo's, recorded in {home / DEMO_FLEET_RECORD}")
    if Path("sim-fleet.yaml").is_file():
        return FleetChoice("sim-fleet.yaml", "the simulated fleet's, in this directory")
    if not recorded:
        return FleetChoice(SEED_FLEET, "the default: no --fleet, $SPARK_FLEET or demo record")
    return FleetChoice(SEED_FLEET, "the default: the demo's file is gone", warning=(
        f"the demo's fleet file {recorded} is gone (make sim-down): {SEED_FLEET} is read instead, whose hosts "
        f"are the runbook's real nodes, not the simulated ones the recorded runs used. To see the demo's fleet "
        f"again: make demo; to choose a file: --fleet FILE or SPARK_FLEET=FILE"))


def demo_gateway_key(fleet_path: str, key_env: str, environ: MutableMapping[str, str] | None = None,
                     home: Path | None = None) -> str | None:
    """The simulator's gateway key for a command reading the demo's fleet file while `key_env` is
    unset: read from the key file into `environ` (this process's
    environment) and never printed. Returns a line saying where it came from, or None."""
    env = os.environ if environ is None else environ
    if env.get(key_env):
        return None
    home = demo_home(env) if home is None else home
    key_file = ""
    recorded = _recorded(home, DEMO_FLEET_RECORD)
    if recorded and Path(recorded).resolve() == Path(fleet_path).resolve():
        key_file = _recorded(home, DEMO_KEY_RECORD)
    try:
        key = Path(key_file).read_text().strip() if key_file else ""
    except OSError:
        return None
    if not key:
        return None
    env[key_env] = key
    return f"${key_env} from the simulator's key file {key_file}"


def instance_home(environ: Mapping[str, str] | None = None) -> tuple[Path | None, str]:
    """The Dagster instance a command reads: $DAGSTER_HOME, else the demo's when one was made here;
    (None, how to get one) otherwise."""
    env = os.environ if environ is None else environ
    if env.get("DAGSTER_HOME"):
        return Path(env["DAGSTER_HOME"]), "$DAGSTER_HOME"
    home = Path(DEMO_HOME).resolve()
    if (home / "dagster.yaml").is_file():
        return home, "the demo's"
    return None, (f"no Dagster instance: set DAGSTER_HOME to the instance the chain records in, or run `make demo` "
                  f"here (its instance is {DEMO_HOME})")



class ConsoleError(Exception):
    """The console could not start or a run could not be submitted: one line, with the log to read."""


@dataclass(frozen=True)
class RunOutcome:
    run_id: str
    success: bool
    why: str  # empty on success; the step failures' descriptions, else the run's failure
    seconds: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _accepts(port: int) -> bool:
    try:
        socket.create_connection((HOST, port), timeout=2).close()
        return True
    except OSError:
        return False


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/pid/stat): a recycled pid differs."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    return started is not None and _start_time(pid) == started


def _stop_group(pid: int, started: str | None, grace_s: float = STOP_GRACE_S) -> bool:
    """SIGTERM the process group led by `pid` (if still the same process), SIGKILL after `grace_s`."""
    if not _alive(pid, started):
        return False
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            if not _alive(pid, started):
                return True
            time.sleep(0.2)
    return True


def code_server_args(grpc_port: int) -> list[str]:
    """`dagster`'s arguments that serve the project's code location on 127.0.0.1:grpc_port."""
    return ["code-server", "start", "-h", HOST, "-p", str(grpc_port), "-m", "spark_pipelines.definitions",
            "--location-name", LOCATION]


def console_dir(home: Path) -> Path:
    return Path(home) / "console"


def stop_leftovers(home: Path, log: Callable[[str], None] = print) -> list[str]:
    """Stop a console recorded in <home>/console/console.json whose processes still run though
    the process that started them is gone (killed before it could stop them). Returns the names
    of the processes stopped."""
    state_file = console_dir(home) / "console.json"
    try:
        state = json.loads(state_file.read_text())
    except (OSError, ValueError):
        return []
    owner = state.get("owner") or {}
    if owner and _alive(int(owner["pid"]), owner.get("started")):
        if state.get("processes"):
            log(f"the Dagster console on {home} belongs to a running process (pid {owner['pid']}): left as it is")
        return []
    stopped = []
    for name in ("daemon", "webserver", "code-server"):
        proc = state.get("processes", {}).get(name)
        if proc and _stop_group(int(proc["pid"]), proc.get("started")):
            stopped.append(f"{name} (pid {proc['pid']})")
    if stopped:
        log(f"stopped the Dagster console a previous run left on {home}: {', '.join(stopped)}")
    state.update(processes={}, stopped_at=time.time())
    state_file.write_text(json.dumps(state, indent=1))
    return stopped


def _tail(path: Path, lines: int = 1) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


def fresh_daemon_heartbeat(home: Path, since: float) -> float | None:
    """Seconds since the newest daemon heartbeat on the instance in `home`, if newer than `since`."""
    import dagster as dg
    from dagster._core.instance.ref import InstanceRef

    if not (Path(home) / "dagster.yaml").exists() and not (Path(home) / "storage").exists():
        return None
    instance = dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(home)))
    try:
        beats = [b.timestamp for b in instance.get_daemon_heartbeats().values()]
    finally:
        instance.dispose()
    newest = max(beats, default=0.0)
    return time.time() - newest if newest > since else None


def _failure_text(event: Any) -> str:
    """One step failure's description (a dg.Failure's), else the first line of its error's root
    cause (Dagster wraps what a resource or op raised: "Error occurred while ...")."""
    data = event.step_failure_data
    if data and data.user_failure_data and data.user_failure_data.description:
        return data.user_failure_data.description
    if data and data.error:
        return _root_cause(data.error)
    return event.message or "step failed"


def _root_cause(err: Any) -> str:
    while err.cause is not None:
        err = err.cause
    lines = err.message.strip().splitlines()
    return lines[0] if lines else err.cls_name


def follow_run(instance: Any, run_id: str, timeout_s: float, progress: Callable[[str], None],
               check_alive: Callable[[], None], terminate: Callable[[str], None] | None) -> RunOutcome:
    """Poll the run's status and step events on the instance until it ends; print each step's
    start and end. Past `timeout_s` the run is terminated (when `terminate` is given)."""
    from dagster import DagsterEventType, DagsterRunStatus

    kinds = {DagsterEventType.STEP_START, DagsterEventType.STEP_SUCCESS, DagsterEventType.STEP_FAILURE,
             DagsterEventType.RUN_FAILURE, DagsterEventType.RUN_CANCELED}
    ended = {DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED}
    started = time.monotonic()
    deadline = started + timeout_s
    cursor = None
    failures: list[str] = []
    run_failure = ""
    step_started: dict[str, float] = {}
    step_ended: set[str] = set()
    last_news = started
    status = None
    terminated = False
    while True:
        conn = instance.get_records_for_run(run_id, cursor=cursor, of_type=kinds)
        cursor = conn.cursor
        for rec in conn.records:
            ev = rec.event_log_entry.dagster_event
            if ev is None:
                continue
            step = ev.step_key or ""
            last_news = time.monotonic()
            if ev.event_type == DagsterEventType.STEP_START:
                step_started[step] = last_news
                progress(f"    {step}: started")
            elif ev.event_type == DagsterEventType.STEP_SUCCESS:
                step_ended.add(step)
                progress(f"    {step}: ok ({last_news - step_started.get(step, started):.0f} s)")
            elif ev.event_type == DagsterEventType.STEP_FAILURE:
                step_ended.add(step)
                failures.append(_failure_text(ev))
                progress(f"    {step}: FAILED")
            elif ev.event_type == DagsterEventType.RUN_FAILURE:
                # An error outside the steps (a resource set up for the whole run) names its cause.
                error = getattr(ev.event_specific_data, "error", None)
                run_failure = _root_cause(error) if error is not None else ev.message or "run failed"
            else:
                run_failure = ev.message or "run canceled"
        if conn.has_more:
            continue
        status = instance.get_run_by_id(run_id).status
        if status in ended:
            break
        now = time.monotonic()
        if now > deadline and not terminated:
            if terminate is None:
                break
            progress(f"    run {run_id[:8]} still {status.value.lower()} after {timeout_s:.0f} s: terminating it")
            terminate(run_id)
            terminated, deadline = True, now + 180.0
        elif now > deadline:
            break
        if now - last_news > 60:
            running = [s for s in step_started if s not in step_ended]
            doing = f"in {', '.join(running)}" if running else status.value.lower()
            progress(f"    ... still {doing} ({now - started:.0f} s)")
            last_news = now
        check_alive()
        time.sleep(1.0)
    seconds = time.monotonic() - started
    if status == DagsterRunStatus.SUCCESS:
        return RunOutcome(run_id, True, "", seconds)
    why = "; ".join(failures) or run_failure or f"run {status.value.lower() if status else 'unknown'}"
    if terminated:
        why = f"did not finish within {timeout_s:.0f} s, terminated: {why}"
    return RunOutcome(run_id, False, why, seconds)


@dataclass
class Console:
    """`with Console(home, fleet_path) as c:` runs the three processes on the instance in `home`
    (DAGSTER_HOME) serving `fleet_path`; `c.run(job, partition)` submits and waits."""

    home: Path
    fleet_path: str
    env: Mapping[str, str] = field(default_factory=dict)  # added to this process's environment
    web_port: int | None = None
    # The code server's argv for a gRPC port; default: this venv's `dagster code-server`. The team
    # instance runs it in its image instead (runs then launch from that image's Python).
    code_server: Callable[[int], list[str]] | None = None
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    log: Callable[[str], None] = print
    processes: dict[str, tuple[subprocess.Popen, str | None, Path]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.web_port}"

    @property
    def logs(self) -> Path:
        return console_dir(self.home)

    # -- processes -------------------------------------------------------------------------

    def __enter__(self) -> Console:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.home = Path(self.home).resolve()
        self.logs.mkdir(parents=True, exist_ok=True)
        stop_leftovers(self.home, self.log)
        self._refuse_a_second_daemon()
        grpc_port = free_port()
        self.web_port = self.web_port or free_port()
        workspace = self.logs / "workspace.yaml"
        workspace.write_text(f"load_from:\n  - grpc_server:\n      host: {HOST}\n      port: {grpc_port}\n"
                             f"      location_name: {LOCATION}\n")
        env = {**os.environ, **self.env, "DAGSTER_HOME": str(self.home), "SPARK_FLEET": self.fleet_path}
        bin_dir = Path(sys.executable).parent
        code_server = (self.code_server(grpc_port) if self.code_server else
                       [str(bin_dir / "dagster"), *code_server_args(grpc_port)])
        try:
            self._spawn("code-server", code_server, env)
            # The webserver asks once at start; a code server still importing would leave it with an error.
            self._until("code server", "code-server", lambda: _accepts(grpc_port))
            self._spawn("webserver", [str(bin_dir / "dagster-webserver"), "-h", HOST, "-p", str(self.web_port),
                                      "-w", str(workspace)], env)
            self._wait_for_location()
            self._spawn("daemon", [str(bin_dir / "dagster-daemon"), "run", "-w", str(workspace)], env)
            self._wait_for_daemon()
        except BaseException:
            self.stop()
            raise

    def _refuse_a_second_daemon(self) -> None:
        """Two daemons on one instance would both dequeue runs and tick sensors."""
        try:
            stopped_at = json.loads((self.logs / "console.json").read_text()).get("stopped_at") or 0.0
        except (OSError, ValueError):
            stopped_at = 0.0
        beat = fresh_daemon_heartbeat(self.home, since=max(stopped_at, time.time() - DAEMON_FRESH_S))
        if beat:
            raise ConsoleError(f"a Dagster daemon already serves {self.home} (last heartbeat {beat:.0f} s ago; "
                               "`make ui`?): stop it first, the demo starts its own")

    def detach(self) -> None:
        """Leave the processes running after this process exits: no owner is recorded, so the
        next `stop_leftovers` on the instance (`team down`) stops them."""
        self._record()
        state_file = self.logs / "console.json"
        state = json.loads(state_file.read_text())
        state["owner"] = {}
        state_file.write_text(json.dumps(state, indent=1))
        self.processes.clear()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        if "/" in argv[0] and not Path(argv[0]).exists():
            raise ConsoleError(f"{argv[0]} not found: run scripts/bootstrap.sh base (the project venv)")
        log_path = self.logs / f"{name}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        self.processes[name] = (proc, _start_time(proc.pid), log_path)
        self._record()

    def _record(self) -> None:
        # The owner: while it lives, its console is not a leftover (see stop_leftovers).
        state = {"owner": {"pid": os.getpid(), "started": _start_time(os.getpid())},
                 "url": self.url, "fleet": self.fleet_path, "started_at": time.time(), "stopped_at": None,
                 "processes": {n: {"pid": p.pid, "started": st, "log": str(lp)}
                               for n, (p, st, lp) in self.processes.items()}}
        (self.logs / "console.json").write_text(json.dumps(state, indent=1))

    def _check_alive(self) -> None:
        for name, (proc, _, log_path) in self.processes.items():
            if proc.poll() is not None:
                raise ConsoleError(f"the Dagster {name} exited with status {proc.returncode}: "
                                   f"{_tail(log_path, 2) or 'no output'} (log: {log_path})")

    def _until(self, what: str, log_name: str, probe: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + self.startup_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                value = probe()
                if value:
                    return value
            except (httpx.HTTPError, ValueError, KeyError) as e:
                last = e
            time.sleep(1.0)
        raise ConsoleError(f"the Dagster {what} did not come up within {self.startup_timeout_s:.0f} s"
                           f"{f' ({last})' if last else ''}: see {self.logs / (log_name + '.log')}")

    def _wait_for_location(self) -> None:
        query = ("{ workspaceOrError { __typename ... on Workspace { locationEntries { name loadStatus "
                 "locationOrLoadError { __typename ... on PythonError { message } } } } } }")

        def loaded() -> bool:
            entries = self.graphql(query, timeout=10)["workspaceOrError"]["locationEntries"]
            entry = next(e for e in entries if e["name"] == LOCATION)
            load = entry["locationOrLoadError"] or {}
            if entry["loadStatus"] == "LOADED" and load.get("__typename") == "RepositoryLocation":
                return True
            if load.get("__typename") == "PythonError":
                message = load.get("message") or ""
                if "UNAVAILABLE" in message or "failed to connect" in message.lower():
                    # The code server was still importing when the webserver asked: ask again.
                    self.graphql("mutation($n: String!) { reloadRepositoryLocation(repositoryLocationName: $n) "
                                 "{ __typename } }", {"n": LOCATION}, timeout=60)
                    return False
                self._check_alive()
                raise ConsoleError(f"the code location {LOCATION} does not load: "
                                   f"{first_line(message) or 'no error message'} (log: {self.logs / 'code-server.log'})")
            return False

        self._until("webserver", "webserver", loaded)

    def _wait_for_daemon(self) -> None:
        query = "{ instance { daemonHealth { daemonStatus(daemonType: \"QUEUED_RUN_COORDINATOR\") { healthy } } } }"
        self._until("daemon", "daemon",
                    lambda: self.graphql(query, timeout=10)["instance"]["daemonHealth"]["daemonStatus"]["healthy"])

    def stop(self) -> None:
        """Daemon first (it launches nothing more), then webserver, then code server."""
        for name in ("daemon", "webserver", "code-server"):
            if name in self.processes:
                proc, started, _ = self.processes[name]
                _stop_group(proc.pid, started)
                proc.poll()
        self.processes.clear()
        state_file = self.logs / "console.json"
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            state = {}
        state.update(processes={}, stopped_at=time.time())
        if self.logs.exists():
            state_file.write_text(json.dumps(state, indent=1))

    # -- GraphQL ---------------------------------------------------------------------------

    def graphql(self, query: str, variables: dict[str, Any] | None = None, timeout: float = 60) -> dict[str, Any]:
        r = httpx.post(f"{self.url}/graphql", json={"query": query, "variables": variables or {}}, timeout=timeout)
        r.raise_for_status()
        body = r.json()
        if body.get("errors"):
            raise ConsoleError(f"GraphQL error from {self.url}: {body['errors'][0].get('message')}")
        return body["data"]

    def launch(self, job: str, partition: str | None = None, run_config: dict[str, Any] | None = None,
               tags: Mapping[str, str] | None = None, assets: list[str] | None = None) -> str:
        """Submit `job` (for one partition, only `assets` of it if given) through the code location;
        returns the run id."""
        all_tags = {**(tags or {}), **({"dagster/partition": partition} if partition else {})}
        selector: dict[str, Any] = {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY, "jobName": job}
        if assets:
            selector["assetSelection"] = [{"path": [a]} for a in assets]
        params = {
            "selector": selector,
            "runConfigData": run_config or {},
            "executionMetadata": {"tags": [{"key": k, "value": v} for k, v in all_tags.items()]},
        }
        data = self.graphql(
            "mutation($p: ExecutionParams!) { launchRun(executionParams: $p) { __typename "
            "... on LaunchRunSuccess { run { runId } } "
            "... on RunConfigValidationInvalid { errors { message } } "
            "... on Error { message } } }", {"p": params})["launchRun"]
        if data["__typename"] == "LaunchRunSuccess":
            return data["run"]["runId"]
        detail = data.get("message") or "; ".join(e["message"] for e in data.get("errors", [])) or data["__typename"]
        raise ConsoleError(f"{job}{f'[{partition}]' if partition else ''}: not launched: {detail}")

    def terminate(self, run_id: str, wait_s: float = 120.0) -> str:
        """Ask Dagster to terminate the run: its steps see the interruption and run their undo.
        Dagster refuses a run that is STARTING (launched, its process not yet running): asked again
        each second until it has started or ended, up to `wait_s`. Returns "" once the request was
        accepted, else Dagster's reason."""
        deadline = time.monotonic() + wait_s
        while True:
            said = self.graphql(
                "mutation($r: String!) { terminateRun(runId: $r) { __typename "
                "... on TerminateRunFailure { message } ... on RunNotFoundError { message } "
                "... on PythonError { message } } }", {"r": run_id})["terminateRun"]
            if said["__typename"] == "TerminateRunSuccess":
                return ""
            why = said.get("message") or said["__typename"]
            if "STARTING" not in why and "NOT_STARTED" not in why or time.monotonic() > deadline:
                return why
            time.sleep(1.0)

    def run(self, instance: Any, job: str, partition: str | None = None, run_config: dict[str, Any] | None = None,
            timeout_s: float = 3600.0, progress: Callable[[str], None] = print) -> RunOutcome:
        """Launch, then follow the run's steps until it ends or `timeout_s` pass (then terminate it).
        A Ctrl-C terminates the run, follows it to its end (its undo runs first), says how it ended,
        then propagates."""
        run_id = self.launch(job, partition, run_config)
        progress(f"    run {run_id[:8]} queued: {self.url}/runs/{run_id}")
        try:
            return follow_run(instance, run_id, timeout_s, progress, self._check_alive, self.terminate)
        except KeyboardInterrupt:
            progress(f"    interrupted: terminating run {run_id[:8]}; its steps run their undo before it ends "
                     f"(a second Ctrl-C stops the console and the run with it)")
            refused = self.terminate(run_id)
            if refused:
                progress(f"    Dagster did not terminate run {run_id[:8]} ({refused}): following it to its end")
            follow_run(instance, run_id, TERMINATE_WAIT_S, progress, self._check_alive, None)
            status = instance.get_run_by_id(run_id).status
            progress(f"    run {run_id[:8]} ended {status.value}" + (
                "" if status.value == "CANCELED" else " (it finished before the termination took effect)"
                if status.value in ("SUCCESS", "FAILURE") else f" after {TERMINATE_WAIT_S:.0f} s: see {self.url}/runs/{run_id}"))
            raise
