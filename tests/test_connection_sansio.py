"""The connection state machine alone: exact bytes in, exact bytes out, no sockets.

Expected frames are written out by hand from the AMQP 0-9-1 spec (`frame`
below), not produced by the codec under test, so an encoding slip shows.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from pamqp import commands

from twinmq.broker.connection import State
from twinmq.testing.rawamqp import (
    PROTOCOL_HEADER,
    content,
    decode_frames,
    encode,
    plain_response,
    publish,
    start_ok,
)
from twinmq.testing.sansio import PRODUCT_VERSION, Harness, Peer

FRAME_END = b"\xce"


def frame(ftype: int, channel: int, payload: bytes) -> bytes:
    """A frame: type, channel, size, payload, frame-end."""
    return struct.pack(">BHI", ftype, channel, len(payload)) + payload + FRAME_END


def method(channel: int, class_id: int, method_id: int, args: bytes = b"") -> bytes:
    """A method frame from its class id, method id and encoded arguments."""
    return frame(1, channel, struct.pack(">HH", class_id, method_id) + args)


def shortstr(text: str) -> bytes:
    """An AMQP short string."""
    data = text.encode()
    return bytes((len(data),)) + data


def connection_close(code: int, text: str, class_id: int = 0, method_id: int = 0) -> bytes:
    """`connection.close` as the broker must send it."""
    return method(
        0,
        10,
        50,
        struct.pack(">H", code) + shortstr(text) + struct.pack(">HH", class_id, method_id),
    )


OPEN_OK = method(0, 10, 41, shortstr(""))
CLOSE_OK = method(0, 10, 51)
CHANNEL_OPEN_OK = method(1, 20, 11, b"\x00\x00\x00\x010")  # reserved long string, as pamqp fills it
HEARTBEAT = b"\x08\x00\x00\x00\x00\x00\x00\xce"


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Harness]:
    """A virtual host over a real journal in tmp_path."""
    h = Harness(tmp_path)
    yield h
    h.close()


@pytest.fixture
def peer(harness: Harness) -> Peer:
    """A loopback client, nothing sent yet."""
    return harness.connect()


@pytest.fixture
def opened(peer: Peer) -> Peer:
    """A loopback client past the handshake with channel 1 open."""
    peer.handshake()
    assert peer.feed(encode(1, commands.Channel.Open())) == CHANNEL_OPEN_OK
    return peer


# -- the handshake, byte for byte ----------------------------------------------------------


def test_protocol_header_is_answered_with_connection_start(peer: Peer) -> None:
    [(channel, start)] = peer.exchange(PROTOCOL_HEADER)
    assert channel == 0
    assert isinstance(start, commands.Connection.Start)
    assert (start.version_major, start.version_minor) == (0, 9)
    assert start.mechanisms == "PLAIN AMQPLAIN"
    assert start.locales == "en_US"
    props = start.server_properties
    assert props["product"] == "TwinMQ" and props["version"] == PRODUCT_VERSION
    caps = props["capabilities"]
    for capability in ("publisher_confirms", "basic.nack", "consumer_cancel_notify"):
        assert caps[capability] is True
    assert peer.conn.state is State.AWAIT_START_OK


def test_protocol_header_arriving_byte_by_byte_is_answered_once_complete(peer: Peer) -> None:
    for byte in PROTOCOL_HEADER[:-1]:
        assert peer.feed(bytes((byte,))) == b""
    [(_, start)] = peer.exchange(PROTOCOL_HEADER[-1:])
    assert isinstance(start, commands.Connection.Start)


@pytest.mark.parametrize(
    "header",
    [
        b"AMQP\x00\x00\x08\x00",
        b"AMQP\x01\x01\x00\x0a",
        b"AMQP\x00\x00\x09\x01"[:4] + b"\x00\x00\x09\x02",
    ],
)
def test_wrong_protocol_header_gets_ours_and_the_connection_ends(peer: Peer, header: bytes) -> None:
    assert peer.feed(header) == PROTOCOL_HEADER
    assert peer.conn.closed
    assert peer.feed(PROTOCOL_HEADER) == b""  # nothing more is read


def test_non_amqp_bytes_are_refused_without_waiting_for_eight(peer: Peer) -> None:
    assert peer.feed(b"GET") == PROTOCOL_HEADER
    assert peer.conn.closed


def test_start_ok_is_answered_with_tune(peer: Peer) -> None:
    peer.feed(PROTOCOL_HEADER)
    assert peer.feed(start_ok()) == method(0, 10, 30, struct.pack(">HIH", 2047, 131072, 60))
    assert peer.conn.state is State.AWAIT_TUNE_OK


def test_tune_ok_then_open_is_answered_with_open_ok(peer: Peer) -> None:
    peer.feed(PROTOCOL_HEADER + start_ok())
    assert peer.feed(method(0, 10, 31, struct.pack(">HIH", 100, 65536, 0))) == b""
    assert peer.feed(method(0, 10, 40, shortstr("/") + shortstr("") + b"\x00")) == OPEN_OK
    assert peer.conn.state is State.OPEN
    assert (peer.conn.channel_max, peer.conn.frame_max, peer.conn.heartbeat) == (100, 65536, 0)


def test_whole_handshake_in_one_segment_is_answered_in_order(peer: Peer) -> None:
    handshake = (
        PROTOCOL_HEADER
        + start_ok()
        + method(0, 10, 31, struct.pack(">HIH", 0, 0, 0))
        + method(0, 10, 40, shortstr("/") + shortstr("") + b"\x00")
        + encode(1, commands.Channel.Open())
    )
    kinds = [type(f) for _, f in peer.exchange(handshake)]
    assert kinds == [
        commands.Connection.Start,
        commands.Connection.Tune,
        commands.Connection.OpenOk,
        commands.Channel.OpenOk,
    ]
    # tune-ok's zeros mean "no limit from the client": the server's offer stands.
    assert (peer.conn.channel_max, peer.conn.frame_max) == (2047, 131072)


def test_channel_open_is_answered_with_open_ok(peer: Peer) -> None:
    peer.handshake()
    assert peer.feed(method(1, 20, 10, shortstr(""))) == CHANNEL_OPEN_OK


def test_heartbeat_from_the_client_gets_no_answer(opened: Peer) -> None:
    assert opened.feed(HEARTBEAT) == b""
    assert opened.conn.state is State.OPEN


def test_connection_close_is_answered_with_close_ok_and_the_connection_ends(
    opened: Peer,
) -> None:
    assert opened.feed(connection_close(200, "bye")) == CLOSE_OK
    assert opened.conn.closed


def test_channel_close_is_answered_with_close_ok(opened: Peer) -> None:
    close = method(1, 20, 40, struct.pack(">H", 200) + shortstr("done") + b"\x00\x00\x00\x00")
    assert opened.feed(close) == method(1, 20, 41)
    assert 1 not in opened.conn.channels


def test_publish_then_get_returns_the_content_frames_unchanged(opened: Peer) -> None:
    [(_, ok)] = opened.exchange(encode(1, commands.Queue.Declare(queue="q")))
    assert isinstance(ok, commands.Queue.DeclareOk) and ok.queue == "q"
    message = publish(1, "q", b"payload")
    assert opened.feed(message) == b""
    answer = opened.feed(encode(1, commands.Basic.Get(queue="q", no_ack=True)))
    get_ok = method(
        1, 60, 71, struct.pack(">QB", 1, 0) + shortstr("") + shortstr("q") + struct.pack(">I", 0)
    )
    # The content header and body go back out exactly as the publisher sent them.
    content_frames = message[len(encode(1, commands.Basic.Publish(routing_key="q"))) :]
    assert answer == get_ok + content_frames


def test_confirm_waits_for_the_journal_for_a_persistent_message(
    harness: Harness, opened: Peer
) -> None:
    opened.feed(encode(1, commands.Queue.Declare(queue="durable-q", durable=True)))
    assert opened.feed(encode(1, commands.Confirm.Select())) == method(1, 85, 11)
    persistent = commands.Basic.Properties(delivery_mode=2)
    body = encode(1, commands.Basic.Publish(routing_key="durable-q")) + content(
        1, b"kept", persistent
    )
    assert opened.feed(body) == b""  # not on disk yet: no confirm
    harness.commit()
    assert opened.conn.data_to_send() == method(1, 60, 80, struct.pack(">QB", 1, 0))


# -- guest only over loopback ---------------------------------------------------------------


@pytest.mark.parametrize("mechanism", ["PLAIN", "AMQPLAIN"])
def test_guest_from_a_remote_address_is_refused_with_access_refused(
    harness: Harness, mechanism: str
) -> None:
    remote = harness.connect(loopback=False, peer="192.0.2.7:5555")
    remote.feed(PROTOCOL_HEADER)
    answer = remote.feed(start_ok("guest", "guest", mechanism))
    assert answer == connection_close(
        403, "ACCESS_REFUSED - user 'guest' can only connect via localhost", 10, 11
    )
    # As RabbitMQ: the socket closes at once, without waiting for close-ok.
    assert remote.conn.closed
    assert remote.conn.user is None


def test_guest_from_loopback_is_let_in(peer: Peer) -> None:
    peer.feed(PROTOCOL_HEADER)
    [(_, tune)] = peer.exchange(start_ok("guest", "guest"))
    assert isinstance(tune, commands.Connection.Tune)
    assert peer.conn.user == "guest"


def test_other_users_may_log_in_from_a_remote_address(harness: Harness) -> None:
    remote = harness.connect(loopback=False, peer="192.0.2.7:5555")
    kinds = [
        type(f) for _, f in decode_frames(remote.handshake(user="alice", password="wonderland"))
    ]
    assert kinds == [
        commands.Connection.Start,
        commands.Connection.Tune,
        commands.Connection.OpenOk,
    ]
    assert remote.conn.user == "alice"


def test_wrong_password_is_refused_with_the_generic_text(harness: Harness) -> None:
    remote = harness.connect(loopback=False)
    remote.feed(PROTOCOL_HEADER)
    assert remote.feed(start_ok("alice", "rabbit")) == connection_close(
        403,
        "ACCESS_REFUSED - Login was refused using authentication mechanism PLAIN. "
        "For details see the broker logfile.",
        10,
        11,
    )
    assert remote.conn.closed


def test_frames_after_a_refused_login_are_ignored(harness: Harness) -> None:
    remote = harness.connect(loopback=False)
    remote.feed(PROTOCOL_HEADER)
    remote.feed(start_ok("guest", "guest"))
    tune_ok = encode(0, commands.Connection.TuneOk(frame_max=131072))
    assert remote.feed(tune_ok + encode(0, commands.Connection.Open())) == b""
    assert remote.conn.state is State.CLOSED


# -- errors and timeouts ---------------------------------------------------------------------


def test_connection_error_waits_for_close_ok_then_ends(opened: Peer) -> None:
    answer = opened.feed(encode(2, commands.Basic.Qos(prefetch_count=1)))
    assert answer == connection_close(504, "CHANNEL_ERROR - expected 'channel.open' on channel 2")
    assert opened.conn.state is State.CLOSING
    # Until close-ok, everything but close and close-ok is discarded.
    assert opened.feed(encode(1, commands.Basic.Qos(prefetch_count=1))) == b""
    assert opened.feed(CLOSE_OK) == b""
    assert opened.conn.closed


def test_close_ok_nobody_asked_for_is_a_connection_error(opened: Peer) -> None:
    answer = opened.feed(CLOSE_OK)
    assert answer == connection_close(
        503, "COMMAND_INVALID - unexpected Connection.CloseOk on channel 0 in state open"
    )
    assert opened.conn.state is State.CLOSING


def test_basic_publish_on_channel_zero_is_a_connection_error(opened: Peer) -> None:
    answer = opened.feed(encode(0, commands.Basic.Publish(routing_key="q")))
    assert answer == connection_close(
        503, "COMMAND_INVALID - unexpected Basic.Publish on channel 0 in state open"
    )


def test_unicode_queue_name_is_declared_and_echoed(opened: Peer) -> None:
    # ticket, queue, flags (none), empty arguments table
    declare = method(1, 50, 10, b"\x00\x00" + shortstr("очередь") + b"\x00" + b"\x00" * 4)
    assert opened.feed(declare) == method(1, 50, 11, shortstr("очередь") + struct.pack(">II", 0, 0))


def test_framing_error_hangs_up_without_waiting_for_close_ok(opened: Peer) -> None:
    bad = encode(1, commands.Basic.Qos(prefetch_count=1))[:-1] + b"\x00"
    assert opened.feed(bad) == connection_close(501, "FRAME_ERROR - frame-end octet missing")
    assert opened.conn.closed


def test_silent_client_is_dropped_after_two_missed_heartbeats(harness: Harness) -> None:
    client = harness.connect()
    client.handshake(heartbeat=1)
    conn = client.conn
    assert conn.heartbeat == 1
    conn.receive_data(HEARTBEAT, now=100.0)
    conn.last_sent = 100.0  # what the transport records when it writes
    assert conn.heartbeat_due(100.6)
    assert conn.data_to_send() == HEARTBEAT  # half an interval without sending
    assert conn.heartbeat_due(102.0)
    assert not conn.heartbeat_due(102.1)
    assert conn.close_reason == "missed heartbeats"


def test_a_check_that_comes_late_after_a_busy_loop_does_not_drop_the_client(
    harness: Harness,
) -> None:
    client = harness.connect()
    client.handshake(heartbeat=1)
    conn = client.conn
    conn.receive_data(HEARTBEAT, now=100.0)
    # The broker was busy for 5 s: the client's heartbeats wait unread behind this check.
    assert conn.heartbeat_due(105.0, stalled=True)
    conn.receive_data(HEARTBEAT, now=105.0)  # ... and are read right after it
    assert conn.heartbeat_due(106.0)
    assert not conn.heartbeat_due(107.1)  # silence after that is the client's again


def test_client_heartbeats_keep_the_connection(harness: Harness) -> None:
    client = harness.connect()
    client.handshake(heartbeat=1)
    for tick in range(10):
        client.conn.receive_data(HEARTBEAT, now=200.0 + tick)
        assert client.conn.heartbeat_due(200.5 + tick)


def test_client_that_never_finishes_the_handshake_is_dropped(harness: Harness) -> None:
    stalled = harness.connect()
    stalled.feed(PROTOCOL_HEADER[:4], now=50.0)
    assert stalled.conn.heartbeat_due(50.0)
    assert stalled.conn.heartbeat_due(55.0)
    assert not stalled.conn.heartbeat_due(50.0 + harness.ctx.limits.handshake_timeout + 1.5)


def test_client_that_never_answers_connection_close_is_dropped(harness: Harness) -> None:
    client = harness.connect()
    client.handshake()
    client.feed(encode(3, commands.Basic.Qos()), now=10.0)
    assert client.conn.state is State.CLOSING
    assert client.conn.heartbeat_due(10.0)
    assert not client.conn.heartbeat_due(10.0 + harness.ctx.limits.close_timeout + 1.5)


def test_closing_a_connection_deletes_only_its_own_exclusive_queues(harness: Harness) -> None:
    owner, other = harness.connect(), harness.connect()
    for client, name in ((owner, "mine"), (other, "theirs")):
        client.handshake()
        client.feed(encode(1, commands.Channel.Open()))
        client.feed(encode(1, commands.Queue.Declare(queue=name, exclusive=True)))
    assert {"mine", "theirs"} <= set(harness.vhost.queues)
    owner.feed(connection_close(200, "bye"))
    owner.conn.connection_lost()
    assert "mine" not in harness.vhost.queues
    assert "theirs" in harness.vhost.queues


# -- a federation link's status for amq.peer -------------------------------------------------


def _federation_link(harness: Harness) -> Peer:
    """A connection that announces a server identifier (a federation link), channel 1 open."""
    link = harness.connect()
    link.feed(PROTOCOL_HEADER)
    start_ok_frame = encode(
        0,
        commands.Connection.StartOk(
            client_properties={"product": "twinmq-testing", "x-twinmq-server-id": "remote"},
            mechanism="PLAIN",
            response=plain_response("guest", "guest"),
        ),
    )
    link.feed(start_ok_frame)
    link.feed(
        encode(0, commands.Connection.TuneOk(channel_max=2047, frame_max=131072, heartbeat=0))
        + encode(0, commands.Connection.Open(virtual_host="/"))
    )
    assert link.feed(encode(1, commands.Channel.Open())) == CHANNEL_OPEN_OK
    return link


def test_a_federation_links_status_for_amq_peer_is_taken_even_where_publishes_are_refused(
    harness: Harness,
) -> None:
    """On a DR replica (publishes refused, 403) a downstream link's status for amq.peer
    is transient news, not the source site's data: taken, and the link's channel stays
    open; its other publishes are refused as any client's."""
    harness.ctx.write_refusal_reason = "a DR replica"
    link = _federation_link(harness)
    transient = commands.Basic.Properties(delivery_mode=1)
    assert link.feed(publish(1, "link-status", b"{}", "amq.peer", transient)) == b""
    assert harness.ctx.peer_statuses == [("link-status", b"{}", True)]
    [(_, refused)] = link.exchange(publish(1, "k", b"data", "amq.fanout"))
    assert isinstance(refused, commands.Channel.Close) and refused.reply_code == 403


def test_a_federation_links_status_for_amq_peer_does_not_block_it_during_a_resource_alarm(
    harness: Harness,
) -> None:
    """A publish during an alarm stops its connection's reads (RabbitMQ's rule), but a
    link's status is tiny and transient, and that connection's reads carry the link's
    acks, which free this server's queues: not blocked. Any other publish still is."""
    harness.ctx.alarm_reason = "disk"
    link = _federation_link(harness)
    transient = commands.Basic.Properties(delivery_mode=1)
    link.feed(publish(1, "link-up", b"{}", "amq.peer", transient))
    assert harness.ctx.peer_statuses == [("link-up", b"{}", True)]
    assert not link.conn.blocked
    link.feed(publish(1, "k", b"data", "amq.fanout"))
    assert link.conn.blocked
