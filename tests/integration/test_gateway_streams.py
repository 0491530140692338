"""Drain and restore while clients stream through the real LiteLLM proxy on the simulated gateway
host (behind its front, nginx, as the seed's gateway.front sets it). Engines: the vLLM stand-in on
each node's address (spark_sim.traffic), at the runbook's 52 tok/s so that a stream outlives the
change.

graceful (the sim's fleet file): SIGHUP to the proxy's gunicorn master; every stream in flight
ends normally, on the node that stays and on the node drained. restart (the runbook's `docker
compose restart litellm`): the same drain drops them, which shows the streams here can fail.
Clients that send back to back on pooled keep-alive connections without resending, on fresh
connections, and through the OpenAI SDK lose no request across reloads (the front's work), and
a drain's block starts only once the drained node's streams ended."""

from __future__ import annotations

import os
import time

import pytest

from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession
from spark_pipelines.runbook.rotation import drained
from spark_sim.traffic import FRESH, OPENAI, POOLED, Streams, Traffic, engines_on, on_every_engine, running, traffic_fleet

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


def test_a_drain_waits_for_the_drained_nodes_streams_before_its_block(streaming):
    """Issue 34.3: the deploy's drain returned once the proxy no longer routed to the node, and
    `docker stop` cut a stream the node was still sending. Now the block starts only when the
    node's vLLM reads zero requests in flight; the streams end whole."""
    host, engines = streaming["host"], streaming["engines"]
    streams = in_flight(streaming, tokens=520)  # ~10 s at 52 tok/s: longer than the drain
    with drained(host, "spark2", reason="test deploy") as d:
        assert running(engines["spark2"]) == 0, "the block ran while spark2 still had requests in flight"
        on2 = [r for r in streams.results if r.node == "spark2"]
        assert on2 and all(r.ended and r.finished for r in on2), [(r.ended, r.error) for r in on2]
    assert d.waited_s is not None
    assert [r.error for r in streams.wait() if r.dropped] == []


def test_clients_lose_no_request_across_graceful_reloads(streaming):
    """Issue 34.3: requests on pooled keep-alive connections were reset at the proxy's graceful
    reloads (uvicorn closes a connection its ending worker accepted and had not read). Clients as
    users run them (a pooled httpx client that never resends, a fresh connection per request, the
    OpenAI SDK's default client) send back to back through the gateway while spark2 is drained and
    restored 6 times: none fails, and the SDK never needs its own resend. Without the front this
    failed (measured: 3 of 173 pooled, 2 of 65 fresh over 20 and 12 reloads)."""
    host, engines = streaming["host"], streaming["engines"]
    node_of = {e.base_url: n for n, e in engines.items()}
    kinds = {POOLED: 4, FRESH: 2}
    try:
        import openai  # noqa: F401 - the test extra

        kinds[OPENAI] = 2
    except ImportError:
        pass
    with Traffic(streaming["url"], streaming["key"], node_of, kinds, max_tokens=8, pause_s=0.3) as t:
        time.sleep(2)
        for _ in range(6):
            host.drain("spark2", "test drain")
            time.sleep(0.5)
            host.restore("spark2")
            time.sleep(0.5)
    for kind in kinds:
        assert len(t.results(kind)) >= 10, t.summary()
    assert t.failed() == [], t.summary()
    assert t.resent() == [], t.summary()
    assert {r.node for r in t.results()} == {"spark1", "spark2"}
    print(t.summary())
