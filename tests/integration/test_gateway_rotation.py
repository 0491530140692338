"""The gateway step and drain / restore against the real LiteLLM proxy on the simulated gateway host:
an operator's config survives, the previous config is kept, a failed reload at drain puts the node
back, and concurrent drains and reloads never empty the rotation or overlap."""

from __future__ import annotations

import os
import threading
import time

import httpx
import pytest
import yaml

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core.fleet import Fleet, parse_fleet
from spark_pipelines.resources.gateway import GatewayError, GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.core.errors import RunbookError
from spark_pipelines.runbook.rotation import drained

pytestmark = pytest.mark.slow

OPERATOR_MODEL = "operator-gpt"
OPERATOR_CONFIG = f"""# the operator's own gateway, before spark-pipelines ever ran
model_list:
  - model_name: {OPERATOR_MODEL}
    litellm_params:
      model: openai/gpt-4o-mini
      api_base: http://127.0.0.1:9/v1
      api_key: sk-operator-literal
    model_info:
      id: operator-gpt-1
litellm_settings:
  drop_params: true
  num_retries: 2
general_settings:
  master_key: os.environ/LITELLM_MASTER_KEY
"""


def fleet_with(sim_fleet, change=None) -> Fleet:
    data = yaml.safe_load(open(sim_fleet.fleet_file))
    if change:
        change(data)
    return parse_fleet(data, "test fleet")


def host_for(s: FleetSession, **kw) -> GatewayHost:
    return GatewayHost(s, master_key=os.environ["LITELLM_MASTER_KEY"], **kw)


def models(fleet: Fleet) -> list[str]:
    gw = fleet.gateway
    r = httpx.get(f"http://{gw.host}:{gw.proxy_port}/v1/models",
                  headers={"Authorization": f"Bearer {os.environ['LITELLM_MASTER_KEY']}"}, timeout=10)
    r.raise_for_status()
    return sorted(m["id"] for m in r.json()["data"])


@pytest.fixture(scope="module")
def operator_gateway(sim_fleet):
    """The gateway host with the operator's own config in place and the gateway step run once."""
    fleet = fleet_with(sim_fleet)
    with FleetSession(fleet) as s:
        s.put_text("gateway", fleet.gateway.config_path, OPERATOR_CONFIG, 0o600)
        host = host_for(s)
        config, reloaded = host.set_rotation(["spark1", "spark2"])
        assert reloaded
        yield fleet, s, host


def file_config(s: FleetSession, fleet: Fleet, suffix: str = "") -> str:
    return s.run("gateway", ["cat", fleet.gateway.config_path + suffix], timeout=20, log=False).stdout


def assert_operator_kept(text: str) -> None:
    cfg = gateway_core.load(text)
    mine = yaml.safe_load(OPERATOR_CONFIG)
    assert [e for e in cfg["model_list"] if gateway_core.owner(e) is None] == mine["model_list"]
    assert cfg["litellm_settings"] == mine["litellm_settings"]
    assert cfg["general_settings"] == mine["general_settings"]
    assert "router_settings" not in cfg  # never added to an existing config


def test_gateway_step_keeps_operator_config_and_a_backup(operator_gateway):
    fleet, s, host = operator_gateway
    text = file_config(s, fleet)
    assert_operator_kept(text)
    assert gateway_core.nodes_in_rotation(gateway_core.load(text)) == ["spark1", "spark2"]
    # The file it replaced, byte for byte (comments included), and a bounded history.
    assert file_config(s, fleet, ".previous") == OPERATOR_CONFIG
    hist = s.run("gateway", ["ls", "-1", fleet.gateway.config_path + ".history"], timeout=20, log=False).stdout.split()
    assert 1 <= len(hist) <= 5
    assert OPERATOR_MODEL in models(fleet) and "fast" in models(fleet)
    assert host.serving_nodes() == ["spark1", "spark2"]
    # The same rotation again: nothing rewritten, no reload.
    assert host.set_rotation(["spark1", "spark2"])[1] is False


def test_drain_and_restore_keep_operator_config(operator_gateway):
    fleet, s, host = operator_gateway
    before = file_config(s, fleet)
    with drained(host, "spark1", reason="test bench") as d:
        assert d.was_in
        text = file_config(s, fleet)
        assert_operator_kept(text)
        assert gateway_core.nodes_in_rotation(gateway_core.load(text)) == ["spark2"]
        assert "spark1: test bench since" in text  # the drain note, in the header
        assert host.serving_nodes() == ["spark2"]  # confirmed drained before the body ran
        assert OPERATOR_MODEL in models(fleet)
        assert file_config(s, fleet, ".previous") == before
    after = file_config(s, fleet)
    assert_operator_kept(after)
    assert gateway_core.load(after) == gateway_core.load(before) and "drained" not in after
    assert host.serving_nodes() == ["spark1", "spark2"] and OPERATOR_MODEL in models(fleet)


def test_drain_whose_reload_fails_puts_the_node_back(operator_gateway, sim_fleet):
    fleet, _, _ = operator_gateway
    flag = f"{sim_fleet.gateway.home}/fail-next-reload"
    real = list(fleet.gateway.reload_command)

    def failing_reload(d):
        d["gateway"]["reload_command"] = [
            "sh", "-c", f'if [ -e {flag} ]; then rm -f {flag}; echo "injected: reload refused" >&2; exit 1; fi; '
                        f'exec "$@"', "reload", *real]

    bad = fleet_with(sim_fleet, failing_reload)
    with FleetSession(bad) as s:
        host = host_for(s)
        s.run("gateway", ["touch", flag], timeout=20)
        ran = False
        with pytest.raises(GatewayError) as err:
            with drained(host, "spark1", reason="test bench"):
                ran = True
        assert not ran
        msg = str(err.value)
        assert "reload" in msg and "previous config was put back" in msg and "injected: reload refused" in msg
        assert host.rotation() == ["spark1", "spark2"]
        assert host.serving_nodes() == ["spark1", "spark2"]
        assert_operator_kept(file_config(s, bad))


def test_two_drains_at_once_never_empty_the_rotation(operator_gateway, sim_fleet):
    fleet, _, _ = operator_gateway
    samples: list[tuple[float, list[str], list[str]]] = []
    stop = threading.Event()
    events: dict[str, float] = {}
    errors: dict[str, BaseException] = {}

    def sample():
        with FleetSession(fleet) as s:
            h = host_for(s)
            while not stop.is_set():
                try:
                    serving = h.serving_nodes()
                except GatewayError:
                    serving = ["(reloading)"]  # the proxy restarts on each change: no answer is not empty
                samples.append((time.monotonic(), h.rotation(), serving))
                time.sleep(0.3)

    def bench(label: str, node: str, hold_s: float, wait_s: float, delay_s: float):
        time.sleep(delay_s)
        try:
            with FleetSession(fleet) as s, drained(host_for(s, poll_s=1.0), node, reason=f"bench {node}", wait_s=wait_s):
                events[f"{label} in"] = time.monotonic()
                time.sleep(hold_s)
                events[f"{label} out"] = time.monotonic()
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors[label] = e

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    first = threading.Thread(target=bench, args=("first", "spark1", 20.0, 0, 0))
    refused = threading.Thread(target=bench, args=("refused", "spark2", 0.0, 2.0, 3.0))
    first.start()
    refused.start()
    refused.join(timeout=300)
    waiter = threading.Thread(target=bench, args=("waiter", "spark2", 2.0, 240.0, 0))
    waiter.start()
    for t in (first, waiter):
        t.join(timeout=600)
    stop.set()
    sampler.join(timeout=60)

    # The second bench that could not wait long was refused, naming who is out and why.
    refusal = errors.pop("refused", None)
    assert isinstance(refusal, RunbookError) and "refused in" not in events
    msg = str(refusal)
    assert "spark2 not drained" in msg and "min_in_rotation=1" in msg and "spark1 is out (bench spark1 since" in msg
    assert errors == {}, errors
    # The one that waited ran only after spark1 was back.
    assert events["waiter in"] > events["first out"]
    assert samples and all(rot for _, rot, _ in samples), "the rotation in the config was empty at some point"
    assert all(serving for _, _, serving in samples), "the proxy served no owned node at some point"
    assert any(rot == ["spark2"] for _, rot, _ in samples) and any(rot == ["spark1"] for _, rot, _ in samples)
    with FleetSession(fleet) as s:
        assert host_for(s).rotation() == ["spark1", "spark2"]


def test_concurrent_changes_are_serialized_and_none_is_lost(operator_gateway):
    fleet, _, _ = operator_gateway
    results: dict[str, object] = {}

    def note(name: str):
        try:
            with FleetSession(fleet) as s:
                h = host_for(s)
                results[name] = h.change(lambda snap: (snap.config, {**snap.drains, name: "test note"}), rollback=True)[2]
        except BaseException as e:  # noqa: BLE001
            results[name] = e

    threads = [threading.Thread(target=note, args=(n,)) for n in ("nodeA", "nodeB")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert results == {"nodeA": True, "nodeB": True}  # both reloaded, neither failed ("address already in use")
    with FleetSession(fleet) as s:
        h = host_for(s)
        snap = h.read()
        assert set(snap.drains) == {"nodeA", "nodeB"}  # the later one re-read and kept the earlier's change
        h.change(lambda snap: (snap.config, {}), rollback=True)
        assert h.read().drains == {} and h.serving_nodes() == ["spark1", "spark2"]


def test_proxy_killed_during_a_drain_comes_back_with_the_node(operator_gateway, sim_fleet):
    import signal

    fleet, s, host = operator_gateway
    with drained(host, "spark2", reason="test bench"):
        pid = int((sim_fleet.gateway.dir / "litellm.pid").read_text().strip())
        # As its container dies: the gunicorn master and its worker (the sim runs them as root;
        # the test is root too).
        os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while host.ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not host.ready()
    assert host.ready() and host.serving_nodes() == ["spark1", "spark2"]
    assert OPERATOR_MODEL in models(fleet)


class _Warnings:
    """A session log that keeps its warnings (the fallback restart says itself there)."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def info(self, msg: str, *a) -> None:
        pass

    debug = info

    def warning(self, msg: str, *a) -> None:
        self.warnings.append(msg)

    error = warning


def test_a_graceful_reload_that_ends_the_proxy_is_followed_by_a_restart(operator_gateway, sim_fleet):
    """A SIGHUP ends a proxy not under gunicorn, and `docker compose kill` returns 0 all the same:
    not ready within graceful_confirm_s, the proxy is restarted (restart_command) and the drain and
    restore are confirmed on it; the gateway never stays without a proxy."""
    fleet, _, _ = operator_gateway
    stop = f"sudo -n {sim_fleet.gateway.sbin}/litellm-proxy stop >/dev/null"

    def hup_that_ends_the_proxy(d):
        d["gateway"].update(reload="graceful", graceful_confirm_s=3, reload_command=["sh", "-c", stop])

    bad = fleet_with(sim_fleet, hup_that_ends_the_proxy)
    assert bad.gateway.restart_command == (str(sim_fleet.gateway.bin / "litellm-restart"),)  # the sim's
    with FleetSession(bad) as s:
        s.log = log = _Warnings()
        host = host_for(s)
        with drained(host, "spark1", reason="test bench"):
            assert host.ready() and host.serving_nodes() == ["spark2"]
        assert host.ready() and host.serving_nodes() == ["spark1", "spark2"]
        restarts = [w for w in log.warnings if "not ready 3 s after the graceful reload: restarting it" in w]
        assert len(restarts) == 2, log.warnings  # the drain's and the restore's
        assert_operator_kept(file_config(s, bad))

    # A restart that fails too is one error naming both, and the next change brings the proxy back.
    def and_no_restart(d):
        hup_that_ends_the_proxy(d)
        d["gateway"]["restart_command"] = ["false"]

    worse = fleet_with(sim_fleet, and_no_restart)
    with FleetSession(worse) as s:
        with pytest.raises(GatewayError, match="not ready after the graceful reload and its restart"):
            host_for(s).set_rotation(["spark2"])
    with FleetSession(fleet) as s:
        host = host_for(s)
        host.set_rotation(["spark1", "spark2"])
        assert host.ready() and host.serving_nodes() == ["spark1", "spark2"]


def test_a_key_left_unset_is_named_when_the_proxy_refuses(operator_gateway, monkeypatch):
    """The real proxy has a master key; an orchestrator without it gets LiteLLM's 500 (not a 401),
    and the error names the variable to set rather than a bare status."""
    fleet, s, host = operator_gateway
    assert host.serving_nodes()  # with the key: the rotation
    monkeypatch.delenv(fleet.gateway.master_key_env)  # the host falls back to it
    with pytest.raises(GatewayError) as e:
        GatewayHost(s, master_key=None).serving_nodes()
    assert fleet.gateway.master_key_env in str(e.value) and "no key was sent" in str(e.value)


def test_a_drain_without_the_key_is_refused_before_anything_changes(operator_gateway, monkeypatch):
    """Issue 35, item 5: a bench launched from a UI started without the proxy's key drained its node,
    then failed 3 minutes later ("no key was sent"). The drain is refused at once, nothing changed."""
    fleet, s, host = operator_gateway
    before = file_config(s, fleet)
    monkeypatch.delenv(fleet.gateway.master_key_env)
    started = time.monotonic()
    with pytest.raises(RunbookError) as e:
        with drained(GatewayHost(s, master_key=None), "spark2"):
            raise AssertionError("the block ran")
    took = time.monotonic() - started
    assert took < 30, took
    assert str(e.value).startswith("spark2 not drained, nothing was changed: ") and "no key was sent" in str(e.value)
    assert fleet.gateway.master_key_env in str(e.value) and "\n" not in str(e.value)
    assert file_config(s, fleet) == before and host.serving_nodes() == ["spark1", "spark2"]
