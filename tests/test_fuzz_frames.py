"""Fuzzing the frame path: the protocol core, the frame reader, and a real broker process.

(a) Random bytes and mutated valid frames fed to an open `Connection` never
    raise, leave it open or properly closing, and never disturb another
    connection on the same virtual host.
(b) `FrameReader` yields the same frames however a valid stream is split.
(c) Garbage on a real socket leaves the broker serving real clients.
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands
from pamqp.base import Frame as MethodFrame
from pamqp.frame import _unmarshal_method_frame
from sansio import Harness, Peer

from twinmq.broker.codec import FrameReader
from twinmq.broker.connection import State
from twinmq.broker.errors import AMQPError, ReplyCode
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.rawamqp import (
    PROTOCOL_HEADER,
    RawClient,
    connections,
    content,
    decode_frames,
    encode,
    pika_round_trip,
    raw_frame,
    split_frames,
)
from twinmq.testing.waiting import wait_for

# Fuzzed frames decode to basic.recover-async now and then, which pamqp warns about.
pytestmark = pytest.mark.filterwarnings("ignore:This command is deprecated:DeprecationWarning")

HEARTBEAT = b"\x08\x00\x00\x00\x00\x00\x00\xce"
# TWINMQ_FUZZ_EXAMPLES=5000 for a long hunt; the default keeps the file well under 30 s.
FUZZ_EXAMPLES = int(os.environ.get("TWINMQ_FUZZ_EXAMPLES", "150"))
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- a corpus of valid frames to mutate ------------------------------------------------------


def _publish_parts(
    channel: int,
    routing_key: str,
    body: bytes,
    exchange: str = "",
    properties: commands.Basic.Properties | None = None,
) -> list[bytes]:
    """A publish as three separate frames, so mutations can drop or reorder them."""
    method = encode(channel, commands.Basic.Publish(exchange=exchange, routing_key=routing_key))
    header_and_body = content(channel, body, properties)
    header = split_frames(header_and_body)[0]
    header_frame = raw_frame(header[0], header[1], header[2])
    return [method, header_frame, header_and_body[len(header_frame) :]]


def _corpus() -> list[bytes]:
    C, Q, E, B, T = (
        commands.Channel,
        commands.Queue,
        commands.Exchange,
        commands.Basic,
        commands.Tx,
    )
    dlx_args = {"x-message-ttl": 0, "x-dead-letter-exchange": "fz-dlx"}
    methods: list[tuple[int, MethodFrame]] = [
        (1, Q.Declare(queue="fz")),
        (1, Q.Declare(queue="fz-durable", durable=True)),
        (1, Q.Declare(queue="", exclusive=True)),
        (1, Q.Declare(queue="fz-auto", auto_delete=True)),
        (1, Q.Declare(queue="fz-ttl", arguments=dlx_args)),
        (
            1,
            Q.Declare(
                queue="fz-max", arguments={"x-max-length": 1, "x-overflow": "reject-publish"}
            ),
        ),
        (1, Q.Declare(queue="fz", passive=True)),
        (1, E.Declare(exchange="fz-dlx", exchange_type="fanout")),
        (1, E.Declare(exchange="fz-topic", exchange_type="topic", durable=True)),
        (1, E.Declare(exchange="fz-headers", exchange_type="headers")),
        (1, Q.Bind(queue="fz", exchange="fz-topic", routing_key="a.*")),
        (1, Q.Bind(queue="fz", exchange="fz-dlx")),
        (
            1,
            Q.Bind(
                queue="fz-durable", exchange="fz-headers", arguments={"x-match": "any", "k": "v"}
            ),
        ),
        (1, Q.Unbind(queue="fz", exchange="fz-topic", routing_key="a.*")),
        (1, B.Qos(prefetch_count=2)),
        (1, B.Qos(prefetch_count=1, global_=True)),
        (1, B.Consume(queue="fz", consumer_tag="c1")),
        (1, B.Consume(queue="fz-auto", consumer_tag="c2", no_ack=True)),
        (1, B.Cancel(consumer_tag="c1")),
        (1, B.Cancel(consumer_tag="c2")),
        (1, B.Get(queue="fz")),
        (1, B.Get(queue="fz-durable", no_ack=True)),
        (1, B.Ack(delivery_tag=1)),
        (1, B.Ack(delivery_tag=0, multiple=True)),
        (1, B.Nack(delivery_tag=2, requeue=True)),
        (1, B.Nack(delivery_tag=0, multiple=True, requeue=False)),
        (1, B.Reject(delivery_tag=1, requeue=False)),
        (1, B.Recover(requeue=True)),
        (1, T.Select()),
        (1, T.Commit()),
        (1, T.Rollback()),
        (1, commands.Confirm.Select()),
        (1, C.Flow(active=False)),
        (1, C.Flow(active=True)),
        (1, Q.Purge(queue="fz")),
        (1, Q.Delete(queue="fz")),
        (1, E.Delete(exchange="fz-topic")),
        (1, C.Close(reply_code=200, reply_text="bye", class_id=0, method_id=0)),
        (1, C.CloseOk()),
        (1, C.Open()),
        (2, C.Open()),
        (2, Q.Declare(queue="fz")),
        (2, B.Consume(queue="fz", consumer_tag="c3")),
        (3, B.Get(queue="fz")),
    ]
    frames = [encode(channel, method) for channel, method in methods]
    persistent = commands.Basic.Properties(delivery_mode=2, message_id="m-1")
    headers = commands.Basic.Properties(headers={"k": "v"}, expiration="0")
    for parts in (
        _publish_parts(1, "fz", b"body"),
        _publish_parts(1, "a.b", b"x" * 300, exchange="fz-topic"),
        _publish_parts(1, "fz-durable", b"kept", properties=persistent),
        _publish_parts(1, "", b"h", exchange="fz-headers", properties=headers),
        _publish_parts(1, "fz-ttl", b"dead soon"),
        _publish_parts(1, "fz-max", b"full"),
        _publish_parts(2, "fz", b""),
    ):
        frames.append(b"".join(parts))
        frames.extend(part for part in parts if part)
    frames.append(HEARTBEAT)
    return frames


CORPUS = _corpus()

# One mutation: (kind, where as a fraction of the stream, bytes).
mutations = st.tuples(
    st.sampled_from(["flip", "truncate", "insert", "delete", "duplicate"]),
    st.floats(0, 1, allow_nan=False),
    st.binary(min_size=1, max_size=8),
)


def mutate(data: bytes, kind: str, where: float, noise: bytes) -> bytes:
    """Apply one mutation to a byte stream."""
    if not data:
        return noise
    pos = min(int(where * len(data)), len(data) - 1)
    if kind == "flip":
        return data[:pos] + bytes((data[pos] ^ (noise[0] or 1),)) + data[pos + 1 :]
    if kind == "truncate":
        return data[:pos]
    if kind == "insert":
        return data[:pos] + noise + data[pos:]
    if kind == "delete":
        return data[:pos] + data[pos + len(noise) :]
    return data[:pos] + data[pos : pos + len(noise) * 4] + data[pos:]


# -- (a) the protocol core -------------------------------------------------------------------


def chunked(data: bytes, cuts: list[int]) -> Iterator[bytes]:
    """`data` split at the given offsets (any order, duplicates allowed)."""
    last = 0
    for cut in sorted({c % (len(data) + 1) for c in cuts}):
        yield data[last:cut]
        last = cut
    yield data[last:]


def check_output(output: bytes) -> list[tuple[int, MethodFrame]]:
    """The broker's output is well-formed frames; return its decoded method frames."""
    methods = []
    for ftype, channel, payload in split_frames(output):
        if ftype == 1:
            methods.append((channel, _unmarshal_method_frame(payload)))
    for _, method in methods:
        if isinstance(method, commands.Connection.Close | commands.Channel.Close):
            assert method.reply_code != ReplyCode.INTERNAL_ERROR, method.reply_text
    return methods


def check_state(peer: Peer, methods: list[tuple[int, MethodFrame]]) -> None:
    """Open, or closing/closed having told the client why."""
    state = peer.conn.state
    closes = [m for ch, m in methods if ch == 0 and isinstance(m, commands.Connection.Close)]
    close_oks = [m for ch, m in methods if ch == 0 and isinstance(m, commands.Connection.CloseOk)]
    if state is State.OPEN:
        assert not closes and not close_oks
    elif state is State.CLOSING:
        assert len(closes) == 1
    else:
        assert state is State.CLOSED, state
        # Either the broker closed (and said why) or the client did (and got close-ok).
        assert len(closes) + len(close_oks) == 1, methods
    for number, channel in peer.conn.channels.items():
        assert 1 <= number <= peer.conn.channel_max and channel.number == number


def open_peer(harness: Harness) -> Peer:
    """A loopback client past the handshake, channel 1 open."""
    peer = harness.connect()
    peer.handshake()
    peer.feed(encode(1, commands.Channel.Open()))
    assert peer.conn.state is State.OPEN
    return peer


def canary_round_trip(canary: Peer, body: bytes) -> None:
    """The bystander connection publishes to its exclusive queue and gets the message back."""
    message = b"".join(_publish_parts(1, "canary", body))
    assert canary.feed(message) == b""
    answer = canary.exchange(encode(1, commands.Basic.Get(queue="canary", no_ack=True)))
    kinds = [type(frame) for _, frame in answer]
    assert kinds[0] is commands.Basic.GetOk, answer
    assert answer[-1][1].value == body  # type: ignore[attr-defined]


def check_vhost(harness: Harness) -> None:
    """Queue bookkeeping adds up once the fuzzed connection is gone."""
    for queue in harness.vhost.queues.values():
        assert queue.unacked == 0, (queue.name, queue.unacked)
        assert queue.bytes == sum(entry.size for entry in queue.entries), queue.name
        assert not queue.consumers, queue.name


def fuzz_connection(streams: list[bytes], cuts: list[int]) -> None:
    """Feed the streams to one connection while another one stands by, then check both."""
    with tempfile.TemporaryDirectory() as tmp:
        harness = Harness(Path(tmp))
        try:
            canary = open_peer(harness)
            canary.feed(encode(1, commands.Queue.Declare(queue="canary", exclusive=True)))
            fuzzed = open_peer(harness)
            output = b""
            for stream in streams:
                for chunk in chunked(stream, cuts):
                    output += fuzzed.feed(chunk)
                    harness.clock.advance(0.5)  # let TTL timers fire between chunks
            check_state(fuzzed, check_output(output))
            harness.commit()
            check_output(fuzzed.conn.data_to_send())
            assert canary.conn.state is State.OPEN
            canary_round_trip(canary, b"still here")
            fuzzed.conn.connection_lost()
            check_vhost(harness)
            assert "canary" in harness.vhost.queues
            canary_round_trip(canary, b"and after")
        finally:
            harness.close()


@FUZZ_SETTINGS
@given(garbage=st.binary(min_size=1, max_size=512), cuts=st.lists(st.integers(0, 600), max_size=4))
def test_random_bytes_after_the_handshake_never_break_the_core(
    garbage: bytes, cuts: list[int]
) -> None:
    fuzz_connection([garbage], cuts)


@FUZZ_SETTINGS
@given(
    frames=st.lists(st.sampled_from(CORPUS), min_size=1, max_size=25),
    changes=st.lists(mutations, max_size=3),
    cuts=st.lists(st.integers(0, 10_000), max_size=4),
)
def test_mutated_valid_frames_never_break_the_core(
    frames: list[bytes], changes: list[tuple[str, float, bytes]], cuts: list[int]
) -> None:
    stream = b"".join(frames)
    for kind, where, noise in changes:
        stream = mutate(stream, kind, where, noise)
    fuzz_connection([stream], cuts)


@FUZZ_SETTINGS
@given(
    frames=st.lists(st.sampled_from(CORPUS), min_size=1, max_size=40),
    cuts=st.lists(st.integers(0, 10_000), max_size=4),
)
def test_valid_frame_sequences_never_break_the_core(frames: list[bytes], cuts: list[int]) -> None:
    # Valid frames in any order: many are protocol errors, none may be an internal error.
    fuzz_connection([b"".join(frames)], cuts)


# (class id, method id) of methods clients send, fuzzed with random arguments.
METHOD_IDS = [
    *((10, m) for m in (11, 31, 40, 50, 51)),
    *((20, m) for m in (10, 20, 40, 41)),
    *((40, m) for m in (10, 20, 30)),
    *((50, m) for m in (10, 20, 30, 40, 50)),
    *((60, m) for m in (10, 20, 30, 40, 70, 80, 90, 100, 110, 120)),
    (85, 10),
    *((90, m) for m in (10, 20, 30)),
]


@FUZZ_SETTINGS
@given(
    method_payload=st.binary(min_size=4, max_size=64),
    ids=st.sampled_from(METHOD_IDS),
    channel=st.sampled_from([0, 1, 2]),
)
def test_known_methods_with_random_arguments_never_break_the_core(
    method_payload: bytes, ids: tuple[int, int], channel: int
) -> None:
    payload = struct.pack(">HH", *ids) + method_payload
    fuzz_connection([raw_frame(1, channel, payload)], [])


# -- (b) the frame reader --------------------------------------------------------------------

frames_strategy = st.lists(
    st.tuples(
        st.sampled_from([1, 2, 3, 8]),
        st.integers(0, 65535),
        st.binary(max_size=300),
    ),
    max_size=20,
)


@settings(max_examples=300, deadline=None)
@given(frames=frames_strategy, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_frame_reader_yields_the_same_frames_however_the_stream_is_split(
    frames: list[tuple[int, int, bytes]], cuts: list[int]
) -> None:
    stream = b"".join(raw_frame(t, c, p) for t, c, p in frames)
    reader = FrameReader(frame_max=4096)
    got: list[tuple[int, int, bytes]] = []
    for chunk in chunked(stream, cuts):
        got += reader.feed(chunk)
    assert got == frames
    assert reader.buffered == 0


@settings(max_examples=50, deadline=None)
@given(frames=frames_strategy)
def test_frame_reader_yields_the_same_frames_fed_one_byte_at_a_time(
    frames: list[tuple[int, int, bytes]],
) -> None:
    stream = b"".join(raw_frame(t, c, p) for t, c, p in frames)
    reader = FrameReader(frame_max=4096)
    got: list[tuple[int, int, bytes]] = []
    for i in range(len(stream)):
        got += reader.feed(stream[i : i + 1])
    assert got == frames


@settings(max_examples=300, deadline=None)
@given(frames=frames_strategy.filter(bool), bad=st.data())
def test_frame_reader_stops_at_a_corrupt_frame_end_however_the_stream_is_split(
    frames: list[tuple[int, int, bytes]], bad: st.DataObject
) -> None:
    index = bad.draw(st.integers(0, len(frames) - 1))
    encoded = [raw_frame(t, c, p) for t, c, p in frames]
    encoded[index] = encoded[index][:-1] + bad.draw(
        st.binary(min_size=1, max_size=1).filter(lambda b: b != b"\xce")
    )
    stream = b"".join(encoded)
    cuts = bad.draw(st.lists(st.integers(0, len(stream)), max_size=8))
    reader = FrameReader(frame_max=4096)
    got: list[tuple[int, int, bytes]] = []
    with pytest.raises(AMQPError) as info:
        for chunk in chunked(stream, cuts):
            got += reader.feed(chunk)
    assert info.value.code == ReplyCode.FRAME_ERROR
    # Whatever came out before the error is a prefix of the good frames, never garbage.
    assert got == frames[: len(got)] and len(got) <= index


@settings(max_examples=100, deadline=None)
@given(size=st.integers(4096 - 7, 1 << 31), ftype=st.sampled_from([1, 2, 3]))
def test_frame_reader_refuses_an_oversize_frame_from_its_header_alone(
    size: int, ftype: int
) -> None:
    reader = FrameReader(frame_max=4096)
    with pytest.raises(AMQPError) as info:
        reader.feed(struct.pack(">BHI", ftype, 1, size))
    assert info.value.code == ReplyCode.FRAME_ERROR


# -- (c) a real broker -----------------------------------------------------------------------


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    garbage=st.binary(min_size=1, max_size=4096),
    after_handshake=st.booleans(),
)
def test_garbage_on_a_socket_leaves_the_broker_serving(
    broker: BrokerProcess, garbage: bytes, after_handshake: bool
) -> None:
    baseline = connections(broker)
    with RawClient(broker.host, broker.port, timeout=2) as client:
        if after_handshake:
            client.handshake()
            client.open_channel(1)
        # The broker may hang up before it has read everything.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            client.send(garbage)
    wait_for("the connection count back to its baseline", lambda: connections(broker) == baseline)
    pika_round_trip(broker.url)


def test_garbage_after_a_valid_header_is_answered_with_frame_error(broker: BrokerProcess) -> None:
    with RawClient(broker.host, broker.port) as client:
        client.send(PROTOCOL_HEADER)
        client.expect(commands.Connection.Start, 0)
        client.send(b"\xff" * 64)
        close = client.expect(commands.Connection.Close, 0)
        assert close.reply_code == ReplyCode.FRAME_ERROR
        client.wait_closed()
    pika_round_trip(broker.url)


def test_decode_frames_helper_round_trips_the_corpus() -> None:
    # Guards the corpus itself: every entry is whole frames that pamqp can read back.
    for entry in CORPUS:
        assert decode_frames(entry)
