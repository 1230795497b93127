"""Journal ops and their binary codec.

An *op* is one change to a durable queue: a persistent message enqueued
(`StoredMessage`) or a message that left its queue (`Settle`). A *group* of ops
is the unit of atomicity: a journal record's payload and a replication batch's
body are both one encoded group (`encode_ops`), so channel, vhost, audit and
replication code import the op types from here without touching storage.

Ops are tagged little-endian structs::

    message  = u8 1 | u64 mid | u64 qid | f64 expires_at (NaN = never)
               | u16 len(exchange) | u16 len(routing_key) | u32 len(header) | u32 len(body)
               | exchange | routing_key | header | body
    settle   = u8 2 | u64 qid | u64 mid
    carried  = u8 3 | u64 qid | u64 mid | u64 target segment   (written by compaction only)

`mid` is the broker-wide message sequence number (the replication ID,
`broker/epoch.py`); `qid` a queue incarnation. A carried settle names the
*segment number* of the copy it settles (see `segment.py`); it never travels
outside a journal.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "TAG_CARRIED",
    "TAG_MSG",
    "TAG_SETTLE",
    "CorruptRecord",
    "DecodedOp",
    "JournalOp",
    "Settle",
    "StoredMessage",
    "decode_group",
    "decode_ops",
    "encode_carried",
    "encode_message",
    "encode_ops",
    "encode_settle",
]


@dataclass(slots=True, unsafe_hash=True)
class StoredMessage:
    """A persistent message enqueued on a durable queue, as the journal stores it.

    Treated as immutable, but not a frozen dataclass: a frozen one's `__init__`
    sets each field through `object.__setattr__`, twice the cost of this one,
    and one is built per message published and per message replicated.
    """

    mid: int  # broker-wide message sequence number, unique, increasing
    qid: int  # queue incarnation id (QueueDef.qid)
    exchange: str
    routing_key: str
    header: bytes  # raw AMQP content-header properties payload, opaque to the journal
    body: bytes
    expires_at: float | None  # absolute unix time (TTL), None = never


@dataclass(slots=True, frozen=True)
class Settle:
    """The message left the queue: acked, dropped, expired, dead-lettered or purged."""

    qid: int
    mid: int


JournalOp = StoredMessage | Settle

TAG_MSG = 1
TAG_SETTLE = 2
TAG_CARRIED = 3
_MSG = struct.Struct("<BQQdHHII")
_SETTLE = struct.Struct("<BQQ")
_CARRIED = struct.Struct("<BQQQ")
_NAN = math.nan


class CorruptRecord(Exception):
    """Bytes that do not decode as a group of ops."""


# An op as replay sees it: (tag, qid, mid, message or None, carried target segment or 0).
DecodedOp = tuple[int, int, int, StoredMessage | None, int]


def decode_group(data: bytes | memoryview, start: int, end: int) -> list[DecodedOp]:
    """Decode one group (a record's payload). Raises CorruptRecord on anything malformed."""
    out: list[DecodedOp] = []
    pos = start
    try:
        while pos < end:
            tag = data[pos]
            if tag == TAG_MSG:
                _, mid, qid, exp, lx, lr, lh, lb = _MSG.unpack_from(data, pos)
                pos += _MSG.size
                stop = pos + lx + lr + lh + lb
                if stop > end:
                    raise CorruptRecord("message runs past its record")
                exchange = bytes(data[pos : pos + lx]).decode()
                pos += lx
                routing_key = bytes(data[pos : pos + lr]).decode()
                pos += lr
                header = bytes(data[pos : pos + lh])
                pos += lh
                body = bytes(data[pos:stop])
                pos = stop
                msg = StoredMessage(
                    mid, qid, exchange, routing_key, header, body, None if exp != exp else exp
                )
                out.append((TAG_MSG, qid, mid, msg, 0))
            elif tag == TAG_SETTLE:
                _, qid, mid = _SETTLE.unpack_from(data, pos)
                pos += _SETTLE.size
                out.append((TAG_SETTLE, qid, mid, None, 0))
            elif tag == TAG_CARRIED:
                _, qid, mid, target = _CARRIED.unpack_from(data, pos)
                pos += _CARRIED.size
                out.append((TAG_CARRIED, qid, mid, None, target))
            else:
                raise CorruptRecord(f"unknown op tag {tag}")
    except (struct.error, UnicodeDecodeError, IndexError) as exc:
        raise CorruptRecord(str(exc)) from exc
    if pos != end:
        raise CorruptRecord("op runs past its record")
    return out


def encode_message(
    buf: bytearray,
    mid: int,
    qid: int,
    exchange: str,
    routing_key: str,
    header: bytes,
    body: bytes,
    expires_at: float | None,
) -> None:
    """Append one message op to `buf`, from its fields (no `StoredMessage` built).

    For code that encodes many messages it already holds (a catch-up chunk).
    Raises struct.error for a field that does not fit the format.
    """
    ex = exchange.encode()
    rk = routing_key.encode()
    buf += _MSG.pack(
        TAG_MSG,
        mid,
        qid,
        _NAN if expires_at is None else expires_at,
        len(ex),
        len(rk),
        len(header),
        len(body),
    )
    buf += ex
    buf += rk
    buf += header
    buf += body


def encode_settle(buf: bytearray, qid: int, mid: int) -> None:
    """Append one settle op to `buf`."""
    buf += _SETTLE.pack(TAG_SETTLE, qid, mid)


def encode_ops(ops: Sequence[JournalOp], buf: bytearray) -> int:
    """Append the binary form of `ops` to `buf`; return 1 + the highest mid they name.

    The same bytes are a journal record's payload and a replication batch's body.
    Raises ValueError (nothing useful appended: callers truncate) for an op that
    does not fit the format, TypeError for something that is not an op.
    """
    next_mid = 0
    try:
        for op in ops:
            if type(op) is StoredMessage:
                encode_message(
                    buf, op.mid, op.qid, op.exchange, op.routing_key, op.header, op.body,
                    op.expires_at,
                )  # fmt: skip
            elif type(op) is Settle:
                encode_settle(buf, op.qid, op.mid)
            else:
                raise TypeError(f"not a journal op: {op!r}")
            if op.mid >= next_mid:
                next_mid = op.mid + 1
    except struct.error as exc:
        raise ValueError(f"cannot encode journal op: {exc}") from exc
    return next_mid


def encode_carried(carry: dict[int, list[tuple[int, int]]]) -> bytes:
    """The payload of carried settles: target segment number -> (qid, mid) pairs."""
    payload = bytearray()
    for target, pairs in carry.items():
        for qid, mid in pairs:
            payload += _CARRIED.pack(TAG_CARRIED, qid, mid, target)
    return bytes(payload)


def decode_ops(data: bytes) -> list[JournalOp]:
    """Decode what `encode_ops` wrote (messages and settles only); ValueError if malformed."""
    try:
        decoded = decode_group(data, 0, len(data))
    except CorruptRecord as exc:
        raise ValueError(f"malformed ops: {exc}") from exc
    ops: list[JournalOp] = []
    for tag, qid, mid, msg, _target in decoded:
        if tag == TAG_MSG and msg is not None:
            ops.append(msg)
        elif tag == TAG_SETTLE:
            ops.append(Settle(qid, mid))
        else:
            raise ValueError(f"op tag {tag} cannot travel outside a journal")
    return ops
