"""A full disk blocks publishers and nacks what could not be written; nothing confirmed is lost."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest

from twinmq.broker.api import BrokerStatus
from twinmq.broker.launcher import BrokerProcess


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs of the test's own (needs root; skipped where mounting is refused)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def wait_for_alarms(broker: BrokerProcess, expected: list[str]) -> None:
    """Poll the admin API until the broker reports exactly `expected` alarms."""
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(broker.admin_url + "/status", timeout=5) as resp:
            alarms = BrokerStatus.model_validate_json(resp.read()).alarms
        if alarms == expected:
            return
        assert time.monotonic() < deadline, f"alarms {alarms}, expected {expected}"
        time.sleep(0.1)


def test_full_disk_nacks_blocks_and_recovers_without_losing_confirms(small_disk: Path) -> None:
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (11 * 1024 * 1024))
    data = small_disk / "data"
    args = ["--disk-free-limit", "0", "--segment-bytes", str(1024 * 1024)]
    broker = BrokerProcess(data, name="full", extra_args=args, log_path=small_disk.parent / "b.log")
    broker.start()
    params = pika.ConnectionParameters(port=broker.port, blocked_connection_timeout=3)
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    ch.queue_declare("full.q", durable=True)
    ch.confirm_delivery()
    confirmed: list[int] = []
    refused = None
    body = b"x" * 4096
    for i in range(5000):
        try:
            ch.basic_publish(
                "", "full.q", body + str(i).encode(), pika.BasicProperties(delivery_mode=2)
            )
        except (
            pika.exceptions.NackError,
            pika.exceptions.ConnectionBlockedTimeout,
            pika.exceptions.AMQPConnectionError,
        ) as exc:
            refused = exc
            break
        confirmed.append(i)
    assert refused is not None, "the disk never filled"
    assert confirmed, "nothing was confirmed before the disk filled"
    # The failed write raised the disk alarm (publishers blocked) ...
    wait_for_alarms(broker, ["disk"])
    # ... until space comes back: the alarm clears and publishing works again.
    filler.unlink()
    wait_for_alarms(broker, [])
    deadline = time.monotonic() + 10
    while True:
        try:
            conn = pika.BlockingConnection(pika.ConnectionParameters(port=broker.port))
            ch = conn.channel()
            ch.confirm_delivery()
            ch.basic_publish("", "full.q", body + b"after", pika.BasicProperties(delivery_mode=2))
            break
        except (pika.exceptions.NackError, pika.exceptions.AMQPConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    conn.close()
    broker.kill()
    restarted = BrokerProcess(
        data, name="full", extra_args=args, port=broker.port, log_path=small_disk.parent / "b.log"
    ).start()
    try:
        conn = pika.BlockingConnection(pika.ConnectionParameters(port=restarted.port))
        ch = conn.channel()
        seen = set()
        while True:
            method, _props, got = ch.basic_get("full.q", auto_ack=True)
            if method is None:
                break
            seen.add(got[len(body) :].decode())
        conn.close()
    finally:
        restarted.stop()
    assert {str(i) for i in confirmed} <= seen, "a confirmed message was lost"
    assert "after" in seen
    assert "disk full" in (small_disk.parent / "b.log").read_text()
