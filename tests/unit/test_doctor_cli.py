"""`spark-pipelines doctor`: output shapes and bad input (exit 2, one line, no traceback), all refused
before any connection is tried. The sweep itself runs against the simulated fleet in
tests/e2e/test_zz_doctor.py."""

import json
import os
import subprocess
import sys

import yaml

from spark_pipelines.core.health import NodeVerdict
from spark_pipelines.cli.doctor import Doctored, render_json, render_text


def run(*args):
    # No demo record read from this clone's .dagster-home: the fleet file is the one the test names.
    return subprocess.run([sys.executable, "-m", "spark_pipelines.cli", "doctor", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "DAGSTER_HOME": "/nonexistent/demo-home"})


def variant(tmp_path, change):
    data = yaml.safe_load(open("fleets/seed.yaml"))
    change(data)
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def one_line_exit_2(p):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.count("\n") == 1 and p.stderr.strip()
    return p.stderr


def test_unknown_node_missing_fleet_bad_format(tmp_path):
    assert "known nodes: spark1, spark2" in one_line_exit_2(run("--node", "spark9"))
    assert "does not exist" in one_line_exit_2(run("--fleet", str(tmp_path / "missing.yaml")))
    assert "invalid choice" in one_line_exit_2(run("--format", "xml"))


def test_an_invalid_fleet_is_one_line_naming_the_field(tmp_path):
    path = variant(tmp_path, lambda d: d["launch"].__setitem__("gpu_memory_utilization", 0.5))
    assert "gpu_memory_utilization" in one_line_exit_2(run("--fleet", path))


def test_a_node_without_the_serve_role_is_refused(tmp_path):
    path = variant(tmp_path, lambda d: d["nodes"][0].__setitem__("roles", ["build"]))
    err = one_line_exit_2(run("--fleet", path, "--node", "spark1"))
    assert "no 'serve' role" in err and "serve nodes: spark2" in err


def test_missing_credentials_are_input_errors_not_dead_nodes(tmp_path):
    def no_key(d):
        for n in d["nodes"]:
            n["key_path"] = str(tmp_path / "no-such-key")
    err = one_line_exit_2(run("--fleet", variant(tmp_path, no_key)))
    assert "key_path" in err and "no-such-key" in err and "spark1" in err

    def key_is_a_directory(d):  # issue 23, item 6: it said "does not exist"
        for n in d["nodes"]:
            n["key_path"] = str(tmp_path)
    err = one_line_exit_2(run("--fleet", variant(tmp_path, key_is_a_directory)))
    assert "is a directory, not a key file" in err and "does not exist" not in err and "spark1" in err

    def no_known_hosts(d):
        key = tmp_path / "key"
        key.write_text("not a key")
        for n in d["nodes"]:
            n["key_path"], n["known_hosts"] = str(key), str(tmp_path / "no-known-hosts")
    err = one_line_exit_2(run("--fleet", variant(tmp_path, no_known_hosts)))
    assert "known_hosts" in err and "ssh-keyscan" in err


def test_text_is_one_line_per_node_and_json_has_the_promised_shape():
    verdicts = {
        "spark1": Doctored(NodeVerdict("spark1", "healthy", ("/health 200", "0 running / 0 waiting"), "nothing to do"),
                           in_gateway=True),
        "spark2": Doctored(NodeVerdict("spark2", "wedged", ("under 2 live request(s): wedge",), "cold drain")),
    }
    lines = render_text(verdicts).splitlines()
    assert lines == [
        "spark1  healthy      /health 200; 0 running / 0 waiting  -> nothing to do",
        "spark2  wedged       under 2 live request(s): wedge  -> cold drain",
    ]
    assert json.loads(render_json(verdicts, "/f.yaml")) == {"fleet_file": "/f.yaml", "nodes": {
        "spark1": {"verdict": "healthy", "evidence": ["/health 200", "0 running / 0 waiting"],
                   "advice": "nothing to do", "gateway": {"in": True, "why_out": []}},
        "spark2": {"verdict": "wedged", "evidence": ["under 2 live request(s): wedge"], "advice": "cold drain",
                   "gateway": {"in": None, "why_out": []}},
    }}


def test_a_healthy_node_the_ledger_holds_out_says_why_and_what_puts_it_back():
    """Issue 35, item 7: `doctor` said "healthy -> nothing to do" for a node the ledger held out of
    the gateway; the answer to "why is this node out?" is now part of its line, and the exit status."""
    healthy = NodeVerdict("spark2", "healthy", ("/health 200",), "nothing to do")
    held = {
        # As the ledger answers for a quarantined node: its drain note first, then the quarantine.
        "quarantine": ("drained: health: quarantined (manual) since 2026-12-07T10:00:03Z",
                       "quarantined: manual: quarantined by an operator (since 2026-12-07T10:00:00Z, by run 1a2b3c4d)"),
        "bench": ("held out by its bench: 38.2 tok/s below its floor 45.0",),
        "drain": ("drained: bench since 2026-12-07T10:00:00Z",),
    }
    lines = {k: render_text({"spark2": Doctored(healthy, False, why)}) for k, why in held.items()}
    assert "quarantined: manual: quarantined by an operator" in lines["quarantine"]
    assert "its bench or deploy puts it back" not in lines["quarantine"]
    assert "release_quarantine_job" in lines["quarantine"] and "nothing to do; out" in lines["quarantine"]
    assert "below its floor 45.0" in lines["bench"] and "bench_job that passes its gate" in lines["bench"]
    assert "its bench or deploy puts it back" in lines["drain"]
    assert all("\n" not in line for line in lines.values())
    assert Doctored(healthy, False, held["bench"]).needs_action
    assert not Doctored(healthy, True).needs_action


def test_bench_history_comes_from_the_instances_bench_results(tmp_path):
    import dagster as dg

    from spark_pipelines.core.health import BenchHistory
    from spark_pipelines.state.records import bench_histories

    with dg.DagsterInstance.local_temp(str(tmp_path)) as instance:
        for node, mean, rate, gpu_state in (("spark1", 51.2, 0.95, "healthy"), ("spark1", 0.0, None, "unknown"),
                                            ("spark1", 52.0, 0.96, "healthy"), ("spark1", 40.1, 0.94, "healthy"),
                                            ("spark2", 47.0, None, "wedged")):
            meta = {"mean_tok_s": mean, "gpu_under_load": gpu_state}
            if rate is not None:
                meta["spec_acceptance_rate"] = rate
            instance.report_runless_asset_event(dg.AssetMaterialization("bench_results", partition=node,
                                                                        metadata=meta))
        got = bench_histories(["spark1", "spark2", "spark3"], instance)
    assert got == {
        "spark1": BenchHistory((51.2, 52.0, 40.1), (0.95, 0.96, 0.94), "healthy"),  # oldest first, 0.0 skipped
        "spark2": BenchHistory((47.0,), (), "wedged"),
    }


def test_no_dagster_home_no_history(monkeypatch):
    from spark_pipelines.state.records import bench_histories

    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    assert bench_histories(["spark1"]) == {}
    monkeypatch.setenv("DAGSTER_HOME", "/nonexistent/dagster-home")
    assert bench_histories(["spark1"]) == {}
