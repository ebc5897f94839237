"""Shared fixtures: one real server per test module that asks for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.server import RunningServer, start_server

PROFILES = {
    "small": {"gpu_fraction": 0.25, "memory_mib": 10240},
    "whole": {"gpu_fraction": 1},
    "huge": {"gpu_fraction": 0.5, "memory_mib": 100_000},
}
INVENTORY = [
    {"uuid": "GPU-test-0000", "name": "Test A100", "memory_mib": 40960},
    {"uuid": "GPU-test-0001", "name": "Test A100", "memory_mib": 40960},
]
CONFIG = {"ElasticKernels": {"profiles": PROFILES, "gpu_inventory": INVENTORY, "reap_interval": 1}}


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server with two declared test GPUs and the sizes above."""
    running = start_server(tmp_path_factory.mktemp("server"), CONFIG)
    yield running
    running.stop()
