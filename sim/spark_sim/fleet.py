"""The simulated GB10 fleet: real sshd and dockerd per node, each in its own network namespace.

`spark-pipelines sim up` starts N nodes on this machine and writes a fleet file for them that is
the seed fleet with only the addresses, users, keys, repository URLs and commits changed, so every
other command runs against the simulation exactly as against the real Sparks.

Layout (slot s = SPARK_SIM_SLOT, default 0; root = SPARK_SIM_ROOT, default /var/lib/spark-sim):
- a switch namespace `<p>-net` holding one bridge; the root namespace joins it as 10.213.s.1/24,
  the gateway host is 10.213.s.2, node i is 10.213.s.(10+i) (network.py).
- per node `<p>-<node>`: netns, an ordinary user `<p>-<node>` (home under the root), an sshd
  (key-only, own host key) on port 22, a dockerd on a unix socket under the root (host networking
  only), `nvidia-smi` and `nvidia-container-runtime-hook` stand-ins, a sudoers drop-in for the
  runbook's root steps.
- the gateway `<p>-gateway`: netns, user, sshd, the real LiteLLM proxy under gunicorn (a
  `litellm-restart` script standing in for `docker compose restart litellm`) and, when the fleet
  file's gateway has a `front`, nginx on the proxy port before it (core/gateway_front.py).
- `<root>/lib/python`: everything the node programs import, copied there (node_lib.py): a node
  never reads the checkout, which may sit in a folder only root can enter.
Everything made is recorded in `<root>/state.json` before it is made, so `sim down` also cleans up
after a crash. Modules: layout (names, addresses), network, node_host (users, sshd, dockerd,
sudoers, stand-in programs), node_lib, fleet_doc (the fleet file), effects, cli; this one holds the
lifecycle (up, down, status, set_gpu) and the state file.
"""

from __future__ import annotations

import grp
import hashlib
import json
import os
import pwd
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from spark_pipelines.core.fleet import load_fleet, parse_fleet
from spark_sim import base_image, gpu_hook, network, node_lib, power
from spark_sim.effects import (alive, cgroup_parents, cgroup_pids, comm, docker_ping, dockerd_failed, kill_all,
                               netns_exists, netns_pids, pid_from, remove_cgroups, run, ssh_banner, unmount_under,
                               user_pids, wait_until, write)
from spark_sim.fleet_doc import fleet_doc, gateway_of, read_seed
from spark_sim.layout import (DEFAULT_FLEET_OUT, DEFAULT_TOKENS_PER_SECOND, GPU_STATES, INSTALL_HINT, MAX_NODES,
                              REQUIRED_BINARIES, SSH_PORT, Layout, Member, SimError)
from spark_sim.node_host import NodeHost

__all__ = ["Layout", "Member", "SimError", "SimFleet"]


class SimFleet:
    """A simulated fleet under one root. `up()` then `down()`; `status()` and `set_gpu()` between."""

    def __init__(self, root: str | os.PathLike[str] | None = None, slot: int | None = None) -> None:
        self.layout = Layout(Path(root) if root else None, slot)
        self.state: dict[str, Any] = self._load_state()

    # -- state file --

    def _load_state(self) -> dict[str, Any]:
        try:
            return json.loads(self.layout.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def _save_state(self) -> None:
        lay = self.layout
        if not lay.root.exists() or not any(lay.root.iterdir()):
            lay.root.mkdir(parents=True, exist_ok=True)
            lay.marker.touch()
        elif not lay.marker.exists():
            raise SimError(f"{lay.root} exists and was not made by the sim; set SPARK_SIM_ROOT to a new dir")
        write(self.layout.state_file, json.dumps(self.state, indent=2), mode=0o600)

    def _record(self, kind: str, value: str) -> None:
        made = self.state.setdefault("made", {})
        if value not in made.setdefault(kind, []):
            made[kind].append(value)
            self._save_state()

    # -- queries --

    @property
    def is_up(self) -> bool:
        return any(netns_exists(ns) for ns in self.state.get("made", {}).get("netns", []))

    @property
    def members(self) -> list[Member]:
        return [Member(**{**m, "dir": Path(m["dir"])}) for m in self.state.get("members", [])]

    @property
    def nodes(self) -> list[Member]:
        return [m for m in self.members if not m.is_gateway]

    @property
    def gateway(self) -> Member:
        return next(m for m in self.members if m.is_gateway)

    def node(self, name: str) -> Member:
        for m in self.nodes:
            if m.name == name:
                return m
        known = ", ".join(m.name for m in self.nodes) or "none (run `spark-pipelines sim up`)"
        raise SimError(f"no simulated node named {name!r}; known nodes: {known}")

    @property
    def fleet_file(self) -> Path | None:
        f = self.state.get("fleet_file")
        return Path(f) if f else None

    @property
    def hub_cache(self) -> Path | None:
        """The local model source (an HF hub cache) standing in for the Hugging Face hub."""
        h = self.state.get("hub_cache")
        return Path(h) if h else None

    @property
    def master_key_file(self) -> Path:
        """The gateway proxy's master key (root-only file)."""
        return self.gateway.dir / "master_key"

    # -- up --

    def up(self, nodes: int = 2, fleet_out: str | os.PathLike[str] = DEFAULT_FLEET_OUT,
           tokens_per_second: float = DEFAULT_TOKENS_PER_SECOND, link_mbit: float | None = None) -> Path:
        """Start `nodes` simulated nodes and the gateway host; write and return the fleet file.
        tokens_per_second: the stand-in engine's single-stream decode rate on a healthy node.
        link_mbit: every node's link rate each way (tc), like a real NIC; None leaves them unlimited."""
        if not 0 < tokens_per_second <= 100_000:
            raise SimError(f"--tokens-per-second {tokens_per_second:g}: choose a rate in (0, 100000]")
        if not 1 <= nodes <= MAX_NODES:
            raise SimError(f"--nodes {nodes}: choose between 1 and {MAX_NODES}")
        if link_mbit is not None and not 1 <= link_mbit <= 100_000:
            raise SimError(f"--link-mbit {link_mbit:g}: choose a rate between 1 and 100000 Mbit/s")
        if os.geteuid() != 0:
            raise SimError("sim up needs root (network namespaces, users, dockerd); run it as root")
        missing = [b for b in REQUIRED_BINARIES if not shutil.which(b)]
        if missing:
            raise SimError(f"missing programs: {', '.join(missing)}; {INSTALL_HINT}")
        _check_reachable(self.layout.root)
        if self.is_up:
            raise SimError(f"a simulated fleet is already up under {self.layout.root}; run `spark-pipelines sim down` first")
        if self.state or self.layout.root.exists():
            self.down()  # leftovers of a crashed run
        fleet_path = Path(fleet_out).resolve()
        seed = read_seed()
        members = self.layout.members(nodes)
        self.state = {
            "version": 1,
            "root": str(self.layout.root),
            "slot": self.layout.slot,
            "members": [{**m.__dict__, "dir": str(m.dir)} for m in members],
            "link_mbit": link_mbit,
            "tokens_per_second": tokens_per_second,
            "made": {},
        }
        self._save_state()
        try:
            with ThreadPoolExecutor(max_workers=1) as pool:
                # The base image (cached after the first run) builds while namespaces come up.
                tarball = pool.submit(base_image.build_tarball)
                # The stand-in nvidia-smi shows load while the engine on this port has requests running.
                host = NodeHost(self.layout, self._record, node_lib.install(self.layout.root),
                                engine_port=int(seed.get("launch", {}).get("port", 8000)),
                                tokens_per_second=tokens_per_second, **gateway_of(seed))
                host.make_client_key()
                power.write_smart_plug(self.layout)
                network.make_switch(self.layout, self._record)
                for m in members:
                    network.make_member_netns(self.layout, m, self._record)
                    if link_mbit is not None and not m.is_gateway:
                        network.limit_link(self.layout, m, link_mbit)
                self._make_pair_links(seed, members)
                host_keys = {m.name: host.make_member(m) for m in members}
                host.write_known_hosts(members, host_keys)
                for m in members:
                    host.start_sshd(m)
                host.start_front(self.gateway)
                for m in members:
                    if not m.is_gateway:
                        host.start_dockerd(m)
                for m in members:
                    wait_until(f"sshd of {m.name} ({m.ip}:{SSH_PORT})", lambda m=m: ssh_banner(m.ip), 15,
                               m.dir / "ssh" / "sshd.log")
                for m in members:
                    if not m.is_gateway:
                        log = m.dir / "docker" / "dockerd.log"
                        wait_until(f"dockerd of {m.name}", lambda m=m: docker_ping(m.docker_sock), 30, log,
                               failed=lambda log=log: dockerd_failed(log))
                tar = tarball.result()
            with ThreadPoolExecutor(max_workers=2) as pool:
                list(pool.map(lambda m: base_image.import_into(m.docker_host, tar), self.nodes))
            pins = self._make_upstream()
            doc = fleet_doc(self.layout, seed, members, pins, self.state.get("pair_links", {}))
            parse_fleet(doc, "simulated fleet")  # refuse to write a fleet the tools would refuse
            text = (
                "# Simulated fleet written by `spark-pipelines sim up`: the seed fleet with only what must\n"
                "# differ to reach the simulated nodes. `spark-pipelines sim down` removes it.\n"
                + yaml.safe_dump(doc, sort_keys=False)
            )
            self.state["fleet_file"] = str(fleet_path)
            self.state["fleet_sha256"] = hashlib.sha256(text.encode()).hexdigest()
            self._save_state()
            write(fleet_path, text)
            load_fleet(fleet_path)
        except BaseException:
            self.down()
            raise
        return fleet_path

    def _make_pair_links(self, seed: dict[str, Any], members: list[Member]) -> None:
        """The direct link of each of the seed's node pairs whose nodes are simulated (the pair
        stays off in the fleet file, as in the seed: a test or the operator turns it on)."""
        by_name = {m.name: m for m in members if not m.is_gateway}
        links: dict[str, dict[str, Any]] = {}
        for p in seed.get("pairs") or []:
            head, worker = by_name.get(p.get("head")), by_name.get(p.get("worker"))
            if head is None or worker is None or links:
                continue  # one link per sim: one subnet for it
            head_ip, worker_ip = network.make_pair_link(self.layout, head, worker)
            links[p["name"]] = {"head_address": head_ip, "worker_address": worker_ip, "mtu": network.LINK_MTU}
        self.state["pair_links"] = links
        self._save_state()

    def add_node(self, hardware: str = "gx10") -> Member:
        """A GB10 joins the running fleet, not yet in its fleet file (the operator adds it there):
        its namespace, user, sshd and dockerd with the base image, everyone's known_hosts updated.
        Returns it; `sim down` removes it with the rest."""
        if not self.is_up:
            raise SimError("no simulated fleet is up; run `spark-pipelines sim up` first")
        index = len(self.nodes) + 1
        if index > MAX_NODES:
            raise SimError(f"the fleet already has {MAX_NODES} nodes, the most a slot holds")
        m = self.layout.member(f"spark{index}", index, hardware)
        seed = read_seed()
        host = NodeHost(self.layout, self._record, node_lib.install(self.layout.root),
                        engine_port=int(seed.get("launch", {}).get("port", 8000)),
                        tokens_per_second=float(self.state.get("tokens_per_second", DEFAULT_TOKENS_PER_SECOND)))
        self.state["members"].insert(len(self.nodes), {**m.__dict__, "dir": str(m.dir)})
        self._save_state()
        network.make_member_netns(self.layout, m, self._record)
        if self.state.get("link_mbit") is not None:
            network.limit_link(self.layout, m, self.state["link_mbit"])
        host.make_member(m)
        keys = {x.name: (x.dir / "ssh" / "ssh_host_ed25519_key.pub").read_text().split()[0:2] for x in self.members}
        host.write_known_hosts(self.members, keys)
        host.start_sshd(m)
        host.start_dockerd(m)
        wait_until(f"sshd of {m.name} ({m.ip}:{SSH_PORT})", lambda: ssh_banner(m.ip), 15, m.dir / "ssh" / "sshd.log")
        log = m.dir / "docker" / "dockerd.log"
        wait_until(f"dockerd of {m.name}", lambda: docker_ping(m.docker_sock), 30, log,
                   failed=lambda: dockerd_failed(log))
        base_image.import_into(m.docker_host, base_image.build_tarball())
        trusted = (self.nodes[0].home / ".gitconfig")
        if trusted.exists():
            write(m.home / ".gitconfig", trusted.read_text(), 0o644, owner=m.user)
        return m

    def _make_upstream(self) -> dict[str, Any]:
        """Local stand-ins of the recipe and build repos and of the HF hub, if the module exists."""
        try:
            from spark_sim import upstream
        except ImportError:
            return {}
        base = self.layout.root / "upstream"
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o755)
        recipe_sha = upstream.make_recipe_repo(base / "recipe")
        build_sha = upstream.make_build_repo(base / "build")
        source = upstream.make_model_source(self.layout.hub_cache)
        self.state["hub_cache"] = str(source.hub_cache)
        self._save_state()
        # The stand-in repos belong to root; git refuses to clone a repo another user owns
        # ("dubious ownership"), so each node user trusts exactly these two.
        trusted = "".join(f"\tdirectory = {base / r}\n\tdirectory = {base / r}/.git\n" for r in ("recipe", "build"))
        for m in self.nodes:
            write(m.home / ".gitconfig", f"[safe]\n{trusted}", 0o644, owner=m.user)
        return {
            "recipe_repo": {"url": f"file://{base / 'recipe'}", "commit": recipe_sha},
            "build_repo": {"url": f"file://{base / 'build'}", "commit": build_sha},
            "base_model_revision": source.intel_revision,
            "fp8_model_revision": source.fp8_revision,
        }


    def down(self) -> list[str]:
        """Remove every process, container, namespace, user, sudoers file and file the sim made.
        Idempotent; works from the state file and the naming convention after a crash."""
        lay = self.layout
        if lay.root.exists() and not lay.marker.exists() and any(lay.root.iterdir()):
            raise SimError(f"{lay.root} was not made by the sim (no {lay.marker.name}); not touching it")
        made = self.state.get("made", {})
        done: list[str] = []
        netns = list(dict.fromkeys(
            [*made.get("netns", []),
             *(n.split()[0] for n in run(["ip", "netns", "list"], check=False).stdout.splitlines()
               if n.startswith(f"{lay.prefix}-"))]
        ))
        users = list(dict.fromkeys([*made.get("users", []), *(m.user for m in self.members)]))
        # Only users of ours: the prefix AND a home under the sim root.
        users += [p.pw_name for p in pwd.getpwall()
                  if p.pw_name.startswith(f"{lay.prefix}-") and p.pw_dir.startswith(f"{lay.root}/") and p.pw_name not in users]
        # Every process of a node lives in its namespace (sshd, sessions, dockerd, containerd,
        # containers, litellm): TERM them (dockerd stops its containers), then KILL the rest.
        cgroups = list(dict.fromkeys([*(f"spark-sim-{ns}" for ns in netns), *cgroup_parents(lay.prefix)]))

        def ours() -> list[int]:
            # Containers not on the host network have namespaces of their own: their cgroups
            # (under the node's --cgroup-parent) find them, also after dockerd was killed.
            return list(dict.fromkeys(
                [p for ns in netns for p in netns_pids(ns)]
                + [p for cg in cgroups for p in cgroup_pids(cg)]
                + [p for u in users for p in user_pids(u)]
            ))

        pids = ours()
        dockerds = [p for p in pids if comm(p) == "dockerd"]
        if dockerds:
            kill_all(dockerds, grace_s=10)
        pids = ours()
        if pids:
            kill_all(list(dict.fromkeys(pids)))
            done.append(f"stopped {len(pids)} processes")
        for cg in cgroups:
            remove_cgroups(cg)
        for ns in netns:
            if netns_exists(ns):
                run(["ip", "netns", "del", ns], check=False)
                done.append(f"removed netns {ns}")
        for link in [*made.get("links", []), lay.root_link]:
            if Path("/sys/class/net", link).exists():
                run(["ip", "link", "del", link], check=False)
        for u in users:
            try:
                pwd.getpwnam(u)
            except KeyError:
                continue
            run(["userdel", u], check=False)
            done.append(f"removed user {u}")
            try:
                grp.getgrnam(u)
                run(["groupdel", u], check=False)
            except KeyError:
                pass
        for f in {*made.get("sudoers", []), *(f"/etc/sudoers.d/{u}" for u in users)}:
            if Path(f).exists():
                Path(f).unlink()
        fleet_file = self.fleet_file
        if fleet_file and fleet_file.exists():
            # Only the file we wrote: an edited copy is the operator's now.
            if hashlib.sha256(fleet_file.read_bytes()).hexdigest() == self.state.get("fleet_sha256"):
                fleet_file.unlink()
                done.append(f"removed {fleet_file}")
        if lay.root.exists():
            unmount_under(lay.root)
            shutil.rmtree(lay.root, ignore_errors=True)
            if lay.root.exists():
                raise SimError(f"{lay.root} could not be removed completely; check `findmnt -R {lay.root}`")
            done.append(f"removed {lay.root}")
        self.state = {}
        return done

    # -- status and GPU state --

    def status(self) -> list[dict[str, Any]]:
        rows = []
        for m in self.members:
            sshd = pid_from(m.sshd_pidfile)
            row: dict[str, Any] = {
                "name": m.name, "ip": m.ip, "netns": m.netns, "netns_up": netns_exists(m.netns),
                "user": m.user, "sshd_pid": sshd, "sshd_alive": alive(sshd),
            }
            if not m.is_gateway:
                dockerd = pid_from(m.dockerd_pidfile)
                row.update({"dockerd_pid": dockerd, "dockerd_alive": alive(dockerd) and docker_ping(m.docker_sock)})
                try:
                    row["gpu"] = json.loads(m.gpu_state_file.read_text())
                except (OSError, ValueError):
                    row["gpu"] = None
                row["containers"] = self.containers(m) if row["dockerd_alive"] else []
            else:
                proxy = pid_from(m.dir / "litellm.pid")
                row.update({"litellm_pid": proxy, "litellm_alive": alive(proxy)})
            rows.append(row)
        return rows

    def containers(self, m: Member) -> list[str]:
        p = run(["docker", "ps", "-a", "--format", "{{.Names}} {{.Status}}"], check=False,
                 env={**os.environ, "DOCKER_HOST": m.docker_host})
        return [line for line in p.stdout.splitlines() if line.strip()]

    def set_gpu(self, node: str, state: str) -> list[str]:
        """Change a node's GPU state; running GPU containers see it too. Returns refreshed containers."""
        m = self.node(node)
        if state not in GPU_STATES:
            raise SimError(f"unknown GPU state {state!r}; use one of {', '.join(GPU_STATES)}")
        try:
            doc = json.loads(m.gpu_state_file.read_text())
        except (OSError, ValueError):
            doc = {"profile": m.hardware}
        doc["state"] = state
        write(m.gpu_state_file, json.dumps(doc), 0o664, owner=m.user)
        env = {**os.environ, "DOCKER_HOST": m.docker_host}
        ps = run(["docker", "ps", "-q"], env=env, what=f"docker ps on {m.name}")
        refreshed = []
        staged = m.dir / "gpu" / "container-state.json"
        gpu_hook.write_container_state(m.gpu_state_file, staged)
        for cid in ps.stdout.split():
            req = run(["docker", "inspect", "--format", "{{json .HostConfig.DeviceRequests}}", cid], env=env, check=False)
            if req.returncode != 0 or req.stdout.strip() in ("", "null", "[]"):
                continue
            run(["docker", "cp", str(staged), f"{cid}:/{gpu_hook.CONTAINER_STATE_PATH}"], env=env,
                 what=f"docker cp of the GPU state into {cid} on {m.name}")
            refreshed.append(cid)
        return refreshed


def _check_reachable(root: Path) -> None:
    """The node users live under the root: every folder above it must let them pass."""
    for d in root.parents:
        try:
            mode = d.stat().st_mode
        except OSError:
            continue  # made by `up` with mode 0755
        if not mode & 0o001:
            raise SimError(f"SPARK_SIM_ROOT={root} lies under {d} (mode {mode & 0o777:o}), which the simulated "
                           f"nodes' users cannot enter; choose a root outside it, e.g. /var/lib/spark-sim")

