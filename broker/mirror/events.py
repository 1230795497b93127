"""Mirror events and their bytes, sans-I/O.

An event is one message in the source's replication queue; its identity is
(origin, seq) where `seq` is that message's replication ID (`mid`): unique and
increasing across the source pair's failovers (`broker/epoch.py`), so the
mirror's high-water mark per origin makes apply idempotent.

    event = u8 kind | f64 created (unix time, for the age of the oldest event) | payload
    OPS          payload = the journal's own op encoding (`encode_ops`): one group commit's
                 changes to mirrored queues (enqueues, settles), applied as one unit
    DEFINITIONS  payload = JSON of `Definitions`: the whole mirrored topology of every
                 vhost (full state, so declares, deletes and argument changes, vhosts
                 made and deleted converge and re-applying is harmless)
    SEED         payload = UTF-8 reason: a (re-)seed starts here; every event before it is
                 irrelevant to a mirror (the DEFINITIONS and SNAPSHOT events after it
                 rebuild the whole state), so any mirror can start from it
    SNAPSHOT     payload = u64 qid | u64 lo | u64 hi | ops (enqueues only): the source holds
                 exactly these messages of queue `qid` with lo <= mid <= hi. A mirror that
                 holds others in that range did not get, or missed, what happened to them:
                 it moves them to its orphan queue (never discarded)
    DELTA        payload = u64 qid | u64 lo | u64 hi | u32 n | n fixes | ops (enqueues only):
                 a SNAPSHOT event of the same seq, rewritten for one mirror by the link
                 (`delta.py`; never journaled): the ops are the messages the mirror lacked;
                 each fix = u64 lo | u64 hi | u32 k | k u64 mids: in lo..hi the source holds
                 exactly these (the mirror orphans the rest; k = KEEP_ANY: orphan nothing).
                 Outside the fixes the mirror held exactly the snapshot's messages
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from pydantic import ValidationError

from twinmq.broker.definitions import DEFAULT_VHOST, Definitions
from twinmq.broker.journal import JournalOp, Settle, StoredMessage
from twinmq.broker.journal.ops import decode_ops, encode_ops
from twinmq.broker.message import Entry, Message
from twinmq.broker.queue import Queue

KIND_OPS: Final = 1
KIND_DEFINITIONS: Final = 2
KIND_SEED: Final = 3
KIND_SNAPSHOT: Final = 4
KIND_DELTA: Final = 6  # 5 is bidi.KIND_BIDI
_HEAD = struct.Struct("<Bd")
_RANGE = struct.Struct("<QQQ")
_COUNT = struct.Struct("<I")
_FIX = struct.Struct("<QQI")
_MID = struct.Struct("<Q")
# A fix's count when it lists no mids: the mirror orphans nothing in its range.
KEEP_ANY: Final = 0xFFFFFFFF
# The `hi` of a queue's last snapshot event: everything above the previous one.
TOP_MID: Final = (1 << 64) - 1

# Internal queues (the replication queue, the mirror's applied marks, its DLQ): never
# mirrored, and left alone when a mirror applies the source's topology.
INTERNAL_PREFIX: Final = "amq.twinmq."
# Their queue ids sit far above any id a broker hands out, so the mirror can keep the
# source's own queue ids (and message ids) without a translation table.
INTERNAL_QID_BASE: Final = 1 << 62

# A valid, empty content header (class basic, no properties): how internal queues
# store their records as messages the journal, recovery and replication already carry.
_EMPTY_HEADER = struct.Struct(">HHQH")


def record_header(body_size: int) -> bytes:
    """The content header of an internal record of `body_size` bytes."""
    return _EMPTY_HEADER.pack(60, 0, body_size, 0)


@dataclass(slots=True, frozen=True)
class SnapshotRange:
    """What a SNAPSHOT event covers: queue `qid`, message ids lo..hi inclusive."""

    qid: int
    lo: int
    hi: int


@dataclass(slots=True, frozen=True)
class SnapshotFix:
    """Part of a DELTA event: in `lo..hi` the source holds exactly `keep` (None: the mirror
    holds nothing there the source lacks; it orphans nothing)."""

    lo: int
    hi: int
    keep: tuple[int, ...] | None


@dataclass(slots=True, frozen=True)
class MirrorEvent:
    """One decoded event: ops (with their range for a snapshot), definitions or a seed."""

    seq: int
    created: float
    ops: list[JournalOp] | None = None
    definitions: Definitions | None = None
    snapshot: SnapshotRange | None = None
    seed: str | None = None
    fixes: list[SnapshotFix] | None = None  # a DELTA event's (`snapshot` is its range then)


def encode_ops_event(ops: Sequence[JournalOp], created: float) -> bytes:
    """The event of one group commit's mirrored ops."""
    buf = bytearray()
    encode_ops(ops, buf)
    return ops_event(buf, created)


def ops_event(encoded: bytes | bytearray | memoryview, created: float) -> bytes:
    """The event of ops already in the journal's encoding (copied once, into the event)."""
    return _HEAD.pack(KIND_OPS, created) + encoded


def encode_definitions_event(definitions: Definitions, created: float) -> bytes:
    """The event of the mirrored topology as it now stands."""
    return _HEAD.pack(KIND_DEFINITIONS, created) + definitions.model_dump_json().encode()


def encode_seed_event(reason: str, created: float) -> bytes:
    """The event a (re-)seed starts with."""
    return _HEAD.pack(KIND_SEED, created) + reason.encode()


def encode_snapshot_event(
    covered: SnapshotRange, ops: Sequence[JournalOp], created: float
) -> bytes:
    """A snapshot event: the messages `ops` are all the source holds in `covered`."""
    buf = bytearray(_RANGE.pack(covered.qid, covered.lo, covered.hi))
    encode_ops(ops, buf)
    return _HEAD.pack(KIND_SNAPSHOT, created) + buf


def encode_delta_event(
    covered: SnapshotRange, fixes: Sequence[SnapshotFix], ops: Sequence[JournalOp], created: float
) -> bytes:
    """A DELTA event: a snapshot event's messages the mirror lacks, and where it holds
    others (`fixes`)."""
    buf = bytearray(_RANGE.pack(covered.qid, covered.lo, covered.hi))
    buf += _COUNT.pack(len(fixes))
    for fix in fixes:
        keep = fix.keep
        buf += _FIX.pack(fix.lo, fix.hi, KEEP_ANY if keep is None else len(keep))
        if keep:
            buf += struct.pack(f"<{len(keep)}Q", *keep)
    encode_ops(ops, buf)
    return _HEAD.pack(KIND_DELTA, created) + buf


def snapshot_of(body: bytes) -> tuple[SnapshotRange, list[JournalOp]] | None:
    """A SNAPSHOT event's range and messages (None: another kind of event)."""
    if not body or body[0] != KIND_SNAPSHOT:
        return None
    event = decode_event(0, body)
    assert event.snapshot is not None and event.ops is not None
    return event.snapshot, event.ops


def is_seed(body: bytes) -> bool:
    """Whether an event starts a (re-)seed."""
    return bool(body) and body[0] == KIND_SEED


def event_created(body: bytes) -> float:
    """When an event was made (for the age of the oldest unreplicated one)."""
    return float(_HEAD.unpack_from(body)[1])


def decode_event(seq: int, body: bytes) -> MirrorEvent:
    """Decode an event; ValueError if it is malformed."""
    if len(body) < _HEAD.size:
        raise ValueError(f"event {seq}: {len(body)} bytes is shorter than its header")
    kind, created = _HEAD.unpack_from(body)
    payload = body[_HEAD.size :]
    if kind == KIND_OPS:
        return MirrorEvent(seq, created, ops=decode_ops(payload))
    if kind == KIND_SNAPSHOT:
        if len(payload) < _RANGE.size:
            raise ValueError(f"event {seq}: snapshot range truncated")
        covered = SnapshotRange(*_RANGE.unpack_from(payload))
        ops = decode_ops(payload[_RANGE.size :])
        return MirrorEvent(seq, created, ops=ops, snapshot=covered)
    if kind == KIND_DELTA:
        return _decode_delta(seq, created, payload)
    if kind == KIND_SEED:
        return MirrorEvent(seq, created, seed=payload.decode(errors="replace"))
    if kind == KIND_DEFINITIONS:
        try:
            return MirrorEvent(seq, created, definitions=Definitions.model_validate_json(payload))
        except ValidationError as exc:
            raise ValueError(
                f"event {seq}: malformed definitions ({exc.error_count()} errors)"
            ) from None
    if kind == 5:  # bidi.KIND_BIDI
        raise ValueError(
            f"event {seq}: a bidirectional site's event: this site must run "
            f"--mirror-role bidirectional too"
        )
    raise ValueError(f"event {seq}: unknown kind {kind}")


def _decode_delta(seq: int, created: float, payload: bytes) -> MirrorEvent:
    try:
        covered = SnapshotRange(*_RANGE.unpack_from(payload))
        (n,) = _COUNT.unpack_from(payload, _RANGE.size)
        at = _RANGE.size + _COUNT.size
        fixes: list[SnapshotFix] = []
        for _ in range(n):
            lo, hi, k = _FIX.unpack_from(payload, at)
            at += _FIX.size
            keep: tuple[int, ...] | None = None
            if k != KEEP_ANY:
                keep = struct.unpack_from(f"<{k}Q", payload, at)
                at += k * _MID.size
            fixes.append(SnapshotFix(lo, hi, keep))
    except struct.error:
        raise ValueError(f"event {seq}: delta truncated") from None
    return MirrorEvent(seq, created, ops=decode_ops(payload[at:]), snapshot=covered, fixes=fixes)


def is_internal(name: str) -> bool:
    """Whether a queue is one of the mirror's own (never mirrored)."""
    return name.startswith(INTERNAL_PREFIX)


def mirrored_definitions(definitions: Definitions, *, root_only: bool = False) -> Definitions:
    """The topology a mirror receives: everything durable of every vhost but the internal
    queues (`root_only`: of the vhost `/` alone, the bidirectional mode's: its id map is
    keyed by queue names, docs/mirror.md "Virtual hosts"). `/`'s objects carry no `vhost`
    in their JSON, so `/`'s part of the event is what it was before vhosts were mirrored."""

    def kept(vhost: str) -> bool:
        return not root_only or vhost == DEFAULT_VHOST

    return Definitions(
        exchanges=[e for e in definitions.exchanges if kept(e.vhost)],
        queues=[q for q in definitions.queues if kept(q.vhost) and not is_internal(q.name)],
        bindings=[b for b in definitions.bindings if kept(b.vhost) and not is_internal(b.queue)],
        next_qid=definitions.next_qid,
    )


def replace_record(queue: Queue, mid: int, data: bytes) -> list[JournalOp]:
    """Make `data` the one record of internal queue `queue` (in memory, as message `mid`);
    the ops that journal the change (the new record, settles of the old)."""
    qid, name = queue.definition.qid, queue.name
    header = record_header(len(data))
    ops: list[JournalOp] = [StoredMessage(mid, qid, "", name, header, data, None)]
    ops += [Settle(qid, entry.message.mid) for entry in queue.entries]
    queue.entries.clear()
    queue.entries.append(Entry(Message(mid, "", name, header, data, True, None, None), None, True))
    queue.bytes = len(data)
    return ops


def restore_record(queue: Queue, previous: list[Entry], made: int) -> list[JournalOp]:
    """Put back `previous`, the records of internal queue `queue` a failed batch replaced
    with record `made` (in memory); the ops that do the same on a passive that applied
    the batch. Nothing if a later batch replaced `made` already (its change stands)."""
    entries = queue.entries
    if queue.deleted or len(entries) != 1 or entries[0].message.mid != made:
        return []
    qid, name = queue.definition.qid, queue.name
    ops: list[JournalOp] = [Settle(qid, made)]
    ops += [
        StoredMessage(e.message.mid, qid, "", name, e.message.header, e.message.body, None)
        for e in previous
    ]
    entries.clear()
    entries.extend(previous)
    queue.bytes = sum(e.size for e in previous)
    return ops
