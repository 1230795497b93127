"""The fuzz targets: one function of arbitrary bytes per parser, with its seeds.

A target raises only when it found something: an exception its parser does not
document (a crash: a client or a peer could close the broker's connection with an
internal error, or stop a restart) or a broken invariant (`AssertionError`). Seeds
are valid inputs the fuzzer mutates from; `fuzz/regressions/<target>/` holds every
input that once failed, replayed by the unit tests.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pamqp import commands
from pamqp import encode as pamqp_encode
from pydantic import BaseModel

from twinmq.broker import codec, fieldtable
from twinmq.broker.definitions import Definitions, DefinitionsDelta
from twinmq.broker.errors import AMQPError
from twinmq.broker.journal import JournalError, JournalOp, StoredMessage, deflog
from twinmq.broker.journal.deflog import encode_log_header
from twinmq.broker.journal.ops import CorruptRecord, Settle, decode_group, decode_ops, encode_ops
from twinmq.broker.journal.recovery import decode_definitions, encode_definitions
from twinmq.broker.journal.segment import encode_header, frame, scan
from twinmq.broker.mirror import events
from twinmq.broker.replication import protocol
from twinmq.fuzz import admin
from twinmq.fuzz.amqp import CAP, CORPUS, ConnectionFuzzer, chunked, open_peer, publish_parts
from twinmq.testing.rawamqp import encode, split_frames
from twinmq.testing.sansio import Harness


@dataclass(frozen=True)
class Target:
    """One fuzz target."""

    name: str
    one_input: Callable[[bytes], None]
    seeds: Callable[[], list[bytes]]
    """Valid inputs to start from (a few dozen)."""


def _cuts(data: bytes) -> tuple[list[int], bytes]:
    """Split offsets from the input's first two bytes, and the rest of it."""
    if len(data) < 2:
        return [], data
    return [data[0], data[0] + data[1] * 7], data[2:]


# -- AMQP: the frame reader ------------------------------------------------------------------


def amqp_frames(data: bytes) -> None:
    """`FrameReader`: only AMQPError, and the same frames however the bytes are split."""
    cuts, stream = _cuts(data)
    whole: list[tuple[int, int, bytes]] | None
    try:
        whole = codec.FrameReader(frame_max=4096).feed(stream)
    except AMQPError:
        whole = None
    reader = codec.FrameReader(frame_max=4096)
    got: list[tuple[int, int, bytes]] = []
    try:
        for chunk in chunked(stream, cuts):
            got += reader.feed(chunk)
    except AMQPError:
        assert whole is None or got == whole[: len(got)], "split reading disagrees"
        return
    assert whole is not None, "split reading accepted what whole reading refused"
    assert got == whole, "split reading yields other frames"
    for ftype, _channel, payload in got:
        if ftype == 1:
            _method(payload)
        elif ftype == 2:
            _content_header(payload)


def _amqp_frames_seeds() -> list[bytes]:
    return [b"\x03\x09" + entry for entry in CORPUS]


# -- AMQP: methods and content headers ------------------------------------------------------


def _method(payload: bytes) -> None:
    with contextlib.suppress(AMQPError):
        codec.decode_method(payload)


def amqp_method(data: bytes) -> None:
    """`decode_method`: AMQPError only (pamqp's own errors are translated)."""
    _method(data)


def _amqp_method_seeds() -> list[bytes]:
    return [payload for entry in CORPUS for t, _c, payload in split_frames(entry) if t == 1]


def _content_header(payload: bytes) -> None:
    try:
        info = codec.decode_content_header(payload)
    except AMQPError:
        return
    # Accepted at publish: everything downstream must handle it (docs/poison-input.md).
    assert info.body_size == struct.unpack_from(">Q", payload, 4)[0]
    assert codec.header_message_id(payload) == info.message_id
    headers = codec.decode_headers(payload)
    for _key, value in headers.items:
        fieldtable.to_python(value)
    assert codec.rebuild_header(payload, {}) == payload
    assert codec.rebuild_header(payload, {0x2000: None}, body_size=0) is not None


def content_header(data: bytes) -> None:
    """`decode_content_header`: AMQPError only; what it accepts routes, rebuilds, decodes."""
    _content_header(data)


def _content_header_seeds() -> list[bytes]:
    props = commands.Basic.Properties
    every = props(
        content_type="text/plain",
        content_encoding="gzip",
        headers={"k": "v", "n": 1, "t": {"x": [1, "a"]}, "f": 1.5, "b": True},
        delivery_mode=2,
        priority=3,
        correlation_id="c",
        reply_to="amq.gen-1",
        expiration="60000",
        message_id="m-1",
        timestamp=None,
        message_type="t",
        user_id="guest",
        app_id="app",
    )
    out = [codec.encode_header_payload(p, 5) for p in (props(), every, props(delivery_mode=1))]
    out += [payload for entry in CORPUS for t, _c, payload in split_frames(entry) if t == 2]
    return out


# -- field tables ----------------------------------------------------------------------------


def field_table(data: bytes) -> None:
    """`decode_table`: FieldTableError only; a decoded table re-encodes to the same bytes."""
    try:
        table, end = fieldtable.decode_table(data)
    except fieldtable.FieldTableError:
        return
    assert fieldtable.encode_table(table) == data[:end], "re-encoding changed the table"
    for _key, value in table.items:
        fieldtable.to_python(value)


def _field_table_seeds() -> list[bytes]:
    tables: list[dict[str, object]] = [
        {},
        {"k": "v"},
        {"x-death": [{"count": 1, "queue": "q", "reason": "expired", "routing-keys": ["a"]}]},
        {"i": 1, "l": 2**40, "f": 0.5, "b": False, "d": None, "n": {"deep": {"er": [1, 2]}}},
        {"bytes": bytearray(b"\x00\xff"), "neg": -5, "s": "x" * 300},
    ]
    return [pamqp_encode.field_table(t) for t in tables]  # type: ignore[arg-type]


# -- the AMQP connection core ----------------------------------------------------------------


@cache
def _connection_fuzzer() -> ConnectionFuzzer:
    # One per process: the temporary folder lives as long as the fuzzing process.
    return ConnectionFuzzer(Path(tempfile.mkdtemp(prefix="twinmq-fuzz-")))


def amqp_connection(data: bytes) -> None:
    """Bytes after the handshake on an open connection: see `twinmq.fuzz.amqp`."""
    cuts, stream = _cuts(data)
    _connection_fuzzer().one_input(stream, cuts)


def _amqp_connection_seeds() -> list[bytes]:
    declare = CORPUS[0]
    publish = b"".join(publish_parts(1, "fz", b"body"))
    get = next(e for e in CORPUS if b"\x00\x3c\x00\x46" in e)  # basic.get
    select, commit = (encode(1, method) for method in (commands.Tx.Select(), commands.Tx.Commit()))
    past_cap = publish * (CAP.messages + 1)  # the cap's refusals, in and out of a transaction
    return [b"\x00\x00" + entry for entry in CORPUS] + [
        b"\x05\x03" + declare + publish + get,
        b"\x00\x00" + declare + past_cap,
        b"\x00\x00" + declare + select + past_cap + commit,
    ]


# -- replication link ------------------------------------------------------------------------

_CONTROL_MODELS: dict[protocol.FrameType, type[BaseModel]] = {
    protocol.FrameType.CHALLENGE: protocol.Challenge,
    protocol.FrameType.HELLO: protocol.Hello,
    protocol.FrameType.WELCOME: protocol.Welcome,
    protocol.FrameType.REFUSE: protocol.Refuse,
    protocol.FrameType.SNAPSHOT: protocol.Snapshot,
    protocol.FrameType.DEFINITIONS: Definitions,
    protocol.FrameType.DEFINITIONS_DELTA: DefinitionsDelta,
}


def replication_frames(data: bytes) -> None:
    """What a replication peer sends: frames, control models, batches of ops, dedup keys.

    Only `ProtocolError` (the link is closed) or the journal codec's documented
    ValueError for a batch body.
    """
    decoder = protocol.FrameDecoder(max_frame=1 << 16)
    cuts, stream = _cuts(data)
    for chunk in chunked(stream, cuts):
        decoder.push(chunk)
        while True:
            try:
                got = decoder.next()
            except protocol.ProtocolError:
                return
            if got is None:
                break
            _replication_frame(*got)


def _replication_frame(ftype: protocol.FrameType, payload: bytes) -> None:
    try:
        model = _CONTROL_MODELS.get(ftype)
        if model is not None:
            decoded = protocol.decode_model(model, payload)
            if isinstance(decoded, protocol.Snapshot):
                for ids in decoded.ids().values():
                    list(ids)
        elif ftype in (protocol.FrameType.BATCH, protocol.FrameType.DEDUP_KEYS):
            _batch, _flags, body = protocol.decode_batch(payload)
            if ftype == protocol.FrameType.DEDUP_KEYS:
                protocol.decode_keys(body)
            else:
                _ops(body)
        elif len(payload) == 8:
            protocol.decode_u64(payload)
    except protocol.ProtocolError:
        pass


def _ops(body: bytes) -> None:
    try:
        ops = decode_ops(body)
    except ValueError:
        return
    buf = bytearray()
    encode_ops(ops, buf)
    assert decode_ops(bytes(buf)) == ops, "ops do not survive a re-encoding"


def _sample_ops() -> list[JournalOp]:
    header = codec.encode_header_payload(commands.Basic.Properties(), 4)
    message = StoredMessage(7, 3, "amq.topic", "a.b", header, b"body", None)
    expiring = StoredMessage(8, 3, "", "q", message.header, b"", 1_700_000_000.5)
    return [message, expiring, Settle(3, 7)]


def _replication_seeds() -> list[bytes]:
    ops = bytearray()
    encode_ops(_sample_ops(), ops)
    keys = bytearray()
    protocol.encode_key(keys, "m-1")
    protocol.encode_key(keys, "\udcff")
    challenge = protocol.Challenge(name="broker-0", nonce="n" * 32)
    hello = protocol.Hello(name="broker-1", epoch=3, nonce="m" * 32, proof="p" * 64)
    frames = [
        protocol.encode(protocol.FrameType.CHALLENGE, challenge),
        protocol.encode(protocol.FrameType.HELLO, hello),
        protocol.encode(protocol.FrameType.WELCOME, protocol.Welcome(epoch=3, proof="q" * 64)),
        protocol.encode(protocol.FrameType.SNAPSHOT, protocol.Snapshot.of({3: [1, 2, 900]})),
        protocol.encode_batch(1, 0, ops),
        protocol.encode_batch(2, protocol.BATCH_CATCHUP, keys, protocol.FrameType.DEDUP_KEYS),
        protocol.encode_u64(protocol.FrameType.ACK, 1),
    ]
    return [b"\x09\x40" + f for f in frames] + [b"\x00\x00" + b"".join(frames)]


# -- journal segments (a damaged file at start-up) -------------------------------------------


def journal_segment(data: bytes) -> None:
    """A segment of records with valid checksums around fuzzed payloads, as a flipped
    bit after the checksum (or a bug of another version) could leave it.

    `scan` reports damage and raises only JournalError (an intact record of an unknown
    format); `classify` never raises; every record scanned decodes as a group.
    """
    segment = encode_header(1, 0) + b"".join(frame(part) for part in data.split(b"\xfe\xfe"))
    for blob in (segment, segment[: len(segment) - len(data) // 3]):
        try:
            found = scan(blob, 1)
        except JournalError:
            continue
        found.classify(last=True)
        found.classify(last=False)
        for record in found.records:
            assert record.end <= len(blob)


def journal_group(data: bytes) -> None:
    """`decode_group` (one record's ops): CorruptRecord only."""
    with contextlib.suppress(CorruptRecord):
        decode_group(data, 0, len(data))


def _journal_seeds() -> list[bytes]:
    ops = bytearray()
    encode_ops(_sample_ops(), ops)
    return [bytes(ops), bytes(ops) + b"\xfe\xfe" + bytes(ops)]


def definitions_file(data: bytes) -> None:
    """A damaged definitions file at start-up: JournalError only (never start without it)."""
    with contextlib.suppress(JournalError):
        decode_definitions(data, Path("definitions.json"))


def definitions_log(data: bytes) -> None:
    """The definitions log at start-up: records with valid checksums around fuzzed
    payloads (`\\xfe\\xfe` separates them), then the same log cut short (a torn tail).
    `load` raises JournalError only; a topology it accepts saves and loads back the same."""
    directory = _deflog_directory()
    log_ = encode_log_header(0) + b"".join(frame(part) for part in data.split(b"\xfe\xfe"))
    for blob in (log_, log_[: len(log_) - len(data) // 3]):
        (directory / deflog.LOG).write_bytes(blob)
        try:
            loaded = deflog.load(directory)
        except JournalError:
            continue
        assert loaded.log_bytes + loaded.torn_bytes == len(blob)
        defs = loaded.state.definitions()
        assert decode_definitions(encode_definitions(defs), Path("definitions.json")) == defs


@cache
def _deflog_directory() -> Path:
    """One scratch journal directory for the whole run, holding the sample snapshot."""
    shm = Path("/dev/shm")  # in memory where there is one: a file per input
    base = shm if shm.is_dir() else None
    directory = Path(tempfile.mkdtemp(prefix="twinmq-fuzz-deflog-", dir=base))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    (directory / "definitions.json").write_bytes(encode_definitions(_sample_definitions()))
    return directory


def _definitions_log_seeds() -> list[bytes]:
    sample = _sample_definitions()
    deltas = [
        DefinitionsDelta(add_queues=sample.queues[:1], next_qid=sample.next_qid + 1),
        DefinitionsDelta(add_bindings=sample.bindings[:2], del_exchanges=["gone"]),
        DefinitionsDelta(del_queues=[q.name for q in sample.queues[1:2]]),
    ]
    records = [d.model_dump_json().encode() for d in deltas]
    group = b"[" + b",".join(records) + b"]"  # one record for a loop turn's changes
    return [b"\xfe\xfe".join(records), group + b"\xfe\xfe" + records[0]]


def _definitions_seeds() -> list[bytes]:
    return [encode_definitions(Definitions()), encode_definitions(_sample_definitions())]


def _sample_definitions() -> Definitions:
    """The topology the AMQP corpus declares (queues, exchanges, bindings, arguments)."""
    with tempfile.TemporaryDirectory() as tmp:
        harness = Harness(Path(tmp))
        try:
            open_peer(harness).feed(b"".join(CORPUS[:14]))
            return harness.vhost.definitions()
        finally:
            harness.close()


# -- DR mirror events --------------------------------------------------------------------------


def mirror_event(data: bytes) -> None:
    """`decode_event` (what a mirror applies): ValueError only."""
    try:
        event = events.decode_event(1, data)
    except ValueError:
        return
    assert math.isnan(event.created) or event.created == events.event_created(data)


def _mirror_event_seeds() -> list[bytes]:
    ops = _sample_ops()
    return [
        events.encode_ops_event(ops, 1.5),
        events.encode_seed_event("first activation", 2.0),
        events.encode_definitions_event(Definitions(), 3.0),
        events.encode_snapshot_event(events.SnapshotRange(3, 1, 9), ops, 4.0),
    ]


# -- the admin API ---------------------------------------------------------------------------


@cache
def _admin_fuzzer() -> admin.AdminFuzzer:
    return admin.make_fuzzer()


def admin_api(data: bytes) -> None:
    """A raw HTTP request to a real broker's admin app: see `twinmq.fuzz.admin`."""
    _admin_fuzzer().one_input(data)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        Target("amqp_frames", amqp_frames, _amqp_frames_seeds),
        Target("amqp_method", amqp_method, _amqp_method_seeds),
        Target("content_header", content_header, _content_header_seeds),
        Target("field_table", field_table, _field_table_seeds),
        Target("amqp_connection", amqp_connection, _amqp_connection_seeds),
        Target("replication_frames", replication_frames, _replication_seeds),
        Target("journal_segment", journal_segment, _journal_seeds),
        Target("journal_group", journal_group, _journal_seeds),
        Target("definitions_file", definitions_file, _definitions_seeds),
        Target("definitions_log", definitions_log, _definitions_log_seeds),
        Target("mirror_event", mirror_event, _mirror_event_seeds),
        Target("admin_api", admin_api, admin.seeds),
    )
}
"""Every target by name (the names of `make fuzz` and of the corpus folders)."""


def regressions(root: Path, name: str) -> Iterator[Path]:
    """The past findings of target `name` kept under `root` (fuzz/regressions)."""
    folder = root / name
    if folder.is_dir():
        yield from sorted(p for p in folder.iterdir() if p.is_file())
