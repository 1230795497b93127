"""The receiving side's durable dedup window: (origin, seq) keys already republished.

One window per server, shared by all its links: a message that reaches this server by
two paths (a triangle, a diamond) carries the same key on both and is republished once.
A key is *claimed* while its republish is in flight, so the other path's copy is dropped
then too; if the republish fails, the claim is released and the first path's upstream
re-delivers it (never acknowledged), so dropping the second copy loses nothing.

Durability, as the mirror's applied mark: the keys of a batch of republished messages
are one record (a message) of the internal queue `amq.twinmq.federation-dedup`, journaled
**in the same group commit** as the messages themselves (`record` is called in the same
turn of the event loop as their publishes). After a crash either both are on disk or
neither; the pair's passive receives the record like any op, so a promoted passive knows
the keys too. The window is rebuilt from the queue's records at every activation
(`load`); the oldest records are settled once the window holds more keys than its size.

**A lagging path holds the window open.** A path into this server can lag another by
more keys than the window holds (the topology runs at a million messages back their
link queues up by 100,000s; a link down a while), and a count-bounded window had
forgotten the first copy's key when the late copy came: delivered twice. Each link tells
the window how far it has got per origin (`passed`: the highest seq of that origin it
brought, copies dropped included); the window forgets its oldest key, beyond its size,
only once **every link of the server** has passed the key's seq: any link may bring any
origin's messages (in a mesh a link carries on an origin's message only when its
upstream got that one first by the link's own path, i.e. now and then), so a link that
has brought nothing of an origin yet, or not since a restart, has passed none of it.
Along one link an origin's messages come in seq order (queues are FIFO, the first copies
at an upstream of two in-order paths are in order too, and the link consumes exclusively,
so a cut's unacknowledged deliveries come back before anything newer), so a link that has passed
a seq brings no copy of it later, save a re-delivery after a cut (its ack lost) or a
reordering within a few batches: a link's mark is in force only once it has brought 4
prefetch windows (at least 4,096 keys) more, and those come before that. Bounded still:
past `STRETCH` times its size, the window forgets its oldest keys whatever lags (a link
down for good, a link that never brings some origin: a diamond's), counted in `forced`.
Forgetting never loses a message, it can only let a copy through. The marks are not
journaled: after a restart or a promotion every link has passed nothing, which holds
more keys (up to the stretch), never fewer.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from typing import Final, Protocol

from twinmq.broker.federation import metrics
from twinmq.broker.journal import JournalOp, Settle, StoredMessage
from twinmq.broker.message import Entry, Message
from twinmq.broker.mirror.events import INTERNAL_PREFIX, INTERNAL_QID_BASE, record_header
from twinmq.broker.queue import Queue

log = logging.getLogger(__name__)

QUEUE_NAME: Final = INTERNAL_PREFIX + "federation-dedup"
# Federation's internal qids start at +0x100, clear of the mirror's (+1 ... +4 and the
# marks'); tests/test_federation_units.py checks that no two internal queues share one.
QUEUE_QID: Final = INTERNAL_QID_BASE + 0x100
# How far past its size the window stretches for a lagging link (memory: ~150 bytes a key).
STRETCH: Final = 10


class KeyStore(Protocol):
    """What the window needs of the virtual host."""

    next_mid: int

    def internal_queue(self, name: str, qid: int, *, locked: bool = True) -> Queue:
        """A durable queue of the broker's own, made if missing."""
        ...


def _origin_seq(key: str) -> tuple[str, int] | None:
    """(origin, seq) of a key made by `headers.arrival`; None for another kind (held)."""
    origin, sep, seq = key.rpartition("\x00")
    if not sep or not seq.isdigit():
        return None
    return origin, int(seq)


class LagWindow:
    """The newest `size` keys, and older ones while a link that may bring them again lags
    behind them (up to `STRETCH` times `size`)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._keys: OrderedDict[str, None] = OrderedDict()
        # link -> origin -> the highest seq of that origin the link has passed for good.
        self._passed: dict[str, dict[str, int]] = {}
        # link -> (keys brought up to that batch, its marks): marks not in force yet.
        self._pending: dict[str, deque[tuple[int, dict[str, int]]]] = {}
        self._brought: dict[str, int] = {}  # link -> keys brought
        # Every link of the server: each may bring any origin's messages, so each is
        # waited for, whether it has brought that origin yet or not.
        self._links: set[str] = set()
        self.forced = 0  # keys forgotten at the stretch while a link had not passed them

    def register(self, link: str) -> None:
        """`link` is one of the server's links: the window waits for it from now on."""
        self._links.add(link)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: str) -> None:
        """Remember a key; forget the oldest beyond the size that no link lags behind."""
        if not self.size:
            return
        self._keys[key] = None
        self._keys.move_to_end(key)
        self._forget()

    def passed(self, link: str, keys: list[str], delay: int = 0) -> None:
        """`link` brought these keys (republished or dropped as copies). Its marks count
        once it has brought `delay` more keys: what it delivered just before a cut comes
        again at the next session's start (its acks lost), and must still be known then."""
        marks: dict[str, int] = {}
        for key in keys:
            named = _origin_seq(key)
            if named is not None and named[1] > marks.get(named[0], -1):
                marks[named[0]] = named[1]
        self._links.add(link)
        passed = self._passed.setdefault(link, {})
        pending = self._pending.setdefault(link, deque())
        brought = self._brought[link] = self._brought.get(link, 0) + len(keys)
        pending.append((brought, marks))
        while pending and brought - pending[0][0] >= delay:
            for origin, seq in pending.popleft()[1].items():
                passed[origin] = max(passed.get(origin, -1), seq)
        self._forget()

    def _forget(self) -> None:
        keys = self._keys
        while len(keys) > self.size:
            oldest = next(iter(keys))
            awaited = self._awaited(oldest)
            if awaited and len(keys) <= self.size * STRETCH:
                return  # the oldest is still awaited on a link: newer ones wait behind it
            self.forced += awaited
            keys.popitem(last=False)

    def _awaited(self, key: str) -> bool:
        """Some link of the server has not passed the key's seq of its origin yet."""
        named = _origin_seq(key)
        if named is None:
            return False
        origin, seq = named
        passed = self._passed
        return any(passed.get(link, {}).get(origin, -1) < seq for link in self._links)


class DurableKeys:
    """A bounded window of keys whose records ride in the republished messages' commits."""

    def __init__(self, size: int) -> None:
        self.window = LagWindow(size)
        self.claimed: set[str] = set()
        self._records: deque[tuple[int, int]] = deque()  # (mid, keys in it), oldest first
        self._recorded = 0  # keys in the queue's records
        self._forced = 0  # the window's `forced` already counted in the metric

    def __contains__(self, key: str) -> bool:
        return key in self.claimed or key in self.window

    def __len__(self) -> int:
        return len(self.window)

    def register(self, link: str) -> None:
        """`link` is one of the server's links; see `LagWindow.register`."""
        self.window.register(link)

    def load(self, store: KeyStore) -> None:
        """Rebuild the window from the queue's records (start-up, promotion)."""
        queue = store.internal_queue(QUEUE_NAME, QUEUE_QID)
        self._records.clear()
        self._recorded = 0
        for entry in queue.entries:
            keys = _keys(entry.message.body)
            for key in keys:
                self.window.add(key)
            self._records.append((entry.message.mid, len(keys)))
            self._recorded += len(keys)
        self._count_forced()

    def claim(self, key: str) -> None:
        """A republish of `key` is in flight: copies of it are duplicates meanwhile."""
        self.claimed.add(key)

    def record(self, store: KeyStore, keys: list[str]) -> list[JournalOp]:
        """The ops that journal `keys` (one record) and settle records beyond the window;
        for the caller to add to the group commit of the messages they name."""
        if not keys:
            return []
        queue = store.internal_queue(QUEUE_NAME, QUEUE_QID)
        body = "\n".join(keys).encode()
        mid = store.next_mid
        store.next_mid += 1
        header = record_header(len(body))
        # The queue's own qid: a queue made by an earlier version may carry another one.
        qid = queue.definition.qid
        ops: list[JournalOp] = [StoredMessage(mid, qid, "", QUEUE_NAME, header, body, None)]
        queue.entries.append(
            Entry(Message(mid, "", QUEUE_NAME, header, body, True, None, None), None, True)
        )
        queue.bytes += len(body)
        self._records.append((mid, len(keys)))
        self._recorded += len(keys)
        # Keep at least the window's worth of keys on disk (stretched by a lagging link, its
        # keys too); settle the oldest records.
        keep = max(self.window.size, len(self.window))
        while len(self._records) > 1 and self._recorded - self._records[0][1] >= keep:
            old_mid, count = self._records.popleft()
            self._recorded -= count
            ops.append(Settle(qid, old_mid))
            for i, entry in enumerate(queue.entries):
                if entry.message.mid == old_mid:
                    queue.bytes -= len(entry.message.body)
                    del queue.entries[i]
                    break
        return ops

    def settle(self, durable: list[str], failed: list[str]) -> None:
        """The batch is complete: its keys enter the window; a failed batch's are released
        (its messages are re-delivered by their upstream)."""
        for key in durable:
            self.window.add(key)
        self.claimed.difference_update(durable)
        self.claimed.difference_update(failed)
        self._count_forced()

    def passed(self, link: str, keys: list[str], delay: int = 0) -> None:
        """`link` brought these keys (republished or dropped as copies); see `LagWindow`."""
        self.window.passed(link, keys, delay)
        self._count_forced()

    def _count_forced(self) -> None:
        forced = self.window.forced - self._forced
        if not forced:
            return
        if not self._forced:
            # Once: the stretch is full for as long as some link lags for good (or never
            # brings some origin, as a diamond's), and every key then would log.
            log.warning(
                "federation: the dedup window reached %d keys (%d times dedup-window) while "
                "a link had not passed its oldest keys: forgetting them (a copy that link "
                "brings later is delivered again); counted in %s",
                self.window.size * STRETCH, STRETCH, "twinmq_federation_dedup_forced_total",
            )  # fmt: skip
        self._forced = self.window.forced
        metrics.DEDUP_FORCED.inc(forced)


def _keys(body: bytes) -> list[str]:
    return body.decode("utf-8", "replace").split("\n") if body else []
