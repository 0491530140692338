"""The simulated fleet's network: one bridge in a switch namespace, one namespace per member.

The bridge lives in its own namespace so the host's iptables (which any system dockerd may set
to FORWARD DROP) never sees node-to-node traffic, and no host sysctl (ip_forward) has to change.
Namespaces get no default route: nodes reach each other and this machine, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

from spark_sim.effects import run
from spark_sim.layout import Layout, Member, SimError

Record = Callable[[str, str], None]  # (kind, name): noted in the state file before it is made


def make_switch(lay: Layout, record: Record) -> None:
    record("netns", lay.switch_ns)
    run(["ip", "netns", "add", lay.switch_ns], what=f"ip netns add {lay.switch_ns}")
    sw = ["ip", "-n", lay.switch_ns]
    run([*sw, "link", "add", "br0", "type", "bridge"], what="creating the sim bridge")
    run([*sw, "link", "set", "br0", "up"])
    run([*sw, "link", "set", "lo", "up"])
    record("links", lay.root_link)
    run(["ip", "link", "add", lay.root_link, "type", "veth", "peer", "name", "host", "netns", lay.switch_ns],
        what=f"creating veth {lay.root_link}")
    run([*sw, "link", "set", "host", "master", "br0", "up"])
    run(["ip", "addr", "add", f"{lay.host_ip}/24", "dev", lay.root_link])
    run(["ip", "link", "set", lay.root_link, "up"])


def make_member_netns(lay: Layout, m: Member, record: Record) -> None:
    """The member's namespace, plugged into the bridge at its address."""
    record("netns", m.netns)
    run(["ip", "netns", "add", m.netns], what=f"ip netns add {m.netns}")
    port = f"p{m.ip.rsplit('.', 1)[1]}"
    run(["ip", "-n", lay.switch_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", m.netns],
        what=f"creating the veth of {m.name}")
    run(["ip", "-n", lay.switch_ns, "link", "set", port, "master", "br0", "up"])
    run(["ip", "-n", m.netns, "addr", "add", f"{m.ip}/24", "dev", "eth0"])
    run(["ip", "-n", m.netns, "link", "set", "eth0", "up"])
    run(["ip", "-n", m.netns, "link", "set", "lo", "up"])


def limit_link(lay: Layout, m: Member, mbit: float) -> None:
    """Rate-limit the member's link to `mbit` each way, like a real NIC: its uplink (eth0 egress in its
    namespace) and its downlink (the switch port's egress toward it). A token bucket (tbf) with
    ~10 ms of burst keeps a stream at the rate without dropping bursts a plain policer would."""
    if not 1 <= mbit <= 100_000:
        raise SimError(f"--link-mbit {mbit:g}: choose a rate between 1 and 100000 Mbit/s")
    rate = f"{mbit:g}mbit"
    burst = f"{max(64, int(mbit * 1e6 / 8 / 100 / 1024))}kb"
    port = f"p{m.ip.rsplit('.', 1)[1]}"
    for ns, dev in ((m.netns, "eth0"), (lay.switch_ns, port)):
        run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
             "latency", "100ms"], what=f"tc on {dev} of {m.name} ({rate})")


LINK_DEV = "dac0"  # a pair's direct link in each of its two namespaces (the runbook's DAC between CX-7 ports)
LINK_MTU = 9000


def make_pair_link(lay: Layout, head: Member, worker: Member, mtu: int = LINK_MTU) -> tuple[str, str]:
    """A direct link between two nodes' namespaces, beside the bridge (a veth, jumbo frames):
    what a node pair's NCCL and rendezvous run over. Returns (head address, worker address).
    Gone with the namespaces at `down`: nothing to record."""
    head_ip, worker_ip = lay.link_address(1), lay.link_address(2)
    run(["ip", "-n", head.netns, "link", "add", LINK_DEV, "type", "veth", "peer", "name", LINK_DEV,
         "netns", worker.netns], what=f"creating the link {head.name} <-> {worker.name}")
    for m, ip in ((head, head_ip), (worker, worker_ip)):
        run(["ip", "-n", m.netns, "link", "set", LINK_DEV, "mtu", str(mtu), "up"])
        run(["ip", "-n", m.netns, "addr", "add", f"{ip}/24", "dev", LINK_DEV])
    return head_ip, worker_ip
