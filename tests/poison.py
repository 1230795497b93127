"""Hypothesis strategies for content headers with odd (valid) and poison (invalid) properties.

Shared by the pure codec tests (test_content_headers.py), the fuzz against a
real broker (test_poison_headers.py) and the fault matrix's poison family
(jepsen.py: `sample_headers`, and the `POISON` catalog of headers to refuse).
Tables are generated as `fieldtable` values, so a test knows the exact bytes it
sent; every scalar type appears with its corner values (timestamps past year
9999, decimals pamqp cannot re-encode, byte arrays, long strings that are not
UTF-8, NaN floats).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from twinmq.broker.fieldtable import Array, Scalar, Table, Value, encode_table

_SIZES = {"t": 1, "b": 1, "B": 1, "s": 2, "u": 2, "I": 4, "i": 4, "l": 8, "L": 8}
_SIZES |= {"f": 4, "d": 8, "D": 5, "T": 8, "V": 0}

ODD_TIMESTAMPS = [0, 2**32 - 1, 2**32, 253402300800, 2**63, 2**64 - 1]


def _fixed(kind: str) -> st.SearchStrategy[Scalar]:
    size = _SIZES[kind]
    raw = st.binary(min_size=size, max_size=size)
    if kind == "T":
        raw = st.one_of(raw, st.sampled_from(ODD_TIMESTAMPS).map(lambda t: struct.pack(">Q", t)))
    if kind == "D":
        raw = st.one_of(raw, st.just(b"\xff\xff\xff\xff\xff"), st.just(b"\x00\x80\x00\x00\x00"))
    return raw.map(lambda r: Scalar(kind, r))


def _long(kind: str) -> st.SearchStrategy[Scalar]:
    data = st.one_of(
        st.text(max_size=40).map(lambda t: t.encode("utf-8")),
        st.binary(max_size=40),  # not UTF-8, often
    )
    return data.map(lambda d: Scalar(kind, struct.pack(">I", len(d)) + d))


scalars: st.SearchStrategy[Value] = st.one_of(
    *[_fixed(kind) for kind in _SIZES], _long("S"), _long("x")
)

keys = st.text(max_size=12).filter(lambda k: len(k.encode("utf-8")) <= 255)


def values(max_leaves: int = 25) -> st.SearchStrategy[Value]:
    """Any field value: scalars, tables and arrays (arrays of tables included)."""
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(st.tuples(keys, inner), max_size=5).map(lambda i: Table(tuple(i))),
            st.lists(inner, max_size=5).map(lambda i: Array(tuple(i))),
        ),
        max_leaves=max_leaves,
    )


_X_DEATH_ODD = st.one_of(
    values(8),  # anything at all
    st.lists(values(6), max_size=3).map(lambda i: Array(tuple(i))),  # an array of anything
    st.lists(
        st.lists(
            st.tuples(
                st.sampled_from(["queue", "reason", "count", "exchange", "time"]),
                values(3),
            ),
            max_size=5,
        ).map(lambda i: Table(tuple(i))),
        max_size=3,
    ).map(lambda i: Array(tuple(i))),  # tables with odd field types
)

tables: st.SearchStrategy[Table] = st.lists(
    st.one_of(
        st.tuples(keys, values()),
        st.tuples(st.just("x-death"), _X_DEATH_ODD),
        st.tuples(st.sampled_from(["k", "x-first-death-queue"]), values(3)),
    ),
    max_size=8,
).map(lambda items: Table(tuple(items)))


def _shortstr(data: bytes) -> bytes:
    return bytes((len(data),)) + data


# 30 characters are at most 120 bytes: always a valid short string.
short_texts = st.text(max_size=30).map(lambda t: t.encode("utf-8"))


@st.composite
def content_headers(
    draw: st.DrawFn, body_size: int = 0, *, persistent: bool | None = None
) -> bytes:
    """A valid content header payload with any subset of the 14 properties, odd values kept."""
    flags = 0
    parts: list[bytes] = []

    def text_prop(flag: int) -> None:
        nonlocal flags
        if draw(st.booleans()):
            flags |= flag
            parts.append(_shortstr(draw(short_texts)))

    text_prop(0x8000)
    text_prop(0x4000)
    if draw(st.booleans()):
        flags |= 0x2000
        parts.append(encode_table(draw(tables)))
    mode = 2 if persistent else 1 if persistent is False else draw(st.integers(0, 255))
    if persistent is not None or draw(st.booleans()):
        flags |= 0x1000
        parts.append(bytes((mode,)))
    if draw(st.booleans()):
        flags |= 0x0800
        parts.append(bytes((draw(st.integers(0, 255)),)))
    text_prop(0x0400)
    text_prop(0x0200)
    if draw(st.booleans()):
        flags |= 0x0100
        parts.append(_shortstr(str(draw(st.integers(0, 2**32 - 1))).encode()))
    if draw(st.booleans()):
        flags |= 0x0080
        parts.append(_shortstr(draw(short_texts)))
    if draw(st.booleans()):
        flags |= 0x0040
        stamp = draw(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from(ODD_TIMESTAMPS)))
        parts.append(struct.pack(">Q", stamp))
    text_prop(0x0020)
    # user-id must name the login: left out
    text_prop(0x0008)
    text_prop(0x0004)
    return struct.pack(">HHQH", 60, 0, body_size, flags) + b"".join(parts)


def sample_headers(random_seed: int, count: int) -> list[bytes]:
    """`count` odd (valid) content headers drawn from `content_headers`, the same for the
    same seed: for a workload outside a hypothesis test (the fault matrix's publisher)."""
    drawn: list[bytes] = []

    @seed(random_seed)
    @settings(
        max_examples=count, database=None, phases=[Phase.generate], deadline=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(content_headers(persistent=True))
    def draw(header: bytes) -> None:
        drawn.append(header)

    draw()
    return drawn


def nested_table(depth: int) -> bytes:
    """A headers table nested `depth` levels deep (the top-level table is level 1)."""
    inner = b"\x00\x00\x00\x00"
    for _ in range(depth - 1):
        entry = b"\x01aF" + inner
        inner = struct.pack(">I", len(entry)) + entry
    return inner


def header_with_table(table: bytes, body_size: int = 0) -> bytes:
    """A content header payload carrying `table` as its headers property."""
    return struct.pack(">HHQH", 60, 0, body_size, 0x2000) + table


# -- poison: headers the broker must refuse at publish (docs/poison-input.md) ---------------


def _deep_table() -> bytes:
    return header_with_table(nested_table(40))


def _many_fields() -> bytes:
    entries = b"".join(b"\x01kV" for _ in range(3000))
    return header_with_table(struct.pack(">I", len(entries)) + entries)


def _huge_table() -> bytes:
    blob = b"y" * 70_000
    entry = b"\x01kS" + struct.pack(">I", len(blob)) + blob
    return header_with_table(struct.pack(">I", len(entry)) + entry)


# name -> (the content header payload, the reply code its publish must be refused with:
# 501/502 close the connection, 406 the channel).
POISON: dict[str, tuple[Callable[[], bytes], int]] = {
    "deep": (_deep_table, 502),
    "many-fields": (_many_fields, 502),
    "huge": (_huge_table, 502),
    "unknown-type": (lambda: header_with_table(b"\x00\x00\x00\x03\x01kZ"), 501),
    "key-not-utf8": (lambda: header_with_table(b"\x00\x00\x00\x03\x01\xffV"), 502),
    "content-type-not-utf8": (lambda: struct.pack(">HHQH", 60, 0, 0, 0x8000) + b"\x01\xff", 502),
    "trailing-bytes": (lambda: struct.pack(">HHQH", 60, 0, 0, 0) + b"\x00", 501),
    "bad-expiration": (lambda: struct.pack(">HHQH", 60, 0, 0, 0x0100) + b"\x02\xc2\xb2", 406),
}
