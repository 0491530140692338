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

from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_sim.traffic import Streams, engines_on, on_every_engine, traffic_fleet

pytestmark = pytest.mark.slow

PORT = 18000  # not the launch port: no deployed engine of another module answers here
TOKENS = 420  # ~8 s at 52 tok/s: longer than a graceful drain and restore together


@pytest.fixture(scope="module")
def streaming(sim_fleet, tmp_path_factory):
    """Both nodes' engines up and both in the gateway; the gateway's previous config put back after."""
    fleet = traffic_fleet(sim_fleet, PORT)
    key = os.environ["LITELLM_MASTER_KEY"]
    with FleetSession(fleet) as s, engines_on(sim_fleet, PORT, fleet.launch.served_model_name,
                                               tmp_path_factory.mktemp("engines")) as engines:
        host = GatewayHost(s, master_key=key, poll_s=0.5)
        before = host.read()
        host.set_rotation(["spark1", "spark2"])
        yield {"host": host, "engines": engines, "url": host.base_url, "key": key}
        if before.config is not None:
            host.apply(before.config)


def in_flight(st: dict, tokens: int = TOKENS) -> Streams:
    return on_every_engine(st["url"], st["key"], st["engines"], max_tokens=tokens)


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
        node_of = {e.base_url: n for n, e in streaming["engines"].items()}
        after = Streams(streaming["url"], streaming["key"], node_of, max_tokens=5).add(4).wait()
        assert [r.node for r in after] == ["spark1"] * 4 and not any(r.dropped for r in after)
    finally:
        host.restore("spark2")


def test_restart_drops_streams_in_flight(sim_fleet, streaming):
    """The runbook's restart, for contrast: the streams' failure is seen (the test above can fail).
    A stop waits 10 s for the proxy's streams (as `docker compose restart` does), then kills it:
    these streams (~19 s) are cut."""
    with FleetSession(traffic_fleet(sim_fleet, PORT, "restart")) as s:
        host = GatewayHost(s, master_key=streaming["key"], poll_s=0.5)
        streams = in_flight(streaming, tokens=1000)
        try:
            host.drain("spark2", "test drain")
        finally:
            host.restore("spark2")
        results = streams.wait()
    dropped = [r for r in results if r.dropped]
    assert dropped and {r.node for r in dropped} >= {"spark1"}, [(r.node, r.error) for r in results]
