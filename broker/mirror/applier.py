"""The mirror's side: apply events idempotently, in the same group commit as the applied mark.

Sans-I/O: `apply` changes the virtual host and returns the batch to wait for;
the listener (`listener.py`) acknowledges the returned sequence number once that
batch is complete (on both disks of the mirror's own pair).

Identity: the mirror keeps the source's queue ids (`qid`) and message ids
(`mid`), so an ack event names exactly the message it settles and no translation
table has to be kept durable. The mirror's own records live in internal queues
with ids far above any the source hands out (`INTERNAL_QID_BASE`):

- `amq.twinmq.mirror-applied.<origin>`: one record, the highest event applied
  from that origin (`AppliedMark`), replaced in every apply batch: the mark and
  the effects it covers are durable together, so a re-sent event (a reconnect,
  a source failover) is recognised and skipped, and a crash re-applies nothing.
- `amq.twinmq.mirror-dlq`: events that still fail after `retries` attempts, with
  the reason in their headers; the stream goes on past them.
- `amq.twinmq.mirror-orphans`: messages a (re-)seed's snapshot showed the source does
  not hold (ones it never mirrored before a forced failover, or settled while this
  mirror missed events), moved out of their queues with the queue's name in their
  headers: counted and kept, never discarded.

A settle of a message the mirror does not hold goes to a bounded holding set
(seed 004's "holding queue"): if the message arrives later it is dropped on
arrival; entries expire after `holding_ttl` seconds.
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

from pydantic import BaseModel, Field

from twinmq.broker.commit import Waiter
from twinmq.broker.definitions import DEFAULT_VHOST as ROOT
from twinmq.broker.definitions import Definitions, QueueDef
from twinmq.broker.fieldtable import Table, Value, encode_table, long_int, text
from twinmq.broker.heap import HeapFreezer
from twinmq.broker.journal import JournalOp, Settle, StoredMessage
from twinmq.broker.message import Entry, Message
from twinmq.broker.mirror import metrics
from twinmq.broker.mirror.bidi import (
    BidiMeta,
    IdMap,
    TopologyDelta,
    apply_delta,
    decode_bidi,
    key_parts,
)
from twinmq.broker.mirror.events import (
    INTERNAL_PREFIX,
    INTERNAL_QID_BASE,
    TOP_MID,
    SnapshotRange,
    decode_event,
    is_internal,
    record_header,
    replace_record,
)
from twinmq.broker.queue import Queue

log = logging.getLogger(__name__)

MARK_PREFIX: Final = INTERNAL_PREFIX + "mirror-applied."
DLQ_NAME: Final = INTERNAL_PREFIX + "mirror-dlq"
DLQ_QID: Final = INTERNAL_QID_BASE + 2
ORPHANS_NAME: Final = INTERNAL_PREFIX + "mirror-orphans"
ORPHANS_QID: Final = INTERNAL_QID_BASE + 4
_MARK_QID_BASE: Final = INTERNAL_QID_BASE + (1 << 32)


class QueueHolder(Protocol):
    """A virtual host as the bidirectional applier finds a queue by name in it."""

    queues: dict[str, Queue]


class MirrorState(Protocol):
    """The virtual host as the applier uses it."""

    next_mid: int

    @property
    def vhosts(self) -> Mapping[str, QueueHolder]:
        """Every vhost of the broker, by name."""
        ...

    def internal_queue(self, name: str, qid: int, *, locked: bool = True) -> Queue:
        """The broker's own durable queue `name`, made if missing."""
        ...

    queues: dict[str, Queue]

    def queue_by_qid(self, qid: int) -> Queue | None:
        """The queue of an incarnation id."""
        ...

    def definitions(self) -> Definitions:
        """The durable topology of the vhost `/` (the bidirectional mode's)."""
        ...

    def all_definitions(self) -> Definitions:
        """The durable topology of every vhost."""
        ...

    def all_queues(self) -> list[Queue]:
        """The queues of every vhost."""
        ...

    def apply_definitions(self, defs: Definitions, served: Collection[str] | None = None) -> None:
        """Make the topology of every vhost equal to `defs` (a vhost it names made here);
        with `served`, a vhost neither names is dropped (emptied first)."""
        ...

    def apply_ops(self, ops: list[JournalOp]) -> list[str]:
        """Apply enqueues and settles (the caller journals them); their dedup keys."""
        ...

    def remember_when_durable(self, keys: list[str], batch: int) -> None:
        """Admit dedup keys once `batch` is durable."""
        ...


class MirrorLog(Protocol):
    """The group committer as the applier uses it."""

    def add(self, ops: Iterable[JournalOp]) -> int:
        """Journal ops in the open batch; its number."""
        ...

    def await_durable(self, waiter: Waiter) -> None:
        """Call `waiter.durable(batch)` as batches complete."""
        ...


class AppliedMark(BaseModel):
    """The applied high-water mark of one origin, as its record's body holds it."""

    origin: str
    seq: int
    applied_at: float
    created: float  # when the source made that event (the mirror's lag)
    # Bidirectional mode: per event origin, the highest `oseq` applied through this link.
    origins: dict[str, int] = Field(default_factory=dict)


class Forwarder(Protocol):
    """The site's own mirror source as the bidirectional applier uses it."""

    applying: bool  # set while the applier changes the topology: no event of that

    def exclude(self, ops: Iterable[JournalOp]) -> None:
        """These ops are applied from a link: never events of this site."""
        ...

    def forward(self, body: bytes, meta: BidiMeta) -> StoredMessage | None:
        """The op of the event passed on to this site's mirror (None: not passed on)."""
        ...

    def forwarded(self, batch: int, seqs: Iterable[int]) -> None:
        """Those events are journaled in `batch`."""
        ...


@dataclass(slots=True)
class _BidiBatch:
    """What one bidirectional apply batch tracks besides its journal."""

    origins: dict[str, int]  # event origin -> highest oseq applied through this link
    seen: dict[str, int]  # the same through any link
    forwards: list[int] = field(default_factory=list)  # seqs of the events passed on
    touched: set[Queue] = field(default_factory=set)  # queues given messages


@dataclass(slots=True)
class Applied:
    """What one `apply` did: the batch to wait for, the seq to acknowledge then, and why
    it stopped early (an event to retry after a reconnect), if it did."""

    batch: int
    seq: int
    applied: int
    retry: str | None = None


class HoldingSet:
    """Settles that arrived before their message: bounded, each kept `ttl` seconds."""

    def __init__(self, limit: int, ttl: float) -> None:
        self.limit = limit
        self.ttl = ttl
        self._held: OrderedDict[Hashable, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def add(self, key: Hashable, now: float) -> None:
        """Hold a settle of (qid, mid) (bidirectional: (queue, origin, id)) until
        `now + ttl`; the oldest go when full."""
        self._expire(now)
        self._held[key] = now + self.ttl
        while len(self._held) > self.limit:
            self._held.popitem(last=False)

    def clear(self) -> None:
        """Forget every held settle."""
        self._held.clear()

    def take(self, key: Hashable, now: float) -> bool:
        """Whether a settle of (qid, mid) was held (and is now used up)."""
        self._expire(now)
        return self._held.pop(key, None) is not None

    def _expire(self, now: float) -> None:
        held = self._held
        while held:
            key, until = next(iter(held.items()))
            if until > now:
                break
            del held[key]


def mark_queue(origin: str) -> tuple[str, int]:
    """The name and queue id of an origin's applied-mark queue."""
    return MARK_PREFIX + origin, _MARK_QID_BASE + zlib.crc32(origin.encode())


class MirrorApplier:
    """Applies events from any number of origins to this (mirror) broker."""

    def __init__(
        self,
        vhost: MirrorState,
        log: MirrorLog,
        clock: Callable[[], float],
        *,
        retries: int = 3,
        holding_limit: int = 100_000,
        holding_ttl: float = 600.0,
        ids: IdMap | None = None,
        forwarder: Forwarder | None = None,
    ) -> None:
        self.vhost = vhost
        self.log = log
        self.clock = clock
        self.retries = retries
        self.holding = HoldingSet(holding_limit, holding_ttl)
        self._failures: dict[tuple[str, int], int] = {}
        self.ids = ids  # bidirectional mode (`bidi.py`): ids mapped per origin
        self.forwarder = forwarder
        # Origins whose SEED event came and whose seed's topology has not yet: that one
        # deletes the queues the source does not have, and their messages are orphans.
        self._seeding: set[str] = set()
        # Keeps the applied messages out of full collections (`broker/heap.py`).
        self.heap: HeapFreezer | None = None
        # The vhosts this broker's users file declares (set by the server): a vhost the
        # source deleted is dropped here too unless this site serves it (then kept, empty,
        # as a passive keeps it: `VirtualHost.apply_definitions`).
        self.served: Callable[[], Collection[str]] | None = None

    def mark(self, origin: str) -> AppliedMark | None:
        """The last applied mark of `origin`, as durable (or about to be)."""
        name, qid = mark_queue(origin)
        queue = self.vhost.internal_queue(name, qid)
        if not queue.entries:
            return None
        return AppliedMark.model_validate_json(queue.entries[-1].message.body)

    def origins(self) -> list[str]:
        """The origins this mirror holds a mark of."""
        return [
            AppliedMark.model_validate_json(q.entries[-1].message.body).origin
            for name, q in self.vhost.queues.items()
            if name.startswith(MARK_PREFIX) and q.entries
        ]

    def applied(self, origin: str) -> int:
        """The highest event seq of `origin` applied here (0: none)."""
        mark = self.mark(origin)
        return 0 if mark is None else mark.seq

    def apply(self, origin: str, events: list[tuple[int, bytes]]) -> Applied:
        """Apply the events after the origin's mark, in order, as one group commit.

        Bidirectional mode: `origin` is the peer of the link; each event names its own
        origin (`_apply_bidi`), and the link's mark also keeps the highest event applied
        per event origin."""
        previous = self.mark(origin)
        done = 0 if previous is None else previous.seq
        created = 0.0 if previous is None else previous.created
        seen = self._seen() if self.ids is not None else {}
        bidi = _BidiBatch(dict(previous.origins) if previous else {}, seen)
        journal: list[JournalOp] = []
        keys: list[str] = []
        applied = 0
        retry: str | None = None
        for seq, body in events:
            if seq <= done:
                continue  # applied before: a re-sent batch changes nothing
            try:
                if self.ids is not None:
                    created = self._apply_bidi(seq, body, journal, keys, bidi)
                else:
                    created = self._apply_event(origin, seq, body, journal, keys)
            except Exception as exc:
                retry = self._failed(origin, seq, body, exc, journal)
                if retry is not None:
                    break
            done = seq
            applied += 1
        if applied == 0:
            return Applied(0, done, 0, retry)
        journal += self._new_mark(origin, previous, done, created, bidi.origins)
        if self.forwarder is not None:
            self.forwarder.exclude(journal)  # applied here: never this site's own events
        batch = self.log.add(journal)
        if self.forwarder is not None and bidi.forwards:
            self.forwarder.forwarded(batch, bidi.forwards)
        if keys:
            self.vhost.remember_when_durable(keys, batch)
        now = self.clock()
        for queue in bidi.touched:
            if not queue.deleted:
                queue.dispatch(now)  # consumers here get what the other site published
        metrics.APPLIED.inc(applied)
        if self.heap is not None:
            self.heap.freeze()
        return Applied(batch, done, applied, retry)

    def _apply_event(
        self, origin: str, seq: int, body: bytes, journal: list[JournalOp], keys: list[str]
    ) -> float:
        """Apply one event of the one-way mode; when it was made."""
        event = decode_event(seq, body)
        if event.definitions is not None:
            emptied: list[QueueDef] = []
            if origin in self._seeding:
                self._seeding.discard(origin)
                emptied = self._orphan_dropped_queues(origin, event.definitions, journal)
            self._apply_definitions(event.definitions, emptied)
        elif event.seed is not None:
            self._seeding.add(origin)
            self.holding.clear()  # settles of a past the seed makes irrelevant
            metrics.SEEDS.inc()
            log.warning("mirror: seed from %s (%s): rebuilding", origin, event.seed)
        elif event.ops is not None:
            if event.fixes is not None and event.snapshot is not None:
                # A seed's snapshot as this mirror's delta (`delta.py`): the messages it
                # lacked, and the few ranges where it holds others.
                qid = event.snapshot.qid
                for fix in event.fixes:
                    if fix.keep is not None:
                        covered = SnapshotRange(qid, fix.lo, fix.hi)
                        journal += self._orphan(origin, covered, set(fix.keep))
            elif event.snapshot is not None:
                journal += self._orphan(origin, event.snapshot, {op.mid for op in event.ops})
            journal += self._apply_ops(event.ops, keys)
        return event.created

    def _failed(
        self, origin: str, seq: int, body: bytes, exc: Exception, journal: list[JournalOp]
    ) -> str | None:
        """An event failed to apply: why, if it is to be retried after a reconnect (the
        batch stops before it); None once it went to the DLQ (the stream goes on)."""
        failures = self._failures.get((origin, seq), 0) + 1
        if failures < self.retries:
            self._failures[(origin, seq)] = failures
            retry = f"event {seq} of {origin} failed ({exc}); attempt {failures}"
            log.warning("mirror: %s: retried after a reconnect", retry)
            return retry
        self._failures.pop((origin, seq), None)
        journal.append(self._dead_letter(origin, seq, body, exc))
        log.error("mirror: event %d of %s dead-lettered after %d attempts: %s",
                  seq, origin, failures, exc)  # fmt: skip
        return None

    def _apply_definitions(self, defs: Definitions, emptied: Iterable[QueueDef] = ()) -> None:
        """The source's topology of every vhost (a vhost it names and this broker lacks is
        made; one it no longer names is emptied, and dropped unless served here), plus this
        broker's internal queues, kept as they are (and `emptied`: queues whose messages a
        seed just orphaned)."""
        own = [q for q in self.vhost.all_definitions().queues if is_internal(q.name)]
        self.vhost.apply_definitions(
            Definitions(
                exchanges=defs.exchanges,
                queues=[*(q for q in defs.queues if not is_internal(q.name)), *own, *emptied],
                bindings=[b for b in defs.bindings if not is_internal(b.queue)],
                next_qid=defs.next_qid,
            ),
            served=None if self.served is None else self.served(),
        )

    def _apply_ops(self, ops: list[JournalOp], keys: list[str]) -> list[JournalOp]:
        """Apply one event's ops; those to journal (held settles are not)."""
        now = self.clock()
        out: list[JournalOp] = []
        added: set[tuple[int, int]] = set()
        for op in ops:
            queue = self.vhost.queue_by_qid(op.qid)
            if queue is None or op.qid >= INTERNAL_QID_BASE:
                continue  # a queue deleted since (the topology event says so)
            key = (op.qid, op.mid)
            if type(op) is StoredMessage:
                if self.holding.take(key, now):
                    metrics.HELD_APPLIED.inc()
                    continue  # its settle came first: taken and settled at once
                if _may_hold(queue, op.mid) and _holds(queue, op.mid):
                    continue  # here already (a snapshot overlapping a live event)
                added.add(key)
                out.append(op)
            elif key in added or _holds(queue, op.mid):
                out.append(op)
            else:
                self.holding.add(key, now)
        keys += self.vhost.apply_ops(out)
        return out

    def _orphan_dropped_queues(
        self, origin: str, defs: Definitions, journal: list[JournalOp]
    ) -> list[QueueDef]:
        """A seed's topology deletes the queues here the source does not have (by queue
        id: one of the same name and another id is another queue): the messages they hold
        are orphans, kept, never deleted with them (a forced failover's old source holds
        queues it declared while the promoted site could not see it, with confirmed
        messages in them; a NeedsResync mirror, queues the source deleted meanwhile).
        Returns those that held messages: kept, emptied, until the source's next topology
        (the topology is written before the batch of its turn: deleted now, a crash
        before the batch would take the messages with the queue)."""
        kept = {q.qid for q in defs.queues}
        emptied: list[QueueDef] = []
        for queue in self.vhost.all_queues():  # every vhost's: qids are the broker's
            qid = queue.definition.qid
            if qid in kept or qid >= INTERNAL_QID_BASE or is_internal(queue.name):
                continue
            moved = self._orphan(origin, SnapshotRange(qid, 0, TOP_MID), set())
            if moved:
                journal += moved
                emptied.append(queue.definition)
        return emptied

    def _orphan(self, origin: str, covered: SnapshotRange, source_has: set[int]) -> list[JournalOp]:
        """Move what this mirror holds in `covered` and the source does not (`source_has`
        are the source's message ids there) to the orphan queue; the ops that journal it."""
        queue = self.vhost.queue_by_qid(covered.qid)
        if queue is None or covered.qid >= INTERNAL_QID_BASE:
            return []

        def stale(entry: Entry) -> bool:
            mid = entry.message.mid
            return covered.lo <= mid <= covered.hi and mid not in source_has

        gone = [e for e in queue.entries if stale(e)]
        if gone:
            queue.entries = type(queue.entries)(e for e in queue.entries if not stale(e))
        for held in (queue.delivered, queue.held_aside):
            for mid in [mid for mid, e in held.items() if stale(e)]:
                gone.append(held.pop(mid))  # a replica consumer's ack of it is a no-op
        if not gone:
            return []
        orphans = self.vhost.internal_queue(ORPHANS_NAME, ORPHANS_QID, locked=False)
        out: list[JournalOp] = []
        for entry in gone:
            m = entry.message
            queue.bytes -= entry.size
            out.append(Settle(covered.qid, m.mid))
            fields: list[tuple[str, Value]] = [
                ("x-mirror-origin", text(origin)),
                ("x-mirror-orphan-queue", text(queue.name)),
                ("x-mirror-orphan-mid", long_int(m.mid)),
            ]
            if queue.definition.vhost != ROOT:  # `/`'s orphans' headers as before vhosts
                fields.append(("x-mirror-orphan-vhost", text(queue.definition.vhost)))
            table = Table(tuple(fields))
            header = _header_with(table, len(m.body))
            orphan = Message(m.mid, m.exchange, queue.name, header, m.body, True, None, None)
            orphans.entries.append(Entry(orphan, None, True))
            orphans.bytes += len(m.body)
            out.append(
                StoredMessage(m.mid, ORPHANS_QID, m.exchange, queue.name, header, m.body, None)
            )
        metrics.ORPHANED.inc(len(gone))
        log.warning("mirror: %d messages of queue %r that %s does not hold moved to %s",
                    len(gone), queue.name, origin, ORPHANS_NAME)  # fmt: skip
        return out

    # -- the bidirectional mode ------------------------------------------------------------

    def _seen(self) -> dict[str, int]:
        """Per event origin, the highest `oseq` applied here through any link."""
        seen: dict[str, int] = {}
        for name, queue in self.vhost.queues.items():
            if name.startswith(MARK_PREFIX) and queue.entries:
                mark = AppliedMark.model_validate_json(queue.entries[-1].message.body)
                for origin, oseq in mark.origins.items():
                    seen[origin] = max(seen.get(origin, 0), oseq)
        return seen

    def _apply_bidi(
        self, seq: int, body: bytes, journal: list[JournalOp], keys: list[str], batch: _BidiBatch
    ) -> float:
        """Apply one bidirectional event; when it was made. What came back to its origin
        (or to a site it went through) or was applied before by another path is counted
        and skipped; the rest is applied through the id map and passed on, in the group
        commit of the link's mark and the per-origin marks."""
        assert self.ids is not None
        name = self.ids.name
        event = decode_bidi(seq, body)
        meta = event.meta
        if meta.origin == name or name in meta.hops or meta.oseq <= batch.seen.get(meta.origin, 0):
            metrics.LOOPED.inc()  # its own, or here before: never applied twice
            return event.created
        if meta.seed is not None:
            log.info("mirror: %s announces its whole state (%s)", meta.origin, meta.seed)
        deltas = dict(meta.vhost_topology)
        deltas.pop(ROOT, None)  # `/`'s is `topology` (a peer carrying `/` only reads it)
        if meta.topology is not None:
            deltas = {ROOT: meta.topology, **deltas}
        if deltas:
            journal += self._apply_delta(deltas)
        journal += self._apply_named(meta, event.ops, keys, batch.touched)
        batch.seen[meta.origin] = batch.origins[meta.origin] = meta.oseq
        if self.forwarder is not None:
            forward = self.forwarder.forward(body, meta)
            if forward is not None:
                journal.append(forward)
                batch.forwards.append(forward.mid)
        return event.created

    def _apply_delta(self, deltas: dict[str, TopologyDelta]) -> list[JournalOp]:
        """Another site's topology changes, by vhost and name (a vhost named and missing
        here is made; the other vhosts stay as they are); the id map's records of queues
        they deleted go (the ops)."""
        assert self.ids is not None
        everything = self.vhost.all_definitions()
        next_qid = everything.next_qid
        parts: dict[str, Definitions] = {}
        deleted = False
        for vhost, delta in deltas.items():
            local = everything.of_vhost(vhost).model_copy(update={"next_qid": next_qid})
            parts[vhost], gone = apply_delta(local, delta, vhost)
            next_qid = parts[vhost].next_qid
            deleted = deleted or gone
        kept = everything.model_copy(
            update={
                "exchanges": [e for e in everything.exchanges if e.vhost not in parts],
                "queues": [q for q in everything.queues if q.vhost not in parts],
                "bindings": [b for b in everything.bindings if b.vhost not in parts],
            }
        )
        topology = Definitions(
            exchanges=[*kept.exchanges, *(e for d in parts.values() for e in d.exchanges)],
            queues=[*kept.queues, *(q for d in parts.values() for q in d.queues)],
            bindings=[*kept.bindings, *(b for d in parts.values() for b in d.bindings)],
            next_qid=next_qid,
        )
        # A vhost these deltas left with nothing durable (its deletion on the other site
        # deletes its queues and exchanges), that this site does not serve, is dropped;
        # never another vhost, nor one where a client still holds a transient queue (its
        # connection open since the vhost was retired here).
        kept_vhosts = None
        if self.served is not None:
            vhosts = self.vhost.vhosts
            busy = {n for n, v in vhosts.items() if any(not q.durable for q in v.queues.values())}
            kept_vhosts = {*self.served(), *busy, *(n for n in vhosts if n not in parts)}
        if self.forwarder is not None:
            self.forwarder.applying = True
        try:
            self.vhost.apply_definitions(topology, served=kept_vhosts)
        finally:
            if self.forwarder is not None:
                self.forwarder.applying = False
        if not deleted:
            return []
        return self.ids.prune(q.definition.qid for q in self.vhost.all_queues())

    def _apply_named(
        self, meta: BidiMeta, ops: list[JournalOp], keys: list[str], touched: set[Queue]
    ) -> list[JournalOp]:
        """Apply one bidirectional event's ops (queues by name, messages through the id
        map); the ops to journal: the effects and the map's records."""
        ids = self.ids
        assert ids is not None
        now = self.clock()
        out: list[JournalOp] = []
        records: list[JournalOp] = []
        added: set[tuple[int, int]] = set()
        vhosts = self.vhost.vhosts
        for op in ops:
            vname, qname, morigin = key_parts(meta.keys[op.qid])
            vhost = vhosts.get(vname)
            queue = None if vhost is None else vhost.queues.get(qname)
            if queue is None or is_internal(qname) or not queue.durable:
                continue  # a queue deleted since (its delete is an event too)
            qid = queue.definition.qid
            local = ids.local(morigin, op.mid)
            held = (vname, qname, morigin, op.mid)
            if type(op) is StoredMessage:
                if self.holding.take(held, now):
                    metrics.HELD_APPLIED.inc()
                    continue  # its settle came first: taken and settled at once
                if local is not None and (_holds(queue, local) or (qid, local) in added):
                    continue  # here already (an announcement overlapping a live event)
                if local is None:
                    local = self.vhost.next_mid
                    self.vhost.next_mid = local + 1
                added.add((qid, local))
                out.append(StoredMessage(local, qid, op.exchange, op.routing_key, op.header,
                                         op.body, op.expires_at))  # fmt: skip
                record = ids.add(morigin, op.mid, qid, local)
                if record is not None:
                    records.append(record)
                touched.add(queue)
            elif local is not None and ((qid, local) in added or _holds(queue, local)):
                delivered = queue.delivered.pop(local, None)
                if delivered is not None:
                    queue.bytes -= delivered.size  # a consumer's ack of it here is a no-op
                out.append(Settle(qid, local))
                added.discard((qid, local))
                record = ids.drop(qid, local)
                if record is not None:
                    records.append(record)
            else:
                self.holding.add(held, now)
        keys += self.vhost.apply_ops(out)
        return out + records

    def _new_mark(
        self,
        origin: str,
        previous: AppliedMark | None,
        seq: int,
        created: float,
        origins: dict[str, int] | None = None,
    ) -> list[JournalOp]:
        """The ops that replace the origin's mark (and the in-memory record)."""
        queue = self.vhost.internal_queue(*mark_queue(origin))
        body = AppliedMark(
            origin=origin, seq=seq, applied_at=self.clock(), created=created, origins=origins or {}
        )
        return replace_record(queue, seq, body.model_dump_json().encode())

    def _dead_letter(self, origin: str, seq: int, body: bytes, exc: Exception) -> JournalOp:
        """Keep an event that cannot be applied in the mirror DLQ, with the reason."""
        queue = self.vhost.internal_queue(DLQ_NAME, DLQ_QID, locked=False)
        table = Table(
            (
                ("x-mirror-origin", text(origin)),
                ("x-mirror-seq", long_int(seq)),
                ("x-mirror-reason", text(str(exc)[:1000])),
            )
        )
        header = _header_with(table, len(body))
        message = Message(seq, "", DLQ_NAME, header, body, True, None, None)
        queue.entries.append(Entry(message, None, True))
        queue.bytes += len(body)
        metrics.DEAD_LETTERED.inc()
        return StoredMessage(seq, DLQ_QID, "", DLQ_NAME, header, body, None)


def _header_with(headers: Table, body_size: int) -> bytes:
    """An internal record's content header carrying `headers` (property flag 0x2000)."""
    return record_header(body_size)[:-2] + struct.pack(">H", 0x2000) + encode_table(headers)


def _may_hold(queue: Queue, mid: int) -> bool:
    """False when `queue` certainly lacks `mid` (the usual case: a new message is newer
    than everything ready there), without a scan."""
    return bool(queue.delivered or queue.held_aside) or (
        bool(queue.entries) and queue.entries[-1].message.mid >= mid
    )


def _holds(queue: Queue, mid: int) -> bool:
    """Whether `queue` has message `mid` (ready, delivered or held aside)."""
    entries = queue.entries
    if entries and entries[0].message.mid == mid:
        return True
    if mid in queue.delivered or mid in queue.held_aside:
        return True
    return any(e.message.mid == mid for e in entries)
