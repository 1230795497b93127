"""Withdrawing a failed batch everywhere: in this broker's memory and on its passive.

A batch is streamed to the passive before the active's own write. When that write
fails, each virtual host withdraws the batch's messages from its queues and undoes
its transaction's acks (`Visibility.withdraw`); the passive, which applied the batch,
gets the ops that do the same there (`undo_ops`: a discard of each withdrawn message,
each undone ack's message stored again, and a discard of each of the batch's DR mirror
events: `BatchTap.batch_failed`), in a WITHDRAW frame streamed ahead of any later batch
(docs/replication.md, "A failed batch on the passive").
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from twinmq.broker.commit import BatchTap
from twinmq.broker.journal import JournalOp, Settle, StoredMessage
from twinmq.broker.message import Entry
from twinmq.broker.queue import Queue
from twinmq.broker.visibility import Visibility


class HasVisibility(Protocol):
    """A virtual host (its `visibility` holds the entries waiting for their batch)."""

    @property
    def visibility(self) -> Visibility:
        """The vhost's visibility."""
        ...


def withdraw_everywhere(
    vhosts: Iterable[HasVisibility], batch: int, tap: BatchTap | None = None
) -> list[JournalOp]:
    """Withdraw failed batch `batch` in every vhost and from the committer's `tap` (the
    DR mirror's replication queue) now; the ops that undo it on a passive."""
    ops: list[JournalOp] = []
    for vhost in vhosts:
        withdrawn, undone = vhost.visibility.withdraw(batch)
        ops += undo_ops(withdrawn, undone)
    if tap is not None:
        # The batch's mirror events: a promoted passive holding one would send the DR
        # site a message its publisher was told failed, or a settle of an undone ack.
        ops += tap.batch_failed(batch)
    return ops


def undo_ops(
    withdrawn: Iterable[tuple[Queue, Entry]], undone: Iterable[tuple[Queue, Entry]]
) -> list[JournalOp]:
    """Journal ops that take a failed batch back out of a replica that applied it.

    Only journaled entries: the passive was streamed nothing of the others (transient
    messages, non-durable queues). A withdrawn message is discarded; the message of an
    undone ack is stored again, as the active's journal (where the settle was rolled
    back) still has it. The passive applies them as a catch-up's (a discard takes the
    message's dedup key out of the window too: a key without its message would swallow
    the client's re-send).
    """
    ops: list[JournalOp] = [
        Settle(queue.definition.qid, entry.message.mid)
        for queue, entry in withdrawn
        if entry.journaled
    ]
    for queue, entry in undone:
        if entry.journaled:
            m = entry.message
            ops.append(
                StoredMessage(
                    m.mid,
                    queue.definition.qid,
                    m.exchange,
                    m.routing_key,
                    m.header,
                    m.body,
                    entry.expires_at,
                )
            )
    return ops
