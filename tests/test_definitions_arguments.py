"""Queue, exchange and binding arguments of every AMQP field type survive a restart.

Arguments are stored as JSON (the definitions file and log, replication, mirror
events); JSON has no byte arrays, decimals, timestamps or non-finite floats. Stored
as they came, a byte-array argument came back as a string (found by fuzzing the
connection core): after a restart the client's own re-declare was refused as
inequivalent (406), and a headers binding on a byte-array value stopped matching the
messages it routed before (and could not be unbound).
"""

from __future__ import annotations

import datetime
import decimal
import json
import math
from pathlib import Path
from typing import Any

import pika
import pytest

from twinmq.broker.definitions import (
    BindingDef,
    Definitions,
    DefinitionsDelta,
    ExchangeDef,
    QueueDef,
)
from twinmq.broker.journal.recovery import decode_snapshot, encode_snapshot
from twinmq.testing.launcher import BrokerProcess

EVERY_TYPE: dict[str, Any] = {
    "bytes": b"\x00\xffraw",
    "decimal": decimal.Decimal("12.340"),
    "timestamp": datetime.datetime(2026, 12, 3, 1, 2, 3, tzinfo=datetime.UTC),
    "naive": datetime.datetime(2026, 12, 3, 1, 2, 3),
    "nan": math.nan,
    "inf": -math.inf,
    "float": 1.5,
    "int": -7,
    "bool": True,
    "void": None,
    "text": "plain",
    "array": [b"a", decimal.Decimal("1"), ["nested", b"b"]],
    # A client's own table whose one key is a tag name stays a table.
    "looks_tagged": {"__bytes__": "aGk="},
    "table": {"inner": b"c", "n": 1},
}


def _same(a: Any, b: Any) -> bool:
    """Equal, type for type (NaN equal to NaN; bytes and bytearray alike)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    if isinstance(a, bytes | bytearray):
        return isinstance(b, bytes | bytearray) and bytes(a) == bytes(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, datetime.datetime):
        return a == b and a.tzinfo == b.tzinfo
    return bool(a == b)


def _topology(arguments: dict[str, Any]) -> Definitions:
    return Definitions(
        exchanges=[ExchangeDef(name="x", type="headers", arguments=arguments)],
        queues=[QueueDef(name="q", qid=1, arguments=arguments)],
        bindings=[BindingDef(exchange="x", queue="q", routing_key="", arguments=arguments)],
        next_qid=2,
    )


def test_every_field_type_reads_back_from_the_definitions_file_as_it_was_declared() -> None:
    defs = _topology(EVERY_TYPE)
    back, generation = decode_snapshot(encode_snapshot(defs, 3), Path("definitions.json"))
    assert generation == 3
    for obj in (back.exchanges[0], back.queues[0], back.bindings[0]):
        assert _same(obj.arguments, EVERY_TYPE), obj.arguments


def test_every_field_type_reads_back_from_a_definitions_log_record() -> None:
    delta = DefinitionsDelta(
        add_queues=[QueueDef(name="q", qid=1, arguments=EVERY_TYPE)],
        add_bindings=[BindingDef(exchange="x", queue="q", routing_key="", arguments=EVERY_TYPE)],
    )
    back = DefinitionsDelta.model_validate_json(delta.model_dump_json(exclude_defaults=True))
    assert _same(back.add_queues[0].arguments, EVERY_TYPE)
    assert _same(back.add_bindings[0].arguments, EVERY_TYPE)


def test_plain_arguments_are_stored_byte_for_byte_as_before() -> None:
    # Older data directories' checksums are of this JSON: it must not change for them.
    plain = {"x-message-ttl": 60000, "x-dead-letter-exchange": "dlx", "x-args": [1, "a"]}
    stored = json.loads(_topology(plain).model_dump_json())
    assert stored["queues"][0]["arguments"] == plain
    assert stored["bindings"][0]["arguments"] == plain


@pytest.mark.parametrize("value", [b"raw\x00bytes", decimal.Decimal("2.50")])
def test_a_durable_queue_with_such_an_argument_is_redeclared_after_a_restart(
    tmp_path: Path, value: bytes | decimal.Decimal
) -> None:
    arguments = {"x-custom": value}
    broker = BrokerProcess(tmp_path / "data", name="args").start()
    try:
        with pika.BlockingConnection(pika.URLParameters(broker.url)) as conn:
            ch = conn.channel()
            ch.queue_declare("q", durable=True, arguments=arguments)
            ch.exchange_declare("h", "headers", durable=True)
            ch.queue_bind("q", "h", arguments={"x-match": "all", "tag": b"\x01\x02"})
        broker.stop()
        broker = BrokerProcess(tmp_path / "data", name="args", port=broker.port).start()
        with pika.BlockingConnection(pika.URLParameters(broker.url)) as conn:
            ch = conn.channel()
            # Refused as inequivalent (406, the channel closed) before the fix.
            ch.queue_declare("q", durable=True, arguments=arguments)
            ch.confirm_delivery()
            ch.basic_publish(
                "h", "", b"m", pika.BasicProperties(headers={"tag": b"\x01\x02"}), mandatory=True
            )
            method, _, body = ch.basic_get("q", auto_ack=True)
            assert method is not None and body == b"m"
            # The binding is told apart by its arguments: the same ones unbind it.
            ch.queue_unbind("q", "h", arguments={"x-match": "all", "tag": b"\x01\x02"})
            ch.basic_publish("h", "", b"n", pika.BasicProperties(headers={"tag": b"\x01\x02"}))
            assert ch.basic_get("q", auto_ack=True)[0] is None
    finally:
        broker.stop()
