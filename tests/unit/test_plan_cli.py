"""`spark-pipelines plan` renders the deploy without touching anything; bad input exits 2 cleanly."""

import json
import subprocess
import sys

from tests.unit.test_launch import runbook_argv


def run(*args):
    return subprocess.run([sys.executable, "-m", "spark_pipelines.cli", *args], capture_output=True, text=True)


def test_plan_json_shape_and_argv():
    p = run("plan", "--fleet", "fleets/seed.yaml", "--format", "json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    assert set(plan) == {"nodes", "gateway", "rollout"}
    assert plan["rollout"]["waves"] == [["spark1"], ["spark2"]]  # canary alone, then max_unavailable 1
    assert plan["nodes"]["spark1"]["docker_run_argv"] == runbook_argv("/home/operator")
    pf = plan["nodes"]["spark2"]["preflight"]
    assert pf["required_gib"] == 103.44 and pf["verdict"] in ("pass", "tight")
    assert pf["steps"][0] == "GPU state not wedged (nvidia-smi)" and len(pf["steps"]) == 7
    assert len(plan["gateway"]["config"]["model_list"]) == 6


def test_plan_single_node_text():
    p = run("plan", "--node", "spark2")
    assert p.returncode == 0
    assert "== node spark2" in p.stdout and "== node spark1" not in p.stdout
    assert "--speculative-config '{\"method\":\"mtp\",\"num_speculative_tokens\":2}'" in p.stdout


def test_bad_input_exit_2_one_line_no_traceback(tmp_path):
    bad = tmp_path / "f.yaml"
    bad.write_text(open("fleets/seed.yaml").read().replace("0.85        #", "0.95        #"))
    for args in (["plan", "--node", "spark9"], ["plan", "--fleet", str(bad)], ["plan", "--fleet", "missing.yaml"],
                 ["plan", "--format", "xml"], ["nosuch"]):
        p = run(*args)
        assert p.returncode == 2, args
        assert "Traceback" not in p.stderr and p.stderr.strip(), args
    p = run("plan", "--fleet", str(bad))
    assert "gpu_memory_utilization 0.95" in p.stderr and "spark1" in p.stderr


def test_every_command_shares_the_one_parser_one_line_per_bad_input():
    from spark_pipelines.cli import main

    cases = [
        (["bench", "--model", "m"], "spark-pipelines bench: the following arguments are required: --base-url"),
        (["bench", "--base-url", "http://127.0.0.1:9", "--model", "m", "--suite", "fast"], "invalid choice: 'fast'"),
        (["demo", "--nodes", "x"], "spark-pipelines demo: argument --nodes: invalid int value: 'x'"),
        (["plan", "--format", "xml"], "spark-pipelines plan: argument --format"),
        (["nosuch"], "invalid choice: 'nosuch'"),
    ]
    for args, needle in cases:
        p = run(*args)
        assert p.returncode == 2 and needle in p.stderr, (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and "usage:" not in p.stderr, p.stderr
    assert main(["bench", "--help"]) == 0


def test_plan_lists_the_checks_preflight_runs_in_its_order():
    from spark_pipelines.core.preflight import CHECKS, Observations, evaluate

    clean = Observations(free_gib=107.8, total_gib=121.69, gpu_state="idle", gpu_holder_pids=[], persistenced_pids=[],
                         earlyoom_installed=False, running_exporters=[], disk_free_gib=500.0, page_cache_flushed=True)
    report = evaluate("spark1", clean, gmu=0.85, max_gmu=0.85, profile_total_gib=121.69, min_disk_gib=170.0)
    assert [c.name for c in report.checks] == [name for name, _ in CHECKS]
