"""Duplicate detection never swallows a message: only a durable, enqueued message's id counts.

A publish that was returned (unroutable), nacked (a full queue), rolled back or
whose transaction failed leaves no id in the window, so its re-send is a new
message: enqueued, confirmed and consumable, on one broker and across a failover.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pika
import pika.exceptions
import pytest
from aio_pika.exceptions import DeliveryError

from twinmq.client import ReliablePublisher
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair
from twinmq.testing.queues import drain, opted_in

PERSISTENT = 2


def _props(message_id: str) -> pika.BasicProperties:
    return pika.BasicProperties(delivery_mode=PERSISTENT, message_id=message_id)


def _full_queue(ch: pika.adapters.blocking_connection.BlockingChannel, name: str) -> None:
    """A durable queue that holds one message and nacks publishes beyond it."""
    ch.queue_declare(
        name, durable=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
    )


def test_a_resend_after_basic_return_is_enqueued(fresh_broker: BrokerProcess) -> None:
    conn = opted_in(fresh_broker)
    ch = conn.channel()
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish("", "later.q", b"first try", _props("r-1"), mandatory=True)
    ch.queue_declare("later.q", durable=True)
    ch.basic_publish("", "later.q", b"re-sent", _props("r-1"), mandatory=True)
    conn.close()
    assert drain(fresh_broker.url, "later.q") == [b"re-sent"]


def test_a_resend_after_a_reject_publish_nack_is_enqueued(fresh_broker: BrokerProcess) -> None:
    conn = opted_in(fresh_broker)
    ch = conn.channel()
    _full_queue(ch, "tight.q")
    ch.confirm_delivery()
    ch.basic_publish("", "tight.q", b"a", _props("n-a"))
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", "tight.q", b"b", _props("n-b"))
    assert drain(fresh_broker.url, "tight.q") == [b"a"]  # room again
    ch.basic_publish("", "tight.q", b"b", _props("n-b"))
    conn.close()
    assert drain(fresh_broker.url, "tight.q") == [b"b"]


def test_a_resend_after_one_queue_refused_its_copy_reaches_that_queue(
    fresh_broker: BrokerProcess,
) -> None:
    conn = opted_in(fresh_broker)
    ch = conn.channel()
    ch.exchange_declare("split", "fanout")
    _full_queue(ch, "split.full")
    ch.queue_declare("split.free", durable=True)
    for queue in ("split.full", "split.free"):
        ch.queue_bind(queue, "split")
    ch.basic_publish("", "split.full", b"filler", _props("s-0"))
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.NackError):  # refused by one queue: taken by none
        ch.basic_publish("split", "", b"s", _props("s-1"))
    assert drain(fresh_broker.url, "split.full") == [b"filler"]  # room again
    ch.basic_publish("split", "", b"s", _props("s-1"))  # not swallowed as a duplicate
    conn.close()
    assert drain(fresh_broker.url, "split.full") == [b"s"]
    assert drain(fresh_broker.url, "split.free") == [b"s"]


def test_a_resend_after_a_rollback_is_enqueued(fresh_broker: BrokerProcess) -> None:
    conn = opted_in(fresh_broker)
    ch = conn.channel()
    ch.queue_declare("tx.q", durable=True)
    ch.tx_select()
    ch.basic_publish("", "tx.q", b"rolled back", _props("t-1"))
    ch.tx_rollback()
    ch.basic_publish("", "tx.q", b"committed", _props("t-1"))
    ch.tx_commit()
    # and the committed one is what a later re-send is measured against
    ch.basic_publish("", "tx.q", b"duplicate", _props("t-1"))
    ch.tx_commit()
    conn.close()
    assert drain(fresh_broker.url, "tx.q") == [b"committed"]


def test_reliable_publisher_resend_after_a_nack_is_enqueued(fresh_broker: BrokerProcess) -> None:
    setup = pika.BlockingConnection(pika.URLParameters(fresh_broker.url))
    _full_queue(setup.channel(), "client.q")
    setup.close()

    async def run() -> None:
        publisher = ReliablePublisher([fresh_broker.url])
        try:
            await publisher.publish(b"a", "client.q", message_id="c-a")
            with pytest.raises(DeliveryError):
                await publisher.publish(b"b", "client.q", message_id="c-b")
            assert await asyncio.to_thread(drain, fresh_broker.url, "client.q") == [b"a"]
            await publisher.publish(b"b", "client.q", message_id="c-b")
        finally:
            await publisher.close()

    asyncio.run(run())
    assert drain(fresh_broker.url, "client.q") == [b"b"]


@pytest.mark.timeout(90)
def test_a_resend_after_a_nack_is_enqueued_on_the_promoted_passive(tmp_path: Path) -> None:
    with Pair(tmp_path) as pair:
        conn = opted_in(pair.active)
        ch = conn.channel()
        _full_queue(ch, "pair.q")
        ch.confirm_delivery()
        ch.basic_publish("", "pair.q", b"a", _props("p-a"))
        with pytest.raises(pika.exceptions.NackError):
            ch.basic_publish("", "pair.q", b"b", _props("p-b"))
        # The returned one too: unroutable on the active, re-sent to the promoted passive.
        with pytest.raises(pika.exceptions.UnroutableError):
            ch.basic_publish("", "late.q", b"c", _props("p-c"), mandatory=True)
        conn.close()
        pair.wait_healthy()
        pair.active.kill()
        pair.promote_passive()
        promoted = pair.active
        assert drain(promoted.url, "pair.q") == [b"a"]
        conn = opted_in(promoted)
        ch = conn.channel()
        ch.confirm_delivery()
        ch.queue_declare("late.q", durable=True)
        ch.basic_publish("", "pair.q", b"b", _props("p-b"))
        ch.basic_publish("", "late.q", b"c", _props("p-c"), mandatory=True)
        conn.close()
        assert drain(promoted.url, "pair.q") == [b"b"]
        assert drain(promoted.url, "late.q") == [b"c"]
