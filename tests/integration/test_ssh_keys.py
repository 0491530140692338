"""Key types and ssh-agent against a real sshd on a simulated node."""

import os
import subprocess

import pytest
import yaml

from spark_pipelines.core.fleet import parse_fleet
from spark_pipelines.resources.ssh import FleetSession, NodeConnectError

pytestmark = pytest.mark.slow


def fleet_with(sim_fleet, **node_changes):
    data = yaml.safe_load(sim_fleet.fleet_file.read_text())
    data["nodes"][1].update(node_changes)
    return parse_fleet(data)


def authorize(sim_fleet, node, pub: str):
    ak = sim_fleet.node(node).home / ".ssh" / "authorized_keys"
    with open(ak, "a") as f:
        f.write(pub.strip() + "\n")


def test_rsa_key_logs_in(sim_fleet, tmp_path):
    key = tmp_path / "id_rsa"
    subprocess.run(["ssh-keygen", "-q", "-t", "rsa", "-b", "3072", "-N", "", "-f", str(key)], check=True)
    authorize(sim_fleet, "spark2", (tmp_path / "id_rsa.pub").read_text())
    with FleetSession(fleet_with(sim_fleet, key_path=str(key))) as s:
        assert s.run("spark2", ["id", "-un"], log=False).stdout.strip() == sim_fleet.node("spark2").user


def test_ssh_agent_when_no_key_path(sim_fleet, tmp_path, monkeypatch):
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    try:
        for _ in range(50):
            if sock.exists():
                break
            subprocess.run(["sleep", "0.1"])
        env = dict(os.environ, SSH_AUTH_SOCK=str(sock))
        subprocess.run(["ssh-add", "-q", str(sim_fleet.layout.key_path)], env=env, check=True)
        monkeypatch.setenv("SSH_AUTH_SOCK", str(sock))
        with FleetSession(fleet_with(sim_fleet, key_path=None)) as s:
            assert s.run("spark2", ["true"], log=False).ok
        monkeypatch.delenv("SSH_AUTH_SOCK")
        with pytest.raises(NodeConnectError, match="ssh-agent"):
            with FleetSession(fleet_with(sim_fleet, key_path=None)) as s:
                s.run("spark2", ["true"], log=False)
    finally:
        agent.terminate()
        agent.wait(10)
