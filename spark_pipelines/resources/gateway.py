"""The LiteLLM gateway host: write the proxy config, reload the proxy, read its health.

Without a database LiteLLM has no runtime API to add or remove a deployment, so changing a pool
means rewriting the config and reloading (the runbook restarted the compose service).
"""

from __future__ import annotations

import os
import time
from typing import Any

import dagster as dg
import httpx
from pydantic import Field

from spark_pipelines.core import gateway as gateway_core
from spark_pipelines.core.launch import expand_home
from spark_pipelines.resources.ssh import GATEWAY_KEY, FleetSession, FleetSSH


class GatewayError(Exception):
    pass


class GatewayHost:
    def __init__(self, session: FleetSession, ready_timeout_s: float = 90.0) -> None:
        self.session = session
        self.fleet = session.fleet
        self.gw = session.fleet.gateway
        self.ready_timeout_s = ready_timeout_s

    @property
    def base_url(self) -> str:
        host = self.gw.host if ":" not in self.gw.host else f"[{self.gw.host}]"
        return f"http://{host}:{self.gw.proxy_port}"

    def master_key(self) -> str | None:
        return os.environ.get(self.gw.master_key_env) or None

    def read_config(self) -> dict[str, Any] | None:
        path = expand_home(self.gw.config_path, self.gw.home_dir)
        if not self.session.exists(GATEWAY_KEY, path):
            return None
        return gateway_core.load(self.session.read_text(GATEWAY_KEY, path))

    def apply(self, config: dict[str, Any], current: dict[str, Any] | None) -> bool:
        """Write the config and reload the proxy; wait until it answers readiness again.
        `current` is the config on the host (the caller has read it already). A ready proxy
        already serving this exact config is left alone (a reload drops in-flight streams and
        takes ~10-20 s). Returns whether it reloaded."""
        path = expand_home(self.gw.config_path, self.gw.home_dir)
        if current is not None and gateway_core.dump(current) == gateway_core.dump(config) and self.ready():
            self.session.log.info(f"[{GATEWAY_KEY}] LiteLLM config unchanged and proxy ready; not reloaded")
            return False
        self.session.put_text(GATEWAY_KEY, path, gateway_core.dump(config), 0o600)
        argv = list(self.gw.reload_command)
        if self.gw.reload_dir:
            argv = ["env", "-C", expand_home(self.gw.reload_dir, self.gw.home_dir), *argv]
        secret = {self.gw.master_key_env: k} if (k := self.master_key()) else None
        self.session.run(GATEWAY_KEY, argv, secret_env=secret, timeout=300)
        self.wait_ready()
        return True

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.base_url}/health/readiness", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{self.base_url}/health/readiness", timeout=5)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                last = type(e).__name__
            time.sleep(1)
        raise GatewayError(
            f"LiteLLM on {self.gw.host}:{self.gw.proxy_port} not ready after {self.ready_timeout_s:.0f} s ({last}); "
            f"check the proxy's logs on the gateway host"
        )

    def set_rotation(self, nodes: list[str]) -> tuple[dict[str, Any], bool]:
        """(the config now serving, whether the proxy was reloaded for it)."""
        config = gateway_core.render_config(self.fleet, nodes)
        return config, self.apply(config, self.read_config())

    def drain(self, node: str) -> list[str]:
        """Take one node out of every pool; returns the rotation before, for restore."""
        current = self.read_config()
        before = gateway_core.nodes_in_rotation(current) if current else []
        if current is None:
            return before
        self.apply(gateway_core.drain(current, node), current)
        return before

    def restore(self, node: str) -> None:
        current = self.read_config()
        self.apply(gateway_core.restore(current or gateway_core.render_config(self.fleet, []), self.fleet, node),
                   current)

    def rotation(self) -> list[str]:
        current = self.read_config()
        return gateway_core.nodes_in_rotation(current) if current else []


class LiteLLMGateway(dg.ConfigurableResource):
    ssh: FleetSSH
    ready_timeout_s: float = Field(default=90.0, description="how long a reloaded proxy may take to be ready")

    def host(self) -> GatewayHost:
        return GatewayHost(self.ssh.session, self.ready_timeout_s)
