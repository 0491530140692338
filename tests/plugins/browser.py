"""A real browser for the UI tests: Debian's chromium, headless, driven over the DevTools protocol
with the `websockets` client (no browser download, no driver whose version must match the
browser's, as Playwright's would).

Chromium runs with a private profile in the session's tmp dir, only towards 127.0.0.1 (every other
host goes to a dead proxy, name resolution maps everything else to nothing, background networking
off), and with --no-sandbox: the tests run as root, and chromium refuses to start as root with its
sandbox on. Screenshots land in test-artifacts/ui/ (gitignored; SPARK_TEST_ARTIFACTS overrides);
the path is printed at the end of the session.

    shown = browser.open(url, "asset-graph", expect=["bench_results"])   # waits for the strings
    shown.has("tok/s")            # one line per assertion: names the page and the screenshot
    shown.lacks("spark2")
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.plugins import unavailable

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
# What the Dagster UI shows when a query or a page breaks.
ERROR_BANNERS = ("Unexpected GraphQL error", "Something went wrong", "An unexpected error", "PythonError",
                 "Could not load", "Error loading", "Page not found")


def artifacts_dir() -> Path:
    return Path(os.environ.get("SPARK_TEST_ARTIFACTS", REPO / "test-artifacts")) / "ui"


@dataclass
class Shown:
    """A page as the browser showed it: its text, its screenshot."""

    name: str
    url: str
    text: str
    screenshot: Path

    def _where(self) -> str:
        return f"{self.name} ({self.url}, screenshot {self.screenshot})"

    def has(self, *needles: str) -> Shown:
        missing = [n for n in needles if n not in self.text]
        assert not missing, f"{self._where()} does not show {missing}; it shows: {self.text[:1500]!r}"
        return self

    def lacks(self, *needles: str) -> Shown:
        found = [n for n in needles if n in self.text]
        assert not found, f"{self._where()} shows {found}"
        return self


@dataclass
class Browser:
    ws: object  # websockets.sync.client.ClientConnection
    shots: Path
    ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    requested: list[str] = field(default_factory=list)

    def call(self, method: str, timeout: float = 60, **params: object) -> dict:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if msg.get("method") == "Network.requestWillBeSent":
                self.requested.append(msg["params"]["request"]["url"])
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def eval(self, expression: str) -> object:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return res.get("result", {}).get("value")

    def text(self) -> str:
        return self.eval("document.body ? document.body.innerText : ''") or ""

    def open(self, url: str, name: str, expect: list[str] | tuple[str, ...] = (), timeout: float = 90) -> Shown:
        """Load `url`, then `show` it."""
        self.call("Page.navigate", url=url)
        return self.show(name, expect, timeout)

    def show(self, name: str, expect: list[str] | tuple[str, ...] = (), timeout: float = 90) -> Shown:
        """Wait until every string of `expect` shows on the current page and its text stops
        changing, save a screenshot as <name>.png, check for error banners."""
        url = self.eval("location.href") or ""
        deadline = time.monotonic() + timeout
        text, stable_since, complete_since = "", time.monotonic(), None
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.text()
            if now != text:
                text, stable_since = now, time.monotonic()
            if not all(e in text for e in expect):
                complete_since = None
                continue
            complete_since = complete_since or time.monotonic()
            # Settled, or a page with a clock in it (timeline, tick countdown) given 5 s to finish loading.
            if time.monotonic() - stable_since >= 1.5 or time.monotonic() - complete_since >= 5:
                break
        if "Join the Dagster community" in text:
            # The UI's first-visit newsletter dialog covers the page: dismissed as a user would.
            self.click_text("Skip")
            time.sleep(1.0)
            text = self.text()
        shot = self.shots / f"{name}.png"
        data = self.call("Page.captureScreenshot", format="png")["data"]
        shot.write_bytes(base64.b64decode(data))
        shown = Shown(name, url, text, shot)
        shown.has(*expect)
        banners = [b for b in ERROR_BANNERS if b in text]
        assert not banners, f"{shown._where()} shows an error: {banners}: {text[:1500]!r}"
        return shown

    def key(self, key: str, code: str, alt: bool = False) -> None:
        """Press a key (the UI's shortcuts, e.g. Alt+E expands every group of the asset graph)."""
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=code, modifiers=1 if alt else 0)

    def click_text(self, text: str) -> None:
        """Click the innermost visible element whose own text is `text`."""
        found = self.eval(
            "(() => { const want = " + json.dumps(text) + ";"
            " const els = [...document.querySelectorAll('body *')].filter(e => e.offsetParent !== null"
            " && e.innerText && e.innerText.trim() === want);"
            " const el = els[els.length - 1]; if (!el) return false; el.click(); return true; })()")
        assert found, f"no element reads {text!r}"


@pytest.fixture(scope="session")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        unavailable(f"{CHROMIUM} is missing: scripts/bootstrap.sh test installs Debian's chromium")
    from websockets.sync.client import connect

    profile = tmp_path_factory.mktemp("chromium-profile")
    shots = artifacts_dir()
    shutil.rmtree(shots, ignore_errors=True)
    shots.mkdir(parents=True)
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            f"--user-data-dir={profile}", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--disable-sync",
            "--disable-background-networking", "--disable-component-update", "--disable-default-apps",
            "--proxy-server=http://127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            "--window-size=1600,1000", "about:blank"]
    log = open(profile.parent / "chromium.log", "wb")
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or len(port_file.read_text().splitlines()) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"chromium did not start (log: {log.name})")
            time.sleep(0.2)
        port = int(port_file.read_text().splitlines()[0])
        pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        target = next(p for p in pages if p["type"] == "page")
        # No keepalive pings: the DevTools socket is loopback, and a test may sit minutes in a run (the
        # page busy) before its next command; a missed pong would close the browser under it.
        with connect(target["webSocketDebuggerUrl"], max_size=None, open_timeout=30, ping_interval=None) as ws:
            b = Browser(ws, shots)
            b.call("Page.enable")
            b.call("Network.enable")
            b.call("Emulation.setDeviceMetricsOverride", width=1600, height=1000, deviceScaleFactor=1, mobile=False)
            yield b
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def only_loopback(urls: list[str]) -> list[str]:
    """The requests that left 127.0.0.1 (data:, blob: and about: stay in the browser)."""
    return [u for u in urls if urlparse(u).scheme in ("http", "https", "ws", "wss")
            and urlparse(u).hostname != "127.0.0.1"]


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    shots = artifacts_dir()
    if shots.exists() and any(shots.glob("*.png")):
        terminalreporter.write_line(f"browser screenshots: {shots}")
