"""The bidirectional mode's event format, id map and topology deltas (sans-I/O).

With `--mirror-role bidirectional` every site is writable and mirrors to its target
while it applies what its listener receives. Two writers' queue ids and message
ids collide, so a bidirectional event names everything in the origin's terms:

    event = u8 KIND_BIDI | f64 created | u32 meta length | meta (JSON of `BidiMeta`)
            | ops (the journal's op encoding)

- `meta.origin`, `meta.oseq`: the site that made the change and the event's seq
  there; a forwarded event keeps both, and `meta.hops` lists every site it went
  through (origin first). A site never applies an event of its own origin or one
  that already went through it (no echo, no loop), and skips an (origin, oseq) at
  or below the highest it applied from that origin (no duplicate).
- Each op's `qid` is an index into `meta.keys`, a list of (queue name, message
  origin), with a third element, the queue's vhost, for a vhost other than `/`; its
  `mid` is the message's id *at that message origin* (a broker's ids are unique across
  its vhosts, so the pair names one message whatever its vhost). A settle on
  site B of a message that A published names (queue, A, A's id), so A settles
  its own message and C settles its copy of A's message.
- `meta.topology`: a per-object delta (`TopologyDelta`): declares, deletes,
  bindings made and removed, by name. Absence never deletes: two writers'
  full states would delete each other's queues; an explicit delete is mirrored
  (as RabbitMQ's and Artemis' mirrors do). `meta.vhost_topology`: the deltas of the
  other vhosts, by vhost.

Every vhost is carried; `/`'s events are byte for byte what they were when the mode
carried `/` alone. A site's own ops go in one event per vhost (`/`'s first), so a peer
of that version, which reads `/` only, applies `/`'s events as before, dead-letters the
events of another vhost (their 3-element keys fail its validation, with the reason) and
ignores `vhost_topology` (an unknown field): it keeps carrying `/`.

The receiving site keeps an **id map** (`IdMap`): (message origin, id there) ->
its own message id, one record per (local queue, local id) in the internal
queue `amq.twinmq.mirror-ids`, journaled in the same group commit as the
message it maps (and settled with it): a restart or a pair failover keeps it.
"""

from __future__ import annotations

import bisect
import json
import logging
import struct
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from pydantic import BaseModel, Field

from twinmq.broker.definitions import (
    DEFAULT_VHOST,
    BindingDef,
    Definitions,
    ExchangeDef,
    QueueDef,
)
from twinmq.broker.journal import JournalOp, Settle, StoredMessage
from twinmq.broker.journal.ops import decode_ops, encode_ops
from twinmq.broker.message import Entry, Message
from twinmq.broker.mirror.events import INTERNAL_QID_BASE, is_internal, record_header
from twinmq.broker.queue import Queue

log = logging.getLogger(__name__)

KIND_BIDI: Final = 5
_HEAD = struct.Struct("<BdI")
IDS_NAME: Final = "amq.twinmq.mirror-ids"
IDS_QID: Final = INTERNAL_QID_BASE + 5
_RECORD = struct.Struct("<QQQ")  # local qid, local mid, id at the message origin


class TopologyDelta(BaseModel):
    """Topology changes by name, in this order: unbinds, deletes, declares, binds."""

    unbind: list[BindingDef] = Field(default_factory=list)
    delete_queues: list[str] = Field(default_factory=list)
    delete_exchanges: list[str] = Field(default_factory=list)
    declare_exchanges: list[ExchangeDef] = Field(default_factory=list)
    declare_queues: list[QueueDef] = Field(default_factory=list)  # qid: the origin's, unused
    bind: list[BindingDef] = Field(default_factory=list)

    def empty(self) -> bool:
        """Whether it changes nothing."""
        return not any(
            (self.unbind, self.delete_queues, self.delete_exchanges, self.declare_exchanges,
             self.declare_queues, self.bind)
        )  # fmt: skip


# An op's queue and message origin: (queue name, message origin), and the queue's vhost
# third when it is not `/` (so `/`'s keys are what they were before vhosts were carried).
Key = tuple[str, str] | tuple[str, str, str]


def make_key(vhost: str, queue: str, origin: str) -> Key:
    """The key of (vhost, queue, message origin) in an event's key table."""
    return (queue, origin) if vhost == DEFAULT_VHOST else (queue, origin, vhost)


def key_parts(key: Key) -> tuple[str, str, str]:
    """(vhost, queue name, message origin) of a key."""
    if len(key) == 2:
        return DEFAULT_VHOST, key[0], key[1]
    return key[2], key[0], key[1]


class BidiMeta(BaseModel):
    """The header of a bidirectional event."""

    origin: str  # the site that made the change
    oseq: int  # the event's seq at its origin
    hops: list[str]  # every site it went through, origin first
    keys: list[Key] = Field(default_factory=list)  # op.qid -> (queue, msg origin[, vhost])
    topology: TopologyDelta | None = None  # the vhost `/`'s
    # The other vhosts' deltas (a field a peer carrying `/` only ignores).
    vhost_topology: dict[str, TopologyDelta] = Field(default_factory=dict)
    seed: str | None = None  # a (re-)announcement of the origin's whole state: why


@dataclass(slots=True, frozen=True)
class BidiEvent:
    """One decoded bidirectional event."""

    meta: BidiMeta
    ops: list[JournalOp]
    created: float


def is_bidi_seed(body: bytes) -> bool:
    """Whether an event is a bidirectional site's (re-)announcement of its whole state."""
    if len(body) < _HEAD.size or body[0] != KIND_BIDI:
        return False
    size = _HEAD.unpack_from(body)[2]
    return BidiMeta.model_validate_json(body[_HEAD.size : _HEAD.size + size]).seed is not None


def encode_bidi(meta: BidiMeta, ops: Sequence[JournalOp], created: float) -> bytes:
    """The event's bytes."""
    head = meta.model_dump_json(exclude_defaults=True).encode()
    buf = bytearray(_HEAD.pack(KIND_BIDI, created, len(head)))
    buf += head
    encode_ops(ops, buf)
    return bytes(buf)


def decode_bidi(seq: int, body: bytes) -> BidiEvent:
    """Decode a bidirectional event; ValueError if malformed."""
    if len(body) < _HEAD.size:
        raise ValueError(f"event {seq}: {len(body)} bytes is shorter than its header")
    kind, created, size = _HEAD.unpack_from(body)
    if kind != KIND_BIDI:
        raise ValueError(f"event {seq}: kind {kind} in bidirectional mode (every site must run "
                         f"--mirror-role bidirectional)")  # fmt: skip
    start = _HEAD.size
    meta = BidiMeta.model_validate_json(body[start : start + size])
    return BidiEvent(meta, decode_ops(body[start + size :]), created)


def forwarded(body: bytes, meta: BidiMeta, hop: str) -> bytes:
    """The same event (`meta` decoded from it) with `hop` added to its hop list: what a
    site passes on."""
    _kind, created, size = _HEAD.unpack_from(body)
    start = _HEAD.size
    meta = meta.model_copy(update={"hops": [*meta.hops, hop]})
    head = meta.model_dump_json(exclude_defaults=True).encode()
    return _HEAD.pack(KIND_BIDI, created, len(head)) + head + body[start + size :]


# -- topology deltas ----------------------------------------------------------------------


def _shape(q: QueueDef) -> tuple[bool, bool, bool, str]:
    return q.durable, q.exclusive, q.auto_delete, json.dumps(q.arguments, sort_keys=True)


def _key(b: BindingDef) -> str:
    return b.model_dump_json()


def topology_delta(old: Definitions | None, new: Definitions) -> TopologyDelta:
    """What changed from `old` to `new` (None: everything in `new` is declared).

    A queue whose incarnation (qid) or shape changed is deleted and declared again
    (AMQP's "policy update"), so its messages go with it on the mirror as here."""
    old = old or Definitions()
    delta = TopologyDelta()
    before = {q.name: q for q in old.queues}
    after = {q.name: q for q in new.queues}
    for name, q in before.items():
        now = after.get(name)
        if now is None or now.qid != q.qid or _shape(now) != _shape(q):
            delta.delete_queues.append(name)
    for name, q in after.items():
        was = before.get(name)
        if was is None or was.qid != q.qid or _shape(was) != _shape(q):
            delta.declare_queues.append(q)
    ex_before = {e.name: e for e in old.exchanges}
    ex_after = {e.name: e for e in new.exchanges}
    for name, e in ex_before.items():
        if ex_after.get(name) != e:
            delta.delete_exchanges.append(name)
    delta.declare_exchanges = [e for n, e in ex_after.items() if ex_before.get(n) != e]
    b_before = {_key(b): b for b in old.bindings}
    b_after = {_key(b): b for b in new.bindings}
    delta.unbind = [b for k, b in b_before.items() if k not in b_after]
    delta.bind = [b for k, b in b_after.items() if k not in b_before]
    return delta


def vhost_deltas(
    old: Definitions | None, new: Definitions
) -> tuple[TopologyDelta, dict[str, TopologyDelta]]:
    """`topology_delta` per vhost: `/`'s delta and the other vhosts' that change something
    (a vhost gone from `new` has its objects deleted)."""
    old = old or Definitions()
    names = (old.vhost_names() | new.vhost_names()) - {DEFAULT_VHOST}
    root = topology_delta(old.of_vhost(DEFAULT_VHOST), new.of_vhost(DEFAULT_VHOST))
    others = {
        name: delta
        for name in sorted(names)
        if not (delta := topology_delta(old.of_vhost(name), new.of_vhost(name))).empty()
    }
    return root, others


def declares_only(delta: TopologyDelta) -> TopologyDelta:
    """A delta's declares and binds (a re-announcement: never deletes anything)."""
    return TopologyDelta(
        declare_exchanges=delta.declare_exchanges,
        declare_queues=delta.declare_queues,
        bind=delta.bind,
    )


def _builtin(exchange: str) -> bool:
    """The default exchange and the amq.* ones (no client declares or deletes them)."""
    return exchange == "" or exchange.startswith("amq.")


def apply_delta(
    local: Definitions, delta: TopologyDelta, vhost: str = DEFAULT_VHOST
) -> tuple[Definitions, bool]:
    """`local` (the topology of `vhost` here) with `delta` applied: local queue ids kept,
    new queues get local ids; and whether a queue was deleted. A declare of a queue that
    exists here with another shape, not deleted by the same delta, keeps the local one
    (two writers declared it differently at once; logged). What `delta` declares lands
    in `vhost`, whatever vhost its objects name (the event's key says where)."""
    queues = {q.name: q for q in local.queues}
    exchanges = {e.name: e for e in local.exchanges}
    bindings = {_key(b): b for b in local.bindings}
    next_qid = local.next_qid
    for b in delta.unbind:
        bindings.pop(_key(b.model_copy(update={"vhost": vhost})), None)
    deleted = False
    for name in delta.delete_queues:
        if not is_internal(name) and queues.pop(name, None) is not None:
            deleted = True
    for name in delta.delete_exchanges:
        if not _builtin(name):
            exchanges.pop(name, None)
    for e in delta.declare_exchanges:
        exchanges[e.name] = e.model_copy(update={"vhost": vhost})
    for q in delta.declare_queues:
        if is_internal(q.name):
            continue
        here = queues.get(q.name)
        if here is not None:
            if _shape(here) != _shape(q):
                log.warning("mirror: queue %r declared with other arguments on another site; "
                            "kept as it is here", q.name)  # fmt: skip
            continue
        queues[q.name] = q.model_copy(update={"qid": next_qid, "vhost": vhost})
        next_qid += 1
    for b in delta.bind:
        b = b.model_copy(update={"vhost": vhost})
        bindings[_key(b)] = b
    # Built-in exchanges (the default, amq.*) are in no definitions: always there.
    kept = [
        b
        for b in bindings.values()
        if b.queue in queues and (b.exchange in exchanges or _builtin(b.exchange))
    ]
    return (
        Definitions(
            exchanges=list(exchanges.values()),
            queues=list(queues.values()),
            bindings=kept,
            next_qid=next_qid,
        ),
        deleted,
    )


# -- the id map ---------------------------------------------------------------------------


class IdHost(Protocol):
    """The virtual host as the id map uses it."""

    next_mid: int
    queues: dict[str, Queue]

    def internal_queue(self, name: str, qid: int, *, locked: bool = True) -> Queue:
        """The broker's own durable queue `name`, made if missing."""
        ...


class IdMap:
    """(message origin, its id there) <-> this site's message id, durable per message."""

    def __init__(self, vhost: IdHost, name: str) -> None:
        self.vhost = vhost
        self.name = name  # this site's origin id
        self._local: dict[tuple[str, int], int] = {}
        self._origin: dict[int, tuple[str, int]] = {}
        self._records: dict[tuple[int, int], int] = {}  # (local qid, local mid) -> record mid
        self._refs: Counter[int] = Counter()  # local mid -> queues holding it here
        self._queue: Queue | None = None
        self._seen: tuple[int, int] = (0, 0)  # the records as this map last left them

    @property
    def queue(self) -> Queue:
        """The records' queue; the map is rebuilt from it when the records changed by
        other means than this map (recovered, or replicated while this broker was the
        pair's passive): records are only appended (higher ids) or removed, so their
        count and last id tell."""
        queue = self.vhost.internal_queue(IDS_NAME, IDS_QID)
        if queue is not self._queue or _fingerprint(queue) != self._seen:
            self.load(queue)
        return queue

    def load(self, queue: Queue) -> None:
        """Rebuild the map from the records."""
        self._queue = queue
        self._local.clear()
        self._origin.clear()
        self._records.clear()
        self._refs.clear()
        for entry in queue.entries:
            body = entry.message.body
            qid, mid, omid = _RECORD.unpack_from(body)
            self._remember(body[_RECORD.size :].decode(), omid, qid, mid, entry.message.mid)
        self._seen = _fingerprint(queue)

    def _remember(self, origin: str, omid: int, qid: int, mid: int, record: int) -> None:
        self._local[(origin, omid)] = mid
        self._origin[mid] = (origin, omid)
        self._records[(qid, mid)] = record
        self._refs[mid] += 1

    def __len__(self) -> int:
        return len(self._records)

    def local(self, origin: str, omid: int) -> int | None:
        """This site's id of a message (None: not here); its own messages keep theirs."""
        self.queue  # noqa: B018 (loads the map on first use)
        if origin == self.name:
            return omid
        return self._local.get((origin, omid))

    def origin_of(self, mid: int) -> tuple[str, int]:
        """(message origin, its id there) of this site's message `mid`."""
        self.queue  # noqa: B018
        return self._origin.get(mid, (self.name, mid))

    def add(self, origin: str, omid: int, qid: int, mid: int) -> JournalOp | None:
        """Map a message applied into queue `qid` as `mid`; the record's op (None: the
        message is this site's own, or the record exists)."""
        queue = self.queue
        if origin == self.name or (qid, mid) in self._records:
            return None
        record = self.vhost.next_mid
        self.vhost.next_mid = record + 1
        body = _RECORD.pack(qid, mid, omid) + origin.encode()
        header = record_header(len(body))
        queue.entries.append(
            Entry(Message(record, "", IDS_NAME, header, body, True, None, None), None, True)
        )
        queue.bytes += len(body)
        self._remember(origin, omid, qid, mid, record)
        self._seen = _fingerprint(queue)
        return StoredMessage(record, IDS_QID, "", IDS_NAME, header, body, None)

    def drop(self, qid: int, mid: int, removed: list[Entry] | None = None) -> JournalOp | None:
        """Message `mid` left queue `qid` here: its record goes (onto `removed`, if given:
        `undo` puts it back); the op (None: unmapped)."""
        queue = self.queue
        record = self._records.pop((qid, mid), None)
        if record is None:
            return None
        entry = queue.remove_mid(record)
        if removed is not None and entry is not None:
            removed.append(entry)
        self._seen = _fingerprint(queue)
        self._refs[mid] -= 1
        if self._refs[mid] <= 0:
            del self._refs[mid]
            key = self._origin.pop(mid, None)
            if key is not None:
                self._local.pop(key, None)
        return Settle(IDS_QID, record)

    def undo(self, added: Iterable[tuple[int, int]], removed: Iterable[Entry]) -> list[JournalOp]:
        """Take a failed batch's changes back (in memory): the records it `added` (by local
        queue and message id) go, those it removed (`drop`) come back; the ops that do the
        same on a passive that applied the batch. A message whose ack the failure undid is
        back in its queue here: without its record, its next settle would name it as this
        site's own message, which the peer does not hold (the peer's copy kept forever)."""
        ops = [op for qid, mid in added if (op := self.drop(qid, mid)) is not None]
        queue = self.queue
        for entry in removed:
            body = entry.message.body
            qid, mid, omid = _RECORD.unpack_from(body)
            if (qid, mid) in self._records:
                continue  # recorded again since (a later batch)
            entries = queue.entries
            at = bisect.bisect_left(entries, entry.message.mid, key=lambda e: e.message.mid)
            entries.insert(at, entry)
            queue.bytes += len(body)
            self._remember(body[_RECORD.size :].decode(), omid, qid, mid, entry.message.mid)
            m = entry.message
            ops.append(StoredMessage(m.mid, IDS_QID, "", IDS_NAME, m.header, body, None))
        self._seen = _fingerprint(queue)
        return ops

    def prune(self, live: Iterable[int]) -> list[JournalOp]:
        """Drop the records of queues deleted since; the ops."""
        self.queue  # noqa: B018 (the map as its records now stand)
        alive = set(live)
        gone = [(qid, mid) for (qid, mid) in self._records if qid not in alive]
        return [op for qid, mid in gone if (op := self.drop(qid, mid)) is not None]


def id_record(body: bytes) -> tuple[int, int, int, str]:
    """An id map record's (local qid, local mid, id at the message origin, message origin);
    the audit log reads the records a batch journals (broker/auditlog.py)."""
    qid, mid, omid = _RECORD.unpack_from(body)
    return qid, mid, omid, body[_RECORD.size :].decode()


def _fingerprint(queue: Queue) -> tuple[int, int]:
    entries = queue.entries
    return len(entries), entries[-1].message.mid if entries else 0


def event_keys(
    ops: Iterable[JournalOp], name_of: dict[int, tuple[str, str]], ids: IdMap
) -> tuple[list[Key], list[JournalOp]]:
    """This site's ops in the origin's terms (`name_of`: qid -> (vhost, queue name)): the
    key table and the translated ops (ops of a queue no longer here are left out)."""
    keys: list[Key] = []
    index: dict[Key, int] = {}
    out: list[JournalOp] = []
    for op in ops:
        named = name_of.get(op.qid)
        if named is None:
            continue
        origin, omid = ids.origin_of(op.mid)
        key = make_key(named[0], named[1], origin)
        at = index.get(key)
        if at is None:
            at = index[key] = len(keys)
            keys.append(key)
        if type(op) is StoredMessage:
            out.append(StoredMessage(omid, at, op.exchange, op.routing_key, op.header, op.body,
                                     op.expires_at))  # fmt: skip
        else:
            out.append(Settle(at, omid))
    return keys, out
