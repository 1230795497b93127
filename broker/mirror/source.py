"""The source's replication queue: mirror events journaled in the group commit they describe.

The committer's tap (`GroupCommitter.tap`) hands every batch's ops here as the
batch closes; the event made of them is one more op of *that* batch, so a crash
keeps both or neither (no event lost, none invented), and the pair's passive
receives it like any op: a promoted passive holds the same events under the same
sequence numbers. Topology changes add an event to the open batch right after
the definitions file is replaced; the event of the whole topology emitted at
every activation covers a crash between the two.

Events leave the queue only when the mirror acknowledges them (`acked`); the
link (`link.py`) sends only events whose batch is complete here
(`durable_seq`): the mirror never applies what the source may still lose.
"""

from __future__ import annotations

import bisect
import logging
import struct
import zlib
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterable
from itertools import islice
from operator import attrgetter
from typing import Final, Protocol

from pydantic import BaseModel

from twinmq.broker.commit import Waiter
from twinmq.broker.definitions import DEFAULT_VHOST, Definitions
from twinmq.broker.heap import HeapFreezer
from twinmq.broker.journal import JournalOp, Settle, StoredMessage
from twinmq.broker.message import Entry, Message
from twinmq.broker.mirror import metrics
from twinmq.broker.mirror.bidi import (
    BidiMeta,
    IdMap,
    TopologyDelta,
    declares_only,
    encode_bidi,
    event_keys,
    forwarded,
    is_bidi_seed,
    vhost_deltas,
)
from twinmq.broker.mirror.events import (
    INTERNAL_PREFIX,
    INTERNAL_QID_BASE,
    TOP_MID,
    SnapshotRange,
    encode_definitions_event,
    encode_ops_event,
    encode_seed_event,
    encode_snapshot_event,
    event_created,
    is_seed,
    mirrored_definitions,
    ops_event,
    record_header,
    replace_record,
    restore_record,
)
from twinmq.broker.queue import Queue

log = logging.getLogger(__name__)

QUEUE_NAME: Final = INTERNAL_PREFIX + "mirror"
QUEUE_QID: Final = INTERNAL_QID_BASE + 1
# Bounds of one snapshot event (an event is applied as one group commit on the mirror).
SNAPSHOT_EVENT_BYTES: Final = 1024 * 1024
SNAPSHOT_EVENT_OPS: Final = 4096
# An op's fixed part in the journal's encoding (broker/journal/ops.py): per-queue lag bytes.
MESSAGE_OP_BYTES: Final = struct.calcsize("<BQQdHHII")
SETTLE_OP_BYTES: Final = struct.calcsize("<BQQ")
_QID = attrgetter("qid")
# A full mesh (several targets): each target's cursor, one record per target.
CURSOR_PREFIX: Final = INTERNAL_PREFIX + "mirror-cursor."
_CURSOR_QID_BASE: Final = INTERNAL_QID_BASE + (2 << 32)


def cursor_queue(target: str) -> tuple[str, int]:
    """The name and queue id of a mesh target's cursor record."""
    return CURSOR_PREFIX + target, _CURSOR_QID_BASE + zlib.crc32(target.encode())


def _within(seq: int, ranges: list[tuple[int, int]]) -> bool:
    """Whether `seq` lies in one of the (first, last) `ranges`."""
    return any(lo <= seq <= hi for lo, hi in ranges)


class TargetCursor(BaseModel):
    """A mesh target's cursor on the replication queue, as its record's body holds it."""

    target: str  # the address as configured (`--mirror-to`)
    acked: int  # the newest event it acknowledged
    peer: str | None = None  # its mirror id, as its last handshake said
    needs_resync: str | None = None  # it fell past the retention bound: why
    # The newest event trimmed from the queue when this record was written: recovered
    # (the highest of every record, listed targets or not) so that a target whose mark is
    # below it gets the announcement after a restart too (`gap`): a target dropped from
    # --mirror-to and named again lacks what was trimmed while it was not listed.
    trimmed: int = 0
    # Re-seed announcements made for other targets, as (first, last) event ranges: this
    # target has every event, so it is never sent them (a message it consumed meanwhile
    # would come back).
    skips: list[tuple[int, int]] = []


class SourceState(Protocol):
    """The virtual host as the mirror source uses it."""

    next_mid: int
    replica: bool
    queues: dict[str, Queue]

    def queue_by_qid(self, qid: int) -> Queue | None:
        """The queue of an incarnation id."""
        ...

    def internal_queue(self, name: str, qid: int, *, locked: bool = True) -> Queue:
        """The broker's own durable queue `name`, made if missing."""
        ...

    def definitions(self) -> Definitions:
        """The durable topology of the vhost `/` (the bidirectional mode's)."""
        ...

    def all_definitions(self) -> Definitions:
        """The durable topology of every vhost (the one-way mirror's)."""
        ...

    def all_queues(self) -> list[Queue]:
        """The queues of every vhost."""
        ...

    def other_vhost_qids(self) -> frozenset[int]:
        """The qids of the queues in vhosts other than `/` (the bidirectional mode skips
        them)."""
        ...


class SourceLog(Protocol):
    """The group committer as the mirror source uses it."""

    def add(self, ops: Iterable[JournalOp]) -> int:
        """Journal ops in the open batch; its number."""
        ...

    def await_durable(self, waiter: Waiter) -> None:
        """Call `waiter.durable(batch)` as batches complete."""
        ...


def op_bytes_by_queue(ops: Iterable[JournalOp]) -> Counter[int]:
    """Per qid: the bytes its ops take in an event (a message's fixed part, exchange and
    routing key (counted in characters: ASCII in practice, and no encode on the hot path),
    properties and body; a settle's fixed record)."""
    sizes: Counter[int] = Counter()
    for op in ops:
        if type(op) is StoredMessage:
            sizes[op.qid] += (
                MESSAGE_OP_BYTES + len(op.exchange) + len(op.routing_key) + len(op.header)
                + len(op.body)
            )  # fmt: skip
        else:
            sizes[op.qid] += SETTLE_OP_BYTES
    return sizes


class MirrorSource:
    """Fills and trims the replication queue; a `BatchTap` and a `Waiter` of the committer."""

    def __init__(self, vhost: SourceState, log: SourceLog, clock: Callable[[], float]) -> None:
        self.vhost = vhost
        self.log = log
        self.clock = clock
        self.durable_seq = 0  # every event up to this one is complete here
        self.acked_seq = 0  # the mirror's high-water mark, as last acknowledged
        self.on_change: Callable[[], None] | None = None  # events became sendable
        self.sending: Callable[[], bool] = lambda: True  # the DR source (its role's record)
        self.retention = 0  # most events kept unacknowledged (0: no bound)
        self.needs_resync: str | None = None  # the backlog was dropped past `retention`
        # The backlog was dropped (`reason`): the ops that record NeedsResync durably (the
        # site's role record), journaled in the drop's own batch, and what undoes them
        # should that batch fail.
        self.on_needs_resync: (
            Callable[[str], tuple[list[JournalOp], Callable[[], list[JournalOp]]]] | None
        ) = None
        self.on_acked: Callable[[], None] | None = None  # the mirror acknowledged more
        self.trimmed_seq = 0  # the newest event acknowledged or dropped since start-up
        self.last_seed: str | None = None  # why the last seed was queued (since start-up)
        self.queue_lag: Counter[int] = Counter()  # qid -> unacknowledged events touching it
        self.queue_lag_bytes: Counter[int] = Counter()  # qid -> their ops' bytes for it
        # seq -> (made at, its qids, its ops' bytes per qid)
        self._lag: dict[int, tuple[float, Counter[int], Counter[int]]] = {}
        self._queue: Queue | None = None
        self._unsettled: deque[tuple[int, int]] = deque()  # (batch, seq), batch not complete
        # The bidirectional mode (`bidi.py`): events in the origin's terms, through the id
        # map; ops the applier journals (applied from a link) are never this site's events.
        self.ids: IdMap | None = None
        self.name = ""  # this site's origin id
        self.peer: str | None = None  # the mirror's origin id, as its last handshake said
        self.applying = False  # the applier is changing the topology: no event of it
        # Ops applied from a link in the open batch, by id(); kept alive until the batch
        # closes, so no other op can take one of their ids meanwhile.
        self._excluded: dict[int, JournalOp] = {}
        self._topology: Definitions | None = None  # the mirrored topology last announced
        # Keeps the queues' messages and the events out of full collections (`broker/heap.py`).
        self.heap: HeapFreezer | None = None
        # A full mesh (`targets` set): one cursor per target on this one queue, each
        # journaled (a record per target); an event leaves the queue once every target in
        # good standing acknowledged it, and only this site's own events are made (no
        # forwarding). Without targets: one mirror, `acked_seq` is its cursor (as ever).
        self.targets: list[str] = []
        self.cursors: dict[str, int] = {}
        self.target_resync: dict[str, str] = {}  # target -> why it needs a re-seed
        self.target_peers: dict[str, str] = {}  # target -> its mirror id (last handshake)
        self.target_skips: dict[str, list[tuple[int, int]]] = {}  # target -> ranges not sent
        self.watchers: list[Callable[[], None]] = []  # each link's wake-up (several)
        # One target now, a mesh before (cursor records left): its trims are recorded too
        # (the record of the target "", `acked`), see `acked`.
        self._was_mesh = False
        # Changes made in batches not complete yet besides their events (a re-seed's drop
        # of the backlog, the site's role record), by batch: each undone if its batch
        # fails (`batch_failed`), forgotten once it completes (`durable`).
        self._undo: dict[int, list[Callable[[], list[JournalOp]]]] = {}
        # Changes made no event of while such a batch was pending, this source inactive (in
        # NeedsResync): a failed drop's undo must not resume the mirror past them.
        self._missed = 0

    # -- the replication queue --------------------------------------------------------------

    def ensure_active(self) -> bool:
        """Take the queue over if this broker became active since; whether it is active."""
        if not self.active:
            self._queue = None  # a passive's queue changes by replication only
            return False
        if self._queue is None or self._queue.deleted:
            self.activate()
        return True

    def activate(self, *, snapshot: bool = True, announce: bool = True) -> Queue:
        """This broker is (or became) active: take over the queue and re-announce the topology.

        Entries already there (recovered, or replicated while passive) are durable. The
        first activation also seeds the mirror with every message, unless `snapshot` is
        False (a switchover's new source: its mirror, the demoted site, holds them all);
        `announce` False: no topology event either (a seed follows at once).
        """
        first = snapshot and QUEUE_NAME not in self.vhost.queues
        queue = self._queue = self.vhost.internal_queue(QUEUE_NAME, QUEUE_QID)
        self._unsettled.clear()
        if queue.entries:
            self.durable_seq = max(self.durable_seq, queue.entries[-1].message.mid)
        self._load_cursors()
        if self.ids is None and not self.targets:
            self._drop_before_seed(queue)
        if self.ids is not None:
            self.ids.queue  # noqa: B018 (the map as recovered, or replicated while passive)
            if first:
                self._seed("first activation as a bidirectional site")
            else:
                # Re-announce every object (never a delete): covers a crash between a
                # topology change and its event.
                current = mirrored_definitions(self.vhost.all_definitions())
                root, others = vhost_deltas(None, current)
                self._emit_bidi(
                    [],
                    topology=declares_only(root),
                    vhosts={name: declares_only(delta) for name, delta in others.items()},
                )
                self._topology = current
            return queue
        if first:
            self._seed("first activation as the DR source")
        elif announce:
            self._emit_definitions(self.vhost.all_definitions())
        return queue

    def _drop_before_seed(self, queue: Queue) -> None:
        """Events journaled before the newest seed are stale (a re-seed drops the backlog
        first): dropped again. A re-seed whose batch the journal refused (a full disk)
        withdrew its seed but not its drop, which a later seed did not repeat; recovered,
        the old events headed the queue and `gap` seeded the old source again from the
        state then (orphaning what clients had acked since the forced promotion)."""
        stale = 0
        for index, entry in enumerate(queue.entries):
            if is_seed(entry.message.body):
                stale = index
        if stale == 0:
            return
        settles: list[JournalOp] = []
        for _ in range(stale):
            entry = queue.entries.popleft()
            queue.bytes -= entry.size
            settles.append(Settle(QUEUE_QID, entry.message.mid))
            self._forget(entry.message.mid)
            self.trimmed_seq = max(self.trimmed_seq, entry.message.mid)
        self.log.add(settles)
        log.warning("mirror: %d events queued before the newest seed dropped again", stale)

    def reseed(self, reason: str, target: str | None = None) -> int:
        """Rebuild the mirror from scratch: drop the backlog (a seed makes it irrelevant),
        leave NeedsResync, queue a seed; the number of messages it carries. In a mesh only
        the targets in NeedsResync and `target` skip their backlog (`_reseed_targets`)."""
        if self.targets:
            if self._queue is None or self._queue.deleted:
                self.activate(snapshot=False)
            # A request naming no target while none needs it: every target gets it (a
            # repair asked by hand), as before there were targets to tell apart.
            rebuilt = {*self.target_resync, *([target] if target is not None else [])}
            rebuilt = rebuilt or set(self.targets)
            ops = self._reseed_targets(target)
            if ops:
                self.log.add(ops)
            self.needs_resync = None
            before = self.head
            count = self._seed(reason)
            self._skip_announcement(before, rebuilt)
            return count
        if self._queue is None or self._queue.deleted:
            # Taken over first, its backlog dropped, nothing announced: the SEED heads
            # the queue. A mirror must meet it before the seed's topology (which deletes
            # queues: the seed orphans their messages first; `applier.py`), and `gap`
            # must find it, or a mirror linking later is seeded again from the state then
            # (a first forced promotion: the old source orphaned what B's consumers acked).
            self.activate(snapshot=False, announce=False)
        undo = self._backlog_undo()
        batch = self.log.add(self._drop_backlog())  # the seed's batch (one turn of the loop)
        self.needs_resync = None
        # A failed batch withdraws the seed (`batch_failed`): the backlog must come back
        # with it, or a mirror resumes from its mark without either (docs/mirror.md).
        self.undo_if_failed(batch, undo)
        return self._seed(reason)

    def _backlog_undo(self, dropped: list[Entry] | None = None) -> Callable[[], list[JournalOp]]:
        """What puts the backlog as it is now back (or the events `dropped`, the head of
        the queue), should the batch that drops it fail (a re-seed's, or a drop past the
        retention bound): a copy of it, paid only then."""
        queue = self._queue
        assert queue is not None
        dropped = list(queue.entries) if dropped is None else dropped
        lag = {
            e.message.mid: self._lag[e.message.mid] for e in dropped if e.message.mid in self._lag
        }
        trimmed, resync = self.trimmed_seq, self.needs_resync
        # The trim mark once the batch drops them: a later mark means a later batch dropped
        # or trimmed more (for good), which this undo must not take back.
        raised = max(trimmed, dropped[-1].message.mid) if dropped else trimmed

        def undo() -> list[JournalOp]:
            # The same queue, whether or not taken over now (a drop past the bound
            # releases it: `ensure_active` while in NeedsResync).
            if queue.deleted or self.vhost.queues.get(QUEUE_NAME) is not queue:
                return []
            self._queue = queue  # active again as before the drop: no new activation
            queue.entries.extend(dropped)
            queue.sort_by_mid()  # behind a later batch's events, if any
            queue.bytes += sum(e.size for e in dropped)
            self._lag = {**lag, **self._lag}  # oldest first
            for _made, qids, sizes in lag.values():
                self.queue_lag.update(qids)
                self.queue_lag_bytes.update(sizes)
            if self.trimmed_seq <= raised:
                self.trimmed_seq, self.needs_resync = trimmed, resync
            # else: a later batch's drop or trim stands, and its NeedsResync (if any) too
            log.warning("mirror: a failed batch's drop of %d events undone", len(dropped))
            return [
                StoredMessage(m.mid, QUEUE_QID, "", QUEUE_NAME, m.header, m.body, None)
                for m in (e.message for e in dropped)
            ]

        return undo

    def undo_if_failed(self, batch: int, undo: Callable[[], list[JournalOp]]) -> None:
        """Should batch `batch` fail, `undo` takes a change made in it back out of memory
        and returns the ops that do the same on a passive that applied the batch (they go
        in its withdrawal, `batch_failed`)."""
        self._undo.setdefault(batch, []).append(undo)

    def seed_forced(self, reason: str) -> None:
        """A forced promotion's seed, queued now.

        The old source may hold anything (its messages the promoted site never got, its
        settles of messages still held here), so it is always seeded (as a delta): a first
        activation seeds anyway; a site that was a source before (a switchover, then a
        failback) has its queue already, and used to stream on from the old source's mark
        without a seed, the old source never comparing, counting or orphaning (its lost
        messages left among its queues: the two sites holding different messages)."""
        if QUEUE_NAME not in self.vhost.queues:
            self.activate()  # a first activation seeds
        else:
            self.reseed(reason)  # takes the queue over unannounced, drops its backlog

    def _seed(self, reason: str) -> int:
        """A SEED event, the topology and every journaled message of every mirrored queue,
        in this turn of the loop: a consistent cut (every later change is a later event),
        from which any mirror can start (`gap`)."""
        self.last_seed = reason
        metrics.SEEDS.inc()
        if self.ids is not None:
            return self._announce(reason)
        self._emit(encode_seed_event(reason, self.clock()))
        self._emit_definitions(self.vhost.all_definitions())
        count = 0
        for queue in self.vhost.all_queues():  # every vhost's (qids are the broker's)
            if not queue.durable or queue.definition.qid >= INTERNAL_QID_BASE:
                continue
            count += self._snapshot_queue(queue)
        log.info("mirror: seed (%s): %d messages queued for the mirror", reason, count)
        return count

    def _snapshot_queue(self, queue: Queue) -> int:
        """One queue's messages as SNAPSHOT events covering every message id (the last
        one's range is open above), so the mirror knows what it holds and should not."""
        qid = queue.definition.qid
        held = [*queue.entries, *queue.delivered.values(), *queue.held_aside.values()]
        journaled = sorted((e for e in held if e.journaled), key=lambda e: e.message.mid)
        chunk: list[JournalOp] = []
        size = 0
        lo = 0
        now = self.clock()
        for entry in journaled:
            m = entry.message
            chunk.append(
                StoredMessage(
                    m.mid, qid, m.exchange, m.routing_key, m.header, m.body, entry.expires_at
                )
            )
            size += len(m.body) + len(m.header)
            if size >= SNAPSHOT_EVENT_BYTES or len(chunk) >= SNAPSHOT_EVENT_OPS:
                self._emit(encode_snapshot_event(SnapshotRange(qid, lo, m.mid), chunk, now), chunk)
                lo = m.mid + 1
                chunk, size = [], 0
        self._emit(encode_snapshot_event(SnapshotRange(qid, lo, TOP_MID), chunk, now), chunk)
        return len(journaled)

    def _announce(self, reason: str) -> int:
        """The bidirectional seed: every object declared and every journaled message
        enqueued, in the origin's terms (a mirror keeps what it has: no orphans)."""
        current = mirrored_definitions(self.vhost.all_definitions())
        self._topology = current
        root, others = vhost_deltas(None, current)
        self._emit_bidi([], topology=root, seed=reason, vhosts=others)
        count = 0
        chunk: list[JournalOp] = []
        size = 0
        vhost = DEFAULT_VHOST
        for queue in self.vhost.all_queues():  # `/`'s first, then each vhost's
            if not queue.durable or queue.definition.qid >= INTERNAL_QID_BASE:
                continue
            if queue.definition.vhost != vhost and chunk:
                # One vhost per event (a peer carrying `/` only still applies `/`'s).
                self._emit_bidi(chunk)
                chunk, size = [], 0
            vhost = queue.definition.vhost
            qid = queue.definition.qid
            held = [*queue.entries, *queue.delivered.values(), *queue.held_aside.values()]
            for entry in sorted((e for e in held if e.journaled), key=lambda e: e.message.mid):
                m = entry.message
                chunk.append(StoredMessage(m.mid, qid, m.exchange, m.routing_key, m.header,
                                           m.body, entry.expires_at))  # fmt: skip
                size += len(m.body) + len(m.header)
                count += 1
                if size >= SNAPSHOT_EVENT_BYTES or len(chunk) >= SNAPSHOT_EVENT_OPS:
                    self._emit_bidi(chunk)
                    chunk, size = [], 0
        if chunk:
            self._emit_bidi(chunk)
        log.info("mirror: announcement (%s): %d messages queued for the mirror", reason, count)
        return count

    def _bidi_event(
        self,
        ops: list[JournalOp],
        topology: TopologyDelta | None = None,
        seed: str | None = None,
        vhosts: dict[str, TopologyDelta] | None = None,
    ) -> bytes:
        """A bidirectional event of this site's own `ops` (its seq is the next id);
        `topology` is `/`'s delta, `vhosts` the other vhosts'."""
        assert self.ids is not None
        self.queue  # noqa: B018 (taking the queue over may record an event first)
        names: dict[int, tuple[str, str]] = {}
        for op in ops:
            if op.qid not in names:
                queue = self.vhost.queue_by_qid(op.qid)
                if queue is not None:
                    names[op.qid] = (queue.definition.vhost, queue.name)
        keys, translated = event_keys(ops, names, self.ids)
        meta = BidiMeta(
            origin=self.name, oseq=self.vhost.next_mid, hops=[self.name], keys=keys,
            topology=topology, seed=seed, vhost_topology=vhosts or {},
        )  # fmt: skip
        return encode_bidi(meta, translated, self.clock())

    def _emit_bidi(
        self,
        ops: list[JournalOp],
        topology: TopologyDelta | None = None,
        seed: str | None = None,
        vhosts: dict[str, TopologyDelta] | None = None,
    ) -> None:
        self._emit(self._bidi_event(ops, topology, seed, vhosts), ops)

    # -- the applier's view (bidirectional) ------------------------------------------------

    def exclude(self, ops: Iterable[JournalOp]) -> None:
        """These ops were applied from a link: never an event of this site (no echo)."""
        self._excluded.update((id(op), op) for op in ops)

    def forward(self, body: bytes, meta: BidiMeta) -> StoredMessage | None:
        """Pass an applied event on to this site's mirror, its origin and hops kept, this
        site added; the op that journals it (None: not a source now, or the mirror is the
        event's origin or went through it already)."""
        if not self.active or self.targets:
            return None  # a mesh: every origin sends its own events to every site
        peer = self.peer
        if peer is not None and (peer == meta.origin or peer in meta.hops):
            return None
        metrics.FORWARDED.inc()
        return self._record(forwarded(body, meta, self.name), Counter())

    def forwarded(self, batch: int, seqs: Iterable[int]) -> None:
        """The forwarded events are journaled in `batch`: sendable once it is complete."""
        self._unsettled.extend((batch, seq) for seq in seqs)

    def foreign(self, mark: int, peer: str) -> str | None:
        """Why a mirror's mark cannot come from this source (it mirrors an older incarnation
        of the same origin: a source re-created with an empty data directory), or None.
        Every event this source made has a seq below its next id; a mark at or above it
        would make the mirror skip this source's events as applied before."""
        if mark < self.vhost.next_mid:
            return None
        return (
            f"the mirror {peer!r} applied up to event {mark}, beyond anything this source "
            f"made (next id {self.vhost.next_mid}): it mirrors an older incarnation of this "
            f"origin; wipe the mirror's data or give this source another mirror id"
        )

    def gap(
        self, mark: int, peer: str, took_over_from: str | None, target: str | None = None
    ) -> str | None:
        """Why a mirror whose applied mark is `mark` cannot resume from the queue (it must
        be seeded again), or None.

        A queue that starts with a seed rebuilds any mirror. Otherwise a mirror resumes
        only if it has every event trimmed from the queue: a mark of 0 (a new or wiped
        mirror) has none, unless it is the site this one took over from by a switchover
        (it holds everything); a mark below the newest event trimmed since start-up
        (a mirror restored from an old copy) misses some.
        """
        entries = self.queue.entries
        if self.targets and target is not None:
            # A mesh target resumes after its own cursor: a seed next for it rebuilds it
            # (it was re-seeded); a mark below what it acknowledged lost applied events.
            cursor = self.cursor(target)
            index = self._first_after(cursor)
            if index < len(entries) and is_bidi_seed(entries[index].message.body):
                return None
            if mark < cursor:
                return (
                    f"the mirror {peer!r} applied up to event {mark}, but acknowledged "
                    f"{cursor} before (restored from an older copy, or wiped)"
                )
        if entries and (is_seed(entries[0].message.body) or is_bidi_seed(entries[0].message.body)):
            return None
        if mark == 0 and peer != took_over_from:
            return f"the mirror {peer!r} holds nothing of this origin yet"
        if mark < self.trimmed_seq:
            return (
                f"the mirror {peer!r} applied up to event {mark}, but events up to "
                f"{self.trimmed_seq} were trimmed here"
            )
        return None

    def _emit(self, body: bytes, ops: Iterable[JournalOp] = ()) -> None:
        op = self._record(body, op_bytes_by_queue(ops))
        self._unsettled.append((self.log.add([op]), op.mid))

    @property
    def active(self) -> bool:
        """Whether this broker makes events: the active broker of the DR source site, its
        backlog within bounds (a passive's queue changes by replication only)."""
        return self.sending() and self.needs_resync is None and not self.vhost.replica

    @property
    def queue(self) -> Queue:
        """The replication queue (made on first use by an active broker)."""
        if self._queue is None or self._queue.deleted:
            return self.activate()
        return self._queue

    def _record(self, body: bytes, sizes: Counter[int]) -> StoredMessage:
        """Append one event to the queue (in memory); the op that journals it. `sizes`:
        the bytes of its ops per queue (`op_bytes_by_queue`)."""
        # The queue first: taking it over after a promotion records the topology event,
        # which must come before this one in sequence as in the queue (an event queued
        # behind a higher sequence number is skipped by the mirror as applied before).
        queue = self.queue
        seq = self.vhost.next_mid
        self.vhost.next_mid = seq + 1
        header = record_header(len(body))
        queue.entries.append(
            Entry(Message(seq, "", QUEUE_NAME, header, body, True, None, None), None, True)
        )
        queue.bytes += len(body)
        qids = Counter(dict.fromkeys(sizes, 1))  # an event counts once per queue it touches
        self._lag[seq] = (event_created(body), qids, sizes)
        self.queue_lag.update(qids)
        self.queue_lag_bytes.update(sizes)
        if self.heap is not None:
            self.heap.freeze()
        return StoredMessage(seq, QUEUE_QID, "", QUEUE_NAME, header, body, None)

    def _forget(self, seq: int) -> None:
        """An event left the queue: it no longer lags behind on its queues."""
        made = self._lag.pop(seq, None)
        if made is None or not made[1]:
            return
        qids, sizes = made[1], made[2]
        self.queue_lag.subtract(qids)
        self.queue_lag_bytes.subtract(sizes)
        for qid in qids:
            if self.queue_lag[qid] <= 0:
                del self.queue_lag[qid]
                self.queue_lag_bytes.pop(qid, None)

    def _beyond_retention(self, batch: int) -> list[JournalOp]:
        """Past the retention bound: drop the whole backlog, loudly (NeedsResync): the
        mirror misses these events, so it must be re-seeded rather than go on.

        The drop and the record of NeedsResync are ops of closing batch `batch`, one unit:
        a promoted passive (or a restart) never holds the drop without NeedsResync, which
        would resume the mirror from its mark past the dropped events. Should the batch
        fail, both are undone with it (here, and on a passive by its withdrawal)."""
        if self.targets:
            return self._targets_beyond_retention(batch)
        if not self.retention or self._queue is None or self.depth <= self.retention:
            return []
        reason = (
            f"replication queue passed its retention bound ({self.depth} > {self.retention} "
            f"events unacknowledged): backlog dropped, the mirror needs a re-seed"
        )
        log.error("mirror: NeedsResync: %s", reason)
        undo_drop = self._backlog_undo()  # the backlog as it is, NeedsResync clear
        missed = self._missed
        self.needs_resync = reason
        ops = self._drop_backlog()
        undo_record: Callable[[], list[JournalOp]] | None = None
        if self.on_needs_resync is not None:
            record, undo_record = self.on_needs_resync(reason)
            ops += record

        def undo() -> list[JournalOp]:
            # Later batches closed in NeedsResync made no event (confirmed messages the
            # mirror never gets): resuming from its mark would skip them, silently.
            keep = self.needs_resync is not None and self._missed != missed
            restored = undo_drop()  # NeedsResync clear in memory before the record's undo
            if undo_record is not None:
                restored += undo_record()
            if keep:
                log.error("mirror: a failed drop's NeedsResync kept: later batches made no event")
                self.needs_resync = reason
                if self.on_needs_resync is not None:
                    # Its record journaled again, in a new batch (the failed one's withdrawn).
                    self.log.add(self.on_needs_resync(reason)[0])
            return restored

        self.undo_if_failed(batch, undo)
        return ops

    def drop_unsent(self, keep: Collection[int] = ()) -> int:
        """This site was fenced by a forced failover and reversed: the promoted site will
        never apply its backlog (what it holds of those events' effects is orphaned by the
        promoted site's seed). Drop it, journaled, so a later promotion (a failback) never
        sends it to put those messages back there; the events of seqs in `keep` stay (the
        promoted site claims it applied them, unverified); the number of events dropped."""
        queue = self.vhost.queues.get(QUEUE_NAME)
        if queue is None or self.active or not queue.entries:
            return 0
        settles: list[JournalOp] = []
        kept = [entry for entry in queue.entries if entry.message.mid in keep]
        for entry in queue.entries:
            if entry.message.mid not in keep:
                settles.append(Settle(QUEUE_QID, entry.message.mid))
                self._forget(entry.message.mid)
        queue.entries.clear()
        queue.entries.extend(kept)
        queue.bytes = sum(entry.size for entry in kept)
        self.log.add(settles)
        return len(settles)

    def _drop_backlog(self) -> list[JournalOp]:
        """Empty the queue (in memory); the settles that journal it."""
        if self._queue is None:
            return []
        settles: list[JournalOp] = []
        for entry in self._queue.entries:
            settles.append(Settle(QUEUE_QID, entry.message.mid))
            self._forget(entry.message.mid)
            self.trimmed_seq = max(self.trimmed_seq, entry.message.mid)
        self._queue.entries.clear()
        self._queue.bytes = 0
        return settles

    # -- BatchTap ---------------------------------------------------------------------------

    def batch_closing(
        self, batch: int, ops: list[JournalOp], encoded: memoryview
    ) -> list[JournalOp]:
        """The event of a closing batch's mirrored ops (none for internal queues); `encoded`
        is the ops' journal encoding (a view into the journal's record, not kept), the
        event's payload when every op is mirrored."""
        if not self.active:
            self._excluded.clear()
            if self._undo and any(op.qid < INTERNAL_QID_BASE for op in ops):
                self._missed += 1  # no event of them (`_beyond_retention`'s undo)
            return []
        if self.ids is not None:
            return self._bidi_batch(batch, ops)
        # The batch's queues in one pass in C: most batches are all mirrored, and on one
        # queue (a publisher's, a consumer's acks), with no per-op Python work left.
        qids = set(map(_QID, ops))
        if not qids:
            return []
        now = self.clock()
        if max(qids) < INTERNAL_QID_BASE:
            # Every op is mirrored (every vhost's: qids are unique across them).
            body = ops_event(encoded, now)
            if len(qids) == 1:
                # One queue's bytes are the whole encoding (`op_bytes_by_queue`'s count
                # with names in bytes: the same for ASCII names).
                op = self._record(body, Counter({qids.pop(): len(encoded)}))
            else:
                op = self._record(body, op_bytes_by_queue(ops))
        else:
            mirrored = [op for op in ops if op.qid < INTERNAL_QID_BASE]
            if not mirrored:
                return []
            op = self._record(encode_ops_event(mirrored, now), op_bytes_by_queue(mirrored))
        self._unsettled.append((batch, op.mid))
        return [op, *self._beyond_retention(batch)]

    def batch_failed(self, batch: int) -> list[JournalOp]:
        """Failed batch `batch`'s events leave the queue now (in memory: their batch never
        completes, so they were never sendable), so that a catch-up started before the
        failure is told carries none of them to the passive (one of an older version is
        made to catch up); the settles that discard them from a passive that applied the
        batch, in its withdrawal (`replication/withdrawal.py`)."""
        # The batch's other changes first: a re-seed's drop put back holds the events the
        # batch made before it, withdrawn next like the others.
        ops: list[JournalOp] = []
        for undo in reversed(self._undo.pop(batch, [])):  # the newest change first
            ops += undo()
        seqs = [seq for each, seq in self._unsettled if each == batch]
        if seqs:
            self._unsettled = deque(item for item in self._unsettled if item[0] != batch)
            self._withdraw(seqs)
            log.warning("mirror: batch %d failed: its %d events withdrawn", batch, len(seqs))
            if ops:
                withdrawn = set(seqs)
                ops = [op for op in ops if op.qid != QUEUE_QID or op.mid not in withdrawn]
            ops += [Settle(QUEUE_QID, seq) for seq in seqs]
        return ops

    def _withdraw(self, seqs: Iterable[int]) -> None:
        """Take events of a failed batch out of the queue: never journaled, as if never made."""
        queue = self._queue if self._queue is not None else self.vhost.queues.get(QUEUE_NAME)
        for seq in seqs:
            if queue is not None:
                queue.remove_mid(seq)
            self._forget(seq)

    def _by_vhost(self, ops: list[JournalOp]) -> list[list[JournalOp]]:
        """`ops` in one group per vhost, `/`'s first, each in batch order: one event each,
        so a peer carrying `/` only applies `/`'s as before (`bidi.py`). A transaction is
        one channel's, so in one vhost: never split."""
        others = self.vhost.other_vhost_qids()
        if not others or not any(op.qid in others for op in ops):
            return [ops]
        groups: dict[str, list[JournalOp]] = {DEFAULT_VHOST: []}
        for op in ops:
            vhost = DEFAULT_VHOST
            if op.qid in others:
                queue = self.vhost.queue_by_qid(op.qid)
                vhost = DEFAULT_VHOST if queue is None else queue.definition.vhost
            groups.setdefault(vhost, []).append(op)
        return [group for group in groups.values() if group]

    def _bidi_batch(self, batch: int, ops: list[JournalOp]) -> list[JournalOp]:
        """A closing batch's own ops (not those applied from a link) as a bidirectional
        event, and the id map's changes they make (in the same batch)."""
        assert self.ids is not None
        excluded, self._excluded = self._excluded, {}
        own = [op for op in ops if op.qid < INTERNAL_QID_BASE and id(op) not in excluded]
        if not own:
            return []
        extra: list[JournalOp] = []
        for group in self._by_vhost(own):
            event = self._record(self._bidi_event(group), op_bytes_by_queue(group))
            self._unsettled.append((batch, event.mid))
            extra.append(event)
        # The map follows what left or joined a queue here; a message that leaves one
        # queue and joins another in the batch (dead-lettered) keeps its origin.
        origins = {op.mid: self.ids.origin_of(op.mid) for op in own if type(op) is StoredMessage}
        added: list[tuple[int, int]] = []
        removed: list[Entry] = []
        for op in own:
            if type(op) is StoredMessage:
                origin, omid = origins[op.mid]
                change = self.ids.add(origin, omid, op.qid, op.mid)
                if change is not None:
                    added.append((op.qid, op.mid))
            else:
                change = self.ids.drop(op.qid, op.mid, removed)
            if change is not None:
                extra.append(change)
        if added or removed:
            # Undone with the batch should it fail: an ack it undid must keep its record.
            ids = self.ids
            self.undo_if_failed(batch, lambda: ids.undo(added, removed))
        return [*extra, *self._beyond_retention(batch)]

    def definitions_saved(self, definitions: Definitions) -> None:
        """The topology changed: its event joins the open batch."""
        if self._undo and not self.active:
            self._missed += 1  # no event of it (`_beyond_retention`'s undo)
        if self.ids is not None:
            self._bidi_definitions(definitions)
        elif self.active and self._queue is not None:
            self._emit_definitions(definitions)

    def _bidi_definitions(self, definitions: Definitions) -> None:
        """A per-object delta of the topology; none while the applier changes it (that
        change is forwarded as the event that made it). Deleted queues' map records go."""
        assert self.ids is not None
        new = mirrored_definitions(definitions)
        old, self._topology = self._topology, new
        if self.applying or old is None or not self.active or self._queue is None:
            return
        delta, others = vhost_deltas(old, new)
        if not delta.empty() or others:
            self._emit_bidi([], topology=None if delta.empty() else delta, vhosts=others)
        if delta.delete_queues or any(d.delete_queues for d in others.values()):
            pruned = self.ids.prune(q.qid for q in definitions.queues)
            if pruned:
                self.log.add(pruned)

    def _emit_definitions(self, definitions: Definitions) -> None:
        self._emit(encode_definitions_event(mirrored_definitions(definitions), self.clock()))

    # -- Waiter -----------------------------------------------------------------------------

    def durable(self, batch: int, failed: bool = False) -> bool:
        """Events of complete batches become sendable; those of a failed one are withdrawn
        (already, as a rule: `batch_failed`)."""
        unsettled = self._unsettled
        withdrawn: list[int] = []
        while unsettled and unsettled[0][0] <= batch:
            each, seq = unsettled.popleft()
            if failed and each == batch:
                withdrawn.append(seq)
            else:
                self.durable_seq = max(self.durable_seq, seq)
        if withdrawn:
            self._withdraw(withdrawn)
        if self._undo:  # a failed batch's undo ran already (`batch_failed` comes first)
            for done in [each for each in self._undo if each <= batch]:
                del self._undo[done]
        if self.on_change is not None:
            self.on_change()
        for watcher in self.watchers:
            watcher()
        return True

    # -- the link's view --------------------------------------------------------------------

    def settled_through(self, seq: int) -> bool:
        """Whether every event up to `seq` is complete or withdrawn (its batch closed)."""
        return not self._unsettled or self._unsettled[0][1] > seq

    def sendable(
        self, after: int, max_events: int, max_bytes: int, target: str | None = None
    ) -> list[tuple[int, bytes]]:
        """Complete events after `after`, oldest first, within the limits (at least one);
        in a mesh, not those of a re-seed announcement made for other targets."""
        out: list[tuple[int, bytes]] = []
        size = 0
        if self._queue is None:
            return out
        skips = self.target_skips.get(target or "", [])
        # From the first event after `after` (found by bisection): in a mesh the queue
        # also holds what a lagging target lacks, which a leading one must not walk.
        start = self._first_after(after)
        for entry in islice(self._queue.entries, start, None):
            seq = entry.message.mid
            if seq > self.durable_seq or len(out) >= max_events or (out and size >= max_bytes):
                break
            if skips and _within(seq, skips):
                continue
            out.append((seq, entry.message.body))
            size += len(entry.message.body)
        return out

    def acked(self, seq: int, target: str | None = None) -> None:
        """The mirror applied everything up to `seq`: those events leave the queue. In a
        mesh, `target`'s cursor moves (journaled) and events leave once every target in
        good standing has them."""
        queue = self._queue
        if queue is None or not self.active:
            return  # a passive's queue changes by replication only
        ops: list[JournalOp] = []
        if self.targets and target is not None:
            moved = seq > self.cursors.get(target, 0)
            if moved:
                self.cursors[target] = seq
            ops += self._trim(self.floor())
            if moved or ops:
                # After the trim, so that the record keeps `trimmed` (a trim without a move:
                # the floor rose as a target left the list, or at a restart).
                ops += self._cursor_record(target)
        else:
            ops += self._trim(seq)
            if ops and self._was_mesh:
                # One target left of a former mesh: the targets dropped from the list keep
                # their records; what is trimmed now is recorded too, so that one of them
                # named again later gets the announcement (`gap`), not a resume.
                ops += self._cursor_record("")
        if ops:
            self.log.add(ops)
        if self.on_acked is not None:
            self.on_acked()

    def _trim(self, seq: int) -> list[JournalOp]:
        """Events up to `seq` leave the queue (in memory); the settles that journal it."""
        queue = self._queue
        assert queue is not None
        self.acked_seq = max(self.acked_seq, seq)
        settles: list[JournalOp] = []
        entries = queue.entries
        now = self.clock()
        while entries and entries[0].message.mid <= seq:
            entry = entries.popleft()
            metrics.EVENT_LAG.observe(max(0.0, now - event_created(entry.message.body)))
            queue.bytes -= entry.size
            settles.append(Settle(QUEUE_QID, entry.message.mid))
            self._forget(entry.message.mid)
            self.trimmed_seq = max(self.trimmed_seq, entry.message.mid)
        return settles

    # -- a full mesh: one cursor per target -----------------------------------------------

    def _load_cursors(self) -> None:
        """The targets' cursors as journaled (recovered, or replicated while passive); a
        target without a record (new) starts at 0: nothing is trimmed until it acknowledges."""
        self.cursors.clear()
        self.target_resync.clear()
        self.target_peers.clear()
        self.target_skips.clear()
        records = 0
        for name, queue in list(self.vhost.queues.items()):
            # Every record, a target's no longer listed too: what was trimmed is a fact of
            # the queue, whichever target's acknowledgement trimmed it.
            if name.startswith(CURSOR_PREFIX) and queue.entries:
                record = TargetCursor.model_validate_json(queue.entries[-1].message.body)
                self.trimmed_seq = max(self.trimmed_seq, record.trimmed)
                records += 1
        self._was_mesh = records > 0 and not self.targets
        for target in self.targets:
            queue = self.vhost.internal_queue(*cursor_queue(target))
            if not queue.entries:
                self.cursors[target] = 0
                continue
            record = TargetCursor.model_validate_json(queue.entries[-1].message.body)
            self.cursors[target] = record.acked
            if record.peer is not None:
                self.target_peers[target] = record.peer
            if record.needs_resync is not None:
                self.target_resync[target] = record.needs_resync
            if record.skips:
                self.target_skips[target] = list(record.skips)

    def _cursor_record(self, target: str) -> list[JournalOp]:
        """Replace `target`'s cursor record (in memory); the ops that journal it."""
        queue = self.vhost.internal_queue(*cursor_queue(target))
        if target in self.target_skips:  # a range wholly trimmed concerns nobody now
            live = [(lo, hi) for lo, hi in self.target_skips[target] if hi > self.trimmed_seq]
            self.target_skips[target] = live
        record = TargetCursor(
            target=target,
            acked=self.cursors.get(target, 0),
            peer=self.target_peers.get(target),
            needs_resync=self.target_resync.get(target),
            trimmed=self.trimmed_seq,
            skips=self.target_skips.get(target, []),
        )
        mid = self.vhost.next_mid
        self.vhost.next_mid = mid + 1
        return replace_record(queue, mid, record.model_dump_json().encode())

    def floor(self) -> int:
        """The newest event every target in good standing acknowledged (a mesh); with all
        of them in NeedsResync, the newest event (none will take the backlog)."""
        live = [self.reach(t) for t in self.targets if t not in self.target_resync]
        return min(live) if live else self.head

    def reach(self, target: str) -> int:
        """How far `target` is served: its cursor, and past the events right after it that
        it is never sent (an announcement for other targets), which it need not
        acknowledge for them to leave the queue."""
        seq = self.cursor(target)
        skips = self.target_skips.get(target)
        if not skips or self._queue is None:
            return seq
        for entry in islice(self._queue.entries, self._first_after(seq), None):
            mid = entry.message.mid
            if not _within(mid, skips):
                break
            seq = mid
        return seq

    def _skip_announcement(self, before: int, rebuilt: set[str]) -> None:
        """A mesh re-seed's announcement (the events after `before`) is for the targets
        `rebuilt`; the others have every event and are never sent it (journaled in their
        cursor records)."""
        queue = self._queue
        start = self._first_after(before)
        healthy = [t for t in self.targets if t not in rebuilt]
        if queue is None or start >= len(queue.entries) or not healthy:
            return
        made = (queue.entries[start].message.mid, self.head)
        ops: list[JournalOp] = []
        for target in healthy:
            self.target_skips.setdefault(target, []).append(made)
            ops += self._cursor_record(target)
        self.log.add(ops)

    def cursor(self, target: str | None) -> int:
        """The newest event `target` acknowledged (None, or not a mesh: the one mirror's)."""
        if target is None or not self.targets:
            return self.acked_seq
        return max(self.cursors.get(target, 0), self.acked_seq)

    def _first_after(self, seq: int) -> int:
        """The index in the queue of the first event after `seq`."""
        if self._queue is None:
            return 0
        return bisect.bisect_right(self._queue.entries, seq, key=lambda e: e.message.mid)

    def backlog(self, target: str | None = None) -> int:
        """Events `target` has not acknowledged (None: the queue's depth)."""
        if self._queue is None:
            return 0
        if target is None or not self.targets:
            return self.depth
        return len(self._queue.entries) - self._first_after(self.reach(target))

    def backlog_bytes(self, target: str) -> int:
        """Their bytes (walks them: for `/status`)."""
        if self._queue is None:
            return 0
        start = self._first_after(self.reach(target))
        # islice walks the deque once (indexing each entry would walk it per entry).
        return sum(len(e.message.body) for e in islice(self._queue.entries, start, None))

    def target_oldest_age(self, target: str) -> float:
        """Seconds since the oldest event `target` has not acknowledged was made."""
        if self._queue is None:
            return 0.0
        index = self._first_after(self.reach(target))
        if index >= len(self._queue.entries):
            return 0.0
        body = self._queue.entries[index].message.body
        return max(0.0, self.clock() - event_created(body))

    def _targets_beyond_retention(self, batch: int) -> list[JournalOp]:
        """A mesh: each target past the retention bound goes to NeedsResync on its own
        (journaled in its record); its backlog is no longer kept for it, the others go on.
        The trim and the records are ops of closing batch `batch`, one unit: should it
        fail, both are undone with it (here, and on a passive by its withdrawal)."""
        queue = self._queue
        if not self.retention or queue is None:
            return []
        fallen: list[str] = []
        for target in self.targets:
            if target in self.target_resync or self.backlog(target) <= self.retention:
                continue
            reason = (
                f"target {target}: {self.backlog(target)} events unacknowledged passed the "
                f"retention bound ({self.retention}): its backlog is dropped, it needs a re-seed"
            )
            log.error("mirror: NeedsResync: %s", reason)
            self.target_resync[target] = reason
            fallen.append(target)
        if not fallen:
            return []
        floor = self.floor()
        undo_trim = self._backlog_undo(list(islice(queue.entries, self._first_after(floor))))
        acked = self.acked_seq
        ops = self._trim(floor)
        trimmed = self.trimmed_seq
        records: list[tuple[Queue, list[Entry], int]] = []
        skips = {target: list(self.target_skips.get(target, [])) for target in fallen}
        for target in fallen:
            record = self.vhost.internal_queue(*cursor_queue(target))
            previous = list(record.entries)
            ops += self._cursor_record(target)  # after the trim: it keeps `trimmed`
            records.append((record, previous, record.entries[-1].message.mid))

        def undo() -> list[JournalOp]:
            # Trimmed since (another target acknowledged more, in a batch that stands):
            # those events are gone for the fallen targets too, they keep NeedsResync.
            later = self.trimmed_seq > trimmed
            restored = undo_trim()  # keeps the later trim mark
            if not later:
                self.acked_seq = min(self.acked_seq, acked)  # each target's cursor as it was
            for target in fallen:
                if not later:
                    self.target_resync.pop(target, None)
                if skips[target]:
                    self.target_skips[target] = skips[target]
            for record, previous, made in records:
                restored += restore_record(record, previous, made)
            if later:
                kept = [target for target in fallen if target in self.target_resync]
                log.error("mirror: a failed drop's NeedsResync kept (trimmed since): %s", kept)
                again: list[JournalOp] = []
                for target in kept:  # journaled again, in a new batch
                    again += self._cursor_record(target)
                if again:
                    self.log.add(again)
            return restored

        self.undo_if_failed(batch, undo)
        return ops

    def _reseed_targets(self, target: str | None) -> list[JournalOp]:
        """A mesh re-seed: the targets in NeedsResync (and `target`) skip their backlog
        (their cursor moves to the newest event); the announcement that follows rebuilds
        them. Nothing is dropped for the others (they get the announcement too: applying
        it twice changes nothing)."""
        ops: list[JournalOp] = []
        head = self.vhost.next_mid - 1
        moved = {*self.target_resync, *([target] if target is not None else [])}
        for each in moved:
            self.target_resync.pop(each, None)
            self.cursors[each] = max(self.cursors.get(each, 0), head)
        if self._queue is not None:
            ops += self._trim(self.floor())
        for each in moved:
            ops += self._cursor_record(each)  # after the trim: it keeps `trimmed`
        return ops

    # -- metrics ----------------------------------------------------------------------------

    @property
    def head(self) -> int:
        """The newest event made (0: none since start-up and none pending)."""
        if self._queue is not None and self._queue.entries:
            return self._queue.entries[-1].message.mid
        return self.acked_seq

    def lag_by_queue(self) -> dict[str, int]:
        """Unacknowledged events per queue name (queues deleted since under their qid)."""
        return {self._label(qid): count for qid, count in self.queue_lag.items()}

    def lag_bytes_by_queue(self) -> dict[str, int]:
        """Per queue name: the bytes of the unacknowledged events' ops on it."""
        return {self._label(qid): size for qid, size in self.queue_lag_bytes.items()}

    def _label(self, qid: int) -> str:
        """A queue's name, with its vhost unless `/` (a queue deleted since: its qid)."""
        queue = self.vhost.queue_by_qid(qid)
        if queue is None:
            return f"qid:{qid}"
        vhost = queue.definition.vhost
        return queue.name if vhost == DEFAULT_VHOST else f"{queue.name} (vhost {vhost})"

    def lag_seconds_by_queue(self) -> dict[str, float]:
        """Per queue name: the age of its oldest event not yet acknowledged."""
        oldest: dict[int, float] = {}  # qid -> when its oldest event was made
        for made, qids, _ in self._lag.values():  # oldest first
            for qid in qids:
                oldest.setdefault(qid, made)
            if len(oldest) >= len(self.queue_lag):
                break
        now = self.clock()
        return {self._label(qid): round(max(0.0, now - made), 3) for qid, made in oldest.items()}

    @property
    def depth(self) -> int:
        """Events not yet acknowledged by the mirror."""
        return len(self._queue.entries) if self._queue is not None else 0

    @property
    def depth_bytes(self) -> int:
        """Their bytes."""
        return self._queue.bytes if self._queue is not None else 0

    def oldest_age(self) -> float:
        """Seconds since the oldest unacknowledged event was made (0 when none)."""
        if self._queue is None or not self._queue.entries:
            return 0.0
        return max(0.0, self.clock() - event_created(self._queue.entries[0].message.body))
