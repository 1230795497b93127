"""The codec's hot-path shortcuts give exactly what the general path gives."""

from __future__ import annotations

import pytest
from pamqp import commands, frame

from twinmq.broker import codec
from twinmq.broker.codec import FrameReader, Publish, decode_method, encode_deliver


@pytest.mark.parametrize(
    ("channel", "tag", "delivery_tag", "redelivered", "exchange", "routing_key"),
    [
        (1, "c", 1, False, "", "q"),
        (7, "amq.ctag-" + "x" * 40, 2**63 - 1, True, "ex.é", "r" * 255),
        (65535, "t" * 255, 0, False, "e" * 255, ""),
    ],
)
def test_encode_deliver_matches_pamqp(
    channel: int, tag: str, delivery_tag: int, redelivered: bool, exchange: str, routing_key: str
) -> None:
    for _ in range(2):  # the second call is served from the cache
        ex, rk = exchange.encode(), routing_key.encode()
        data = encode_deliver(channel, tag.encode(), delivery_tag, redelivered, ex, rk)
        consumed, ch, method = frame.unmarshal(data)
        assert (consumed, ch) == (len(data), channel)
        assert isinstance(method, commands.Basic.Deliver)
        assert (method.consumer_tag, method.delivery_tag, method.redelivered) == (
            tag,
            delivery_tag,
            redelivered,
        )
        assert (method.exchange, method.routing_key) == (exchange, routing_key)


def test_publish_decode_is_cached_by_exact_bytes() -> None:
    def payload(rk: str, mandatory: bool) -> bytes:
        method = commands.Basic.Publish(exchange="x", routing_key=rk, mandatory=mandatory)
        return frame.marshal(method, 1)[7:-1]

    a = decode_method(payload("k", False))
    assert decode_method(bytes(payload("k", False))) is a
    b = decode_method(payload("k", True))
    assert b == Publish("x", "k", True, False) and a == Publish("x", "k", False, False)
    with pytest.raises(AttributeError):
        a.routing_key = "other"  # type: ignore[misc]
    for i in range(codec._PUBLISH_CACHE_MAX + 10):
        assert decode_method(payload(f"k{i}", False)).routing_key == f"k{i}"
    assert len(codec._PUBLISH_CACHE) <= codec._PUBLISH_CACHE_MAX


@pytest.mark.parametrize("chunk", [1, 3, 7, 8, 100, 1500, 70000])
def test_frame_reader_any_chunking(chunk: int) -> None:
    body = bytes(range(256)) * 8
    stream = b"".join(
        frame.marshal(commands.Basic.Ack(delivery_tag=i), i % 3 + 1)
        + bytes((3, 0, 1)) + len(body).to_bytes(4, "big") + body + b"\xce"
        for i in range(20)
    )  # fmt: skip
    reader = FrameReader(131072)
    got = []
    for pos in range(0, len(stream), chunk):
        got += reader.feed(stream[pos : pos + chunk])
    assert reader.buffered == 0
    assert len(got) == 40
    assert all(type(p) is bytes for _, _, p in got)
    assert [f[2] for f in got[1::2]] == [body] * 20
    assert [(t, c) for t, c, _ in got[::2]] == [(1, i % 3 + 1) for i in range(20)]
