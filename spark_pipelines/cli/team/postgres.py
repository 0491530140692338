"""The team instance's PostgreSQL: Debian's server binaries, one cluster on loopback under the
team's root, started and stopped by `team up` / `team down`. The database outlives both.

The server refuses to run as root, so as root every server command runs as the `postgres` user
the Debian package creates. The password (scram-sha-256 on TCP) is made once, kept in a 0600 file
beside the cluster and handed to Dagster's processes as DAGSTER_PG_PASSWORD; it is never written
into a config file or printed.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"
USER = "dagster"
DB = "dagster"
SERVER_USER = "postgres"  # the Debian package's; the server refuses root
START_TIMEOUT_S = 60
COMMAND_TIMEOUT_S = 120


class PostgresError(Exception):
    """The team database could not be set up or started; the message names the step and the log."""


def pg_bin() -> Path:
    """Debian's versioned server binaries (postgresql-15 on Debian 12), or SPARK_PG_BIN."""
    if os.environ.get("SPARK_PG_BIN"):
        return Path(os.environ["SPARK_PG_BIN"])
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not found:
        raise PostgresError("PostgreSQL's server is not installed: apt-get install postgresql "
                            "(scripts/bootstrap.sh team does it)")
    return found[-1].parent


@dataclass
class Postgres:
    root: Path  # <team root>/postgres: data/, run/ (socket), server.log, the password file
    port: int

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    @property
    def password_file(self) -> Path:
        return self.root / "password"

    def password(self) -> str:
        return self.password_file.read_text().strip()

    def env(self) -> dict[str, str]:
        """What Dagster's processes and runs read through the dagster.yaml's `env:` entries."""
        return {"DAGSTER_PG_HOST": HOST, "DAGSTER_PG_PORT": str(self.port), "DAGSTER_PG_USER": USER,
                "DAGSTER_PG_PASSWORD": self.password(), "DAGSTER_PG_DB": DB}

    # -- commands ----------------------------------------------------------------------------

    def _as_server_user(self, argv: list[str]) -> list[str]:
        if os.geteuid() != 0:
            return argv
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            raise PostgresError(f"running as root needs the '{SERVER_USER}' user: apt-get install postgresql") from None
        return ["runuser", "-u", SERVER_USER, "--", *argv]

    def _run(self, argv: list[str], what: str, env: dict[str, str] | None = None, server_user: bool = True) -> str:
        full = self._as_server_user(argv) if server_user else argv
        try:
            p = subprocess.run(full, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                               env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise PostgresError(f"{what} did not finish within {COMMAND_TIMEOUT_S} s (log: {self.log_path})") from None
        if p.returncode != 0:
            tail = " | ".join((p.stderr or p.stdout).strip().splitlines()[-3:])
            raise PostgresError(f"{what} failed (exit {p.returncode}): {tail} (log: {self.log_path})")
        return p.stdout

    def _own(self, path: Path) -> None:
        if os.geteuid() == 0:
            pw = pwd.getpwnam(SERVER_USER)
            os.chown(path, pw.pw_uid, pw.pw_gid)

    # -- lifecycle ---------------------------------------------------------------------------

    def initialized(self) -> bool:
        return (self.data / "PG_VERSION").exists()

    def init(self) -> None:
        """A new cluster with the `dagster` superuser behind a fresh password (once)."""
        bin_dir = pg_bin()
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # the server user must reach data/ and run/ below
        if not self.password_file.exists():
            fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(24) + "\n")
        for d in (self.data, self.root / "run"):
            d.mkdir(mode=0o700, exist_ok=True)
            self._own(d)
        # initdb reads the password from a file the server user can read; it lives only as long
        # as initdb runs.
        pwfile = self.root / "run" / "initdb-password"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.password() + "\n")
        self._own(pwfile)
        try:
            self._run([str(bin_dir / "initdb"), "-D", str(self.data), "-U", USER, "--pwfile", str(pwfile),
                       "--auth-host=scram-sha-256", "--auth-local=scram-sha-256", "-E", "UTF8",
                       "--locale=C.UTF-8"], "initdb of the team database")
        finally:
            pwfile.unlink(missing_ok=True)

    def running(self) -> bool:
        pidfile = self.data / "postmaster.pid"
        if not pidfile.exists():
            return False
        try:
            pid = int(pidfile.read_text().splitlines()[0])
            os.kill(pid, 0)
        except (ValueError, IndexError, OSError):
            return False
        return True

    def start(self) -> None:
        """Start the server on 127.0.0.1:port (a no-op when it runs), then create the database."""
        if not self.initialized():
            self.init()
        if not self.running():
            if not self.log_path.exists():
                self.log_path.touch()
            self._own(self.log_path)
            options = f"-c listen_addresses={HOST} -p {self.port} -k {self.root / 'run'}"
            self._run([str(pg_bin() / "pg_ctl"), "-D", str(self.data), "-l", str(self.log_path), "-o", options,
                       "-w", "-t", str(START_TIMEOUT_S), "start"], f"starting PostgreSQL on {HOST}:{self.port}")
        self._create_database()

    def _psql(self, sql: str, db: str = "postgres") -> str:
        env = {"PGPASSWORD": self.password(), "PGCONNECT_TIMEOUT": "10"}
        return self._run([str(pg_bin() / "psql"), "-h", HOST, "-p", str(self.port), "-U", USER, "-d", db,
                          "-At", "-v", "ON_ERROR_STOP=1", "-c", sql], "psql", env=env, server_user=False)

    def _create_database(self) -> None:
        if self._psql(f"SELECT 1 FROM pg_database WHERE datname = '{DB}'").strip() != "1":
            self._psql(f'CREATE DATABASE "{DB}"')

    def query(self, sql: str) -> list[list[str]]:
        """Rows of a query on the Dagster database (tests and `team status` read back through it)."""
        out = self._psql(sql, db=DB)
        return [line.split("|") for line in out.splitlines() if line]

    def stop(self) -> None:
        """Fast shutdown (open sessions are ended, committed data stays); a no-op when stopped."""
        if self.running():
            self._run([str(pg_bin() / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t",
                       str(START_TIMEOUT_S), "stop"], "stopping PostgreSQL")

    def destroy(self) -> None:
        """Stop and delete the cluster and its password (tests only: `team down` keeps both)."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
