"""The simulated nodes' OCI runtime: runc, with each container's spec clamped to what this machine grants.

A node pair's launch is Phase 4-alt's `docker run --privileged --ulimit memlock=-1 ...`. On a GB10
dockerd grants both; the machine running the simulator may itself be a container without
CAP_SYS_RESOURCE, where runc then fails ("unable to apply caps", "error setting rlimit type 8").
Every simulated dockerd runs its containers through this shim (daemon.json's default runtime):
docker's CLI, API and `docker inspect` keep what was asked (Privileged, the ulimits), and only the
spec runc receives is clamped on `create`:
- capabilities outside this process's bounding set are dropped;
- an rlimit above this process's hard limit is lowered to it;
- a privileged container gets the default devices only, never this machine's /dev.
Every other runc command passes through unchanged. Invoked by containerd's shim as runc would be.
"""

from __future__ import annotations

import json
import os
import resource
import sys

RUNC = "runc"
_RLIMITS = {name: getattr(resource, name) for name in dir(resource) if name.startswith("RLIMIT_")}
# The devices docker gives every container (oci defaults): a privileged one gets only these here.
DEFAULT_DEVICES = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty", "/dev/ptmx",
                   "/dev/console", "/dev/fuse"}


def _bounding_caps() -> set[str]:
    with open("/proc/self/status", encoding="ascii") as fh:
        mask = next(int(line.split()[1], 16) for line in fh if line.startswith("CapBnd:"))
    names = ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
             "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
             "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE",
             "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT",
             "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
             "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN",
             "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF",
             "CAP_CHECKPOINT_RESTORE"]
    return {n for i, n in enumerate(names) if mask >> i & 1}


def clamp(spec: dict) -> list[str]:
    """Clamp `spec` (an OCI config) in place; returns what was changed (empty: nothing)."""
    said: list[str] = []
    proc = spec.get("process") or {}
    allowed = _bounding_caps()
    for kind, caps in (proc.get("capabilities") or {}).items():
        kept = [c for c in caps if c in allowed]
        if len(kept) != len(caps):
            said.append(f"{kind} capabilities without {sorted(set(caps) - allowed)}")
            proc["capabilities"][kind] = kept
    for lim in proc.get("rlimits") or []:
        which = _RLIMITS.get(lim.get("type", ""))
        if which is None:
            continue
        hard = resource.getrlimit(which)[1]
        if hard != resource.RLIM_INFINITY and lim.get("hard", 0) > hard:  # docker's -1 is 2**64-1 here
            said.append(f"{lim['type']} {lim.get('hard')} -> {hard}")
            lim["hard"] = hard
            lim["soft"] = min(lim.get("soft", hard), hard)
    linux = spec.get("linux") or {}
    devices = linux.get("devices") or []
    kept_devices = [d for d in devices if d.get("path") in DEFAULT_DEVICES]
    if len(kept_devices) != len(devices):
        said.append(f"{len(devices) - len(kept_devices)} host devices left out")
        linux["devices"] = kept_devices
    return said


def main(argv: list[str]) -> None:
    if "create" in argv or "run" in argv:
        bundle = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("--bundle", "-b")), None)
        if bundle:
            path = os.path.join(bundle, "config.json")
            with open(path, encoding="utf-8") as fh:
                spec = json.load(fh)
            if clamp(spec):
                with open(path + ".tmp", "w", encoding="utf-8") as fh:
                    json.dump(spec, fh)
                os.replace(path + ".tmp", path)
    os.execvp(RUNC, [RUNC, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
