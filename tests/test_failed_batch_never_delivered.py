"""What a failed write refused is never seen: not delivered, not counted, not remembered.

Real broker processes on a real small tmpfs (tests/disks.py, needs root), real
pika clients. A message is visible to consumers only once its group-commit batch
is complete; when the batch fails its messages are withdrawn and the
acknowledgements of a failed transaction are undone (docs/journal.md).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest
from disks import PassiveOnSmallDisk, commit_until_refused, small_tmpfs

from twinmq.broker.server import EXIT_JOURNAL_FAILED
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import post_role, status
from twinmq.testing.queues import drain, opted_in
from twinmq.testing.waiting import wait_for

FULL = ["--disk-free-limit", "0", "--segment-bytes", str(1024 * 1024)]
BODY = b"v" * 4096


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs with 11 MiB taken by a filler file (needs root)."""
    with small_tmpfs(tmp_path / "disk", "16m") as mount:
        (mount / "filler").write_bytes(b"\0" * (11 * 1024 * 1024))
        yield mount


class Consumer:
    """A consumer on its own connection and thread that records every body it gets.

    It never acknowledges (unlimited prefetch): the journal keeps every message,
    so the disk fills while everything committed is delivered at once.
    """

    def __init__(self, broker: BrokerProcess, queue: str) -> None:
        self.bodies: list[bytes] = []
        self._conn = pika.BlockingConnection(pika.URLParameters(broker.url))
        ch = self._conn.channel()
        ch.basic_consume(queue, lambda _c, _m, _p, body: self.bodies.append(body))
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(pika.exceptions.AMQPError):
            while not self._stop:
                self._conn.process_data_events(time_limit=0.1)

    def stop(self) -> None:
        self._stop = True
        self._thread.join(10)
        with contextlib.suppress(pika.exceptions.AMQPError):
            self._conn.close()


def _marker_after_space_returns(broker: BrokerProcess, disk: Path, queue: str) -> None:
    """Free the disk and publish a confirmed marker: FIFO, so it comes after all else."""
    (disk / "filler").unlink()

    def published() -> bool:
        try:
            conn = pika.BlockingConnection(pika.URLParameters(broker.url))
            ch = conn.channel()
            ch.confirm_delivery()
            ch.basic_publish("", queue, b"marker", pika.BasicProperties(delivery_mode=2))
            conn.close()
        except (pika.exceptions.NackError, pika.exceptions.AMQPError):
            return False
        return True

    wait_for("a confirmed publish once space returned", published, 20, interval=0.2)


def test_a_failed_tx_commit_is_never_delivered_to_a_live_consumer(small_disk: Path) -> None:
    broker = BrokerProcess(small_disk / "data", name="txvis", extra_args=FULL).start()
    try:
        conn = pika.BlockingConnection(
            pika.ConnectionParameters(port=broker.port, blocked_connection_timeout=3)
        )
        ch = conn.channel()
        ch.queue_declare("vis.q", durable=True)
        consumer = Consumer(broker, "vis.q")
        ch.tx_select()
        committed, failed_txn, refusal = commit_until_refused(ch, "vis.q", BODY)
        assert refusal is not None and failed_txn is not None, "the disk never filled"
        assert refusal.reply_code == 541
        with contextlib.suppress(pika.exceptions.AMQPError):
            conn.close()
        _marker_after_space_returns(broker, small_disk, "vis.q")
        wait_for("the marker delivered", lambda: b"marker" in consumer.bodies, 20)
        consumer.stop()
        seen = {b[len(BODY) :].decode() for b in consumer.bodies if b != b"marker"}
        failed = {f"{failed_txn}.{i}" for i in range(10)}
        assert not failed & seen, f"delivered from the failed transaction: {failed & seen}"
        assert seen == {f"{txn}.{i}" for txn in committed for i in range(10)}
    finally:
        broker.stop()


def test_a_nacked_publish_is_never_delivered_to_a_live_consumer(small_disk: Path) -> None:
    broker = BrokerProcess(small_disk / "data", name="nackvis", extra_args=FULL).start()
    try:
        conn = pika.BlockingConnection(
            pika.ConnectionParameters(port=broker.port, blocked_connection_timeout=3)
        )
        ch = conn.channel()
        ch.queue_declare("nack.q", durable=True)
        consumer = Consumer(broker, "nack.q")
        ch.confirm_delivery()
        confirmed = 0
        nacked = None
        for i in range(5000):
            try:
                ch.basic_publish(
                    "", "nack.q", BODY + str(i).encode(), pika.BasicProperties(delivery_mode=2)
                )
            except pika.exceptions.NackError:
                nacked = i
                break
            confirmed += 1
        assert nacked is not None, "the disk never filled"
        with contextlib.suppress(pika.exceptions.AMQPError):
            conn.close()
        _marker_after_space_returns(broker, small_disk, "nack.q")
        wait_for("the marker delivered", lambda: b"marker" in consumer.bodies, 20)
        consumer.stop()
        seen = [b[len(BODY) :].decode() for b in consumer.bodies if b != b"marker"]
        assert str(nacked) not in seen, "a nacked publish was delivered"
        assert seen == [str(i) for i in range(confirmed)]
    finally:
        broker.stop()


def test_acks_of_a_failed_tx_commit_come_back_and_its_publishes_are_not_counted(
    small_disk: Path,
) -> None:
    data = small_disk / "data"
    broker = BrokerProcess(data, name="txacks", extra_args=FULL).start()
    try:
        conn = pika.BlockingConnection(pika.URLParameters(broker.url))
        ch = conn.channel()
        ch.queue_declare("acks.q", durable=True)
        ch.confirm_delivery()
        for i in range(20):
            ch.basic_publish("", "acks.q", f"m{i}".encode(), pika.BasicProperties(delivery_mode=2))
        tx = conn.channel()
        tx.tx_select()
        tags = []
        for _ in range(20):
            method, _props, _body = tx.basic_get("acks.q")
            assert method is not None
            tags.append(method.delivery_tag)
        tx.basic_ack(tags[-1], multiple=True)
        # The same transaction publishes more than the disk has room for: its write fails.
        big = b"B" * (8 * 1024 * 1024)
        tx.basic_publish("", "acks.q", big, pika.BasicProperties(delivery_mode=2))
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as failed:
            tx.tx_commit()
        assert failed.value.reply_code == 541
        # The acks are undone (the journal still has the messages) and the publish is gone.
        count = ch.queue_declare("acks.q", passive=True).method.message_count
        assert count == 20, f"{count} messages ready after a failed commit of 20 acks"
        conn.close()
        bodies = drain(broker.url, "acks.q")
        assert sorted(bodies) == sorted(f"m{i}".encode() for i in range(20))
    finally:
        broker.stop()


@pytest.mark.timeout(180)
def test_a_promoted_passive_takes_a_resend_of_what_its_failed_write_lost(
    small_disk: Path, tmp_path: Path
) -> None:
    """The passive admits a dedup key only once its own batch is durable: a key of a
    message its disk refused is never in its window, so once promoted it takes the
    re-send of that message instead of confirming it as a duplicate and dropping it."""
    # A long timeout: the active never confirms the message alone before it is killed.
    pair = PassiveOnSmallDisk(small_disk, tmp_path, "dedup-durable-pair", replication_timeout=30)
    active, passive = pair.active, pair.passive
    try:
        conn = opted_in(active)
        ch = conn.channel()
        ch.queue_declare("dd.q", durable=True)
        wait_for("passive ready", lambda: (status(passive) or {})["replication"]["ready"], 30)
        # Unconfirmed (no confirm mode): bigger than the passive's free space.
        big = b"D" * (8 * 1024 * 1024)
        ch.basic_publish("", "dd.q", big, pika.BasicProperties(delivery_mode=2, message_id="m1"))
        assert passive.proc is not None
        assert passive.proc.wait(timeout=30) == EXIT_JOURNAL_FAILED
        active.kill()  # m1 was never confirmed
        window = small_disk / "b" / "dedup.json"
        if window.exists():
            assert not any(key.endswith("\x00m1") for key in json.loads(window.read_text()))
        (small_disk / "filler").unlink()
        passive = pair.restart_passive()
        assert post_role(passive, "active", 2)[0] == 200
        conn = opted_in(passive)
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish(
            "", "dd.q", b"resent", pika.BasicProperties(delivery_mode=2, message_id="m1")
        )
        conn.close()
        assert drain(passive.url, "dd.q") == [b"resent"], "a confirmed re-send was swallowed"
    finally:
        pair.stop()
