"""AMQP 0-9-1 frame codec: bytes in, frames out; frames in, bytes out.

`pamqp` encodes and decodes every method. The few methods on the hot path
(`basic.publish`, `basic.ack` from clients; `basic.deliver` and `basic.ack` to
them) and content headers have hand-written codecs: decoding a content header
into a property object per message costs more than routing it, and the broker
only needs five of its properties.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar, Final

from pamqp import commands, decode, header
from pamqp import frame as pamqp_frame
from pamqp.base import Frame as MethodFrame
from pamqp.exceptions import UnmarshalingException

from twinmq.broker.errors import AMQPError, ReplyCode

FRAME_METHOD: Final = 1
FRAME_HEADER: Final = 2
FRAME_BODY: Final = 3
FRAME_HEARTBEAT: Final = 8
FRAME_END: Final = 0xCE
FRAME_END_BYTE: Final = b"\xce"
FRAME_OVERHEAD: Final = 8  # 7-byte frame header + frame-end octet
PROTOCOL_HEADER: Final = b"AMQP\x00\x00\x09\x01"

HEARTBEAT_FRAME: Final = b"\x08\x00\x00\x00\x00\x00\x00\xce"

_FRAME_HEADER = struct.Struct(">BHI")
_METHOD_ID = struct.Struct(">HH")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_HEADER_PREFIX = struct.Struct(">HHQH")  # class, weight, body size, first flags word
_ACK = struct.Struct(">HHQB")
_ACK_FRAME = struct.Struct(">BHIHHQBB")

BASIC_PUBLISH: Final = (60 << 16) | 40
BASIC_ACK: Final = (60 << 16) | 80


@dataclass(frozen=True, slots=True)
class Publish:
    """A decoded `basic.publish` (fast path; the immediate flag is refused by the channel).

    Immutable: `decode_method` hands out the same object for identical method frames.
    """

    name: ClassVar[str] = "Basic.Publish"  # as pamqp names its methods, for error texts
    exchange: str
    routing_key: str
    mandatory: bool
    immediate: bool


@dataclass(slots=True)
class Ack:
    """A decoded client `basic.ack` (fast path)."""

    name: ClassVar[str] = "Basic.Ack"
    delivery_tag: int
    multiple: bool


Method = MethodFrame | Publish | Ack


@dataclass(slots=True)
class ContentHeaderInfo:
    """What the broker reads from a content header; the raw payload is kept and re-sent as is."""

    class_id: int
    body_size: int
    persistent: bool
    expiration_ms: int | None
    message_id: str | None
    user_id: str | None = None  # checked against the login, as RabbitMQ does


class FrameReader:
    """Splits a byte stream into (frame type, channel, payload) triples.

    Raises `AMQPError` (a connection error) for a malformed stream: an oversize
    frame, a missing frame-end octet, an unknown frame type.
    """

    def __init__(self, frame_max: int) -> None:
        self.frame_max = frame_max
        self._buf = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a complete frame."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        """Add received bytes and return every frame they complete."""
        buf = self._buf
        frame_max = self.frame_max
        if buf:
            # A frame began in an earlier read: collect until at least one completes
            # (a large frame arriving in small reads is appended, never re-copied).
            buf += data
            if len(buf) < 7:
                return []
            size = _FRAME_HEADER.unpack_from(buf)[2]
            if size + FRAME_OVERHEAD > frame_max:
                raise AMQPError(
                    ReplyCode.FRAME_ERROR,
                    f"frame of {size + FRAME_OVERHEAD} bytes exceeds frame_max {frame_max}",
                )
            if 7 + size >= len(buf):
                return []
            data = bytes(buf)
            buf.clear()
        elif type(data) is not bytes:
            data = bytes(data)
        # Payloads are sliced straight from the read's bytes: one copy per frame.
        frames: list[tuple[int, int, bytes]] = []
        append = frames.append
        pos = 0
        n = len(data)
        unpack = _FRAME_HEADER.unpack_from
        while n - pos >= 7:
            ftype, channel, size = unpack(data, pos)
            if size + FRAME_OVERHEAD > frame_max:
                raise AMQPError(
                    ReplyCode.FRAME_ERROR,
                    f"frame of {size + FRAME_OVERHEAD} bytes exceeds frame_max {frame_max}",
                )
            end = pos + 7 + size
            if end >= n:
                break
            if data[end] != FRAME_END:
                raise AMQPError(ReplyCode.FRAME_ERROR, "frame-end octet missing")
            if ftype not in (FRAME_METHOD, FRAME_HEADER, FRAME_BODY, FRAME_HEARTBEAT):
                raise AMQPError(ReplyCode.FRAME_ERROR, f"unknown frame type {ftype}")
            append((ftype, channel, data[pos + 7 : end]))
            pos = end + 1
        if pos < n:
            buf += memoryview(data)[pos:]
        return frames


_PUBLISH_CACHE: dict[bytes, Publish] = {}
_PUBLISH_CACHE_MAX = 1024


def _short_str(data: bytes, pos: int) -> tuple[str, int]:
    length = data[pos]
    end = pos + 1 + length
    if end > len(data):
        raise ValueError("short string overruns the frame")
    return data[pos + 1 : end].decode("utf-8"), end


def decode_method(payload: bytes) -> Method:
    """Decode a method frame's payload; `AMQPError` for an unknown or malformed method."""
    if len(payload) < 4:
        raise AMQPError(ReplyCode.FRAME_ERROR, "method frame too short")
    cached = _PUBLISH_CACHE.get(payload)
    if cached is not None:
        return cached
    class_id, method_id = _METHOD_ID.unpack_from(payload)
    index = (class_id << 16) | method_id
    try:
        if index == BASIC_PUBLISH:
            exchange, pos = _short_str(payload, 6)
            routing_key, pos = _short_str(payload, pos)
            bits = payload[pos]
            publish = Publish(exchange, routing_key, bool(bits & 1), bool(bits & 2))
            # Publishers repeat the same exchange and routing key: remember the decoded
            # method by its exact bytes (a bounded cache; Publish is immutable).
            if len(_PUBLISH_CACHE) >= _PUBLISH_CACHE_MAX:
                _PUBLISH_CACHE.clear()
            _PUBLISH_CACHE[payload] = publish
            return publish
        if index == BASIC_ACK:
            _, _, tag, bits = _ACK.unpack_from(payload)
            return Ack(tag, bool(bits & 1))
    except (IndexError, ValueError, struct.error) as exc:
        raise AMQPError(ReplyCode.FRAME_ERROR, f"malformed method frame: {exc}") from exc
    try:
        return pamqp_frame._unmarshal_method_frame(payload)
    except UnmarshalingException as exc:
        if index not in commands.INDEX_MAPPING:
            raise AMQPError(
                ReplyCode.COMMAND_INVALID,
                f"unknown method {class_id}.{method_id}",
                class_id,
                method_id,
            ) from exc
        raise AMQPError(
            ReplyCode.FRAME_ERROR, f"malformed method frame {class_id}.{method_id}"
        ) from exc
    except (ValueError, UnicodeDecodeError, IndexError, struct.error) as exc:
        raise AMQPError(
            ReplyCode.FRAME_ERROR, f"malformed method frame {class_id}.{method_id}"
        ) from exc


_VALID_TABLES: dict[bytes, None] = {}


def _check_table(table: bytes) -> None:
    """Refuse a malformed headers table here, before it can poison a consumer.

    Decoding costs tens of microseconds per table, so tables already seen (one
    publisher tends to send the same headers) are remembered, boundedly.
    """
    if table in _VALID_TABLES:
        return
    try:
        used, _ = decode.field_table(table)
    except (ValueError, UnicodeDecodeError, IndexError, struct.error, KeyError) as exc:
        raise AMQPError(ReplyCode.FRAME_ERROR, f"malformed headers table: {exc}") from exc
    if used != len(table):
        raise AMQPError(ReplyCode.FRAME_ERROR, "malformed headers table: length mismatch")
    if len(_VALID_TABLES) >= 4096:
        _VALID_TABLES.clear()
    _VALID_TABLES[table] = None


def _skip_short_str(data: bytes, pos: int) -> int:
    return pos + 1 + data[pos]


def decode_content_header(payload: bytes) -> ContentHeaderInfo:
    """Read body size, delivery mode, expiration and message-id from a content header.

    Walks the property list by its flags without building a property object.
    """
    try:
        class_id, _weight, body_size, flags = _HEADER_PREFIX.unpack_from(payload)
        pos = 14
        if flags & 1:
            raise AMQPError(ReplyCode.FRAME_ERROR, "continued property flags are not supported")
        persistent = False
        expiration: int | None = None
        message_id: str | None = None
        user_id: str | None = None
        if flags & 0x8000:  # content-type
            pos = _skip_short_str(payload, pos)
        if flags & 0x4000:  # content-encoding
            pos = _skip_short_str(payload, pos)
        if flags & 0x2000:  # headers
            (table_len,) = struct.unpack_from(">I", payload, pos)
            _check_table(payload[pos : pos + 4 + table_len])
            pos += 4 + table_len
        if flags & 0x1000:  # delivery-mode
            persistent = payload[pos] == 2
            pos += 1
        if flags & 0x0800:  # priority
            pos += 1
        if flags & 0x0400:  # correlation-id
            pos = _skip_short_str(payload, pos)
        if flags & 0x0200:  # reply-to
            pos = _skip_short_str(payload, pos)
        if flags & 0x0100:  # expiration
            text, pos = _short_str(payload, pos)
            expiration = parse_expiration(text)
        if flags & 0x0080:  # message-id
            message_id, pos = _short_str(payload, pos)
        if flags & 0x0040:  # timestamp
            pos += 8
        if flags & 0x0020:  # type
            pos = _skip_short_str(payload, pos)
        if flags & 0x0010:  # user-id
            user_id, pos = _short_str(payload, pos)
        if pos > len(payload):
            raise ValueError("properties overrun the frame")
    except AMQPError:
        raise
    except (IndexError, ValueError, struct.error) as exc:
        raise AMQPError(ReplyCode.FRAME_ERROR, f"malformed content header: {exc}") from exc
    return ContentHeaderInfo(class_id, body_size, persistent, expiration, message_id, user_id)


def parse_expiration(text: str) -> int:
    """Parse the `expiration` property (milliseconds as a decimal string), as RabbitMQ does."""
    if not text.isdigit():
        raise AMQPError(ReplyCode.PRECONDITION_FAILED, f"invalid expiration '{text}'", 60, 40)
    return int(text)


def encode_method(channel: int, method: MethodFrame) -> bytes:
    """Encode any method as a complete frame."""
    return pamqp_frame.marshal(method, channel)


def encode_deliver(
    channel: int,
    consumer_tag: bytes,
    delivery_tag: int,
    redelivered: bool,
    exchange: bytes,
    routing_key: bytes,
) -> bytes:
    """Encode `basic.deliver` as a complete frame; the string arguments are UTF-8 already.

    Everything but the delivery tag and the redelivered flag is the same for every
    delivery of a consumer from one exchange and routing key: those two byte runs
    are built once and kept in a bounded cache.
    """
    key = (channel, consumer_tag, exchange, routing_key)
    parts = _DELIVER_CACHE.get(key)
    if parts is None:
        size = 16 + len(consumer_tag) + len(exchange) + len(routing_key)
        head = b"".join(
            (
                _FRAME_HEADER.pack(FRAME_METHOD, channel, size),
                b"\x00\x3c\x00\x3c",
                bytes((len(consumer_tag),)),
                consumer_tag,
            )
        )
        tail = b"".join(
            (bytes((len(exchange),)), exchange, bytes((len(routing_key),)), routing_key)
        )
        parts = (head, tail + FRAME_END_BYTE)
        if len(_DELIVER_CACHE) >= _DELIVER_CACHE_MAX:
            _DELIVER_CACHE.clear()
        _DELIVER_CACHE[key] = parts
    return b"".join(
        (parts[0], _U64.pack(delivery_tag), b"\x01" if redelivered else b"\x00", parts[1])
    )


_DELIVER_CACHE: dict[tuple[int, bytes, bytes, bytes], tuple[bytes, bytes]] = {}
_DELIVER_CACHE_MAX = 4096


# The methods below carry queue and exchange names back to the client. They are encoded
# by hand because pamqp's constructors check names against the spec's old pattern
# (ASCII letters and a few signs, exchanges up to 127 characters), while RabbitMQ, and so
# TwinMQ, takes any UTF-8 name up to 255 bytes.


def _method_frame(channel: int, payload: bytes) -> bytes:
    return b"".join(
        (_FRAME_HEADER.pack(FRAME_METHOD, channel, len(payload)), payload, FRAME_END_BYTE)
    )


def _shortstr(text: str) -> bytes:
    data = text.encode()
    if len(data) > 255:
        raise ValueError(f"short string of {len(data)} bytes")
    return bytes((len(data),)) + data


def encode_get_ok(
    channel: int,
    delivery_tag: int,
    redelivered: bool,
    exchange: str,
    routing_key: str,
    message_count: int,
) -> bytes:
    """Encode `basic.get-ok`."""
    return _method_frame(
        channel,
        b"\x00\x3c\x00\x47"
        + _U64.pack(delivery_tag)
        + (b"\x01" if redelivered else b"\x00")
        + _shortstr(exchange)
        + _shortstr(routing_key)
        + _U32.pack(message_count),
    )


def encode_declare_ok(channel: int, queue: str, message_count: int, consumer_count: int) -> bytes:
    """Encode `queue.declare-ok`."""
    return _method_frame(
        channel,
        b"\x00\x32\x00\x0b"
        + _shortstr(queue)
        + _U32.pack(message_count)
        + _U32.pack(consumer_count),
    )


def encode_return(
    channel: int, reply_code: int, reply_text: str, exchange: str, routing_key: str
) -> bytes:
    """Encode `basic.return`."""
    return _method_frame(
        channel,
        b"\x00\x3c\x00\x32"
        + _U16.pack(reply_code)
        + _shortstr(reply_text)
        + _shortstr(exchange)
        + _shortstr(routing_key),
    )


def encode_basic_ack(channel: int, delivery_tag: int, multiple: bool) -> bytes:
    """Encode a publisher-confirm `basic.ack` as a complete frame."""
    return _ACK_FRAME.pack(
        FRAME_METHOD, channel, 13, 60, 80, delivery_tag, 1 if multiple else 0, FRAME_END
    )


def encode_basic_nack(channel: int, delivery_tag: int, multiple: bool) -> bytes:
    """Encode a publisher-confirm `basic.nack` (requeue flag unset) as a complete frame."""
    return _ACK_FRAME.pack(
        FRAME_METHOD, channel, 13, 60, 120, delivery_tag, 1 if multiple else 0, FRAME_END
    )


def encode_content(channel: int, header_payload: bytes, body: bytes, frame_max: int) -> bytes:
    """Encode a content header frame (from its raw payload) and the body frames."""
    parts: list[bytes | memoryview] = [
        _FRAME_HEADER.pack(FRAME_HEADER, channel, len(header_payload)),
        header_payload,
        FRAME_END_BYTE,
    ]
    chunk = frame_max - FRAME_OVERHEAD
    size = len(body)
    if size <= chunk:
        if size:
            parts += (_FRAME_HEADER.pack(FRAME_BODY, channel, size), body, FRAME_END_BYTE)
    else:
        view = memoryview(body)
        for start in range(0, size, chunk):
            piece = view[start : start + chunk]
            parts += (_FRAME_HEADER.pack(FRAME_BODY, channel, len(piece)), piece, FRAME_END_BYTE)
    return b"".join(parts)


def encode_header_payload(properties: commands.Basic.Properties, body_size: int) -> bytes:
    """Encode a content header payload from a property object (for messages the broker makes)."""
    return header.ContentHeader(0, body_size, properties).marshal()


def decode_properties(header_payload: bytes) -> commands.Basic.Properties:
    """Fully decode a content header's properties (slow path: dead-lettering, admin)."""
    content = header.ContentHeader()
    content.unmarshal(header_payload)
    return content.properties
