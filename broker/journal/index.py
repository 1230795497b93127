"""Which segment holds the live copy of every message: the journal's bookkeeping.

Loop side only, and only for durable ops: replay (recovery) and the writer
apply a group here once it is on disk, in file order, so the index always
equals what a recovery would compute. Compaction reads it to decide which
segments can go.

Names: a segment is known by its *segment number* (`segno`); a message by
(`qid`, `mid`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from twinmq.broker.journal.ops import JournalOp, StoredMessage

__all__ = ["LiveIndex", "SegmentInfo"]


class SegmentInfo:
    """What compaction needs to know about one segment file."""

    __slots__ = ("damaged", "live", "path", "referrers", "refs", "segno", "size")

    def __init__(self, segno: int, path: Path, size: int, *, damaged: bool = False) -> None:
        self.segno = segno
        self.path = path
        self.size = size
        self.live = 0  # messages recorded here and not yet settled
        # Settles recorded here for messages that live in older segments, by that
        # segment: deleting this one must first carry these forward while the
        # target still exists, or recovery would resurrect those messages.
        self.refs: dict[int, list[tuple[int, int]]] = {}
        self.referrers: set[int] = set()  # newer segments whose refs point here
        # Corrupt: once empty it is moved to quarantine, never unlinked.
        self.damaged = damaged


class LiveIndex:
    """Segments on disk and, per (qid, mid), the segment holding the live copy."""

    def __init__(self) -> None:
        self.segments: dict[int, SegmentInfo] = {}
        self.head: SegmentInfo | None = None  # the segment being appended to
        # Live messages: qid -> mid -> segno of the segment holding the live copy.
        self.where: dict[int, dict[int, int]] = {}
        self.live_total = 0
        # The queue incarnations the saved definitions hold: only their ops count, as
        # recovery drops every other's. None while recovery replays (it keeps every
        # queue's messages until it knows the definitions). Not a set of the deleted
        # ones: qids are never reused, and that set grew with every queue ever deleted.
        self.defined: set[int] | None = None
        self.compact_due = False

    def add_segment(self, seg: SegmentInfo) -> None:
        """Register a segment file (replayed, or just created)."""
        self.segments[seg.segno] = seg

    def install_head(self, seg: SegmentInfo) -> None:
        """`seg` is the new head; the old one is sealed."""
        old = self.head
        self.head = seg
        self.segments[seg.segno] = seg
        if old is not None and old.live == 0:
            self.compact_due = True

    def enqueue(self, qid: int, mid: int, segno: int) -> None:
        """A message recorded in segment `segno`."""
        where = self.where.get(qid)
        if where is None:
            defined = self.defined
            if defined is not None and qid not in defined:
                return  # its queue went (routed before the delete, written after)
            where = self.where[qid] = {}
        old = where.pop(mid, None)
        if old is not None:
            # A re-enqueue of a live (qid, mid) supersedes the old copy exactly as
            # a settle of it would, including the carry-forward duty.
            self._unlive(old)
            if old != segno:
                self._add_ref(segno, old, qid, mid)
        where[mid] = segno
        self.segments[segno].live += 1
        self.live_total += 1

    def settle(self, qid: int, mid: int, segno: int, target: int = 0) -> bool:
        """Apply a settle recorded in segment `segno`; a carried one only hits `target`."""
        where = self.where.get(qid)
        if where is None:
            return False
        old = where.get(mid)
        if old is None or (target and old != target):
            return False  # unknown: compacted, never persisted, or superseded
        del where[mid]
        self._unlive(old)
        if old != segno:
            self._add_ref(segno, old, qid, mid)
        return True

    def define(self, qids: Iterable[int]) -> None:
        """Queue incarnations the saved definitions now hold."""
        if self.defined is not None:
            self.defined.update(qids)

    def drop(self, qid: int) -> None:
        """A queue incarnation is gone: its messages count as settled."""
        if self.defined is not None:
            self.defined.discard(qid)
        where = self.where.pop(qid, None)
        if not where:
            return
        for segno in where.values():
            self._unlive(segno)

    def apply(self, groups: Sequence[Sequence[JournalOp]], segno: int) -> None:
        """Groups just made durable in segment `segno`."""
        # The usual op, a first enqueue of a message, inline and counted once: a
        # replicated chunk brings thousands, and a call each was a tenth of its cost.
        where_of, seg = self.where, self.segments[segno]
        fresh = 0
        for ops in groups:
            for op in ops:
                qid, mid = op.qid, op.mid
                if type(op) is StoredMessage:
                    where = where_of.get(qid)
                    # A queue with an entry in `where` is defined (`drop` removes it).
                    if where is not None and mid not in where:
                        where[mid] = segno
                        fresh += 1
                        continue
                if fresh:  # counted before anything that may uncount
                    seg.live += fresh
                    self.live_total += fresh
                    fresh = 0
                if type(op) is StoredMessage:
                    self.enqueue(qid, mid, segno)
                else:
                    self.settle(qid, mid, segno)
        seg.live += fresh
        self.live_total += fresh

    def live_in(self, segno: int) -> list[tuple[int, int]]:
        """(qid, mid) of the live messages whose copy is in segment `segno`."""
        return [
            (qid, mid)
            for qid, where in self.where.items()
            for mid, holder in where.items()
            if holder == segno
        ]

    def _unlive(self, segno: int) -> None:
        seg = self.segments[segno]
        seg.live -= 1
        self.live_total -= 1
        if seg.live == 0 and seg is not self.head:
            self.compact_due = True

    def _add_ref(self, segno: int, target: int, qid: int, mid: int) -> None:
        seg = self.segments[segno]
        refs = seg.refs.get(target)
        if refs is None:
            refs = seg.refs[target] = []
            self.segments[target].referrers.add(segno)
        refs.append((qid, mid))
