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

A source holding only the mirror token may send anything, so a RECONCILE is bounded
(`refusal`: its bytes, its probes, each probe's range and ids, the ids of the whole
frame, its marks) and refused as a protocol error beyond that; within the bounds it is
answered in slices of work (`answering` yields between them: the mirror's loop serves
its clients meanwhile). The legitimate source cuts its requests to those bounds
(`Reconciler.request`). The marks of the first request, on an old source fenced by a
forced failover, are checked against what that source made and verified against the
probes of the comparison (`LossClaim`) before any of its backlog is dropped.
"""

from __future__ import annotations

import bisect
import hashlib
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Final, Protocol

from pydantic import BaseModel, Field

from twinmq.broker.journal import JournalOp, StoredMessage
from twinmq.broker.mirror.events import (
    KIND_DEFINITIONS,
    KIND_SEED,
    KIND_SNAPSHOT,
    TOP_MID,
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
# What one RECONCILE may ask (a source cuts its requests to these; a mirror refuses a
# frame beyond them): its bytes (1,024 listed probes of 20-digit ids are ~800 KB), its
# probes, a probe's ids (a snapshot event's at most: source.SNAPSHOT_EVENT_OPS), the ids
# of all its probes, the origins of its marks.
MAX_RECONCILE_BYTES: Final = 1 << 20
MAX_PROBES: Final = 1024
MAX_PROBE_IDS: Final = 4096
MAX_FRAME_IDS: Final = 1 << 20
MAX_MARKS: Final = 64
# Units of work (ids read, compared or digested) the mirror does between two turns of
# its loop while it answers: a few milliseconds.
SLICE: Final = 16_384


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


def refusal(payload: bytes) -> tuple[ReconcileRequest | None, str | None]:
    """A RECONCILE frame's request, or why it is refused (beyond the bounds above or not
    a request a source makes: a range upside down, ids listed out of it or out of order,
    a count its range cannot hold)."""
    if len(payload) > MAX_RECONCILE_BYTES:
        return None, f"a RECONCILE of {len(payload)} bytes (at most {MAX_RECONCILE_BYTES})"
    try:
        request = ReconcileRequest.model_validate_json(payload)
    except ValueError as exc:
        return None, f"a malformed RECONCILE: {str(exc).splitlines()[0]}"
    if len(request.probes) > MAX_PROBES:
        return None, f"a RECONCILE of {len(request.probes)} probes (at most {MAX_PROBES})"
    if len(request.marks) > MAX_MARKS:
        return None, f"a RECONCILE with {len(request.marks)} marks (at most {MAX_MARKS})"
    total = 0
    for n, probe in enumerate(request.probes):
        why = _probe_refusal(probe)
        if why is not None:
            return None, f"RECONCILE probe {n}: {why}"
        total += probe.count
    if total > MAX_FRAME_IDS:
        return None, f"a RECONCILE asking about {total} ids (at most {MAX_FRAME_IDS})"
    return request, None


def _probe_refusal(probe: RangeProbe) -> str | None:
    if not 0 <= probe.lo <= probe.hi <= TOP_MID or probe.qid < 0:
        return f"range {probe.lo}..{probe.hi} of queue {probe.qid}"
    if not 0 <= probe.count <= min(MAX_PROBE_IDS, probe.hi - probe.lo + 1):
        return f"{probe.count} ids in {probe.lo}..{probe.hi} (at most {MAX_PROBE_IDS})"
    mids = probe.mids
    if mids is None:
        return None
    if len(mids) != probe.count or len(mids) > LEAF:
        return f"{len(mids)} ids listed for a count of {probe.count} (at most {LEAF})"
    if mids and not (probe.lo <= mids[0] and mids[-1] <= probe.hi):
        return f"ids listed outside {probe.lo}..{probe.hi}"
    if any(a >= b for a, b in pairwise(mids)):
        return "ids listed out of order"
    return None


def answering(
    vhost: Holdings,
    request: ReconcileRequest,
    held: dict[int, list[int]] | None = None,
    claim: LossClaim | None = None,
) -> Iterator[RangeAnswer | None]:
    """Compare each probe with what this mirror holds now: its answers in order, and a
    None after each `SLICE` units of work (the caller gives its loop a turn there).
    `held`: each queue's sorted ids, read once per session (kept by the caller); `claim`:
    what the probes prove the source holds of a backlog the mirror must verify."""
    if held is None:
        held = {}
    work = 0
    for probe in request.probes:
        mids = held.get(probe.qid)
        if mids is None:
            queue = vhost.queue_by_qid(probe.qid)
            if queue is None:
                mids = []
            else:
                # One cut of the queue (copied at C speed), its ids read in slices.
                entries = list(queue.entries)
                mids = [*queue.delivered, *queue.held_aside]
                for start in range(0, len(entries), SLICE):
                    mids += [e.message.mid for e in entries[start : start + SLICE]]
                    yield None
                mids.sort()
                yield None
            held[probe.qid] = mids
        i = bisect.bisect_left(mids, probe.lo)
        j = bisect.bisect_right(mids, probe.hi, i)
        n = j - i
        work += 8 + (n if n == probe.count else 0) + (len(probe.mids) if probe.mids else 0)
        if n == probe.count and digest(mids[i:j]) == probe.digest:
            said = RangeAnswer(same=True, count=n)
            if claim is not None:
                claim.held_alike(probe.qid, mids[i:j])
        elif probe.mids is not None:
            lacking = [m for m in probe.mids if not _holds(mids, i, j, m)]
            extra = n > len(probe.mids) - len(lacking)
            said = RangeAnswer(same=False, count=n, lacking=lacking, extra=extra)
            if claim is not None:
                claim.listed(probe.qid, probe.mids)
        else:
            said = RangeAnswer(same=False, count=n)
        yield said
        if work >= SLICE:
            work = 0
            yield None


def _holds(mids: list[int], i: int, j: int, mid: int) -> bool:
    """Whether `mid` is among the sorted `mids[i:j]` (no copy of the slice)."""
    k = bisect.bisect_left(mids, mid, i, j)
    return k < j and mids[k] == mid


def answer(vhost: Holdings, request: ReconcileRequest) -> ReconcileReply:
    """Compare each probe with what this mirror holds now (in one go)."""
    return ReconcileReply(answers=[a for a in answering(vhost, request) if a is not None])


class LossClaim:
    """An old source's check of the mark the site that fenced it sends (its applied mark
    of this origin): the events up to it are those that site claims it applied. Each
    message they enqueued and did not settle is verified held there only if a probe of
    the comparison shows it (a range held alike, or listed); an event with a message not
    shown stays in the backlog (counted), never dropped on that site's word."""

    def __init__(self, mark: int, claimed: Iterable[tuple[int, Sequence[JournalOp]]]) -> None:
        self.mark = mark
        self.seqs: list[int] = []  # the claimed events, in order
        self._wanted: dict[int, dict[int, int]] = {}  # qid -> mid -> the event's seq
        for seq, ops in claimed:
            self.seqs.append(seq)
            for op in ops:
                if type(op) is StoredMessage:
                    self._wanted.setdefault(op.qid, {})[op.mid] = seq
                else:
                    self._wanted.get(op.qid, {}).pop(op.mid, None)  # settled there too
        self._sorted = {qid: sorted(m) for qid, m in self._wanted.items() if m}

    def held_alike(self, qid: int, mine: Sequence[int]) -> None:
        """A range where the source holds exactly `mine` (this mirror's ids there)."""
        wanted = self._wanted.get(qid)
        if not wanted or not mine:
            return
        order = self._sorted[qid]
        lo = bisect.bisect_left(order, mine[0])
        hi = bisect.bisect_right(order, mine[-1], lo)
        for mid in order[lo:hi]:
            k = bisect.bisect_left(mine, mid)
            if k < len(mine) and mine[k] == mid:
                wanted.pop(mid, None)

    def listed(self, qid: int, theirs: Sequence[int]) -> None:
        """A range where the source listed the ids it holds."""
        wanted = self._wanted.get(qid)
        if wanted:
            for mid in theirs:
                wanted.pop(mid, None)

    def unverified(self) -> tuple[set[int], int]:
        """The claimed events with a message not shown held there, and those messages."""
        seqs: set[int] = set()
        messages = 0
        for wanted in self._wanted.values():
            seqs.update(wanted.values())
            messages += len(wanted)
        return seqs, messages


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
        self._asked: list[_Probe] = []
        self._following: list[_Probe] = []  # the next round's, once this one is asked
        self.rounds = 0  # round trips

    def request(self) -> ReconcileRequest | None:
        """The next question (None: the comparison is complete), within the bounds a
        mirror accepts in one frame (`MAX_PROBES`, `MAX_FRAME_IDS`)."""
        if not self._probes:
            self._probes, self._following = self._following, []
        if not self._probes:
            return None
        take = ids = 0
        for probe in self._probes[:MAX_PROBES]:
            if take and ids + len(probe.mids) > MAX_FRAME_IDS:
                break
            ids += len(probe.mids)
            take += 1
        self._asked, self._probes = self._probes[:take], self._probes[take:]
        probes = [
            RangeProbe(
                qid=p.chunk.covered.qid, lo=p.lo, hi=p.hi, count=len(p.mids), digest=digest(p.mids),
                mids=p.mids if len(p.mids) <= LEAF else None,
            )
            for p in self._asked
        ]  # fmt: skip
        marks, self.marks = self.marks, {}  # said once
        return ReconcileRequest(probes=probes, marks=marks)

    def answered(self, reply: ReconcileReply) -> None:
        """Take the mirror's answers to the last request."""
        if len(reply.answers) != len(self._asked):
            raise ValueError(
                f"{len(reply.answers)} answers to {len(self._asked)} probes in a RECONCILE"
            )
        self.rounds += 1
        for probe, said in zip(self._asked, reply.answers, strict=True):
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
                self._following += _split(probe)
        self._asked = []

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
