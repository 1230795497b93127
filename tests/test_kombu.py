"""kombu over py-amqp against a real broker process, used exactly as against RabbitMQ.

py-amqp logs in with AMQPLAIN when the server offers it, so these tests also
cover the broker's AMQPLAIN path with a real client.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import amqp.exceptions
import kombu
import pytest
from kombu import Consumer, Exchange, Producer, Queue
from kombu.message import Message

from twinmq.testing.launcher import BrokerProcess


def name(prefix: str) -> str:
    """A queue or exchange name unique to one test."""
    return f"kombu.{prefix}.{uuid.uuid4().hex[:8]}"


@pytest.fixture
def url(broker: BrokerProcess) -> str:
    """The kombu URL of the module's broker ('//' is the vhost '/')."""
    return f"amqp://guest:guest@{broker.host}:{broker.port}//"


@pytest.fixture
def conn(url: str) -> Iterator[kombu.Connection]:
    """A plain py-amqp connection."""
    with kombu.Connection(url, transport="pyamqp") as connection:
        connection.connect()
        yield connection


@pytest.fixture
def confirming(url: str) -> Iterator[kombu.Connection]:
    """A connection whose channels use publisher confirms: each publish waits for its ack."""
    with kombu.Connection(
        url, transport="pyamqp", transport_options={"confirm_publish": True}
    ) as connection:
        connection.connect()
        yield connection


def collect(
    conn: kombu.Connection, queue: Queue, count: int, *, ack: bool = True, timeout: float = 5.0
) -> list[Message]:
    """Consume `count` messages from `queue` with drain_events; acked unless told otherwise."""
    received: list[Message] = []

    def on_message(body: Any, message: Message) -> None:
        received.append(message)
        if ack:
            message.ack()

    deadline = time.monotonic() + timeout
    with Consumer(conn, queues=[queue], callbacks=[on_message], accept=["json", "text/plain"]):
        while len(received) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{len(received)} of {count} messages in {timeout}s")
            try:
                conn.drain_events(timeout=remaining)
            except TimeoutError:
                continue
    return received


def get_bodies(channel: Any, queue: Queue) -> list[Any]:
    """basic.get (no-ack) until the queue is empty; decoded payloads."""
    bound = queue(channel)
    bodies = []
    while (message := bound.get(no_ack=True, accept=["json", "text/plain"])) is not None:
        bodies.append(message.payload)
    return bodies


def ready_count(channel: Any, queue_name: str) -> int:
    """The queue's ready messages, from a passive declare."""
    _, message_count, _ = channel.queue_declare(queue=queue_name, passive=True)
    return int(message_count)


# -- connecting --------------------------------------------------------------------------------


@pytest.mark.parametrize("login_method", ["AMQPLAIN", "PLAIN"])
def test_py_amqp_logs_in_with_either_mechanism(url: str, login_method: str) -> None:
    with kombu.Connection(url, transport="pyamqp", login_method=login_method) as connection:
        connection.connect()
        assert connection.connection.server_properties["product"] == "TwinMQ"
        with connection.SimpleQueue(name("login"), queue_opts={"exclusive": True}) as q:
            q.put("hello", serializer="json")
            assert q.get(timeout=5).payload == "hello"


def test_wrong_password_is_refused(broker: BrokerProcess) -> None:
    bad = f"amqp://guest:wrong@{broker.host}:{broker.port}//"
    with (
        kombu.Connection(bad, transport="pyamqp") as connection,
        pytest.raises(amqp.exceptions.AccessRefused),
    ):
        connection.connect()


# -- SimpleQueue -------------------------------------------------------------------------------


def test_simple_queue_round_trips_json_and_acks(conn: kombu.Connection) -> None:
    queue_name = name("simple")
    with conn.SimpleQueue(queue_name) as q:
        q.put({"order": 1, "items": ["a", "b"]})
        q.put({"order": 2, "items": []})
        first = q.get(timeout=5)
        assert first.payload == {"order": 1, "items": ["a", "b"]}
        first.ack()
        second = q.get(timeout=5)
        assert second.payload["order"] == 2
        second.ack()
        with pytest.raises(q.Empty):
            q.get_nowait()
    channel = conn.channel()
    assert ready_count(channel, queue_name) == 0
    channel.queue_delete(queue_name)


# -- declarations and routing ------------------------------------------------------------------


def test_every_exchange_type_routes_by_its_own_rules(conn: kombu.Connection) -> None:
    channel = conn.channel()
    direct = Exchange(name("direct"), "direct", auto_delete=True)
    fanout = Exchange(name("fanout"), "fanout", auto_delete=True)
    topic = Exchange(name("topic"), "topic", auto_delete=True)
    headers = Exchange(name("headers"), "headers", auto_delete=True)
    q1 = Queue(name("q1"), exclusive=True, channel=channel)
    q2 = Queue(name("q2"), exclusive=True, channel=channel)
    q1.declare()
    q2.declare()
    for queue, bindings in (
        (q1, [(direct, "one", None), (fanout, "", None), (topic, "logs.*.error", None)]),
        (q2, [(direct, "two", None), (fanout, "", None), (topic, "logs.#", None)]),
    ):
        for exchange, key, _ in bindings:
            exchange(channel).declare()
            queue.bind_to(exchange=exchange.name, routing_key=key)
    headers(channel).declare()
    q1.bind_to(exchange=headers.name, arguments={"x-match": "all", "kind": "a", "size": 1})
    q2.bind_to(exchange=headers.name, arguments={"x-match": "any", "kind": "a", "size": 2})

    producer = Producer(channel, serializer="json")
    producer.publish("d1", exchange=direct, routing_key="one")
    producer.publish("d2", exchange=direct, routing_key="two")
    producer.publish("f", exchange=fanout, routing_key="")
    producer.publish("t-both", exchange=topic, routing_key="logs.db.error")
    producer.publish("t-q2", exchange=topic, routing_key="logs.db.info.verbose")
    producer.publish("h-both", exchange=headers, headers={"kind": "a", "size": 1})
    producer.publish("h-q2", exchange=headers, headers={"kind": "b", "size": 2})

    assert get_bodies(channel, q1) == ["d1", "f", "t-both", "h-both"]
    assert get_bodies(channel, q2) == ["d2", "f", "t-both", "t-q2", "h-both", "h-q2"]


def test_server_named_queue_gets_an_amq_gen_name(conn: kombu.Connection) -> None:
    channel = conn.channel()
    queue = Queue("", exclusive=True, channel=channel)
    queue.declare()
    assert queue.name.startswith("amq.gen-")
    Producer(channel).publish("x", routing_key=queue.name, serializer="json")
    assert get_bodies(channel, queue) == ["x"]


def test_durable_queue_keeps_persistent_messages_across_connections(url: str) -> None:
    queue = Queue(name("durable"), durable=True, auto_delete=False)
    with kombu.Connection(url, transport="pyamqp") as first:
        Producer(first.channel()).publish(
            "kept", routing_key=queue.name, declare=[queue], delivery_mode=2, serializer="json"
        )
    with kombu.Connection(url, transport="pyamqp") as second:
        channel = second.channel()
        assert ready_count(channel, queue.name) == 1
        assert get_bodies(channel, queue) == ["kept"]
        queue(channel).delete()


def test_exclusive_queue_is_locked_to_its_connection(url: str, conn: kombu.Connection) -> None:
    queue = Queue(name("exclusive"), exclusive=True, channel=conn.channel())
    queue.declare()
    with (
        kombu.Connection(url, transport="pyamqp") as other,
        pytest.raises(amqp.exceptions.ResourceLocked),
    ):
        other.channel().queue_declare(queue=queue.name, passive=True)


def test_auto_delete_queue_goes_with_its_last_consumer(url: str, conn: kombu.Connection) -> None:
    queue = Queue(name("auto"), auto_delete=True)
    with Consumer(conn, queues=[queue], callbacks=[]):
        ready_count(conn.channel(), queue.name)  # declared and consumed
    with (
        kombu.Connection(url, transport="pyamqp") as other,
        pytest.raises(amqp.exceptions.NotFound),
    ):
        other.channel().queue_declare(queue=queue.name, passive=True)


# -- confirms and returns ----------------------------------------------------------------------


def test_publisher_confirms_every_publish_of_a_confirming_connection(
    confirming: kombu.Connection,
) -> None:
    queue = Queue(name("confirms"), durable=True, auto_delete=True)
    channel = confirming.channel()
    producer = Producer(channel, serializer="json")
    for i in range(100):
        # With confirm_publish, py-amqp returns only after the broker's basic.ack.
        producer.publish(i, routing_key=queue.name, declare=[queue], delivery_mode=2)
    assert ready_count(channel, queue.name) == 100
    queue(channel).delete()


def test_overflowing_publish_is_nacked(confirming: kombu.Connection) -> None:
    queue = Queue(
        name("nacked"),
        exclusive=True,
        queue_arguments={"x-max-length": 1, "x-overflow": "reject-publish"},
    )
    channel = confirming.channel()
    producer = Producer(channel, serializer="json")
    producer.publish("fits", routing_key=queue.name, declare=[queue])
    with pytest.raises(amqp.exceptions.MessageNacked):
        producer.publish("overflow", routing_key=queue.name)
    assert get_bodies(channel, queue) == ["fits"]


def test_unroutable_mandatory_publish_is_returned(confirming: kombu.Connection) -> None:
    returned: list[tuple[int, str, str]] = []

    def on_return(exc: Exception, exchange: str, routing_key: str, message: Any) -> None:
        returned.append((exc.reply_code, exchange, routing_key))  # type: ignore[attr-defined]

    producer = Producer(confirming.channel(), on_return=on_return, serializer="json")
    # The return precedes the confirm, so it has arrived when publish() returns.
    producer.publish("lost", routing_key=name("nowhere"), mandatory=True)
    assert returned == [(312, "", returned[0][2])]


def test_publish_to_a_missing_exchange_closes_only_the_channel(conn: kombu.Connection) -> None:
    channel = conn.channel()
    channel.basic_publish(amqp.Message("x"), exchange=name("missing"), routing_key="k")
    with pytest.raises(amqp.exceptions.NotFound):
        channel.queue_declare(queue="", exclusive=True)
    other = conn.channel()
    queue = Queue("", exclusive=True, channel=other)
    queue.declare()
    assert ready_count(other, queue.name) == 0


# -- consuming and settling --------------------------------------------------------------------


def test_consumed_and_acked_messages_are_gone(conn: kombu.Connection) -> None:
    channel = conn.channel()
    # Not exclusive: kombu makes exclusive queues auto-delete, and this one must
    # outlive its consumer to be inspected.
    queue = Queue(name("consume"), auto_delete=False, channel=channel)
    queue.declare()
    producer = Producer(channel, serializer="json")
    for i in range(10):
        producer.publish(i, routing_key=queue.name)
    messages = collect(conn, queue, 10)
    assert [m.payload for m in messages] == list(range(10))
    assert ready_count(channel, queue.name) == 0
    assert queue(channel).get() is None
    queue(channel).delete()


def test_basic_get_then_ack(conn: kombu.Connection) -> None:
    channel = conn.channel()
    queue = Queue(name("get"), exclusive=True, channel=channel)
    queue.declare()
    Producer(channel).publish("only", routing_key=queue.name, serializer="json")
    message = queue(channel).get(no_ack=False)
    assert message is not None and message.payload == "only"
    assert queue(channel).get() is None
    message.ack()
    assert ready_count(channel, queue.name) == 0


def test_requeued_message_is_redelivered(conn: kombu.Connection) -> None:
    channel = conn.channel()
    queue = Queue(name("requeue"), exclusive=True, channel=channel)
    queue.declare()
    Producer(channel).publish("retry", routing_key=queue.name, serializer="json")
    message = queue(channel).get()
    assert not message.delivery_info["redelivered"]
    message.requeue()  # basic.reject with requeue
    again = queue(channel).get(no_ack=True)
    assert again.payload == "retry" and again.delivery_info["redelivered"]


def test_rejected_message_without_requeue_is_dropped(conn: kombu.Connection) -> None:
    channel = conn.channel()
    queue = Queue(name("reject"), exclusive=True, channel=channel)
    queue.declare()
    producer = Producer(channel, serializer="json")
    producer.publish("drop", routing_key=queue.name)
    producer.publish("next", routing_key=queue.name)
    queue(channel).get().reject(requeue=False)
    assert get_bodies(channel, queue) == ["next"]


def test_unacked_messages_return_when_the_consumer_channel_closes(conn: kombu.Connection) -> None:
    setup = conn.channel()
    queue = Queue(name("unacked"), exclusive=True, channel=setup)
    queue.declare()
    Producer(setup).publish("again", routing_key=queue.name, serializer="json")
    consumer_channel = conn.channel()
    assert queue(consumer_channel).get(no_ack=False).payload == "again"
    consumer_channel.close()
    again = queue(setup).get(no_ack=True)
    assert again.payload == "again" and again.delivery_info["redelivered"]


def test_prefetch_count_limits_unacked_deliveries(conn: kombu.Connection) -> None:
    channel = conn.channel()
    queue = Queue(name("qos"), exclusive=True, channel=channel)
    queue.declare()
    producer = Producer(channel, serializer="json")
    for i in range(5):
        producer.publish(i, routing_key=queue.name)
    received: list[Message] = []
    deadline = time.monotonic() + 5
    with Consumer(
        channel, queues=[queue], callbacks=[lambda b, m: received.append(m)], prefetch_count=2
    ):
        while len(received) < 2 and time.monotonic() < deadline:
            conn.drain_events(timeout=1)
        # The declare-ok is answered after the broker handled the consume: what it
        # held back is still ready.
        assert ready_count(channel, queue.name) == 3
        assert len(received) == 2
        received[0].ack()
        while len(received) < 3 and time.monotonic() < deadline:
            conn.drain_events(timeout=1)
        assert [m.payload for m in received] == [0, 1, 2]
        assert ready_count(channel, queue.name) == 2


# -- transactions ------------------------------------------------------------------------------


def test_rolled_back_publishes_never_arrive_and_committed_ones_do(conn: kombu.Connection) -> None:
    channel = conn.channel()
    queue = Queue(name("tx"), exclusive=True, channel=channel)
    queue.declare()
    channel.tx_select()
    producer = Producer(channel, serializer="json")
    producer.publish("rolled back", routing_key=queue.name)
    channel.tx_rollback()
    producer.publish("committed", routing_key=queue.name)
    assert ready_count(channel, queue.name) == 0  # nothing before the commit
    channel.tx_commit()
    assert get_bodies(channel, queue) == ["committed"]


def test_acks_inside_a_rolled_back_transaction_stay_unacked(conn: kombu.Connection) -> None:
    setup = conn.channel()
    queue = Queue(name("tx-ack"), exclusive=True, channel=setup)
    queue.declare()
    producer = Producer(setup, serializer="json")
    producer.publish("kept", routing_key=queue.name)
    producer.publish("acked", routing_key=queue.name)

    tx = conn.channel()
    tx.tx_select()
    kept = queue(tx).get(no_ack=False)
    kept.ack()
    tx.tx_rollback()
    acked = queue(tx).get(no_ack=False)
    acked.ack()
    tx.tx_commit()
    tx.close()  # "kept" was never acked after all: it comes back

    again = queue(setup).get(no_ack=True)
    assert again.payload == "kept" and again.delivery_info["redelivered"]
    assert queue(setup).get() is None


# -- dead-lettering, TTL, length limits --------------------------------------------------------


def dead_letter_setup(channel: Any, arguments: dict[str, Any]) -> tuple[Queue, Queue]:
    """A source queue dead-lettering (with `arguments`) into a fanout DLX and its queue."""
    dlx = Exchange(name("dlx"), "fanout", auto_delete=True, channel=channel)
    dlx.declare()
    dead = Queue(name("dead"), exchange=dlx, exclusive=True, channel=channel)
    dead.declare()
    source = Queue(
        name("source"),
        exclusive=True,
        queue_arguments={"x-dead-letter-exchange": dlx.name, **arguments},
        channel=channel,
    )
    source.declare()
    return source, dead


def death(message: Message) -> dict[str, Any]:
    """The newest x-death entry of a dead-lettered message."""
    deaths = message.headers["x-death"]
    assert isinstance(deaths, list) and deaths
    entry: dict[str, Any] = deaths[0]
    return entry


def test_rejected_message_is_dead_lettered_with_x_death(conn: kombu.Connection) -> None:
    channel = conn.channel()
    source, dead = dead_letter_setup(channel, {})
    Producer(channel).publish("bad", routing_key=source.name, serializer="json")
    source(channel).get().reject(requeue=False)
    [dead_letter] = collect(conn, dead, 1)
    assert dead_letter.payload == "bad"
    entry = death(dead_letter)
    assert (entry["reason"], entry["queue"], entry["count"]) == ("rejected", source.name, 1)


def test_queue_ttl_expires_messages_to_the_dead_letter_exchange(conn: kombu.Connection) -> None:
    channel = conn.channel()
    source, dead = dead_letter_setup(channel, {"x-message-ttl": 50})
    Producer(channel).publish("stale", routing_key=source.name, serializer="json")
    [dead_letter] = collect(conn, dead, 1)
    assert dead_letter.payload == "stale" and death(dead_letter)["reason"] == "expired"
    assert ready_count(channel, source.name) == 0


def test_per_message_expiration_is_honoured(conn: kombu.Connection) -> None:
    channel = conn.channel()
    source, dead = dead_letter_setup(channel, {})
    producer = Producer(channel, serializer="json")
    producer.publish("short", routing_key=source.name, expiration=0.03)
    producer.publish("long-lived", routing_key=source.name)
    [dead_letter] = collect(conn, dead, 1)
    assert dead_letter.payload == "short" and death(dead_letter)["reason"] == "expired"
    assert get_bodies(channel, source) == ["long-lived"]


def test_max_length_drops_the_oldest_to_the_dead_letter_exchange(conn: kombu.Connection) -> None:
    channel = conn.channel()
    source, dead = dead_letter_setup(channel, {"x-max-length": 2})
    producer = Producer(channel, serializer="json")
    for body in ("1", "2", "3"):
        producer.publish(body, routing_key=source.name)
    [dropped] = collect(conn, dead, 1)
    assert dropped.payload == "1" and death(dropped)["reason"] == "maxlen"
    assert get_bodies(channel, source) == ["2", "3"]


# -- content and consumers ---------------------------------------------------------------------


def test_large_message_spans_many_frames_intact(conn: kombu.Connection) -> None:
    body = bytes(range(256)) * 4096  # 1 MiB: eight frames at the default frame_max
    channel = conn.channel()
    queue = Queue(name("large"), exclusive=True, channel=channel)
    queue.declare()
    producer = Producer(channel)
    producer.publish(body, routing_key=queue.name, content_type="application/octet-stream")
    producer.publish(body, routing_key=queue.name, content_type="application/octet-stream")
    message = queue(channel).get(no_ack=True, accept=["application/octet-stream"])
    assert message.body == body
    consumer = Consumer(channel, queues=[queue], accept=["application/octet-stream"])
    got: list[bytes] = []
    consumer.register_callback(lambda b, m: got.append(m.body))
    with consumer:
        conn.drain_events(timeout=5)
    assert got == [body]


def test_deleting_a_consumed_queue_cancels_its_consumer(conn: kombu.Connection) -> None:
    channel = conn.channel()
    queue = Queue(name("cancelled"), exclusive=True, channel=channel)
    queue.declare()
    consumer = Consumer(channel, queues=[queue], callbacks=[])
    consumer.consume()
    [tag] = consumer._active_tags.values()
    # py-amqp turns the broker's basic.cancel into ConsumerCancelled for a consumer
    # without an on_cancel callback; it arrives while waiting for the delete-ok.
    with pytest.raises(amqp.exceptions.ConsumerCancelled):
        conn.channel().queue_delete(queue.name)
        conn.drain_events(timeout=5)
    assert tag not in channel.callbacks
