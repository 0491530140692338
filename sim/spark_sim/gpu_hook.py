"""Stand-in for `nvidia-container-runtime-hook`, run by runc as an OCI prestart hook.

dockerd registers its `--gpus` device driver only when it finds a program of this name on its
PATH, and then adds it as a prestart hook to every container that asks for GPUs. The real hook
mounts the driver libraries into the container's rootfs; this one copies the simulated node's GPU
state file to /run/sim-gpu/state.json inside the rootfs, where the vLLM stand-in reads it.

It runs with an empty environment under runc, so it gets the state file path from its command
line (the per-node wrapper script that `sim up` writes passes it, and sets PYTHONPATH so the
free/total memory of a state comes from `gpu_states`, the one table of GB10 memory figures).
Invoked as: gpu_hook.py --state-file PATH prestart   (stdin: the OCI state JSON)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

CONTAINER_STATE_PATH = "run/sim-gpu/state.json"
# Values of NVIDIA_VISIBLE_DEVICES that mean "no GPU" for the real hook too.
NO_GPU = {"", "void", "none"}


def _rootfs(bundle: Path, config: dict) -> Path:
    root = Path(config.get("root", {}).get("path", "rootfs"))
    return root if root.is_absolute() else bundle / root


def _wants_gpu(config: dict) -> bool:
    for item in config.get("process", {}).get("env", []):
        key, _, value = item.partition("=")
        if key == "NVIDIA_VISIBLE_DEVICES":
            return value not in NO_GPU
    return False


def container_state(node_state: dict, desktop_gib: float = 0.0) -> dict:
    """The node's state plus what vLLM's startup check would read from the driver
    (free and total CUDA memory): nvidia-smi on a GB10 cannot show them, the container can.
    `desktop_gib`: what the node's desktop holds (gdm3 running), gone from the free memory."""
    doc = dict(node_state)
    if "free_gib" not in doc or "total_gib" not in doc:
        from spark_sim import gpu_states  # lazy: only when the node file lacks them

        doc.setdefault("free_gib", gpu_states.free_gib(doc.get("state", "healthy"), doc.get("profile", "founders")))
        doc.setdefault("total_gib", gpu_states.TOTAL_CUDA_GIB)
    if desktop_gib:
        doc["free_gib"] = round(max(0.0, doc["free_gib"] - desktop_gib), 2)
    if os.environ.get("SIM_TOKENS_PER_SECOND"):  # set by `sim up --tokens-per-second`
        doc.setdefault("tokens_per_second", float(os.environ["SIM_TOKENS_PER_SECOND"]))
    return doc


def write_container_state(node_state_file: Path, target: Path) -> None:
    from spark_sim.node_os import NodeOs, desktop_gib

    node_dir = node_state_file.parent.parent  # <node dir>/gpu/state.json
    doc = container_state(json.loads(node_state_file.read_text()), desktop_gib(NodeOs(node_dir)))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(doc))
    os.chmod(tmp, 0o644)
    tmp.replace(target)  # atomic: the stand-in re-reads the file while serving


def inject(state: dict, state_file: Path) -> Path | None:
    """Put the node's GPU state into the container's rootfs; returns the written path."""
    bundle = Path(state.get("bundle") or state.get("bundlePath") or ".")
    config = json.loads((bundle / "config.json").read_text())
    if not _wants_gpu(config):
        return None
    target = _rootfs(bundle, config) / CONTAINER_STATE_PATH
    write_container_state(state_file, target)
    return target


def main(argv: list[str]) -> int:
    state_file: Path | None = None
    rest: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "--state-file":
            state_file = Path(next(it, ""))
        else:
            rest.append(a)
    if not rest or rest[0] != "prestart":
        # poststart/poststop: nothing to undo, the rootfs goes away with the container.
        return 0
    if state_file is None or not state_file.is_file():
        print(f"nvidia-container-runtime-hook (sim): GPU state file {state_file} is missing; run `spark-pipelines sim up`",
              file=sys.stderr)
        return 1
    try:
        inject(json.load(sys.stdin), state_file)
    except (OSError, ValueError, ImportError) as e:
        print(f"nvidia-container-runtime-hook (sim): {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
