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

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands

from twinmq.broker.codec import FrameReader
from twinmq.broker.errors import AMQPError, ReplyCode
from twinmq.fuzz.amqp import CORPUS, chunked, fuzz_connection
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.rawamqp import (
    PROTOCOL_HEADER,
    RawClient,
    connections,
    decode_frames,
    pika_round_trip,
    raw_frame,
)
from twinmq.testing.waiting import wait_for

# Fuzzed frames decode to basic.recover-async now and then, which pamqp warns about.
pytestmark = pytest.mark.filterwarnings("ignore:This command is deprecated:DeprecationWarning")

# TWINMQ_FUZZ_EXAMPLES=5000 for a long hunt; the default keeps the file well under 30 s.
FUZZ_EXAMPLES = int(os.environ.get("TWINMQ_FUZZ_EXAMPLES", "150"))
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


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
