"""Per-user permissions with RabbitMQ's semantics, with real clients (pika, aio-pika, kombu)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import aiormq.exceptions
import amqp.exceptions
import kombu
import pika
import pika.exceptions
import pytest

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.waiting import wait_for

USERS = ["admin", "producer", "consumer", "stranger"]
GRANTS: list[dict[str, str]] = [
    {"user": "admin", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
    # Declares and publishes to `orders` (through the default exchange), reads nothing.
    {
        "user": "producer",
        "vhost": "/",
        "configure": "^orders$",
        "write": "^(amq\\.default|orders)$",
        "read": "^$",
    },
    # Reads `orders`, changes nothing.
    {"user": "consumer", "vhost": "/", "configure": "^$", "write": "^$", "read": "^orders$"},
]  # fmt: skip  (stranger has no entry: it may not open the vhost)


def users_file(path: Path, grants: list[dict[str, str]]) -> None:
    users = [{"name": name, "password": f"{name}-pw"} for name in USERS]
    path.write_text(json.dumps({"users": users, "permissions": grants}))


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    root = tmp_path_factory.mktemp("permissions")
    users_file(root / "users.json", GRANTS)
    with BrokerProcess(
        root / "data", name="perm", extra_args=["--users-file", str(root / "users.json")]
    ).start() as started:
        admin = connect(started, "admin")
        admin.channel().queue_declare("orders", durable=True)
        admin.close()
        yield started


def connect(broker: BrokerProcess, user: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            host="127.0.0.1", port=broker.port,
            credentials=pika.PlainCredentials(user, f"{user}-pw"), connection_attempts=1,
        )
    )  # fmt: skip


def refused(broker: BrokerProcess, user: str, action: Callable[[Any], object]) -> str:
    """Run `action(channel)` as `user`; it must close the channel with 403; the reason."""
    conn = connect(broker, user)
    try:
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
            action(conn.channel())
        assert caught.value.reply_code == 403
        return str(caught.value.reply_text)
    finally:
        if conn.is_open:
            conn.close()


def publish(ch: Any, body: bytes = b"x", exchange: str = "", key: str = "orders") -> None:
    ch.confirm_delivery()
    ch.basic_publish(exchange, key, body, pika.BasicProperties(delivery_mode=2))


def test_a_user_without_permissions_on_the_vhost_may_not_open_it(broker: BrokerProcess) -> None:
    # pika's name for a connection.close in reply to connection.open.
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as caught:
        connect(broker, "stranger")
    assert "(530) \"NOT_ALLOWED - access to vhost '/' refused for user 'stranger'" in str(
        caught.value
    )


def test_the_producer_declares_and_publishes_within_its_grants_and_nothing_else(
    broker: BrokerProcess,
) -> None:
    conn = connect(broker, "producer")
    ch = conn.channel()
    ch.queue_declare("orders", durable=True)
    publish(ch, b"granted")
    conn.close()
    text = refused(broker, "producer", lambda ch: ch.basic_get("orders"))
    assert "read access to queue 'orders' in vhost '/' refused for user 'producer'" in text
    refused(broker, "producer", lambda ch: ch.queue_declare("billing"))
    refused(broker, "producer", lambda ch: ch.queue_purge("orders"))
    refused(broker, "producer", lambda ch: ch.queue_delete("billing"))
    refused(broker, "producer", lambda ch: ch.exchange_declare("events", "topic"))
    # A binding reads the exchange: the producer may not read amq.direct.
    refused(broker, "producer", lambda ch: ch.queue_bind("orders", "amq.direct", "k"))
    refused(broker, "producer", lambda ch: publish(ch, exchange="amq.topic"))


def test_the_consumer_reads_and_may_not_publish_declare_or_dead_letter(
    broker: BrokerProcess,
) -> None:
    conn = connect(broker, "producer")
    publish(conn.channel(), b"for-the-consumer")
    conn.close()
    conn = connect(broker, "consumer")
    ch = conn.channel()
    ch.queue_declare("orders", durable=True, passive=True)  # passive: no permission needed
    seen = []
    while (got := ch.basic_get("orders", auto_ack=True))[0] is not None:
        seen.append(got[2])
    assert b"for-the-consumer" in seen
    conn.close()
    text = refused(broker, "consumer", publish)
    assert "write access to exchange 'amq.default'" in text
    refused(broker, "consumer", lambda ch: ch.queue_declare("orders", durable=True))


def test_dead_lettering_to_an_exchange_needs_write_on_it(broker: BrokerProcess) -> None:
    # The producer may configure `orders`, not write to amq.fanout.
    dead_lettered = {"x-dead-letter-exchange": "amq.fanout"}
    text = refused(
        broker, "producer", lambda ch: ch.queue_declare("orders", arguments=dead_lettered)
    )
    assert "write access to exchange 'amq.fanout'" in text


def test_a_server_named_queue_needs_configure_on_amq_gen(broker: BrokerProcess) -> None:
    refused(broker, "producer", lambda ch: ch.queue_declare("", exclusive=True))
    conn = connect(broker, "admin")
    assert conn.channel().queue_declare("", exclusive=True).method.queue.startswith("amq.gen")
    conn.close()


def test_aio_pika_and_kombu_see_the_same_refusal(broker: BrokerProcess) -> None:
    url = f"amqp://consumer:consumer-pw@127.0.0.1:{broker.port}/"

    async def aio() -> None:
        connection = await aio_pika.connect(url)
        channel = await connection.channel(publisher_confirms=True)
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
            await channel.default_exchange.publish(aio_pika.Message(b"x"), "orders")
        await connection.close()

    asyncio.run(aio())
    with kombu.Connection(url) as conn:
        channel = conn.channel()
        with pytest.raises(amqp.exceptions.AccessRefused):
            kombu.Queue("kombu-q", channel=channel).declare()


def test_permissions_change_without_a_restart_and_a_broken_file_keeps_the_old_ones(
    tmp_path: Path,
) -> None:
    users = tmp_path / "users.json"
    users_file(users, GRANTS)
    with BrokerProcess(
        tmp_path / "data", name="reload", extra_args=["--users-file", str(users)]
    ).start() as broker:
        admin = connect(broker, "admin")
        admin.channel().queue_declare("orders", durable=True)
        admin.close()
        refused(broker, "consumer", publish)
        consumer = connect(broker, "consumer")  # open across the change: it sees it too
        grants = [*GRANTS[:2], {**GRANTS[2], "write": "^amq\\.default$"}]
        users_file(users, grants)

        def may_publish() -> bool:
            try:
                publish(consumer.channel(), b"now-allowed")
            except pika.exceptions.ChannelClosedByBroker:
                return False
            return True

        wait_for("the consumer may publish after the reload", may_publish, timeout=30)
        users.write_text("{not json")
        log = broker.log_path
        assert log is not None
        wait_for("the broken file logged", lambda: "does not load" in log.read_text())
        assert may_publish(), "a broken users file took the permissions away"
        consumer.close()
