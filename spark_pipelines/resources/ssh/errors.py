"""What can go wrong on (or on the way to) a node; every message names the node and what to do."""

from __future__ import annotations

from spark_pipelines.core import remote

# The runbook's rule for a node that stops answering: "Node SSH-unreachable for >10 min | Hard-reset
# the node, don't wait." Every dead-peer message ends with it.
UNREACHABLE_ADVICE = "check that the node is up (runbook: SSH-unreachable >10 min -> hard-reset)"


class RemoteError(Exception):
    """Something on (or on the way to) a node failed; the message says which node and what to do."""


class NodeConnectError(RemoteError):
    """No SSH session could be opened to a node."""


class NodeUnreachable(NodeConnectError):
    """The node does not answer (no TCP connection, or an sshd that accepts and never speaks): the
    only connect failure that says something about the node itself rather than the fleet file or
    the credentials."""


class HostKeyError(NodeConnectError):
    """The node's host key is unknown or does not match known_hosts: refused, never retried."""


class RemoteFileError(RemoteError):
    """A file on a node could not be read or written."""


class NodeUnresponsive(RemoteError):
    """The node's sshd stopped answering (no bytes, no keepalive reply): the connection was closed.

    Raised in bounded time for a frozen sshd or a dead link, where TCP alone would wait forever."""

    def __init__(self, node: str, seconds: float, during: str):
        self.node, self.seconds, self.during = node, seconds, during
        super().__init__(f"node {node}: no answer from sshd for {seconds:.0f} s during {during}; {UNREACHABLE_ADVICE}")


class RemoteCommandError(RemoteError):
    """A remote command exited non-zero. Carries node, the quoted command, exit status and output tail."""

    def __init__(self, node: str, command: str, exit_status: int | None, tail: str, message: str | None = None):
        self.node = node
        self.command = command
        self.exit_status = exit_status
        self.tail = tail
        if message is None:
            # 124/137 is what the node-side `timeout` returns: say so, a bare number explains nothing.
            why = (" (the node-side `timeout` ended it: it ran past its limit; check what it waits on, "
                   "e.g. dockerd for a docker command)" if exit_status in remote.TIMEOUT_EXIT_CODES else "")
            message = f"node {node}: command exited with status {exit_status}{why}: {command}\n--- last output ---\n{tail}"
        super().__init__(message)


class RemoteCommandTimeout(RemoteCommandError):
    """The command ran past its timeout and was killed on the node."""


class SudoPasswordRequired(RemoteCommandError):
    """`sudo -n` wanted a password: the message holds the sudoers line to add."""

    def __init__(self, node: str, command: str, exit_status: int | None, tail: str, advice: str, line: str):
        self.sudoers_line = line
        super().__init__(node, command, exit_status, tail, f"{advice}\ncommand: {command}")
