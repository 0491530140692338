"""Drain and restore while clients stream through the real LiteLLM proxy on the simulated gateway
host. Engines: the vLLM stand-in on each node's address (spark_sim.traffic), at the runbook's
52 tok/s so that a stream outlives the change.

graceful (the sim's fleet file): SIGHUP to the proxy's gunicorn master; every stream in flight
ends normally, on the node that stays and on the node drained. restart (the runbook's `docker
compose restart litellm`): the same drain drops them, which shows the streams here can fail."""

from __future__ import annotations

import os
import time

import pytest
import yaml

from spark_pipelines.core.fleet import Fleet, parse_fleet
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_sim.traffic import Streams, engines_on, running

pytestmark = pytest.mark.slow

PORT = 18000  # not the launch port: no deployed engine of another module answers here
TOKENS = 420  # ~8 s at 52 tok/s: longer than a graceful drain and restore together


def variant(sim_fleet, reload: str | None = None) -> Fleet:
    data = yaml.safe_load(open(sim_fleet.fleet_file))
    data["launch"]["port"] = PORT
    data["gateway"]["routing_strategy"] = "simple-shuffle"  # streams on both nodes, not the fastest only
    if reload == "restart":
        data["gateway"]["reload"] = "restart"
        data["gateway"]["reload_command"] = [str(sim_fleet.gateway.bin / "litellm-restart")]
    return parse_fleet(data, "streams fleet")


@pytest.fixture(scope="module")
def streaming(sim_fleet, tmp_path_factory):
    """Both nodes' engines up and both in the gateway; the gateway's previous config put back after."""
    fleet = variant(sim_fleet)
    key = os.environ["LITELLM_MASTER_KEY"]
    with FleetSession(fleet) as s, engines_on(sim_fleet, PORT, fleet.launch.served_model_name,
                                               tmp_path_factory.mktemp("engines")) as engines:
        host = GatewayHost(s, master_key=key, poll_s=0.5)
        before = host.read()
        host.set_rotation(["spark1", "spark2"])
        url = host.base_url
        node_of = {f"http://{sim_fleet.node(n).ip}:{PORT}": n for n in ("spark1", "spark2")}
        yield {"fleet": fleet, "host": host, "engines": engines, "url": url, "key": key, "node_of": node_of,
               "session": s}
        if before.config is not None:
            host.apply(before.config)


class InFlight:
    """Streams through the gateway, two at a time until both engines carry at least one."""

    def __init__(self, st: dict, tokens: int) -> None:
        self.batches: list[Streams] = []
        for _ in range(8):
            self.batches.append(Streams(st["url"], st["key"], st["node_of"], n=2, max_tokens=tokens))
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                if all(running(e) >= 1 for e in st["engines"].values()):
                    return
                time.sleep(0.1)
        pytest.fail(f"the streams did not reach both engines: {[running(e) for e in st['engines'].values()]}")

    def wait(self) -> list:
        return [r for b in self.batches for r in b.wait()]


def in_flight(st: dict, tokens: int = TOKENS) -> InFlight:
    return InFlight(st, tokens)


def test_graceful_drain_and_restore_keep_every_stream(streaming):
    host = streaming["host"]
    streams = in_flight(streaming)
    t0 = time.monotonic()
    host.drain("spark2", "test drain")
    drained_s = time.monotonic() - t0
    assert host.serving_nodes() == ["spark1"]
    host.restore("spark2")
    assert host.serving_nodes() == ["spark1", "spark2"]
    results = streams.wait()
    assert [r.error for r in results if r.dropped] == []
    assert {r.node for r in results} == {"spark1", "spark2"}  # both nodes' streams survived
    # Every stream outlived both changes: the changes happened while they flowed.
    assert min(r.ended for r in results) > t0 + drained_s
    # The new config is what serves: new requests reach only the nodes in the rotation.
    host.drain("spark2", "test drain")
    try:
        after = Streams(streaming["url"], streaming["key"], streaming["node_of"], n=4, max_tokens=5).wait()
        assert [r.node for r in after] == ["spark1"] * 4 and not any(r.dropped for r in after)
    finally:
        host.restore("spark2")


def test_restart_drops_streams_in_flight(sim_fleet, streaming):
    """The runbook's restart, for contrast: the streams' failure is seen (the test above can fail).
    A stop waits 10 s for the proxy's streams (as `docker compose restart` does), then kills it:
    these streams (~19 s) are cut."""
    with FleetSession(variant(sim_fleet, "restart")) as s:
        host = GatewayHost(s, master_key=streaming["key"], poll_s=0.5)
        streams = in_flight(streaming, tokens=1000)
        try:
            host.drain("spark2", "test drain")
        finally:
            host.restore("spark2")
        results = streams.wait()
    dropped = [r for r in results if r.dropped]
    assert dropped and {r.node for r in dropped} >= {"spark1"}, [(r.node, r.error) for r in results]
