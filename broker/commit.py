"""Group commit: journal operations gathered per event-loop turn, made durable together.

Every publish and ack handled in one turn of the loop goes into the same batch,
appended to the journal as one atomic record group. One syncing task waits for
the journal's fsync of the newest batch and then tells the channels waiting on
it, so confirms go out in bulk while the next batch is already being filled.

With a passive broker attached (the replication guard on), a batch is complete
only once it is durable here *and* acknowledged by the passive (Qpid's delayed
completion): confirms wait for both disks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol

from twinmq.broker import metrics
from twinmq.broker.auditlog import AuditLog
from twinmq.broker.definitions import Definitions
from twinmq.broker.journal import DiskFullError, Journal, JournalError, JournalOp

log = logging.getLogger(__name__)


class Waiter(Protocol):
    """Something that waits for batches to become durable (a channel)."""

    def durable(self, batch: int, failed: bool = False) -> bool:
        """Batches up to `batch` are done; return whether it still waits for more."""
        ...


class GroupCommitter:
    """Implements the virtual host's `Committer` over a `Journal` on the running loop."""

    def __init__(self, journal: Journal, loop: asyncio.AbstractEventLoop) -> None:
        self.journal = journal
        self.loop = loop
        self.durable_batch = 0  # every batch up to this one is on disk
        self.complete_batch = 0  # ... and, while guarded, on the passive's disk too
        self.replica_batch = 0  # the newest batch the passive acknowledged
        self.guarded = False
        self.last_appended = 0
        # Called with every batch appended (the replication source streams them).
        self.on_batch: Callable[[int, list[JournalOp]], None] | None = None
        self.audit: AuditLog | None = None
        self._audit_batches: deque[tuple[int, list[JournalOp]]] = deque()
        self._open: list[JournalOp] = []
        self._open_batch = 1  # the number of the batch being filled
        self._appended: list[tuple[int, int]] = []  # (batch, lsn) appended, not yet durable
        self._flush_scheduled = False
        self._waiters: set[Waiter] = set()
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()  # set while no batch waits for its sync
        self._settled.set()
        self._task: asyncio.Task[None] | None = None
        self.failure: JournalError | None = None

    # -- Committer protocol ----------------------------------------------------------------

    def add(self, ops: Iterable[JournalOp]) -> int:
        """Queue ops for the batch being filled and return its number."""
        self._open.extend(ops)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)
        return self._open_batch

    def confirm_point(self) -> int:
        """0 if nothing is outstanding, else the batch that covers everything before now."""
        if self._open:
            return self._open_batch
        if self.last_appended > self.complete_batch:
            return self.last_appended
        return 0

    def save_definitions(self, definitions: Definitions) -> None:
        """Durably replace the topology file (rare: declares and deletes)."""
        self.journal.save_definitions(definitions)

    def drop_queue(self, qid: int) -> None:
        """Tell the journal a queue's messages are garbage."""
        self.journal.drop_queue(qid)

    # -- waiting -------------------------------------------------------------------------

    def await_durable(self, waiter: Waiter) -> None:
        """Register a waiter; it is called as batches become durable."""
        self._waiters.add(waiter)

    def start(self) -> None:
        """Start the syncing task."""
        self._task = self.loop.create_task(self._sync_loop(), name="twinmq-group-commit")

    async def stop(self) -> None:
        """Flush, sync what is pending, stop the task."""
        self._flush()
        if self._appended:
            await self._sync_once()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._open:
            return
        ops, self._open = self._open, []
        batch = self._open_batch
        self._open_batch += 1
        metrics.COMMIT_BATCH.observe(len(ops))
        lsn = self.journal.append(ops)
        self._appended.append((batch, lsn))
        self._settled.clear()
        self.last_appended = batch
        if self.audit is not None:
            self._audit_batches.append((batch, ops))
        self._wake.set()
        if self.on_batch is not None:
            self.on_batch(batch, ops)

    async def idle(self, limit: float) -> None:
        """Wait (at most `limit` seconds) until no batch waits for its sync.

        Background work (a catch-up) calls this before each step so that it runs
        while the journal is idle and leaves the loop and the GIL to confirms.
        """
        if self._settled.is_set() and not self._open:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._settled.wait(), limit)

    def flush_now(self) -> int:
        """Close the open batch at once (before a catch-up snapshot); return the last batch."""
        self._flush()
        return self.last_appended

    # -- the replication guard -----------------------------------------------------------

    def guard(self, on: bool) -> None:
        """Start (a passive attached) or stop (it timed out) waiting for the passive."""
        if on and not self.guarded:
            self.replica_batch = self.complete_batch
        self.guarded = on
        self._advance(False)

    def replica_acked(self, batch: int) -> None:
        """The passive has every batch up to `batch` on its disk."""
        if batch > self.replica_batch:
            self.replica_batch = batch
            self._advance(False)

    def _advance(self, failed: bool) -> None:
        complete = self.durable_batch
        if self.guarded and not failed:
            complete = min(complete, self.replica_batch)
        if complete <= self.complete_batch and not failed:
            return
        self.complete_batch = max(self.complete_batch, complete)
        audited = self._audit_batches
        recorded = False
        while audited and audited[0][0] <= complete:
            _, ops = audited.popleft()
            if self.audit is not None and not failed:
                self.audit.batch_complete(ops, self.guarded)
                recorded = True
        if recorded and self.audit is not None:
            # The confirm records reach the OS before the confirms go out: a broker killed
            # right after confirming still shows the audit what it confirmed.
            self.audit.flush()
        for waiter in list(self._waiters):
            try:
                waiting = waiter.durable(complete, failed)
            except Exception:
                # One broken waiter must not end the sync task: every confirm would hang.
                log.exception("durability waiter %r failed: dropping it", waiter)
                waiting = False
            if not waiting:
                self._waiters.discard(waiter)

    async def _sync_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._appended:
                await self._sync_once()

    async def _sync_once(self) -> None:
        batch, lsn = self._appended[-1]
        failed = False
        try:
            await self.journal.sync(lsn)
        except DiskFullError as exc:
            log.error("journal write failed, disk full: nacking batches up to %d", batch)
            self.failure = exc
            failed = True
        except JournalError as exc:
            log.error("journal write failed (%s): nacking batches up to %d", exc, batch)
            self.failure = exc
            failed = True
        # Batches appended while we synced stay for the next round.
        self._appended = [(b, n) for b, n in self._appended if b > batch]
        if not self._appended:
            self._settled.set()
        self.durable_batch = batch
        self._advance(failed)
