"""Content headers and field tables, pure: what is refused at publish, and what is carried exactly.

No sockets: `decode_content_header` (the publish check), the `fieldtable` codec
and the dead-letter rewrite, fed bytes built here or by hypothesis.
"""

from __future__ import annotations

import contextlib
import datetime
import decimal
import os
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands
from pamqp import decode as pamqp_decode
from pamqp import encode as pamqp_encode
from pamqp.header import ContentHeader
from poison import content_headers, header_with_table, nested_table, tables, values

from twinmq.broker import fieldtable
from twinmq.broker.codec import (
    MAX_EXPIRY_MS,
    decode_content_header,
    decode_headers,
    decode_method,
    property_spans,
    rebuild_header,
)
from twinmq.broker.deadletter import dead_letter_header, is_cycle
from twinmq.broker.definitions import BindingDef, ExchangeDef
from twinmq.broker.errors import AMQPError, ReplyCode
from twinmq.broker.fieldtable import (
    MAX_DEPTH,
    MAX_FIELDS,
    MAX_TABLE_BYTES,
    Array,
    FieldTableError,
    Scalar,
    Table,
    decode_table,
    encode_table,
    to_python,
)
from twinmq.broker.routing import HeadersExchange, headers_match

# TWINMQ_FUZZ_EXAMPLES=5000 for a long hunt; the default keeps the file a few seconds.
EXAMPLES = int(os.environ.get("TWINMQ_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def header(body_size: int = 0, **properties: object) -> bytes:
    """A content header payload as pamqp (a real client's codec) encodes it."""
    return ContentHeader(0, body_size, commands.Basic.Properties(**properties)).marshal()  # type: ignore[arg-type]


def refused(payload: bytes) -> AMQPError:
    with pytest.raises(AMQPError) as info:
        decode_content_header(payload)
    return info.value


# -- the bounds ---------------------------------------------------------------------------


def test_a_table_nested_to_the_depth_bound_is_accepted() -> None:
    decode_content_header(header_with_table(nested_table(MAX_DEPTH)))


def test_a_table_nested_one_level_deeper_is_a_syntax_error() -> None:
    error = refused(header_with_table(nested_table(MAX_DEPTH + 1)))
    assert error.code == ReplyCode.SYNTAX_ERROR and error.connection_level
    assert f"deeper than {MAX_DEPTH}" in error.text


def test_a_table_nested_thousands_deep_is_refused_without_recursing() -> None:
    # pamqp's recursive decoder hits RecursionError here: an internal error per message.
    assert refused(header_with_table(nested_table(20_000))).code == ReplyCode.SYNTAX_ERROR


def test_arrays_count_towards_the_depth_bound() -> None:
    def headers_with_arrays(count: int) -> bytes:
        value = b"A\x00\x00\x00\x00"
        for _ in range(count - 1):
            value = b"A" + struct.pack(">I", len(value)) + value
        entry = b"\x01a" + value
        return header_with_table(struct.pack(">I", len(entry)) + entry)

    # The headers table is level 1: MAX_DEPTH - 1 nested arrays fit, one more does not.
    decode_content_header(headers_with_arrays(MAX_DEPTH - 1))
    assert refused(headers_with_arrays(MAX_DEPTH)).code == ReplyCode.SYNTAX_ERROR


def test_more_values_than_the_field_bound_is_a_syntax_error() -> None:
    ok = b"".join(b"\x01kV" for _ in range(MAX_FIELDS))
    decode_content_header(header_with_table(struct.pack(">I", len(ok)) + ok))
    over = ok + b"\x01kV"
    error = refused(header_with_table(struct.pack(">I", len(over)) + over))
    assert error.code == ReplyCode.SYNTAX_ERROR and str(MAX_FIELDS) in error.text


def test_a_table_over_the_byte_bound_is_a_syntax_error() -> None:
    blob = b"x" * MAX_TABLE_BYTES
    entry = b"\x01kS" + struct.pack(">I", len(blob)) + blob
    error = refused(header_with_table(struct.pack(">I", len(entry)) + entry))
    assert error.code == ReplyCode.SYNTAX_ERROR and "bytes" in error.text


# -- malformed and illegal content headers --------------------------------------------------


@pytest.mark.parametrize(
    ("table", "code"),
    [
        (b"\x00\x00\x00\x07\x03keyZ\x00\x00", ReplyCode.FRAME_ERROR),  # no field type Z
        (b"\x00\x00\x00\x04\x03key", ReplyCode.FRAME_ERROR),  # a key without a value
        (b"\x00\x00\x00\x09\x01kS\x00\x00\x00\x09ab", ReplyCode.FRAME_ERROR),  # string overruns
        (b"\x00\x00\x00\x0a\x01kA\x00\x00\x00\x09bb\xff", ReplyCode.FRAME_ERROR),  # array overruns
        (b"\x00\x00\x00\x04\x02\xff\xfeV", ReplyCode.SYNTAX_ERROR),  # key not UTF-8
        (b"\x00\x00\x00\x00\x00", ReplyCode.FRAME_ERROR),  # a byte after the table
        (b"\x00\x00\x01\x00", ReplyCode.FRAME_ERROR),  # table longer than the header
    ],
    ids=["unknown-type", "no-value", "string-overrun", "array-overrun", "key-utf8", "tail", "long"],
)
def test_malformed_or_illegal_headers_tables_are_refused(table: bytes, code: ReplyCode) -> None:
    assert refused(header_with_table(table)).code == code


def test_a_short_string_property_that_is_not_utf8_is_a_syntax_error() -> None:
    payload = struct.pack(">HHQH", 60, 0, 0, 0x8000) + b"\x02\xc3\x28"
    assert refused(payload).code == ReplyCode.SYNTAX_ERROR


def test_app_id_and_cluster_id_are_checked_too() -> None:
    decode_content_header(header(app_id="app"))
    bad = struct.pack(">HHQH", 60, 0, 0, 0x0008 | 0x0004) + b"\x01a" + b"\x01\xff"
    assert refused(bad).code == ReplyCode.SYNTAX_ERROR


def test_bytes_after_the_last_property_are_a_frame_error() -> None:
    assert refused(header(content_type="a") + b"\x00").code == ReplyCode.FRAME_ERROR


def test_an_unknown_property_flag_is_a_syntax_error() -> None:
    assert refused(struct.pack(">HHQH", 60, 0, 0, 0x0002)).code == ReplyCode.SYNTAX_ERROR


@pytest.mark.parametrize("expiration", ["²", "-1", "1e3", " 5", str(MAX_EXPIRY_MS + 1)])
def test_an_invalid_expiration_is_precondition_failed_on_the_channel(expiration: str) -> None:
    error = refused(header(expiration=expiration))
    assert error.code == ReplyCode.PRECONDITION_FAILED and not error.connection_level


def test_odd_but_valid_values_are_accepted_and_read() -> None:
    # A timestamp pamqp cannot turn into a datetime, delivery mode 7, priority 255.
    payload = struct.pack(">HHQH", 60, 0, 3, 0x1000 | 0x0800 | 0x0080 | 0x0040)
    payload += b"\x07\xff" + b"\x02id" + struct.pack(">Q", 2**64 - 1)
    info = decode_content_header(payload)
    assert (info.body_size, info.persistent, info.message_id) == (3, False, "id")


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_are_accepted_or_refused_with_a_protocol_error(payload: bytes) -> None:
    with contextlib.suppress(AMQPError):
        decode_content_header(struct.pack(">HHQ", 60, 0, 0) + payload)


@FUZZ
@given(st.binary(max_size=300))
def test_any_bytes_as_a_table_decode_or_raise_field_table_error(data: bytes) -> None:
    try:
        table, end = decode_table(data)
    except FieldTableError:
        return
    assert encode_table(table) == data[:end]


# -- the lossless codec ---------------------------------------------------------------------


@FUZZ
@given(tables)
def test_every_table_round_trips_byte_for_byte(table: Table) -> None:
    data = encode_table(table)
    decoded, end = decode_table(data)
    assert end == len(data) and decoded == table and encode_table(decoded) == data


@FUZZ
@given(content_headers())
def test_generated_headers_pass_the_publish_check(payload: bytes) -> None:
    decode_content_header(payload)


@FUZZ
@given(values())
def test_to_python_never_raises(value: fieldtable.Value) -> None:
    to_python(value)


def test_to_python_agrees_with_pamqp_for_what_pamqp_decodes() -> None:
    sample = {
        "int": 7,
        "big": 2**40,
        "neg": -5,
        "text": "héllo",
        "flag": True,
        "none": None,
        "dec": decimal.Decimal("1.25"),
        "when": datetime.datetime(2024, 1, 2, tzinfo=datetime.UTC),
        "list": [1, "a", {"n": 2}],
        "table": {"deep": {"deeper": [True]}},
        "float": 0.5,
    }
    data = pamqp_encode.field_table(sample)
    assert to_python(decode_table(data)[0]) == pamqp_decode.field_table(data)[1]


def test_values_pamqp_cannot_handle_are_kept_exactly() -> None:
    stamp = Scalar("T", struct.pack(">Q", 2**64 - 1))  # pamqp: OverflowError
    dec = Scalar("D", b"\x02\xff\xff\xff\xff")  # pamqp decodes it, then cannot re-encode
    raw = Scalar("S", b"\x00\x00\x00\x02\xff\xfe")  # not UTF-8
    table = Table((("t", stamp), ("d", dec), ("s", raw), ("x", Scalar("x", b"\x00\x00\x00\x01z"))))
    data = encode_table(table)
    assert decode_table(data)[0] == table
    python = to_python(table)
    assert python["t"] == stamp.raw and python["s"] == b"\xff\xfe" and python["x"] == b"z"


# -- the dead-letter rewrite ----------------------------------------------------------------


def _deaths(payload: bytes) -> list[dict[str, object]]:
    deaths = to_python(decode_headers(payload))["x-death"]
    assert isinstance(deaths, list)
    return deaths


def test_dead_lettering_adds_x_death_drops_expiration_and_keeps_the_rest_byte_for_byte() -> None:
    odd = Table((("when", Scalar("T", b"\xff" * 8)), ("dec", Scalar("D", b"\xff" * 5))))
    original = header(
        5,
        content_type="text/plain",
        expiration="1000",
        message_id="m-1",
        timestamp=datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC),
        app_id="app",
    )
    with_headers = rebuild_header(original, {0x2000: encode_table(odd)})
    decode_content_header(with_headers)
    dead = dead_letter_header(
        with_headers, queue="q", reason="expired", exchange="ex", routing_key="rk", now=100
    )
    info = decode_content_header(dead.header)
    assert info.expiration_ms is None and info.message_id == "m-1" and info.body_size == 5
    before, after = property_spans(with_headers), property_spans(dead.header)
    assert set(after) == set(before) - {0x0100}
    for flag in set(after) - {0x2000}:
        assert dead.header[slice(*after[flag])] == with_headers[slice(*before[flag])]
    assert dead.headers.get("when") == odd.get("when") and dead.headers.get("dec") == odd.get("dec")
    (death,) = _deaths(dead.header)
    assert death["count"] == 1 and death["queue"] == "q" and death["reason"] == "expired"
    assert death["exchange"] == "ex" and death["routing-keys"] == ["rk"]
    assert to_python(dead.headers)["x-first-death-queue"] == "q"


def test_a_second_death_in_the_same_queue_counts_and_moves_first() -> None:
    first = dead_letter_header(
        header(), queue="a", reason="rejected", exchange="", routing_key="a", now=1
    )
    second = dead_letter_header(
        first.header, queue="b", reason="expired", exchange="", routing_key="b", now=2
    )
    third = dead_letter_header(
        second.header, queue="a", reason="rejected", exchange="", routing_key="a", now=3
    )
    deaths = _deaths(third.header)
    assert [(d["queue"], d["count"]) for d in deaths] == [("a", 2), ("b", 1)]
    assert to_python(third.headers)["x-first-death-queue"] == "a"


@pytest.mark.parametrize(
    "x_death",
    [
        Scalar("S", b"\x00\x00\x00\x03abc"),  # not an array
        Array((Scalar("b", b"\x01"), Scalar("V", b""))),  # an array of non-tables
        Array((Table((("queue", Scalar("S", b"\x00\x00\x00\x01q")),)),)),  # no reason
        Array(
            (
                Table(
                    (
                        ("queue", Scalar("S", b"\x00\x00\x00\x01q")),
                        ("reason", Scalar("S", b"\x00\x00\x00\x07expired")),
                        ("count", Scalar("S", b"\x00\x00\x00\x03ten")),  # a string count
                    )
                ),
            )
        ),
        Array(
            (
                Table(
                    (
                        ("queue", Scalar("S", b"\x00\x00\x00\x01q")),
                        ("reason", Scalar("S", b"\x00\x00\x00\x07expired")),
                        ("count", Scalar("l", struct.pack(">q", 2**63 - 1))),  # at the top
                    )
                ),
            )
        ),
    ],
    ids=["scalar", "non-tables", "no-reason", "string-count", "max-count"],
)
def test_an_odd_x_death_is_handled(x_death: fieldtable.Value) -> None:
    payload = header_with_table(encode_table(Table((("x-death", x_death),))))
    decode_content_header(payload)
    dead = dead_letter_header(
        payload, queue="q", reason="expired", exchange="", routing_key="q", now=1
    )
    decode_content_header(dead.header)
    deaths = _deaths(dead.header)
    latest = deaths[0]
    assert latest["queue"] == "q" and latest["reason"] == "expired"
    assert isinstance(latest["count"], int) and latest["count"] >= 1


@FUZZ
@given(content_headers(), st.sampled_from(["expired", "maxlen", "rejected"]))
def test_dead_lettering_any_accepted_header_never_raises(payload: bytes, reason: str) -> None:
    dead = dead_letter_header(
        payload,
        queue="q",
        reason=reason,  # type: ignore[arg-type]
        exchange="e",
        routing_key="r",
        now=1,
    )
    info = decode_content_header(dead.header)
    assert info.expiration_ms is None
    assert decode_content_header(payload).message_id == info.message_id
    assert to_python(decode_headers(dead.header))["x-death"][0]["queue"] == "q"


def test_a_cycle_without_a_rejection_is_detected() -> None:
    once = dead_letter_header(
        header(), queue="a", reason="expired", exchange="", routing_key="a", now=1
    )
    assert is_cycle(once.headers, "a")
    assert not is_cycle(once.headers, "b")
    rejected = dead_letter_header(
        once.header, queue="b", reason="rejected", exchange="", routing_key="b", now=2
    )
    # A consumer took part (the rejection): a retry loop, not a cycle.
    assert not is_cycle(rejected.headers, "a")


# -- tables in method arguments ---------------------------------------------------------------


def _queue_declare(arguments: bytes) -> bytes:
    return struct.pack(">HHH", 50, 10, 0) + b"\x01q" + b"\x00" + arguments


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 20_000])
def test_method_arguments_nested_too_deep_are_a_syntax_error(depth: int) -> None:
    with pytest.raises(AMQPError) as info:
        decode_method(_queue_declare(nested_table(depth)))
    assert info.value.code == ReplyCode.SYNTAX_ERROR and info.value.connection_level


def test_method_arguments_within_the_bounds_decode() -> None:
    method = decode_method(_queue_declare(nested_table(MAX_DEPTH)))
    assert isinstance(method, commands.Queue.Declare) and method.arguments


def test_a_method_argument_pamqp_cannot_represent_is_a_protocol_error() -> None:
    stamp = b"\x01tT" + struct.pack(">Q", 2**64 - 1)
    with pytest.raises(AMQPError) as info:
        decode_method(_queue_declare(struct.pack(">I", len(stamp)) + stamp))
    assert info.value.code in (ReplyCode.FRAME_ERROR, ReplyCode.SYNTAX_ERROR)


# -- headers-exchange matching on decoded values ------------------------------------------------


def test_a_queue_bound_with_two_matching_tables_is_routed_to_once() -> None:
    exchange = HeadersExchange(ExchangeDef(name="h", type="headers"))
    for table in ({}, {"x-match": "all", "a": 1}, {"x-match": "any", "a": 2}):
        exchange.bind(BindingDef(exchange="h", queue="q", routing_key="", arguments=table))
    exchange.bind(BindingDef(exchange="h", queue="r", routing_key="", arguments={"a": 1}))
    assert list(exchange.route("", {"a": 1})) == ["q", "r"]
    assert list(exchange.route("", {"a": 2})) == ["q"]


def test_headers_match_compares_text_and_bytes_by_their_bytes() -> None:
    binding = {"x-match": "all", "k": "v"}
    assert headers_match(binding, {"k": b"v"}) and headers_match(binding, {"k": bytearray(b"v")})
    assert not headers_match(binding, {"k": b"\xff"})


@FUZZ
@given(tables, tables)
def test_headers_match_never_raises_on_decoded_tables(headers: Table, arguments: Table) -> None:
    for mode in ("all", "any", "all-with-x", "any-with-x"):
        headers_match({**to_python(arguments), "x-match": mode}, to_python(headers))
