"""Light simulated nodes for scale: up to hundreds of nodes on loopback addresses of one machine.

A full sim node (layout.py, node_host.py) is a network namespace with its own sshd and dockerd;
a hundred of those do not fit on a build machine. A light node keeps what the health sweep and
ansible talk to for real and drops the rest:
- a real sshd per node, on its own loopback address 127.<slot>.<a>.<b> port 22, with its own
  ed25519 host key in a known_hosts file and key-only logins (the same sshd_config as a full
  node: NodeHost._sshd_config), all logging in as one unprivileged user;
- the sim's GB10 `nvidia-smi` (gpu_states.run on the real H200 captures, the node's state file),
  served by one resident process: the node's `nvidia-smi` is a bash client of it, because starting
  the Python stand-in costs ~0.3 s of CPU per call and a sweep of 100 nodes would then measure
  interpreter start-ups instead of the sweep;
- `docker`: THE ONE DOUBLE. A light node has no dockerd; its `docker` answers `container inspect`
  and `logs` for the serving container from files in the node's directory (a running container,
  the real vLLM log capture), "No such container" for any other name, and refuses everything else;
- the engine: /health (200) and /metrics (the real vLLM /metrics capture) on each node's address
  and the launch profile's port, served by the same resident process (asyncio).
An unreachable node is one whose address drops every packet (an iptables DROP in INPUT, in a
chain of this slot's own): connects time out, as to a node that is off, rather than being refused
(a blackhole route fails connect() at once with EINVAL, which no dead node does).

`LightFleet(...).up()` / `.down()` (also a context manager; `down` works from the root alone,
so it also clears what a killed run left). `python -m spark_sim.light down` does that by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from spark_sim.effects import alive, pid_from, run, user_pids, write
from spark_sim.fleet_doc import read_seed
from spark_sim.gpu_states import run as gpu_run
from spark_sim.layout import SSH_PORT, Layout, Member, SimError
from spark_sim.node_host import NodeHost
from spark_sim.nvidia_smi_standin import NO_DRIVER_RC, load_state

FIXTURES = Path(os.environ.get("SPARK_FIXTURES", "/work/shared/fixtures")) / "vllm-0.32.0-cpu"
DEFAULT_SLOT = 20
DEFAULT_ROOT = Path("/var/lib/spark-sim-light")
GPU_SERVICE_PORT = 9400  # on 127.<slot>.0.1: the resident nvidia-smi stand-in
MAX_LIGHT_NODES = 1000
READY_TIMEOUT_S = 60


def node_ip(slot: int, index: int) -> str:
    """Address of light node `index` (1-based): 127.<slot>.<1 + i // 200>.<10 + i % 200>."""
    i = index - 1
    return f"127.{slot}.{1 + i // 200}.{10 + i % 200}"


class LightFleet:
    def __init__(self, nodes: int, root: Path | None = None, slot: int | None = None) -> None:
        if not 1 <= nodes <= MAX_LIGHT_NODES:
            raise SimError(f"--nodes {nodes}: use 1-{MAX_LIGHT_NODES}")
        self.count = nodes
        self.slot = int(slot if slot is not None else os.environ.get("SPARK_SIM_SLOT", DEFAULT_SLOT))
        base = Path(root or os.environ.get("SPARK_SIM_ROOT") or DEFAULT_ROOT)
        self.root = base / "light"
        # Layout checks the slot and root the way `sim up` does; its client key / known_hosts paths are ours.
        self.layout = Layout(self.root, self.slot)
        self.user = f"sp{self.slot}-light"
        self.chain = f"SPARK-SIM{self.slot}-DROP"
        self.service_ip = f"127.{self.slot}.0.1"
        self.fleet_path = self.root / "fleet.yaml"
        self.inventory_path = self.root / "inventory.ini"
        self.members = [Member(name=f"light{i:03d}", ip=node_ip(self.slot, i), netns="", user=self.user,
                               dir=self.root / f"light{i:03d}", hardware="gx10")
                        for i in range(1, nodes + 1)]
        self._seed = read_seed()
        self.launch_port = int(self._seed["launch"].get("port", 8000))
        self.container = str(self._seed["launch"].get("container_name", "vllm-qwen35-v2"))
        self.cut_nodes: set[str] = set()

    @property
    def key_path(self) -> Path:
        return self.layout.key_path

    @property
    def known_hosts(self) -> Path:
        return self.layout.known_hosts

    def __enter__(self) -> LightFleet:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    # ------------------------------------------------------------------ up

    def up(self) -> LightFleet:
        self.down()  # whatever a killed run of this slot left
        try:
            self._make()
            self._start()
        except BaseException:
            self.down()
            raise
        return self

    def _make(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        write(self.root / ".spark-sim-light", f"slot {self.slot}\n")
        home = self.root / "home"
        run(["useradd", "-M", "-d", str(home), "-s", "/bin/sh", "-U", "-c", "spark-pipelines light sim", self.user],
            what=f"useradd {self.user}")
        run(["usermod", "-p", "*", self.user])  # no password, not locked: key logins work
        (home / ".ssh").mkdir(parents=True, mode=0o700, exist_ok=True)
        host = NodeHost(self.layout, lambda kind, value: None, None, self.launch_port, 52.0)  # type: ignore[arg-type]
        host.make_client_key()
        write(home / ".ssh" / "authorized_keys", Path(f"{self.key_path}.pub").read_text(), 0o600)
        run(["chown", "-R", f"{self.user}:{self.user}", str(home)])
        inspect = json.dumps([self._inspect_doc()])
        log = (FIXTURES / "vllm-compiled.log").read_text()
        known = []
        for m in self.members:
            for d in (m.bin, m.dir / "ssh", m.gpu_state_file.parent, m.dir / "container"):
                d.mkdir(parents=True, exist_ok=True)
            hostkey = m.dir / "ssh" / "ssh_host_ed25519_key"
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{m.name}-host", "-f", str(hostkey)],
                what=f"ssh-keygen (host key of {m.name})")
            known.append(f"{m.ip} {' '.join(Path(f'{hostkey}.pub').read_text().split()[:2])}\n")
            write(m.dir / "ssh" / "sshd_config", host._sshd_config(m, hostkey))
            write(m.gpu_state_file, json.dumps({"state": "healthy", "profile": "gx10"}), 0o664, owner=self.user)
            write(m.dir / "container" / "inspect.json", inspect)
            write(m.dir / "container" / "log", log)
            write(m.bin / "nvidia-smi", self._nvidia_smi_client(m), 0o755)
            write(m.bin / "docker", self._docker_double(m), 0o755)
        write(self.known_hosts, "".join(known))
        self._write_fleet()
        self._write_inventory()

    def _inspect_doc(self) -> dict[str, Any]:
        started = (dt.datetime.now(dt.UTC) - dt.timedelta(hours=2)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {
            "Id": "0" * 64, "Name": f"/{self.container}", "RestartCount": 0,
            "State": {"Status": "running", "Running": True, "Paused": False, "Restarting": False,
                      "OOMKilled": False, "Dead": False, "Pid": 4242, "ExitCode": 0, "Error": "",
                      "StartedAt": started, "FinishedAt": "0001-01-01T00:00:00Z"},
            "Config": {"Image": str(self._seed["launch"].get("image", "vllm-qwen35-v2")), "Labels": {}},
        }

    def _nvidia_smi_client(self, m: Member) -> str:
        # Request: a count line, then the state file and the arguments, NUL-terminated.
        # Answer: "<rc> <stderr lines>", those lines, then stdout.
        return (
            "#!/bin/bash\n"
            "# light-node nvidia-smi: the sim's GB10 stand-in, asked of its resident process (spark_sim.light)\n"
            f": \"${{SIM_GPU_STATE_FILE:={m.gpu_state_file}}}\"\n"
            f"exec 3<>/dev/tcp/{self.service_ip}/{GPU_SERVICE_PORT} 2>/dev/null || "
            f"{{ echo 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.' >&2; exit {NO_DRIVER_RC}; }}\n"
            "printf '%s\\n' \"$(($# + 1))\" >&3\n"
            "printf '%s\\0' \"$SIM_GPU_STATE_FILE\" \"$@\" >&3\n"
            "IFS=' ' read -r rc nerr <&3 || exit 9\n"
            "while [ \"$nerr\" -gt 0 ]; do IFS= read -r line <&3; printf '%s\\n' \"$line\" >&2; nerr=$((nerr - 1)); done\n"
            "cat <&3\n"
            "exit \"$rc\"\n"
        )

    def _docker_double(self, m: Member) -> str:
        d = m.dir / "container"
        return (
            "#!/bin/sh\n"
            "# light-node docker: THE double of a light node (it has no dockerd). Answers `container inspect`\n"
            "# and `logs` for the serving container from files; any other container does not exist.\n"
            f"dir={d}; serving={self.container}\n"
            "case \"$1\" in\n"
            "  container) [ \"$2\" = inspect ] || { echo \"light-node docker: unsupported: $*\" >&2; exit 125; }; shift 2; verb=inspect ;;\n"
            "  inspect) shift; verb=inspect ;;\n"
            "  logs) shift; verb=logs ;;\n"
            "  *) echo \"light-node docker: unsupported: $*\" >&2; exit 125 ;;\n"
            "esac\n"
            "tail=all\n"
            "while [ $# -gt 1 ]; do case \"$1\" in --tail|-n) tail=$2; shift 2 ;; *) shift ;; esac; done\n"
            "if [ \"$1\" != \"$serving\" ] || [ ! -f \"$dir/inspect.json\" ]; then\n"
            "  [ $verb = inspect ] && echo '[]'\n"
            "  echo \"Error: No such container: $1\" >&2; exit 1\n"
            "fi\n"
            "if [ $verb = inspect ]; then cat \"$dir/inspect.json\"; echo; exit 0; fi\n"
            "if [ \"$tail\" = all ]; then cat \"$dir/log\"; else tail -n \"$tail\" \"$dir/log\"; fi\n"
        )

    def _write_fleet(self) -> None:
        seed = self._seed
        template = next((n for n in seed["nodes"] if n.get("hardware") == "gx10"), seed["nodes"][-1])
        reach = {"port": SSH_PORT, "user": self.user, "key_path": str(self.key_path),
                 "known_hosts": str(self.known_hosts), "home": str(self.root / "home")}
        nodes = []
        for i, m in enumerate(self.members):
            node = {"name": m.name, "host": m.ip, **reach}
            node.update({k: v for k, v in template.items() if k not in node})
            node["roles"] = ["build", "serve"] if i == 0 else ["serve"]  # a fleet has exactly one build node
            nodes.append(node)
        doc = {**seed, "nodes": nodes}
        # The sweep never talks to the gateway; it points at the service address so nothing else answers.
        doc["gateway"] = {**seed["gateway"], "host": self.service_ip, **reach}
        write(self.fleet_path, yaml.safe_dump(doc, sort_keys=False))

    def _write_inventory(self) -> None:
        lines = ["[light]"] + [f"{m.name} ansible_host={m.ip} ansible_port={SSH_PORT}" for m in self.members]
        lines += ["", "[light:vars]", f"ansible_user={self.user}",
                  f"ansible_ssh_private_key_file={self.key_path}"]
        write(self.inventory_path, "\n".join(lines) + "\n")

    def _start(self) -> None:
        spec = {"service_ip": self.service_ip, "gpu_port": GPU_SERVICE_PORT, "engine_port": self.launch_port,
                "nodes": [m.ip for m in self.members], "metrics": str(FIXTURES / "metrics.txt")}
        write(self.root / "service.json", json.dumps(spec))
        log = open(self.root / "service.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", "spark_sim.light", "serve", str(self.root / "service.json")],
                             stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        log.close()
        write(self.root / "service.pid", f"{p.pid}\n")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
        for m in self.members:
            # sshd daemonizes itself and writes its PidFile.
            run(["/usr/sbin/sshd", "-f", str(m.dir / "ssh" / "sshd_config"), "-E", str(m.dir / "ssh" / "sshd.log")],
                what=f"starting sshd of {m.name}")
        self._wait_ready(p)

    def _wait_ready(self, service: subprocess.Popen[bytes]) -> None:
        import socket

        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = [(self.service_ip, GPU_SERVICE_PORT)] + [(m.ip, p) for m in self.members
                                                            for p in (SSH_PORT, self.launch_port)]
        while pending:
            if service.poll() is not None:
                raise SimError(f"the light nodes' service exited ({service.returncode}); see {self.root}/service.log")
            addr = pending[-1]
            try:
                socket.create_connection(addr, timeout=1).close()
                pending.pop()
                continue
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SimError(f"{addr[0]}:{addr[1]} did not listen within {READY_TIMEOUT_S} s; see {self.root}")
            time.sleep(0.1)

    # ------------------------------------------------------------------ unreachable nodes

    def cut(self, names: Iterable[str]) -> None:
        """Make these nodes drop every packet (a node that is off: connects time out)."""
        ips = {m.name: m.ip for m in self.members}
        if run(["iptables", "-n", "-L", self.chain], check=False).returncode != 0:
            run(["iptables", "-N", self.chain], what=f"iptables -N {self.chain}")
            run(["iptables", "-I", "INPUT", "-j", self.chain], what=f"iptables -I INPUT -j {self.chain}")
        for name in names:
            if name not in self.cut_nodes:
                run(["iptables", "-A", self.chain, "-d", f"{ips[name]}/32", "-j", "DROP"], what=f"cutting {name}")
                self.cut_nodes.add(name)

    def mend(self) -> None:
        """Every node reachable again."""
        if run(["iptables", "-n", "-L", self.chain], check=False).returncode == 0:
            run(["iptables", "-F", self.chain], check=False)
        self.cut_nodes.clear()

    # ------------------------------------------------------------------ down

    def down(self) -> None:
        """Stop and remove everything of this slot's light fleet (idempotent, from the root alone)."""
        if run(["iptables", "-n", "-L", self.chain], check=False).returncode == 0:
            while run(["iptables", "-D", "INPUT", "-j", self.chain], check=False).returncode == 0:
                pass
            run(["iptables", "-F", self.chain], check=False)
            run(["iptables", "-X", self.chain], check=False)
        self.cut_nodes.clear()
        pidfiles = [*self.root.glob("light*/ssh/sshd.pid"), self.root / "service.pid"] if self.root.exists() else []
        pids = [p for p in (pid_from(f) for f in pidfiles) if p and alive(p)]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        try:
            pwd.getpwnam(self.user)
            for pid in user_pids(self.user):  # its sessions left behind (a killed sweep's commands), by id
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            run(["userdel", self.user], check=False)
        except KeyError:
            pass
        if self.root.exists():
            if not (self.root / ".spark-sim-light").exists() and any(self.root.iterdir()):
                raise SimError(f"{self.root} was not made by the light sim; not deleting it")
            shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------------- the resident service


def _gpu_answer(fields: list[str]) -> bytes:
    state_file, args = Path(fields[0]), fields[1:]
    try:
        sim = load_state(state_file)
    except ValueError as e:
        out, err, rc = "", f"nvidia-smi stand-in: {e}\n", NO_DRIVER_RC
    else:
        result, new = gpu_run(args, sim, dt.datetime.now())
        if new != sim:  # settings changes (-pm, -lgc, -rgc) persist, as in nvidia_smi_standin
            tmp = state_file.with_suffix(".tmp")
            tmp.write_text(new.model_dump_json())
            tmp.replace(state_file)
        out, err, rc = result.stdout, result.stderr, result.returncode
    err_lines = err.splitlines()
    return f"{rc} {len(err_lines)}\n".encode() + "".join(f"{x}\n" for x in err_lines).encode() + out.encode()


async def _serve_gpu(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        count = int((await reader.readline()).strip() or 0)
        fields = [(await reader.readuntil(b"\0"))[:-1].decode() for _ in range(count)]
        writer.write(_gpu_answer(fields) if fields else b"9 1\nnvidia-smi stand-in: empty request\n")
        await writer.drain()
    except (ValueError, asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _engine_handler(metrics: bytes):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keep-alive: a client may reuse the connection for /metrics after /health
                request = await reader.readline()
                if not request:
                    return
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
                parts = request.split()
                path = parts[1].decode() if len(parts) > 1 else "/"
                if path == "/health":
                    status, body, ctype = "200 OK", b"", "text/plain"
                elif path == "/metrics":
                    status, body, ctype = "200 OK", metrics, "text/plain; version=0.0.4; charset=utf-8"
                else:
                    status, body, ctype = "404 Not Found", b'{"detail":"Not Found"}', "application/json"
                writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n"
                             .encode() + body)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
    return handle


async def _serve(spec: dict[str, Any]) -> None:
    metrics = Path(spec["metrics"]).read_bytes()
    servers = [await asyncio.start_server(_serve_gpu, spec["service_ip"], spec["gpu_port"], backlog=1024)]
    engine = _engine_handler(metrics)
    for ip in spec["nodes"]:
        servers.append(await asyncio.start_server(engine, ip, spec["engine_port"], backlog=256))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for s in servers:
        s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m spark_sim.light", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="(internal) the resident GPU + engine stand-in").add_argument("spec")
    down = sub.add_parser("down", help="remove a light fleet a killed run left (SPARK_SIM_SLOT / SPARK_SIM_ROOT)")
    down.add_argument("--root", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        asyncio.run(_serve(json.loads(Path(args.spec).read_text())))
        return 0
    try:
        LightFleet(1, root=args.root).down()
    except SimError as e:
        print(f"light sim: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
