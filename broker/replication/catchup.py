"""Catch-up: bring a (re)connected passive to the active's state, as a stream of chunks.

On every (re)connect the passive sends the replication IDs it holds per queue.
In one step of the event loop (no await in between) the active closes its open
batch, notes `boundary` (the next replication ID: everything enqueued from now
on travels in live batches) and takes references to each durable queue's
journaled entries (`capture`: a copy of the lists, not of the messages). From
then on, a slice at a time between live batches, `CatchupStream`:

1. loads the passive's IDs of one queue, a slice per step;
2. walks that queue's captured entries with a cursor, a chunk per step (at most
   `chunk_bytes` / `chunk_messages`): what the passive holds is kept, the rest
   sent; at the end, what it holds but the active's capture does not (dequeued
   meanwhile, or never confirmed before a failover) is discarded. Each chunk is
   a `BATCH` frame (flag `BATCH_CATCHUP`) that the passive journals as its own
   record group and acknowledges with `CATCHUP_ACK`;
3. once every queue is done, sends the active's duplicate-detection window
   (`window`, its keys oldest first, taken in that step) in chunks of keys
   (`DEDUP_KEYS` frames, numbered and acknowledged as the other chunks): the
   ids of messages published *and consumed* while the passive was away, or
   discarded from it by this catch-up, reach it only so. Last, so that the
   passive admits a key only once it holds every message the active held
   (a key without its message would swallow a re-send), and after the
   discards that forgot the keys of messages the active no longer holds.

Live batches keep flowing meanwhile, and `filter_live` keeps both streams
consistent: a message settled live before the cursor reaches it is not sent
(and its settle is not forwarded when the passive surely lacks it); one
settled after its chunk went out is settled on the passive by the live batch
that follows the chunk on the link. A queue deleted meanwhile is skipped.

`CatchupSender` drives a stream over a link with flow control: at most
`window` chunks unacknowledged, and never more than the transport's write
buffer allows, so a slow passive makes the active wait, not buffer. Each chunk
is durable on the passive once acknowledged: a catch-up cut short resumes, as
the passive's next snapshot holds what it received and the next plan keeps it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from twinmq.broker import metrics
from twinmq.broker.journal import JournalOp, Settle, encode_message, encode_settle
from twinmq.broker.message import Entry
from twinmq.broker.queue import Queue
from twinmq.broker.replication.protocol import (
    BATCH_CATCHUP,
    BATCH_CATCHUP_LAST,
    FrameType,
    ProtocolError,
    encode_batch,
    encode_key,
)

log = logging.getLogger(__name__)

CHUNK_BYTES: Final = 1024 * 1024
CHUNK_MESSAGES: Final = 4096
PLAN_SLICE: Final = 8192  # IDs loaded or entries looked at per step (about a millisecond)
BUCKET_IDS: Final = 4096  # IDs per bucket of an `IdBuckets`, about
WINDOW: Final = 8  # chunks in flight, unacknowledged
YIELD_LIMIT: Final = 0.005  # seconds a step waits for the journal to go idle, at most


def capture(queues: Iterable[Queue]) -> dict[int, list[Entry]]:
    """The catch-up's view of the active: each durable queue's entries, delivered first.

    Only list copies of references, at C speed: the caller holds the event loop
    for this, and the messages are shared, not copied. Delivered (unacknowledged)
    messages are the oldest of a queue as a rule, so this order is mostly the
    replication ID order the passive keeps.
    """
    # Held-aside (quarantined) messages are live and kept: leaving them out would
    # make the passive discard them.
    return {
        q.definition.qid: [*q.delivered.values(), *q.held_aside.values(), *q.entries]
        for q in queues
        if q.durable
    }


@dataclass
class Chunk:
    """One chunk's ops, already in the journal's encoding (a BATCH frame's body), or
    dedup keys (`frame` DEDUP_KEYS)."""

    payload: bytearray
    messages: int = 0
    settles: int = 0
    keys: int = 0
    frame: FrameType = FrameType.BATCH

    @property
    def empty(self) -> bool:
        """No op or key at all (only ever the last chunk)."""
        return not (self.messages or self.settles or self.keys)


@dataclass
class CatchupProgress:
    """Counters of one catch-up (for `/status`, logs and tests)."""

    candidates: int = 0  # entries in the active's snapshot (journaled or not)
    sent: int = 0  # messages sent
    kept: int = 0  # messages the passive already had
    discarded: int = 0  # messages the passive held and the active did not
    skipped: int = 0  # settled on the active before their chunk went out
    bytes: int = 0  # bytes of chunk frames written
    chunks: int = 0
    dedup_keys: int = 0  # keys of the active's dedup window sent


class IdBuckets:
    """A set of replication IDs split into buckets of a few thousand, by `mid & mask`.

    A catch-up fills one a slice at a time between live batches: a single set of
    a million IDs rehashes all of them each time it doubles (20 ms and more in
    one step, the loop held), a bucket only its own few thousand.
    """

    __slots__ = ("_buckets", "_mask")

    def __init__(self, expected: int) -> None:
        count = 1
        while count * BUCKET_IDS < expected:
            count *= 2
        self._mask = count - 1
        self._buckets: list[set[int]] = [set() for _ in range(count)]

    def add(self, mid: int) -> None:
        """Add one ID."""
        self._buckets[mid & self._mask].add(mid)

    def update(self, mids: Iterable[int]) -> None:
        """Add `mids`."""
        buckets, mask = self._buckets, self._mask
        for mid in mids:
            buckets[mid & mask].add(mid)

    def __contains__(self, mid: int) -> bool:
        return mid in self._buckets[mid & self._mask]

    def take(self, mid: int) -> bool:
        """Remove `mid`; whether it was there."""
        bucket = self._buckets[mid & self._mask]
        if mid in bucket:
            bucket.remove(mid)
            return True
        return False

    def pop_bucket(self) -> list[int] | None:
        """Remove and return the IDs of one bucket, sorted; None once none is left."""
        return sorted(self._buckets.pop()) if self._buckets else None


class CatchupStream:
    """The plan and the chunks of one catch-up; no I/O, driven a step at a time.

    Per queue, the passive's IDs are first loaded (a slice per step) into
    `IdBuckets`; then a cursor walks the active's captured entries, a chunk per
    step: what the passive holds is kept, what was settled live meanwhile is
    skipped, the rest is sent; at the end of the queue what the passive holds
    and the active did not have is discarded. "Planned, not sent yet" is the
    part of the entries past the cursor: no set of every ID to send.
    """

    def __init__(
        self,
        sources: Mapping[int, Sequence[Entry]],
        have: Mapping[int, Sequence[int]],
        boundary: int,
        *,
        queue_exists: Callable[[int], bool],
        chunk_bytes: int = CHUNK_BYTES,
        chunk_messages: int = CHUNK_MESSAGES,
        plan_slice: int = PLAN_SLICE,
        discard: bool = True,
        window: Callable[[], list[str]] | None = None,
    ) -> None:
        self.boundary = boundary
        # False for a damaged active (journal corruption may have cost it messages):
        # the passive keeps what the active lacks, so catch-up never spreads a loss.
        self.discard = discard
        self.chunk_bytes = max(1, chunk_bytes)
        self.chunk_messages = max(1, chunk_messages)
        self.plan_slice = max(1, plan_slice)
        # Entries a chunk step looks at, at most (kept and skipped ones send nothing).
        self.scan_slice = max(self.plan_slice, self.chunk_messages)
        self.progress = CatchupProgress(candidates=sum(len(s) for s in sources.values()))
        self._sources = dict(sources)
        self._have_lists = have
        self._queue_exists = queue_exists
        self._order = list(self._sources)
        self._position = {qid: i for i, qid in enumerate(self._order)}
        self._index = 0  # the queue being planned or streamed
        # Per queue: settled live before the cursor passed them (never to be sent).
        self._settled: dict[int, IdBuckets] = {}
        # The current queue.
        self._have: IdBuckets | None = None  # the passive's IDs not met by the cursor yet
        self._have_pos = 0  # of the passive's list, loaded into `_have`
        self._loaded = False  # `_have` complete: the cursor may start
        self._cursor = 0  # entries before it were sent, kept or skipped
        self._passed_max = 0  # the highest ID before the cursor
        self._discard: list[int] = []  # discards of one bucket, in reverse order
        self._window = window  # the dedup window's keys, taken once the queues are done
        self._keys: list[str] | None = None
        self._key_pos = 0

    @property
    def _queues_done(self) -> bool:
        """Every queue planned and streamed."""
        return self._index >= len(self._order)

    @property
    def finished(self) -> bool:
        """Every queue planned and streamed, and the dedup window sent."""
        return self._queues_done and self._keys is not None and self._key_pos >= len(self._keys)

    @property
    def _qid(self) -> int:
        return self._order[self._index]

    # -- the live stream ---------------------------------------------------------------

    def filter_live(self, ops: list[JournalOp]) -> list[JournalOp]:
        """The live batch as the passive must get it while this catch-up runs.

        Settles of messages this catch-up has not sent yet take them out of the
        plan; those the passive surely lacks are not forwarded.
        """
        if self._queues_done:
            return ops
        out: list[JournalOp] | None = None
        for i, op in enumerate(ops):
            if type(op) is Settle and op.mid < self.boundary and self._settle(op.qid, op.mid):
                if out is None:
                    out = ops[:i]
                continue
            if out is not None:
                out.append(op)
        return ops if out is None else out

    def _settle(self, qid: int, mid: int) -> bool:
        """A live settle of (qid, mid); True if the passive lacks it and must not get it."""
        position = self._position.get(qid)
        if position is None or position < self._index:
            return False  # not in this catch-up, or streamed already
        settled = self._settled.get(qid)
        if settled is None:
            settled = self._settled[qid] = IdBuckets(len(self._sources[qid]))
        if position == self._index and self._loaded and mid > self._passed_max:
            # Past the cursor: not sent. The passive holds it if it is still in `_have`
            # (the cursor keeps it); else it lacks it and must not get it at all.
            if self._have is not None and mid in self._have:
                return False
            settled.add(mid)
            return True
        # Maybe passed already (sent or kept): forwarded, as the passive may hold it (a
        # settle of a message it lacks is a no-op there); the cursor skips it if not.
        settled.add(mid)
        return False

    # -- planning and chunks -----------------------------------------------------------

    def step(self) -> Chunk | None:
        """One bounded piece of work: a planning or scanning slice (None) or the next chunk.

        A chunk may be empty only as the last one (`finished` is then True): an
        empty catch-up still ends with a chunk the passive acknowledges.
        """
        while not self._queues_done:
            if not self._queue_exists(self._qid):
                self._next_queue()  # deleted meanwhile: the topology drops it on the passive
                continue
            if not self._loaded:
                self._load_slice()
                return None
            chunk, done = self._fill()
            if done:
                self._next_queue()
                if self._queues_done:
                    self._take_window()  # now: `finished` tells the last chunk
            if not chunk.empty:
                return chunk
            if not done:
                return None  # a slice of kept or skipped entries: nothing to send yet
        return self._window_chunk()

    def _take_window(self) -> None:
        # Taken once the queues are done, not at the capture: keys the active admitted
        # meanwhile are in it, in the active's order (the passive's own live ones too).
        self._keys = self._window() if self._window is not None else []

    def _window_chunk(self) -> Chunk:
        """The next chunk of the dedup window's keys (empty if there are none)."""
        if self._keys is None:
            self._take_window()  # no queue to stream, or the last one deleted
        assert self._keys is not None
        keys, pos = self._keys, self._key_pos
        stop = min(len(keys), pos + self.chunk_messages)
        buf = bytearray()
        while pos < stop and len(buf) < self.chunk_bytes:
            encode_key(buf, keys[pos])
            pos += 1
        count = pos - self._key_pos
        self._key_pos = pos
        self.progress.dedup_keys += count
        return Chunk(buf, keys=count, frame=FrameType.DEDUP_KEYS if count else FrameType.BATCH)

    def _load_slice(self) -> None:
        have_list = self._have_lists.get(self._qid, ())
        if self._have_pos >= len(have_list):
            self._loaded = True
            return
        if self._have is None:
            self._have = IdBuckets(len(have_list))
        end = self._have_pos + self.plan_slice
        self._have.update(have_list[self._have_pos : end])
        self._have_pos = end
        self._loaded = self._have_pos >= len(have_list)

    def _fill(self) -> tuple[Chunk, bool]:
        """The next chunk of the current queue, and whether the queue is done."""
        # Encoded straight from the queue's entries: a chunk is up to thousands of
        # messages, and building an op object for each only to encode it was most
        # of the active's work per chunk (its loop is held meanwhile).
        qid = self._qid
        buf = bytearray()
        entries = self._sources[qid]
        pos, end = self._cursor, len(entries)
        stop = min(end, pos + self.scan_slice)
        have = self._have
        settled = self._settled.get(qid)
        limit_bytes, limit_ops = self.chunk_bytes, self.chunk_messages
        passed_max = self._passed_max
        messages = kept = skipped = 0
        while pos < stop and len(buf) < limit_bytes and messages < limit_ops:
            entry = entries[pos]
            pos += 1
            if not entry.journaled:
                continue
            m = entry.message
            mid = m.mid
            if mid > passed_max:
                passed_max = mid
            if have is not None and have.take(mid):
                kept += 1  # what is left in `have` at the end is what the passive must drop
            elif settled is not None and mid in settled:
                skipped += 1  # settled live before its turn
            else:
                encode_message(
                    buf, mid, qid, m.exchange, m.routing_key, m.header, m.body, entry.expires_at
                )
                messages += 1
        self._cursor, self._passed_max = pos, passed_max
        progress = self.progress
        progress.sent += messages
        progress.kept += kept
        progress.skipped += skipped
        if pos < end:
            return Chunk(buf, messages), False
        # The queue's entries are done: then its discards, a bucket at a time.
        settles = 0
        if have is not None and self.discard:
            discard = self._discard
            while len(buf) < limit_bytes and messages + settles < limit_ops:
                if not discard:
                    more = have.pop_bucket()
                    if more is None:
                        break
                    discard += reversed(more)
                    continue
                encode_settle(buf, qid, discard.pop())
                settles += 1
            else:  # a bound reached: the next chunk goes on
                progress.discarded += settles
                return Chunk(buf, messages, settles), False
        progress.discarded += settles
        return Chunk(buf, messages, settles), True

    def _next_queue(self) -> None:
        self._settled.pop(self._qid, None)
        self._index += 1
        self._have = None
        self._have_pos = self._cursor = self._passed_max = 0
        self._loaded = False
        self._discard = []


class ChunkLink(Protocol):
    """What `CatchupSender` needs of a replication link."""

    @property
    def closed(self) -> bool:
        """The link is gone."""
        ...

    def write(self, data: bytes) -> bool:
        """Queue a frame; False once the link is gone."""
        ...

    def drain(self) -> Awaitable[None]:
        """Wait until the transport's write buffer is below its high-water mark."""
        ...

    def close(self) -> None:
        """Drop the link (the passive attaches again)."""
        ...


class Yielding(Protocol):
    """What `CatchupSender` needs of the group committer: confirms go first."""

    def idle(self, limit: float) -> Awaitable[None]:
        """Wait (at most `limit` seconds) until no batch waits for its sync."""
        ...


class CatchupSender:
    """Streams a `CatchupStream` over a link: bounded chunks, flow control, acknowledgements."""

    def __init__(
        self,
        stream: CatchupStream,
        link: ChunkLink,
        *,
        window: int = WINDOW,
        on_done: Callable[[], None] | None = None,
        committer: Yielding | None = None,
        max_rate: int = 0,
    ) -> None:
        self.stream = stream
        self.link = link
        self.committer = committer
        # Bytes per second at most (0: as fast as the link and the passive go). A cap
        # leaves CPU to the active's clients on a small machine, as pg_basebackup's
        # --max-rate and Kafka's replication throttle do.
        self.max_rate = max(0, max_rate)
        self.window = max(1, window)
        self.on_done = on_done
        self.sent_chunk = 0  # the newest chunk written
        self.acked_chunk = 0  # the newest chunk durable on the passive
        self.last_chunk: int | None = None  # the final chunk's number, once written
        self.acked_messages = 0  # messages in acknowledged chunks: durable on the passive
        self.done = False  # every chunk acknowledged
        self._in_flight: deque[tuple[int, int]] = deque()  # (chunk, messages) unacknowledged
        self._acked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def progress(self) -> CatchupProgress:
        """The stream's counters."""
        return self.stream.progress

    @property
    def unacked(self) -> bool:
        """Chunks written and not yet acknowledged."""
        return self.acked_chunk < self.sent_chunk

    def filter_live(self, ops: list[JournalOp]) -> list[JournalOp]:
        """See `CatchupStream.filter_live`."""
        return self.stream.filter_live(ops)

    def start(self) -> None:
        """Start streaming on the running loop."""
        metrics.CATCHUP_IN_PROGRESS.set(1)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="twinmq-catchup")

    def cancel(self) -> None:
        """Stop streaming (the link is gone)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if not self.done:
            metrics.CATCHUP_IN_PROGRESS.set(0)

    def on_ack(self, chunk: int) -> None:
        """The passive has every chunk up to `chunk` on its disk."""
        if chunk > self.acked_chunk:
            self.acked_chunk = min(chunk, self.sent_chunk)
            while self._in_flight and self._in_flight[0][0] <= self.acked_chunk:
                self.acked_messages += self._in_flight.popleft()[1]
            self._acked.set()
        if not self.done and self.last_chunk is not None and self.acked_chunk >= self.last_chunk:
            self.done = True
            metrics.CATCHUP_IN_PROGRESS.set(0)
            if self.on_done is not None:
                self.on_done()

    async def _run(self) -> None:
        stream, link = self.stream, self.link
        loop = asyncio.get_running_loop()
        paced_until = loop.time()  # when the bytes written so far are due, at max_rate
        try:
            while not link.closed:
                # Wait *before* building a chunk: once built, its messages count as sent,
                # so it must reach the link in this same step (a live settle of one of
                # them then follows it on the link).
                while self.sent_chunk - self.acked_chunk >= self.window and not link.closed:
                    self._acked.clear()
                    await self._acked.wait()
                await link.drain()
                if self.committer is not None:
                    # Confirms first: a step started while a batch syncs would hold the
                    # loop and the GIL when the sync completes.
                    await self.committer.idle(YIELD_LIMIT)
                if link.closed:
                    return
                chunk = stream.step()
                if chunk is not None and (not chunk.empty or stream.finished):
                    written = self._write(chunk, stream.finished)
                    if self.max_rate:
                        paced_until = max(paced_until, loop.time()) + written / self.max_rate
                if stream.finished:
                    return
                # Let live batches and confirms through (and keep to the rate cap).
                await asyncio.sleep(max(0.0, paced_until - loop.time()))
        except (ConnectionError, RuntimeError) as exc:
            # The link died under us; its reader notices and drops it.
            log.debug("catch-up stream stopped: %r", exc)
        except ProtocolError as exc:
            # The passive's snapshot (read lazily) was malformed: drop the link; it
            # attaches again with a new one. Never a silently dead catch-up.
            log.warning("catch-up stopped: %s: replication link closed", exc)
            self.link.close()

    def _write(self, chunk: Chunk, last: bool) -> int:
        """Write one chunk; the bytes written (0 if the link is gone)."""
        self.sent_chunk += 1
        flags = BATCH_CATCHUP | (BATCH_CATCHUP_LAST if last else 0)
        frame = encode_batch(self.sent_chunk, flags, chunk.payload, chunk.frame)
        if not self.link.write(frame):
            return 0
        progress = self.stream.progress
        progress.chunks += 1
        progress.bytes += len(frame)
        messages = chunk.messages
        self._in_flight.append((self.sent_chunk, messages))
        metrics.CATCHUP_BYTES.inc(len(frame))
        metrics.CATCHUP_MESSAGES.inc(messages)
        if last:
            self.last_chunk = self.sent_chunk
        return len(frame)
