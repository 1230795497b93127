"""Recovery and dead-lettering of stored messages this broker would not accept today, sans I/O.

A journal is written directly (as another broker version might have left it),
then opened by a real `VirtualHost` on a real journal (`sansio.Harness`) with a
clock the test controls. Recovery must complete and keep every message.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from pathlib import Path

import pytest
from pamqp import commands
from poison import header_with_table, nested_table

from twinmq.broker.codec import decode_headers
from twinmq.broker.definitions import BindingDef, Definitions, ExchangeDef, QueueDef
from twinmq.broker.fieldtable import to_python
from twinmq.broker.journal import Journal, StoredMessage
from twinmq.broker.replication.catchup import capture
from twinmq.testing.rawamqp import encode
from twinmq.testing.sansio import Harness, ManualClock

NOW = ManualClock().now
UNWALKABLE = struct.pack(">HHQH", 60, 0, 4, 0x2000) + b"\x00\x00\xff\xff"  # table overruns
TOO_DEEP = header_with_table(nested_table(100), body_size=4)


def plant(directory: Path, definitions: Definitions, messages: list[StoredMessage]) -> None:
    """Write definitions and messages into a journal, as a broker would have."""

    async def go() -> None:
        journal = Journal(directory / "journal", fsync=False)
        journal.open()
        journal.save_definitions(definitions)
        await journal.sync(journal.append(messages))
        await journal.close()

    asyncio.run(go())


def dead_letter_topology(source_args: dict[str, object]) -> Definitions:
    return Definitions(
        exchanges=[ExchangeDef(name="dlx", type="fanout")],
        queues=[
            QueueDef(name="src", qid=1, arguments={"x-dead-letter-exchange": "dlx", **source_args}),
            QueueDef(name="dead", qid=2),
        ],
        bindings=[BindingDef(exchange="dlx", queue="dead", routing_key="")],
        next_qid=3,
    )


def test_messages_that_expired_while_down_are_dead_lettered_at_start(tmp_path: Path) -> None:
    # The dead-letter queue comes after the source in the definitions, and bindings last:
    # expiring before the topology is complete would drop the message.
    plain = struct.pack(">HHQH", 60, 0, 1, 0)
    plant(tmp_path, dead_letter_topology({}), [StoredMessage(1, 1, "", "src", plain, b"p", NOW)])
    harness = Harness(tmp_path)
    try:
        (entry,) = harness.vhost.queues["dead"].entries
        assert entry.message.body == b"p"
        deaths = to_python(decode_headers(entry.message.header))["x-death"]
        assert deaths[0]["queue"] == "src" and deaths[0]["reason"] == "expired"
    finally:
        harness.close()


def test_expired_messages_with_undecodable_headers_are_dead_lettered_unchanged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plant(
        tmp_path,
        dead_letter_topology({}),
        [
            StoredMessage(1, 1, "", "src", UNWALKABLE, b"body", NOW - 10),
            StoredMessage(2, 1, "", "src", TOO_DEEP, b"deep", NOW - 10),
        ],
    )
    with caplog.at_level(logging.ERROR):
        harness = Harness(tmp_path)
    try:
        dead = harness.vhost.queues["dead"]
        assert [(e.message.header, e.message.body) for e in dead.entries] == [
            (UNWALKABLE, b"body"),
            (TOO_DEEP, b"deep"),
        ]
        assert not harness.vhost.queues["src"].entries
        assert "2 recovered messages have content headers" in caplog.text
        assert caplog.text.count("dead-lettered with its header unchanged") == 2
        assert "Traceback" not in caplog.text
    finally:
        harness.close()


def test_a_message_basic_deliver_cannot_carry_is_held_aside_and_kept(tmp_path: Path) -> None:
    long_key = "k" * 300  # a routing key basic.deliver's short string cannot hold
    plain = struct.pack(">HHQH", 60, 0, 1, 0)
    plant(
        tmp_path,
        dead_letter_topology({}),
        [
            StoredMessage(1, 1, "", long_key, plain, b"x", None),
            StoredMessage(2, 1, "", "src", plain, b"y", None),
        ],
    )
    harness = Harness(tmp_path)
    try:
        vhost = harness.vhost
        src = vhost.queues["src"]
        assert [e.message.body for e in src.entries] == [b"y"]
        assert list(src.held_aside) == [1]
        # Kept: still live for catch-up and never settled in the journal.
        assert sorted(e.message.mid for e in capture(vhost.queues.values())[1]) == [1, 2]
        assert sorted(vhost.replication_snapshot()[1]) == [1, 2]
    finally:
        harness.close()
    harness = Harness(tmp_path)  # and it comes back after a restart
    try:
        assert list(harness.vhost.queues["src"].held_aside) == [1]
    finally:
        harness.close()


def test_a_queue_argument_refused_today_does_not_stop_recovery(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    plant(
        tmp_path,
        dead_letter_topology({"x-message-ttl": 2**40, "x-max-length": 5}),
        [StoredMessage(1, 1, "", "src", struct.pack(">HHQH", 60, 0, 1, 0), b"z", None)],
    )
    with caplog.at_level(logging.ERROR):
        harness = Harness(tmp_path)
    try:
        src = harness.vhost.queues["src"]
        assert [e.message.body for e in src.entries] == [b"z"]
        assert src.args.message_ttl is None and src.args.max_length == 5
        assert src.args.dead_letter_exchange == "dlx"
        assert "ignoring its argument 'x-message-ttl'" in caplog.text
    finally:
        harness.close()


def test_a_far_expiry_read_from_disk_arms_a_bounded_timer(tmp_path: Path) -> None:
    plain = struct.pack(">HHQH", 60, 0, 1, 0)
    plant(
        tmp_path,
        dead_letter_topology({}),
        [StoredMessage(1, 1, "", "src", plain, b"f", NOW + 1e15)],
    )
    harness = Harness(tmp_path)
    try:
        harness.clock.advance(2 * 86400)  # the daily re-arm fires and finds it alive
        assert [e.message.body for e in harness.vhost.queues["src"].entries] == [b"f"]
    finally:
        harness.close()


def test_a_delivery_that_fails_quarantines_that_message_and_the_consumer_carries_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A peer of another version replicated a message basic.deliver cannot carry (a routing
    # key over 255 bytes); this broker, promoted, tries to deliver it to a consumer.
    plant(tmp_path, dead_letter_topology({}), [])
    harness = Harness(tmp_path)
    try:
        plain = struct.pack(">HHQH", 60, 0, 1, 0)
        harness.vhost.apply_ops(
            [
                StoredMessage(1, 1, "", "k" * 300, plain, b"x", None),
                StoredMessage(2, 1, "", "src", plain, b"y", None),
            ]
        )
        peer = harness.connect()
        peer.handshake()
        peer.feed(encode(1, commands.Channel.Open()))
        with caplog.at_level(logging.ERROR):
            frames = peer.exchange(encode(1, commands.Basic.Consume(queue="src", no_ack=True)))
        deliveries = [f for _, f in frames if isinstance(f, commands.Basic.Deliver)]
        assert [d.routing_key for d in deliveries] == ["src"]
        assert not any(isinstance(f, commands.Connection.Close) for _, f in frames)
        src = harness.vhost.queues["src"]
        assert list(src.held_aside) == [1]
        assert [e.message.mid for e in capture(harness.vhost.queues.values())[1]] == [1]  # y no-ack
        assert "message 1 quarantined during delivery" in caplog.text
    finally:
        harness.close()
