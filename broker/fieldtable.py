"""AMQP 0-9-1 field tables: a strict, bounded and lossless codec.

The broker reads field tables in three places: it checks every `headers`
property at publish, it matches headers against headers-exchange bindings, and
it rewrites `x-death` when it dead-letters a message. The rules:

- **Strict at publish.** `decode_table` refuses what it cannot decode (an
  unknown field type, a length that overruns its table: `ReplyCode.FRAME_ERROR`)
  and what it will not carry (a key that is not UTF-8, a table nested deeper than
  `MAX_DEPTH`, more than `MAX_FIELDS` values or more than `MAX_TABLE_BYTES`
  bytes: `ReplyCode.SYNTAX_ERROR`). Field types are RabbitMQ's (its 0-9-1
  errata: `s` is a signed 16-bit integer) plus `L` (unsigned 64-bit), which
  pamqp and pika both read.
- **Lossless.** A scalar is kept as its type octet and its encoded bytes, never
  interpreted: timestamps beyond year 9999, decimals of any scale, NaN floats,
  byte arrays and long strings that are not UTF-8 go back out exactly as they
  came in, so no value can make the broker raise and re-encoding a table the
  broker did not change yields the same bytes.
- **Never raises on the slow path.** `to_python` turns a decoded value into
  what pamqp would have made of it (for comparing with binding arguments) and
  falls back to the raw bytes where pamqp would have raised.

The bounds are far above what real clients send (a few dozen headers, nested
two or three levels; the broker's own `x-death` is four levels deep) and keep
the cost of checking one table small and predictable.
"""

from __future__ import annotations

import datetime
import decimal
import struct
from dataclasses import dataclass
from typing import Any, Final

from twinmq.broker.errors import ReplyCode

MAX_DEPTH: Final = 32
"""Nesting levels of tables and arrays; the `headers` table itself is level 1."""
MAX_FIELDS: Final = 2048
"""Values in one table, counting every nested value (a nested table counts too)."""
MAX_TABLE_BYTES: Final = 65536
"""Encoded size of one top-level table, its 4-byte length included."""

# Scalar field types and their fixed encoded sizes (None: a u32 length prefix follows).
_FIXED: Final[dict[int, int | None]] = {
    ord("t"): 1,
    ord("b"): 1,
    ord("B"): 1,
    ord("s"): 2,
    ord("u"): 2,
    ord("I"): 4,
    ord("i"): 4,
    ord("l"): 8,
    ord("L"): 8,
    ord("f"): 4,
    ord("d"): 8,
    ord("D"): 5,
    ord("T"): 8,
    ord("V"): 0,
    ord("S"): None,
    ord("x"): None,
}
_TABLE: Final = ord("F")
_ARRAY: Final = ord("A")
_U32 = struct.Struct(">I")
_INT_FORMATS: Final = {
    "b": ">b",
    "B": ">B",
    "s": ">h",
    "u": ">H",
    "I": ">i",
    "i": ">I",
    "l": ">q",
    "L": ">Q",
}


class FieldTableError(ValueError):
    """A table the broker refuses; `code` is the AMQP reply code to close with."""

    def __init__(self, code: ReplyCode, text: str) -> None:
        super().__init__(text)
        self.code = code


@dataclass(frozen=True, slots=True)
class Scalar:
    """A field value other than a table or an array, kept as it was encoded."""

    kind: str  # the field-type octet, e.g. "S"
    raw: bytes  # the encoded value after the type octet (length prefix included)


@dataclass(frozen=True, slots=True)
class Table:
    """A field table: (key, value) pairs in wire order, duplicate keys kept."""

    items: tuple[tuple[str, Value], ...] = ()

    def get(self, key: str) -> Value | None:
        """The value of the last field named `key` (as pamqp, pika and RabbitMQ read it)."""
        found: Value | None = None
        for name, value in self.items:
            if name == key:
                found = value
        return found

    def without(self, key: str) -> Table:
        """This table with every field named `key` removed."""
        return Table(tuple(item for item in self.items if item[0] != key))


@dataclass(frozen=True, slots=True)
class Array:
    """A field array."""

    items: tuple[Value, ...] = ()


Value = Scalar | Table | Array


class _Budget:
    """What is left of the field-count bound while one table is decoded."""

    __slots__ = ("fields",)

    def __init__(self) -> None:
        self.fields = MAX_FIELDS

    def take(self) -> None:
        self.fields -= 1
        if self.fields < 0:
            raise FieldTableError(
                ReplyCode.SYNTAX_ERROR, f"field table has more than {MAX_FIELDS} values"
            )


def decode_table(data: bytes, pos: int = 0) -> tuple[Table, int]:
    """Decode the field table at `pos` (its u32 length first); returns it and the end offset.

    Raises `FieldTableError` for a malformed table or one beyond the bounds.
    """
    if len(data) - pos < 4:
        raise FieldTableError(ReplyCode.FRAME_ERROR, "field table length overruns the frame")
    (size,) = _U32.unpack_from(data, pos)
    if size + 4 > MAX_TABLE_BYTES:
        raise FieldTableError(
            ReplyCode.SYNTAX_ERROR,
            f"field table of {size + 4} bytes exceeds the limit of {MAX_TABLE_BYTES}",
        )
    return _table(data, pos, 1, _Budget())


def _table(data: bytes, pos: int, depth: int, budget: _Budget) -> tuple[Table, int]:
    if depth > MAX_DEPTH:
        raise FieldTableError(
            ReplyCode.SYNTAX_ERROR, f"field table nested deeper than {MAX_DEPTH} levels"
        )
    if len(data) - pos < 4:
        raise FieldTableError(ReplyCode.FRAME_ERROR, "field table length overruns the frame")
    (size,) = _U32.unpack_from(data, pos)
    pos += 4
    end = pos + size
    if end > len(data):
        raise FieldTableError(ReplyCode.FRAME_ERROR, "field table overruns its container")
    items: list[tuple[str, Value]] = []
    while pos < end:
        key_len = data[pos]
        key_end = pos + 1 + key_len
        if key_end >= end:  # a key needs its value's type octet after it
            raise FieldTableError(ReplyCode.FRAME_ERROR, "field table key overruns the table")
        try:
            key = data[pos + 1 : key_end].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FieldTableError(
                ReplyCode.SYNTAX_ERROR, "field table key is not valid UTF-8"
            ) from exc
        value, pos = _value(data, key_end, end, depth, budget)
        items.append((key, value))
    return Table(tuple(items)), end


def _array(data: bytes, pos: int, depth: int, budget: _Budget) -> tuple[Array, int]:
    if depth > MAX_DEPTH:
        raise FieldTableError(
            ReplyCode.SYNTAX_ERROR, f"field table nested deeper than {MAX_DEPTH} levels"
        )
    if len(data) - pos < 4:
        raise FieldTableError(ReplyCode.FRAME_ERROR, "field array length overruns the frame")
    (size,) = _U32.unpack_from(data, pos)
    pos += 4
    end = pos + size
    if end > len(data):
        raise FieldTableError(ReplyCode.FRAME_ERROR, "field array overruns its container")
    items: list[Value] = []
    while pos < end:
        value, pos = _value(data, pos, end, depth, budget)
        items.append(value)
    return Array(tuple(items)), end


def _value(data: bytes, pos: int, end: int, depth: int, budget: _Budget) -> tuple[Value, int]:
    """One typed value at `pos` that must end by `end` (its container's end)."""
    budget.take()
    kind = data[pos]
    pos += 1
    if kind in (_TABLE, _ARRAY):
        if end - pos < 4 or pos + 4 + _U32.unpack_from(data, pos)[0] > end:
            raise FieldTableError(ReplyCode.FRAME_ERROR, "nested field value overruns its table")
        if kind == _TABLE:
            return _table(data, pos, depth + 1, budget)
        return _array(data, pos, depth + 1, budget)
    size = _FIXED.get(kind, -1)
    if size is None:
        if end - pos < 4:
            raise FieldTableError(ReplyCode.FRAME_ERROR, "field value overruns its table")
        size = 4 + _U32.unpack_from(data, pos)[0]
    elif size < 0:
        raise FieldTableError(ReplyCode.FRAME_ERROR, f"unknown field type {bytes((kind,))!r}")
    stop = pos + size
    if stop > end:
        raise FieldTableError(ReplyCode.FRAME_ERROR, "field value overruns its table")
    return Scalar(chr(kind), data[pos:stop]), stop


# -- encoding ---------------------------------------------------------------------------------


def encode_table(table: Table) -> bytes:
    """Encode a table, its u32 length first (exactly the bytes it was decoded from)."""
    parts: list[bytes] = []
    for key, value in table.items:
        raw_key = key.encode("utf-8")
        if len(raw_key) > 255:
            raise ValueError(f"field table key of {len(raw_key)} bytes")
        parts.append(bytes((len(raw_key),)) + raw_key)
        parts.append(encode_value(value))
    body = b"".join(parts)
    return _U32.pack(len(body)) + body


def encode_value(value: Value) -> bytes:
    """Encode one value with its type octet."""
    if isinstance(value, Scalar):
        return value.kind.encode("ascii") + value.raw
    if isinstance(value, Table):
        return b"F" + encode_table(value)
    body = b"".join(encode_value(item) for item in value.items)
    return b"A" + _U32.pack(len(body)) + body


def text(value: str) -> Scalar:
    """A long-string value (what RabbitMQ uses for every string it writes into headers)."""
    raw = value.encode("utf-8")
    return Scalar("S", _U32.pack(len(raw)) + raw)


def long_int(value: int) -> Scalar:
    """A signed 64-bit integer value."""
    return Scalar("l", struct.pack(">q", value))


def timestamp(seconds: int) -> Scalar:
    """A timestamp value (seconds since the epoch)."""
    return Scalar("T", struct.pack(">Q", seconds))


# -- reading values ---------------------------------------------------------------------------


def as_text(value: Value | None) -> str | None:
    """The value as text if it is a UTF-8 long string, else None."""
    if isinstance(value, Scalar) and value.kind == "S":
        try:
            return value.raw[4:].decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def as_int(value: Value | None) -> int | None:
    """The value as an integer if it is one of the integer types, else None."""
    if isinstance(value, Scalar):
        fmt = _INT_FORMATS.get(value.kind)
        if fmt is not None:
            return int(struct.unpack(fmt, value.raw)[0])
    return None


def to_python(value: Value) -> Any:
    """The value as pamqp decodes it (for comparing with binding arguments); never raises.

    Where pamqp would raise (a timestamp beyond year 9999), the raw bytes stand in.
    """
    if isinstance(value, Table):
        return {key: to_python(item) for key, item in value.items}
    if isinstance(value, Array):
        return [to_python(item) for item in value.items]
    kind, raw = value.kind, value.raw
    try:
        if kind in _INT_FORMATS:
            return as_int(value)
        if kind == "t":
            return raw != b"\x00"
        if kind == "S":
            try:
                return raw[4:].decode("utf-8")
            except UnicodeDecodeError:
                return raw[4:]
        if kind == "x":
            return raw[4:]
        if kind == "f":
            return struct.unpack(">f", raw)[0]
        if kind == "d":
            return struct.unpack(">d", raw)[0]
        if kind == "D":
            # pamqp reads the mantissa unsigned: binding arguments were decoded that way.
            scale, mantissa = struct.unpack(">BI", raw)
            return decimal.Decimal(mantissa) * (decimal.Decimal(10) ** -scale)
        if kind == "T":
            (seconds,) = struct.unpack(">Q", raw)
            # pamqp's reading: above 2^32 the value is taken for milliseconds.
            stamp = seconds / 1000.0 if seconds > 0xFFFFFFFF else seconds
            return datetime.datetime.fromtimestamp(stamp, tz=datetime.UTC)
    except (ValueError, OverflowError, OSError, ArithmeticError):
        return raw
    return None  # "V": void


def check_decoded(value: Any) -> None:
    """Apply the bounds to a table another codec decoded (pamqp, for method arguments).

    Method arguments (`queue.declare`, `queue.bind`, ...) end up in the stored
    definitions, whose JSON reader stops at a few hundred levels: a deeper table
    accepted here would stop the broker's next start. Raises `FieldTableError`.
    """
    budget = _Budget()
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise FieldTableError(
                ReplyCode.SYNTAX_ERROR, f"field table nested deeper than {MAX_DEPTH} levels"
            )
        if isinstance(item, dict):
            for child in item.values():
                budget.take()
                if isinstance(child, dict | list):
                    stack.append((child, depth + 1))
        elif isinstance(item, list):
            for child in item:
                budget.take()
                if isinstance(child, dict | list):
                    stack.append((child, depth + 1))
