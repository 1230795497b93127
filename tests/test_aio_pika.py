"""aio-pika (over aiormq) against a real broker process, used exactly as against RabbitMQ.

Each test is a coroutine run by `aio` on a fresh event loop; waits are for
deliveries or broker answers, with timeouts, never sleeps.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika
import aiormq
import pytest
from aio_pika import DeliveryMode, ExchangeType, Message
from aio_pika.abc import AbstractChannel, AbstractIncomingMessage, AbstractQueue
from aio_pika.exceptions import ChannelNotFoundEntity, ChannelPreconditionFailed, DeliveryError
from aiormq.exceptions import ChannelAccessRefused, ChannelLockedResource

from twinmq.testing.launcher import BrokerProcess

TIMEOUT = 20.0


def aio(test: Callable[..., Awaitable[None]]) -> Callable[..., None]:
    """Run an async test on its own event loop, with an overall timeout."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(test(*args, **kwargs), TIMEOUT))

    return run


def name(prefix: str) -> str:
    """A queue or exchange name unique to one test."""
    return f"aio.{prefix}.{uuid.uuid4().hex[:8]}"


@pytest.fixture
def url(broker: BrokerProcess) -> str:
    """The module broker's AMQP URL."""
    return broker.url


@asynccontextmanager
async def channel(url: str, **kwargs: Any) -> AsyncIterator[AbstractChannel]:
    """A channel on a connection of its own; both closed afterwards."""
    connection = await aio_pika.connect(url)
    try:
        yield await connection.channel(**kwargs)
    finally:
        await connection.close()


async def next_message(queue: AbstractQueue) -> AbstractIncomingMessage:
    """Consume from `queue` until one message arrives (5 s at most), then cancel."""
    async with queue.iterator() as messages, asyncio.timeout(5):
        return await messages.__anext__()


async def ready_count(ch: AbstractChannel, queue: str) -> int:
    """The queue's ready messages, from a passive declare."""
    declared = await ch.declare_queue(queue, passive=True)
    assert declared.declaration_result.message_count is not None
    return declared.declaration_result.message_count


async def get_bodies(queue: AbstractQueue) -> list[bytes]:
    """basic.get (auto-ack) until empty."""
    bodies = []
    while (message := await queue.get(no_ack=True, fail=False)) is not None:
        bodies.append(message.body)
    return bodies


# -- declarations ---------------------------------------------------------------------------


@aio
async def test_every_exchange_type_routes_by_its_own_rules(url: str) -> None:
    async with channel(url) as ch:
        direct = await ch.declare_exchange(name("direct"), ExchangeType.DIRECT, auto_delete=True)
        fanout = await ch.declare_exchange(name("fanout"), ExchangeType.FANOUT, auto_delete=True)
        topic = await ch.declare_exchange(name("topic"), ExchangeType.TOPIC, auto_delete=True)
        headers = await ch.declare_exchange(name("headers"), ExchangeType.HEADERS, auto_delete=True)
        q1 = await ch.declare_queue(exclusive=True)
        q2 = await ch.declare_queue(exclusive=True)
        await q1.bind(direct, "one")
        await q2.bind(direct, "two")
        await q1.bind(fanout)
        await q2.bind(fanout)
        await q1.bind(topic, "logs.*.error")
        await q2.bind(topic, "logs.#")
        await q1.bind(headers, arguments={"x-match": "all", "kind": "a", "size": 1})
        await q2.bind(headers, arguments={"x-match": "any", "kind": "a", "size": 2})

        await direct.publish(Message(b"d1"), "one")
        await direct.publish(Message(b"d2"), "two")
        await fanout.publish(Message(b"f"), "ignored")
        await topic.publish(Message(b"t-both"), "logs.db.error")
        await topic.publish(Message(b"t-q2"), "logs.db.info.verbose")
        await headers.publish(Message(b"h-both", headers={"kind": "a", "size": 1}), "")
        await headers.publish(Message(b"h-q2", headers={"kind": "b", "size": 2}), "")
        await headers.publish(Message(b"h-none", headers={"kind": "c"}), "", mandatory=False)

        assert await get_bodies(q1) == [b"d1", b"f", b"t-both", b"h-both"]
        assert await get_bodies(q2) == [b"d2", b"f", b"t-both", b"t-q2", b"h-both", b"h-q2"]


@aio
async def test_exchange_redeclared_with_another_type_is_precondition_failed(url: str) -> None:
    async with channel(url) as ch:
        exchange = name("ex")
        await ch.declare_exchange(exchange, ExchangeType.TOPIC, auto_delete=True)
        with pytest.raises(ChannelPreconditionFailed):
            await ch.declare_exchange(exchange, ExchangeType.FANOUT, auto_delete=True)


@aio
async def test_server_named_queue_gets_an_amq_gen_name(url: str) -> None:
    async with channel(url) as ch:
        queue = await ch.declare_queue(exclusive=True)
        assert queue.name.startswith("amq.gen-")
        await ch.default_exchange.publish(Message(b"x"), queue.name)
        assert await get_bodies(queue) == [b"x"]


@aio
async def test_durable_queue_outlives_the_connection_that_declared_it(url: str) -> None:
    queue_name = name("durable")
    async with channel(url) as ch:
        queue = await ch.declare_queue(queue_name, durable=True)
        await ch.default_exchange.publish(
            Message(b"kept", delivery_mode=DeliveryMode.PERSISTENT), queue_name
        )
    async with channel(url) as ch:
        queue = await ch.declare_queue(queue_name, durable=True)
        assert queue.declaration_result.message_count == 1
        assert await get_bodies(queue) == [b"kept"]
        await queue.delete(if_unused=False, if_empty=False)


@aio
async def test_exclusive_queue_is_locked_to_its_connection_and_dies_with_it(url: str) -> None:
    queue_name = name("exclusive")
    async with channel(url) as owner:
        await owner.declare_queue(queue_name, exclusive=True)
        async with channel(url) as other:
            with pytest.raises(ChannelLockedResource):
                await other.declare_queue(queue_name, passive=True)
    async with channel(url) as ch:
        with pytest.raises(ChannelNotFoundEntity):
            await ch.declare_queue(queue_name, passive=True)


@aio
async def test_auto_delete_queue_goes_with_its_last_consumer(url: str) -> None:
    queue_name = name("auto")
    async with channel(url) as ch:
        queue = await ch.declare_queue(queue_name, auto_delete=True)

        async def ignore(message: AbstractIncomingMessage) -> None:
            pass

        tag = await queue.consume(ignore)
        await ch.declare_queue(queue_name, passive=True)  # still there while consumed
        await queue.cancel(tag)
    async with channel(url) as ch:
        with pytest.raises(ChannelNotFoundEntity):
            await ch.declare_queue(queue_name, passive=True)


# -- publishing and confirms ----------------------------------------------------------------


@aio
async def test_publisher_confirms_ack_every_publish(url: str) -> None:
    async with channel(url, publisher_confirms=True) as ch:
        queue = await ch.declare_queue(name("confirms"), durable=True, auto_delete=True)
        confirms = await asyncio.gather(
            *(
                ch.default_exchange.publish(
                    Message(str(i).encode(), delivery_mode=DeliveryMode.PERSISTENT), queue.name
                )
                for i in range(200)
            )
        )
        assert all(isinstance(c, aiormq.spec.Basic.Ack) for c in confirms)
        assert await ready_count(ch, queue.name) == 200
        await queue.delete(if_unused=False, if_empty=False)


@aio
async def test_unroutable_mandatory_publish_is_returned(url: str) -> None:
    async with channel(url, publisher_confirms=True, on_return_raises=True) as ch:
        with pytest.raises(DeliveryError) as info:
            await ch.default_exchange.publish(
                Message(b"lost", message_id="m-1"), name("nowhere"), mandatory=True
            )
        frame = info.value.frame
        assert isinstance(frame, aiormq.spec.Basic.Return) and frame.reply_code == 312


@aio
async def test_publish_to_a_missing_exchange_closes_only_the_channel(url: str) -> None:
    connection = await aio_pika.connect(url)
    try:
        ch = await connection.channel()
        exchange = await ch.get_exchange(name("missing"), ensure=False)
        with pytest.raises(ChannelNotFoundEntity):
            await exchange.publish(Message(b"x"), "k")
        again = await connection.channel()
        queue = await again.declare_queue(exclusive=True)
        await again.default_exchange.publish(Message(b"fine"), queue.name)
        assert await get_bodies(queue) == [b"fine"]
    finally:
        await connection.close()


# -- consuming --------------------------------------------------------------------------------


@aio
async def test_consumed_and_acked_messages_are_gone(url: str) -> None:
    async with channel(url) as ch:
        queue = await ch.declare_queue(exclusive=True)
        for i in range(10):
            await ch.default_exchange.publish(Message(f"m{i}".encode()), queue.name)
        received = []
        async with queue.iterator() as messages:
            async for message in messages:
                received.append(message.body)
                await message.ack()
                if len(received) == 10:
                    break
        assert received == [f"m{i}".encode() for i in range(10)]
        assert await ready_count(ch, queue.name) == 0
        assert await queue.get(fail=False) is None


@aio
async def test_unacked_deliveries_come_back_redelivered_when_the_channel_closes(url: str) -> None:
    connection = await aio_pika.connect(url)
    try:
        consumer = await connection.channel()
        queue = await consumer.declare_queue(exclusive=True)
        await consumer.default_exchange.publish(Message(b"again"), queue.name)
        first = await next_message(queue)
        assert not first.redelivered
        await consumer.close()
        ch = await connection.channel()
        again = await (await ch.get_queue(queue.name)).get(no_ack=True)
        assert again.body == b"again" and again.redelivered
    finally:
        await connection.close()


@aio
async def test_basic_get_returns_one_message_then_nothing(url: str) -> None:
    async with channel(url) as ch:
        queue = await ch.declare_queue(exclusive=True)
        await ch.default_exchange.publish(Message(b"only", content_type="text/plain"), queue.name)
        message = await queue.get(no_ack=False)
        assert message.body == b"only" and message.content_type == "text/plain"
        assert await queue.get(fail=False) is None
        await message.ack()
        assert await ready_count(ch, queue.name) == 0


@pytest.mark.parametrize("settle", ["nack", "reject"])
@aio
async def test_requeued_message_is_redelivered(url: str, settle: str) -> None:
    async with channel(url) as ch:
        queue = await ch.declare_queue(exclusive=True)
        await ch.default_exchange.publish(Message(b"retry"), queue.name)
        message = await queue.get()
        await getattr(message, settle)(requeue=True)
        again = await queue.get(no_ack=True)
        assert again.body == b"retry" and again.redelivered


@pytest.mark.parametrize("settle", ["nack", "reject"])
@aio
async def test_message_settled_without_requeue_is_dropped(url: str, settle: str) -> None:
    async with channel(url) as ch:
        queue = await ch.declare_queue(exclusive=True)
        await ch.default_exchange.publish(Message(b"drop"), queue.name)
        await ch.default_exchange.publish(Message(b"next"), queue.name)
        message = await queue.get()
        await getattr(message, settle)(requeue=False)
        assert await get_bodies(queue) == [b"next"]


@aio
async def test_nack_multiple_requeues_every_earlier_delivery(url: str) -> None:
    async with channel(url) as ch:
        queue = await ch.declare_queue(exclusive=True)
        for body in (b"a", b"b", b"c"):
            await ch.default_exchange.publish(Message(body), queue.name)
        messages = [await queue.get() for _ in range(3)]
        await messages[1].nack(multiple=True, requeue=True)
        await messages[2].ack()
        assert await get_bodies(queue) == [b"a", b"b"]


@aio
async def test_prefetch_count_limits_unacked_deliveries(url: str) -> None:
    async with channel(url) as ch:
        await ch.set_qos(prefetch_count=2)
        queue = await ch.declare_queue(exclusive=True)
        for i in range(5):
            await ch.default_exchange.publish(Message(str(i).encode()), queue.name)
        received: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()
        await queue.consume(received.put)
        first = [await asyncio.wait_for(received.get(), 5) for _ in range(2)]
        # Deliveries happen as the consume is handled; the passive declare after it
        # shows what the broker held back.
        assert await ready_count(ch, queue.name) == 3
        assert received.empty()
        await first[0].ack()
        third = await asyncio.wait_for(received.get(), 5)
        assert third.body == b"2"
        assert await ready_count(ch, queue.name) == 2


# -- transactions ---------------------------------------------------------------------------


@aio
async def test_rolled_back_publishes_never_arrive_and_committed_ones_do(url: str) -> None:
    async with channel(url, publisher_confirms=False) as ch:
        queue = await ch.declare_queue(exclusive=True)
        tx = ch.transaction()
        await tx.select()
        await ch.default_exchange.publish(Message(b"rolled back"), queue.name)
        assert await ready_count(ch, queue.name) == 0  # held until commit
        await tx.rollback()
        await ch.default_exchange.publish(Message(b"committed"), queue.name)
        await tx.commit()
        assert await get_bodies(queue) == [b"committed"]


@aio
async def test_acks_inside_a_rolled_back_transaction_stay_unacked(url: str) -> None:
    connection = await aio_pika.connect(url)
    try:
        setup = await connection.channel()
        queue = await setup.declare_queue(exclusive=True)
        for body in (b"kept", b"acked"):
            await setup.default_exchange.publish(Message(body), queue.name)

        ch = await connection.channel(publisher_confirms=False)
        tx = ch.transaction()
        await tx.select()
        tx_queue = await ch.get_queue(queue.name)
        kept = await tx_queue.get()
        await kept.ack()
        await tx.rollback()
        acked = await tx_queue.get()
        await acked.ack()
        await tx.commit()
        await ch.close()  # the rolled-back ack never happened: "kept" comes back

        again = await queue.get(no_ack=True)
        assert again.body == b"kept" and again.redelivered
        assert await queue.get(fail=False) is None
    finally:
        await connection.close()


@aio
async def test_transaction_context_commits_on_success(url: str) -> None:
    async with channel(url, publisher_confirms=False) as ch:
        queue = await ch.declare_queue(exclusive=True)
        async with ch.transaction():
            await ch.default_exchange.publish(Message(b"one"), queue.name)
            await ch.default_exchange.publish(Message(b"two"), queue.name)
        assert await get_bodies(queue) == [b"one", b"two"]


# -- dead-lettering, TTL, length limits ---------------------------------------------------------


async def dead_letter_setup(
    ch: AbstractChannel, arguments: dict[str, Any]
) -> tuple[AbstractQueue, AbstractQueue]:
    """A source queue dead-lettering (with `arguments`) to a fanout DLX and its queue."""
    dlx = await ch.declare_exchange(name("dlx"), ExchangeType.FANOUT, auto_delete=True)
    dead = await ch.declare_queue(exclusive=True)
    await dead.bind(dlx)
    source = await ch.declare_queue(
        name("source"), exclusive=True, arguments={"x-dead-letter-exchange": dlx.name, **arguments}
    )
    return source, dead


def death(message: AbstractIncomingMessage) -> dict[str, Any]:
    """The newest x-death entry of a dead-lettered message."""
    deaths = message.headers["x-death"]
    assert isinstance(deaths, list) and deaths
    entry = deaths[0]
    assert isinstance(entry, dict)
    return entry


@aio
async def test_rejected_message_is_dead_lettered_with_x_death(url: str) -> None:
    async with channel(url) as ch:
        source, dead = await dead_letter_setup(ch, {})
        await ch.default_exchange.publish(Message(b"bad", headers={"k": "v"}), source.name)
        message = await source.get()
        await message.reject(requeue=False)
        dead_letter = await next_message(dead)
        assert dead_letter.body == b"bad" and dead_letter.headers["k"] == "v"
        entry = death(dead_letter)
        assert (entry["reason"], entry["queue"], entry["count"]) == ("rejected", source.name, 1)
        assert dead_letter.headers["x-first-death-reason"] == "rejected"


@aio
async def test_queue_ttl_expires_messages_to_the_dead_letter_exchange(url: str) -> None:
    async with channel(url) as ch:
        source, dead = await dead_letter_setup(ch, {"x-message-ttl": 50})
        await ch.default_exchange.publish(Message(b"stale"), source.name)
        dead_letter = await next_message(dead)
        assert dead_letter.body == b"stale"
        assert death(dead_letter)["reason"] == "expired"
        assert await ready_count(ch, source.name) == 0


@aio
async def test_per_message_expiration_is_honoured(url: str) -> None:
    async with channel(url) as ch:
        source, dead = await dead_letter_setup(ch, {})
        await ch.default_exchange.publish(
            Message(b"short", expiration=timedelta(milliseconds=30)), source.name
        )
        await ch.default_exchange.publish(Message(b"long-lived"), source.name)
        dead_letter = await next_message(dead)
        assert dead_letter.body == b"short" and death(dead_letter)["reason"] == "expired"
        assert dead_letter.expiration is None  # dropped when dead-lettered, as RabbitMQ does
        assert await get_bodies(source) == [b"long-lived"]


@aio
async def test_max_length_drops_the_oldest_to_the_dead_letter_exchange(url: str) -> None:
    async with channel(url) as ch:
        source, dead = await dead_letter_setup(ch, {"x-max-length": 2})
        for body in (b"1", b"2", b"3"):
            await ch.default_exchange.publish(Message(body), source.name)
        dropped = await next_message(dead)
        assert dropped.body == b"1" and death(dropped)["reason"] == "maxlen"
        assert await get_bodies(source) == [b"2", b"3"]


@aio
async def test_max_length_with_reject_publish_nacks_the_overflow(url: str) -> None:
    async with channel(url, publisher_confirms=True) as ch:
        queue = await ch.declare_queue(
            exclusive=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
        )
        await ch.default_exchange.publish(Message(b"fits"), queue.name)
        with pytest.raises(DeliveryError) as info:
            await ch.default_exchange.publish(Message(b"overflow"), queue.name)
        assert isinstance(info.value.frame, aiormq.spec.Basic.Nack)
        assert await get_bodies(queue) == [b"fits"]


@aio
async def test_max_length_bytes_counts_body_bytes(url: str) -> None:
    async with channel(url) as ch:
        queue = await ch.declare_queue(exclusive=True, arguments={"x-max-length-bytes": 10})
        for body in (b"12345", b"67890", b"abc"):
            await ch.default_exchange.publish(Message(body), queue.name)
        assert await get_bodies(queue) == [b"67890", b"abc"]


# -- content and consumers ----------------------------------------------------------------------


def rich_message(body: bytes) -> Message:
    """A message with every basic property set (expiration aside)."""
    return Message(
        body,
        headers={
            "str": "text",
            "int": 7,
            "big": 2**40,
            "neg": -3,
            "float": 1.5,
            "bool": True,
            "list": [1, "two", False],
            "table": {"nested": {"deep": "yes"}},
        },
        content_type="application/octet-stream",
        content_encoding="identity",
        delivery_mode=DeliveryMode.PERSISTENT,
        priority=5,
        correlation_id="corr-1",
        reply_to="replies",
        message_id=f"msg-{uuid.uuid4()}",
        timestamp=datetime(2024, 5, 17, 12, 30, tzinfo=UTC),
        type="order.created",
        user_id="guest",
        app_id="tests",
    )


PROPERTIES = (
    "content_type",
    "content_encoding",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "message_id",
    "timestamp",
    "type",
    "user_id",
    "app_id",
)


def assert_same_properties(got: AbstractIncomingMessage, sent: Message) -> None:
    """Every property and header arrived as sent."""
    for prop in PROPERTIES:
        assert getattr(got, prop) == getattr(sent, prop), prop
    for key, value in sent.headers.items():
        assert got.headers[key] == value, key


@aio
async def test_every_property_and_header_reaches_the_consumer_unchanged(url: str) -> None:
    async with channel(url) as ch:
        queue = await ch.declare_queue(exclusive=True)
        sent = rich_message(b"props")
        await ch.default_exchange.publish(sent, queue.name)
        got = await next_message(queue)
        assert got.body == b"props"
        assert_same_properties(got, sent)


@aio
async def test_dead_lettering_keeps_every_property_and_header(url: str) -> None:
    async with channel(url) as ch:
        source, dead = await dead_letter_setup(ch, {})
        sent = rich_message(b"props")
        await ch.default_exchange.publish(sent, source.name)
        await (await source.get()).reject(requeue=False)
        got = await next_message(dead)
        assert_same_properties(got, sent)
        assert death(got)["reason"] == "rejected"


@aio
async def test_publish_with_someone_elses_user_id_is_precondition_failed(url: str) -> None:
    async with channel(url) as ch:
        queue = await ch.declare_queue(exclusive=True)
        with pytest.raises(ChannelPreconditionFailed):
            await ch.default_exchange.publish(Message(b"x", user_id="admin"), queue.name)


@aio
async def test_large_message_spans_many_frames_intact(url: str) -> None:
    body = bytes(range(256)) * 4096  # 1 MiB: eight frames at the default frame_max
    async with channel(url) as ch:
        queue = await ch.declare_queue(exclusive=True)
        await ch.default_exchange.publish(Message(body), queue.name)
        assert (await next_message(queue)).body == body
        await ch.default_exchange.publish(Message(body), queue.name)
        assert (await queue.get(no_ack=True)).body == body


@aio
async def test_deleting_a_consumed_queue_cancels_its_consumer(url: str) -> None:
    connection = await aio_pika.connect(url)
    try:
        ch = await connection.channel()
        queue = await ch.declare_queue(exclusive=True)

        async def ignore(message: AbstractIncomingMessage) -> None:
            pass

        tag = await queue.consume(ignore)
        consumers = (await ch.get_underlay_channel()).consumers  # aiormq's live consumers
        assert tag in consumers
        other = await connection.channel()
        await other.queue_delete(queue.name)
        # A round trip on the consumer's channel: the basic.cancel came before its answer.
        await ch.set_qos(prefetch_count=0)
        assert tag not in consumers
    finally:
        await connection.close()


@aio
async def test_exclusive_consumer_shuts_out_other_consumers(url: str) -> None:
    async with channel(url) as ch:
        queue = await ch.declare_queue(name("excl-consumer"), auto_delete=True)

        async def ignore(message: AbstractIncomingMessage) -> None:
            pass

        await queue.consume(ignore, exclusive=True)
        async with channel(url) as other:
            other_queue = await other.get_queue(queue.name)
            with pytest.raises(ChannelAccessRefused):
                await other_queue.consume(ignore)


@aio
async def test_consumed_message_republished_with_its_message_id_is_delivered(url: str) -> None:
    # A common pattern: a worker forwards what it consumed, properties and all.
    async with channel(url) as ch:
        inbox = await ch.declare_queue(exclusive=True)
        outbox = await ch.declare_queue(exclusive=True)
        await ch.default_exchange.publish(
            Message(b"forward me", message_id=f"order-{uuid.uuid4()}"), inbox.name
        )
        received = await inbox.get(no_ack=True)
        await ch.default_exchange.publish(
            Message(received.body, message_id=received.message_id), outbox.name
        )
        assert await get_bodies(outbox) == [b"forward me"]


@aio
async def test_message_republished_to_its_own_queue_for_a_retry_is_delivered(url: str) -> None:
    # "Retry later" by moving a message to the tail: republish it as it is, then ack it.
    async with channel(url) as ch:
        queue = await ch.declare_queue(exclusive=True)
        await ch.default_exchange.publish(
            Message(b"try again", message_id=f"job-{uuid.uuid4()}"), queue.name
        )
        await ch.default_exchange.publish(Message(b"other job"), queue.name)
        first = await queue.get()
        await ch.default_exchange.publish(
            Message(first.body, message_id=first.message_id, headers={"x-retries": 1}),
            queue.name,
        )
        await first.ack()
        assert await get_bodies(queue) == [b"other job", b"try again"]
