"""A fake `nvidia-smi` for the simulated fleet: ``python -m spark_sim.nvidia_smi_standin``.

The node's GPU state lives in a JSON file whose path is in ``SIM_GPU_STATE_FILE``,
e.g. ``{"state": "healthy", "profile": "founders", "under_load": false}``.
Commands that change GPU settings (-pm, -lgc, -rgc) write the file back.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from spark_pipelines.core.diagnosis import parse_metrics
from spark_sim.gpu_states import SimGpu, run

STATE_FILE_ENV = "SIM_GPU_STATE_FILE"
# nvidia-smi's own code when it cannot reach a driver: the closest truthful answer
# when the simulated node has no readable GPU state.
NO_DRIVER_RC = 9


def load_state(path: Path) -> SimGpu:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ValueError(f"{STATE_FILE_ENV}={path}: file does not exist") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{STATE_FILE_ENV}={path}: not JSON ({exc.msg}, line {exc.lineno})") from exc
    try:
        return SimGpu.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in exc.errors()
        )
        raise ValueError(f"{STATE_FILE_ENV}={path}: {problems}") from exc


def engine_busy(port: int | None, timeout_s: float = 3.0) -> bool:
    """Whether the engine on this node's loopback reports a request running (vLLM's gauge).
    The timeout is generous: an engine streaming on a loaded 2-core CI machine can take a second
    to answer, and a timeout reads as idle, hiding a wedge that shows only under load."""
    if port is None:
        return False
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
            text = resp.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return False  # no engine, or one still starting: the GPU is not decoding
    return parse_metrics(text).get("vllm:num_requests_running", 0.0) > 0


def main(argv: Sequence[str] | None = None, state_file: Path | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if state_file is None:
        env = os.environ.get(STATE_FILE_ENV)
        if not env:
            sys.stderr.write(
                f"nvidia-smi stand-in: set {STATE_FILE_ENV} to the node's GPU state JSON file\n"
            )
            return NO_DRIVER_RC
        state_file = Path(env)
    try:
        sim = load_state(state_file)
    except ValueError as exc:
        sys.stderr.write(f"nvidia-smi stand-in: {exc}\n")
        return NO_DRIVER_RC
    seen = sim if sim.under_load else sim.model_copy(update={"under_load": engine_busy(sim.engine_port)})
    result, new_seen = run(args, seen, dt.datetime.now())
    if new_seen != seen:
        # Only settings changes (-pm, -lgc, -rgc) are persisted, never the observed load.
        new_sim = new_seen.model_copy(update={"under_load": sim.under_load})
        tmp = state_file.with_suffix(state_file.suffix + ".tmp")
        tmp.write_text(new_sim.model_dump_json(), encoding="utf-8")
        tmp.replace(state_file)  # atomic, so a concurrent reader never sees half a file
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
