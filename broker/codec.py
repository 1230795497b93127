"""AMQP 0-9-1 frame codec: bytes in, frames out; frames in, bytes out.

`pamqp` encodes and decodes every method. The few methods on the hot path
(`basic.publish`, `basic.ack` from clients; `basic.deliver` and `basic.ack` to
them) and content headers have hand-written codecs: decoding a content header
into a property object per message costs more than routing it, and the broker
only needs five of its properties.

Content headers: validated at publish, then opaque bytes. `decode_content_header`
checks every property of every published message (structure, UTF-8 short
strings, the headers table within the bounds of `fieldtable`) and refuses a bad
one with a connection error (501 frame error when it cannot be decoded, 502
syntax error when it holds values the broker will not carry). From then on the
header is bytes: delivered as received, journaled and replicated as received.
The two places that must look inside (headers-exchange routing and the
`x-death` rewrite of dead-lettering) use the lossless `fieldtable` codec and
`rebuild_header`, which copy every property they do not change byte for byte
and never interpret a value (a timestamp, a decimal, a byte array), so no value
can make them raise. Why this and not "opaque everywhere": the broker must read
headers to route and must write `x-death`, and a header the broker cannot read
would also break the consumers' client libraries (pika and pamqp decode every
property); refusing it at the door is the one place where the publisher, not an
innocent consumer, hears about it. Headers that never passed this check (stored
by another broker version) are still handled: `header_message_id` never raises,
and dead-lettering falls back to forwarding such a header unchanged.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import ClassVar, Final

from pamqp import commands, header
from pamqp import frame as pamqp_frame
from pamqp.base import Frame as MethodFrame
from pamqp.exceptions import UnmarshalingException

from twinmq.broker import fieldtable
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

MAX_EXPIRY_MS: Final = 0xFFFFFFFF  # RabbitMQ's bound on expiration and TTL arguments

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


# Method fields that carry field tables (queue/exchange arguments, client properties).
_TABLE_ARGUMENTS: Final = ("arguments", "client_properties")


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
        method = pamqp_frame._unmarshal_method_frame(payload)
        for name in _TABLE_ARGUMENTS:
            table = getattr(method, name, None)
            if table:
                fieldtable.check_decoded(table)
        return method
    except fieldtable.FieldTableError as exc:
        raise AMQPError(exc.code, f"{name} table refused: {exc}", class_id, method_id) from None
    except RecursionError:
        # pamqp's decoder is recursive: a table nested thousands deep ends here.
        raise AMQPError(
            ReplyCode.SYNTAX_ERROR,
            f"field table nested deeper than {fieldtable.MAX_DEPTH} levels",
            class_id,
            method_id,
        ) from None
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
    except (OverflowError, OSError) as exc:
        # pamqp turns table timestamps into datetimes: one past year 9999 cannot be.
        raise AMQPError(
            ReplyCode.SYNTAX_ERROR,
            f"method {class_id}.{method_id} carries a value out of range: {exc}",
            class_id,
            method_id,
        ) from None


# Tables already checked, by their bytes (one publisher tends to send the same headers);
# only small ones, so the cache stays small however many distinct tables arrive.
_VALID_TABLES: dict[bytes, None] = {}
_VALID_TABLES_MAX = 4096
_CACHED_TABLE_MAX = 2048


def _check_table(payload: bytes, pos: int) -> int:
    """Check the headers table at `pos` (see `fieldtable`); returns the offset after it."""
    if len(payload) - pos < 4:
        raise AMQPError(ReplyCode.FRAME_ERROR, "headers table overruns the content header")
    end: int = pos + 4 + _U32.unpack_from(payload, pos)[0]
    if end > len(payload):
        raise AMQPError(ReplyCode.FRAME_ERROR, "headers table overruns the content header")
    table = payload[pos:end]
    if table in _VALID_TABLES:
        return end
    try:
        fieldtable.decode_table(table)
    except fieldtable.FieldTableError as exc:
        raise AMQPError(exc.code, f"headers table refused: {exc}", 60, 40) from None
    if len(table) <= _CACHED_TABLE_MAX:
        if len(_VALID_TABLES) >= _VALID_TABLES_MAX:
            _VALID_TABLES.clear()
        _VALID_TABLES[table] = None
    return end


def _skip_short_str(data: bytes, pos: int) -> int:
    """The offset after the short string at `pos`, which must be UTF-8 (AMQP 4.2.5.3)."""
    end = pos + 1 + data[pos]
    if end > len(data):
        raise IndexError("short string overruns the content header")
    raw = data[pos + 1 : end]
    if not raw.isascii():
        raw.decode("utf-8")  # UnicodeDecodeError: refused as a syntax error
    return end


# Property flags of the basic class, in wire order (bit 15 first), and their AMQP types.
PROPERTY_FLAGS: Final[tuple[tuple[int, str, str], ...]] = (
    (0x8000, "content-type", "shortstr"),
    (0x4000, "content-encoding", "shortstr"),
    (0x2000, "headers", "table"),
    (0x1000, "delivery-mode", "octet"),
    (0x0800, "priority", "octet"),
    (0x0400, "correlation-id", "shortstr"),
    (0x0200, "reply-to", "shortstr"),
    (0x0100, "expiration", "shortstr"),
    (0x0080, "message-id", "shortstr"),
    (0x0040, "timestamp", "timestamp"),
    (0x0020, "type", "shortstr"),
    (0x0010, "user-id", "shortstr"),
    (0x0008, "app-id", "shortstr"),
    (0x0004, "cluster-id", "shortstr"),
)


def decode_content_header(payload: bytes) -> ContentHeaderInfo:
    """Validate a content header and read what the broker needs from it.

    Every property is checked here, at publish, so nothing downstream (headers
    routing, dead-lettering, delivery, recovery) meets a header it cannot handle:
    lengths within the frame and nothing after the last property (else 501
    frame error), every short string UTF-8, no unknown property flag, the headers
    table within the bounds of `fieldtable` (else 502 syntax error). Values are
    otherwise carried as sent: a timestamp, a delivery mode or a priority is never
    interpreted beyond what the broker needs. Walks the property list by its
    flags without building a property object (tables are checked once per distinct
    table, from a bounded cache).
    """
    try:
        class_id, _weight, body_size, flags = _HEADER_PREFIX.unpack_from(payload)
        pos = 14
        if flags & 3:
            if flags & 1:
                raise AMQPError(ReplyCode.FRAME_ERROR, "continued property flags are not supported")
            raise AMQPError(
                ReplyCode.SYNTAX_ERROR, f"unknown content header property flags {flags:#06x}"
            )
        persistent = False
        expiration: int | None = None
        message_id: str | None = None
        user_id: str | None = None
        if flags & 0x8000:  # content-type
            pos = _skip_short_str(payload, pos)
        if flags & 0x4000:  # content-encoding
            pos = _skip_short_str(payload, pos)
        if flags & 0x2000:  # headers
            pos = _check_table(payload, pos)
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
        if flags & 0x000C:
            if flags & 0x0008:  # app-id
                pos = _skip_short_str(payload, pos)
            if flags & 0x0004:  # cluster-id (deprecated; carried as sent)
                pos = _skip_short_str(payload, pos)
        if pos != len(payload):
            if pos > len(payload):
                raise ValueError("properties overrun the frame")
            raise ValueError(f"{len(payload) - pos} bytes after the last property")
    except AMQPError:
        raise
    except UnicodeDecodeError:
        raise AMQPError(
            ReplyCode.SYNTAX_ERROR, "content header property is not valid UTF-8", 60, 40
        ) from None
    except (IndexError, ValueError, struct.error) as exc:
        raise AMQPError(ReplyCode.FRAME_ERROR, f"malformed content header: {exc}") from None
    return ContentHeaderInfo(class_id, body_size, persistent, expiration, message_id, user_id)


def header_message_id(payload: bytes) -> str | None:
    """The message id of a stored or replicated header, None if it has none or is malformed.

    Never raises: recovery, replication and the audit log call it on headers another
    broker version may have accepted.
    """
    if len(payload) < 14 or not payload[13] & 0x80:
        return None  # no message-id flag (most messages): nothing to decode
    try:
        return decode_content_header(payload).message_id
    except AMQPError:
        return None


def property_spans(payload: bytes) -> dict[int, tuple[int, int]]:
    """Where each present property's encoded value lies: flag -> (start, end).

    Structure only (lengths, no UTF-8 or table checks); `ValueError` if the
    properties overrun the payload or a continued flags word is set.
    """
    if len(payload) < 14:
        raise ValueError("content header too short")
    flags = _U16.unpack_from(payload, 12)[0]
    if flags & 1:
        raise ValueError("continued property flags")
    spans: dict[int, tuple[int, int]] = {}
    pos = 14
    n = len(payload)
    for flag, _name, kind in PROPERTY_FLAGS:
        if not flags & flag:
            continue
        if pos >= n:
            raise ValueError("properties overrun the content header")
        if kind == "shortstr":
            end = pos + 1 + payload[pos]
        elif kind == "table":
            if n - pos < 4:
                raise ValueError("headers table overruns the content header")
            end = pos + 4 + _U32.unpack_from(payload, pos)[0]
        elif kind == "octet":
            end = pos + 1
        else:
            end = pos + 8
        if end > n:
            raise ValueError("properties overrun the content header")
        spans[flag] = (pos, end)
        pos = end
    return spans


def rebuild_header(
    payload: bytes, replace: dict[int, bytes | None], body_size: int | None = None
) -> bytes:
    """A content header with some properties replaced (raw encoded bytes) or removed (None).

    Every other property is copied byte for byte: the broker never re-encodes what it
    did not change. `ValueError` if the payload's properties cannot be walked.
    """
    spans = property_spans(payload)
    class_id, weight, size = struct.unpack_from(">HHQ", payload)
    flags = 0
    parts: list[bytes] = []
    for flag, _name, _kind in PROPERTY_FLAGS:
        if flag in replace:
            value = replace[flag]
        elif flag in spans:
            start, end = spans[flag]
            value = payload[start:end]
        else:
            value = None
        if value is not None:
            flags |= flag
            parts.append(value)
    size = size if body_size is None else body_size
    return struct.pack(">HHQH", class_id, weight, size, flags) + b"".join(parts)


def decode_headers(payload: bytes) -> fieldtable.Table:
    """The headers table of a content header (empty if it has none).

    Raises `ValueError` (`fieldtable.FieldTableError` included) if the header or the
    table is malformed or beyond the bounds.
    """
    span = property_spans(payload).get(0x2000)
    if span is None:
        return fieldtable.Table()
    table, _end = fieldtable.decode_table(payload[span[0] : span[1]])
    return table


def parse_expiration(text: str) -> int:
    """Parse the `expiration` property (milliseconds as a decimal string), as RabbitMQ does."""
    # ASCII digits only: str.isdigit() is true for "²", which int() refuses.
    if not (text.isascii() and text.isdigit()):
        raise AMQPError(ReplyCode.PRECONDITION_FAILED, f"invalid expiration '{text}'", 60, 40)
    value = int(text)
    if value > MAX_EXPIRY_MS:
        raise AMQPError(
            ReplyCode.PRECONDITION_FAILED,
            f"invalid expiration '{text}': larger than {MAX_EXPIRY_MS} ms",
            60,
            40,
        )
    return value


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
    """Fully decode a content header's properties with pamqp (tools and tests).

    Lossy and may raise (`ValueError`, `OverflowError`: pamqp reads timestamps as
    datetimes): the broker's own paths use `decode_headers` and `rebuild_header`.
    """
    content = header.ContentHeader()
    content.unmarshal(header_payload)
    return content.properties
