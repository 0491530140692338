"""A simulated host's own parts: its user and keys, sshd, dockerd, sudoers drop-in, and the
stand-in programs on its PATH (nvidia-smi, hf, the GPU hook, litellm-reload/-restart, and the OS
programs of node_os.py: systemctl, sysctl, swap, cat/tee of /etc files, dpkg-query, apt-get, free, reboot).

Every program a node user runs is under the sim root (see node_lib.py), never in the checkout.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

from spark_pipelines.core import node_os as p0
from spark_pipelines.core.preflight import EXPORTER_UNITS
from spark_pipelines.core.fleet_settings import GatewayFront
from spark_pipelines.core.gateway_front import nginx_site
from spark_sim import node_os
from spark_sim.effects import run, write
from spark_sim.layout import LITELLM_BIN, LITELLM_MAIN, SSH_PORT, Layout, Member
from spark_sim.network import Record
from spark_sim.node_lib import NodeLib


SIM_RUNTIME = "sim-runc"  # dockerd's default runtime on every simulated node (runtime_shim.py)


class NodeHost:
    """Makes and starts the parts of each member under one layout."""

    def __init__(self, layout: Layout, record: Record, lib: NodeLib, engine_port: int,
                 tokens_per_second: float, front: GatewayFront | None = None, proxy_port: int = 4000) -> None:
        self.layout = layout
        self.proxy_port = proxy_port  # the gateway's client port (the fleet file's gateway.proxy_port)
        # The gateway's front as the fleet file sets it (nginx on the proxy port, LiteLLM behind
        # it on loopback: core/gateway_front.py); None: LiteLLM itself on the proxy port.
        self.front = front
        self._record = record
        self.lib = lib
        # The stand-in nvidia-smi shows load while the engine on this port has requests running.
        self.engine_port = engine_port
        self.tokens_per_second = tokens_per_second

    def make_client_key(self) -> None:
        lay = self.layout
        lay.client_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(lay.client_dir, 0o700)
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"spark-sim-{lay.slot}", "-f", str(lay.key_path)],
            what="ssh-keygen (client key)")

    def make_member(self, m: Member) -> list[str]:
        """User, files and keys of one member (its namespace exists); returns its host public key line."""
        lay = self.layout
        for d in (m.dir, m.bin, m.sbin, m.hook_dir, m.dir / "ssh", m.dir / "docker", m.gpu_state_file.parent):
            d.mkdir(parents=True, exist_ok=True)
            os.chmod(d, 0o755)
        self._record("users", m.user)
        run(["useradd", "-m", "-d", str(m.home), "-s", "/bin/bash", "-U", "-c", f"spark-pipelines sim {m.name}", m.user],
            what=f"useradd {m.user}")
        # A locked account ('!') makes sshd refuse even key logins; '*' = no password, not locked.
        run(["usermod", "-p", "*", m.user])
        ssh_dir = m.home / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        pub = Path(f"{lay.key_path}.pub").read_text()
        write(ssh_dir / "authorized_keys", pub, 0o600)
        # The same key on every node lets the build node stream to the serving nodes (rsync over ssh).
        shutil.copyfile(lay.key_path, ssh_dir / "id_ed25519")
        os.chmod(ssh_dir / "id_ed25519", 0o600)
        write(ssh_dir / "id_ed25519.pub", pub)
        run(["chown", "-R", f"{m.user}:{m.user}", str(m.home)])

        hostkey = m.dir / "ssh" / "ssh_host_ed25519_key"
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{m.name}-host", "-f", str(hostkey)],
            what=f"ssh-keygen (host key of {m.name})")
        write(m.dir / "ssh" / "sshd_config", self._sshd_config(m, hostkey))
        if m.is_gateway:
            self._make_gateway_files(m)
        else:
            self._make_node_files(m)
        return Path(f"{hostkey}.pub").read_text().split()[0:2]

    def _sshd_config(self, m: Member, hostkey: Path) -> str:
        env = [f"PATH={m.bin}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", f"SIM_NODE={m.name}"]
        if not m.is_gateway:
            env += [f"DOCKER_HOST={m.docker_host}", f"SIM_GPU_STATE_FILE={m.gpu_state_file}",
                    f"HF_HUB_CACHE={self.layout.hub_cache}"]
        lines = [
            f"# sshd of simulated {m.name}, written by `spark-pipelines sim up`",
            f"ListenAddress {m.ip}",
            f"Port {SSH_PORT}",
            f"HostKey {hostkey}",
            f"PidFile {m.sshd_pidfile}",
            f"AllowUsers {m.user}",
            "AuthorizedKeysFile .ssh/authorized_keys",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitRootLogin no",
            "UsePAM no",
            "StrictModes no",
            "MaxStartups 500:30:1000",
            "MaxSessions 100",
            "PrintMotd no",
            "ClientAliveInterval 30",
            "Subsystem sftp /usr/lib/openssh/sftp-server",
            "SetEnv " + " ".join(env),
        ]
        return "\n".join(lines) + "\n"

    def _make_node_files(self, m: Member) -> None:
        lib = self.lib
        state = {"state": "healthy", "profile": m.hardware, "engine_port": self.engine_port}
        write(m.gpu_state_file, json.dumps(state), 0o664, owner=m.user)
        # The GB10 nvidia-smi stand-in; under sudo the env is reset, hence the default state file.
        write(m.bin / "nvidia-smi", (
            "#!/bin/sh\n"
            f": \"${{SIM_GPU_STATE_FILE:={m.gpu_state_file}}}\"\n"
            f"export SIM_GPU_STATE_FILE PYTHONPATH={lib.path}\n"
            f"exec {lib.python} -s -m spark_sim.nvidia_smi_standin \"$@\"\n"
        ), 0o755)
        # `hf download` reads the local model source instead of the Hub.
        write(m.bin / "hf", f"#!/bin/sh\nexec {lib.python} -s {lib.module_file('hf_standin')} \"$@\"\n", 0o755)
        # runc runs the hook with an empty environment: everything is spelled out here.
        write(m.hook_dir / "nvidia-container-runtime-hook", (
            "#!/bin/sh\n"
            f"SIM_TOKENS_PER_SECOND={self.tokens_per_second:g} "
            f"PYTHONPATH={lib.path} exec {lib.python} -s {lib.module_file('gpu_hook')} "
            f"--state-file {m.gpu_state_file} \"$@\"\n"
        ), 0o755)
        # Root steps of the runbook, made harmless: drop caches writes a node-local file.
        vm = m.dir / "vm"
        vm.mkdir(exist_ok=True)
        write(m.sbin / "sh", (
            "#!/bin/sh\n"
            "# sim stand-in for `sudo sh -c 'sync; echo 3 > /proc/sys/vm/drop_caches'` on a node\n"
            "if [ \"$#\" -eq 2 ] && [ \"$1\" = -c ] && [ \"$2\" = 'sync; echo 3 > /proc/sys/vm/drop_caches' ]; then\n"
            f"  echo 3 > {vm}/drop_caches && date -u +%FT%TZ >> {vm}/drop_caches.log && exit 0\n"
            "fi\n"
            "# Phase 0's sysctl file (spark_sim/node_os.py writes the node's copy)\n"
            f"PYTHONPATH={lib.path} exec {lib.python} -s -m spark_sim.node_os {m.dir} sh \"$@\"\n"
        ), 0o755)
        self._make_os_files(m)
        # `sudo poweroff`: the node halts a second later (power.py), until `sim power NODE on`.
        write(m.sbin / "poweroff", (
            "#!/bin/sh\n"
            "# sim stand-in for poweroff: halts the simulated node a second later\n"
            f"echo halted > {m.dir}/power\n"
            f"(sleep 1; PYTHONPATH={lib.path} {lib.python} -s -m spark_sim.power halt {m.dir}) "
            f"</dev/null >>{m.dir}/power.log 2>&1 &\n"
            "echo 'The system will power off now!'\n"
        ), 0o755)
        self._install_sudoers(m, [
            f"{m.sbin}/poweroff",
            f"{m.sbin}/sh -c sync; echo 3 > /proc/sys/vm/drop_caches",
            "/usr/bin/fuser",
            f"{m.bin}/nvidia-smi -pm *", f"{m.bin}/nvidia-smi -lgc *", f"{m.bin}/nvidia-smi -rgc",
            *self._os_sudoers(m),
        ])
        # runc through the shim that clamps a container's spec to what this machine grants
        # (runtime_shim.py: a pair's --privileged and memlock=-1 where CAP_SYS_RESOURCE is missing).
        write(m.hook_dir / SIM_RUNTIME, (
            "#!/bin/sh\n"
            f"PYTHONPATH={lib.path} exec {lib.python} -s {lib.module_file('runtime_shim')} \"$@\"\n"
        ), 0o755)
        write(m.dir / "docker" / "daemon.json", json.dumps(
            {"runtimes": {SIM_RUNTIME: {"path": str(m.hook_dir / SIM_RUNTIME)}}, "default-runtime": SIM_RUNTIME}) + "\n")

    def _make_os_files(self, m: Member) -> None:
        """The OS parts Phase 0 touches (node_os.py): systemd, sysctl, swap, /etc files, earlyoom,
        free and reboot. Root programs in sbin (sudo finds them first), the user's readers in bin."""
        lib = self.lib
        node_os.provision(m.dir)
        run_os = f"PYTHONPATH={lib.path} exec {lib.python} -s -m spark_sim.node_os {m.dir}"
        for name in ("systemctl", "sysctl", "swapon", "swapoff", "tee", "rm", "cp", "sed", "apt-get"):
            write(m.sbin / name, f"#!/bin/sh\n# sim stand-in for {name} (spark_sim/node_os.py)\n{run_os} {name} \"$@\"\n",
                  0o755)
        for name in ("systemctl", "sysctl", "swapon"):  # their read-only forms need no sudo
            (m.bin / name).symlink_to(m.sbin / name)
        for name in ("dpkg-query", "free"):
            write(m.bin / name, f"#!/bin/sh\n# sim stand-in for {name} (spark_sim/node_os.py)\n{run_os} {name} \"$@\"\n",
                  0o755)
        etc = m.dir / "etc"
        # `cat` of the two /etc files Phase 0 writes reads the node's copies; anything else is /bin/cat.
        write(m.bin / "cat", (
            "#!/bin/sh\n"
            "# sim stand-in for cat: the node's own /etc/fstab and sysctl.d file, else the real cat\n"
            "if [ \"$#\" -eq 1 ]; then case \"$1\" in\n"
            + "".join(f"  {p}) [ -e {etc}{p} ] && exec /bin/cat {etc}{p}; echo \"cat: $1: No such file or directory\" >&2; exit 1 ;;\n"
                      for p in node_os.ETC_FILES)
            + "esac; fi\n"
            "exec /bin/cat \"$@\"\n"
        ), 0o755)
        # `sudo reboot`: returns, halts a second later, boots after the node's boot delay (reboot.py).
        write(m.sbin / "reboot", (
            "#!/bin/sh\n"
            "# sim stand-in for reboot: halts the simulated node a second later, then boots it\n"
            f"tok=$(PYTHONPATH={lib.path} {lib.python} -s -m spark_sim.reboot {m.dir} start) || exit 1\n"
            f"PYTHONPATH={lib.path} setsid {lib.python} -s -m spark_sim.reboot {m.dir} run \"$tok\" "
            f"</dev/null >>{m.dir}/power.log 2>&1 &\n"
            "echo 'The system will reboot now!'\n"
        ), 0o755)

    def _os_sudoers(self, m: Member) -> list[str]:
        """Exactly the lines `spark-pipelines sudoers` gives an operator for Phase 0 and its undo
        (the product's own, with this node's stand-in programs), and the deploy's two exporter
        lines: a command the product runs as root that those lines do not allow fails here too."""
        programs = {name: f"{m.sbin}/{name}" for name in p0.PROGRAMS}
        exporter = [f"{m.sbin}/systemctl {verb} {u}" for u in EXPORTER_UNITS for verb in ("stop", "start")]
        return [*p0.sudoers_commands(p0.Choices(disable_tailscale=True), programs), *exporter]

    def _make_gateway_files(self, m: Member) -> None:
        """`litellm-reload` stands in for `docker compose kill -s SIGHUP litellm` (a graceful reload),
        `litellm-restart` for `docker compose restart litellm`. The proxy runs as
        root through one sudoers line (as it would in its container): the litellm venv's
        interpreter lives under root's 0700 home, out of the gateway user's reach."""
        work = m.home / "litellm"
        work.mkdir(exist_ok=True)
        shutil.chown(work, m.user, m.user)
        key = os.environ.get("LITELLM_MASTER_KEY") or f"sk-sim-{secrets.token_urlsafe(24)}"
        key_file = m.dir / "master_key"  # root-only; the proxy reads it, never the command line
        write(key_file, key + "\n", 0o600)
        cfg, pidfile, log = work / "config.yaml", m.dir / "litellm.pid", work / "litellm.log"
        # Behind the front LiteLLM listens on loopback only; the front (start_front) takes the port.
        where = (f"--host 127.0.0.1 --port {self.front.litellm_port}" if self.front else f"--host {m.ip} --port {self.proxy_port}")
        if self.front:
            self._make_front_files(m)
        write(m.sbin / "litellm-proxy", (
            "#!/bin/sh\n"
            "# The simulated gateway's LiteLLM proxy, run as root via sudo. Under gunicorn (one worker,\n"
            "# the app preloaded) as a compose service running `litellm --run_gunicorn` would be:\n"
            "#   litellm-proxy          stop it if it runs, start it: drops every stream in flight\n"
            "#   litellm-proxy reload   SIGHUP to the running master: a new worker reads the config,\n"
            "#                          the old one finishes its streams (start it if none runs)\n"
            "#   litellm-proxy stop     stop it (what a SIGHUP does to a proxy not under gunicorn)\n"
            "set -u\n"
            f"cfg={cfg}; pidfile={pidfile}; log={log}\n"
            f"[ -x {LITELLM_BIN} ] || {{ echo \"litellm-proxy: {LITELLM_BIN} is missing; install litellm[proxy] there\" >&2; exit 1; }}\n"
            "[ -f \"$cfg\" ] || { echo \"litellm-proxy: $cfg does not exist; write the gateway config first\" >&2; exit 1; }\n"
            # One start or stop at a time, as docker serialises a service's restarts: two
            # overlapping restarts each started a proxy, the pid file named the one that lost the
            # port, and the winner kept serving a stale config that no reload or restart reached.
            # The lock's descriptor is closed for the proxy itself (9>&- below).
            f"exec 9>{m.dir / 'litellm.lock'}\n"
            "flock -w 150 9 || { echo \"litellm-proxy: another start or stop of the proxy did not end in 150 s\" >&2; exit 1; }\n"
            "old=; [ -f \"$pidfile\" ] && old=$(cat \"$pidfile\")\n"
            "alive() { [ -n \"$1\" ] && grep -q litellm \"/proc/$1/cmdline\" 2>/dev/null; }\n"
            "if [ \"${1:-}\" = reload ] && alive \"$old\"; then\n"
            "  kill -HUP \"$old\" && { echo \"$old\"; exit 0; }\n"
            "fi\n"
            # Stopped as `docker compose restart` stops a service (SIGTERM, 10 s, SIGKILL), to the
            # master's whole process group (setsid): a worker outlives a killed master and keeps the
            # port. dash's kill takes a group as -PGID, without --.
            "if [ -n \"$old\" ] && kill -0 -\"$old\" 2>/dev/null; then\n"
            "  kill -TERM -\"$old\" 2>/dev/null\n"
            "  i=0; while kill -0 -\"$old\" 2>/dev/null && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done\n"
            "  kill -KILL -\"$old\" 2>/dev/null\n"
            "fi\n"
            # Anything else still running this config (a proxy started outside the pid file) goes
            # too: the container a restart replaces holds every process of the service.
            "pkill -KILL -f \"config $cfg\" 2>/dev/null; i=0\n"
            "while pgrep -f \"config $cfg\" >/dev/null && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done\n"
            "rm -f \"$pidfile\"\n"
            "[ \"${1:-}\" = stop ] && { echo stopped; exit 0; }\n"
            f"LITELLM_MASTER_KEY=$(cat {key_file})\n"
            # Without LITELLM_LOCAL_MODEL_COST_MAP the proxy first tries an internet download. An old
            # worker waits this long for its streams after a reload (LiteLLM's default 30 s would cut
            # a long reasoning answer).
            "GRACEFUL_SHUTDOWN_TIMEOUT=900\n"
            "export LITELLM_MASTER_KEY LITELLM_LOCAL_MODEL_COST_MAP=True GRACEFUL_SHUTDOWN_TIMEOUT\n"
            f"cd {work}\n"
            # `litellm` itself, with the ascii codec imported first: LiteLLM 1.108's gunicorn master
            # starts its query-engine reaper thread just before it forks the worker, the thread's
            # first /proc read imports encodings.ascii, and a fork in that moment leaves the worker
            # waiting forever on that module's lock (apscheduler -> tzlocal at startup).
            f"setsid {LITELLM_BIN.parent / 'python3'} -c '{LITELLM_MAIN}' --config \"$cfg\" {where} "
            "--run_gunicorn --num_workers 1 >\"$log\" 2>&1 </dev/null 9>&- &\n"
            "echo $! > \"$pidfile\"\n"
            "chmod 644 \"$log\"\n"
            "echo $!\n"
        ), 0o755)
        # LiteLLM's own readiness (not the front's answer for it).
        url = (f"http://127.0.0.1:{self.front.litellm_port}/health/liveliness" if self.front
               else f"http://{m.ip}:{self.proxy_port}/health/liveliness")
        # A restart truncates the log: its startup line is the new worker's, not an old one
        # answering while it stops.
        started = "grep -aq 'Application startup complete' \"$log\" && "
        for script, argv, did, ready in (("litellm-restart", "litellm-proxy", "ready", started),
                                         ("litellm-reload", "litellm-proxy reload", "reloaded", "")):
            write(m.bin / script, (
                "#!/bin/sh\n"
                f"# `sudo {argv}`, then wait until the proxy answers.\n"
                "set -u\n"
                f"log={log}\n"
                f"pid=$(sudo -n {argv}) || exit 1\n"
                "i=0\n"
                "while [ $i -lt 240 ]; do\n"
                f"  if {ready}python3 -c \"import urllib.request as u; u.urlopen('{url}', timeout=1)\" 2>/dev/null; then\n"
                f"    echo \"litellm {did} on {m.ip}:{self.proxy_port} (pid $pid)\"; exit 0\n"
                "  fi\n"
                f"  [ -d /proc/$pid ] || {{ echo '{script}: the proxy exited:' >&2; tail -n 5 \"$log\" >&2; exit 1; }}\n"
                "  sleep 0.5; i=$((i+1))\n"
                "done\n"
                f"echo \"{script}: not ready after 120 s; see $log\" >&2; exit 1\n"
            ), 0o755)
        self._install_sudoers(m, [f"{m.sbin}/litellm-proxy"])

    def _install_sudoers(self, m: Member, commands: list[str]) -> None:
        sudoers = (
            f"# simulated {m.name}, written by `spark-pipelines sim up`; `sim down` removes it\n"
            f"Defaults:{m.user} secure_path=\"{m.sbin}:{m.bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\"\n"
            f"{m.user} ALL=(root) NOPASSWD: {', '.join(commands)}\n"
        )
        check = m.dir / "sudoers.check"
        write(check, sudoers, 0o440)
        run(["visudo", "-cf", str(check)], what=f"visudo check of the sudoers drop-in for {m.name}")
        check.unlink()
        self._record("sudoers", str(m.sudoers_file))
        write(m.sudoers_file, sudoers, 0o440)

    def write_known_hosts(self, members: list[Member], host_keys: dict[str, list[str]]) -> None:
        lines = "".join(f"{m.ip} {' '.join(host_keys[m.name])}\n" for m in members)
        write(self.layout.known_hosts, lines, 0o644)
        for m in members:
            write(m.home / ".ssh" / "known_hosts", lines, 0o644, owner=m.user)

    def start_sshd(self, m: Member) -> None:
        start_sshd(m)

    def _make_front_files(self, m: Member) -> None:
        """The front's nginx: the product's site (core/gateway_front.py) in a main config of its
        own under the member's dir (pid, logs, temp files there; workers as the gateway user)."""
        assert self.front is not None
        d = m.dir / "front"
        (d / "tmp").mkdir(parents=True, exist_ok=True)
        shutil.chown(d / "tmp", m.user, m.user)
        os.chmod(d / "tmp", 0o700)
        write(d / "site.conf", nginx_site(proxy_port=self.proxy_port, litellm_port=self.front.litellm_port,
                                          idle_timeout_s=self.front.idle_timeout_s,
                                          source="the simulated fleet's gateway section"), 0o644)
        write(d / "nginx.conf", (
            "# The simulated gateway host's nginx (the front before LiteLLM), written by `sim up`.\n"
            f"user {m.user};\nworker_processes 1;\npid {d / 'nginx.pid'};\nerror_log {d / 'error.log'} warn;\n"
            "events { worker_connections 1024; }\n"
            "http {\n    access_log off;\n"
            + "".join(f"    {kind}_temp_path {d / 'tmp' / kind};\n"
                      for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
            + f"    include {d / 'site.conf'};\n}}\n"), 0o644)

    def start_front(self, m: Member) -> None:
        """nginx in the gateway's namespace on the proxy port, for the life of the sim (as the
        Debian service runs on a real gateway host): LiteLLM's restarts never touch it."""
        if not self.front:
            return
        d = m.dir / "front"
        argv = ["ip", "netns", "exec", m.netns, "nginx", "-c", str(d / "nginx.conf"), "-e", str(d / "error.log")]
        run([*argv, "-t", "-q"], what=f"checking the front's nginx config of {m.name}")
        # nginx daemonizes itself (no zombie left with the caller) and writes its pid file.
        run(argv, what=f"starting the front (nginx) of {m.name}")

    def start_dockerd(self, m: Member) -> None:
        d = m.dir / "docker"
        env = {
            "PATH": f"{m.hook_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(d),
            "LANG": "C.UTF-8",
        }
        # Not `ip netns exec`: it remounts /sys and so hides the cgroup mounts dockerd needs.
        # A private mount namespace (slave: host mounts still come in) keeps dockerd's overlay
        # mounts out of the host's table, so a crashed sim leaves no mounts behind.
        argv = [
            "setsid", "-f", "unshare", "--mount", "--propagation", "slave",
            "nsenter", f"--net=/run/netns/{m.netns}", "dockerd",
            "--config-file", str(d / "daemon.json"),
            "--data-root", str(d / "data"),
            "--exec-root", str(d / "exec"),
            "--pidfile", str(m.dockerd_pidfile),
            "-H", m.docker_host,
            "--group", m.user,
            "--storage-driver", "overlay2",
            "--iptables=false", "--ip-forward=false", "--ip-masq=false", "--bridge=none",
            "--userland-proxy=false", "--log-level", "warn",
            "--cgroup-parent", self.cgroup_parent(m),
        ]
        with open(d / "dockerd.log", "ab") as log:
            # setsid -f: dockerd is re-parented away from us, so no zombie stays with the caller.
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, check=True, timeout=30)

    def cgroup_parent(self, m: Member) -> str:
        return f"spark-sim-{m.netns}"


def start_sshd(m: Member) -> None:
    log = m.dir / "ssh" / "sshd.log"
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege separation dir
    # sshd daemonizes itself (no zombie left with the caller) and writes its PidFile.
    run(["ip", "netns", "exec", m.netns, "/usr/sbin/sshd", "-f", str(m.dir / "ssh" / "sshd_config"), "-E", str(log)],
        what=f"starting sshd of {m.name}")
