"""Eight nodes at the level CI can afford (the full chain runs at 2 in e2e; 4 in test_distribution_tree
for the copy): the sim brings up 8, the fleet file names 8 serve nodes with one builder, the
distribution reaches 7 receivers pipelined down a chain (the second receiver gets units from the
first before the first has everything: nobody waits for a whole copy), and the real proxy rotates
and drains among all 8."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from spark_pipelines.core import distribution as plan_core
from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core.fleet import load_fleet
from spark_pipelines.resources.docker import NodeDocker
from spark_pipelines.resources.gateway import GatewayHost
from spark_pipelines.resources.ssh import FleetSession, SshSettings
from spark_pipelines.runbook.distribution import distribute
from spark_pipelines.runbook.rotation import drained
from spark_sim.fleet import SimFleet
from tests.plugins.distribution import make_payload, sim_fleet_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet8(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    with sim_fleet_of(8, tmp_path_factory.mktemp("sim8")) as sim:
        yield sim


def test_eight_nodes_distribute_pipelined_and_rotate_in_the_gateway(fleet8):
    assert fleet8.fleet_file is not None
    fleet = load_fleet(fleet8.fleet_file)
    names = [n.name for n in fleet.serve_nodes]
    assert len(names) == 8 and len({n.host for n in fleet.nodes}) == 8
    assert [n.name for n in fleet.nodes if "build" in n.roles] == [fleet.nodes[0].name]
    assert all(r["sshd_alive"] and r.get("dockerd_alive", True) for r in fleet8.status())
    with FleetSession(fleet, SshSettings(connect_retries=1)) as s:
        payload = make_payload(s, 2 * 1024 * 1024)
        report = distribute(s, fleet.serve_nodes, payload)
        receivers = [n for n in names if n != fleet.build_node.name]
        assert plan_core.tree_lines(report.tree) == [" -> ".join(names)]  # fan_out 1: one chain
        assert sorted(report.verified) == sorted(receivers) and not report.given_up
        # Every unit came from the node's parent, and the pipeline ran: the second node was receiving
        # from the first before the first had everything (a tree of whole copies waits for it).
        assert all(report.tree[t.receiver] == t.holder for t in report.transfers)
        second_started = min(t.started for t in report.transfers if t.receiver == receivers[1])
        assert second_started < report.done_at[receivers[0]], report.lines()
        assert all(NodeDocker(s).image_id(n, payload.image) == payload.image_id for n in names)

        gw = GatewayHost(s, master_key=os.environ["LITELLM_MASTER_KEY"])
        config, reloaded = gw.set_rotation(names)
        assert reloaded and gateway_core.nodes_in_rotation(config) == names
        last = names[-1]
        with drained(gw, last, reason="test"):
            assert gw.serving_nodes() == names[:-1]
        assert gw.serving_nodes() == names
