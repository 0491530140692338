"""First contact with a hand-built gateway, on the real LiteLLM proxy of the simulated fleet: the
runbook's six hand-written entries (no spark-pipelines marks, its comments) plus an operator's
entry for another backend, clients streaming through it all along (spark_sim.traffic).

- drain spark2: no request started after the drain reaches spark2, none fails;
- restore: the file is the same bytes as before (drain notes aside);
- take_over: each entry marked in place, routing unchanged on the running proxy, each node once
  per pool; a gateway step after it changes nothing;
- the old duplicate bug (owned entries beside identical hand ones) collapses on take_over;
- the proxy is confirmed after every write: a reload that fails at a bench's restore, or one that
  does not take, is repaired (reload again, then restart) without a hand step; a file the proxy
  does not serve is repaired by the next gateway step."""

from __future__ import annotations

import difflib
import os
import threading
import time

import pytest
import yaml

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core.fleet import Fleet, parse_fleet
from spark_pipelines.resources.gateway import GatewayError, GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook.rotation import drained
from spark_sim import faults as fx
from spark_sim.traffic import Streams, engines_on, traffic_fleet
from tests.plugins.gateway_config import runbook_config

pytestmark = pytest.mark.slow

PORT = 18100  # the stand-ins of this module only (not the launch port, not test_gateway_streams')
OPERATOR = """\
  # the operator's own backend, not a fleet node
  - model_name: embed
    litellm_params:
      model: openai/bge-m3
      api_base: http://127.0.0.1:9/v1
      api_key: sk-operator-literal
litellm_settings:
  drop_params: true  # the operator's comment
general_settings:
  master_key: os.environ/LITELLM_MASTER_KEY
"""
EACH_ONCE = {"fast": ["spark1", "spark2"], "reasoning": ["spark1", "spark2"], "code": ["spark1", "spark2"]}


class Log:
    """A session log that keeps what was said (the repairs say themselves as warnings)."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def info(self, msg: str, *a) -> None:
        pass

    debug = info

    def warning(self, msg: str, *a) -> None:
        self.warnings.append(msg)

    error = warning


def hand_config(sim_fleet) -> str:
    return runbook_config(sim_fleet.node("spark1").ip, sim_fleet.node("spark2").ip, port=PORT, tail=OPERATOR)


def variant(sim_fleet, **gateway) -> Fleet:
    """traffic_fleet's fleet with other gateway settings."""
    data = yaml.safe_load(open(sim_fleet.fleet_file))
    data["launch"]["port"] = PORT
    data["gateway"].update(routing_strategy="simple-shuffle", reload="graceful",
                           reload_command=[str(sim_fleet.gateway.bin / "litellm-reload")])
    data["gateway"].update(gateway)
    return parse_fleet(data, "test variant")


def file_text(s: FleetSession, fleet: Fleet) -> str:
    return s.run("gateway", ["cat", fleet.gateway.config_path], timeout=20, log=False).stdout


def body(text: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith(gateway_core.DRAIN_NOTE)]


def pools(host: GatewayHost) -> dict[str, list[str]]:
    return {p: sorted(n) for p, n in host.serving_routes().items()}


class Traffic:
    """Short streams through pool `fast`, one after another on `n` threads, until stopped: each
    result with when it started."""

    def __init__(self, url: str, key: str, node_of: dict[str, str], n: int = 3) -> None:
        self.results: list = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(url, key, node_of), daemon=True) for _ in range(n)]

    def _loop(self, url: str, key: str, node_of: dict[str, str]) -> None:
        while not self._stop.is_set():
            self.results += Streams(url, key, node_of, max_tokens=40).add(1).wait()

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


@pytest.fixture(scope="module")
def hand_gateway(sim_fleet, tmp_path_factory):
    """The runbook's hand config on the gateway host, served by the stand-ins on both nodes; the
    gateway's previous config put back after."""
    fleet = traffic_fleet(sim_fleet, PORT)
    key = os.environ["LITELLM_MASTER_KEY"]
    with FleetSession(fleet) as s, engines_on(sim_fleet, PORT, fleet.launch.served_model_name,
                                               tmp_path_factory.mktemp("hand-engines")) as engines:
        host = GatewayHost(s, master_key=key, poll_s=0.5)
        before = host.read()
        text = hand_config(sim_fleet)
        assert host.change(lambda snap: gateway_core.parse(text), rollback=True)[2]
        assert file_text(s, fleet) == text
        yield {"fleet": fleet, "s": s, "host": host, "text": text, "key": key,
               "node_of": {e.base_url: n for n, e in engines.items()}}
        if before.text is not None:
            host.change(lambda snap: gateway_core.parse(before.text), rollback=True)


def test_hand_routes_drained_and_restored_exactly_under_traffic(hand_gateway):
    g = hand_gateway
    host, s, fleet, text = g["host"], g["s"], g["fleet"], g["text"]
    # The running proxy's /model/info names each entry's api_base: the hand entries are routes.
    assert pools(host) == EACH_ONCE and host.rotation() == ["spark1", "spark2"]
    with Traffic(host.base_url, g["key"], g["node_of"]) as traffic:
        time.sleep(3)
        host.drain("spark2", "test bench")
        drained_at = time.monotonic()
        assert pools(host) == {"fast": ["spark1"], "reasoning": ["spark1"], "code": ["spark1"]}
        out = file_text(s, fleet)
        assert "# spark-pipelines drained spark2: test bench since" in out
        assert sum(line.startswith(gateway_core.STASH + "spark2 | ") for line in out.splitlines()) == 22
        assert "# the operator's comment" in out and "# spark1 entries" in out
        time.sleep(6)
        host.restore("spark2")
        restored_at = time.monotonic()
        assert body(file_text(s, fleet)) == body(text) and file_text(s, fleet) == text
        assert pools(host) == EACH_ONCE
        time.sleep(6)
    results = traffic.results
    assert len(results) > 30, len(results)
    assert [r.error for r in results if r.dropped] == [], "client requests failed during the drain"
    during = [r for r in results if r.started > drained_at and r.ended < restored_at]
    assert during and {r.node for r in during} == {"spark1"}, "a request reached spark2 while it was drained"
    assert "spark2" in {r.node for r in results if r.started > restored_at}


def test_take_over_marks_the_hand_entries_and_keeps_routing(hand_gateway):
    g = hand_gateway
    host, s, fleet, text = g["host"], g["s"], g["fleet"], g["text"]
    check = host.take_over(check=True)
    assert len(check.taken_over) == 6 and file_text(s, fleet) == text  # the check writes nothing
    with Traffic(host.base_url, g["key"], g["node_of"]) as traffic:
        report = host.take_over()
        time.sleep(2)
    assert [r.error for r in traffic.results if r.dropped] == []
    assert len(report.taken_over) == 6 and not report.collapsed and not report.differing
    assert {p: sorted(n) for p, n in report.proxy_before.items()} == EACH_ONCE
    assert {p: sorted(n) for p, n in report.proxy_after.items()} == EACH_ONCE
    after = file_text(s, fleet)
    diff = [d for d in difflib.ndiff(text.splitlines(), after.splitlines()) if d[:1] in "+-"]
    assert diff == [f"+       {gateway_core.OWNER_TAG}: {n}" for n in ["spark1"] * 3 + ["spark2"] * 3]
    assert s.run("gateway", ["cat", fleet.gateway.config_path + ".previous"], timeout=20, log=False).stdout == text
    # The gateway step after it: nothing to write, nothing to reload.
    config, reloaded = host.set_rotation(["spark1", "spark2"])
    assert reloaded is False and file_text(s, fleet) == after
    assert gateway_core.owned_view(config, fleet)["operator_entries"] == ["embed"]
    # Adopted entries drain and restore to the same bytes too.
    with drained(host, "spark1", reason="test bench"):
        assert host.serving_nodes() == ["spark2"]
    assert file_text(s, fleet) == after and pools(host) == EACH_ONCE
    host.change(lambda snap: gateway_core.parse(text), rollback=True)  # the hand config again


def test_duplicates_of_the_old_gateway_step_collapse_on_take_over(hand_gateway):
    g = hand_gateway
    host, s, fleet, text = g["host"], g["s"], g["fleet"], g["text"]
    owned = gateway_core.dump_yaml([e for n in fleet.serve_nodes for e in gateway_core.node_entries(fleet, n)])
    bugged = text.replace("litellm_settings:", "".join(f"  {x}\n" for x in owned.splitlines()) + "litellm_settings:")
    host.change(lambda snap: gateway_core.parse(bugged), rollback=True)
    assert len(gateway_core.load(file_text(s, fleet))["model_list"]) == 13
    report = host.take_over()
    assert len(report.collapsed) == 6 and len(report.taken_over) == 6
    assert {p: sorted(n) for p, n in report.proxy_after.items()} == EACH_ONCE
    entries = gateway_core.load(file_text(s, fleet))["model_list"]
    assert len(entries) == 7 and "# spark2 entries" in file_text(s, fleet)
    assert len(host.model_info()) == 7  # the running proxy: each node once per pool, and the operator's
    host.change(lambda snap: gateway_core.parse(text), rollback=True)


def test_a_reload_failing_at_the_restore_is_repaired_without_a_hand_step(hand_gateway, sim_fleet):
    """Issue 22.7: the bench's restore wrote the file, its reload failed; the proxy kept serving
    spark1 only. Now the restore reloads again and confirms."""
    g = hand_gateway
    flag = f"{sim_fleet.gateway.home}/fail-next-reload"
    real = list(g["fleet"].gateway.reload_command)
    bad = variant(sim_fleet, reload_command=[
        "sh", "-c", f'if [ -e {flag} ]; then rm -f {flag}; echo "injected: reload refused" >&2; exit 1; fi; '
                    f'exec "$@"', "reload", *real])
    with FleetSession(bad) as s:
        s.log = log = Log()
        host = GatewayHost(s, master_key=g["key"], poll_s=0.5)
        with drained(host, "spark1", reason="test bench"):
            assert host.serving_nodes() == ["spark2"]
            s.run("gateway", ["touch", flag], timeout=20)  # the restore's reload fails
        assert s.run("gateway", ["test", "-e", flag], timeout=20, check=False).exit_status != 0, "not injected"
        assert pools(host) == EACH_ONCE
        assert any("injected: reload refused" in w and "reloading again" in w for w in log.warnings), log.warnings
        assert file_text(s, bad) == g["text"]


def test_a_reload_that_does_not_take_on_a_serving_proxy_is_an_error_not_a_restart(hand_gateway, sim_fleet):
    g = hand_gateway
    # A graceful reload that returns 0 and does nothing (a SIGHUP to the wrong process). The proxy
    # still serves both nodes: a restart would fail every request while LiteLLM starts (the
    # 60-minute soak's 59), so the drain fails naming the command, and the proxy keeps serving.
    bad = variant(sim_fleet, reload_command=["true"])
    before = fx.proxy_pids(sim_fleet)
    with FleetSession(bad) as s:
        s.log = log = Log()
        host = GatewayHost(s, master_key=g["key"], poll_s=0.5, ready_timeout_s=5)
        with pytest.raises(GatewayError) as e:
            host.drain("spark2", "test bench")
        said = "\n".join(log.warnings)
        assert "reloading it again (true)" in said and "restarting it" not in said, said
    msg = str(e.value)
    assert "not restarted, it serves clients" in msg and "gateway.reload_command" in msg, msg
    assert "Traceback" not in msg and fx.proxy_pids(sim_fleet) == before  # the same proxy, never restarted
    assert pools(g["host"]) == EACH_ONCE  # it never stopped serving both
    # The next gateway run with a working reload puts file and proxy in agreement.
    g["host"].restore("spark2")
    assert pools(g["host"]) == EACH_ONCE and g["host"].rotation() == ["spark1", "spark2"]


def test_a_proxy_serving_another_config_is_an_error_and_the_next_gateway_step_repairs_it(hand_gateway, sim_fleet):
    g = hand_gateway
    host = g["host"]
    stuck = variant(sim_fleet, reload_command=["true"], restart_command=["true"])
    with FleetSession(stuck) as s2:
        s2.log = Log()
        with pytest.raises(GatewayError) as e:
            GatewayHost(s2, master_key=g["key"], poll_s=0.5, ready_timeout_s=3).drain("spark2", "test bench")
    msg = str(e.value)
    assert "the running proxy serves code: spark1, spark2; fast: spark1, spark2" in msg, msg
    assert "lists code: spark1; fast: spark1; reasoning: spark1" in msg, msg
    # The file says spark2 is out, the proxy still serves it: the gateway step (spark1 only, as the
    # file says) writes nothing, sees the difference and reloads.
    assert host.rotation() == ["spark1"] and "spark2" in host.serving_nodes()
    _, repaired = host.set_rotation(["spark1"])
    assert repaired and host.serving_nodes() == ["spark1"]
    host.set_rotation(["spark1", "spark2"])
    assert pools(host) == EACH_ONCE
    host.change(lambda snap: gateway_core.parse(g["text"]), rollback=True)


def test_sidecar_files_share_the_config_lock(hand_gateway):
    g = hand_gateway
    host, s, fleet = g["host"], g["s"], g["fleet"]
    suffix = ".test-ledger.json"
    try:
        assert host.read_sidecar(suffix) == (None, "absent")
        assert host.change_sidecar(suffix, lambda t: '{"spark1": "out"}\n') == '{"spark1": "out"}\n'
        text, digest = host.read_sidecar(suffix)
        assert text == '{"spark1": "out"}\n' and len(digest) == 64
        mode = s.run("gateway", ["stat", "-c", "%a", fleet.gateway.config_path + suffix], timeout=20).stdout.strip()
        assert mode == "600"
        # Held lock: the write waits, then names the lock; nothing changed.
        holder = s.run("gateway", ["sh", "-c", f"flock {fleet.gateway.config_path}.lock sleep 6 </dev/null >/dev/null 2>&1 &"],
                       timeout=20)
        assert holder.exit_status == 0
        time.sleep(0.5)
        with pytest.raises(GatewayError, match="lock held for more than 2 s"):
            host.change_sidecar(suffix, lambda t: "{}\n", lock_wait_s=2)
        assert host.read_sidecar(suffix)[0] == '{"spark1": "out"}\n'
        # Two writers at once: the later one re-reads and keeps the earlier's change.
        import json

        def add(name: str) -> None:
            with FleetSession(fleet) as s2:
                GatewayHost(s2).change_sidecar(suffix, lambda t: json.dumps({**json.loads(t or "{}"), name: "x"}))

        threads = [threading.Thread(target=add, args=(n,)) for n in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert set(json.loads(host.read_sidecar(suffix)[0])) == {"spark1", "a", "b"}
        assert host.change_sidecar(suffix, lambda t: None) is None and host.read_sidecar(suffix)[0] is None
        with pytest.raises(ValueError, match="sidecar suffix"):
            host.read_sidecar(".previous")
    finally:
        s.run("gateway", ["rm", "-f", fleet.gateway.config_path + suffix], timeout=20)
