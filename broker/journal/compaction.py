"""Compaction: which sealed segments can go, and what must be carried forward first.

A sealed segment whose messages are all settled is removed. Settles it holds
for messages in older segments still on disk are first re-appended ("carried")
to the head, targeted at the segment of the message they settle, so a removal
can never resurrect a message. Removals happen oldest first with a directory
fsync after each (`writer.SegmentFiles.compact` does the I/O).

A damaged segment (see `segment.py`) is removed the same way once its live
messages were re-appended to the head (recovery does that), except that it is
moved to the quarantine folder instead of being unlinked.

Known limit: a segment stays while any message in it is live (sparse segments
are not rewritten), so one long-lived message pins its whole segment.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from twinmq.broker.journal.index import LiveIndex

__all__ = ["CompactionPlan", "finish", "plan"]

log = logging.getLogger("twinmq.broker.journal")


@dataclass(slots=True)
class CompactionPlan:
    """Segments to remove and the settles to carry into the head before that."""

    remove: list[int]  # ascending: targets before the segments that settle them
    carry: dict[int, list[tuple[int, int]]]  # target segno -> (qid, mid) settles
    quarantine: frozenset[int] = frozenset()  # of `remove`: damaged, moved aside


def plan(index: LiveIndex, allow_carry: bool) -> CompactionPlan:
    """Which all-settled segments to remove, and which settles to carry first.

    Ascending order matters: a segment's refs point only at older segments,
    so when we reach it we already know which of its targets are going too
    (those need no carrying: their messages go with them).
    """
    head, defined = index.head, index.defined
    remove: list[int] = []
    gone: set[int] = set()
    carry: dict[int, list[tuple[int, int]]] = {}
    for segno in sorted(index.segments):
        seg = index.segments[segno]
        if seg is head or seg.live:
            continue
        needed = [t for t in seg.refs if t not in gone and t in index.segments]
        if needed and not allow_carry:
            continue
        for target in needed:
            # A deleted queue's settles need no carrying: recovery drops its messages.
            keep = [(q, m) for q, m in seg.refs[target] if defined is None or q in defined]
            if keep:
                carry.setdefault(target, []).extend(keep)
        remove.append(segno)
        gone.add(segno)
    damaged = frozenset(s for s in remove if index.segments[s].damaged)
    return CompactionPlan(remove, carry, damaged)


def finish(index: LiveIndex, done: CompactionPlan, carried: int, removed: list[int]) -> None:
    """Apply a compaction's outcome: `carried` bytes appended to the head, `removed` gone."""
    head = index.head
    assert head is not None
    if carried:
        head.size += carried
        for target, pairs in done.carry.items():
            if pairs:
                head.refs.setdefault(target, []).extend(pairs)
                index.segments[target].referrers.add(head.segno)
    for segno in removed:
        seg = index.segments.pop(segno)
        for target in seg.refs:
            other = index.segments.get(target)
            if other is not None:
                other.referrers.discard(segno)
        for referrer in seg.referrers:
            other = index.segments.get(referrer)
            if other is not None:
                other.refs.pop(segno, None)
    if removed:
        log.info("journal: compacted %d segments", len(removed))
    # A segment that could not be removed is retried at the next trigger, not in a
    # loop here.
