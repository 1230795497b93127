"""kill -9 while clients publish: every confirmed message, every committed transaction survives."""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path

import aio_pika
import pika
import pytest
from aio_pika.abc import AbstractChannel

from twinmq.audit.records import AuditEvent, body_digest, segment_records
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.queues import drain as _drain

QUEUE = "crash.q"


async def _publish_until_killed(
    broker: BrokerProcess, kill_after: int, window: int = 64
) -> tuple[set[int], int]:
    """Publish persistent numbered messages with confirms until the broker dies.

    Returns the confirmed numbers and how many were sent. The broker is killed
    (SIGKILL) once `kill_after` confirms arrived, while publishes are in flight.
    """
    confirmed: set[int] = set()
    sent = 0
    conn = await aio_pika.connect(broker.url)
    channel: AbstractChannel = await conn.channel(publisher_confirms=True)
    await channel.declare_queue(QUEUE, durable=True)
    gate = asyncio.Semaphore(window)
    killed = asyncio.Event()

    async def one(n: int) -> None:
        try:
            await channel.default_exchange.publish(
                aio_pika.Message(str(n).encode(), delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                routing_key=QUEUE,
            )
            confirmed.add(n)
            if len(confirmed) >= kill_after and not killed.is_set():
                killed.set()
                broker.kill()
        except Exception:
            pass  # the broker died under this publish: it was not confirmed
        finally:
            gate.release()

    tasks = []
    while not killed.is_set():
        await gate.acquire()
        tasks.append(asyncio.create_task(one(sent)))
        sent += 1
    await asyncio.gather(*tasks, return_exceptions=True)
    with contextlib.suppress(Exception):
        await asyncio.wait_for(conn.close(), 2)
    return confirmed, sent


def _crash_cycle(data: Path, kill_after: int) -> tuple[set[int], list[int], int]:
    broker = BrokerProcess(data, name="crash").start()
    confirmed, sent = asyncio.run(_publish_until_killed(broker, kill_after))
    restarted = BrokerProcess(data, name="crash", port=broker.port).start()
    try:
        received = [int(b) for b in _drain(restarted.url, QUEUE)]
    finally:
        restarted.stop()
    return confirmed, received, sent


def test_confirmed_messages_survive_kill_9(tmp_path: Path) -> None:
    confirmed, received, sent = _crash_cycle(tmp_path / "data", kill_after=300)
    assert len(confirmed) >= 300
    lost = confirmed - set(received)
    assert not lost, f"{len(lost)} confirmed messages lost"
    assert len(received) == len(set(received)), "a message was recovered twice"
    assert set(received) <= set(range(sent)), "recovered a message nobody sent"


def test_the_audit_log_holds_every_confirm_sent_before_a_kill_9(tmp_path: Path) -> None:
    """The audit's proof needs the confirm records of what a killed broker confirmed: they
    reach the OS before the confirms go out (page cache survives kill -9)."""
    data = tmp_path / "data"
    broker = BrokerProcess(data, name="crash").start()
    confirmed, _ = asyncio.run(_publish_until_killed(broker, kill_after=300))
    recorded = set()
    for path in (data / "audit").glob("crash-e*.jsonl*"):
        for record in segment_records(path.read_bytes()):
            if record.event in (AuditEvent.CONFIRMED, AuditEvent.CONFIRMED_ALONE):
                recorded.add(record.digest)
    missing = sorted(n for n in confirmed if body_digest(str(n).encode()) not in recorded)
    assert not missing, f"{len(missing)} of {len(confirmed)} confirms have no audit record"


@pytest.mark.slow
def test_confirmed_messages_survive_repeated_kill_9(tmp_path: Path) -> None:
    rng = random.Random(7)
    for cycle in range(10):
        data = tmp_path / f"cycle{cycle}"
        confirmed, received, _ = _crash_cycle(data, kill_after=rng.randint(50, 800))
        assert not confirmed - set(received), f"cycle {cycle}: confirmed messages lost"


def test_committed_transactions_survive_kill_9_whole(tmp_path: Path) -> None:
    """Every committed transaction is recovered entirely; an uncommitted one not at all."""
    data = tmp_path / "data"
    broker = BrokerProcess(data, name="txcrash").start()
    conn = pika.BlockingConnection(pika.URLParameters(broker.url))
    ch = conn.channel()
    ch.queue_declare("tx.q", durable=True)
    ch.tx_select()
    committed = 0
    for batch in range(40):
        for i in range(10):
            ch.basic_publish(
                "", "tx.q", f"{batch}:{i}".encode(), pika.BasicProperties(delivery_mode=2)
            )
        ch.tx_commit()
        committed += 1
    # A transaction in flight when the broker dies: published, never committed.
    for i in range(10):
        ch.basic_publish("", "tx.q", f"open:{i}".encode(), pika.BasicProperties(delivery_mode=2))
    broker.kill()
    restarted = BrokerProcess(data, name="txcrash", port=broker.port).start()
    try:
        bodies = [b.decode() for b in _drain(restarted.url, "tx.q")]
    finally:
        restarted.stop()
    batches: dict[str, int] = {}
    for body in bodies:
        batch = body.split(":")[0]
        batches[batch] = batches.get(batch, 0) + 1
    assert "open" not in batches
    assert len(batches) == committed
    assert set(batches.values()) == {10}


def test_acked_messages_do_not_come_back_after_clean_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with BrokerProcess(data, name="ack") as broker:
        conn = pika.BlockingConnection(pika.URLParameters(broker.url))
        ch = conn.channel()
        ch.queue_declare("ack.q", durable=True)
        ch.confirm_delivery()
        for i in range(100):
            ch.basic_publish("", "ack.q", str(i).encode(), pika.BasicProperties(delivery_mode=2))
        for _ in range(60):
            method, _p, _b = ch.basic_get("ack.q")
            assert method is not None
            ch.basic_ack(method.delivery_tag)
        conn.close()
        port = broker.port
    with BrokerProcess(data, name="ack", port=port) as broker:
        assert [int(b) for b in _drain(broker.url, "ack.q")] == list(range(60, 100))


def test_transient_messages_do_not_survive_restart(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with BrokerProcess(data, name="transient") as broker:
        conn = pika.BlockingConnection(pika.URLParameters(broker.url))
        ch = conn.channel()
        ch.queue_declare("mixed.q", durable=True)
        ch.confirm_delivery()
        ch.basic_publish("", "mixed.q", b"persistent", pika.BasicProperties(delivery_mode=2))
        ch.basic_publish("", "mixed.q", b"transient", pika.BasicProperties(delivery_mode=1))
        conn.close()
        port = broker.port
    with BrokerProcess(data, name="transient", port=port) as broker:
        assert _drain(broker.url, "mixed.q") == [b"persistent"]


def test_a_restarted_active_never_reuses_replication_ids_of_its_previous_run(
    tmp_path: Path,
) -> None:
    """Batches reach the passive before this disk: ids handed out by a killed run may live
    on the passive only, so a restart in the same epoch starts past them."""
    from twinmq.broker.journal import Journal
    from twinmq.broker.server import RESTART_MID_GAP

    data = tmp_path / "data"
    for body in (b"first run", b"second run"):
        with BrokerProcess(data, name="ids") as broker:
            conn = pika.BlockingConnection(pika.URLParameters(broker.url))
            ch = conn.channel()
            ch.queue_declare("ids.q", durable=True)
            ch.confirm_delivery()
            ch.basic_publish("", "ids.q", body, pika.BasicProperties(delivery_mode=2))
            conn.close()
            broker.kill()
    journal = Journal(data / "journal")
    recovered = journal.open()
    asyncio.run(journal.close())
    (messages,) = recovered.messages.values()
    first, second = (m.mid for m in messages)
    assert second - first >= RESTART_MID_GAP
