"""What a connect failure says, and whether the health sweep reads it as the node's fault: a host
name that does not resolve, a key_path that is a directory, an sshd that accepts and never speaks."""

from __future__ import annotations

import logging
import socket
import threading

import pytest

from spark_pipelines.core import health
from spark_pipelines.core.fleet import SshTarget
from spark_pipelines.resources.ssh import connection
from spark_pipelines.resources.ssh.errors import NodeConnectError, NodeUnreachable

LOG = logging.getLogger("test")
FAST = connection.SshSettings(connect_timeout_s=1.0, connect_retries=0, retry_backoff_s=0)


def target(tmp_path, **kw) -> SshTarget:
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    key = tmp_path / "id_ed25519"
    key.write_text("not used: the failure comes first")
    return SshTarget(**{"host": "127.0.0.1", "user": "operator", "key_path": str(key), "known_hosts": str(kh), **kw})


def verdict_for(e: NodeConnectError, refused: bool) -> health.NodeVerdict:
    obs = health.Observation(node="spark2", probed_at=1000.0, ssh_ok=False, ssh_error=str(e), ssh_refused=refused,
                             ssh_dead_since=0.0)
    return health.unreachable(obs)


def test_a_key_path_that_is_a_directory_says_so(tmp_path):
    with pytest.raises(NodeConnectError) as e:
        connection.connect("spark2", target(tmp_path, key_path=str(tmp_path)), FAST, LOG)
    assert "is a directory, not a key file" in str(e.value) and "does not exist" not in str(e.value)
    assert not isinstance(e.value, NodeUnreachable)


def test_an_unresolvable_host_is_the_fleet_files_fault_never_a_reset(tmp_path, monkeypatch):
    def no_such_name(address, timeout=None):  # what getaddrinfo raises, without asking a resolver
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(connection.socket, "create_connection", no_such_name)
    with pytest.raises(NodeConnectError) as e:
        connection.connect("spark2", target(tmp_path, host="spark2.lan"), FAST, LOG)
    assert not isinstance(e.value, NodeUnreachable)
    assert "host 'spark2.lan' does not resolve (Name or service not known); fix host in the fleet file" in str(e.value)
    v = verdict_for(e.value, refused=not isinstance(e.value, NodeUnreachable))
    assert v.verdict == "unknown" and "reset" not in v.advice.replace("never a reset", ""), v


def test_an_sshd_that_accepts_and_never_speaks_is_unreachable_in_one_voice(tmp_path):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(4)
        held = []
        threading.Thread(target=lambda: held.append(srv.accept()), daemon=True).start()
        with pytest.raises(NodeUnreachable) as e:
            connection.connect("spark2", target(tmp_path, port=srv.getsockname()[1]), FAST, LOG)
    assert "accepted the connection but did not answer" in str(e.value)
    v = verdict_for(e.value, refused=not isinstance(e.value, NodeUnreachable))
    # One story: a node that does not answer, never "answers but refuses the session".
    assert v.verdict == "unreachable" and "refuse" not in " ".join(v.evidence), v
