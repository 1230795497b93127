"""Shared fixtures: real broker processes on loopback, on throw-away data directories."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from twinmq.broker.launcher import BrokerProcess


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """A broker shared by the tests of one module (they use distinct queue names)."""
    data = tmp_path_factory.mktemp("broker") / "data"
    with BrokerProcess(data, name="test-broker") as proc:
        yield proc


@pytest.fixture
def fresh_broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    """A broker of the test's own (for tests that restart, kill or configure it)."""
    with BrokerProcess(tmp_path / "data", name="fresh-broker") as proc:
        yield proc
