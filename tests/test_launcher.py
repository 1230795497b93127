"""The test launcher's port handling: a picked port lost to another process is re-picked."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from twinmq.testing.launcher import BrokerProcess


def _occupy(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_a_picked_port_taken_before_the_start_is_picked_again(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path / "picked")
    lost = broker.admin_port
    with _occupy(lost), broker.start():
        assert broker.admin_port != lost
        assert broker.admin.status().role == "active"


def test_a_port_the_caller_chose_is_never_changed(tmp_path: Path) -> None:
    with _occupy(0) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="address already in use"):
            BrokerProcess(tmp_path / "fixed", admin_port=port).start()
