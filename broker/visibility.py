"""What consumers may see: a message is taken only once its batch is complete.

A publish goes into its queues at once (queue order is publish order) but an
entry waiting for a group-commit batch is not *visible*: no consumer receives
it and `basic.get` does not return it until the batch its completion waits for
(the publisher's confirm, or the transaction's `tx.commit-ok`) is complete, on
this disk and, while a passive guards, on the passive's too. If that batch
fails (a full disk, an I/O error), its entries are withdrawn from their queues
before anyone saw them, as soon as the failure is known (`withdraw`): the
broker never hands out what it told the publisher it did not take (a nack, a
541), and its memory never holds more than its disk. The
acknowledgements of a transaction whose batch failed are undone: the messages go
back to their queues, as the journal (where the settles were rolled back) has
them. Artemis does the same for a transaction's messages (visible once the
commit record is durable); for a plain publish it costs consumers one group
commit of latency, which a confirm pays anyway.

Held: every message of a transaction, and persistent messages on durable queues
from a publisher in confirm mode. Visible at once: transient messages outside a
transaction (nothing about them is written, even when a confirm covering one is
nacked because an earlier batch failed: AMQP's nack, "may or may not have been
taken"), and publishes without confirms or a transaction, as in RabbitMQ's
classic queues: such a publisher is told nothing either way, and publish then
`basic.get` works at once. If the write of one of those fails, the message stays
in memory (delivered, possibly) and is gone after a restart.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from twinmq.broker.message import Entry
from twinmq.broker.queue import Queue

if TYPE_CHECKING:
    from twinmq.broker.commit import Waiter

log = logging.getLogger(__name__)

# The batch of an entry of a transaction whose commit has not been handled yet.
UNCOMMITTED = sys.maxsize


class Visibility:
    """Holds entries until their batch is complete; a group-commit waiter."""

    def __init__(
        self,
        await_durable: Callable[[Waiter], None],
        now: Callable[[], float],
        requeue: Callable[[Queue, list[Entry]], None],
    ) -> None:
        self.complete = 0  # every batch up to this one has its outcome
        self._await_durable = await_durable
        self._now = now
        self._requeue = requeue
        # (batch, queue) with entries of that batch, batches ascending, runs collapsed.
        self._held: deque[tuple[int, Queue]] = deque()
        # (batch, acknowledged entries) of transactions: undone if the batch fails.
        self._acks: deque[tuple[int, list[tuple[Queue, Entry]]]] = deque()
        # Registered with the group committer: once per run of held batches, not once
        # per publish (it keeps a waiter until `durable` answers False).
        self._registered = False

    def hold(self, batch: int, entries: list[tuple[Queue, Entry]]) -> None:
        """Keep `entries` (already in their queues) from consumers until `batch` is complete."""
        held = self._held
        for queue, entry in entries:
            entry.batch = batch
            if not held or held[-1][0] != batch or held[-1][1] is not queue:
                held.append((batch, queue))
        if not self._registered:
            self._registered = True
            self._await_durable(self)

    def hold_transaction(
        self,
        batch: int,
        published: list[tuple[Queue, Entry]],
        acked: list[tuple[Queue, Entry]],
    ) -> None:
        """A transaction is committed in `batch` (0: nothing to wait for)."""
        if batch == 0:
            for _, entry in published:
                entry.batch = 0
            self._dispatch({queue for queue, _ in published})
            return
        if acked:
            self._acks.append((batch, acked))
        self.hold(batch, published)

    def durable(self, batch: int, failed: bool = False) -> bool:
        """Batches up to `batch` have their outcome: show or withdraw what waited for them.

        Returns whether anything still waits (False: the committer drops this waiter).
        """
        # Should this raise, the committer drops the waiter: the next hold registers again.
        self._registered = False
        held = self._held
        ready: set[Queue] = set()
        withdrawn = 0
        while held and held[0][0] <= batch:
            each, queue = held.popleft()
            if failed:
                withdrawn += len(queue.withdraw(each))
            elif not queue.deleted:
                ready.add(queue)
        acks = self._acks
        while acks and acks[0][0] <= batch:
            _, acked = acks.popleft()
            if failed:
                self._undo_acks(acked)
        if withdrawn:
            log.error(
                "batch %d failed: %d messages withdrawn from their queues, never delivered",
                batch,
                withdrawn,
            )
        self.complete = batch
        self._dispatch(ready)
        self._registered = bool(held or acks)
        return self._registered

    def withdraw(self, batch: int) -> tuple[list[tuple[Queue, Entry]], list[tuple[Queue, Entry]]]:
        """Batch `batch` failed: withdraw its entries and undo its acks now, before its
        waiters hear of it; return both, (queue, entry), for the passive's withdrawal.

        Called as soon as the failure is known, possibly while earlier batches still
        wait (for the passive, the audit): the active then streams the withdrawal ahead
        of any later batch, so nothing streamed after it can build on the failed batch
        (an undone ack's message redelivered and acked again). `durable(batch, True)`
        later finds nothing left of it to withdraw.
        """
        withdrawn: list[tuple[Queue, Entry]] = []
        kept: deque[tuple[int, Queue]] = deque()
        for each, queue in self._held:
            if each != batch:
                kept.append((each, queue))
            else:
                withdrawn += ((queue, entry) for entry in queue.withdraw(batch))
        self._held = kept
        undone: list[tuple[Queue, Entry]] = []
        acks: deque[tuple[int, list[tuple[Queue, Entry]]]] = deque()
        for each, acked in self._acks:
            if each != batch:
                acks.append((each, acked))
            else:
                undone += acked
        self._acks = acks
        if undone:
            self._undo_acks(undone)
        if withdrawn:
            log.error(
                "batch %d failed: %d messages withdrawn from their queues, never delivered",
                batch,
                len(withdrawn),
            )
        return withdrawn, undone

    def _undo_acks(self, acked: list[tuple[Queue, Entry]]) -> None:
        by_queue: dict[Queue, list[Entry]] = {}
        for queue, entry in acked:
            by_queue.setdefault(queue, []).append(entry)
        for queue, entries in by_queue.items():
            log.error(
                "queue %r: %d acknowledgements of a failed transaction undone (requeued)",
                queue.name,
                len(entries),
            )
            self._requeue(queue, entries)

    def _dispatch(self, queues: set[Queue]) -> None:
        if not queues:
            return
        now = self._now()
        for queue in queues:
            if not queue.deleted:
                queue.dispatch(now)
