"""Shared fixtures. Server-starting fixtures live in tests/plugins/ and start once per session."""

import pytest

pytest_plugins = ["tests.plugins.sim", "tests.plugins.servers", "tests.plugins.remote", "tests.plugins.faults",
                  "tests.plugins.browser"]

SEED = "fleets/seed.yaml"


@pytest.fixture()
def seed_data():
    import yaml

    with open(SEED) as f:
        return yaml.safe_load(f)
