"""A fake `nvidia-smi` for the simulated fleet: ``python -m spark_pipelines.sim.nvidia_smi_standin``.

The node's GPU state lives in a JSON file whose path is in ``SIM_GPU_STATE_FILE``,
e.g. ``{"state": "healthy", "profile": "founders", "under_load": false}``.
Commands that change GPU settings (-pm, -lgc, -rgc) write the file back.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from spark_pipelines.sim.gpu_states import SimGpu, run

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
    result, new_sim = run(args, sim, dt.datetime.now())
    if new_sim != sim:
        tmp = state_file.with_suffix(state_file.suffix + ".tmp")
        tmp.write_text(new_sim.model_dump_json(), encoding="utf-8")
        tmp.replace(state_file)  # atomic, so a concurrent reader never sees half a file
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
