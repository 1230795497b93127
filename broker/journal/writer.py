"""The writer thread's side of the journal: every write, fsync, unlink and rename.

`SegmentFiles` runs one call at a time, in the journal's private worker thread
while the event loop runs (or directly before it, at open). It touches only
the head segment's file descriptor, the directory and the bytes it is handed;
the loop side (`facade.Journal`) owns all bookkeeping.

Rules kept here:

* A failed write is rolled back on disk (truncated to the last good offset, or
  a new segment removed), so the next write appends after the last good record;
  if the rollback fails too the journal stops writing for good
  (`FatalJournalError`).
* A new segment's data and its directory entry are synced together.
* Compaction's carried settles are durable before any segment is removed, and
  removals are one at a time with a directory fsync after each.
* A damaged segment is never unlinked or truncated: it is renamed into the
  quarantine folder (directory fsyncs on both sides), and only after its live
  messages were re-appended durably.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

from twinmq.broker.journal.compaction import CompactionPlan
from twinmq.broker.journal.errors import FatalJournalError, io_error
from twinmq.broker.journal.ops import encode_carried
from twinmq.broker.journal.segment import frame, segment_name

__all__ = ["SegmentFiles"]

log = logging.getLogger("twinmq.broker.journal")


class SegmentFiles:
    """File I/O on a journal directory (one call at a time)."""

    def __init__(self, directory: Path, quarantine: Path, *, fsync: bool) -> None:
        self.dir = directory
        self.quarantine_dir = quarantine
        self.fsync = fsync
        self.dir_fd = -1
        self.head_fd = -1
        self.quarantined: list[Path] = []  # where damaged segments were moved, in order

    def open(self) -> None:
        """Open the directory (for its fsyncs)."""
        self.dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)

    def close(self) -> None:
        """Let go of the file descriptors."""
        for name in ("head_fd", "dir_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)

    def write(
        self, data: bytes | bytearray, segno: int, header: bytes, offset: int
    ) -> float | None:
        """Write `data` at `offset` of the head (or create segment `segno` with `header`
        and write after it), then fdatasync. Returns the fsync time (None when off).

        On failure the file is put back exactly as it was.
        """
        path: Path | None = None
        if header:
            path = self.dir / segment_name(segno)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as exc:
                raise io_error("creating segment", exc) from exc
            offset = 0
            data = header + data
        else:
            fd = self.head_fd
        try:
            self._write_all(fd, data, offset)
            secs = self._sync_fd(fd)
            if header:
                self.sync_dir()  # the new name must survive a crash with its data
        except OSError as exc:
            try:
                if path is not None:
                    os.close(fd)
                    path.unlink()
                else:
                    os.ftruncate(fd, offset)
            except OSError as exc2:
                raise FatalJournalError(
                    f"cannot roll back a failed write ({exc}): {exc2}"
                ) from exc2
            raise io_error("writing", exc) from exc
        if header:
            if self.head_fd >= 0:
                os.close(self.head_fd)
            self.head_fd = fd
        return secs

    def compact(self, plan: CompactionPlan, head_size: int) -> tuple[float | None, int, list[int]]:
        """Append the carried settles, make them durable, then remove segments in order.

        Returns the fsync time, the bytes appended to the head and the segments removed.
        """
        secs = None
        # Encoded here, not on the loop: a long-lived segment can have many settles.
        payload = encode_carried(plan.carry)
        carry = frame(payload) if payload else b""
        if carry:
            try:
                self._write_all(self.head_fd, carry, head_size)
                secs = self._sync_fd(self.head_fd)
            except OSError as exc:
                try:
                    os.ftruncate(self.head_fd, head_size)
                except OSError as exc2:
                    raise FatalJournalError(
                        f"cannot roll back a failed write ({exc}): {exc2}"
                    ) from exc2
                raise io_error("carrying settles", exc) from exc
        removed: list[int] = []
        for segno in plan.remove:
            try:
                if segno in plan.quarantine:
                    self.quarantine(segno)
                else:
                    (self.dir / segment_name(segno)).unlink()
                    # One at a time, durably: a later removal relies on this one.
                    self.sync_dir()
            except OSError as exc:
                log.error("journal: cannot remove segment %d: %s", segno, exc)
                break
            removed.append(segno)
        return secs, len(carry), removed

    def quarantine(self, segno: int) -> Path:
        """Move a damaged segment into the quarantine folder, durably; return its new path."""
        qdir = self.quarantine_dir
        if not qdir.is_dir():
            qdir.mkdir(parents=True, exist_ok=True)
            self._sync_path(qdir.parent)
        name = segment_name(segno)
        target = qdir / name
        n = 0
        while target.exists():  # never overwrite earlier evidence
            n += 1
            target = qdir / f"{name}.{n}"
        os.rename(self.dir / name, target)
        self._sync_path(qdir)
        self.sync_dir()
        self.quarantined.append(target)
        log.error("journal: damaged segment %s moved to %s", name, target)
        return target

    def truncate(self, segno: int, size: int) -> None:
        """Cut a torn tail off segment `segno` (never a damaged one)."""
        with open(self.dir / segment_name(segno), "r+b") as f:
            f.truncate(size)
            os.fsync(f.fileno())

    def unlink_torn(self, segno: int) -> None:
        """Remove a last segment that a crash left without a header or any record."""
        (self.dir / segment_name(segno)).unlink()
        os.fsync(self.dir_fd)

    def sync_dir(self) -> None:
        """fsync the journal directory (when fsync is on)."""
        if self.fsync:
            os.fsync(self.dir_fd)

    def _sync_path(self, path: Path) -> None:
        if not self.fsync:
            return
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _sync_fd(self, fd: int) -> float | None:
        if not self.fsync:
            return None
        t0 = time.perf_counter()
        os.fdatasync(fd)
        return time.perf_counter() - t0

    @staticmethod
    def _write_all(fd: int, data: bytes | bytearray, offset: int) -> None:
        view = memoryview(data)
        try:
            while view:
                n = os.pwrite(fd, view, offset)
                view = view[n:]
                offset += n
        finally:
            view.release()
