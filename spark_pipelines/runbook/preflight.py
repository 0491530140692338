"""Phase 0 checks before a launch, with observing and acting kept apart.

`prepare` does the runbook's two actions (stop the monitoring exporters, flush the page cache) and
returns what it stopped, so the caller can start them again (`restore_exporters`) in every outcome.
`observe` only reads: GPU state, device holders, earlyoom, disk, CUDA-visible free memory.
`core.preflight.evaluate` turns the observations into ready / blocked with the runbook's fixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from spark_pipelines.core import gpu, preflight, remote
from spark_pipelines.core.fleet import Node
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.ssh import FleetSession, RemoteCommandError
from spark_pipelines.state import markers

MEMCHECK_PY = "import torch; f, t = torch.cuda.mem_get_info(); print(f / 2**30, t / 2**30)"
GPU_DEVICE = "/dev/nvidia0"
# One read gives every field of the wedge signature, counters included (CSV lacks them on 580).
GPU_QUERY = ("nvidia-smi", "-q", "-d", "PERFORMANCE,CLOCK,POWER,UTILIZATION")
# The runbook's flush, verbatim, so the sudoers line operators already have keeps matching.
DROP_CACHES = "sync; echo 3 > /proc/sys/vm/drop_caches"


def read_gpu(session: FleetSession, node: str, timeout: float = 30) -> gpu.GpuReading:
    """One nvidia-smi read of the node (raises GpuFormatError on output it cannot parse)."""
    return gpu.parse_reading(session.run(node, list(GPU_QUERY), check=False, log=False, timeout=timeout).stdout)


@dataclass
class Prepared:
    """What `prepare` changed on the node, for its undo."""

    stopped_exporters: list[str] = field(default_factory=list)  # containers
    stopped_units: list[str] = field(default_factory=list)  # systemd units (the host's node exporter)
    page_cache_flushed: bool = False

    @property
    def stopped_any(self) -> bool:
        return bool(self.stopped_exporters or self.stopped_units)


def running_exporters(session: FleetSession, node: Node) -> tuple[list[str], list[str]]:
    """The exporter containers and systemd units running on the node now (read-only)."""
    n = node.name
    running = session.run(n, ["docker", "ps", "--format", "{{.Names}}"], log=False, timeout=60).stdout.split()
    # `systemctl is-active U...` prints one state per unit, in order (exit 3 when one is not active).
    states = session.run(n, ["systemctl", "is-active", *preflight.EXPORTER_UNITS], check=False, log=False,
                   timeout=30).stdout.split()
    return ([c for c in preflight.EXPORTER_CONTAINERS if c in running],
            [u for u, st in zip(preflight.EXPORTER_UNITS, states) if st == "active"])


def prepare(session: FleetSession, node: Node, running: tuple[list[str], list[str]]) -> Prepared:
    """Stop the exporters `running_exporters` found (the containers hold a CUDA context, ~9 GiB)
    and flush the page cache (MANDATORY before every launch). Undo with `restore_exporters`."""
    n = node.name
    docker = NodeDocker(session)
    done = Prepared()
    containers, units = running
    for c in containers:
        docker.stop(n, c)
        done.stopped_exporters.append(c)
    for u in units:
        # Monitoring, not memory: a node without the sudoers line still launches, told the line.
        try:
            session.run(n, ["systemctl", "stop", u], sudo=True, timeout=120)
            done.stopped_units.append(u)
        except RemoteCommandError as e:
            session.log.warning(f"[{n}] {u} not stopped before the launch: {e}")
    # sync as the user, drop as root.
    session.run(n, ["sync"], log=False, timeout=300)
    flushed = session.run(n, ["sudo", "-n", "sh", "-c", DROP_CACHES], check=False, timeout=300)
    if not flushed.ok and "password" in (flushed.stderr + flushed.tail).lower():
        session.log.warning(remote.sudo_advice(n, node.user, f"/bin/sh -c {DROP_CACHES}"))
    done.page_cache_flushed = flushed.ok
    return done


def restore_exporters(session: FleetSession, node: Node, prepared: Prepared) -> None:
    """Start again what `prepare` stopped; every one is tried, the first failure raised after."""
    docker = NodeDocker(session)
    failed: list[Exception] = []
    for c in prepared.stopped_exporters:
        try:
            docker.start(node.name, c)
        except Exception as e:  # noqa: BLE001 - the others still start; raised below
            failed.append(e)
    for u in prepared.stopped_units:
        try:
            session.run(node.name, ["systemctl", "start", u], sudo=True, timeout=120)
        except RemoteCommandError as e:
            failed.append(e)
    if failed:
        raise failed[0]


def observe(session: FleetSession, node: Node, image: str, prepared: Prepared) -> preflight.Observations:
    """Read-only: what the node looks like right before a launch."""
    n = node.name
    try:
        reading = read_gpu(session, n)
        gpu_state = gpu.classify(reading, under_load=(reading.utilization_pct or 0) >= 50).state
    except gpu.GpuFormatError:
        gpu_state = "unknown"
    holders = session.run(n, ["sudo", "-n", "fuser", GPU_DEVICE], check=False, log=False, timeout=30)
    persist = session.run(n, ["pgrep", "-x", "nvidia-persistenced"], check=False, log=False, timeout=30)
    earlyoom = session.run(n, ["dpkg-query", "-W", "-f", "${Status}", "earlyoom"], check=False, log=False, timeout=30)
    df = session.run(n, ["df", "-Pk", node.home_dir], log=False, timeout=30).stdout.splitlines()[-1].split()
    mem = session.run(n, ["docker", "run", "--rm", "--gpus", "all", "--entrypoint", "python3", image, "-c", MEMCHECK_PY],
                check=False, log=False, timeout=300)
    free_gib = total_gib = None
    if mem.ok and mem.stdout.split():
        free_gib, total_gib = (round(float(x), 2) for x in mem.stdout.split()[-2:])
    return preflight.Observations(
        free_gib=free_gib,
        total_gib=total_gib,
        gpu_state=gpu_state,
        gpu_holder_pids=[int(p) for p in holders.stdout.split() if p.strip().isdigit()],
        persistenced_pids=[int(p) for p in persist.stdout.split() if p.isdigit()],
        earlyoom_installed="install ok installed" in earlyoom.stdout,
        running_exporters=[],  # `prepare` stopped them
        disk_free_gib=int(df[3]) / 2**20,
        page_cache_flushed=prepared.page_cache_flushed,
    )


def evaluate(session: FleetSession, node: Node, obs: preflight.Observations, gmu: float,
             residue_quarantine: bool = False) -> preflight.PreflightReport:
    """`residue_quarantine`: the node is quarantined for residue: also refuse until free memory
    is back at its clean-boot baseline (node_os's measured one, else the profile's)."""
    fleet = session.fleet
    prof = fleet.profile_of(node)
    measured = markers.read_clean_boot(session, node)  # node_os's memcheck after the Phase 0 reboot
    baseline = measured.free_gib if measured else prof.clean_boot_free_gib
    return preflight.evaluate(
        node.name, obs, gmu=gmu, max_gmu=prof.max_gmu, profile_total_gib=prof.cuda_total_gib,
        min_disk_gib=(fleet.preflight.build_host_disk_gib if node.name == fleet.build_node.name
                      else fleet.preflight.serve_node_disk_gib),
        residue_baseline_gib=baseline if residue_quarantine else None,
        measured_baseline_gib=measured.free_gib if measured else None,
    )
