"""The test launcher's port handling: a picked port lost to another process is re-picked."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from twinmq.testing.launcher import BrokerProcess, free_port


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


def test_a_broker_whose_listener_cannot_bind_exits_even_with_its_mirror_link_up(
    tmp_path: Path,
) -> None:
    # Its mirror link is already connecting when the mirror port turns out to be taken:
    # the failed start must stop the link and exit (3.11's wait_for once swallowed the
    # cancellation and the broker waited for ever, never ready and never gone).
    mirror_port = free_port()
    args = ["--mirror-token", "t" * 32, "--mirror-role", "bidirectional"]
    target = BrokerProcess(
        tmp_path / "target" / "data",
        name="target",
        extra_args=[*args, "--mirror-port", str(mirror_port), "--mirror-id", "target",
                    "--mirror-to", f"127.0.0.1:{free_port()}"],
    )  # fmt: skip
    with target.start(), _occupy(0) as taken:
        for attempt in range(2):
            broker = BrokerProcess(
                tmp_path / f"b{attempt}" / "data",
                name=f"b{attempt}",
                extra_args=[*args, "--mirror-port", str(taken.getsockname()[1]),
                            "--mirror-id", f"b{attempt}", "--mirror-to",
                            f"127.0.0.1:{mirror_port}"],
            )  # fmt: skip
            with pytest.raises(RuntimeError, match="address already in use"):
                broker.start(timeout=60)
