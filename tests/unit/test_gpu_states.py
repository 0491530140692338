"""The simulated GB10 nvidia-smi: built from the real H200 captures, read back by core.gpu."""

import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import pytest

from spark_pipelines.core.gpu import classify, combine, parse_query_csv, parse_reading
from spark_sim.gpu_states import (
    PROFILES,
    STATES,
    TOTAL_CUDA_GIB,
    SimGpu,
    free_gib,
    run,
    valid_query_fields,
)
from spark_sim.nvidia_smi_standin import main

NOW = dt.datetime(2026, 6, 18, 9, 5, 1, 123000)
H200 = Path("/work/shared/fixtures/nvidia-smi/h200")
CSV_FIELDS = "name,utilization.gpu,clocks.current.sm,clocks.max.sm,power.draw,memory.total,memory.free,clocks_event_reasons.active,clocks_event_reasons_counters.sw_power_cap,pstate,persistence_mode"

# (state, under_load) -> verdict. residue / low-memory look healthy to nvidia-smi.
EXPECTED = {
    ("healthy", True): "healthy",
    ("healthy", False): "idle",
    ("idle", True): "idle",
    ("idle", False): "idle",
    ("wedged", True): "wedged",
    ("wedged", False): "idle",
    ("residue", True): "healthy",
    ("residue", False): "idle",
    ("low-memory", True): "healthy",
    ("low-memory", False): "idle",
}


def smi(sim: SimGpu, *argv: str):
    result, _ = run(list(argv), sim, NOW)
    return result


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize(("state", "under_load"), list(EXPECTED))
def test_round_trip_verdicts(state: str, under_load: bool, profile: str) -> None:
    sim = SimGpu(state=state, profile=profile, under_load=under_load)
    csv = smi(sim, f"--query-gpu={CSV_FIELDS}", "--format=csv")
    perf = smi(sim, "-q", "-d", "PERFORMANCE,CLOCK,POWER")
    full = smi(sim, "-q")
    assert csv.returncode == perf.returncode == full.returncode == 0
    from_csv = parse_reading(csv.stdout)
    from_q = combine([parse_reading(full.stdout), parse_reading(perf.stdout)])
    for reading in (from_csv, from_q):
        assert reading.name == "NVIDIA GB10"
        assert reading.memory_total_mib is None  # unified memory: N/A
        assert classify(reading, under_load).state == EXPECTED[(state, under_load)]


def test_table_keeps_the_real_layout() -> None:
    real = (H200 / "nvidia-smi.txt").read_text().splitlines()
    for state in STATES:
        text = smi(SimGpu(state=state, profile="gx10", under_load=True), ).stdout
        lines = text.splitlines()
        assert [len(l) for l in lines] == [len(l) for l in real]
        assert "NVIDIA GB10" in text and "Not Supported" in text and "H200" not in text
    wedged = smi(SimGpu(state="wedged", profile="gx10", under_load=True)).stdout
    assert "10W /  N/A" in wedged and "97%" in wedged


def test_q_is_the_real_capture_with_gb10_values() -> None:
    real = (H200 / "nvidia-smi-q.txt").read_text().splitlines()
    text = smi(SimGpu(state="healthy", profile="founders"), "-q").stdout
    lines = text.splitlines()
    assert len(lines) == len(real)
    # Same keys in the same places: only values changed.
    keys = lambda ls: [l.split(" : ")[0].replace("00000000:00:06.0", "BUS") for l in ls]
    assert keys(lines).count("GPU BUS") == 0
    assert keys(l.replace("0000000F:01:00.0", "00000000:00:06.0") for l in lines) == keys(real)
    assert "H200" not in text and "00000000:00:06.0" not in text
    assert "GPU 0000000F:01:00.0" in text


def test_display_filter_shows_only_the_requested_sections() -> None:
    sim = SimGpu(state="healthy", profile="founders", under_load=True)
    perf = smi(sim, "-q", "-d", "PERFORMANCE").stdout
    assert "Clocks Event Reasons" in perf and "GPU Power Readings" not in perf and "Max Clocks" not in perf
    three = smi(sim, "-q", "-d", "PERFORMANCE,CLOCK,POWER").stdout
    real = (H200 / "nvidia-smi-q-perf-load.txt").read_text()
    section = lambda text: [l.strip().split(" :")[0].strip() for l in text.splitlines() if l.startswith("    ") and not l.startswith("     ")]
    assert section(three) == section(real)
    assert smi(sim, "-q", "-d", "BOGUS").returncode == 2


def test_query_units_noheader_and_na() -> None:
    sim = SimGpu(state="wedged", profile="founders", under_load=True)
    units = smi(sim, "--query-gpu=clocks.current.sm,memory.total,power.draw", "--format=csv")
    assert units.stdout.splitlines() == ["clocks.current.sm [MHz], memory.total [MiB], power.draw [W]", "611 MHz, [N/A], 10.20 W"]
    bare = smi(sim, "--query-gpu=clocks.current.sm,memory.total", "--format=csv,noheader,nounits")
    assert bare.stdout == "611, [N/A]\n"
    # The runbook's first-check command for the wedge.
    check = smi(sim, "--query-gpu=clocks.current.sm", "--format=csv,noheader")
    assert int(check.stdout.split()[0]) < 1000


def test_header_matches_the_real_capture_for_its_fields() -> None:
    real_header = (H200 / "query-idle.csv").read_text().splitlines()[0]
    fields = ",".join(cell.split(" [")[0].strip() for cell in real_header.split(","))
    result = smi(SimGpu(state="healthy", profile="gx10"), f"--query-gpu={fields}", "--format=csv")
    assert result.returncode == 0
    assert result.stdout.splitlines()[0] == real_header
    assert len(parse_query_csv(result.stdout)) == 1


def test_unknown_field_is_nvidia_smis_error() -> None:
    result = smi(SimGpu(state="healthy", profile="gx10"), "--query-gpu=name,cuda_version", "--format=csv")
    assert (result.stdout, result.stderr.strip(), result.returncode) == ("", 'Field "cuda_version" is not a valid field to query.', 2)
    assert "clocks_event_reasons.sw_power_cap" in valid_query_fields()
    assert "gpu_name" in valid_query_fields()


def test_compute_apps_is_empty_on_gb10() -> None:
    sim = SimGpu(state="residue", profile="founders")
    assert smi(sim, "--query-compute-apps=pid,used_memory", "--format=csv").stdout == "pid, used_gpu_memory [MiB]\n"
    assert smi(sim, "--query-compute-apps=pid,used_memory", "--format=csv,noheader").stdout == ""


def test_lgc_accepted_but_ignored_on_a_wedged_node() -> None:
    for state, expect_locked in (("wedged", False), ("healthy", True)):
        sim = SimGpu(state=state, profile="gx10", under_load=True, locked_clocks=None)
        result, locked = run(["-lgc", "2418,2430"], sim, NOW)
        assert result.returncode == 0 and "All done." in result.stdout
        clock = int(smi(locked, "--query-gpu=clocks.current.sm", "--format=csv,noheader,nounits").stdout)
        assert (clock <= 2430) is expect_locked or state == "wedged"
        assert (clock == 708) is (state == "wedged")
        _, reset = run(["-rgc"], locked, NOW)
        assert reset.locked_clocks is None
    assert run(["-lgc", "3003,2418"], SimGpu(state="healthy", profile="gx10"), NOW)[0].returncode == 2


def test_persistence_mode() -> None:
    sim = SimGpu(state="healthy", profile="gx10", persistence_mode=False)
    result, on = run(["-pm", "1"], sim, NOW)
    assert result.stdout.startswith("Enabled persistence mode for GPU") and on.persistence_mode
    again, _ = run(["-pm", "1"], on, NOW)
    assert "already Enabled" in again.stdout
    assert run(["--bogus"], sim, NOW)[0].returncode == 2


def test_free_gib_follows_the_runbook_gmu_check() -> None:
    need_085 = 0.85 * TOTAL_CUDA_GIB  # 103.44 GiB
    need_090 = 0.90 * TOTAL_CUDA_GIB
    for profile in PROFILES:
        for state in ("healthy", "idle", "wedged"):
            assert need_085 <= free_gib(state, profile) < need_090
        assert free_gib("residue", profile) < 97 < need_085  # "still < 97 GiB -> reboot"
        assert free_gib("low-memory", profile) < 0.80 * TOTAL_CUDA_GIB
    with pytest.raises(ValueError, match="unknown GPU state 'melted'"):
        free_gib("melted", "gx10")


def test_standin_cli_reads_and_writes_state_file(tmp_path: Path) -> None:
    state = tmp_path / "gpu.json"
    state.write_text(json.dumps({"state": "wedged", "profile": "gx10", "under_load": True}))
    env_cmd = [sys.executable, "-m", "spark_sim.nvidia_smi_standin"]
    env = {"SIM_GPU_STATE_FILE": str(state), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(env_cmd + ["-q", "-d", "PERFORMANCE"], env=env, capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[2])
    assert done.returncode == 0 and "SW Power Capping" in done.stdout
    assert main(["-lgc", "2418,3003"], state) == 0
    assert json.loads(state.read_text())["locked_clocks"] == [2418, 3003]


def test_standin_bad_state_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "gpu.json"
    state.write_text(json.dumps({"state": "melted", "profile": "gx10"}))
    assert main(["-q"], state) == 9
    err = capsys.readouterr().err
    assert "SIM_GPU_STATE_FILE" in err and "state" in err and "Traceback" not in err
    assert main(["-q"], tmp_path / "missing.json") == 9
    assert "does not exist" in capsys.readouterr().err


def test_gpu_shows_load_while_the_engine_reports_running_requests(tmp_path: Path, capsys) -> None:
    """The stand-in reads vLLM's own gauge on loopback, as the GPU is busy while vLLM decodes."""
    import http.server
    import threading

    running = {"n": 0}

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = f'vllm:num_requests_running{{model_name="m"}} {running["n"]}.0\n'.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state = tmp_path / "gpu.json"
    state.write_text(json.dumps({"state": "wedged", "profile": "gx10", "engine_port": server.server_port}))
    try:
        verdicts = []
        for n in (0, 2):
            running["n"] = n
            assert main([f"--query-gpu={CSV_FIELDS}", "--format=csv"], state_file=state) == 0
            verdicts.append(classify(parse_reading(capsys.readouterr().out), under_load=True).state)
        assert verdicts == ["idle", "wedged"]
        # The observed load is never written back into the node's state.
        assert main(["-pm", "0"], state_file=state) == 0
        assert json.loads(state.read_text())["under_load"] is False
        capsys.readouterr()
    finally:
        server.shutdown()
    state.write_text(json.dumps({"state": "healthy", "profile": "gx10", "engine_port": server.server_port}))
    assert main([f"--query-gpu={CSV_FIELDS}", "--format=csv"], state_file=state) == 0  # engine gone
    assert classify(parse_reading(capsys.readouterr().out), under_load=True).state == "idle"
