"""Poison and odd content headers against a real broker: it never crashes, loses or wedges.

The fuzz (`test_odd_headers_survive_routing_dead_lettering_expiry_and_restart`)
publishes hypothesis-made content headers with raw frames and confirms, through
a headers exchange and into queues that dead-letter by rejection, by length
limit and by expiry (into a headers exchange again), next to headers the broker
must refuse. Then it kills the broker (kill -9 or a clean stop) and restarts it,
and reads every queue empty with raw frames (client libraries cannot decode
some of these headers; the broker must not care). Every confirmed message must
be found, with every property but `headers` and `expiration` byte for byte as
published; refused headers close their connection with 501/502 and one log
line; the broker log never holds a traceback.

TWINMQ_POISON_EXAMPLES sets the examples (a few by default; the `soak` variant
runs many).
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pika
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands
from pamqp.base import Frame as MethodFrame
from pamqp.frame import _unmarshal_method_frame
from poison import POISON, content_headers, header_with_table, nested_table

from twinmq.broker.codec import decode_headers, property_spans, rebuild_header
from twinmq.broker.fieldtable import Array, Scalar, Table, as_text, encode_table, to_python
from twinmq.broker.journal import Journal, StoredMessage
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.rawamqp import RawClient, encode, raw_frame
from twinmq.testing.waiting import wait_for

EXAMPLES = int(os.environ.get("TWINMQ_POISON_EXAMPLES", "3"))

HEADERS_EXCHANGE = "pz.headers"
DLX = "pz.dlx"  # a headers exchange: dead-lettered headers are routed by their table
EVERY = "pz.h-every"  # bound to HEADERS_EXCHANGE with x-match=all and no keys: every message
MATCHED = "pz.h-k"  # bound with x-match=any, k="v"
DEAD = "pz.dead"
REJECT = "pz.reject"
MAXLEN = "pz.maxlen"
TTL = "pz.ttl"
QUEUES = (EVERY, MATCHED, DEAD, REJECT, MAXLEN, TTL)
ROUTES = ("headers", "reject", "maxlen", "ttl")
HEADERS_FLAG, EXPIRATION_FLAG, DELIVERY_MODE_FLAG = 0x2000, 0x0100, 0x1000


# -- raw frames, read as bytes (client codecs raise on some valid values) --------------------


def read_raw(client: RawClient) -> tuple[int, int, bytes]:
    """The next frame as (type, channel, payload)."""
    ftype, channel, size = struct.unpack(">BHI", client.read_exact(7))
    rest = client.read_exact(size + 1)
    assert rest[-1:] == b"\xce"
    return ftype, channel, rest[:-1]


def next_method(client: RawClient) -> MethodFrame:
    """The next method frame (heartbeats skipped)."""
    while True:
        ftype, _, payload = read_raw(client)
        if ftype == 8:
            continue
        assert ftype == 1, f"expected a method frame, got type {ftype}"
        return _unmarshal_method_frame(payload)


def read_content(client: RawClient) -> tuple[bytes, bytes]:
    """A content header payload and the body after it."""
    ftype, _, header = read_raw(client)
    assert ftype == 2
    size = struct.unpack_from(">Q", header, 4)[0]
    body = b""
    while len(body) < size:
        ftype, _, payload = read_raw(client)
        assert ftype == 3
        body += payload
    return header, body


def opened(broker: BrokerProcess) -> RawClient:
    client = RawClient(broker.host, broker.port)
    client.handshake()
    client.open_channel(1)
    return client


def publish_confirmed(broker: BrokerProcess, items: list[tuple[str, str, bytes, bytes]]) -> int:
    """Publish (exchange, routing key, header, body) items with confirms; the number acked."""
    with opened(broker) as client:
        client.send_frame(1, commands.Confirm.Select())
        assert isinstance(next_method(client), commands.Confirm.SelectOk)
        client.send(
            b"".join(
                encode(1, commands.Basic.Publish(exchange=ex, routing_key=rk))
                + raw_frame(2, 1, header)
                + (raw_frame(3, 1, body) if body else b"")
                for ex, rk, header, body in items
            )
        )
        acked: set[int] = set()
        while len(acked) < len(items):
            method = next_method(client)
            assert isinstance(method, commands.Basic.Ack), f"not confirmed: {method!r}"
            tag = method.delivery_tag
            acked |= set(range(1, tag + 1)) if method.multiple else {tag}
        return len(acked)


def message_count(client: RawClient, queue: str) -> int:
    client.send_frame(1, commands.Queue.Declare(queue=queue, passive=True))
    method = next_method(client)
    assert isinstance(method, commands.Queue.DeclareOk), method
    return int(method.message_count)


def reject_all(broker: BrokerProcess, queue: str) -> int:
    """basic.get and basic.reject (no requeue) until the queue is empty; the rejecter lives on."""
    rejected = 0
    with opened(broker) as client:
        while True:
            client.send_frame(1, commands.Basic.Get(queue=queue))
            method = next_method(client)
            if isinstance(method, commands.Basic.GetEmpty):
                break
            assert isinstance(method, commands.Basic.GetOk), method
            read_content(client)
            client.send_frame(
                1, commands.Basic.Reject(delivery_tag=method.delivery_tag, requeue=False)
            )
            rejected += 1
        message_count(client, queue)  # a round trip: the rejecting connection is still open
    return rejected


def drain(broker: BrokerProcess, queue: str) -> list[tuple[bytes, bytes]]:
    """basic.get (no-ack) until empty; (header, body) pairs."""
    out = []
    with opened(broker) as client:
        while True:
            client.send_frame(1, commands.Basic.Get(queue=queue, no_ack=True))
            method = next_method(client)
            if isinstance(method, commands.Basic.GetEmpty):
                return out
            assert isinstance(method, commands.Basic.GetOk), method
            out.append(read_content(client))


# -- the broker, restarted in place ---------------------------------------------------------


@dataclass
class Rig:
    """One broker on one data directory, restarted on the same ports."""

    data: Path
    broker: BrokerProcess = field(init=False)

    def __post_init__(self) -> None:
        self.broker = BrokerProcess(self.data, name="poison").start()

    def restart(self, kill: bool) -> None:
        if kill:
            self.broker.kill()
        else:
            assert self.broker.stop() == 0
        b = self.broker
        self.broker = BrokerProcess(
            self.data,
            name="poison",
            port=b.port,
            admin_port=b.admin_port,
            replication_port=b.replication_port,
        ).start()

    def log(self) -> str:
        assert self.broker.log_path is not None
        return self.broker.log_path.read_text()


def declare_topology(broker: BrokerProcess) -> None:
    """Durable exchanges and queues through a real client (pika)."""
    conn = pika.BlockingConnection(pika.URLParameters(broker.url))
    ch = conn.channel()
    ch.exchange_declare(HEADERS_EXCHANGE, "headers", durable=True)
    ch.exchange_declare(DLX, "headers", durable=True)
    dl = {"x-dead-letter-exchange": DLX}
    for queue, arguments in (
        (EVERY, {}),
        (MATCHED, {}),
        (DEAD, {}),
        (REJECT, dl),
        (MAXLEN, {**dl, "x-max-length": 1}),
        (TTL, {**dl, "x-message-ttl": 5}),
    ):
        ch.queue_declare(queue, durable=True, arguments=arguments)
    ch.queue_bind(EVERY, HEADERS_EXCHANGE, arguments={"x-match": "all"})
    ch.queue_bind(MATCHED, HEADERS_EXCHANGE, arguments={"x-match": "any", "k": "v"})
    ch.queue_bind(DEAD, DLX, arguments={"x-match": "all"})
    conn.close()


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    rig = Rig(tmp_path_factory.mktemp("poison") / "data")
    declare_topology(rig.broker)
    yield rig
    rig.broker.stop()


# -- poison: refused at publish ----------------------------------------------------------------


def publish_poison(broker: BrokerProcess, name: str) -> None:
    """Publish one poison header; the broker must close with the expected code."""
    build, code = POISON[name]
    with opened(broker) as client:
        client.send(
            encode(1, commands.Basic.Publish(exchange=HEADERS_EXCHANGE, routing_key=""))
            + raw_frame(2, 1, build())
        )
        method = next_method(client)
        close = commands.Channel.Close if code == 406 else commands.Connection.Close
        assert isinstance(method, close), f"{name}: {method!r}"
        assert method.reply_code == code, f"{name}: {method!r}"


# -- the fuzz --------------------------------------------------------------------------------


@dataclass
class Sent:
    route: str
    header: bytes


def prepare(header: bytes, body: bytes, route: str) -> bytes:
    """The generated header as published: persistent, the body's size, expiration by route."""
    replace: dict[int, bytes | None] = {DELIVERY_MODE_FLAG: b"\x02", EXPIRATION_FLAG: None}
    if route == "ttl":
        replace[EXPIRATION_FLAG] = b"\x011"  # and the queue's TTL: both expiry paths
    return rebuild_header(header, replace, body_size=len(body))


def same_but_dead_lettered(published: bytes, found: bytes, source: str) -> None:
    """Every property but headers and expiration kept byte for byte; x-death names `source`."""
    before, after = property_spans(published), property_spans(found)
    assert set(after) - {HEADERS_FLAG} == set(before) - {HEADERS_FLAG, EXPIRATION_FLAG}
    for flag in set(after) - {HEADERS_FLAG}:
        assert found[slice(*after[flag])] == published[slice(*before[flag])]
    deaths = decode_headers(found).get("x-death")
    assert isinstance(deaths, Array) and isinstance(deaths.items[0], Table)
    assert as_text(deaths.items[0].get("queue")) == source


class Round:
    """One fuzz example: publish, dead-letter, expire, restart, read back, check."""

    counter = 0

    def __init__(self, rig: Rig) -> None:
        Round.counter += 1
        self.rig = rig
        self.tag = f"r{Round.counter}-"
        self.sent: dict[bytes, Sent] = {}

    def run(self, messages: list[tuple[bytes, str]], poison: list[str], kill: bool) -> None:
        broker = self.rig.broker
        items = []
        for n, (header, route) in enumerate(messages):
            body = f"{self.tag}{n}".encode()
            published = prepare(header, body, route)
            self.sent[body] = Sent(route, published)
            exchange, key = {
                "headers": (HEADERS_EXCHANGE, ""),
                "reject": ("", REJECT),
                "maxlen": ("", MAXLEN),
                "ttl": ("", TTL),
            }[route]
            items.append((exchange, key, published, body))
        for name in poison:
            publish_poison(broker, name)
        assert publish_confirmed(broker, items) == len(items)
        reject_all(broker, REJECT)
        with opened(broker) as client:
            wait_for("the TTL queue empty", lambda: message_count(client, TTL) == 0, 10)
        self.rig.restart(kill)
        self.check(kill)

    def check(self, killed: bool) -> None:
        broker = self.rig.broker
        found: dict[str, list[tuple[bytes, bytes]]] = {q: drain(broker, q) for q in QUEUES}
        where: dict[bytes, list[tuple[str, bytes]]] = {}
        for queue, got in found.items():
            for header, body in got:
                # Nothing refused at publish, nothing from another round, ever shows up.
                assert body in self.sent, f"unexpected message {body!r} in {queue}"
                where.setdefault(body, []).append((queue, header))
        for body, sent in self.sent.items():
            places = where.get(body)
            assert places, f"confirmed message {body!r} ({sent.route}) lost"
            for queue, header in places:
                if queue != DEAD:
                    assert header == sent.header, f"{body!r}: header changed in {queue}"
                else:
                    same_but_dead_lettered(sent.header, header, f"pz.{sent.route}")
            queues = {q for q, _ in places}
            expected = {
                "headers": {EVERY},
                # After kill -9 a dead-lettering that was not yet on disk is undone: the
                # message is back in its queue (redelivered), never lost.
                "reject": {DEAD, REJECT} if killed else {DEAD},
                "ttl": {DEAD, TTL} if killed else {DEAD},
                "maxlen": {DEAD, MAXLEN},
            }[sent.route]
            if sent.route == "headers":
                expected = expected | {MATCHED}
            assert queues <= expected, f"{body!r} ({sent.route}) in {queues}"
            if sent.route == "headers":
                assert EVERY in queues
                value = to_python(decode_headers(sent.header)).get("k")
                assert (MATCHED in queues) == (value == "v" or value == b"v")
        log = self.rig.log()
        assert "Traceback" not in log, log[-3000:]
        assert "quarantined" not in log, log[-3000:]


messages = st.lists(st.tuples(content_headers(), st.sampled_from(ROUTES)), min_size=1, max_size=12)


def _fuzz(rig: Rig, batch: list[tuple[bytes, str]], poison: list[str], kill: bool) -> None:
    Round(rig).run(batch, poison, kill)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    batch=messages,
    poison=st.lists(st.sampled_from(sorted(POISON)), max_size=2),
    kill=st.booleans(),
)
def test_odd_headers_survive_routing_dead_lettering_expiry_and_restart(
    rig: Rig, batch: list[tuple[bytes, str]], poison: list[str], kill: bool
) -> None:
    _fuzz(rig, batch, poison, kill)


@pytest.mark.soak
@pytest.mark.timeout(7200)
@settings(
    max_examples=int(os.environ.get("TWINMQ_POISON_SOAK_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    batch=messages,
    poison=st.lists(st.sampled_from(sorted(POISON)), max_size=3),
    kill=st.booleans(),
)
def test_odd_headers_soak(
    rig: Rig, batch: list[tuple[bytes, str]], poison: list[str], kill: bool
) -> None:
    _fuzz(rig, batch, poison, kill)


# -- named cases -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POISON))
def test_poison_header_is_refused_with_one_log_line_and_no_traceback(rig: Rig, name: str) -> None:
    before = len(rig.log())
    publish_poison(rig.broker, name)
    new = wait_for("new log lines", lambda: rig.log()[before:])
    assert "Traceback" not in new
    assert len([line for line in new.splitlines() if "closing" in line]) == 1, new
    # The broker serves a real client as before.
    pika.BlockingConnection(pika.URLParameters(rig.broker.url)).close()


def test_a_real_client_consumes_a_dead_lettered_message_with_odd_headers(rig: Rig) -> None:
    """pika publishes odd (pika-encodable) headers; its consumer rejects and reads the dead copy."""
    import datetime
    import decimal

    headers = {
        "decimal": decimal.Decimal("-12.345"),
        "when": datetime.datetime(2038, 1, 19, 3, 14, 8),
        "tables": [{"a": 1}, {"b": [None, True, b"\x00\xff"]}],
        "bytes": b"\xff\xfe",
        "x-death": "not a list",  # the broker owns x-death: it replaces this one
    }
    conn = pika.BlockingConnection(pika.URLParameters(rig.broker.url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish(
            "",
            REJECT,
            b"pika-odd",
            pika.BasicProperties(headers=headers, delivery_mode=2, expiration="60000"),
        )
        method, _, _ = ch.basic_get(REJECT)
        assert method is not None
        ch.basic_reject(method.delivery_tag, requeue=False)
        method, props, body = ch.basic_get(DEAD, auto_ack=True)
        assert method is not None and body == b"pika-odd"
        assert props.expiration is None
        assert props.headers["decimal"] == decimal.Decimal("-12.345")
        assert props.headers["tables"] == [{"a": 1}, {"b": [None, True, b"\x00\xff"]}]
        (death,) = props.headers["x-death"]
        assert death["queue"] == REJECT and death["reason"] == "rejected"
        assert conn.is_open
    finally:
        conn.close()


def test_a_consumer_and_a_publisher_stay_connected_when_an_odd_message_dies(rig: Rig) -> None:
    """A maxlen drop caused by an innocent publish dead-letters an odd message to a consumer."""
    odd = Table((("t", Scalar("T", b"\xff" * 8)),))
    first = rebuild_header(
        header_with_table(encode_table(odd)), {DELIVERY_MODE_FLAG: b"\x02"}, body_size=3
    )
    with opened(rig.broker) as consumer:
        consumer.send_frame(1, commands.Basic.Consume(queue=DEAD, consumer_tag="c"))
        assert isinstance(next_method(consumer), commands.Basic.ConsumeOk)
        plain = rebuild_header(struct.pack(">HHQH", 60, 0, 0, 0), {DELIVERY_MODE_FLAG: b"\x02"})
        publish_confirmed(rig.broker, [("", MAXLEN, first, b"odd")])
        # The innocent publish pushes the odd message out (x-max-length 1): confirmed.
        pushed_out = [("", MAXLEN, rebuild_header(plain, {}, 5), b"plain")]
        assert publish_confirmed(rig.broker, pushed_out) == 1
        deliver = next_method(consumer)
        assert isinstance(deliver, commands.Basic.Deliver)
        header, body = read_content(consumer)
        assert body == b"odd"
        assert decode_headers(header).get("t") == odd.get("t")
        consumer.send_frame(1, commands.Basic.Ack(delivery_tag=deliver.delivery_tag))
        consumer.send_frame(1, commands.Basic.Cancel(consumer_tag="c"))
        assert isinstance(next_method(consumer), commands.Basic.CancelOk)
    drain(rig.broker, MAXLEN)


# -- recovery --------------------------------------------------------------------------------


def test_a_stored_header_the_broker_would_refuse_is_recovered_as_opaque_bytes(
    tmp_path: Path,
) -> None:
    """A journal written under other rules: recovery completes, the message is served as is."""
    data = tmp_path / "data"
    broker = BrokerProcess(data, name="opaque").start()
    conn = pika.BlockingConnection(pika.URLParameters(broker.url))
    conn.channel().queue_declare("opaque.q", durable=True)
    conn.close()
    assert broker.stop() == 0
    poison = header_with_table(nested_table(200))  # refused at publish today
    broken = struct.pack(">HHQH", 60, 0, 4, 0x2000) + b"\x00\x00\xff\xff"  # not even walkable

    async def plant() -> None:
        journal = Journal(data / "journal", fsync=True)
        recovered = journal.open()
        (qdef,) = [q for q in recovered.definitions.queues if q.name == "opaque.q"]
        mid = max(recovered.next_mid, 1)
        ops = [
            StoredMessage(mid, qdef.qid, "", "opaque.q", poison, b"", None),
            StoredMessage(mid + 1, qdef.qid, "", "opaque.q", broken, b"body", None),
        ]
        await journal.sync(journal.append(ops))
        await journal.close()

    asyncio.run(plant())
    restarted = BrokerProcess(data, name="opaque", port=broker.port).start()
    try:
        got = drain(restarted, "opaque.q")
        assert got == [(poison, b""), (broken, b"body")]
        log = restarted.log_path.read_text() if restarted.log_path else ""
        assert "2 recovered messages have content headers" in log
        assert "Traceback" not in log
    finally:
        restarted.stop()


@pytest.mark.parametrize("depth", [100, 5000])
def test_deeply_nested_queue_arguments_are_refused_and_never_stored(rig: Rig, depth: int) -> None:
    # Stored definitions deeper than ~200 levels would not load again: the next start fails.
    declare = struct.pack(">HHH", 50, 10, 0) + b"\x06deep.q" + b"\x02" + nested_table(depth)
    with opened(rig.broker) as client:
        client.send(raw_frame(1, 1, declare))
        close = next_method(client)
        assert isinstance(close, commands.Connection.Close) and close.reply_code == 502, close
    with opened(rig.broker) as client:
        client.send_frame(1, commands.Queue.Declare(queue="deep.q", passive=True))
        missing = next_method(client)
        assert isinstance(missing, commands.Channel.Close) and missing.reply_code == 404
    assert "Traceback" not in rig.log()
