"""Shared fixtures. Server-starting fixtures live in tests/plugins/ and start once per session."""

import signal

import pytest

# A suite started as a background job (`nohup make test &`, a CI runner's shell) inherits SIGINT
# ignored, and Python then installs no KeyboardInterrupt handler. Dagster maps SIGTERM to SIGINT's
# handler during a run, so SIGTERM becomes ignored too, and every child inherits that: its
# compute-log `tail` then outlives terminate() by 30 s a stream, and `_thread.interrupt_main()`
# does nothing. The suite runs as it would from a terminal.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
if signal.getsignal(signal.SIGTERM) == signal.SIG_IGN:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)

pytest_plugins = ["tests.plugins.sim", "tests.plugins.servers", "tests.plugins.remote", "tests.plugins.faults",
                  "tests.plugins.browser"]

SEED = "fleets/seed.yaml"


@pytest.fixture()
def seed_data():
    import yaml

    with open(SEED) as f:
        return yaml.safe_load(f)
