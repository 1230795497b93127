"""Group commit: journal operations gathered per event-loop turn, made durable together.

Every publish and ack handled in one turn of the loop goes into the same batch,
appended to the journal as one atomic record group. One syncing task waits for
the journal's fsync of the newest batch and then tells the channels waiting on
it, so confirms go out in bulk while the next batch is already being filled.

With a passive broker attached (the replication guard on), a batch is complete
only once it is durable here *and* acknowledged by the passive (Qpid's delayed
completion): confirms wait for both disks.

A batch whose write failed (a full disk, an I/O error, a journal that refused the
append) is *failed*, never complete: its waiters hear `durable(batch, failed=True)`
and answer with a nack or a channel error. Every batch's own outcome is checked,
not only the newest one synced: after a full disk, a later, smaller write can
succeed while an earlier one was rolled back, and that earlier batch must not be
acknowledged on the strength of the later one. A failed batch needs nothing from
the passive (it is not confirmed), so it completes as soon as the batches before
it have.
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
        # (batch, lsn) appended, not yet known durable; lsn None: the append itself failed
        self._appended: list[tuple[int, int | None]] = []
        self._failed_batches: deque[int] = deque()  # failed, not yet told to the waiters
        self._unaudited: set[int] = set()  # failed batches the audit must not record
        self._flush_scheduled = False
        self._waiters: set[Waiter] = set()
        self._wake = asyncio.Event()
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
        self.last_appended = batch
        try:
            lsn: int | None = self.journal.append(ops)
        except (JournalError, ValueError) as exc:
            # Never streamed, never written: the batch fails, its waiters hear it.
            log.error("journal refused batch %d (%s): failing it", batch, exc)
            if isinstance(exc, JournalError):
                self.failure = exc
            lsn = None
        self._appended.append((batch, lsn))
        self._wake.set()
        if lsn is None:
            return
        if self.audit is not None:
            self._audit_batches.append((batch, ops))
        if self.on_batch is not None:
            self.on_batch(batch, ops)

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
        self._advance()

    def replica_acked(self, batch: int) -> None:
        """The passive has every batch up to `batch` on its disk."""
        if batch > self.replica_batch:
            self.replica_batch = batch
            self._advance()

    def _advance(self) -> None:
        complete = self.durable_batch
        if self.guarded:
            complete = min(complete, self.replica_batch)
        failed = self._failed_batches
        # Failed batches wait for no passive: take those right after the frontier.
        for batch in failed:
            if batch == complete + 1 and batch <= self.durable_batch:
                complete = batch
            elif batch > complete:
                break
        if complete <= self.complete_batch:
            return
        self.complete_batch = complete
        # The waiters hear the outcomes in batch order: runs of good batches, each
        # failed batch on its own.
        outcomes: list[tuple[int, bool]] = []
        while failed and failed[0] <= complete:
            batch = failed.popleft()
            if not outcomes or outcomes[-1][0] < batch - 1:
                outcomes.append((batch - 1, False))
            outcomes.append((batch, True))
        if not outcomes or outcomes[-1][0] < complete:
            outcomes.append((complete, False))
        try:
            self._record_audit(complete)
        except OSError as exc:
            # The audit log shares the data dir's disk. A full disk costs audit records
            # (said here), never this task: raising would end it, and with it every
            # confirm, nack and passive acknowledgement (found by the fault matrix).
            log.error(
                "audit log write failed (%s): records up to batch %d may be missing", exc, complete
            )
        for upto, batch_failed in outcomes:
            self._notify(upto, batch_failed)

    def _record_audit(self, complete: int) -> None:
        audited = self._audit_batches
        recorded = False
        while audited and audited[0][0] <= complete:
            batch, ops = audited.popleft()
            if batch in self._unaudited:
                self._unaudited.discard(batch)  # not confirmed: nothing to record
            elif self.audit is not None:
                self.audit.batch_complete(ops, self.guarded)
                recorded = True
        if recorded and self.audit is not None:
            # The confirm records reach the OS before the confirms go out: a broker killed
            # right after confirming still shows the audit what it confirmed.
            self.audit.flush()

    def _notify(self, batch: int, failed: bool) -> None:
        for waiter in list(self._waiters):
            try:
                waiting = waiter.durable(batch, failed)
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
        round_ = list(self._appended)  # a copy: _flush appends to the list meanwhile
        batch, lsn = round_[-1]
        if lsn is not None:
            with contextlib.suppress(JournalError):
                await self.journal.sync(lsn)  # the outcomes are read one by one below
        # Batches appended while we synced stay for the next round.
        self._appended = self._appended[len(round_) :]
        for each, each_lsn in round_:
            error = await self._outcome(each_lsn)
            if error is not None:
                self._failed_batches.append(each)
                self._unaudited.add(each)
                self.failure = error
                if isinstance(error, DiskFullError):
                    log.error("journal write failed, disk full: batch %d fails", each)
                else:
                    log.error("journal write failed (%s): batch %d fails", error, each)
        self.durable_batch = batch
        self._advance()

    async def _outcome(self, lsn: int | None) -> JournalError | None:
        """What became of one appended group (its write is done: this does not wait)."""
        if lsn is None:
            return self.failure or JournalError("the journal refused the batch")
        try:
            await self.journal.sync(lsn)
        except JournalError as exc:
            return exc
        return None
