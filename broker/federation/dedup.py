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
"""

from __future__ import annotations

from collections import deque
from typing import Final, Protocol

from twinmq.broker.dedup import DedupWindow
from twinmq.broker.journal import JournalOp, Settle, StoredMessage
from twinmq.broker.message import Entry, Message
from twinmq.broker.mirror.events import INTERNAL_PREFIX, INTERNAL_QID_BASE, record_header
from twinmq.broker.queue import Queue

QUEUE_NAME: Final = INTERNAL_PREFIX + "federation-dedup"
# Federation's internal qids start at +0x100, clear of the mirror's (+1 ... +4 and the
# marks'); tests/test_federation_units.py checks that no two internal queues share one.
QUEUE_QID: Final = INTERNAL_QID_BASE + 0x100


class KeyStore(Protocol):
    """What the window needs of the virtual host."""

    next_mid: int

    def internal_queue(self, name: str, qid: int, *, locked: bool = True) -> Queue:
        """A durable queue of the broker's own, made if missing."""
        ...


class DurableKeys:
    """A bounded window of keys whose records ride in the republished messages' commits."""

    def __init__(self, size: int) -> None:
        self.window = DedupWindow(size)
        self.claimed: set[str] = set()
        self._records: deque[tuple[int, int]] = deque()  # (mid, keys in it), oldest first
        self._recorded = 0  # keys in the queue's records

    def __contains__(self, key: str) -> bool:
        return key in self.claimed or key in self.window

    def __len__(self) -> int:
        return len(self.window)

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
        # Keep at least the window's worth of keys on disk; settle the oldest records.
        while len(self._records) > 1 and self._recorded - self._records[0][1] >= self.window.size:
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


def _keys(body: bytes) -> list[str]:
    return body.decode("utf-8", "replace").split("\n") if body else []
