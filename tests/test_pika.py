"""pika (blocking API) against a real broker process: the AMQP features clients rely on."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import pika
import pika.exceptions
import pytest
from pika.adapters.blocking_connection import BlockingChannel

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.waiting import wait_for

Connect = Callable[[], pika.BlockingConnection]


@pytest.fixture
def connect(broker: BrokerProcess) -> Iterator[Connect]:
    """Open connections to the module's broker; all are closed after the test."""
    opened: list[pika.BlockingConnection] = []

    def open_one() -> pika.BlockingConnection:
        conn = pika.BlockingConnection(pika.URLParameters(broker.url))
        opened.append(conn)
        return conn

    yield open_one
    for conn in opened:
        if conn.is_open:
            conn.close()


@pytest.fixture
def ch(connect: Connect) -> BlockingChannel:
    """A channel on a fresh connection."""
    return connect().channel()


def name(prefix: str) -> str:
    """A queue or exchange name unique to one test."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def drain(ch: BlockingChannel, queue: str, timeout: float = 0.5) -> list[bytes]:
    """basic.get (with ack) until the queue is empty."""
    out: list[bytes] = []
    deadline = time.monotonic() + timeout
    while True:
        method, _props, body = ch.basic_get(queue, auto_ack=True)
        if method is None:
            if out or time.monotonic() > deadline:
                return out
            time.sleep(0.01)
            continue
        out.append(body)


def test_publish_with_confirms_then_consume_and_ack(ch: BlockingChannel) -> None:
    q = name("q")
    ch.queue_declare(q, durable=True)
    ch.confirm_delivery()
    for i in range(50):
        ch.basic_publish("", q, str(i).encode(), pika.BasicProperties(delivery_mode=2))
    got = []
    for method, _props, body in ch.consume(q, inactivity_timeout=1):
        if method is None:
            break
        got.append(int(body))
        ch.basic_ack(method.delivery_tag)
    assert got == list(range(50))
    assert ch.queue_declare(q, passive=True).method.message_count == 0


def test_server_named_queue_and_passive_declare(ch: BlockingChannel) -> None:
    declared = ch.queue_declare("", exclusive=True)
    qname = declared.method.queue
    assert qname.startswith("amq.gen-")
    assert ch.queue_declare(qname, passive=True).method.queue == qname


def test_passive_declare_of_missing_queue_is_404(ch: BlockingChannel) -> None:
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare(name("missing"), passive=True)
    assert err.value.reply_code == 404


@pytest.mark.parametrize(
    ("etype", "key", "bindings", "expected"),
    [
        ("direct", "a", {"q1": "a", "q2": "b"}, {"q1"}),
        ("fanout", "whatever", {"q1": "", "q2": "x"}, {"q1", "q2"}),
        (
            "topic",
            "stock.usd.nyse",
            {"q1": "stock.#", "q2": "*.eur.*", "q3": "#.nyse"},
            {"q1", "q3"},
        ),
    ],
)
def test_exchange_types_route_to_the_right_queues(
    ch: BlockingChannel, etype: str, key: str, bindings: dict[str, str], expected: set[str]
) -> None:
    ex = name(etype)
    ch.exchange_declare(ex, etype)
    queues = {alias: name(alias) for alias in bindings}
    for alias, rk in bindings.items():
        ch.queue_declare(queues[alias], exclusive=True)
        ch.queue_bind(queues[alias], ex, rk)
    ch.basic_publish(ex, key, b"m")
    got = {alias for alias, q in queues.items() if drain(ch, q, 0.3)}
    assert got == expected


def test_headers_exchange_matches_all_and_any(ch: BlockingChannel) -> None:
    ex = name("hdr")
    ch.exchange_declare(ex, "headers")
    q_all, q_any = name("all"), name("any")
    for q in (q_all, q_any):
        ch.queue_declare(q, exclusive=True)
    ch.queue_bind(q_all, ex, "", {"x-match": "all", "a": 1, "b": "x"})
    ch.queue_bind(q_any, ex, "", {"x-match": "any", "a": 1, "b": "x"})
    ch.basic_publish(ex, "", b"one", pika.BasicProperties(headers={"a": 1}))
    ch.basic_publish(ex, "", b"both", pika.BasicProperties(headers={"a": 1, "b": "x"}))
    assert drain(ch, q_all) == [b"both"]
    assert drain(ch, q_any) == [b"one", b"both"]


def test_amq_builtin_exchanges_exist_and_reserved_names_are_refused(
    connect: Connect,
) -> None:
    ch = connect().channel()
    for ex in ("amq.direct", "amq.fanout", "amq.topic", "amq.headers", "amq.match"):
        ch.exchange_declare(ex, passive=True)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.exchange_declare("amq.mine", "direct")
    assert err.value.reply_code == 403


def test_mandatory_unroutable_publish_is_returned(ch: BlockingChannel) -> None:
    returned: list[bytes] = []
    ch.add_on_return_callback(lambda _ch, _m, _p, body: returned.append(body))
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.UnroutableError):
        ch.basic_publish("amq.direct", name("nobody"), b"lost?", mandatory=True)


def test_publish_to_missing_exchange_closes_channel_with_404_not_connection(
    connect: Connect,
) -> None:
    conn = connect()
    ch = conn.channel()
    ch.basic_publish(name("nope"), "k", b"x")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare(name("after"), exclusive=True)
    assert err.value.reply_code == 404
    assert conn.is_open
    conn.channel().queue_declare("", exclusive=True)


def test_redeclare_with_other_arguments_is_406(ch: BlockingChannel) -> None:
    q = name("q")
    ch.queue_declare(q, durable=False, auto_delete=True, arguments={"x-max-length": 5})
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare(q, durable=False, auto_delete=True, arguments={"x-max-length": 6})
    assert err.value.reply_code == 406


def test_exclusive_queue_is_locked_to_its_connection(connect: Connect) -> None:
    owner = connect().channel()
    q = name("excl")
    owner.queue_declare(q, exclusive=True)
    other = connect().channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        other.basic_consume(q, lambda *a: None)
    assert err.value.reply_code == 405


def test_exclusive_queue_is_deleted_with_its_connection(connect: Connect) -> None:
    conn = connect()
    q = name("excl")
    conn.channel().queue_declare(q, exclusive=True)
    conn.close()
    ch = connect().channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare(q, passive=True)
    assert err.value.reply_code == 404


def test_auto_delete_queue_goes_with_its_last_consumer(connect: Connect) -> None:
    ch = connect().channel()
    q = name("ad")
    ch.queue_declare(q, auto_delete=True)
    tag = ch.basic_consume(q, lambda *a: None)
    ch.basic_cancel(tag)
    check = connect().channel()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):
        check.queue_declare(q, passive=True)


def test_delete_if_unused_and_if_empty_are_enforced(connect: Connect) -> None:
    ch = connect().channel()
    q = name("del")
    ch.queue_declare(q)
    ch.basic_publish("", q, b"x")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_delete(q, if_empty=True)
    assert err.value.reply_code == 406
    ch = connect().channel()
    assert ch.queue_purge(q).method.message_count == 1
    ch.queue_delete(q, if_empty=True)


def test_queue_delete_cancels_consumers_with_notification(connect: Connect) -> None:
    conn = connect()
    ch = conn.channel()
    q = name("cancelled")
    ch.queue_declare(q)
    cancelled: list[str] = []
    tag = ch.basic_consume(q, lambda *a: None)
    ch.add_on_cancel_callback(lambda frame: cancelled.append(frame.method.consumer_tag))
    connect().channel().queue_delete(q)
    deadline = time.monotonic() + 5
    while not cancelled and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.1)
    assert cancelled == [tag]


def test_nack_with_requeue_redelivers_and_reject_without_requeue_drops(
    ch: BlockingChannel,
) -> None:
    q = name("nack")
    ch.queue_declare(q)
    ch.basic_publish("", q, b"m")
    method, _, _ = ch.basic_get(q)
    assert method is not None and not method.redelivered
    ch.basic_nack(method.delivery_tag, requeue=True)
    method, _, _ = ch.basic_get(q)
    assert method is not None and method.redelivered
    ch.basic_reject(method.delivery_tag, requeue=False)
    assert ch.basic_get(q)[0] is None


def test_ack_of_unknown_delivery_tag_is_406(ch: BlockingChannel) -> None:
    ch.basic_ack(999)
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare("", exclusive=True)
    assert err.value.reply_code == 406


def test_multiple_ack_settles_everything_up_to_the_tag(ch: BlockingChannel) -> None:
    q = name("multi")
    ch.queue_declare(q)
    for i in range(5):
        ch.basic_publish("", q, str(i).encode())
    tags = []
    for _ in range(5):
        method, _, _ = ch.basic_get(q)
        assert method is not None
        tags.append(method.delivery_tag)
    ch.basic_ack(tags[3], multiple=True)
    ch.basic_recover(requeue=True)
    assert drain(ch, q) == [b"4"]


def test_prefetch_limits_unacked_deliveries(connect: Connect) -> None:
    conn = connect()
    ch = conn.channel()
    q = name("qos")
    ch.queue_declare(q)
    for i in range(10):
        ch.basic_publish("", q, str(i).encode())
    ch.basic_qos(prefetch_count=3)
    got: list[int] = []
    ch.basic_consume(q, lambda _c, m, _p, _b: got.append(m.delivery_tag))
    conn.process_data_events(time_limit=0.5)
    assert len(got) == 3
    ch.basic_ack(got[-1], multiple=True)
    conn.process_data_events(time_limit=0.5)
    assert len(got) == 6


def test_transaction_commit_delivers_and_rollback_discards(ch: BlockingChannel) -> None:
    q = name("tx")
    ch.queue_declare(q)
    ch.tx_select()
    ch.basic_publish("", q, b"rolled-back")
    ch.tx_rollback()
    ch.basic_publish("", q, b"committed", pika.BasicProperties(delivery_mode=2))
    assert ch.queue_declare(q, passive=True).method.message_count == 0
    ch.tx_commit()
    assert drain(ch, q) == [b"committed"]


def test_acks_inside_a_rolled_back_transaction_stay_unacked(connect: Connect) -> None:
    ch = connect().channel()
    q = name("txack")
    ch.queue_declare(q)
    ch.basic_publish("", q, b"m")
    ch.tx_select()
    method, _, _ = ch.basic_get(q)
    assert method is not None
    ch.basic_ack(method.delivery_tag)
    ch.tx_rollback()
    ch.close()
    # The channel closed with the message unacked: it is back in the queue.
    check = connect().channel()
    assert check.queue_declare(q, passive=True).method.message_count == 1


def test_confirm_and_tx_modes_exclude_each_other(connect: Connect) -> None:
    ch = connect().channel()
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.tx_select()
    assert err.value.reply_code == 406


def test_per_queue_ttl_expires_and_dead_letters(ch: BlockingChannel) -> None:
    dlx, dead, q = name("dlx"), name("dead"), name("ttl")
    ch.exchange_declare(dlx, "fanout")
    ch.queue_declare(dead, exclusive=True)
    ch.queue_bind(dead, dlx)
    ch.queue_declare(
        q, exclusive=True, arguments={"x-message-ttl": 100, "x-dead-letter-exchange": dlx}
    )
    ch.basic_publish("", q, b"expiring")
    wait_for(
        "the message dead-lettered",
        lambda: ch.queue_declare(dead, passive=True).method.message_count == 1,
    )
    _method, props, body = ch.basic_get(dead, auto_ack=True)
    assert body == b"expiring"
    death = props.headers["x-death"][0]
    assert death["reason"] == "expired" and death["queue"] == q
    assert ch.queue_declare(q, passive=True).method.message_count == 0


def test_per_message_ttl_expires(ch: BlockingChannel) -> None:
    q = name("msgttl")
    ch.queue_declare(q, exclusive=True)
    ch.basic_publish("", q, b"short", pika.BasicProperties(expiration="50"))
    ch.basic_publish("", q, b"long", pika.BasicProperties(expiration="60000"))
    time.sleep(0.2)  # the message's own TTL is the condition under test
    assert drain(ch, q) == [b"long"]


def test_rejected_message_is_dead_lettered_with_routing_key_override(
    ch: BlockingChannel,
) -> None:
    dlx, dead, q = name("dlx"), name("dead"), name("src")
    ch.exchange_declare(dlx, "direct")
    ch.queue_declare(dead, exclusive=True)
    ch.queue_bind(dead, dlx, "failed")
    ch.queue_declare(
        q,
        exclusive=True,
        arguments={"x-dead-letter-exchange": dlx, "x-dead-letter-routing-key": "failed"},
    )
    ch.basic_publish("", q, b"bad")
    method, _, _ = ch.basic_get(q)
    assert method is not None
    ch.basic_reject(method.delivery_tag, requeue=False)
    assert drain(ch, dead) == [b"bad"]


def test_max_length_drops_the_oldest(ch: BlockingChannel) -> None:
    q = name("maxlen")
    ch.queue_declare(q, exclusive=True, arguments={"x-max-length": 3})
    for i in range(5):
        ch.basic_publish("", q, str(i).encode())
    assert drain(ch, q) == [b"2", b"3", b"4"]


def test_max_length_reject_publish_nacks_the_publisher(ch: BlockingChannel) -> None:
    q = name("reject")
    ch.queue_declare(
        q, exclusive=True, arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
    )
    ch.confirm_delivery()
    ch.basic_publish("", q, b"first")
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", q, b"second")
    assert drain(ch, q) == [b"first"]


def test_max_length_reject_publish_dlx_nacks_and_dead_letters_the_refused_message(
    ch: BlockingChannel,
) -> None:
    """RabbitMQ's reject-publish-dlx: the publisher is nacked, as with reject-publish, and
    the refused message is dead-lettered (x-death reason `maxlen`); a reject-publish queue
    with a dead-letter exchange dead-letters nothing it refuses."""
    dlx, dead = name("dlx"), name("dead")
    ch.exchange_declare(dlx, "fanout", auto_delete=True)
    ch.queue_declare(dead, exclusive=True)
    ch.queue_bind(dead, dlx)
    full = {"x-max-length": 1, "x-dead-letter-exchange": dlx}
    dlx_q, plain_q = name("rpdlx"), name("rp")
    ch.queue_declare(dlx_q, exclusive=True, arguments={**full, "x-overflow": "reject-publish-dlx"})
    ch.queue_declare(plain_q, exclusive=True, arguments={**full, "x-overflow": "reject-publish"})
    ch.confirm_delivery()
    for q in (dlx_q, plain_q):
        ch.basic_publish("", q, b"first")
        with pytest.raises(pika.exceptions.NackError):
            ch.basic_publish(
                "", q, b"refused by " + q.encode(), pika.BasicProperties(message_id="m")
            )
    assert drain(ch, dlx_q) == [b"first"] and drain(ch, plain_q) == [b"first"]
    method, props, body = ch.basic_get(dead, auto_ack=True)
    assert method is not None and body == b"refused by " + dlx_q.encode()
    assert props.message_id == "m"
    assert props.headers["x-first-death-reason"] == "maxlen"
    assert props.headers["x-first-death-queue"] == dlx_q
    assert ch.basic_get(dead)[0] is None


def test_queue_expires_when_unused(ch: BlockingChannel) -> None:
    q = name("expires")
    ch.queue_declare(q, arguments={"x-expires": 100})

    def gone() -> bool:
        probe = ch.connection.channel()
        try:
            probe.queue_declare(q, passive=True)
        except pika.exceptions.ChannelClosedByBroker:
            return True
        probe.close()
        return False

    wait_for("the queue gone", gone)


def test_invalid_queue_arguments_are_406(ch: BlockingChannel) -> None:
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as err:
        ch.queue_declare(name("bad"), arguments={"x-max-length": "many"})
    assert err.value.reply_code == 406


def test_large_message_spans_many_frames(ch: BlockingChannel) -> None:
    q = name("big")
    ch.queue_declare(q, exclusive=True)
    body = bytes(range(256)) * 4096  # 1 MiB, 8+ body frames
    ch.confirm_delivery()
    ch.basic_publish("", q, body)
    assert drain(ch, q) == [body]


def test_channel_flow_pauses_deliveries(connect: Connect) -> None:
    conn = connect()
    ch = conn.channel()
    q = name("flow")
    ch.queue_declare(q)
    got: list[bytes] = []
    ch.basic_consume(q, lambda _c, _m, _p, body: got.append(body), auto_ack=True)
    ch.flow(False)
    connect().channel().basic_publish("", q, b"held")
    conn.process_data_events(time_limit=0.3)
    assert got == []
    ch.flow(True)
    deadline = time.monotonic() + 5
    while not got and time.monotonic() < deadline:
        conn.process_data_events(time_limit=0.1)
    assert got == [b"held"]


def test_disk_alarm_blocks_publishers_with_connection_blocked(tmp_path: object) -> None:
    from pathlib import Path

    data = Path(str(tmp_path)) / "alarm"
    # A free-space limit no disk meets: the alarm is raised at once.
    with BrokerProcess(data, name="alarm", extra_args=["--disk-free-limit", str(10**18)]) as b:
        blocked: list[str] = []
        conn = pika.BlockingConnection(pika.URLParameters(b.url))
        conn.add_on_connection_blocked_callback(
            lambda _c, frame: blocked.append(frame.method.reason)
        )
        ch = conn.channel()
        ch.queue_declare("held", durable=True)
        # Publishing while the alarm is on blocks the connection, as in RabbitMQ.
        ch.basic_publish("", "held", b"x")
        deadline = time.monotonic() + 5
        while not blocked and time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.1)
        assert blocked == ["disk"]
        # A blocked connection is not read, so a graceful close would wait: the broker's
        # shutdown (connection.close 320) ends it instead.
