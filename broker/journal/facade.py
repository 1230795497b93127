"""`Journal`: the crash-safe message journal's one entry point.

Durable queues' persistent messages live here, so that a broker killed with
`kill -9` loses nothing it confirmed. On-disk layout (one directory per broker)::

    LOCK                      flock(2)ed while a Journal has the directory open
    definitions.json          the durable topology's snapshot; replaced atomically (tmp,
                              fsync, rename) when the log below is compacted
    definitions.log           each topology change since the snapshot, appended and
                              fsynced a group (a loop turn's) at a time (format and
                              crash order: deflog.py)
    00000000000000000001.seg  append-only segments, oldest first (format: segment.py)
    00000000000000000002.seg
    ...
    <quarantine>/             damaged segments moved aside (default: quarantine/ here;
                              the broker uses <data-dir>/quarantine)

The package, by concern: `ops` (op types and codec), `segment` (file format and
scanning), `recovery` (replay, torn tail vs corruption), `index` (live
bookkeeping), `compaction`, `writer` (the writer thread's file I/O), `completion`
(which lsns are done or failed, and the futures waiting for them) and this facade,
which runs the group commit.

Sequence numbers, one name each:

* `lsn` — journal position: one per group `append`ed, in order; `sync(lsn)`
  waits for it. Never stored on disk.
* `segno` — segment number, the file name.
* `mid` — a message's sequence number (the replication ID).
* The group committer's *commit batch* (`broker/commit.py`) and the active's
  *replication batch* (`broker/replication/`) are not journal concepts: a
  commit batch is appended as one group and gets one lsn.

Rules this module keeps (the reasons are at the code that keeps them):

* A group is applied to the in-memory bookkeeping only once it is durable, and in
  file order, so that bookkeeping always equals what a recovery would compute.
* A failed write (a full disk) is rolled back on disk and the failed groups are
  as if never appended; waiters get the error. After any other I/O error the
  journal stops writing (like PostgreSQL after a failed fsync).
* A torn tail of the last segment is truncated (never confirmed). Corruption is
  never erased: see `recovery.py`; the damaged file ends in quarantine only once
  its live messages are durable in the head segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path

from twinmq.broker.definitions import Definitions, DefinitionsDelta
from twinmq.broker.journal import compaction
from twinmq.broker.journal.completion import Completions
from twinmq.broker.journal.deflog import DefinitionsStore
from twinmq.broker.journal.errors import DiskFullError, JournalError
from twinmq.broker.journal.index import LiveIndex, SegmentInfo
from twinmq.broker.journal.ops import JournalOp, StoredMessage, encode_ops
from twinmq.broker.journal.recovery import DEFINITIONS, Recovered, replay
from twinmq.broker.journal.segment import PLACEHOLDER, encode_header, seal_record, segment_name
from twinmq.broker.journal.writer import SegmentFiles

__all__ = ["Journal", "JournalStats"]

log = logging.getLogger("twinmq.broker.journal")
_MID = attrgetter("mid")  # an op's replication ID, at C speed (a chunk has thousands)


@dataclass(slots=True, frozen=True)
class JournalStats:
    """A snapshot of the journal for metrics and the admin API."""

    segments: int
    disk_bytes: int
    live_messages: int
    last_fsync_seconds: float
    pending_bytes: int  # appended, not yet known durable
    fsyncs: int
    appended_lsn: int
    durable_lsn: int
    disk_full: bool  # the last write failed for lack of space (block publishers)
    damaged_segments: int = 0  # corrupt segments not yet moved to quarantine


class Journal:
    """Append-only segmented journal with group commit. See the module docstring.

    Threading: every method runs on the event loop (or, for `open`,
    `save_definitions` and `close`, before/after it). File writes, fsyncs,
    unlinks and renames run one at a time in a private worker thread
    (`SegmentFiles`).
    """

    def __init__(
        self,
        directory: Path,
        *,
        segment_bytes: int = 64 * 1024 * 1024,
        fsync: bool = True,
        on_fsync: Callable[[float], None] | None = None,
        quarantine: Path | None = None,
    ) -> None:
        if segment_bytes < 1024:
            raise ValueError("segment_bytes must be at least 1024")
        self._dir = Path(directory)
        self._segment_bytes = segment_bytes
        self._fsync = fsync
        self._on_fsync = on_fsync
        self._files = SegmentFiles(self._dir, quarantine or self._dir / "quarantine", fsync=fsync)

        self._opened = False
        self._closing = False
        self._broken: JournalError | None = None
        self._lock_fd = -1

        self._index = LiveIndex()
        self._next_segno = 1
        self._defs = DefinitionsStore(self._dir, lambda: self._files.dir_fd, fsync=fsync)

        # Appending: one bytearray per group commit, swapped by the writer.
        self._buf = bytearray()
        self._buf_groups: list[tuple[JournalOp, ...]] = []
        self._lsns = Completions()
        self._inflight_bytes = 0
        self._next_mid = 0  # one past the highest mid journaled or appended

        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._kick: asyncio.Event | None = None

        self._fsyncs = 0
        self._last_fsync = 0.0
        self._disk_full = False

    # --- opening ------------------------------------------------------------------

    def open(self) -> Recovered:
        """Lock the directory, load the definitions and replay the segments.

        Truncates a torn tail of the last segment, drops messages of queues that
        are not in the definitions, starts a new head segment, re-appends the live
        messages of damaged segments to it and moves those to quarantine, and
        deletes the segments that no longer hold live messages. Synchronous: call
        it before serving clients.
        """
        if self._opened:
            raise JournalError("journal already open")
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self._dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise JournalError(f"journal directory {self._dir} is in use") from None
        try:
            self._files.open()
            return self._open_locked()
        except BaseException:
            self._release_fds()
            raise

    def _open_locked(self) -> Recovered:
        defs_path = self._dir / DEFINITIONS
        loaded = self._defs.open()
        definitions, defs_missing = loaded.state.definitions(), loaded.missing
        def_qids = loaded.state.qids()

        index = self._index
        out = replay(self._dir, index, definitions)
        recovered, messages = out.recovered, out.messages
        if out.segnos:
            self._next_segno = out.segnos[-1] + 1
        self._next_mid = recovered.next_mid
        if out.torn_segment is not None:
            log.warning(
                "journal: removing torn segment %s (%d bytes)",
                segment_name(out.torn_segment),
                recovered.torn_bytes,
            )
            self._files.unlink_torn(out.torn_segment)
        if out.torn_tail is not None:
            segno, offset = out.torn_tail
            log.warning(
                "journal: truncating torn tail of %s at offset %d (%d bytes, never confirmed)",
                segment_name(segno),
                offset,
                recovered.torn_bytes,
            )
            self._files.truncate(segno, offset)

        # Queues deleted before the crash: their messages are garbage.
        index.defined = set(def_qids)
        for qid in list(index.where):
            if qid not in def_qids:
                if defs_missing and index.where[qid]:
                    raise JournalError(
                        f"{defs_path} is missing but the journal holds live messages; "
                        "refusing to drop them (restore the definitions file)"
                    )
                index.drop(qid)
                messages.pop(qid, None)
        recovered.messages = {qid: list(d.values()) for qid, d in messages.items() if d}
        recovered.segments = len(index.segments)
        recovered.definitions_torn_bytes = loaded.torn_bytes
        self._opened = True

        try:
            self._roll_head_sync()
        except DiskFullError:
            # Serving clients with transient messages beats refusing to start; the
            # first write will try to create the head again. Damaged segments stay
            # where they are until then.
            log.warning("disk full: cannot create a new journal segment yet")
        if self._index.head is not None:
            try:
                if out.damaged:
                    recovered.reappended = self._rescue_damaged(out.damaged, messages)
                self._compact_sync()
            except DiskFullError as exc:
                # Rolled back; the damaged segments stay where they are (still read at
                # every start) until a later start has the room to move them aside.
                log.warning("disk full: compaction and quarantine wait for space: %s", exc)
            recovered.quarantined = list(self._files.quarantined)
        log.info(
            "journal opened: %d segments, %d records, %d live messages, next mid %d",
            recovered.segments,
            recovered.records,
            index.live_total,
            recovered.next_mid,
        )
        return recovered

    def _rescue_damaged(
        self, damaged: list[int], messages: dict[int, dict[int, StoredMessage]]
    ) -> int:
        """Re-append, durably, the live messages whose copy is in a damaged segment.

        Afterwards the damaged segments hold nothing live, and compaction moves
        them to quarantine (carrying the settles they hold first). A crash in
        between leaves both copies: the next open supersedes one with the other.
        """
        bad = set(damaged)
        ops: list[JournalOp] = [
            messages[qid][mid]
            for qid, where in self._index.where.items()
            for mid, segno in where.items()
            if segno in bad
        ]
        if ops:
            buf = bytearray(PLACEHOLDER)
            encode_ops(ops, buf)
            seal_record(buf, 0)
            head = self._index.head
            assert head is not None
            secs = self._files.write(buf, head.segno, b"", head.size)
            head.size += len(buf)
            self._index.apply([ops], head.segno)
            self._note_fsync(secs)
        log.error(
            "journal: %d live messages re-appended out of %d damaged segments (%s); "
            "they go to quarantine",
            len(ops),
            len(damaged),
            ", ".join(segment_name(s) for s in damaged),
        )
        return len(ops)

    # --- definitions --------------------------------------------------------------

    def save_definitions(self, defs: Definitions) -> None:
        """Durably replace the whole topology (a new snapshot; the log starts empty).

        Save a queue's definition before journaling messages for it: recovery
        drops the messages of every qid the definitions do not hold. Queues that
        this save removes count as dropped (see `drop_queue`).
        """
        self._require_open()
        dropped = self._defs.replace(defs)
        self._index.define(q.qid for q in defs.queues)
        for qid in dropped:
            self.drop_queue(qid)

    def save_delta(self, delta: DefinitionsDelta) -> None:
        """Durably record one topology change: one append and one fsync of the log.

        The same rules as `save_definitions`; on an error (DiskFullError for a full
        disk) nothing of the change is stored.
        """
        self.save_deltas([delta])

    def save_deltas(self, deltas: list[DefinitionsDelta]) -> None:
        """Durably record topology changes in order: one append and one fsync for all
        (a group commit); on an error none of them is stored."""
        self._require_open()
        dropped = self._defs.append_many(deltas)
        self._index.define(q.qid for delta in deltas for q in delta.add_queues)
        for qid in dropped:
            self.drop_queue(qid)

    def definitions(self) -> Definitions:
        """The topology as stored (snapshot and log)."""
        self._require_open()
        return self._defs.definitions()

    def drop_queue(self, qid: int) -> None:
        """A queue was deleted (definitions already saved without it).

        Its messages count as settled for compaction, including any still
        buffered or being written now.
        """
        self._require_open()
        self._index.drop(qid)
        self._kick_writer()

    # --- the hot path -------------------------------------------------------------

    def append(
        self,
        ops: Sequence[JournalOp],
        encoded: Sequence[bytes] | None = None,
        more: Callable[[memoryview], Sequence[JournalOp]] | None = None,
    ) -> int:
        """Buffer one atomic group of ops and return its lsn (no syscall).

        All ops of a group are recovered or none. Pass the lsn to `sync` to wait
        until it is on disk. An empty group returns the last lsn appended.
        Preconditions: the ops' queues are in the saved definitions; a (qid, mid)
        is not enqueued again while it is live (a later enqueue supersedes).

        `encoded`, if given, is `ops` already in the journal's encoding, in pieces
        whose concatenation is `encode_ops(ops)` (a passive's replicated batches,
        decoded into `ops` from these very bytes): written as they are, not
        encoded again.

        `more` (with `encoded` None), if given, is called once `ops` are encoded,
        with their encoding (a view into the journal's buffer, valid during the call
        only: it must not be kept); the ops it returns join the same record, after
        `ops` (the mirror's event of the batch, made of those very bytes: no other
        copy of them). An exception from it fails the whole group, as one from the
        encoding does.
        """
        if self._broken is not None:
            raise JournalError(f"journal failed: {self._broken}") from self._broken
        if not self._opened or self._closing:
            raise JournalError("journal is not open")
        if not ops:
            return self._lsns.appended
        buf = self._buf
        start = len(buf)
        buf += PLACEHOLDER
        extra: Sequence[JournalOp] = ()
        try:
            if encoded is None:
                next_mid = max(self._next_mid, encode_ops(ops, buf))
                if more is not None:
                    # Released before the buffer grows again (a bytearray with a view
                    # exported cannot be resized).
                    with memoryview(buf) as whole, whole[start + len(PLACEHOLDER) :] as own:
                        extra = more(own)
                    if extra:
                        next_mid = max(next_mid, encode_ops(extra, buf))
            else:
                for piece in encoded:
                    buf += piece
                next_mid = max(self._next_mid, max(map(_MID, ops)) + 1)
        except BaseException:
            del buf[start:]
            raise
        seal_record(buf, start)
        self._next_mid = next_mid
        self._buf_groups.append((*ops, *extra))
        lsn = self._lsns.next()
        self._kick_writer()
        return lsn

    async def sync(self, lsn: int) -> None:
        """Return once group `lsn` (and every earlier one that did not fail) is on disk.

        Raises DiskFullError or JournalError if the write holding `lsn` failed;
        that group was rolled back and will never be recovered.
        """
        lsns = self._lsns
        if lsn > lsns.appended:
            raise ValueError(f"lsn {lsn} was never appended (last is {lsns.appended})")
        if lsn <= lsns.done:
            lsns.raise_if_failed(lsn)
            return
        if self._broken is not None:
            raise JournalError(f"journal failed: {self._broken}") from self._broken
        self._ensure_writer()
        await lsns.wait(lsn)

    async def flush(self) -> None:
        """Write and fsync everything appended so far and finish pending compaction."""
        self._require_open()
        await self.sync(self._lsns.appended)
        self._index.compact_due = True
        self._ensure_writer()
        assert self._kick is not None
        idle = self._lsns.idle_future()
        self._kick.set()
        await idle

    def _kick_writer(self) -> None:
        kick = self._kick
        if kick is not None and self._task is not None and not self._task.done():
            if not kick.is_set():
                kick.set()
            return
        with contextlib.suppress(RuntimeError):  # no running loop: sync() starts it
            asyncio.get_running_loop()
            self._ensure_writer()
            assert self._kick is not None
            self._kick.set()

    @property
    def stats(self) -> JournalStats:
        """Segments, bytes on disk, live messages, last fsync time, pending bytes."""
        segments = self._index.segments.values()
        return JournalStats(
            segments=len(segments),
            disk_bytes=sum(s.size for s in segments),
            live_messages=self._index.live_total,
            last_fsync_seconds=self._last_fsync,
            pending_bytes=len(self._buf) + self._inflight_bytes,
            fsyncs=self._fsyncs,
            appended_lsn=self._lsns.appended,
            durable_lsn=self._lsns.done,
            disk_full=self._disk_full,
            damaged_segments=sum(1 for s in segments if s.damaged),
        )

    # --- the group commit (loop side of the writer) --------------------------------

    def _ensure_writer(self) -> None:
        if self._task is not None and not self._task.done():
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal")
        self._kick = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="journal-writer")

    async def _run(self) -> None:
        assert self._kick is not None
        kick = self._kick
        try:
            while True:
                if self._buf:
                    await self._write_buffer()
                    continue  # whatever was appended meanwhile is the next group commit
                if (
                    self._index.compact_due
                    and self._index.head is not None
                    and self._broken is None
                ):
                    await self._compact()
                    continue
                self._lsns.idle()
                if self._closing:
                    return
                kick.clear()
                await kick.wait()
        except BaseException as exc:
            err = JournalError(f"journal writer stopped: {exc!r}")
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("journal writer crashed")
            self._broken = self._broken or err
            self._lsns.fail_all(err)
            raise

    async def _write_buffer(self) -> None:
        buf, self._buf = self._buf, bytearray()
        groups, self._buf_groups = self._buf_groups, []
        lo, hi = self._lsns.done + 1, self._lsns.appended
        self._inflight_bytes = len(buf)
        head = self._index.head
        if head is None or head.size >= self._segment_bytes:
            segno, header, offset = (
                self._next_segno,
                encode_header(self._next_segno, self._next_mid),
                0,
            )
        else:
            segno, header, offset = head.segno, b"", head.size
        if self._broken is not None:
            # Nothing more reaches the disk after an I/O error.
            self._inflight_bytes = 0
            self._write_failed(lo, hi, self._broken)
            return
        loop = asyncio.get_running_loop()
        try:
            secs = await loop.run_in_executor(
                self._executor, self._files.write, buf, segno, header, offset
            )
        except JournalError as exc:
            self._inflight_bytes = 0
            self._write_failed(lo, hi, exc)
            return
        self._inflight_bytes = 0
        self._disk_full = False
        if header:
            self._install_head(segno, len(header) + len(buf))
        else:
            assert head is not None
            head.size += len(buf)
        self._index.apply(groups, segno)
        self._note_fsync(secs)
        self._lsns.succeeded(hi)

    def _write_failed(self, lo: int, hi: int, exc: JournalError) -> None:
        if isinstance(exc, DiskFullError):
            self._disk_full = True
            log.error("journal: disk full, %d groups rolled back: %s", hi - lo + 1, exc)
        else:
            log.error("journal: write failed, %d groups rolled back: %s", hi - lo + 1, exc)
        if not isinstance(exc, DiskFullError):
            # After an I/O error (not a full disk) the file's contents are unknown;
            # like PostgreSQL after a failed fsync, stop rather than confirm more.
            self._broken = exc
        self._lsns.failed(lo, hi, exc)
        if self._broken is not None:
            self._lsns.fail_all(self._broken)

    def _install_head(self, segno: int, size: int) -> None:
        self._index.install_head(SegmentInfo(segno, self._dir / segment_name(segno), size))
        self._next_segno = segno + 1

    def _note_fsync(self, secs: float | None) -> None:
        if secs is None:
            return
        self._fsyncs += 1
        self._last_fsync = secs
        if self._on_fsync is not None:
            try:
                self._on_fsync(secs)
            except Exception:
                log.exception("journal on_fsync callback failed")

    def _roll_head_sync(self) -> None:
        segno = self._next_segno
        header = encode_header(segno, self._next_mid)
        secs = self._files.write(b"", segno, header, 0)
        self._install_head(segno, len(header))
        self._note_fsync(secs)

    # --- compaction ---------------------------------------------------------------

    async def _compact(self) -> None:
        self._index.compact_due = False
        plan = compaction.plan(self._index, allow_carry=True)
        if not plan.remove:
            return
        head = self._index.head
        assert head is not None
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(
                self._executor, self._files.compact, plan, head.size
            )
        except DiskFullError as exc:
            # Deleting is how space comes back: do what needs no carrying.
            log.warning("journal: cannot carry settles (%s); compacting what needs none", exc)
            self._disk_full = True
            plan = compaction.plan(self._index, allow_carry=False)
            if not plan.remove:
                return
            result = await loop.run_in_executor(
                self._executor, self._files.compact, plan, head.size
            )
        except JournalError as exc:
            self._broken = exc
            self._lsns.fail_all(exc)
            return
        secs, carried, removed = result
        self._note_fsync(secs)
        compaction.finish(self._index, plan, carried, removed)

    def _compact_sync(self) -> None:
        plan = compaction.plan(self._index, allow_carry=True)
        if plan.remove:
            head = self._index.head
            assert head is not None
            secs, carried, removed = self._files.compact(plan, head.size)
            self._note_fsync(secs)
            compaction.finish(self._index, plan, carried, removed)
        self._index.compact_due = False

    # --- closing ------------------------------------------------------------------

    async def close(self) -> None:
        """Flush and fsync everything pending, stop the writer, release the directory."""
        if not self._opened:
            return
        if self._broken is None and (self._buf or self._task is not None):
            self._ensure_writer()
        self._closing = True
        if self._task is not None:
            assert self._kick is not None
            self._kick.set()
            with contextlib.suppress(JournalError):
                await self._task
        self._defs.checkpoint()
        self._shutdown()

    def _simulate_crash(self) -> None:
        """Tests only: drop everything in memory and let go of the files, like kill -9."""
        if self._task is not None:
            self._task.cancel()
        self._buf = bytearray()
        self._buf_groups = []
        self._shutdown()

    def _shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._release_fds()
        self._opened = False

    def _release_fds(self) -> None:
        self._defs.close()
        self._files.close()
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = -1

    def _require_open(self) -> None:
        if not self._opened:
            raise JournalError("journal is not open")
