"""`python3 -m twinmq.client.roundtrip`, the chart's `helm test` check, against a real
broker process: it passes when the messages come back, and fails (exit 1, a reason) when
the broker cannot be used."""

from __future__ import annotations

import os
import subprocess
import sys

from twinmq.client.roundtrip import ENV_PREFIX, EXIT_FAILED, EXIT_OK
from twinmq.testing.launcher import BrokerProcess


def run_check(broker: BrokerProcess, password: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The check as the helm test Pod runs it, aimed at `broker`."""
    env = dict(
        os.environ,
        **{
            ENV_PREFIX + "HOST": broker.host,
            ENV_PREFIX + "PORT": str(broker.port),
            ENV_PREFIX + "USERNAME": "guest",
            ENV_PREFIX + "PASSWORD": password,
        },
    )
    return subprocess.run(
        [sys.executable, "-m", "twinmq.client.roundtrip", *args],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def check_queues(broker: BrokerProcess) -> list[str]:
    """The round trip's queues the broker still has."""
    return [q.name for q in broker.admin.status().queues if q.name.startswith("twinmq-check-")]


def test_messages_published_with_confirms_come_back_and_the_queue_is_removed(
    broker: BrokerProcess,
) -> None:
    proc = run_check(broker, "guest", "--count", "50")
    assert proc.returncode == EXIT_OK, proc.stderr
    assert "50 messages published with confirms and consumed back" in proc.stdout
    assert check_queues(broker) == []


def test_a_refused_login_fails_the_check(broker: BrokerProcess) -> None:
    proc = run_check(broker, "wrong", "--count", "1", "--timeout", "20")
    assert proc.returncode == EXIT_FAILED
    assert proc.stderr.startswith("FAIL ")
