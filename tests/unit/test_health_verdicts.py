"""core.health: every verdict from plain observations, driven by real captures where they apply
(vLLM 0.32.0 CPU logs and /metrics, H200 nvidia-smi) and by the sim's GB10 / vLLM stand-ins."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from spark_pipelines.core import diagnosis, gpu, health
from spark_pipelines.core.health import BenchHistory, ContainerState, Observation, judge
from spark_pipelines.runbook.preflight import GPU_QUERY
from spark_sim.gpu_states import SimGpu
from spark_sim.gpu_states import run as gb10_nvidia_smi
from tests.plugins.servers import HEALTHY_GPU, MANDATORY_ENV, RECIPE_FLAGS

VLLM = Path("/work/shared/fixtures/vllm-0.32.0-cpu")
H200 = Path("/work/shared/fixtures/nvidia-smi/h200")
NOW = 1_800_000_000.0
FOUNDERS_BASELINE = 117.5
GX10_BASELINE = 106.0


# ------------------------------------------------------------------ captures and stand-in outputs


def gb10(state: str, under_load: bool, profile: str = "gx10") -> gpu.GpuReading:
    """What the sim's GB10 nvidia-smi prints for the sweep's query, parsed by core.gpu."""
    out, _ = gb10_nvidia_smi(list(GPU_QUERY[1:]), SimGpu(state=state, profile=profile, under_load=under_load),
                             dt.datetime(2026, 6, 18, 12, 0, 0))
    assert out.returncode == 0
    return gpu.parse_reading(out.stdout)


def h200(name: str) -> gpu.GpuReading:
    return gpu.parse_reading((H200 / name).read_text())


def real_metrics(running: float | None = None) -> dict[str, float]:
    m = diagnosis.parse_metrics((VLLM / "metrics.txt").read_text())
    if running is not None:
        m["vllm:num_requests_running"] = running
    return m


def running(started_min_ago: float = 60.0, restarts: int = 0) -> ContainerState:
    return ContainerState(exists=True, status="running", running=True, restart_count=restarts,
                          exit_code=0, started_at=NOW - started_min_ago * 60)


def exited(code: int, oom: bool = False, restarts: int = 0) -> ContainerState:
    return ContainerState(exists=True, status="exited", running=False, restart_count=restarts, exit_code=code,
                          oom_killed=oom, started_at=NOW - 300, finished_at=NOW - 200)


def obs(**kw) -> Observation:
    base = dict(node="spark2", probed_at=NOW, ssh_ok=True, clean_boot_free_gib=GX10_BASELINE)
    base.update(kw)
    return Observation(**base)


def serving(**kw) -> Observation:
    base = dict(container=running(), health_ok=True, metrics=real_metrics(),
                log_tail=(VLLM / "vllm-eager.log").read_text(), gpu=gb10("healthy", under_load=False))
    base.update(kw)
    return obs(**base)


@pytest.fixture(scope="module")
def standin_logs(vllm_standin):
    """Failed starts of the sim's vLLM stand-in (it dies the way a GB10 does): {case: (exit, log)}."""
    residue_gpu = {**HEALTHY_GPU, "state": "residue", "profile": "gx10", "free_gib": 107.0}
    prefix = (*RECIPE_FLAGS, "--enable-prefix-caching")
    return {
        "residue": vllm_standin.run_to_exit(gpu=residue_gpu),
        "low-free": vllm_standin.run_to_exit(gpu={**HEALTHY_GPU, "free_gib": 96.5}),
        "prefix-caching": vllm_standin.run_to_exit(flags=prefix),
        "no-estimate": vllm_standin.run_to_exit(env={k: v for k, v in MANDATORY_ENV.items()
                                                     if k != "VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS"}),
    }


# ------------------------------------------------------------------ docker inspect and log starts


def test_container_state_reads_docker_inspect():
    inspect = json.loads("""[{"Id": "abc", "RestartCount": 4, "State": {"Status": "exited", "Running": false,
        "Paused": false, "Restarting": false, "OOMKilled": true, "Dead": false, "Pid": 0, "ExitCode": 137,
        "Error": "", "StartedAt": "2026-06-18T10:00:00.123456789Z", "FinishedAt": "2026-06-18T10:05:30Z"}}]""")[0]
    c = health.container_state(inspect)
    assert (c.exists, c.status, c.running, c.restart_count, c.exit_code, c.oom_killed) == \
        (True, "exited", False, 4, 137, True)
    assert c.error is None
    assert c.finished_at - c.started_at == pytest.approx(329.876543, abs=1e-3)
    fresh = health.container_state({"State": {"Status": "created", "StartedAt": "0001-01-01T00:00:00Z",
                                              "FinishedAt": "0001-01-01T00:00:00Z"}})
    assert fresh.started_at is None and fresh.finished_at is None and fresh.restart_count == 0
    assert health.container_state(None) == ContainerState(exists=False)


def test_a_restarted_containers_log_splits_into_its_starts():
    eager, compiled = (VLLM / "vllm-eager.log").read_text(), (VLLM / "vllm-compiled.log").read_text()
    runs = health.starts(eager + "\n" + compiled)
    assert len(runs) == 2
    assert [r.readiness.graph_mode for r in runs] == ["eager", "compiled"]
    assert all(r.readiness.startup_complete and r.failure_signature is None for r in runs)
    assert len(health.starts(eager)) == 1 and health.starts("") == []


# ------------------------------------------------------------------ healthy


def test_healthy_on_real_log_and_metrics_idle_gpu():
    v = judge(serving())
    assert v.verdict == "healthy" and not v.needs_action and v.advice == "nothing to do"
    assert "/health 200" in v.evidence
    assert any("0 running / 0 waiting" in e for e in v.evidence)
    assert any("not judged for the wedge" in e for e in v.evidence)


def test_healthy_under_load_at_full_clock_gb10_and_h200():
    h200_load = gpu.combine([h200("query-load.csv"), h200("nvidia-smi-q-perf-load.txt")])
    for reading in (gb10("healthy", under_load=True), h200_load):
        v = judge(serving(gpu=reading, metrics=real_metrics(running=3)))
        assert v.verdict == "healthy", v
        assert any(e.startswith("GPU under load: under load") for e in v.evidence)


def test_live_mtp_acceptance_is_in_the_evidence():
    m = {**real_metrics(), diagnosis.METRICS_OF_INTEREST[5]: 200.0, diagnosis.METRICS_OF_INTEREST[6]: 190.0}
    assert any("MTP acceptance 95.0%" in e for e in judge(serving(metrics=m)).evidence)


def test_high_restart_count_while_serving_is_not_a_loop_without_an_earlier_read():
    assert judge(serving(container=running(restarts=5))).verdict == "healthy"


# ------------------------------------------------------------------ wedged


def test_wedged_needs_the_whole_signature_under_load():
    v = judge(serving(gpu=gb10("wedged", under_load=True), metrics=real_metrics(running=2)))
    assert v.verdict == "wedged" and v.needs_action
    assert "PD firmware wedge signature complete" in v.evidence[0] and "708 MHz" in v.evidence[0]
    assert "90-120 s" in v.advice and "capture the evidence" in v.advice


def test_a_wedged_gpu_without_live_requests_is_not_judged():
    # The wedge only shows under load: an idle wedged GB10 looks idle, so no verdict from it.
    v = judge(serving(gpu=gb10("wedged", under_load=False), metrics=real_metrics(running=0)))
    assert v.verdict == "healthy"
    assert any("not judged for the wedge" in e for e in v.evidence)


def test_a_low_clock_with_a_throttle_reason_is_not_the_wedge():
    reading = gb10("wedged", under_load=True).model_copy(update={"throttle_reasons_active": frozenset({"hw_slowdown"})})
    assert judge(serving(gpu=reading, metrics=real_metrics(running=2))).verdict == "healthy"


# ------------------------------------------------------------------ engine-down


def test_container_gone_is_engine_down():
    v = judge(obs(container=ContainerState(exists=False), health_ok=False, health_error="connection refused"))
    assert v.verdict == "engine-down" and "does not exist" in v.evidence[0]
    assert "redeploy" in v.advice


def test_a_deploy_in_flight_sets_the_previous_deployment_aside():
    aside = lambda minutes: ContainerState(exists=True, status="exited", exit_code=0,  # noqa: E731
                                           started_at=NOW - 86400, finished_at=NOW - minutes * 60)
    gone = ContainerState(exists=False)
    v = judge(obs(container=gone, previous_container=aside(2), health_ok=False))
    assert v.verdict == "starting" and "a deploy is in progress" in v.evidence[-1]
    v = judge(obs(container=gone, previous_container=aside(90), health_ok=False))
    assert v.verdict == "engine-down" and "never finished" in v.evidence[-1] and "interrupted" in v.advice
    assert judge(obs(container=gone, previous_container=gone, health_ok=False)).advice == health.ADVICE["engine-down"]


def test_exited_after_a_traceback_is_engine_down_with_the_diagnosis(standin_logs):
    code, log = standin_logs["prefix-caching"]
    assert code == 1
    v = judge(obs(container=exited(code), log_tail=log, health_ok=False))
    assert v.verdict == "engine-down"
    assert v.evidence[0] == "container exited, exit code 1"
    assert any("prefix-caching-enabled" in e for e in v.evidence)
    assert any("remove --enable-prefix-caching" in e for e in v.evidence)


def test_a_clean_stop_is_engine_down_too():
    v = judge(obs(container=exited(0), log_tail=(VLLM / "vllm-eager.log").read_text(), health_ok=False))
    assert v.verdict == "engine-down" and v.evidence == ("container exited, exit code 0",)


def test_running_container_with_a_dead_engine_is_engine_down():
    log = (VLLM / "vllm-eager.log").read_text().split("INFO:     Started server")[0]
    log += "\n(APIServer pid=1) ERROR 06-18 10:00:00 [core.py:1] EngineDeadError: EngineCore encountered an issue"
    v = judge(obs(container=running(5), log_tail=log, health_ok=False))
    assert v.verdict == "engine-down" and "the container runs but its engine died" in v.evidence


def test_startup_complete_but_health_failing_is_engine_down():
    v = judge(obs(container=running(5), log_tail=(VLLM / "vllm-eager.log").read_text(), health_ok=False))
    assert v.verdict == "engine-down" and any("startup completed" in e for e in v.evidence)


# ------------------------------------------------------------------ starting


def _partial_log(upto: str) -> str:
    text = (VLLM / "vllm-compiled.log").read_text()
    return text[: text.index(upto)]


@pytest.mark.parametrize(("minutes", "warm", "verdict"), [
    (3, None, "starting"), (44, None, "starting"), (46, None, "engine-down"),
    (8, True, "starting"), (12, True, "engine-down"), (30, False, "starting"),
])
def test_starting_inside_the_boot_window_engine_down_past_it(minutes, warm, verdict):
    v = judge(obs(container=running(minutes), log_tail=_partial_log("Starting vLLM server"), health_ok=False,
                  warm_start=warm))
    assert v.verdict == verdict, v
    if verdict == "starting":
        assert not v.needs_action and "25-45 min" in v.advice
        assert any("inside the" in e for e in v.evidence) and any("last milestone" in e for e in v.evidence)
    else:
        assert "past the" in " ".join(v.evidence) and "OOM" in v.advice


def test_starting_right_after_launch_with_an_empty_log():
    v = judge(obs(container=running(0.1), log_tail="", health_ok=False))
    assert v.verdict == "starting" and "no readiness milestone in the log yet" in v.evidence


# ------------------------------------------------------------------ residue


def test_residue_kv_blocks_zero_then_silent_death(standin_logs):
    code, log = standin_logs["residue"]
    assert code == 137
    v = judge(obs(container=exited(code), log_tail=log, health_ok=False))
    assert v.verdict == "residue"
    assert "num_gpu_blocks=0" in v.evidence[0] and "num_gpu_blocks_override=512" in v.evidence[0]
    assert "exited with code 137" in v.evidence[1] and "silent EngineCore death" in v.evidence[1]
    assert "relaunching cannot help" in v.advice and "reboot" in v.advice.lower()
    assert "0.80" not in v.advice


def test_founders_without_the_estimate_env_dies_the_same_way(standin_logs):
    code, log = standin_logs["no-estimate"]
    v = judge(obs(container=exited(code, oom=True), log_tail=log, health_ok=False,
                  clean_boot_free_gib=FOUNDERS_BASELINE))
    assert v.verdict == "residue" and "(OOMKilled)" in v.evidence[1]


def test_kv_blocks_zero_while_still_running_is_not_yet_residue(standin_logs):
    _, log = standin_logs["residue"]
    v = judge(obs(container=running(1), log_tail=log, health_ok=False))
    assert v.verdict == "starting"
    assert any("num_gpu_blocks=0" in e and "silent EngineCore death usually follows" in e for e in v.evidence)


def test_residue_from_free_memory_below_the_profile_baseline(standin_logs):
    code, log = standin_logs["low-free"]
    assert code == 1
    v = judge(obs(container=exited(code), log_tail=log, health_ok=False, clean_boot_free_gib=FOUNDERS_BASELINE))
    assert v.verdict == "residue"
    assert "free memory 96.50 GiB is below the clean-boot baseline 117.50 GiB" in v.evidence[0]


def test_free_memory_measured_or_read_by_nvidia_smi_with_no_engine():
    assert judge(obs(container=ContainerState(exists=False), health_ok=False, free_gib=99.0)).verdict == "residue"
    # Within one failed start's residue (1 GiB) of the baseline: no verdict from it.
    assert judge(obs(container=ContainerState(exists=False), health_ok=False, free_gib=105.5)).verdict == \
        "engine-down"
    h = h200("nvidia-smi-q.txt")  # the H200 reports memory; a GB10 does not
    v = judge(obs(container=ContainerState(exists=False), health_ok=False, gpu=h,
                  clean_boot_free_gib=h.memory_free_mib / 1024 + 5))
    assert v.verdict == "residue" and "nvidia-smi memory.free" in v.evidence[0]
    # A GB10 says [N/A]: nothing concluded from memory.
    v = judge(obs(container=ContainerState(exists=False), health_ok=False, gpu=gb10("healthy", False)))
    assert gb10("healthy", False).memory_free_mib is None and v.verdict == "engine-down"


def test_an_engine_holding_memory_is_not_residue():
    v = judge(serving(free_gib=20.0, gpu=h200("nvidia-smi-q.txt"), clean_boot_free_gib=200.0))
    assert v.verdict == "healthy"


# ------------------------------------------------------------------ crash-loop


def test_same_failure_on_consecutive_starts_is_a_crash_loop(standin_logs):
    _, log = standin_logs["prefix-caching"]
    c = ContainerState(exists=True, status="restarting", restarting=True, restart_count=2, exit_code=1,
                       started_at=NOW - 20)
    v = judge(obs(container=c, log_tail=log + log + log, health_ok=False))
    assert v.verdict == "crash-loop"
    assert "the same failure on 3 consecutive starts: prefix-caching-enabled" in v.evidence[0]
    assert any("docker is restarting" in e for e in v.evidence)
    assert "stop relaunching" in v.advice


def test_restarts_climbing_since_the_last_sweep():
    c = running(1, restarts=4)
    v = judge(obs(container=c, log_tail=_partial_log("Starting vLLM server"), health_ok=False,
                  previous_restart_count=2))
    assert v.verdict == "crash-loop" and "restart count climbing: 2 -> 4" in v.evidence
    # The same count as last time, while booting: a start, not a loop.
    v = judge(obs(container=running(1, restarts=2), log_tail=_partial_log("Starting vLLM server"),
                  health_ok=False, previous_restart_count=2))
    assert v.verdict == "starting"


def test_many_restarts_and_not_serving_is_a_loop_even_in_one_read():
    v = judge(obs(container=exited(1, restarts=3), health_ok=False))
    assert v.verdict == "crash-loop" and "restarted 3 times and not serving" in v.evidence


def test_residue_wins_over_crash_loop(standin_logs):
    _, log = standin_logs["residue"]
    c = ContainerState(exists=True, status="restarting", restarting=True, restart_count=3, exit_code=137,
                       started_at=NOW - 20)
    v = judge(obs(container=c, log_tail=log + log, health_ok=False))
    assert v.verdict == "residue" and "start 1 of 2" in v.evidence[-1]


def test_different_failures_on_consecutive_starts_are_not_the_same_signature(standin_logs):
    a, b = standin_logs["prefix-caching"][1], standin_logs["low-free"][1]
    v = judge(obs(container=exited(1), log_tail=a + b, health_ok=False, clean_boot_free_gib=90.0))
    assert v.verdict == "engine-down"


# ------------------------------------------------------------------ regressed


@pytest.mark.parametrize(("tok_s", "acceptance", "gpu_state", "verdict"), [
    ((51.2, 52.0, 51.6, 40.1), (), "healthy", "regressed"),
    ((51.2, 52.0, 51.6, 51.0), (), "healthy", "healthy"),  # inside the spread (+2% noise floor)
    ((51.2, 52.0, 51.6, 40.1), (), "wedged", "unknown"),  # not at full clock: cannot tell from the wedge
    ((51.2, 52.0, 51.6, 40.1), (), None, "unknown"),
    ((51.6, 40.1), (), "healthy", "healthy"),  # one earlier bench has no spread to compare with
    ((51.2, 52.0, 51.6, 51.5), (0.95, 0.96, 0.95, 0.71), "healthy", "regressed"),
    ((40.0, 60.0, 50.0, 41.0), (), "healthy", "healthy"),  # a wide history swallows the drop
])
def test_regressed_against_its_own_bench_history(tok_s, acceptance, gpu_state, verdict):
    v = judge(serving(bench=BenchHistory(tok_s=tok_s, acceptance=acceptance, latest_gpu_state=gpu_state)))
    assert v.verdict == verdict, v
    if verdict == "regressed":
        assert "~/.cache/vllm" in v.advice and "full clock" in v.evidence[-1]
        assert any("below its history" in e for e in v.evidence)
    if verdict == "unknown":
        assert "rerun the bench" in v.advice


# ------------------------------------------------------------------ unreachable


def test_ssh_dead_is_unreachable_and_hard_reset_past_ten_minutes():
    v = judge(obs(ssh_ok=False, ssh_error="NodeConnectError: cannot reach", health_ok=False))
    assert v.verdict == "unreachable" and "10 min" in v.advice and "hard-reset" in v.advice
    v = judge(obs(ssh_ok=False, ssh_error="timed out", health_ok=False, ssh_dead_since=NOW - 11 * 60))
    assert v.verdict == "unreachable" and v.advice.startswith("hard-reset the node now")
    assert "SSH dead for 11.0 min (>= 10.0 min)" in v.evidence


def test_ssh_silent_during_graph_capture_of_a_known_launch_is_starting():
    v = judge(obs(ssh_ok=False, ssh_error="timed out", health_ok=False, last_started_at=NOW - 12 * 60,
                  ssh_dead_since=NOW - 11 * 60))
    assert v.verdict == "starting" and any("graph" in e for e in v.evidence)
    v = judge(obs(ssh_ok=False, ssh_error="timed out", health_ok=False, last_started_at=NOW - 31 * 60,
                  ssh_dead_since=NOW - 11 * 60))
    assert v.verdict == "unreachable"


def test_a_node_that_served_since_its_launch_and_goes_silent_is_unreachable_not_starting():
    """Issue 37's soak: a node powered off 19 min after its redeploy read "starting" (SSH silent
    inside the capture window of its launch) and stayed routed; it had served since that launch."""
    v = judge(obs(ssh_ok=False, ssh_error="timed out", health_ok=False, last_started_at=NOW - 19 * 60,
                  served_at=NOW - 30))
    assert v.verdict == "unreachable" and any("not a boot's graph capture" in e for e in v.evidence)
    # Served before this launch only: the new launch's graph capture may still silence SSH.
    v = judge(obs(ssh_ok=False, ssh_error="timed out", health_ok=False, last_started_at=NOW - 12 * 60,
                  served_at=NOW - 13 * 60))
    assert v.verdict == "starting"


def test_the_sweep_carries_when_health_last_answered():
    served = health.with_earlier(obs(ssh_ok=True, health_ok=True), None)
    later = health.with_earlier(obs(ssh_ok=False, ssh_error="timed out", health_ok=False),
                                Observation(node=served.node, probed_at=NOW - 15, ssh_ok=True, health_ok=True))
    assert later.served_at == NOW - 15
    again = health.with_earlier(obs(ssh_ok=False, ssh_error="timed out", health_ok=False), later)
    assert again.served_at == NOW - 15


def test_ssh_refused_is_not_a_dead_node():
    v = judge(obs(ssh_ok=False, ssh_refused=True, ssh_error="HostKeyError: HOST KEY MISMATCH"))
    assert v.verdict == "unknown" and "known_hosts" in v.advice


def test_unreachable_but_still_serving_says_so():
    v = judge(obs(ssh_ok=False, ssh_error="timed out", health_ok=True))
    assert v.verdict == "unreachable" and any("/health still answers 200" in e for e in v.evidence)


# ------------------------------------------------------------------ unknown, never guessed


def test_nothing_read_is_unknown():
    assert judge(obs()).verdict == "unknown"
    v = judge(obs(container_error="docker: permission denied", health_ok=False))
    assert v.verdict == "unknown" and any("permission denied" in e for e in v.evidence)
    v = judge(obs(container=running(5), health_ok=None, health_error="not probed"))
    assert v.verdict == "unknown"
    v = judge(obs(container=ContainerState(exists=True, status="running", running=True), health_ok=False))
    assert v.verdict == "unknown" and any("start time is unknown" in e for e in v.evidence)


# ------------------------------------------------------------------ carrying earlier sweeps, exit status


def test_with_earlier_carries_dead_since_launch_time_and_restarts():
    first = obs(container=running(2, restarts=1), health_ok=False, probed_at=NOW - 600)
    dead = health.with_earlier(obs(ssh_ok=False, ssh_error="timed out"), first)
    assert dead.ssh_dead_since is None and dead.last_started_at == NOW - 120
    assert dead.previous_restart_count == 1
    later = health.with_earlier(obs(ssh_ok=False, ssh_error="timed out", probed_at=NOW + 300), dead)
    assert later.ssh_dead_since == NOW and later.last_started_at == NOW - 120
    back = health.with_earlier(serving(), later)
    assert back.ssh_dead_since is None
    assert health.with_earlier(first, None) is first
    assert health.with_earlier(first, obs(node="spark1")) is first


def test_exit_status_and_every_verdict_has_runbook_advice():
    ok = [judge(serving()), judge(obs(container=running(1), log_tail="", health_ok=False))]
    assert [v.verdict for v in ok] == ["healthy", "starting"]
    assert health.summary_exit_status(ok) == 0
    assert health.summary_exit_status({"a": ok[0], "b": judge(obs())}) == 1
    assert set(health.ADVICE) == set(health.VERDICTS)
    for advice in health.ADVICE.values():
        assert advice and "lower GMU to 0.80" not in advice.replace("do NOT lower GMU to 0.80", "")
    d = judge(serving()).to_dict()
    assert set(d) == {"verdict", "evidence", "advice"} and isinstance(d["evidence"], list)


def test_a_dead_deploys_journal_makes_a_set_aside_node_engine_down_now_and_is_named_on_any_verdict():
    from spark_pipelines.core.health import ContainerState, DeployInFlight, Observation, judge

    prev = ContainerState(exists=True, status="exited", finished_at=990.0)
    base = dict(node="spark2", probed_at=1000.0, ssh_ok=True, container=ContainerState(exists=False),
                previous_container=prev, health_ok=False, health_error="refused")
    # No journal: a previous deployment set aside 10 s ago is a deploy in progress.
    assert judge(Observation(**base)).verdict == "starting"
    live = DeployInFlight("run-live-1234", "launching", "2026-01-01T00:00:00Z", "pid 7 on h", lease_held=True)
    v = judge(Observation(**base, deploy_journal=live))
    assert v.verdict == "starting" and any("is in progress (phase launching" in e for e in v.evidence)
    dead = DeployInFlight("run-dead-1234", "launching", "2026-01-01T00:00:00Z", "pid 7 on h", lease_held=False)
    v = judge(Observation(**base, deploy_journal=dead))
    assert v.verdict == "engine-down" and "interrupted" in v.advice
    assert any("run run-dead (pid 7 on h" in e and "died in phase launching" in e for e in v.evidence)
    assert dead.dead and not live.dead and not DeployInFlight("x", "ending").dead  # unknown lease: not dead
