"""The LiteLLM gateway host: change the proxy config, reload the proxy, read its health.

Without a database LiteLLM has no runtime API to add or remove a deployment (its model API needs
Prisma's query engine, downloaded at first use: not offline), so changing a pool means rewriting
the config and reloading: gracefully (`gateway.reload: graceful`, SIGHUP to the proxy's gunicorn
master; the old worker finishes its streams) or by a restart (the runbook's `docker compose
restart litellm`, which drops every stream in flight). Either way the change is confirmed on the
running proxy's /model/info, never assumed.

Every change is ONE remote command under `flock -w` on `<config>.lock` on the gateway host, so
changes and reloads from any run or process never overlap (two overlapping proxy restarts once
failed with "address already in use"). The command writes only if the file still has the digest
this process read (optimistic concurrency: otherwise re-read, recompute, bounded retries), keeps
the file it replaces as `<config>.previous` (and the last few in `<config>.history/`), renames a
temp file into place (atomic), and reloads with a timeout. Reads are a command with a timeout too
(no SFTP: it has none). The master key reaches the reload command on stdin, never argv or logs.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dagster as dg
import httpx
from pydantic import Field

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core.launch import expand_home
from spark_pipelines.core.remote import TIMEOUT_EXIT_CODES
from spark_pipelines.resources.ssh import GATEWAY_KEY, FleetSession, FleetSSH, RemoteError
from spark_pipelines.core.errors import RunbookError

HISTORY_KEEP = 5  # timestamped copies in <config>.history/ besides <config>.previous
WRITE_RETRIES = 5  # re-reads after another run changed the config between our read and write
READ_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 5.0
# A graceful reload serves the new config within a few hundred ms: a drain is confirmed that soon.
SERVING_POLL_S = 0.2

EXIT_CHANGED, EXIT_LOCK, EXIT_WRITE, EXIT_RELOAD, EXIT_RELOAD_ROLLED_BACK = 75, 76, 70, 73, 72

_READ = r'''f=$1
if [ -f "$f" ]; then sha256sum < "$f" | cut -c1-64; cat -- "$f"; else echo absent; fi'''

# $1 config  $2 digest expected  $3 rollback (1/0)  $4 history kept  $5 key env name
# $6 reload dir  $7 reload timeout (s)  $8.. reload argv.  stdin: key line, then the config.
_APPLY = r'''set -u
cfg=$1 want=$2 rollback=$3 keep=$4 keyenv=$5 rdir=$6 rtimeout=$7; shift 7
IFS= read -r key || key=""
tmp="$cfg.tmp-$$"
cat > "$tmp" || { rm -f "$tmp"; echo "cannot write $tmp" >&2; exit 70; }
have=absent; [ -f "$cfg" ] && have=$(sha256sum < "$cfg" | cut -c1-64)
if [ "$have" != "$want" ]; then rm -f "$tmp"; echo "config changed since read" >&2; exit 75; fi
chmod 600 "$tmp"
if [ "$have" != absent ]; then
  cp -p "$cfg" "$cfg.previous.tmp-$$" && mv -f "$cfg.previous.tmp-$$" "$cfg.previous" || { rm -f "$tmp"; echo "cannot keep $cfg.previous" >&2; exit 70; }
  mkdir -p "$cfg.history" && cp -p "$cfg" "$cfg.history/$(date -u +%Y%m%dT%H%M%S%N)" \
    && ls -1 "$cfg.history" | sort | head -n -"$keep" | while read -r old; do rm -f "$cfg.history/$old"; done
fi
mv -f "$tmp" "$cfg" || { rm -f "$tmp"; echo "cannot rename into $cfg" >&2; exit 70; }
echo "config written"
[ -n "$key" ] && export "$keyenv=$key"
[ -n "$rdir" ] && { cd "$rdir" || exit 73; }
timeout -k 10 "$rtimeout" "$@"; rc=$?
[ $rc -eq 0 ] && { echo "reloaded"; exit 0; }
echo "reload exited $rc" >&2
if [ "$rollback" = 1 ] && [ "$have" != absent ]; then
  cp -p "$cfg.previous" "$tmp" && mv -f "$tmp" "$cfg"
  timeout -k 10 "$rtimeout" "$@"; rc2=$?
  echo "previous config put back; its reload exited $rc2" >&2
  exit 72
fi
exit 73'''


class GatewayError(RunbookError):
    pass


class GatewayUnreachable(GatewayError, RemoteError):
    """The gateway host did not answer over SSH (callers that catch RemoteError still do)."""


class GatewayAuthError(GatewayError):
    pass


class ConfigChanged(Exception):
    """The config on the host is no longer the one read: re-read and recompute."""


@dataclass
class Snapshot:
    """The config on the gateway host as read: parsed, its drain notes, and its digest."""

    config: dict[str, Any] | None
    drains: dict[str, str] = field(default_factory=dict)
    digest: str = "absent"

    @property
    def rotation(self) -> list[str]:
        return gateway_core.nodes_in_rotation(self.config)


# compute(snapshot) -> (new config, new drain notes), or None for "nothing to change"
Change = Callable[[Snapshot], "tuple[dict[str, Any], dict[str, str]] | None"]


class GatewayHost:
    def __init__(self, session: FleetSession, ready_timeout_s: float = 90.0, master_key: str | None = None,
                 lock_wait_s: float = 600.0, reload_timeout_s: float = 300.0, rotation_wait_s: float = 1200.0,
                 poll_s: float = 5.0) -> None:
        self.session = session
        self.fleet = session.fleet
        self.gw = session.fleet.gateway
        self.ready_timeout_s = ready_timeout_s
        # The procedures (a deploy's drain, a quarantine) build their own host: the key comes
        # from the same environment variable the litellm resource binds (never from a file or argv).
        self._master_key = master_key or os.environ.get(self.gw.master_key_env) or None
        self.lock_wait_s = lock_wait_s
        self.reload_timeout_s = reload_timeout_s
        self.rotation_wait_s = rotation_wait_s
        self.poll_s = poll_s

    @property
    def base_url(self) -> str:
        host = self.gw.host if ":" not in self.gw.host else f"[{self.gw.host}]"
        return f"http://{host}:{self.gw.proxy_port}"

    @property
    def config_path(self) -> str:
        return expand_home(self.gw.config_path, self.gw.home_dir)

    def master_key(self) -> str | None:
        return self._master_key

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._master_key}"} if self._master_key else {}

    # -- reading --

    def _run(self, argv: list[str], what: str, **kw: Any):
        """One command on the gateway host; an unreachable host or a hung command is one clear
        GatewayError (a RunbookError the assets turn into a failure)."""
        try:
            return self.session.run(GATEWAY_KEY, argv, **kw)
        except RemoteError as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise GatewayUnreachable(f"gateway {self.gw.host}: {what} failed: {first}; check sshd and the "
                               f"proxy on the gateway host") from None

    def read(self) -> Snapshot:
        r = self._run(["sh", "-c", _READ, "gateway-read", self.config_path], f"reading {self.config_path}",
                      timeout=READ_TIMEOUT_S, log=False)
        head, _, text = r.stdout.partition("\n")
        if head.strip() == "absent":
            return Snapshot(None)
        try:
            config = gateway_core.load(text)
        except ValueError as e:
            raise GatewayError(f"gateway {self.gw.host}: {self.config_path}: {e}") from None
        return Snapshot(config, gateway_core.load_drains(text), head.strip())

    def read_config(self) -> dict[str, Any] | None:
        return self.read().config

    def rotation(self) -> list[str]:
        return self.read().rotation

    # -- changing --

    def _write(self, snap: Snapshot, text: str, rollback: bool) -> None:
        argv = ["flock", "-w", str(int(self.lock_wait_s)), "-E", str(EXIT_LOCK), f"{self.config_path}.lock",
                "sh", "-c", _APPLY, "gateway-apply", self.config_path, snap.digest, "1" if rollback else "0",
                str(HISTORY_KEEP), self.gw.master_key_env,
                expand_home(self.gw.reload_dir, self.gw.home_dir) if self.gw.reload_dir else "",
                str(int(self.reload_timeout_s)), *self.gw.reload_command]
        stdin = (self._master_key or "") + "\n" + text
        timeout = self.lock_wait_s + 2 * (self.reload_timeout_s + 10) + 60
        # The script itself is not worth a log line per run; what it did is.
        how = ("graceful reload: streams in flight finish" if self.gw.reload == "graceful" else
               "proxy restart: every stream in flight is dropped (gateway.reload: graceful avoids it)")
        self.session.log.info(f"[{GATEWAY_KEY}] change {self.config_path} under {self.config_path}.lock, then "
                              f"{' '.join(self.gw.reload_command)} ({how})")
        r = self._run(argv, f"changing {self.config_path}", stdin=stdin, timeout=timeout, check=False,
                      log=lambda line: self.session.log.info(line) if "$ " not in line[:40] else None)
        if r.exit_status == 0:
            return
        if r.exit_status == EXIT_CHANGED:
            raise ConfigChanged()
        where = f"gateway {self.gw.host}"
        tail = r.tail.strip().splitlines()[-3:]
        detail = " / ".join(tail) or f"exit {r.exit_status}"
        if r.exit_status in TIMEOUT_EXIT_CODES:
            raise GatewayError(f"{where}: the config change and reload did not end within {timeout:.0f} s and "
                               f"were killed; check the proxy and {self.config_path} on the gateway host")
        if r.exit_status == EXIT_LOCK:
            raise GatewayError(f"{where}: another change of {self.config_path} held its lock for more than "
                               f"{self.lock_wait_s:.0f} s; nothing was changed (check for a hung reload there)")
        if r.exit_status == EXIT_RELOAD_ROLLED_BACK:
            raise GatewayError(f"{where}: the proxy reload ({' '.join(self.gw.reload_command)}) failed after "
                               f"the config was written; the previous config was put back ({detail}); check "
                               f"the proxy's logs on the gateway host")
        if r.exit_status == EXIT_RELOAD:
            raise GatewayError(f"{where}: the new config was written but the proxy reload "
                               f"({' '.join(self.gw.reload_command)}) failed ({detail}); check the proxy's "
                               f"logs on the gateway host")
        raise GatewayError(f"{where}: the config change failed ({detail}); {self.config_path} is as it was")

    def change(self, compute: Change, rollback: bool) -> tuple[Snapshot, dict[str, Any], bool]:
        """Read, compute, write and reload, retried while other runs change the config in between.
        Returns (the snapshot it was computed from, the config now on the host, reloaded?). An
        unchanged config on a ready proxy is left alone (a restart drops in-flight streams)."""
        for _ in range(WRITE_RETRIES):
            snap = self.read()
            new = compute(snap)
            if new is None:
                return snap, snap.config or {}, False
            config, drains = new
            if snap.config is not None and config == snap.config and drains == snap.drains and self.ready():
                self.session.log.info(f"[{GATEWAY_KEY}] LiteLLM config unchanged and proxy ready; not reloaded")
                return snap, config, False
            try:
                self._write(snap, gateway_core.dump(config, drains), rollback)
            except ConfigChanged:
                self.session.log.info(f"[{GATEWAY_KEY}] LiteLLM config changed by another run meanwhile; re-reading")
                continue
            self._confirm_reload()
            return snap, config, True
        raise GatewayError(f"gateway {self.gw.host}: {self.config_path} kept changing under this run "
                           f"({WRITE_RETRIES} attempts); nothing was changed by it, retry")

    def apply(self, config: dict[str, Any], current: dict[str, Any] | None = None) -> bool:
        """Write exactly `config` (keeping the drain notes on the host) and reload."""
        return self.change(lambda snap: (config, snap.drains), rollback=True)[2]

    def set_rotation(self, nodes: list[str], floor: int | None = None) -> tuple[dict[str, Any], bool]:
        """The gateway step: owned entries for exactly `nodes`, the operator's entries and settings
        kept. Refused (nothing written) below `floor` (default: the fleet's min_in_rotation, at
        least 1). Returns (the config now serving, whether the proxy was reloaded for it)."""
        floor = max(1, self.gw.min_in_rotation if floor is None else floor)
        if len(nodes) < floor:
            raise gateway_core.RotationRefused(
                f"the rotation would have {len(nodes)} node(s) ({', '.join(nodes) or 'none'}), below "
                f"gateway.min_in_rotation={floor}: the gateway config was NOT rewritten (the proxy keeps its pools)")

        def compute(snap: Snapshot):
            drains = {n: why for n, why in snap.drains.items() if n not in nodes}
            return gateway_core.render_config(self.fleet, nodes, snap.config), drains

        _, config, reloaded = self.change(compute, rollback=True)
        return config, reloaded

    def drain(self, node: str, reason: str = "drained", wait_s: float | None = None, *,
              dead: bool = False, deploying: bool = False) -> list[str]:
        """Take one node out of every pool, once the rotation can spare it: waits up to `wait_s`
        (default rotation_wait_s) for other nodes to come back, then refuses naming who is out.
        `dead=True` (the node does not serve) skips the floor: a dead backend is no backend, and
        waiting would only keep clients routed to it. `deploying=True` (a serving node about to be
        redeployed) also waits while rollout.max_unavailable other nodes are out for a deploy.
        Confirmed: returns once the reloaded proxy no longer lists the node. Returns the rotation before."""
        deadline = time.monotonic() + (self.rotation_wait_s if wait_s is None else wait_s)
        note = f"{reason} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
        while True:
            refusal: list[str] = []
            written: list[dict] = []
            stuck: list[bool] = []

            def compute(snap: Snapshot):
                if snap.config is None or node not in snap.rotation:
                    return None
                after = gateway_core.drain(snap.config, node)
                written[:] = [after]
                if dead:
                    return after, {**snap.drains, node: note}
                left = gateway_core.nodes_in_rotation(after)
                why = gateway_core.rotation_refusal(self.fleet, snap.rotation, left, snap.drains)
                if why:
                    # Only a drained node comes back by itself (its bench or deploy ends); a node
                    # the gateway step left out does not: if those cannot lift the floor, waiting
                    # cannot help.
                    back = [n for n in snap.drains if n != node and n not in left]
                    stuck[:] = [len(left) + len(back) < self.gw.min_in_rotation]
                elif deploying:
                    why = gateway_core.deploy_refusal(self.fleet, node, snap.drains)
                if why:
                    refusal.append(why)
                    return None
                return after, {**snap.drains, node: note}

            snap, _, _ = self.change(compute, rollback=True)
            hopeless = len(self.fleet.serve_nodes) <= self.gw.min_in_rotation or any(stuck)
            if refusal and hopeless:
                raise gateway_core.RotationRefused(refusal[-1])
            if not refusal:
                if node in snap.rotation:
                    if written and not written[-1].get("model_list"):
                        # The last model left (a dead node, dead=True): LiteLLM answers /model/info
                        # with HTTP 500 on an empty list, so readiness is the confirmation.
                        self.wait_ready()
                    else:
                        self.wait_serving(node, present=False)
                return snap.rotation
            if time.monotonic() >= deadline:
                raise gateway_core.RotationRefused(refusal[-1])
            self.session.log.info(f"[{GATEWAY_KEY}] waiting to drain {node}: {refusal[-1]}")
            time.sleep(self.poll_s)

    def note(self, node: str, reason: str) -> None:
        """Replace a drained node's drain note. The notes live in the config file, so the proxy is
        reloaded though its pools stay: used only when a failed deploy keeps its node out."""
        text = f"{reason} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"

        def compute(snap: Snapshot):
            if snap.config is None or node not in snap.drains:
                return None
            return snap.config, {**snap.drains, node: text}

        self.change(compute, rollback=False)

    def restore(self, node: str) -> None:
        """Put one node back into every pool (its drain note cleared); never refused. Not rolled back
        on a failed reload: the node stays in the file, so the next reload serves it."""

        def compute(snap: Snapshot):
            base = snap.config if snap.config is not None else gateway_core.render_config(self.fleet, [])
            return gateway_core.restore(base, self.fleet, node), {n: w for n, w in snap.drains.items() if n != node}

        _, _, reloaded = self.change(compute, rollback=False)
        if reloaded:
            self.wait_serving(node, present=True)

    # -- the proxy --

    def _confirm_reload(self) -> None:
        """Ready after the reload; a graceful one not ready within graceful_confirm_s is followed
        by a restart (the proxy may have died on the SIGHUP, or its new worker hung)."""
        if self.gw.reload != "graceful":
            self.wait_ready()
            return
        if self.wait_ready(self.gw.graceful_confirm_s, raise_=False):
            return
        cmd = " ".join(self.gw.restart_command)
        self.session.log.warning(f"[{GATEWAY_KEY}] LiteLLM on {self.gw.host} not ready {self.gw.graceful_confirm_s} s "
                                 f"after the graceful reload: restarting it ({cmd}); streams in flight are dropped")
        argv = ["flock", "-w", str(int(self.lock_wait_s)), f"{self.config_path}.lock", "timeout",
                str(int(self.reload_timeout_s)), *self.gw.restart_command]
        if self.gw.reload_dir:
            argv = ["env", "-C", expand_home(self.gw.reload_dir, self.gw.home_dir), *argv]
        r = self._run(argv, "restarting the proxy", timeout=self.lock_wait_s + self.reload_timeout_s + 60, check=False)
        if r.exit_status != 0:
            raise GatewayError(f"gateway {self.gw.host}: the proxy was not ready after the graceful reload and its "
                               f"restart ({cmd}) failed ({' / '.join(r.tail.strip().splitlines()[-2:]) or r.exit_status}); "
                               "check the proxy on the gateway host")
        self.wait_ready()

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health/readiness", timeout=HTTP_TIMEOUT_S).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self, timeout_s: float | None = None, raise_: bool = True) -> bool:
        timeout_s = self.ready_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.base_url}/health/readiness", timeout=HTTP_TIMEOUT_S)
                if r.status_code == 200:
                    return True
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = type(e).__name__
            time.sleep(SERVING_POLL_S)
        if not raise_:
            return False
        raise GatewayError(
            f"LiteLLM on {self.gw.host}:{self.gw.proxy_port} not ready after {timeout_s:.0f} s ({last}); "
            f"check the proxy's logs on the gateway host"
        )

    def serving_nodes(self) -> list[str]:
        """The owned nodes the running proxy has loaded (its /model/info), in its order."""
        try:
            r = httpx.get(f"{self.base_url}/model/info", headers=self._headers(), timeout=HTTP_TIMEOUT_S)
        except httpx.HTTPError as e:
            raise GatewayError(f"LiteLLM on {self.gw.host}:{self.gw.proxy_port}: /model/info unreachable "
                               f"({type(e).__name__})") from None
        if r.status_code in (401, 403):
            raise GatewayAuthError(f"LiteLLM on {self.gw.host}: /model/info refused the key (HTTP {r.status_code}): "
                               f"set {self.gw.master_key_env} to the proxy's master key")
        if r.status_code != 200:
            # LiteLLM 1.108 answers a request without a key with a 500, not a 401, when it has a
            # master key (its auth error handler fails importing prisma): say what is likely missing.
            hint = "" if self._master_key else (f"; no key was sent: if the proxy has a master_key, set "
                                                f"{self.gw.master_key_env} to it")
            raise GatewayError(f"LiteLLM on {self.gw.host}: /model/info answered HTTP {r.status_code}{hint}")
        return gateway_core.nodes_in_rotation({"model_list": r.json().get("data") or []})

    def wait_serving(self, node: str, present: bool) -> None:
        """Until the running proxy has (or no longer has) `node`: the reload took effect."""
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            try:
                serving = self.serving_nodes()
                if (node in serving) == present:
                    return
                last = f"it serves {', '.join(serving) or 'no owned node'}"
            except GatewayAuthError:
                raise
            except GatewayError as e:
                last = str(e)
            if time.monotonic() >= deadline:
                raise GatewayError(f"LiteLLM on {self.gw.host}: {node} is {'not yet back' if present else 'still'} "
                                   f"in the running proxy {self.ready_timeout_s:.0f} s after the reload ({last})")
            time.sleep(SERVING_POLL_S)


class LiteLLMGateway(dg.ConfigurableResource):
    ssh: FleetSSH
    master_key: str | None = Field(
        default=None, description="the proxy's master key: bind it with dg.EnvVar (the fleet's master_key_env)")
    ready_timeout_s: float = Field(default=90.0, description="how long a reloaded proxy may take to be ready")
    lock_wait_s: float = Field(default=600.0, description="how long a change waits for another run's change")
    rotation_wait_s: float = Field(
        default=1200.0, description="how long a drain waits for other nodes to be back before it is refused")

    def host(self) -> GatewayHost:
        return GatewayHost(self.ssh.session, self.ready_timeout_s, master_key=self.master_key,
                           lock_wait_s=self.lock_wait_s, rotation_wait_s=self.rotation_wait_s)
