"""Node-to-node streams: the checkpoint (rsync) and the image (docker save | docker load).

Both run ON the build node and push straight to the serving node, so the ~71 GB never crosses the
orchestrator's machine. The build node reaches the serving node with its own dedicated key, which
`ensure_peer_access` creates and authorizes; the serving node's host key is written into the build
node's peer known_hosts from the orchestrator's verified known_hosts, never learned from the network.

A copied checkpoint is verified on the receiver by content: every file's sha256 (computed there by
core/checkpoint.py piped to python3) against the build host's digest manifest. Files that differ
are re-sent alone (rsync --checksum over just those files), then checked again.
"""

from __future__ import annotations

import ipaddress
import json
import select
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paramiko

from spark_pipelines.core import checkpoint as checkpoint_core
from spark_pipelines.core import remote
from spark_pipelines.core.checkpoint import INDEX_NAME, MANIFEST_NAME, MAX_HEADER_BYTES
from spark_pipelines.core.progress import Progress
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.ssh import FleetSession, HostKeyError, RemoteCommandError, RemoteError

# sha256 of the ~71 GB checkpoint reads every byte: minutes on a real node (about 1 GB/s per core
# from NVMe, four files at a time); 30 min leaves room for a slow or busy disk, never unbounded.
DIGEST_TIMEOUT_S = 1800


def checkpoint_script(session: FleetSession, node: str, args: list[str], timeout: float,
                      progress: Progress | None = None) -> dict:
    """Run core/checkpoint.py on the node (stdlib only, piped to python3); its last line is JSON.
    `progress`: fed with the bytes hashed as the script says them (it is given --progress), a
    line in the session's log whenever one is due."""
    source = Path(checkpoint_core.__file__).read_text()
    on_line = None
    if progress is not None:
        args = [*args, "--progress"]

        def on_line(stream: str, line: str) -> bool:
            parts = line.split()
            if stream == "stderr" and len(parts) == 3 and parts[0] == checkpoint_core.PROGRESS_PREFIX:
                with _PROGRESS_LOCK:
                    progress.total = int(parts[2]) if parts[2].isdigit() else progress.total
                    progress.set(int(parts[1]) if parts[1].isdigit() else 0)
                    if progress.due(time.monotonic()):
                        session.log.info(progress.line(time.monotonic()))
            return False

    r = session.run(node, ["python3", "-", *args], stdin=source, log=False, timeout=timeout, on_line=on_line)
    if progress is not None:
        progress.set(progress.total)
        said = progress.end(time.monotonic())
        if progress.spoke:
            session.log.info(said)
    return json.loads(r.stdout.strip().splitlines()[-1])


_PROGRESS_LOCK = threading.Lock()


def hash_progress(node: str, directory: str) -> Progress:
    """What a hash of `directory` on `node` says while it runs (its total arrives with its first line)."""
    return Progress(f"[{node}] hashing {directory}", 0, time.monotonic())


def digests_on_node(session: FleetSession, node: str, directory: str, only: list[str] | None = None,
                    progress: Progress | None = None) -> dict[str, dict]:
    """{path: {size, sha256}} of the files under directory, hashed on the node itself; a long
    hash says how far it is in the log (`progress`: the caller's, for the figures it records)."""
    args = [directory, "--digests", *(f"--only={p}" for p in only or [])]
    return checkpoint_script(session, node, args, DIGEST_TIMEOUT_S,
                             progress or hash_progress(node, directory))["files"]


def write_manifest(session: FleetSession, node: str, directory: str,
                   progress: Progress | None = None) -> tuple[dict, str]:
    """Hash the directory on the node, write its MANIFEST_NAME there; (manifest, digest)."""
    manifest = checkpoint_script(session, node, [directory, "--write-manifest"], DIGEST_TIMEOUT_S,
                                 progress or hash_progress(node, directory))
    return manifest, checkpoint_core.manifest_digest(manifest)


RSYNC_FILE_IO_ERROR = 11  # rsync's "error in file I/O": on a receiver, most often a full disk


def copy_failure(src: str, dst: str, dst_dir: str, status: int | None, output: str,
                 free_mib: int | None = None) -> str:
    """One line naming both ends, the receiver's own complaint when rsync relayed one, and the fix.
    The partial copy is kept (`--partial`): a rerun resumes. `free_mib`: what the receiver has left."""
    text = output.lower()
    if status == RSYNC_FILE_IO_ERROR and "no space left on device" not in text and "permission denied" not in text:
        left = f"; {free_mib} MiB free there" if free_mib is not None else ""
        why = f"{dst} could not write under {dst_dir} (rsync: error in file I/O, code 11{left})"
        fix = (f"check free space and ownership on {dst} (`df -h {dst_dir}`; the checkpoint needs ~71 GB), "
               "then rerun: the copy resumes")
    elif "no space left on device" in text:
        why = f"{dst} ran out of disk space under {dst_dir}"
        fix = f"free space on {dst} (`df -h {dst_dir}`; the checkpoint needs ~71 GB), then rerun: the copy resumes"
    elif status in remote.TIMEOUT_EXIT_CODES:
        why = "rsync was stopped by its timeout"
        fix = f"check the link from {src} to {dst} (a slow uplink: raise the copy timeout), then rerun: it resumes"
    elif "permission denied" in text:
        why = f"{dst} refused a write under {dst_dir} (permission denied)"
        fix = f"check the owner of {dst_dir} on {dst}, then rerun"
    else:
        last = next((ln.strip() for ln in reversed(output.splitlines()) if "rsync" in ln.lower() and ln.strip()), "")
        why = f"rsync exited with status {status}" + (f" ({last[:200]})" if last else "")
        fix = f"check that {dst} is up and reachable from {src}, then rerun: the copy resumes"
    return f"copy {src} -> {dst} failed: {why}; {fix}"


def _ip_literal(host: str) -> str | None:
    """The host when it is an IP address (then the peer key is valid only from there), else None."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


class TransferError(RemoteError):
    """A copy between nodes failed or did not verify; the message names both nodes and the problems."""


class PeerStream:
    """One long-lived relay of files from `src` to `dst` (core/relay.py `send | ssh dst recv`),
    run ON `src` and fed file by file while it runs: the bytes go node to node, never through this
    machine, one connection for the whole distribution. `on_got(i, path, sha256)` once a file is
    whole under its final name on `dst` (the digest of the bytes that landed there); `on_end(error)`
    once the stream ended ("" when it was closed and ended cleanly). Bounded by `timeout_s` on `src`
    (and the peer ssh's keep-alives)."""

    def __init__(self, session: FleetSession, src: str, dst: str, route: remote.PeerRoute,
                 scripts: tuple[str, str], src_dirs: list[str], dst_dirs: list[str],
                 on_got: Any, on_end: Any, timeout_s: float) -> None:
        self.s, self.src, self.dst, self.on_got, self.on_end = session, src, dst, on_got, on_end
        inner = ["python3", scripts[1], "recv", *dst_dirs]
        pipeline = (f"{remote.quote_argv(['python3', scripts[0], 'send', *src_dirs])} | "
                    f"{remote.quote_argv(route.remote_argv(inner))}")
        self.argv = ["bash", "-o", "pipefail", "-c", pipeline]
        transport = session.client(src).get_transport()
        if transport is None or not transport.is_active():
            raise TransferError(f"node {src}: no SSH connection to relay files to {dst} from; check that it is up")
        self.chan = transport.open_session(timeout=30)
        self.chan.exec_command(remote.quote_argv(remote.with_timeout(self.argv, timeout_s)))
        self._lock = threading.Lock()
        self.started = time.monotonic()
        threading.Thread(target=self._read, name=f"relay-{src}-{dst}", daemon=True).start()

    def send(self, i: int, path: str) -> None:
        with self._lock:
            self.chan.sendall((json.dumps([i, path]) + "\n").encode())

    def close(self) -> None:
        """No more files: the relay ends once the last one is through."""
        with self._lock:
            if not self.chan.closed:
                self.chan.shutdown_write()

    def _read(self) -> None:
        out, err = remote.LineSplitter(), remote.LineSplitter()
        tail: list[str] = []
        status: int | None = None
        try:
            while True:
                select.select([self.chan], [], [], 1.0)
                if self.chan.recv_ready():
                    for line in out.feed(self.chan.recv(65536)):
                        if line.startswith("got "):
                            i, path, sha = json.loads(line[4:])
                            self.on_got(int(i), str(path), str(sha))
                    continue
                if self.chan.recv_stderr_ready():
                    tail = (tail + [ln for ln in err.feed(self.chan.recv_stderr(65536)) if ln.strip()])[-5:]
                    continue
                if self.chan.exit_status_ready():
                    status = self.chan.recv_exit_status()
                    break
                if self.chan.closed:
                    break
        except Exception as e:  # noqa: BLE001 - the connection went: the stream ended, with that error
            tail = [str(e)]
        finally:
            self.chan.close()
        seconds = time.monotonic() - self.started
        self.s.record_command(self.src, self.argv, status, seconds)
        if status == 0:
            self.on_end("")
            return
        why = (tail[-1].strip() if tail else "") or f"status {status}"
        self.on_end(f"copy {self.src} -> {self.dst} failed ({why[:300]}); check that {self.dst} is up, reachable "
                    f"from {self.src} and has room, then rerun: what verified there stays")


@dataclass
class TreeVerification:
    files: int = 0
    total_bytes: int = 0
    index_keys: int = 0
    shards_checked: int = 0
    digests_checked: int = 0
    manifest: str = ""  # digest of the source's manifest the content was checked against
    resend: list[str] = field(default_factory=list)  # files whose content (or size) is not the source's
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class TreeCopyReport:
    src: str
    dst: str
    src_dir: str
    dst_dir: str
    seconds: float
    bytes_sent: int  # what rsync pushed over the wire (after delta and resume)
    files_transferred: int
    verification: TreeVerification
    rsync_stats: dict[str, int]
    repaired: list[str] = field(default_factory=list)  # re-sent after the content check
    repair_bytes_sent: int = 0


@dataclass
class ImageCopyReport:
    src: str
    dst: str
    image: str
    image_id: str
    seconds: float
    skipped: bool  # the destination already had the same image id


class NodeStreams:
    """Copies between nodes, driven over a FleetSession."""

    def __init__(self, session: FleetSession) -> None:
        self.session = session
        self.docker = NodeDocker(session)
        self._peer_lock = threading.Lock()
        self._routes: dict[tuple[str, str], remote.PeerRoute] = {}

    # -- access --

    def ensure_peer_access(self, src: str, dst: str) -> remote.PeerRoute:
        """Let src ssh to dst with a dedicated key; idempotent (nothing is rewritten when in place)."""
        if src == dst:
            raise TransferError(f"source and destination are the same node ({src}): nothing to copy")
        session = self.session
        with self._peer_lock:
            if (src, dst) in self._routes:
                return self._routes[(src, dst)]
            _, src_t = session.target(src)
            _, dst_t = session.target(dst)
            ssh_dir = session.expand(src, "~/.ssh")
            key = f"{ssh_dir}/{remote.PEER_KEY_NAME}"
            peer_known_hosts = f"{ssh_dir}/{remote.PEER_KNOWN_HOSTS_NAME}"
            session.run(src, ["mkdir", "-p", "-m", "700", ssh_dir], log=False)
            if not session.exists(src, key):
                session.run(src, ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"spark-pipelines-peer@{src}", "-f", key])
            public = session.read_text(src, f"{key}.pub").strip()

            # Authorize on the destination (append once; 0600 as sshd's StrictModes wants).
            dst_ssh = session.expand(dst, "~/.ssh")
            session.run(dst, ["mkdir", "-p", "-m", "700", dst_ssh], log=False)
            ak = f"{dst_ssh}/authorized_keys"
            current = session.read_text(dst, ak) if session.exists(dst, ak) else ""
            if public.split()[1] not in current:
                line = remote.authorized_keys_line(public, f"spark-pipelines-peer@{src}", _ip_literal(src_t.host))
                session.put_text(dst, ak, current + ("" if not current or current.endswith("\n") else "\n") + line + "\n", 0o600)
                session.log.info(f"[{dst}] authorized {src}'s peer key in {ak}")

            # The destination's host key, from the orchestrator's verified known_hosts.
            lines = self._verified_host_lines(dst, dst_t.host, dst_t.port, dst_t.known_hosts)
            name = remote.known_hosts_name(dst_t.host, dst_t.port)
            existing = session.read_text(src, peer_known_hosts) if session.exists(src, peer_known_hosts) else ""
            kept = [ln for ln in existing.splitlines() if ln.strip() and ln.split()[0] != name]
            wanted = "\n".join(kept + lines) + "\n"
            if wanted != existing:
                session.put_text(src, peer_known_hosts, wanted, 0o600)
            route = remote.PeerRoute(dst_t.user, dst_t.host, dst_t.port, key, peer_known_hosts)
            self._routes[(src, dst)] = route
            return route

    def _verified_host_lines(self, dst: str, host: str, port: int, known_hosts: str) -> list[str]:
        path = Path(known_hosts).expanduser()
        name = remote.known_hosts_name(host, port)
        keys = paramiko.HostKeys(str(path)) if path.is_file() else paramiko.HostKeys()
        entry = keys.lookup(name)
        # Connecting checks the live key against that same file (refusing a mismatch).
        live = self.session.client(dst).get_transport().get_remote_server_key()
        if not entry:
            # Only reachable with trust_unknown_host_keys, which just pinned the key there.
            keys = paramiko.HostKeys(str(path))
            entry = keys.lookup(name)
        if not entry or live.get_name() not in entry or entry[live.get_name()] != live:
            raise HostKeyError(
                f"node {dst}: its host key is not verified in {path}; add it there before copying to it"
            )
        return [remote.known_hosts_line(host, port, t, k.get_base64()) for t, k in entry.items()]

    # -- checkpoint --

    def _free_mib(self, node: str, directory: str) -> int | None:
        """Free space under directory on node, for an error message (None when it cannot be read)."""
        try:
            r = self.session.run(node, ["df", "-Pk", directory], check=False, log=False, timeout=remote.PROBE_TIMEOUT_S)
            return int(r.stdout.splitlines()[-1].split()[3]) // 1024 if r.ok else None
        except (RemoteError, ValueError, IndexError):
            return None

    def copy_tree(
        self,
        src: str,
        dst: str,
        src_dir: str,
        dst_dir: str | None = None,
        *,
        bwlimit_kib: int | None = None,
        timeout: float | None = None,
        verify: bool = True,
        manifest: str | None = None,
        link_dest: str | None = None,
    ) -> TreeCopyReport:
        """rsync src_dir on src to dst_dir on dst (resumable), verify sizes, index, headers and
        content, and re-send only the files whose content differs. `manifest`: the digest the
        source's manifest must have (recorded when the checkpoint was built). `link_dest`: a
        directory on dst whose unchanged files are hard-linked (remote.rsync_argv)."""
        session = self.session
        route = self.ensure_peer_access(src, dst)
        src_abs = session.expand(src, src_dir).rstrip("/")
        dst_abs = session.expand(dst, dst_dir or src_dir).rstrip("/")
        session.run(dst, ["mkdir", "-p", dst_abs], log=False)
        started = time.monotonic()
        r = session.run(src, remote.rsync_argv(src_abs, route, dst_abs, bwlimit_kib=bwlimit_kib, link_dest=link_dest),
                  timeout=timeout or remote.COPY_TIMEOUT_S, check=False)
        if not r.ok:
            raise RemoteCommandError(src, r.command, r.exit_status, r.tail, copy_failure(
                src, dst, dst_abs, r.exit_status, r.stderr + r.tail, free_mib=self._free_mib(dst, dst_abs)))
        stats = remote.parse_rsync_stats(r.stdout)
        verification = (self.verify_tree(src, dst, src_abs, dst_abs, manifest=manifest, drop_rsync_leftovers=True)
                        if verify else TreeVerification())
        repaired: list[str] = []
        repair_stats: dict[str, int] = {}
        if not verification.ok and verification.resend:
            repaired = verification.resend
            repair_stats = self.resend_files(src, dst, src_abs, dst_abs, repaired, bwlimit_kib=bwlimit_kib, timeout=timeout)
            verification = self.verify_tree(src, dst, src_abs, dst_abs, manifest=manifest, only=repaired)
        seconds = time.monotonic() - started
        if not verification.ok:
            raise TransferError(
                f"copy {src}:{src_abs} -> {dst}:{dst_abs} finished but does not verify: "
                + "; ".join(verification.problems)
                + ". Rerun the copy (it resumes); if the source itself is damaged, rebuild it"
            )
        return TreeCopyReport(
            src=src, dst=dst, src_dir=src_abs, dst_dir=dst_abs, seconds=round(seconds, 2),
            bytes_sent=stats.get("total_bytes_sent", 0) + repair_stats.get("total_bytes_sent", 0),
            files_transferred=stats.get("number_of_regular_files_transferred", 0),
            verification=verification, rsync_stats=stats,
            repaired=repaired, repair_bytes_sent=repair_stats.get("total_bytes_sent", 0),
        )

    def resend_files(
        self, src: str, dst: str, src_dir: str, dst_dir: str, files: list[str], *,
        bwlimit_kib: int | None = None, timeout: float | None = None,
    ) -> dict[str, int]:
        """Re-send just these files. --checksum: a same-size file rewritten in place keeps its size
        (and maybe its mtime), so rsync's quick check would skip it; the delta transfer then sends
        only the blocks that differ. Before that, the source's own copies are checked against its
        manifest: re-sending a damaged source would only copy the damage."""
        session = self.session
        for f in files:
            if not checkpoint_core.safe_relative(f):
                raise TransferError(f"refusing to re-send {f!r}: the path leaves {src_dir}")
        manifest_text = self._source_manifest_text(src, src_dir)
        if manifest_text is not None:
            expected = checkpoint_core.expected_tree(manifest_text)
            on_src = digests_on_node(session, src, src_dir, [f for f in files if f != MANIFEST_NAME])
            bad = checkpoint_core.diff_manifests(expected, on_src, only=[f for f in files if f != MANIFEST_NAME])
            if not bad.ok:
                raise TransferError(
                    f"build host {src}: its own copy does not match its manifest: "
                    + "; ".join(bad.problems(src, expected, on_src))
                    + ". Rebuild the checkpoint there (remove its step marker to force the step)"
                )
        route = self.ensure_peer_access(src, dst)
        argv = remote.rsync_argv(src_dir, route, dst_dir, bwlimit_kib=bwlimit_kib)
        argv[-2:-2] = ["--checksum", "--from0", "--files-from=-"]
        session.log.info(f"[{dst}] re-sending {len(files)} file(s) whose content differs: {', '.join(files[:5])}")
        r = session.run(src, argv, stdin="".join(f + "\0" for f in files), timeout=timeout or remote.COPY_TIMEOUT_S)
        return remote.parse_rsync_stats(r.stdout)

    def _source_manifest_text(self, src: str, src_dir: str) -> str | None:
        path = f"{src_dir}/{MANIFEST_NAME}"
        return self.session.read_text(src, path) if self.session.exists(src, path) else None

    def verify_tree(
        self, src: str, dst: str, src_dir: str, dst_dir: str, *,
        manifest: str | None = None, content: bool = True, only: list[str] | None = None,
        drop_rsync_leftovers: bool = False, progress: Progress | None = None,
    ) -> TreeVerification:
        """Sizes of every file on both sides, the safetensors index, each shard's header span, and
        (content=True) every file's sha256 on dst against the source's manifest (`only`: just
        those files, after a repair). A source without a manifest is hashed on the source too.
        `drop_rsync_leftovers` (after a copy): a killed rsync's temp files are removed first."""
        session = self.session
        src_abs, dst_abs = session.expand(src, src_dir), session.expand(dst, dst_dir)
        src_sizes = remote.parse_file_sizes(session.run(src, remote.list_files_argv(src_abs), log=False).stdout)
        dst_sizes = remote.parse_file_sizes(session.run(dst, remote.list_files_argv(dst_abs), log=False).stdout)
        stale = remote.rsync_leftovers(dst_sizes) if drop_rsync_leftovers else []
        if stale:
            # A receiver killed mid-copy leaves rsync's temp file beside the shard it was writing; the
            # rerun completes the shard but never removes that file (up to a shard's size of disk).
            # Only exact temp names of files present go, read from this same listing.
            session.log.info(f"[{dst}] removing {len(stale)} temp file(s) a killed copy left: {', '.join(stale[:5])}")
            session.run(dst, ["rm", "-f", "--", *(f"{dst_abs}/{p}" for p in stale)], log=False)
            dst_sizes = {p: n for p, n in dst_sizes.items() if p not in stale}
        v = TreeVerification(files=len(dst_sizes), total_bytes=sum(dst_sizes.values()))
        v.problems += remote.compare_trees(src_sizes, dst_sizes)
        v.resend = sorted(p for p in src_sizes if dst_sizes.get(p) != src_sizes[p])
        if INDEX_NAME in src_sizes and INDEX_NAME in dst_sizes:
            v.index_keys, problems = remote.check_index(
                session.read_text(dst, f"{dst_abs}/{INDEX_NAME}"), dst_sizes, INDEX_NAME
            )
            v.problems += problems
        for name, size in sorted(dst_sizes.items()):
            if not name.endswith(".safetensors") or size < 8:
                continue
            problem = self._check_shard_span(dst, f"{dst_abs}/{name}", name, size)
            v.shards_checked += 1
            if problem:
                v.problems.append(problem)
        if content:
            self._verify_content(src, dst, src_abs, dst_abs, v, manifest, only, progress)
        return v

    def _verify_content(
        self, src: str, dst: str, src_abs: str, dst_abs: str, v: TreeVerification,
        manifest: str | None, only: list[str] | None, progress: Progress | None = None,
    ) -> None:
        session = self.session
        text = self._source_manifest_text(src, src_abs)
        if text is None:
            if manifest:
                v.problems.append(
                    f"{src}:{src_abs}/{MANIFEST_NAME} is missing (the checkpoint step writes it): "
                    "rematerialize mtp_weights on the build host"
                )
                return
            expected = digests_on_node(session, src, src_abs, only)
        else:
            try:
                expected = checkpoint_core.expected_tree(text)
            except ValueError as e:
                v.problems.append(f"{src}: {e}; rematerialize mtp_weights on the build host")
                return
            v.manifest = checkpoint_core.manifest_digest(checkpoint_core.parse_manifest(text))
            if manifest and v.manifest != manifest:
                v.problems.append(
                    f"{src}:{src_abs}/{MANIFEST_NAME} has digest {v.manifest[:16]}, but the checkpoint was "
                    f"recorded as {manifest[:16]}: the build host's checkpoint changed since; rematerialize mtp_weights"
                )
                return
        actual = digests_on_node(session, dst, dst_abs, only, progress)
        v.digests_checked = len(actual)
        diff = checkpoint_core.diff_manifests(expected, actual, only=only)
        # Missing files and size mismatches are already reported by the listing comparison.
        same_size = [p for p in diff.differing if p in actual and actual[p]["size"] == expected[p]["size"]]
        v.problems += checkpoint_core.ManifestDiff(differing=same_size).problems(dst, expected, actual)
        if only is not None:
            v.problems += [f"{p}: missing on {dst}" for p in diff.missing]
        v.resend = sorted(set(v.resend) | set(diff.to_resend))

    def _check_shard_span(self, node: str, path: str, name: str, size: int) -> str | None:
        """Read only the shard's header (a few KB) over SFTP and check the file is as long as it says."""
        (header_len,) = struct.unpack("<Q", self.session.read_bytes(node, path, 0, 8))
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            return f"{name}: header length {header_len} does not fit in {size} bytes (damaged or truncated)"
        try:
            span = remote.header_span(header_len, self.session.read_bytes(node, path, 8, header_len))
        except (ValueError, KeyError, TypeError, IndexError) as e:
            return f"{name}: unreadable safetensors header ({e})"
        if span != size:
            return f"{name}: {size} bytes on disk but its header describes {span} (incomplete copy)"
        return None

    # -- image --

    def copy_image(self, src: str, dst: str, image: str, *, timeout: float | None = None) -> ImageCopyReport:
        """`docker save | ssh dst docker load` on src, then check both nodes hold the same image id."""
        started = time.monotonic()
        src_id = self.docker.image_id(src, image)
        if src_id is None:
            raise TransferError(f"node {src}: image {image} does not exist there; build it first")
        if self.docker.image_id(dst, image) == src_id:
            self.session.log.info(f"[{dst}] already holds {image} ({src_id[:19]}); not copied")
            return ImageCopyReport(src, dst, image, src_id, round(time.monotonic() - started, 2), skipped=True)
        route = self.ensure_peer_access(src, dst)
        self.session.run(src, remote.image_stream_argv(image, route), timeout=timeout or remote.IMAGE_COPY_TIMEOUT_S)
        dst_id = self.docker.image_id(dst, image)
        if dst_id != src_id:
            raise TransferError(
                f"image {image}: {dst} holds {dst_id} after the load but {src} has {src_id}; rerun the copy"
            )
        return ImageCopyReport(src, dst, image, src_id, round(time.monotonic() - started, 2), skipped=False)
