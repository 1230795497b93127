"""A seed sent as a delta: only what the mirror lacks crosses the link (sans-I/O).

A seed (docs/mirror.md, "Re-seed and orphans") is journaled in the source's
replication queue whole: SNAPSHOT events saying "in queue `qid`, ids lo..hi, the
source holds exactly these messages". A mirror that already holds most of them
(the old source reversed after a forced failover: it mirrored them before the
disaster; the mirror keeps the source's queue and message ids) needs only the
difference. So at the link's handshake, before any event, the two ends compare
what the seed's snapshot events not yet applied hold with what the mirror holds,
by ranges of message ids (a range-based set reconciliation):

    source -> RECONCILE ReconcileRequest: per range, the count and digest of its ids
                        (a range of at most LEAF ids lists them)
    mirror -> RECONCILE ReconcileReply: per range, the same or not; for a listed
                        range, which ids it lacks and whether it holds others there

A range that differs is split in FANOUT parts at the source's ids and asked again,
down to LEAF ids: a few round trips (log_FANOUT of a snapshot event's 4,096 ids),
bytes in proportion to the differences, not to what both hold. The link then sends
each snapshot event as a DELTA event (`events.py`) of the same seq: the messages the
mirror lacks, and the leaf ranges where it holds others with the source's ids there
(the mirror orphans the rest, as a full SNAPSHOT would make it). A range both hold
alike costs a few bytes.

Nothing of this is journaled: each session compares again from the mirror's mark
(a restart of either end in the middle compares what is left against what the
mirror holds then), and the events keep their seqs, so the mirror's mark and its
idempotent apply are unchanged. The mirror answers from its queues as they are
when the request arrives, before any event of the session; the end state is the
full seed's (same messages, same orphans), except where a client of the mirror (a
replica: it may consume) settles a message between the comparison and the apply
(its copy is settled, as any replica consumer's is).
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol

from pydantic import BaseModel, Field

from twinmq.broker.journal import JournalOp
from twinmq.broker.mirror.events import (
    KIND_DEFINITIONS,
    KIND_SEED,
    KIND_SNAPSHOT,
    SnapshotFix,
    SnapshotRange,
    encode_delta_event,
    event_created,
    snapshot_of,
)
from twinmq.broker.queue import Queue

# A range of at most LEAF ids is listed, not split; one that differs is asked again as
# FANOUT parts: a difference costs ~2 KiB of comparison in 3 round trips below a
# snapshot event's 4,096 ids (16 and 16: ~3 KiB in 2).
LEAF: Final = 32
FANOUT: Final = 8
# A mirror that answers RECONCILE announces this CHALLENGE version (older ones: 2).
RECONCILE_VERSION: Final = 3


def wire(model: BaseModel) -> bytes:
    """A RECONCILE frame's payload: the model's JSON without its defaults (most answers
    are `{"same":true,"count":n}`)."""
    return model.model_dump_json(exclude_defaults=True).encode()


def digest(mids: Sequence[int]) -> str:
    """The digest of a sorted run of message ids (both ends compute it alike)."""
    return hashlib.blake2b(struct.pack(f"<{len(mids)}Q", *mids), digest_size=8).hexdigest()


class RangeProbe(BaseModel):
    """What the source's seed holds in queue `qid`, ids lo..hi."""

    qid: int
    lo: int
    hi: int
    count: int
    digest: str = Field(max_length=16)
    mids: list[int] | None = None  # listed when count <= LEAF


class ReconcileRequest(BaseModel):
    """The source's question (a RECONCILE frame's payload)."""

    probes: list[RangeProbe]
    # The source's applied marks per origin it mirrored (its listener's): the old source
    # counts its events the promoted site never applied (the RPO, as a count).
    marks: dict[str, int] = Field(default_factory=dict)


class RangeAnswer(BaseModel):
    """The mirror's answer about one probe."""

    same: bool
    count: int  # the mirror's messages in the range
    lacking: list[int] = Field(default_factory=list)  # listed probe: its ids the mirror lacks
    extra: bool = False  # listed probe: the mirror holds ids there the source does not


class ReconcileReply(BaseModel):
    """The mirror's answer (a RECONCILE frame's payload), one per probe, in order."""

    answers: list[RangeAnswer]


# -- the mirror's end ---------------------------------------------------------------------


class Holdings(Protocol):
    """The virtual host as the mirror answers from it."""

    def queue_by_qid(self, qid: int) -> Queue | None:
        """The queue of an incarnation id."""
        ...


def held_mids(queue: Queue) -> list[int]:
    """Every message id `queue` holds (ready, delivered, held aside), sorted."""
    mids = [e.message.mid for e in queue.entries]
    mids += queue.delivered
    mids += queue.held_aside
    mids.sort()
    return mids


def answer(vhost: Holdings, request: ReconcileRequest) -> ReconcileReply:
    """Compare each probe with what this mirror holds now."""
    held: dict[int, list[int]] = {}
    answers: list[RangeAnswer] = []
    for probe in request.probes:
        mids = held.get(probe.qid)
        if mids is None:
            queue = vhost.queue_by_qid(probe.qid)
            mids = held[probe.qid] = held_mids(queue) if queue is not None else []
        mine = mids[bisect.bisect_left(mids, probe.lo) : bisect.bisect_right(mids, probe.hi)]
        if len(mine) == probe.count and digest(mine) == probe.digest:
            answers.append(RangeAnswer(same=True, count=len(mine)))
        elif probe.mids is not None:
            have = set(mine)
            lacking = [mid for mid in probe.mids if mid not in have]
            extra = len(mine) > len(probe.mids) - len(lacking)
            answers.append(RangeAnswer(same=False, count=len(mine), lacking=lacking, extra=extra))
        else:
            answers.append(RangeAnswer(same=False, count=len(mine)))
    return ReconcileReply(answers=answers)


# -- the source's end ---------------------------------------------------------------------


@dataclass(slots=True)
class Chunk:
    """One snapshot event of the seed, not yet applied by the mirror."""

    seq: int
    body: bytes
    covered: SnapshotRange
    mids: list[int]  # sorted (a snapshot event's messages are in id order)
    fixes: list[SnapshotFix] = field(default_factory=list)
    send: set[int] = field(default_factory=set)  # ids the mirror lacks


@dataclass(slots=True)
class _Probe:
    chunk: Chunk
    lo: int
    hi: int
    mids: list[int]


def pending_snapshots(events: Iterable[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    """The seed's snapshot events among `events` (the queue after the mirror's mark):
    those before the first event that is not part of a seed (an OPS event changes the
    mirror between the comparison and the snapshot's apply: never compared past it)."""
    found: list[tuple[int, bytes]] = []
    for seq, body in events:
        kind = body[0] if body else 0
        if kind in (KIND_SEED, KIND_DEFINITIONS):
            continue
        if kind != KIND_SNAPSHOT:
            break
        found.append((seq, body))
    return found


def chunk_of(seq: int, body: bytes) -> Chunk:
    """A snapshot event, to compare."""
    found = snapshot_of(body)
    assert found is not None
    covered, ops = found
    return Chunk(seq, body, covered, sorted(op.mid for op in ops))


class Reconciler:
    """The source's side of one comparison: the next request, what the answers say."""

    def __init__(self, chunks: list[Chunk], marks: dict[str, int] | None = None) -> None:
        self.chunks = chunks
        self.marks = marks or {}
        self._probes = [_Probe(c, c.covered.lo, c.covered.hi, c.mids) for c in chunks]
        self.rounds = 0

    def request(self) -> ReconcileRequest | None:
        """The next question (None: the comparison is complete)."""
        if not self._probes:
            return None
        probes = [
            RangeProbe(
                qid=p.chunk.covered.qid, lo=p.lo, hi=p.hi, count=len(p.mids), digest=digest(p.mids),
                mids=p.mids if len(p.mids) <= LEAF else None,
            )
            for p in self._probes
        ]  # fmt: skip
        marks, self.marks = self.marks, {}  # said once
        return ReconcileRequest(probes=probes, marks=marks)

    def answered(self, reply: ReconcileReply) -> None:
        """Take the mirror's answers to the last request."""
        if len(reply.answers) != len(self._probes):
            raise ValueError(
                f"{len(reply.answers)} answers to {len(self._probes)} probes in a RECONCILE"
            )
        self.rounds += 1
        following: list[_Probe] = []
        for probe, said in zip(self._probes, reply.answers, strict=True):
            chunk = probe.chunk
            if said.same:
                continue
            if said.count == 0:
                chunk.send.update(probe.mids)  # it holds nothing there: all of it, no orphan
            elif len(probe.mids) <= LEAF:
                lacking = set(said.lacking) & set(probe.mids)
                chunk.send |= lacking
                keep = tuple(probe.mids) if said.extra else None
                if keep is not None or lacking:
                    chunk.fixes.append(SnapshotFix(probe.lo, probe.hi, keep))
            else:
                following += _split(probe)
        self._probes = following

    def bodies(self) -> dict[int, bytes]:
        """Each compared snapshot event as its DELTA event, by seq."""
        out: dict[int, bytes] = {}
        for chunk in self.chunks:
            body = chunk.body
            ops: list[JournalOp] = []
            if chunk.send:
                found = snapshot_of(body)
                assert found is not None
                ops = [op for op in found[1] if op.mid in chunk.send]
            fixes = sorted(chunk.fixes, key=lambda f: f.lo)
            out[chunk.seq] = encode_delta_event(chunk.covered, fixes, ops, event_created(body))
        return out

    def skipped(self) -> int:
        """Messages of the compared snapshot events the mirror holds already (not sent)."""
        return sum(len(c.mids) - len(c.send) for c in self.chunks)


def _split(probe: _Probe) -> list[_Probe]:
    """A range that differs as FANOUT parts, cut at the source's ids (each part from its
    first id up to the next part's; the first and last keep the range's ends)."""
    mids = probe.mids
    size = -(-len(mids) // FANOUT)
    parts: list[_Probe] = []
    for start in range(0, len(mids), size):
        lo = probe.lo if start == 0 else mids[start]
        end = start + size
        hi = probe.hi if end >= len(mids) else mids[end] - 1
        parts.append(_Probe(probe.chunk, lo, hi, mids[start:end]))
    return parts
