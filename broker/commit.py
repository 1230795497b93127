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
acknowledged on the strength of the later one. A failed batch is not confirmed,
but it was streamed to the passive before the write failed here, and the passive
applied it: while the passive guards, its waiters hear the failure only once the
passive has dropped it again (`on_withdraw`, `withdrawn`) or the active has gone on
alone (`guard(False)`: the passive is then not promotable), so that a failure told
means nothing of the batch is kept anywhere (docs/replication.md, "A failed batch
on the passive"). Unguarded, it completes as soon as the batches before it have.
Either way its outcome comes after theirs, and the outcomes of later batches after it.

With the audit log on, a complete batch's records are written and fdatasynced
by the audit's writer thread before its waiters hear of it (confirms, tx.commit-ok,
the passive's ACK): the records survive a power loss of what they claim. The
outcomes wait in `_held`, in batch order, while that write runs; the batches that
complete meanwhile are written together in the next one (a group commit of the
audit file, in parallel with the journal's next write).
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
from twinmq.broker.definitions import Definitions, DefinitionsDelta
from twinmq.broker.journal import DiskFullError, Journal, JournalError, JournalOp

log = logging.getLogger(__name__)


class Waiter(Protocol):
    """Something that waits for batches to become durable (a channel)."""

    def durable(self, batch: int, failed: bool = False) -> bool:
        """Batches up to `batch` are done; return whether it still waits for more."""
        ...


class BatchTap(Protocol):
    """Adds ops to a batch as it closes (the mirror's replication queue: same group commit)."""

    def batch_closing(
        self, batch: int, ops: list[JournalOp], encoded: memoryview
    ) -> list[JournalOp]:
        """Ops to journal in `batch` with `ops` (`encoded`: their journal encoding, valid
        during the call only; the tap changes neither)."""
        ...

    def definitions_saved(self, definitions: Definitions) -> None:
        """The durable topology was just replaced."""
        ...

    def batch_failed(self, batch: int) -> list[JournalOp]:
        """Failed batch `batch`'s ops of the tap leave its state now (its events, and
        the changes to its own state that must not outlive the batch); the ops that do
        the same on a passive that applied the batch (docs/replication.md, "A failed
        batch on the passive")."""
        ...


class _Tapped:
    """The tap's part of a closing batch: called by `Journal.append` with the batch's own
    ops as just encoded into the journal's record (encoded once, for the journal and the
    mirror's event alike: the event carries the same bytes); its ops join that record."""

    __slots__ = ("batch", "extra", "ops", "tap")

    def __init__(self, tap: BatchTap, batch: int, ops: list[JournalOp]) -> None:
        self.tap = tap
        self.batch = batch
        self.ops = ops
        self.extra: list[JournalOp] = []

    def __call__(self, encoded: memoryview) -> list[JournalOp]:
        self.extra = self.tap.batch_closing(self.batch, self.ops, encoded)
        return self.extra


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
        # Called at once when a batch's write fails (its waiters hear it in batch order,
        # possibly later, behind outcomes held for the audit log).
        self.on_failed: Callable[[int, JournalError], None] | None = None
        # Called at once with each failed batch and whether it was streamed: withdraws
        # it in memory (and from the passive); True: its outcome waits for `withdrawn`.
        self.on_withdraw: Callable[[int, bool], bool] | None = None
        self.audit: AuditLog | None = None
        self.tap: BatchTap | None = None
        self._audit_batches: deque[tuple[int, list[JournalOp]]] = deque()
        self._open: list[JournalOp] = []
        self._open_encoded: list[bytes] | None = None  # the open batch's ops, encoded
        self._open_batch = 1  # the number of the batch being filled
        # (batch, lsn) appended, not yet known durable; lsn None: the append itself failed
        self._appended: list[tuple[int, int | None]] = []
        self._failed_batches: deque[int] = deque()  # failed, not yet told to the waiters
        # Failed batches the passive may still hold: their outcomes (and all after) wait.
        self._withdrawing: set[int] = set()
        # Outcomes (batch, failed) whose audit records are not yet durable, in order.
        self._held: list[tuple[int, bool]] = []
        self._audit_wake = asyncio.Event()
        self._audit_idle = asyncio.Event()  # set while nothing is held or being written
        self._audit_writing = 0  # the last batch whose audit write is under way, else 0
        self._audit_task: asyncio.Task[None] | None = None
        self._flush_scheduled = False
        # Topology changes staged for this loop turn's group commit (`stage_delta`).
        self._staged: list[tuple[DefinitionsDelta, Callable[[JournalError | None], None]]] = []
        self._staged_current: Callable[[], Definitions] | None = None
        self._topology_scheduled = False
        self._topology_failure: JournalError | None = None  # fails the open batch
        self._waiters: set[Waiter] = set()
        self._wake = asyncio.Event()
        self._settled = asyncio.Event()  # set while no batch waits for its sync
        self._settled.set()
        self._task: asyncio.Task[None] | None = None
        self.failure: JournalError | None = None
        # The last audit write's error while outcomes wait for a retry, else None: the
        # confirms are held, so the disk alarm tells publishers why (alarms.py).
        self.audit_failure: Exception | None = None

    # -- Committer protocol ----------------------------------------------------------------

    def add(self, ops: Iterable[JournalOp], encoded: bytes | None = None) -> int:
        """Queue ops for the batch being filled and return its number.

        `encoded`: the ops already in the journal's encoding (a passive's replicated
        batch, as received): journaled as they are if every add of the batch has them.
        """
        if not self._open:
            self._open_encoded = []
        if encoded is None:
            self._open_encoded = None
        elif self._open_encoded is not None:
            self._open_encoded.append(encoded)
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
        if self._held:
            return self._held[-1][0]  # complete, its audit records not yet durable
        return self._audit_writing  # 0 unless a write of audit records is under way

    def save_definitions(self, definitions: Definitions) -> None:
        """Durably replace the topology file (a passive's catch-up)."""
        self.flush_topology()  # what was staged before it, first
        self.journal.save_definitions(definitions)
        if self.tap is not None:
            self.tap.definitions_saved(definitions)

    def save_delta(self, delta: DefinitionsDelta, current: Callable[[], Definitions]) -> None:
        """Durably record one topology change now (one small append to the definitions log).

        Changes staged before it go in the same write, first (the log keeps the order
        they were made in memory). The mirror's tap still takes the whole topology (its
        events carry it whole): `current()` builds it, only when a tap is attached.
        """
        failure: list[JournalError] = []

        def done(error: JournalError | None) -> None:
            if error is not None:
                failure.append(error)

        self._staged.append((delta, done))
        self._staged_current = current
        self.flush_topology()
        if failure:
            raise failure[0]

    def stage_delta(
        self,
        delta: DefinitionsDelta,
        current: Callable[[], Definitions],
        done: Callable[[JournalError | None], None],
    ) -> None:
        """Queue a topology change for the group commit of this loop turn.

        Every change staged in one turn of the loop (all the bind/unbind/declare
        methods of one network read, across connections) is written with one
        append and one fsync of the definitions log, before any journal batch that
        follows it (`_flush`: a message is journaled only for a queue the topology
        holds). `done(None)` is called once it is durable, in staging order;
        `done(error)` when the write failed, for every change of the group, in the
        reverse order (each caller undoes its change in memory, the last one first).
        """
        self._staged.append((delta, done))
        self._staged_current = current
        if not self._topology_scheduled:
            self._topology_scheduled = True
            self.loop.call_soon(self.flush_topology)

    def flush_topology(self) -> None:
        """Write the staged topology changes now (one append, one fsync) and tell their
        callers; nothing if none is staged."""
        self._topology_scheduled = False
        if not self._staged:
            return
        staged, self._staged = self._staged, []
        current, self._staged_current = self._staged_current, None
        metrics.TOPOLOGY_GROUP.observe(len(staged))
        try:
            self.journal.save_deltas([delta for delta, _ in staged])
        except JournalError as exc:
            log.error("topology changes not saved (%s): %d changes refused", exc, len(staged))
            if self._open:
                # The batch open in this turn may hold messages routed by these changes
                # (into a queue whose declare is refused: recovery would drop them):
                # it fails too, its publishes are nacked, never confirmed.
                self._topology_failure = exc
            for _, done in reversed(staged):
                done(exc)
            return
        if self.tap is not None and current is not None:
            self.tap.definitions_saved(current())
        for _, done in staged:
            done(None)

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

    def _ensure_audit_task(self) -> None:
        if self._audit_task is None or self._audit_task.done():
            self._audit_task = self.loop.create_task(self._audit_loop(), name="twinmq-audit")

    async def stop(self) -> None:
        """Flush, sync what is pending, stop the tasks."""
        self._flush()
        if self._appended:
            await self._sync_once()
        if self._held:
            # Release what the audit can still record (its task may be mid-write: wait).
            self._ensure_audit_task()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(10.0):
                    await self.audit_written()
            if self._held:
                log.error("audit: %d outcomes never recorded at shutdown", len(self._held))
        for task in (self._task, self._audit_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _flush(self) -> None:
        self._flush_scheduled = False
        # The topology changes of this turn first: a batch may hold messages for a
        # queue declared in it, and recovery keeps only those of queues it knows.
        self.flush_topology()
        if not self._open:
            return
        ops, self._open = self._open, []
        encoded, self._open_encoded = self._open_encoded, None
        batch = self._open_batch
        self._open_batch += 1
        tapped: _Tapped | None = None
        if self.tap is not None and encoded is None:
            tapped = _Tapped(self.tap, batch, ops)
        metrics.COMMIT_BATCH.observe(len(ops))
        self.last_appended = batch
        refused, self._topology_failure = self._topology_failure, None
        try:
            if refused is not None:
                raise refused
            lsn: int | None = self.journal.append(ops, encoded, tapped)
            if tapped is not None:
                ops.extend(tapped.extra)  # the record holds them: the audit and passive too
        except (JournalError, ValueError) as exc:
            # Never streamed, never written: the batch fails, its waiters hear it.
            log.error("journal refused batch %d (%s): failing it", batch, exc)
            if isinstance(exc, JournalError):
                self.failure = exc
            lsn = None
        self._appended.append((batch, lsn))
        self._settled.clear()
        self._wake.set()
        if lsn is None:
            return
        if self.audit is not None:
            self._audit_batches.append((batch, ops))
        if self.on_batch is not None:
            self.on_batch(batch, ops)

    async def idle(self, limit: float) -> None:
        """Wait (at most `limit` seconds) until no batch waits for its sync or its audit.

        Background work (a catch-up) calls this before each step so that it runs
        while the journal is idle and leaves the loop and the GIL to confirms. A
        confirm crosses two threads (the journal's sync, then the audit log's
        write); each needs the GIL to start and to finish, and a busy loop hands
        it over only after the interpreter's switch interval (5 ms): waiting for
        the journal alone left the audit's half of every confirm behind the
        background work.
        """
        if self._quiet():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit):
                while not self._quiet():
                    if self._open:
                        await asyncio.sleep(0)  # its flush is scheduled: let it go first
                    elif not self._settled.is_set():
                        await self._settled.wait()
                    else:
                        await self._audit_idle.wait()  # cleared while anything is held

    def _quiet(self) -> bool:
        """Nothing waits for its sync or its audit records."""
        return (
            self._settled.is_set() and not self._open and not self._held and not self._audit_writing
        )

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
        if not on:
            # Alone (the Lease says so, or there is no Lease): no passive is promotable.
            self._withdrawing.clear()
        self._advance()

    def withdrawn(self, batch: int | None = None) -> None:
        """The passive no longer holds the failed batches up to `batch` (None: any).

        None: a passive caught up from what this broker holds after the withdrawal.
        """
        if not self._withdrawing:
            return
        if batch is None:
            self._withdrawing.clear()
        else:
            self._withdrawing = {b for b in self._withdrawing if b > batch}
        self._advance()

    def replica_acked(self, batch: int) -> None:
        """The passive has every batch up to `batch` on its disk."""
        if batch > self.replica_batch:
            self.replica_batch = batch
            self._advance()

    def _advance(self) -> None:
        complete = self.durable_batch
        if self.guarded:
            # Never behind what was told: a failed batch told is one the passive may
            # never acknowledge (its link was reset).
            complete = max(min(complete, self.replica_batch), self.complete_batch)
        failed = self._failed_batches
        # Failed batches wait for no acknowledgement: take those right after the frontier.
        for batch in failed:
            if batch == complete + 1 and batch <= self.durable_batch:
                complete = batch
            elif batch > complete:
                break
        if self._withdrawing:
            # A failed batch the passive may still hold (it acknowledged it, perhaps: it
            # applied it) waits for `withdrawn`, and every later batch behind it.
            complete = min(complete, min(self._withdrawing) - 1)
        told = self.complete_batch
        if complete <= told:
            return
        self.complete_batch = complete
        # The waiters hear the outcomes in batch order: runs of good batches, each
        # failed batch on its own; never again what was told (a waiter takes "durable
        # up to n" for everything up to n it still holds).
        outcomes: list[tuple[int, bool]] = []
        while failed and failed[0] <= complete:
            batch = failed.popleft()
            if told < batch - 1:
                outcomes.append((batch - 1, False))
            outcomes.append((batch, True))
            told = batch
        if told < complete:
            outcomes.append((complete, False))
        if self._record_audit(complete) or self._held or self._audit_writing:
            # The waiters hear these once the audit records are durable, after every
            # earlier outcome still held: in batch order. Those of a write under way
            # are out of `_held` meanwhile: failed batches (no records) told now
            # would overtake them, and a "durable up to n" among them confirm an
            # earlier failed batch's publishes (CI, stop 30).
            self._held += outcomes
            self._audit_idle.clear()
            self._audit_wake.set()
            self._ensure_audit_task()
            return
        for upto, batch_failed in outcomes:
            self._notify(upto, batch_failed)

    async def audit_written(self) -> None:
        """Return once no outcome waits for its audit records (benchmarks, shutdown)."""
        if self._held or self._audit_writing:
            await self._audit_idle.wait()

    def _record_audit(self, complete: int) -> bool:
        """Queue the audit records of the batches now complete; whether any were."""
        audited = self._audit_batches
        recorded = False
        while audited and audited[0][0] <= complete:
            _, ops = audited.popleft()
            if self.audit is not None:
                self.audit.batch_complete(ops, self.guarded)
                recorded = True
        return recorded

    async def _audit_loop(self) -> None:
        while True:
            if not self._held:
                self._audit_idle.set()
            await self._audit_wake.wait()
            self._audit_wake.clear()
            while self._held:
                try:
                    await self._write_audit()
                except Exception as exc:
                    # Never confirm what the audit does not hold: the confirms wait, the
                    # records are written again, and the disk alarm blocks publishers
                    # meanwhile (a full disk can refuse the audit write before any
                    # journal write fails: without the alarm nobody was told why). Not
                    # only OSError: any other error would end this task, and every
                    # confirm after it would wait for good with nobody told why.
                    self.audit_failure = exc
                    metrics.AUDIT_WRITE_FAILURES.inc()
                    if isinstance(exc, OSError):
                        log.error("audit write failed (%s): confirms held, retrying in 1 s", exc)
                    else:
                        log.exception("audit write failed: confirms held, retrying in 1 s")
                    await asyncio.sleep(1.0)
                else:
                    self.audit_failure = None

    async def _write_audit(self) -> None:
        """Write and fdatasync the queued audit records, then release the held outcomes."""
        audit = self.audit
        assert audit is not None
        held, self._held = self._held, []
        batches = audit.take()
        if batches:
            self._audit_writing = held[-1][0]
            started = self.loop.time()
            try:
                records = await audit.writer.call(audit.write, batches)
            except Exception:
                # Rolled back: nothing of it counts; written again by the next round.
                audit.give_back(batches)
                self._held[:0] = held
                raise
            finally:
                self._audit_writing = 0
            metrics.AUDIT_RECORDS.inc(records)
            metrics.AUDIT_WRITES.inc()
            metrics.AUDIT_FSYNC_LATENCY.observe(self.loop.time() - started)
        for upto, batch_failed in held:
            self._notify(upto, batch_failed)

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
        if not self._appended:
            self._settled.set()
        for each, each_lsn in round_:
            error = await self._outcome(each_lsn)
            if error is not None:
                self._failed_batches.append(each)
                # Not confirmed: the audit has nothing to record of it.
                self._audit_batches = deque(b for b in self._audit_batches if b[0] != each)
                self.failure = error
                if self.on_failed is not None:
                    self.on_failed(each, error)
                if isinstance(error, DiskFullError):
                    log.error("journal write failed, disk full: batch %d fails", each)
                else:
                    log.error("journal write failed (%s): batch %d fails", error, each)
                # Withdrawn at once (here and on the passive), told in batch order.
                if self._withdraw(each, each_lsn is not None):
                    self._withdrawing.add(each)
        self.durable_batch = batch
        self._advance()

    def _withdraw(self, batch: int, streamed: bool) -> bool:
        """`on_withdraw`, never raising: an exception here would end the sync task, and
        every later confirm would wait for good. The hook resyncs the passive when its
        own withdrawal fails (server.py); should even that raise, the batch is told
        without waiting rather than never."""
        if self.on_withdraw is None:
            return False
        try:
            return self.on_withdraw(batch, streamed)
        except Exception:
            log.exception("withdrawing failed batch %d failed: told without waiting", batch)
            return False

    async def _outcome(self, lsn: int | None) -> JournalError | None:
        """What became of one appended group (its write is done: this does not wait)."""
        if lsn is None:
            return self.failure or JournalError("the journal refused the batch")
        try:
            await self.journal.sync(lsn)
        except JournalError as exc:
            return exc
        return None
