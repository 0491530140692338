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

After every write the running proxy's pools are compared with the file's (the nodes each pool
routes to, from /model/info); a proxy that does not serve what the file says (a reload that failed
or did not take) is reloaded again, and a proxy still different is a GatewayError naming both. A
restart (`gateway.restart_command`) is only for a proxy that serves nothing (dead, hung, no
/model/info): restarting one that serves would fail every request for LiteLLM's start, on every
node, to change one route (the 60-minute soak's only requests failed by the pipeline). A change
that did not take is the next run's to retry. A rewrite keeps the operator's comments and layout
(core/gateway_text.py).

The same lock and the same digest-checked write serve the small files kept beside the config
(`<config><suffix>`, e.g. the quarantine records): `read_sidecar` / `change_sidecar`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
import re
from typing import Any

import dagster as dg
import httpx
from pydantic import Field

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core.errors import first_line
from spark_pipelines.core.gateway_text import Doc
from spark_pipelines.core.launch import expand_home
from spark_pipelines.core.remote import TIMEOUT_EXIT_CODES
from spark_pipelines.resources.ssh import GATEWAY_KEY, FleetSession, FleetSSH, RemoteError
from spark_pipelines.core.errors import RunbookError

HISTORY_KEEP = 5  # timestamped copies in <config>.history/ besides <config>.previous
WRITE_RETRIES = 5  # re-reads after another run changed the config between our read and write
READ_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 5.0
SIDECAR_LOCK_WAIT_S = 60.0  # a sidecar write waits this long for a config change (and its reload)
# A graceful reload serves the new config within a few hundred ms: a drain is confirmed that soon.
SERVING_POLL_S = 0.2
READY_TIMEOUT_S = 90.0  # a reloaded proxy until ready
LOCK_WAIT_S = 600.0  # a change waits this long for another run's change
RELOAD_TIMEOUT_S = 300.0
ROTATION_WAIT_S = 1200.0  # a drain waits this long for other nodes to be back before it is refused


def change_limit_s(lock_wait_s: float = LOCK_WAIT_S, reload_timeout_s: float = RELOAD_TIMEOUT_S) -> float:
    """How long one config change may take on the gateway host: the lock, the reload and the
    reload of the config put back when the first fails."""
    return lock_wait_s + 2 * (reload_timeout_s + 10) + 60

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


# $1 key env name  $2 reload dir  $3 timeout (s)  $4.. argv.  stdin: the key line.
_PROXY = r'''set -u
keyenv=$1 rdir=$2 rtimeout=$3; shift 3
IFS= read -r key || key=""
[ -n "$key" ] && export "$keyenv=$key"
[ -n "$rdir" ] && { cd "$rdir" || exit 73; }
exec timeout -k 10 "$rtimeout" "$@"'''

# $1 file  $2 digest expected.  stdin: the new content ("" removes the file).
_SIDECAR_WRITE = r'''set -u
f=$1 want=$2 tmp="$1.tmp-$$"
cat > "$tmp" || { rm -f "$tmp"; exit 70; }
have=absent; [ -f "$f" ] && have=$(sha256sum < "$f" | cut -c1-64)
if [ "$have" != "$want" ]; then rm -f "$tmp"; echo "changed since read" >&2; exit 75; fi
if [ ! -s "$tmp" ]; then rm -f "$tmp" "$f"; echo removed; exit 0; fi
chmod 600 "$tmp" && mv -f "$tmp" "$f" || { rm -f "$tmp"; exit 70; }
echo written'''

# A sidecar is `<config><suffix>`: not one of the files the config change itself keeps.
_SIDECAR_SUFFIX = re.compile(r"^\.[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$")
_RESERVED = (".lock", ".previous", ".history", ".tmp")


class GatewayError(RunbookError):
    pass


class GatewayUnreachable(GatewayError, RemoteError):
    """The gateway host did not answer over SSH (callers that catch RemoteError still do)."""


class GatewayAuthError(GatewayError):
    pass


class ConfigChanged(Exception):
    """The config on the host is no longer the one read: re-read and recompute."""


class ReloadFailed(GatewayError):
    """The new config was written (nothing put back) but the reload command failed."""


class ReloadRolledBack(GatewayError):
    """The reload after the write failed; the previous config was put back and reloaded."""


@dataclass
class Snapshot:
    """The config on the gateway host as read: parsed (what LiteLLM reads), its drain notes, its
    digest, and its text cut into lines (`doc`: the stashes, the operator's comments)."""

    config: dict[str, Any] | None
    drains: dict[str, str] = field(default_factory=dict)
    digest: str = "absent"
    doc: Doc | None = None
    text: str | None = None
    fleet: Any = None  # routes by api_base need the fleet; without it only owned entries count

    @property
    def rotation(self) -> list[str]:
        """Nodes some entry routes to (owned or by api_base), in config order."""
        return gateway_core.nodes_in_rotation(self.config, self.fleet)


# compute(snapshot) -> the new config (a Doc; or (config, drain notes), kept line for line when the
# config is the one read), or None for "nothing to change"
Change = Callable[[Snapshot], "Doc | tuple[dict[str, Any], dict[str, str]] | None"]


def _pools(routes: dict[str, list[str]]) -> dict[str, frozenset[str]]:
    """Routes as compared between the file and the proxy: the nodes per pool, as a set (LiteLLM
    loads two entries with one model_info.id once)."""
    return {p: frozenset(n) for p, n in routes.items() if n}


def _said(pools: dict[str, frozenset[str]]) -> str:
    return "; ".join(f"{p}: {', '.join(sorted(n))}" for p, n in sorted(pools.items())) or "no fleet node"


class GatewayHost:
    def __init__(self, session: FleetSession, ready_timeout_s: float = READY_TIMEOUT_S, master_key: str | None = None,
                 lock_wait_s: float = LOCK_WAIT_S, reload_timeout_s: float = RELOAD_TIMEOUT_S,
                 rotation_wait_s: float = ROTATION_WAIT_S, poll_s: float = 5.0) -> None:
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
        self.last_report: gateway_core.Report | None = None  # what the last change did to the config

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
            raise GatewayUnreachable(f"gateway {self.gw.host}: {what} failed: {first_line(e)}; check sshd and the "
                                     f"proxy on the gateway host") from None

    def _read_file(self, path: str) -> tuple[str | None, str]:
        r = self._run(["sh", "-c", _READ, "gateway-read", path], f"reading {path}", timeout=READ_TIMEOUT_S, log=False)
        head, _, text = r.stdout.partition("\n")
        return (None, "absent") if head.strip() == "absent" else (text, head.strip())

    def read(self) -> Snapshot:
        text, digest = self._read_file(self.config_path)
        if text is None:
            return Snapshot(None, fleet=self.fleet)
        try:
            doc = gateway_core.parse(text)
        except ValueError as e:
            raise GatewayError(f"gateway {self.gw.host}: {self.config_path}: {e}") from None
        return Snapshot(doc.config, dict(doc.notes), digest, doc, text, self.fleet)

    def read_config(self) -> dict[str, Any] | None:
        return self.read().config

    def rotation(self) -> list[str]:
        return self.read().rotation

    # -- files beside the config, under its lock --

    def sidecar_path(self, suffix: str) -> str:
        if not _SIDECAR_SUFFIX.match(suffix) or suffix.startswith(_RESERVED):
            raise ValueError(f"sidecar suffix {suffix!r}: use '.<name>' (letters, digits, _ - .), not one of "
                             f"{', '.join(_RESERVED)} (the config change's own files)")
        return self.config_path + suffix

    def read_sidecar(self, suffix: str) -> tuple[str | None, str]:
        """`<config><suffix>` on the gateway host: (its text, or None when absent; its digest)."""
        return self._read_file(self.sidecar_path(suffix))

    def change_sidecar(self, suffix: str, edit: Callable[[str | None], str | None], *,
                       lock_wait_s: float | None = None, retries: int = WRITE_RETRIES) -> str | None:
        """Read `<config><suffix>`, `edit(text or None)`, write what it returns (None or "" removes
        the file; the same text writes nothing) under `<config>.lock`, the config's own lock, only
        if the file still has the digest read (else re-read and edit again, up to `retries`),
        through a temp file renamed into place (atomic, 0600). Returns the text now there.
        Raises GatewayError naming the file (lock held too long, kept changing, unreachable)."""
        path = self.sidecar_path(suffix)
        wait = SIDECAR_LOCK_WAIT_S if lock_wait_s is None else lock_wait_s
        for _ in range(retries):
            text, digest = self._read_file(path)
            new = edit(text) or None
            if new == text:
                return text
            argv = ["flock", "-w", str(int(wait)), "-E", str(EXIT_LOCK), f"{self.config_path}.lock",
                    "sh", "-c", _SIDECAR_WRITE, "gateway-sidecar", path, digest]
            r = self._run(argv, f"writing {path}", stdin=new or "", check=False, log=False,
                          timeout=wait + READ_TIMEOUT_S)
            if r.exit_status == 0:
                return new
            if r.exit_status == EXIT_CHANGED:
                continue
            where = f"gateway {self.gw.host}"
            if r.exit_status == EXIT_LOCK:
                raise GatewayError(f"{where}: {self.config_path}.lock held for more than {wait:.0f} s (a config "
                                   f"change or reload in progress); {path} not changed, retry")
            if r.exit_status in TIMEOUT_EXIT_CODES:
                raise GatewayError(f"{where}: writing {path} did not end within {wait + READ_TIMEOUT_S:.0f} s; "
                                   "it was killed, the file is as it was")
            raise GatewayError(f"{where}: writing {path} exited {r.exit_status}: {r.tail.strip()[-200:]}")
        raise GatewayError(f"gateway {self.gw.host}: {path} kept changing under this run ({retries} attempts); "
                           "not changed, retry")

    # -- changing --

    def _write(self, snap: Snapshot, text: str, rollback: bool) -> None:
        argv = ["flock", "-w", str(int(self.lock_wait_s)), "-E", str(EXIT_LOCK), f"{self.config_path}.lock",
                "sh", "-c", _APPLY, "gateway-apply", self.config_path, snap.digest, "1" if rollback else "0",
                str(HISTORY_KEEP), self.gw.master_key_env,
                expand_home(self.gw.reload_dir, self.gw.home_dir) if self.gw.reload_dir else "",
                str(int(self.reload_timeout_s)), *self.gw.reload_command]
        stdin = (self._master_key or "") + "\n" + text
        timeout = change_limit_s(self.lock_wait_s, self.reload_timeout_s)
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
            raise ReloadRolledBack(f"{where}: the proxy reload ({' '.join(self.gw.reload_command)}) failed after "
                               f"the config was written; the previous config was put back ({detail}); check "
                               f"the proxy's logs on the gateway host")
        if r.exit_status == EXIT_RELOAD:
            raise ReloadFailed(f"{where}: the new config was written but the proxy reload "
                               f"({' '.join(self.gw.reload_command)}) failed ({detail}); check the proxy's "
                               f"logs on the gateway host")
        raise GatewayError(f"{where}: the config change failed ({detail}); {self.config_path} is as it was")

    def _doc(self, snap: Snapshot, new: Doc | tuple[dict[str, Any], dict[str, str]]) -> Doc:
        if isinstance(new, Doc):
            return new
        config, drains = new
        if snap.doc is not None and config == snap.config:
            return snap.doc.with_notes(drains)
        return gateway_core.fresh(config, drains)

    def change(self, compute: Change, rollback: bool) -> tuple[Snapshot, dict[str, Any], bool]:
        """Read, compute, write and reload, retried while other runs change the config in between;
        then the running proxy is confirmed to serve what the file says (repaired if not: see
        `confirm`). Returns (the snapshot it was computed from, the config now on the host, reloaded
        or repaired?). An unchanged config on a ready proxy that serves it is left alone (a restart
        drops in-flight streams); one the proxy does not serve is repaired."""
        for _ in range(WRITE_RETRIES):
            snap = self.read()
            new = compute(snap)
            if new is None:
                return snap, snap.config or {}, False
            doc = self._doc(snap, new)
            self.last_report = doc.report
            text = doc.text()
            if doc.lossy and doc.touched:
                self.session.log.warning(f"[{GATEWAY_KEY}] {self.config_path}: its comments cannot be kept by this "
                                         f"rewrite ({doc.lossy}); the file it replaces is kept as .previous")
            if snap.text is not None and text == snap.text and self.ready():
                self.session.log.info(f"[{GATEWAY_KEY}] LiteLLM config unchanged and proxy ready; not reloaded")
                return snap, doc.config, self.confirm(doc)
            try:
                self._write(snap, text, rollback)
            except ConfigChanged:
                self.session.log.info(f"[{GATEWAY_KEY}] LiteLLM config changed by another run meanwhile; re-reading")
                continue
            except ReloadFailed as e:
                self.session.log.warning(f"[{GATEWAY_KEY}] {e}: reloading again")
                try:
                    self.confirm(doc, first_wait_s=0)
                except GatewayError as again:
                    raise GatewayError(f"{e}; and then: {again}") from None
                return snap, doc.config, True
            except ReloadRolledBack as e:
                if snap.doc is not None:
                    # The change did not happen: the proxy must still serve the file put back.
                    try:
                        self.confirm(snap.doc, first_wait_s=0)
                    except GatewayError as again:
                        raise GatewayError(f"{e}; and then: {again}") from None
                raise
            self._confirm_reload()
            self.confirm(doc)
            return snap, doc.config, True
        raise GatewayError(f"gateway {self.gw.host}: {self.config_path} kept changing under this run "
                           f"({WRITE_RETRIES} attempts); nothing was changed by it, retry")

    def apply(self, config: dict[str, Any], current: dict[str, Any] | None = None) -> bool:
        """Write exactly `config` (keeping the drain notes on the host) and reload."""
        return self.change(lambda snap: (config, snap.drains), rollback=True)[2]

    def _base(self, snap: Snapshot) -> Doc:
        return snap.doc if snap.doc is not None else gateway_core.new_doc(self.fleet, [])

    def set_rotation(self, nodes: list[str], floor: int | None = None) -> tuple[dict[str, Any], bool]:
        """The gateway step: every node in `nodes` routed once per pool (a hand entry identical to
        what it would write is taken over, never doubled), every other serve node out of every
        route, the operator's entries and settings kept (core.gateway.rotate). Refused (nothing
        written) below `floor` (default: the fleet's min_in_rotation, at least 1). Returns (the
        config now serving, whether the proxy was reloaded or repaired for it); `last_report`
        says what was taken over, collapsed, added or left the operator's."""
        floor = max(1, self.gw.min_in_rotation if floor is None else floor)
        if len(nodes) < floor:
            raise gateway_core.RotationRefused(
                f"the rotation would have {len(nodes)} node(s) ({', '.join(nodes) or 'none'}), below "
                f"gateway.min_in_rotation={floor}: the gateway config was NOT rewritten (the proxy keeps its pools)")

        def compute(snap: Snapshot) -> Doc:
            if snap.doc is None:
                doc = gateway_core.new_doc(self.fleet, nodes)
                doc.report = gateway_core.Report(routes_after=gateway_core.routes(doc.config, self.fleet))
            else:
                doc = gateway_core.rotate(snap.doc, self.fleet, nodes)
            doc.notes = {n: why for n, why in snap.drains.items() if n not in nodes}
            return doc

        _, config, reloaded = self.change(compute, rollback=True)
        return config, reloaded

    def take_over(self, check: bool = False) -> gateway_core.Report:
        """Adopt the hand-written routes to fleet nodes (core.gateway.take_over): marked as their
        node's own in place, duplicates collapsed, the rest reported. With check=True nothing is
        written. Else the file it replaces is kept (.previous), the proxy reloaded and confirmed
        to serve the same nodes per pool as before (`proxy_before` / `proxy_after`)."""
        before = self.serving_routes()
        reports: list[gateway_core.Report] = []

        def compute(snap: Snapshot) -> Doc | None:
            if snap.doc is None:
                reports[:] = [gateway_core.Report()]
                return None
            doc, rep = gateway_core.take_over(snap.doc, self.fleet)
            reports[:] = [rep]
            return None if check else doc

        self.change(compute, rollback=True)
        rep = reports[-1]
        rep.proxy_before = before
        rep.proxy_after = before if check else self.serving_routes()
        if _pools(rep.proxy_after) != _pools(before):
            self.session.log.warning(f"[{GATEWAY_KEY}] the running proxy served {_said(_pools(before))} before the "
                                     f"take-over and {_said(_pools(rep.proxy_after))} after: it now serves the file")
        return rep

    def drain(self, node: str, reason: str = "drained", wait_s: float | None = None, *,
              dead: bool = False, deploying: bool = False) -> list[str]:
        """Take one node out of every route to it (owned or hand-written: each stashed in place),
        once the rotation can spare it: waits up to `wait_s` (default rotation_wait_s) for other
        nodes to come back, then refuses naming who is out. `dead=True` (the node does not serve)
        skips the floor: a dead backend is no backend, and waiting would only keep clients routed
        to it. `deploying=True` (a serving node about to be redeployed) also waits while
        rollout.max_unavailable other nodes are out for a deploy. An entry whose route cannot be
        told refuses at once (RouteUnaccounted, naming it). Confirmed: returns once the reloaded
        proxy serves what the file says (the node in no pool). Returns the rotation before."""
        deadline = time.monotonic() + (self.rotation_wait_s if wait_s is None else wait_s)
        note = f"{reason} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"
        while True:
            refusal: list[str] = []
            stuck: list[bool] = []

            def compute(snap: Snapshot) -> Doc | None:
                if snap.doc is None or node not in snap.rotation:
                    return None
                after = gateway_core.drain(snap.doc, self.fleet, node, note)
                if dead:
                    return after
                left = gateway_core.nodes_in_rotation(after.config, self.fleet)
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
                return after

            snap, _, _ = self.change(compute, rollback=True)
            hopeless = len(self.fleet.serve_nodes) <= self.gw.min_in_rotation or any(stuck)
            if refusal and hopeless:
                raise gateway_core.RotationRefused(refusal[-1])
            if not refusal:
                return snap.rotation
            if time.monotonic() >= deadline:
                raise gateway_core.RotationRefused(refusal[-1])
            self.session.log.info(f"[{GATEWAY_KEY}] waiting to drain {node}: {refusal[-1]}")
            time.sleep(self.poll_s)

    def note(self, node: str, reason: str) -> None:
        """Replace a drained node's drain note. The notes live in the config file, so the proxy is
        reloaded though its pools stay: used only when a failed deploy keeps its node out."""
        text = f"{reason} since {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"

        def compute(snap: Snapshot) -> Doc | None:
            if snap.doc is None or node not in snap.drains:
                return None
            return snap.doc.with_notes({**snap.drains, node: text})

        self.change(compute, rollback=False)

    def restore(self, node: str) -> None:
        """Put one node back into every pool, exactly as it was before its drain (its stashed
        entries back in place; its drain note cleared); never refused. Not rolled back on a failed
        reload: the node stays in the file, and the proxy is reloaded again, then restarted, until
        it serves it (`confirm`)."""

        def compute(snap: Snapshot) -> Doc:
            return gateway_core.restore(self._base(snap), self.fleet, node)

        self.change(compute, rollback=False)

    # -- the proxy --

    def _proxy_command(self, cmd: tuple[str, ...], what: str) -> tuple[bool, str]:
        """Run the reload or restart command under the config's lock (never beside a change), the
        master key on stdin. Returns (ok, what it said last)."""
        argv = ["flock", "-w", str(int(self.lock_wait_s)), "-E", str(EXIT_LOCK), f"{self.config_path}.lock",
                "sh", "-c", _PROXY, "gateway-proxy", self.gw.master_key_env,
                expand_home(self.gw.reload_dir, self.gw.home_dir) if self.gw.reload_dir else "",
                str(int(self.reload_timeout_s)), *cmd]
        r = self._run(argv, what, stdin=(self._master_key or "") + "\n", check=False,
                      timeout=self.lock_wait_s + self.reload_timeout_s + 60)
        return r.exit_status == 0, " / ".join(r.tail.strip().splitlines()[-2:]) or f"exit {r.exit_status}"

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
        ok, said = self._proxy_command(self.gw.restart_command, "restarting the proxy")
        if not ok:
            raise GatewayError(f"gateway {self.gw.host}: the proxy was not ready after the graceful reload and its "
                               f"restart ({cmd}) failed ({said}); check the proxy on the gateway host")
        self.wait_ready()

    def confirm(self, doc: Doc, first_wait_s: float | None = None) -> bool:
        """The running proxy serves what `doc` says: the same nodes in each pool. Waits up to
        `first_wait_s` (default ready_timeout_s: a graceful reload's new worker may take that long);
        a proxy still different is reloaded again and, only when it answers no routes at all,
        restarted (gateway.restart_command), each followed by the same wait. Returns whether a
        repair was needed; raises GatewayError saying what the proxy serves and what the file lists
        when that did not help: a proxy that serves other routes is never restarted (every request
        would fail while LiteLLM starts), the run that wanted the change fails and the next retries."""
        config = doc.config
        if not config.get("model_list"):
            # Nothing left to serve (a dead node was the last): LiteLLM answers /model/info with
            # HTTP 500 on an empty list, so readiness is the confirmation.
            self.wait_ready()
            return False
        want = _pools(gateway_core.routes(config, self.fleet))
        got = self._wait_routes(want, self.ready_timeout_s if first_wait_s is None else first_wait_s)
        if got == want:
            return False
        if got is None and not self._master_key and self.ready():
            self.serving_routes()  # no key to read /model/info with: its error names the variable; a restart cannot help
        tried: list[str] = []
        # (what, command, only for a proxy that answers no routes: a serving one is never restarted)
        for what, cmd, when_silent in (("reloading it again", self.gw.reload_command, False),
                                       ("restarting it", self.gw.restart_command, True)):
            if not cmd or (when_silent and got is not None):
                continue
            self.session.log.warning(
                f"[{GATEWAY_KEY}] LiteLLM on {self.gw.host} serves {_said(got) if got is not None else '(no answer)'} "
                f"while {self.config_path} lists {_said(want)}: {what} ({' '.join(cmd)})")
            ok, said = self._proxy_command(cmd, what)
            tried.append(f"{' '.join(cmd)}: {'ok' if ok else said}")
            self.wait_ready(raise_=False)
            got = self._wait_routes(want, self.ready_timeout_s)
            if got == want:
                self.session.log.info(f"[{GATEWAY_KEY}] LiteLLM on {self.gw.host} serves the config again ({_said(want)})")
                return True
        if got is not None:
            raise GatewayError(f"LiteLLM on {self.gw.host}: the running proxy serves {_said(got)} while "
                               f"{self.config_path} lists {_said(want)}, after reloading it again "
                               f"({'; '.join(tried)}); not restarted, it serves clients: check "
                               f"gateway.reload_command, or restart it when traffic allows "
                               f"({' '.join(self.gw.restart_command)}); the next gateway run reloads it again")
        raise GatewayError(f"LiteLLM on {self.gw.host}: the running proxy serves "
                           "(no answer from /model/info) while "
                           f"{self.config_path} lists {_said(want)}, after a reload and a restart "
                           f"({'; '.join(tried)}); check the proxy on the gateway host")

    def _wait_routes(self, want: dict[str, frozenset[str]], timeout_s: float) -> dict[str, frozenset[str]] | None:
        deadline = time.monotonic() + timeout_s
        got: dict[str, frozenset[str]] | None = None
        while True:
            try:
                got = _pools(self.serving_routes())
            except GatewayAuthError:
                raise
            except GatewayError:
                got = None
            if got == want or time.monotonic() >= deadline:
                return got
            time.sleep(SERVING_POLL_S)

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

    def model_info(self) -> list[dict[str, Any]]:
        """The entries the running proxy has loaded (its /model/info: model_name, litellm_params
        with api_base, model_info), in its order."""
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
        try:
            data = r.json().get("data") or []
        except ValueError:
            raise GatewayError(f"LiteLLM on {self.gw.host}: /model/info answered no JSON") from None
        return [e for e in data if isinstance(e, dict)]

    def readable(self) -> None:
        """The running proxy answers /model/info to this run: every drain and restore is confirmed
        there, so one that could not be confirmed is not written (it would be undone after minutes
        of waiting, the node out of the gateway meanwhile). Without a key (or with a refused one)
        any failure is final: raises GatewayError, nothing changed. With a key, a proxy busy with
        another run's reload is left to the change's own confirmation."""
        try:
            self.model_info()
        except GatewayAuthError:
            raise
        except GatewayError:
            if not self._master_key:
                raise

    def serving_routes(self) -> dict[str, list[str]]:
        """Pool -> the fleet nodes the running proxy routes it to (owned entries or by api_base)."""
        return gateway_core.routes({"model_list": self.model_info()}, self.fleet)

    def serving_nodes(self) -> list[str]:
        """The fleet nodes the running proxy routes to (owned entries or by api_base), in its order."""
        return gateway_core.nodes_in_rotation({"model_list": self.model_info()}, self.fleet)


class LiteLLMGateway(dg.ConfigurableResource):
    ssh: FleetSSH
    master_key: str | None = Field(
        default=None, description="the proxy's master key: bind it with dg.EnvVar (the fleet's master_key_env)")
    ready_timeout_s: float = Field(default=READY_TIMEOUT_S, description="how long a reloaded proxy may take to be ready")
    lock_wait_s: float = Field(default=LOCK_WAIT_S, description="how long a change waits for another run's change")
    rotation_wait_s: float = Field(
        default=ROTATION_WAIT_S, description="how long a drain waits for other nodes to be back before it is refused")

    def host(self) -> GatewayHost:
        return GatewayHost(self.ssh.session, self.ready_timeout_s, master_key=self.master_key,
                           lock_wait_s=self.lock_wait_s, rotation_wait_s=self.rotation_wait_s)
