"""The DR mirror between two real brokers (two sites), driven through pika.

One behaviour per test, after seed 004's scenarios in AMQP terms: the mirror
holds what the source holds (topology, messages, acks, purges, committed
transactions) once the source's replication queue is drained.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from mirrorsites import Sites, channel, mirror_status, publish, queues

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for

PERSISTENT = pika.BasicProperties(delivery_mode=2)


@pytest.fixture
def sites(tmp_path: Path) -> Iterator[Sites]:
    with Sites(tmp_path) as started:
        yield started


def test_a_declared_queue_and_its_messages_reach_the_mirror_with_their_arguments(
    sites: Sites,
) -> None:
    connection, ch = channel(sites.source)
    ch.queue_declare("orders", durable=True, arguments={"x-max-length": 1000})
    ch.confirm_delivery()
    for i in range(20):
        ch.basic_publish("", "orders", f"order-{i}".encode(), PERSISTENT)
    connection.close()
    sites.caught_up()
    mirrored = queues(sites.mirror)
    assert mirrored["orders"]["messages"] == 20
    assert drain(sites.mirror.url, "orders") == [f"order-{i}".encode() for i in range(20)]


def test_the_mirror_refuses_a_redeclare_with_other_arguments_as_the_source_would(
    sites: Sites,
) -> None:
    connection, ch = channel(sites.source)
    ch.queue_declare("limited", durable=True, arguments={"x-max-length": 5})
    connection.close()
    sites.caught_up()
    connection, ch = channel(sites.mirror)
    ch.queue_declare("limited", durable=True, arguments={"x-max-length": 5})  # equivalent
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        ch.queue_declare("limited", durable=True, arguments={"x-max-length": 6})
    assert refused.value.reply_code == 406
    connection.close()


def test_a_queue_redeclared_with_new_arguments_on_the_source_is_replaced_on_the_mirror(
    sites: Sites,
) -> None:
    connection, ch = channel(sites.source)
    ch.queue_declare("policy", durable=True, arguments={"x-max-length": 5})
    ch.confirm_delivery()
    ch.basic_publish("", "policy", b"old", PERSISTENT)
    ch.queue_delete("policy")
    ch.queue_declare("policy", durable=True, arguments={"x-max-length": 50})
    ch.basic_publish("", "policy", b"new", PERSISTENT)
    connection.close()
    sites.caught_up()
    connection, ch = channel(sites.mirror)
    ch.queue_declare("policy", durable=True, arguments={"x-max-length": 50})
    connection.close()
    assert drain(sites.mirror.url, "policy") == [b"new"]


def test_a_queue_deleted_at_the_source_is_deleted_on_the_mirror_with_its_messages(
    sites: Sites,
) -> None:
    publish(sites.source, "gone", [b"m1", b"m2", b"m3"])
    publish(sites.source, "kept", [b"k"])
    sites.caught_up()
    assert queues(sites.mirror)["gone"]["messages"] == 3
    connection, ch = channel(sites.source)
    ch.queue_delete("gone")
    connection.close()
    sites.caught_up()
    # As RabbitMQ's and Artemis' mirrors do: the user deleted the queue and what it held;
    # nothing of it is kept aside as an orphan on the mirror.
    mirrored = queues(sites.mirror)
    assert "gone" not in mirrored and mirrored["kept"]["messages"] == 1
    status = mirror_status(sites.mirror)
    assert status is not None and status["orphans"] == 0


def test_acked_messages_leave_the_mirror_and_the_others_stay(sites: Sites) -> None:
    connection, ch = channel(sites.source)
    ch.queue_declare("work", durable=True)
    ch.confirm_delivery()
    for i in range(10):
        ch.basic_publish("", "work", f"job-{i}".encode(), PERSISTENT)
    for _ in range(4):
        method, _, _ = ch.basic_get("work")
        assert method is not None
        ch.basic_ack(method.delivery_tag)
    connection.close()
    sites.caught_up()
    assert drain(sites.mirror.url, "work") == [f"job-{i}".encode() for i in range(4, 10)]


def test_a_message_in_several_queues_consumed_from_one_stays_in_the_others_on_the_mirror(
    sites: Sites,
) -> None:
    connection, ch = channel(sites.source)
    ch.exchange_declare("fan", "fanout", durable=True)
    for name in ("sub-1", "sub-2", "sub-3"):
        ch.queue_declare(name, durable=True)
        ch.queue_bind(name, "fan")
    ch.confirm_delivery()
    ch.basic_publish("fan", "", b"event", PERSISTENT)
    connection.close()
    assert drain(sites.source.url, "sub-1") == [b"event"]
    sites.caught_up()
    mirrored = queues(sites.mirror)
    assert [mirrored[n]["messages"] for n in ("sub-1", "sub-2", "sub-3")] == [0, 1, 1]


def test_exchanges_and_bindings_route_on_the_mirror_as_on_the_source(sites: Sites) -> None:
    connection, ch = channel(sites.source)
    ch.exchange_declare("events", "topic", durable=True)
    ch.queue_declare("eu-orders", durable=True)
    ch.queue_bind("eu-orders", "events", "orders.eu.*")
    ch.exchange_declare("doomed", "direct", durable=True)
    connection.close()
    sites.caught_up()
    connection, ch = channel(sites.mirror)
    ch.exchange_declare("doomed", "direct", passive=True)
    connection.close()
    connection, ch = channel(sites.source)
    ch.queue_unbind("eu-orders", "events", "orders.eu.*")
    ch.exchange_delete("doomed")
    connection.close()
    sites.caught_up()
    sites.promote_mirror(force=True)  # routing on the mirror: once it takes publishes
    connection, ch = channel(sites.mirror)
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish("events", "orders.eu.fr", b"unbound", PERSISTENT, mandatory=True)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as missing:
        ch.exchange_declare("doomed", "direct", passive=True)
    assert missing.value.reply_code == 404
    connection.close()


def test_a_dead_lettered_message_lands_in_the_same_queue_on_the_mirror(sites: Sites) -> None:
    connection, ch = channel(sites.source)
    ch.exchange_declare("dlx", "fanout", durable=True)
    ch.queue_declare("parking", durable=True)
    ch.queue_bind("parking", "dlx")
    ch.queue_declare("inbox", durable=True, arguments={"x-dead-letter-exchange": "dlx"})
    ch.confirm_delivery()
    ch.basic_publish("", "inbox", b"poison", PERSISTENT)
    method, _, _ = ch.basic_get("inbox")
    assert method is not None
    ch.basic_reject(method.delivery_tag, requeue=False)
    connection.close()
    sites.caught_up()
    mirrored = queues(sites.mirror)
    assert (mirrored["inbox"]["messages"], mirrored["parking"]["messages"]) == (0, 1)
    assert drain(sites.mirror.url, "parking") == [b"poison"]


def test_a_message_expired_on_the_source_is_gone_from_the_mirror(sites: Sites) -> None:
    connection, ch = channel(sites.source)
    ch.queue_declare("short-lived", durable=True)
    ch.queue_declare("long-lived", durable=True)
    ch.confirm_delivery()
    ch.basic_publish(
        "", "short-lived", b"ttl", pika.BasicProperties(delivery_mode=2, expiration="1500")
    )
    ch.basic_publish("", "long-lived", b"kept", PERSISTENT)
    connection.close()
    sites.caught_up()
    assert queues(sites.mirror)["short-lived"]["messages"] == 1
    wait_for(
        "expired on the source", lambda: queues(sites.source)["short-lived"]["messages"] == 0, 30
    )
    sites.caught_up()
    mirrored = queues(sites.mirror)
    assert (mirrored["short-lived"]["messages"], mirrored["long-lived"]["messages"]) == (0, 1)


def test_a_purge_on_the_source_empties_the_queue_on_the_mirror(sites: Sites) -> None:
    connection, ch = channel(sites.source)
    ch.queue_declare("purged", durable=True)
    ch.confirm_delivery()
    for i in range(50):
        ch.basic_publish("", "purged", str(i).encode(), PERSISTENT)
    sites.caught_up()
    assert queues(sites.mirror)["purged"]["messages"] == 50
    ch.queue_purge("purged")
    connection.close()
    sites.caught_up()
    assert queues(sites.mirror)["purged"]["messages"] == 0


def test_a_transaction_reaches_the_mirror_only_at_its_commit_and_all_at_once(
    sites: Sites,
) -> None:
    connection, ch = channel(sites.source)
    ch.queue_declare("ledger", durable=True)
    ch.tx_select()
    for i in range(30):
        ch.basic_publish("", "ledger", f"entry-{i}".encode(), PERSISTENT)
    # Something else commits meanwhile, so the mirror is known to be up to date.
    other_connection, other = channel(sites.source)
    other.queue_declare("bystander", durable=True)
    other_connection.close()
    sites.caught_up()
    assert queues(sites.mirror)["ledger"]["messages"] == 0
    ch.tx_commit()
    connection.close()
    sites.caught_up()
    assert drain(sites.mirror.url, "ledger") == [f"entry-{i}".encode() for i in range(30)]


def test_the_mirror_refuses_publishes_and_topology_changes_but_serves_readers(
    sites: Sites,
) -> None:
    publish(sites.source, "orders", [b"one", b"two"])
    sites.caught_up()
    connection, ch = channel(sites.mirror)
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        ch.basic_publish("", "orders", b"written on b", PERSISTENT)
    assert refused.value.reply_code == 403
    assert "site-b is a DR mirror (replica)" in refused.value.reply_text
    assert "publish to the source site" in refused.value.reply_text
    for change in (
        lambda ch: ch.queue_declare("local-to-b", durable=True),
        lambda ch: ch.queue_purge("orders"),
        lambda ch: ch.queue_delete("orders"),
        lambda ch: ch.exchange_declare("b-only", "fanout", durable=True),
    ):
        ch = connection.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            change(ch)
        assert refused.value.reply_code == 403
    ch = connection.channel()
    ch.queue_declare("orders", durable=True)  # equivalent: a consumer's usual declare
    ch.queue_declare("", exclusive=True)  # its own reply queue (never mirrored)
    connection.close()
    assert drain(sites.mirror.url, "orders") == [b"one", b"two"]
    assert "local-to-b" not in queues(sites.source)


def test_clients_can_neither_publish_into_nor_consume_from_the_replication_queue(
    sites: Sites,
) -> None:
    sites.source.stop()
    sites.source.start()  # recovery binds every queue to the default exchange
    _connection, ch = channel(sites.source)
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish("", "amq.twinmq.mirror", b"forged event", PERSISTENT, mandatory=True)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as locked:
        ch.basic_get("amq.twinmq.mirror")
    assert locked.value.reply_code == 405


def test_enabling_the_mirror_on_a_broker_with_messages_mirrors_them_then_streams(
    tmp_path: Path,
) -> None:
    with BrokerProcess(tmp_path / "a" / "data", name="site-a-before-dr") as before:
        connection, ch = channel(before)
        ch.exchange_declare("both", "fanout", durable=True)
        for name in ("old-1", "old-2"):
            ch.queue_declare(name, durable=True)
            ch.queue_bind(name, "both")
        ch.confirm_delivery()
        for i in range(500):
            ch.basic_publish("both", "", f"old-{i}".encode(), PERSISTENT)
        connection.close()
        assert len(drain_some(before, "old-1", 100)) == 100
    with Sites(tmp_path) as sites:  # the same data directory, now with --mirror-to
        assert len(drain_some(sites.source, "old-2", 50)) == 50  # acks of snapshot messages
        connection, ch = channel(sites.source)
        ch.confirm_delivery()
        ch.basic_publish("both", "", b"new", PERSISTENT)
        connection.close()
        sites.caught_up()
        old = [f"old-{i}".encode() for i in range(500)]
        assert drain(sites.mirror.url, "old-1") == [*old[100:], b"new"]
        assert drain(sites.mirror.url, "old-2") == [*old[50:], b"new"]


def drain_some(broker: BrokerProcess, queue: str, n: int) -> list[bytes]:
    """basic.get and ack `n` messages of `queue`."""
    connection, ch = channel(broker)
    got: list[bytes] = []
    try:
        for _ in range(n):
            method, _, body = ch.basic_get(queue)
            assert method is not None
            got.append(body)
            ch.basic_ack(method.delivery_tag)
    finally:
        connection.close()
    return got


def test_a_message_over_16_mib_is_mirrored_whole(sites: Sites) -> None:
    big = bytes(range(256)) * (17 * 4096)  # 17 MiB: more than the link's byte window
    connection, ch = channel(sites.source)
    ch.queue_declare("large", durable=True)
    ch.confirm_delivery()
    ch.basic_publish("", "large", big, PERSISTENT)
    connection.close()
    sites.caught_up()
    assert drain(sites.mirror.url, "large") == [big]
