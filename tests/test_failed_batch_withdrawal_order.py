"""Outcomes are told in batch order: a failed batch the passive may hold only once
withdrawn, and no outcome ahead of an earlier one still waiting for its audit record.

The group committer over a real journal on a real full tmpfs (root): the first of
two batches fails for lack of space, the second fits; the passive (this test plays
its acknowledgements, the committer's own API) acknowledged both, having applied
both. Nothing is told until the withdrawal of the failed one is acknowledged; then
the failure and the confirm behind it come in batch order (docs/replication.md,
"A failed batch on the passive").
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from disks import small_tmpfs

from twinmq.broker.auditlog import AuditLog, PendingBatch
from twinmq.broker.commit import GroupCommitter
from twinmq.broker.journal import Journal, JournalError, StoredMessage


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs with 15 MiB taken (needs root; skipped where mounting is refused)."""
    with small_tmpfs(tmp_path / "disk", "16m") as mount:
        (mount / "filler").write_bytes(b"\0" * (15 * 1024 * 1024))
        yield mount


class Outcomes:
    """A waiter that records every outcome it is told: (batch, failed)."""

    def __init__(self) -> None:
        self.told: list[tuple[int, bool]] = []

    def durable(self, batch: int, failed: bool = False) -> bool:
        self.told.append((batch, failed))
        return True


async def _write(journal: Journal, committer: GroupCommitter, mid: int, fits: bool) -> None:
    """Batch of message `mid`, written on its own: 4 MiB fail on the full disk, 1 KiB fit."""
    body = b"y" * 1024 if fits else b"x" * (4 * 1024 * 1024)
    committer.add([StoredMessage(mid, 1, "", "q", b"", body, None)])
    committer.flush_now()
    with contextlib.suppress(JournalError):
        await journal.sync(journal.stats.appended_lsn)


async def _failed_then_good(journal: Journal, committer: GroupCommitter) -> None:
    """Batch 1 too big for the disk (its write fails), batch 2 small (written): one
    commit round over both."""
    await _write(journal, committer, 1, fits=False)
    await _write(journal, committer, 2, fits=True)
    await committer._sync_once()


def _rig(full_disk: Path) -> tuple[Journal, GroupCommitter, Outcomes, list[tuple[int, bool]]]:
    journal = Journal(full_disk / "j", segment_bytes=64 * 1024 * 1024)
    journal.open()
    committer = GroupCommitter(journal, asyncio.get_running_loop())
    outcomes = Outcomes()
    committer.await_durable(outcomes)
    withdrawals: list[tuple[int, bool]] = []

    def withdraw(batch: int, streamed: bool) -> bool:
        withdrawals.append((batch, streamed))
        return committer.guarded

    committer.on_withdraw = withdraw
    committer.guard(True)  # a passive in sync
    return journal, committer, outcomes, withdrawals


def test_a_failed_batch_the_passive_acknowledged_waits_for_its_withdrawal(
    full_disk: Path,
) -> None:
    async def run() -> None:
        journal, committer, outcomes, withdrawals = _rig(full_disk)
        await _failed_then_good(journal, committer)
        assert withdrawals == [(1, True)], "the failed batch was streamed: withdrawn at once"
        committer.replica_acked(2)  # the passive applied and acknowledged both
        assert outcomes.told == [], "told while the passive still holds the failed batch"
        committer.withdrawn(1)
        assert outcomes.told == [(1, True), (2, False)]
        await journal.close()

    asyncio.run(run())


def test_a_failed_batch_is_told_once_the_active_goes_on_alone(full_disk: Path) -> None:
    async def run() -> None:
        journal, committer, outcomes, _ = _rig(full_disk)
        await _failed_then_good(journal, committer)
        committer.replica_acked(2)
        assert outcomes.told == []
        committer.guard(False)  # alone: the passive is not promotable any more
        assert outcomes.told == [(1, True), (2, False)]
        await journal.close()

    asyncio.run(run())


class _SlowAudit(AuditLog):
    """Fault injection: an audit disk whose write takes as long as the test wants (a slow
    fdatasync); the write itself is the real one."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, "b1", lambda: 1, lambda qid: f"q{qid}", lambda: False)
        self.writing = threading.Event()
        self.go_on = threading.Event()

    def write(self, batches: list[PendingBatch]) -> int:
        self.writing.set()
        self.go_on.wait(30)
        return super().write(batches)


def test_a_failure_is_never_told_ahead_of_earlier_outcomes_waiting_for_their_audit_write(
    tmp_path: Path, full_disk: Path
) -> None:
    # Batches 1 (good), 2 (failed), 3 (good) complete together; their outcomes wait for
    # the audit write of 1 and 3. Batch 4 fails meanwhile and has no audit record: its
    # outcomes used to be told at once, "up to 3: durable" among them, which confirmed
    # batch 2's publishes before "2 failed" came (CI, stop 30: 25 confirmed lost).
    async def run() -> list[tuple[int, bool]]:
        journal = Journal(full_disk / "j", segment_bytes=64 * 1024 * 1024)
        journal.open()
        committer = GroupCommitter(journal, asyncio.get_running_loop())
        audit = _SlowAudit(tmp_path / "audit")
        committer.audit = audit
        outcomes = Outcomes()
        committer.await_durable(outcomes)
        for mid, fits in ((1, True), (2, False), (3, True)):
            await _write(journal, committer, mid, fits)
        await committer._sync_once()
        assert await asyncio.to_thread(audit.writing.wait, 30), "the audit write never began"
        await _write(journal, committer, 4, fits=False)
        await committer._sync_once()
        assert outcomes.told == [], "told while earlier outcomes wait for their audit write"
        audit.go_on.set()
        await committer.stop()
        await journal.close()
        audit.close()
        return outcomes.told

    told = asyncio.run(run())
    assert told == [(1, False), (2, True), (3, False), (4, True)]
