"""Bad input over real sockets: the broker answers as RabbitMQ does and keeps serving.

Each raw-socket test ends by running a pika round trip on the same broker, so
a bad connection that wedged or crashed the broker fails the test that caused it.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator

import pika
import pytest
from pamqp import commands
from pamqp.body import ContentBody
from pamqp.heartbeat import Heartbeat
from pika.exceptions import ChannelClosedByBroker

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.rawamqp import (
    PROTOCOL_HEADER,
    RawClient,
    connections,
    content,
    encode,
    handshake_frames,
    pika_round_trip,
    raw_frame,
)
from twinmq.testing.waiting import wait_for


@pytest.fixture
def raw(broker: BrokerProcess) -> Iterator[RawClient]:
    """A raw socket to the module's broker; afterwards, pika must still get through."""
    with RawClient(broker.host, broker.port) as client:
        yield client
    pika_round_trip(broker.url)


@pytest.fixture
def opened(raw: RawClient) -> RawClient:
    """A raw client past the handshake, with channel 1 open."""
    raw.handshake()
    raw.open_channel(1)
    return raw


# -- the protocol header and the frame layer -------------------------------------------------


@pytest.mark.parametrize(
    "header",
    [
        b"AMQP\x00\x00\x08\x00",  # AMQP 0-8
        b"AMQP\x01\x01\x00\x0a",  # AMQP 1.0
        b"AMQP\x00\x00\x09\x00",  # wrong revision
        b"GET / HTTP/1.1\r\n\r\n",  # not AMQP at all
    ],
    ids=["amqp-0-8", "amqp-1-0", "amqp-0-9-0", "http"],
)
def test_wrong_protocol_header_is_answered_with_ours_then_closed(
    raw: RawClient, header: bytes
) -> None:
    raw.send(header)
    assert raw.wait_closed() == PROTOCOL_HEADER


def test_oversize_frame_closes_the_connection_with_frame_error(raw: RawClient) -> None:
    tune = raw.handshake(frame_max=8192)
    assert tune.frame_max >= 8192
    # Only the frame header: the broker must refuse on the declared size alone.
    raw.send(b"\x01\x00\x01" + (8192).to_bytes(4, "big"))
    close = raw.expect_connection_close(501)
    assert "frame_max" in close.reply_text
    raw.wait_closed()


def test_oversize_frame_before_tune_closes_the_connection(raw: RawClient) -> None:
    raw.send(PROTOCOL_HEADER)
    raw.expect(commands.Connection.Start, 0)
    raw.send(b"\x01\x00\x00" + (1 << 20).to_bytes(4, "big"))
    raw.expect_connection_close(501)
    raw.wait_closed()


def test_frame_without_frame_end_closes_the_connection_with_frame_error(
    opened: RawClient,
) -> None:
    qos = encode(1, commands.Basic.Qos(prefetch_count=1))
    opened.send(qos[:-1] + b"\x00")
    close = opened.expect_connection_close(501)
    assert "frame-end" in close.reply_text
    opened.wait_closed()


def test_unknown_frame_type_closes_the_connection_with_frame_error(opened: RawClient) -> None:
    opened.send(raw_frame(7, 1, b"\x00\x00"))
    opened.expect_connection_close(501)
    opened.wait_closed()


def test_method_on_unopened_channel_closes_the_connection_with_channel_error(
    opened: RawClient,
) -> None:
    opened.send_frame(5, commands.Queue.Declare(queue="never-declared"))
    opened.expect_connection_close(504)
    opened.wait_closed()


def test_content_body_without_header_closes_the_connection_with_unexpected_frame(
    opened: RawClient,
) -> None:
    opened.send_frame(1, ContentBody(b"orphan"))
    opened.expect_connection_close(505)
    opened.wait_closed()


def test_content_header_without_publish_closes_the_connection_with_unexpected_frame(
    opened: RawClient,
) -> None:
    opened.send(content(1, b"orphan"))
    opened.expect_connection_close(505)
    opened.wait_closed()


def test_method_where_content_was_expected_closes_the_connection_with_unexpected_frame(
    opened: RawClient,
) -> None:
    opened.send_frame(1, commands.Basic.Publish(exchange="", routing_key="nowhere"))
    opened.send_frame(1, commands.Basic.Qos(prefetch_count=1))
    opened.expect_connection_close(505)
    opened.wait_closed()


def test_unknown_method_closes_the_connection_with_command_invalid(opened: RawClient) -> None:
    # RabbitMQ closes the connection on a method id its framing does not know; 503 names it.
    opened.send(raw_frame(1, 1, b"\x00\x3c\x00\x63"))
    close = opened.expect_connection_close(503)
    assert (close.class_id, close.method_id) == (60, 99)
    opened.wait_closed()


def test_truncated_method_arguments_close_the_connection_with_frame_error(
    opened: RawClient,
) -> None:
    opened.send(raw_frame(1, 1, b"\x00\x32\x00\x0a\x00"))  # queue.declare, arguments cut off
    opened.expect_connection_close(501)
    opened.wait_closed()


def test_heartbeat_on_a_channel_other_than_zero_closes_the_connection(opened: RawClient) -> None:
    opened.send(raw_frame(8, 1, b""))  # pamqp always puts heartbeats on channel 0
    opened.expect_connection_close(501)
    opened.wait_closed()


def test_channel_above_channel_max_is_refused(raw: RawClient) -> None:
    raw.handshake(channel_max=10)
    raw.send_frame(11, commands.Channel.Open())
    raw.expect_connection_close(530)
    raw.wait_closed()


def test_client_that_disconnects_mid_frame_leaves_no_connection_behind(
    broker: BrokerProcess,
) -> None:
    baseline = connections(broker)
    with RawClient(broker.host, broker.port) as client:
        client.handshake()
        client.open_channel(1)
        client.send_frame(1, commands.Queue.Declare(queue="errors.half-sent", exclusive=True))
        client.expect(commands.Queue.DeclareOk, 1)
        frame = encode(1, commands.Basic.Qos(prefetch_count=10))
        client.send(frame[: len(frame) // 2])
        assert connections(broker) == baseline + 1
    wait_for("the connection count back to its baseline", lambda: connections(broker) == baseline)
    # The connection's exclusive queue went with it.
    assert "errors.half-sent" not in {q.name for q in broker.admin.status().queues}
    pika_round_trip(broker.url)


def test_client_that_disconnects_mid_handshake_leaves_no_connection_behind(
    broker: BrokerProcess,
) -> None:
    baseline = connections(broker)
    with RawClient(broker.host, broker.port) as client:
        client.send(PROTOCOL_HEADER[:5])
        wait_for("one more connection", lambda: connections(broker) == baseline + 1)
    wait_for("the connection count back to its baseline", lambda: connections(broker) == baseline)
    pika_round_trip(broker.url)


@pytest.mark.slow
def test_client_that_never_finishes_the_handshake_is_dropped(broker: BrokerProcess) -> None:
    baseline = connections(broker)
    with RawClient(broker.host, broker.port) as client:
        client.send(PROTOCOL_HEADER)
        client.expect(commands.Connection.Start, 0)
        # ... and never a start-ok: dropped after the 10 s handshake timeout (1 s ticks).
        client.wait_closed(timeout=15)
    wait_for("the connection count back to its baseline", lambda: connections(broker) == baseline)
    pika_round_trip(broker.url)


# -- login and negotiation -----------------------------------------------------------------


@pytest.mark.parametrize("mechanism", ["PLAIN", "AMQPLAIN"])
def test_wrong_password_is_refused_with_access_refused_and_the_socket_closes(
    raw: RawClient, mechanism: str
) -> None:
    header, start_ok, _ = handshake_frames(password="not-guest", mechanism=mechanism)
    raw.send(header)
    raw.expect(commands.Connection.Start, 0)
    raw.send(start_ok)
    close = raw.expect(commands.Connection.Close, 0)
    assert close.reply_code == 403
    assert (close.class_id, close.method_id) == (10, 11)
    # No close-ok needed: the broker closes the socket right after refusing.
    raw.wait_closed()


def test_unknown_user_is_refused_with_access_refused(raw: RawClient) -> None:
    header, start_ok, _ = handshake_frames(user="nobody", password="guest")
    raw.send(header + start_ok)
    raw.expect(commands.Connection.Start, 0)
    assert raw.expect(commands.Connection.Close, 0).reply_code == 403
    raw.wait_closed()


def test_unsupported_mechanism_is_refused_with_access_refused(raw: RawClient) -> None:
    raw.send(PROTOCOL_HEADER)
    start = raw.expect(commands.Connection.Start, 0)
    assert set(start.mechanisms.split()) == {"PLAIN", "AMQPLAIN"}
    raw.send_frame(0, commands.Connection.StartOk(mechanism="EXTERNAL", response=""))
    assert raw.expect(commands.Connection.Close, 0).reply_code == 403
    raw.wait_closed()


def test_amqplain_login_opens_the_connection(raw: RawClient) -> None:
    raw.handshake(mechanism="AMQPLAIN")
    raw.open_channel(1)
    raw.send_frame(1, commands.Queue.Declare(queue="", exclusive=True))
    assert raw.expect(commands.Queue.DeclareOk, 1).queue.startswith("amq.gen-")


def test_unknown_vhost_closes_the_connection_with_not_allowed(raw: RawClient) -> None:
    header, start_ok, _ = handshake_frames()
    raw.send(header + start_ok)
    raw.expect(commands.Connection.Start, 0)
    raw.expect(commands.Connection.Tune, 0)
    raw.send_frame(0, commands.Connection.TuneOk(channel_max=0, frame_max=131072, heartbeat=0))
    raw.send_frame(0, commands.Connection.Open(virtual_host="/elsewhere"))
    raw.expect_connection_close(530)
    raw.wait_closed()


def test_frame_max_below_the_minimum_is_refused(raw: RawClient) -> None:
    header, start_ok, _ = handshake_frames()
    raw.send(header + start_ok)
    raw.expect(commands.Connection.Start, 0)
    raw.expect(commands.Connection.Tune, 0)
    raw.send_frame(0, commands.Connection.TuneOk(channel_max=0, frame_max=1024, heartbeat=0))
    raw.expect_connection_close(530)
    raw.wait_closed()


def test_silent_client_with_heartbeat_1_is_disconnected_after_two_intervals(
    raw: RawClient,
) -> None:
    tune = raw.handshake(heartbeat=1)
    assert tune.heartbeat > 0
    opened_at = time.monotonic()
    before_eof = raw.wait_closed(timeout=10)
    elapsed = time.monotonic() - opened_at
    # Two missed intervals, checked by a 1 s timer: gone between 2 s and 4 s.
    assert 1.5 <= elapsed <= 4.5, elapsed
    # Meanwhile the broker kept its side of the bargain.
    assert b"\x08\x00\x00\x00\x00\x00\x00\xce" in before_eof


def test_client_sending_heartbeats_stays_connected(raw: RawClient) -> None:
    raw.handshake(heartbeat=1)
    raw.open_channel(1)
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        raw.send_frame(0, Heartbeat())
        time.sleep(0.4)  # the client's own heartbeat interval, not a wait for the broker
    raw.send_frame(1, commands.Queue.Declare(queue="", exclusive=True))
    raw.expect(commands.Queue.DeclareOk, 1)


# -- channel-level errors, as a real client sees them ---------------------------------------


@pytest.fixture
def pika_connection(broker: BrokerProcess) -> Iterator[pika.BlockingConnection]:
    """A pika connection to the module's broker."""
    connection = pika.BlockingConnection(pika.URLParameters(broker.url))
    yield connection
    if connection.is_open:
        connection.close()


def assert_connection_lives(connection: pika.BlockingConnection) -> None:
    """The connection is open and a new channel on it works."""
    assert connection.is_open
    channel = connection.channel()
    name = channel.queue_declare("", exclusive=True).method.queue
    channel.basic_publish("", name, b"alive")
    _, _, body = channel.basic_get(name, auto_ack=True)
    assert body == b"alive"
    channel.close()


def test_publish_to_missing_exchange_closes_the_channel_with_not_found(
    pika_connection: pika.BlockingConnection,
) -> None:
    channel = pika_connection.channel()
    channel.confirm_delivery()
    with pytest.raises(ChannelClosedByBroker) as info:
        channel.basic_publish("no-such-exchange", "key", b"lost")
    assert info.value.reply_code == 404
    assert channel.is_closed
    assert_connection_lives(pika_connection)


def test_redeclare_queue_with_different_arguments_is_precondition_failed(
    pika_connection: pika.BlockingConnection,
) -> None:
    channel = pika_connection.channel()
    channel.queue_declare("errors.redeclare", auto_delete=True, arguments={"x-max-length": 5})
    with pytest.raises(ChannelClosedByBroker) as info:
        channel.queue_declare("errors.redeclare", auto_delete=True, arguments={"x-max-length": 6})
    assert info.value.reply_code == 406
    assert_connection_lives(pika_connection)
    pika_connection.channel().queue_delete("errors.redeclare")


def test_redeclare_exchange_with_different_type_is_precondition_failed(
    pika_connection: pika.BlockingConnection,
) -> None:
    channel = pika_connection.channel()
    channel.exchange_declare("errors.exchange", "direct", auto_delete=False)
    with pytest.raises(ChannelClosedByBroker) as info:
        channel.exchange_declare("errors.exchange", "fanout", auto_delete=False)
    assert info.value.reply_code == 406
    assert_connection_lives(pika_connection)
    pika_connection.channel().exchange_delete("errors.exchange")


def test_exclusive_queue_from_another_connection_is_resource_locked(
    broker: BrokerProcess, pika_connection: pika.BlockingConnection
) -> None:
    owner = pika_connection.channel()
    owner.queue_declare("errors.exclusive", exclusive=True)
    other = pika.BlockingConnection(pika.URLParameters(broker.url))
    try:
        for attempt in (
            lambda ch: ch.queue_declare("errors.exclusive", exclusive=True),
            lambda ch: ch.queue_declare("errors.exclusive", passive=True),
            lambda ch: ch.basic_consume("errors.exclusive", lambda *a: None),
            lambda ch: ch.basic_get("errors.exclusive"),
        ):
            with pytest.raises(ChannelClosedByBroker) as info:
                attempt(other.channel())
            assert info.value.reply_code == 405
        assert_connection_lives(other)
    finally:
        other.close()
    # The owner still has its queue.
    owner.queue_declare("errors.exclusive", passive=True)


def test_exclusive_queue_is_deleted_with_its_connection(broker: BrokerProcess) -> None:
    owner = pika.BlockingConnection(pika.URLParameters(broker.url))
    owner.channel().queue_declare("errors.exclusive-gone", exclusive=True)
    owner.close()
    other = pika.BlockingConnection(pika.URLParameters(broker.url))
    try:
        other.channel().queue_declare("errors.exclusive-gone", exclusive=True)
    finally:
        other.close()


def test_duplicate_consumer_tag_closes_the_connection_with_not_allowed(
    opened: RawClient,
) -> None:
    # pika refuses a duplicate tag itself, so this one goes over the raw socket.
    opened.send_frame(1, commands.Queue.Declare(queue="", exclusive=True))
    name = opened.expect(commands.Queue.DeclareOk, 1).queue
    opened.send_frame(1, commands.Basic.Consume(queue=name, consumer_tag="twice"))
    opened.expect(commands.Basic.ConsumeOk, 1)
    opened.send_frame(1, commands.Basic.Consume(queue=name, consumer_tag="twice"))
    close = opened.expect_connection_close(530)
    assert (close.class_id, close.method_id) == (60, 20)
    opened.wait_closed()


def test_ack_of_unknown_delivery_tag_closes_the_channel_with_precondition_failed(
    pika_connection: pika.BlockingConnection,
) -> None:
    channel = pika_connection.channel()
    channel.basic_ack(delivery_tag=999)
    with pytest.raises(ChannelClosedByBroker) as info:
        channel.queue_declare("", exclusive=True)
    assert info.value.reply_code == 406
    assert_connection_lives(pika_connection)


def test_double_ack_closes_the_channel_with_precondition_failed(
    pika_connection: pika.BlockingConnection,
) -> None:
    channel = pika_connection.channel()
    name = channel.queue_declare("", exclusive=True).method.queue
    channel.basic_publish("", name, b"once")
    method, _, _ = channel.basic_get(name)
    assert method is not None
    channel.basic_ack(method.delivery_tag)
    channel.basic_ack(method.delivery_tag)
    with pytest.raises(ChannelClosedByBroker) as info:
        channel.queue_declare("", exclusive=True)
    assert info.value.reply_code == 406
    assert_connection_lives(pika_connection)


def test_consume_from_missing_queue_closes_the_channel_with_not_found(
    pika_connection: pika.BlockingConnection,
) -> None:
    channel = pika_connection.channel()
    with pytest.raises(ChannelClosedByBroker) as info:
        channel.basic_consume("errors.no-such-queue", lambda *a: None)
    assert info.value.reply_code == 404
    assert_connection_lives(pika_connection)


def test_reserved_amq_prefix_is_access_refused(
    pika_connection: pika.BlockingConnection,
) -> None:
    with pytest.raises(ChannelClosedByBroker) as info:
        pika_connection.channel().queue_declare("amq.mine")
    assert info.value.reply_code == 403
    with pytest.raises(ChannelClosedByBroker) as info:
        pika_connection.channel().exchange_declare("amq.mine", "direct")
    assert info.value.reply_code == 403
    assert_connection_lives(pika_connection)


def test_channel_error_leaves_other_channels_of_the_connection_working(
    pika_connection: pika.BlockingConnection,
) -> None:
    survivor = pika_connection.channel()
    name = survivor.queue_declare("", exclusive=True).method.queue
    survivor.basic_publish("", name, b"kept")
    doomed = pika_connection.channel()
    with pytest.raises(ChannelClosedByBroker):
        doomed.queue_declare("errors.missing", passive=True)
    _, _, body = survivor.basic_get(name, auto_ack=True)
    assert body == b"kept"


def test_names_rabbitmq_accepts_work_beyond_the_spec_pattern(
    pika_connection: pika.BlockingConnection,
) -> None:
    # RabbitMQ takes any UTF-8 name up to 255 bytes, not just the spec's old pattern.
    exchange, queue = "échange|" + "x" * 150, "очередь (1)"
    channel = pika_connection.channel()
    channel.exchange_declare(exchange, "direct", auto_delete=True)
    assert channel.queue_declare(queue, exclusive=True).method.queue == queue
    channel.queue_bind(queue, exchange, routing_key="ключ")
    channel.basic_publish(exchange, "ключ", b"named")
    method, _, body = channel.basic_get(queue, auto_ack=True)
    assert method is not None and body == b"named"
    assert (method.exchange, method.routing_key) == (exchange, "ключ")
    returned: list[tuple[str, str]] = []
    channel.add_on_return_callback(
        lambda _ch, m, _p, _b: returned.append((m.exchange, m.routing_key))
    )
    channel.basic_publish(exchange, "nobody", b"back", mandatory=True)
    pika_connection.process_data_events(time_limit=0)
    wait_for(
        "the basic.return",
        lambda: pika_connection.process_data_events(time_limit=0.05) or returned,
    )
    assert returned == [(exchange, "nobody")]
    assert_connection_lives(pika_connection)


def test_publish_with_a_malformed_headers_table_never_reaches_consumers(
    broker: BrokerProcess, opened: RawClient
) -> None:
    queue = "errors.poison"
    opened.send_frame(1, commands.Queue.Declare(queue=queue, auto_delete=False))
    opened.expect(commands.Queue.DeclareOk, 1)
    opened.send_frame(1, commands.Basic.Publish(routing_key=queue))
    table = b"\x03key" + b"Z" + b"junk"  # 'Z' is no field type
    properties = struct.pack(">HHQH", 60, 0, 4, 0x2000) + struct.pack(">I", len(table)) + table
    opened.send(raw_frame(2, 1, properties) + raw_frame(3, 1, b"body"))
    # A round trip on the publisher's connection: the publish has been handled (or refused).
    opened.send_frame(0, commands.Connection.UpdateSecret(new_secret="", reason="sync"))
    while not isinstance(
        opened.read_frame()[1], commands.Connection.UpdateSecretOk | commands.Connection.Close
    ):
        pass
    connection = pika.BlockingConnection(pika.URLParameters(broker.url))
    try:
        method, _, _ = connection.channel().basic_get(queue, auto_ack=True)
        assert method is None
    finally:
        if connection.is_open:
            connection.close()
        cleanup = pika.BlockingConnection(pika.URLParameters(broker.url))
        cleanup.channel().queue_delete(queue)
        cleanup.close()
