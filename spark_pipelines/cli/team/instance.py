"""The team instance on one machine: PostgreSQL, the Dagster daemon and webserver, the code
location as a gRPC server in the code-location image, and every run in its own container
(DockerRunLauncher), all on loopback. `up` brings it up and returns (the processes stay, detached);
`down` stops the processes and containers and keeps the database.

Layout under the team root (SPARK_TEAM_ROOT, default /var/lib/spark-pipelines/team):
  home/          DAGSTER_HOME: the rendered dagster.yaml, compute logs, the console's logs
  postgres/      the cluster, its log and its password file (0600)
  docker/        the team's own dockerd (unless DOCKER_HOST names an engine)
  team.json      ports, image and URL of the last `up`
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from spark_pipelines.cli.console import HOST, Console, code_server_args, stop_leftovers
from spark_pipelines.core.fleet import Fleet, load_fleet
from spark_pipelines.resources.hub import TOKEN_ENV
from spark_pipelines.cli.team import image as team_image
from spark_pipelines.cli.team.engine import EngineError, TeamEngine
from spark_pipelines.cli.team.postgres import Postgres

ROOT_ENV = "SPARK_TEAM_ROOT"
DEFAULT_ROOT = "/var/lib/spark-pipelines/team"
WEB_PORT = 3000
TEMPLATE = Path(__file__).with_name("dagster.yaml")
TEAM_LABEL = "spark-pipelines.team"  # on every container the team starts: `down` finds them by it
# Handed to the code server and to every run by name (values stay in the daemon's environment).
INSTANCE_ENV = ("DAGSTER_PG_HOST", "DAGSTER_PG_PORT", "DAGSTER_PG_USER", "DAGSTER_PG_PASSWORD", "DAGSTER_PG_DB",
                "DAGSTER_HOME", "SPARK_FLEET")


def default_root() -> Path:
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT)


@dataclass(frozen=True)
class Mount:
    path: str  # the same path inside the container: the fleet file names keys by their host paths
    writable: bool = False


def secret_mounts(fleet: Fleet, fleet_path: str, home: Path) -> list[Mount]:
    """What a run reads from this machine: the fleet file, each node's SSH key and known_hosts
    (read-only: host keys are verified, never added), and DAGSTER_HOME (compute logs)."""
    paths = {str(Path(fleet_path).resolve())}
    for node in fleet.nodes:
        for p in (node.key_path, node.known_hosts):
            # A missing path is not mounted (docker would create a directory there); the node's
            # runs then fail to connect with the SSH layer's message naming the file.
            if p and Path(p).expanduser().is_file():
                paths.add(str(Path(p).expanduser().resolve()))
    return [Mount(p) for p in sorted(paths)] + [Mount(str(home), writable=True)]


def secret_env_names(fleet: Fleet, environ: Iterable[str]) -> list[str]:
    """Secrets the runs need, by name, where this environment sets them: the gateway key, HF_TOKEN."""
    present = set(environ)
    return [n for n in (fleet.gateway.master_key_env, TOKEN_ENV) if n in present]


def render_instance_config(template: str, image_ref: str, env_names: Iterable[str], mounts: Iterable[Mount],
                           label: str) -> str:
    """The team's dagster.yaml: the template with the run launcher's per-machine values."""
    cfg = yaml.safe_load(template)
    launcher = cfg["run_launcher"]["config"]
    launcher["image"] = image_ref
    launcher["env_vars"] = sorted(set(env_names))
    kwargs = launcher.setdefault("container_kwargs", {})
    kwargs["volumes"] = {m.path: {"bind": m.path, "mode": "rw" if m.writable else "ro"} for m in mounts}
    kwargs["labels"] = {TEAM_LABEL: label}
    header = ("# Written by `spark-pipelines team up` from spark_pipelines/cli/team/dagster.yaml; edit the template.\n")
    return header + yaml.safe_dump(cfg, sort_keys=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/server_info", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _docker(docker_host: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "DOCKER_HOST": docker_host})
    except FileNotFoundError:
        raise EngineError("the docker CLI is not installed: scripts/bootstrap.sh base") from None
    except subprocess.TimeoutExpired:
        raise EngineError(f"`docker {args[0]}` on {docker_host} did not answer within {timeout:.0f} s: "
                          "is its dockerd frozen?") from None


@dataclass
class Team:
    root: Path = field(default_factory=default_root)
    web_port: int = WEB_PORT
    log: Callable[[str], None] = print

    def __post_init__(self) -> None:
        self.root = Path(self.root).resolve()

    @property
    def home(self) -> Path:
        return self.root / "home"

    @property
    def state_file(self) -> Path:
        return self.root / "team.json"

    @property
    def label(self) -> str:
        return hashlib.sha256(str(self.root).encode()).hexdigest()[:12]

    def state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def _save(self, **values: object) -> None:
        self.state_file.write_text(json.dumps({**self.state(), **values}, indent=1))

    @property
    def postgres(self) -> Postgres:
        """The team's database (its port chosen once, on the first `up`; 0 before that)."""
        return Postgres(self.root / "postgres", int(self.state().get("pg_port") or 0))

    def _first_up(self) -> None:
        if not self.state().get("pg_port"):
            self.root.mkdir(parents=True, exist_ok=True)
            self.root.chmod(0o755)  # PostgreSQL's user walks through it to its cluster
            self._save(pg_port=_free_port())

    @property
    def engine(self) -> TeamEngine:
        return TeamEngine(self.root / "docker")

    def docker_host(self, start: bool = True) -> str | None:
        if os.environ.get("DOCKER_HOST"):
            return os.environ["DOCKER_HOST"]
        return self.engine.start() if start else (self.engine.host if self.engine.pid() else None)

    def instance_env(self) -> dict[str, str]:
        """The environment of the daemon, the webserver, the code server and (by name) each run."""
        return {**self.postgres.env(), "DAGSTER_HOME": str(self.home)}

    # -- up ----------------------------------------------------------------------------------

    def up(self, fleet_path: str) -> str:
        """Bring the instance up for `fleet_path`; returns the UI's URL. The processes stay."""
        fleet_path = str(Path(fleet_path).resolve())
        fleet = load_fleet(fleet_path)
        state = self.state()
        if state.get("url") and state.get("fleet") == fleet_path and _answers(state["url"]):
            self.log(f"team: already up at {state['url']} (image {state.get('image')}); `make team-down` stops it")
            return state["url"]
        self._first_up()
        if (self.home / "console" / "console.json").exists():
            stop_leftovers(self.home, self.log)  # a previous `up` not brought down: restart it
        self.log(f"team: PostgreSQL on {HOST}:{self.postgres.port} ({self.postgres.data})")
        self.postgres.start()
        env = {**self.instance_env(), "SPARK_FLEET": fleet_path}
        os.environ.update(env)  # this process reads the instance too (the daemon-heartbeat check)
        docker_host = self.docker_host()
        self.log(f"team: Docker engine {docker_host}")
        built = team_image.build(docker_host, log=self.log)
        self.log(f"team: image {built.ref} ({built.size_bytes / 1e6:.0f} MB, id {built.image_id[7:19]}, "
                 f"{'built' if built.built else 'up to date'} in {built.seconds:.0f} s)")
        self.home.mkdir(parents=True, exist_ok=True)
        mounts = secret_mounts(fleet, fleet_path, self.home)
        names = [*INSTANCE_ENV, *secret_env_names(fleet, os.environ)]
        (self.home / "dagster.yaml").write_text(
            render_instance_config(TEMPLATE.read_text(), built.ref, names, mounts, self.label))
        _docker(docker_host, "rm", "-f", self._code_server_name())  # one a killed `up` left
        console = Console(self.home, fleet_path, env={**env, "DOCKER_HOST": docker_host}, web_port=self.web_port,
                          log=self.log, code_server=lambda port: self._code_server_argv(built.ref, port, names, mounts))
        console.start()
        console.detach()
        self._save(url=console.url, image=built.ref, image_size_bytes=built.size_bytes, docker_host=docker_host,
                   fleet=fleet_path)
        self.log(f"team: the Dagster UI is at {console.url} (stop with `make team-down`; the database stays)")
        return console.url

    def _code_server_name(self) -> str:
        return f"spark-team-code-server-{self.label}"

    def _code_server_argv(self, ref: str, port: int, env_names: list[str], mounts: list[Mount]) -> list[str]:
        # Foreground `docker run`: stopping its process group stops the container (signals are
        # proxied) and --rm removes it. DAGSTER_CURRENT_IMAGE puts the image in the location's
        # origin, so every run is launched from the very image the code server runs.
        argv = ["docker", "run", "--rm", "--name", self._code_server_name(), "--network", "host",
                "--label", f"{TEAM_LABEL}={self.label}", "-e", f"DAGSTER_CURRENT_IMAGE={ref}"]
        for name in env_names:
            argv += ["-e", name]  # the value comes from this environment, never from the argv
        for m in mounts:
            argv += ["-v", f"{m.path}:{m.path}:{'rw' if m.writable else 'ro'}"]
        return [*argv, ref, "dagster", *code_server_args(port)]

    # -- down --------------------------------------------------------------------------------

    def down(self) -> list[str]:
        """Stop the daemon, webserver and code server, then the team's containers and engine,
        then PostgreSQL. The database and the image stay. Returns what was stopped."""
        if not self.state():
            self.log(f"team: no team instance in {self.root}")
            return []
        stopped = stop_leftovers(self.home, self.log)
        docker_host = self.docker_host(start=False)
        if docker_host:
            ids = _docker(docker_host, "ps", "-aq", "--filter", f"label={TEAM_LABEL}={self.label}").stdout.split()
            if ids:
                # A run still going gets the launcher's stop_timeout to run its undo before SIGKILL.
                grace = int(yaml.safe_load(TEMPLATE.read_text())["run_launcher"]["config"]["container_kwargs"]
                            ["stop_timeout"])
                _docker(docker_host, "stop", "-t", str(grace), *ids, timeout=grace + 120)
                _docker(docker_host, "rm", "-f", *ids)
                stopped.append(f"{len(ids)} container(s)")
            if not os.environ.get("DOCKER_HOST") and self.engine.stop():
                stopped.append("dockerd")
        if self.postgres.running():
            self.postgres.stop()
            stopped.append("PostgreSQL")
        self._save(url=None)
        self.log(f"team: stopped {', '.join(stopped) or 'nothing (not running)'}; database kept in {self.postgres.data}")
        return stopped
