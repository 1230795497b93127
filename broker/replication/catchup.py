"""Catch-up: bring a (re)connected passive to the active's state, as a stream of chunks.

On every (re)connect the passive sends the replication IDs it holds per queue.
In one step of the event loop (no await in between) the active closes its open
batch, notes `boundary` (the next replication ID: everything enqueued from now
on travels in live batches) and takes references to each durable queue's
journaled entries (`capture`: a copy of the lists, not of the messages). From
then on, a slice at a time between live batches, `CatchupStream`:

1. plans one queue: what the passive lacks is queued to send, what it holds is
   kept, what it holds but the active's snapshot does not (dequeued meanwhile,
   or never confirmed before a failover) is discarded;
2. streams that queue in chunks of at most `chunk_bytes` / `chunk_messages`,
   each a `BATCH` frame (flag `BATCH_CATCHUP`) that the passive journals as its
   own record group and acknowledges with `CATCHUP_ACK`.

Live batches keep flowing meanwhile, and `filter_live` keeps both streams
consistent: a message settled live before its chunk went out is taken out of
the plan (and the settle is not forwarded: the passive never had it); one
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
from twinmq.broker.replication.protocol import BATCH_CATCHUP, BATCH_CATCHUP_LAST, encode_batch

log = logging.getLogger(__name__)

CHUNK_BYTES: Final = 1024 * 1024
CHUNK_MESSAGES: Final = 4096
PLAN_SLICE: Final = 8192  # entries planned per step (about a millisecond)
WINDOW: Final = 8  # chunks in flight, unacknowledged
YIELD_LIMIT: Final = 0.005  # seconds a step waits for the journal to go idle, at most
_SETTLE_SIZE: Final = 17  # bytes of an encoded settle


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
    """One chunk's ops, already in the journal's encoding (a BATCH frame's body)."""

    payload: bytearray
    messages: int = 0
    settles: int = 0

    @property
    def empty(self) -> bool:
        """No op at all (only ever the last chunk)."""
        return not (self.messages or self.settles)


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


class CatchupStream:
    """The plan and the chunks of one catch-up; no I/O, driven a step at a time."""

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
    ) -> None:
        self.boundary = boundary
        # False for a damaged active (journal corruption may have cost it messages):
        # the passive keeps what the active lacks, so catch-up never spreads a loss.
        self.discard = discard
        self.chunk_bytes = max(1, chunk_bytes)
        self.chunk_messages = max(1, chunk_messages)
        self.plan_slice = max(1, plan_slice)
        self.progress = CatchupProgress(candidates=sum(len(s) for s in sources.values()))
        self._sources = dict(sources)
        self._have_lists = have
        self._queue_exists = queue_exists
        self._order = list(self._sources)
        self._position = {qid: i for i, qid in enumerate(self._order)}
        self._index = 0  # the queue being planned or streamed
        # Per queue: settled live before planning reached them (never sent).
        self._settled: dict[int, set[int]] = {}
        # The current queue's plan.
        self._have: set[int] = set()
        self._have_pos = 0
        self._scan_pos = 0
        self._planned = False
        self._send: list[Entry] = []
        self._pending: set[int] = set()  # planned to send, not sent yet
        self._discard: list[int] = []
        self._send_pos = 0

    @property
    def finished(self) -> bool:
        """Every queue planned and streamed."""
        return self._index >= len(self._order)

    @property
    def _qid(self) -> int:
        return self._order[self._index]

    # -- the live stream ---------------------------------------------------------------

    def filter_live(self, ops: list[JournalOp]) -> list[JournalOp]:
        """The live batch as the passive must get it while this catch-up runs.

        Settles of messages this catch-up has not sent yet take them out of the
        plan; those the passive lacks (planned to send) are not forwarded.
        """
        if self.finished:
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
        if position == self._index:
            if mid in self._pending:
                self._pending.discard(mid)
                self.progress.skipped += 1
                return True
            if self._planned:
                return False  # kept (the passive has it) or sent already
        # Not planned yet: planning must skip it. The passive may hold it, so the settle
        # goes on (a settle of a message it lacks is a no-op there).
        self._settled.setdefault(qid, set()).add(mid)
        return False

    # -- planning and chunks -----------------------------------------------------------

    def step(self) -> Chunk | None:
        """One bounded piece of work: a planning slice (None) or the next chunk.

        A chunk may be empty only as the last one (`finished` is then True): an
        empty catch-up still ends with a chunk the passive acknowledges.
        """
        while not self.finished:
            if not self._queue_exists(self._qid):
                self._next_queue()  # deleted meanwhile: the topology drops it on the passive
                continue
            if not self._planned:
                self._plan_slice()
                return None
            chunk = self._fill()
            if self._send_pos >= len(self._send) and not self._discard:
                self._next_queue()
            if not chunk.empty:
                return chunk
        return Chunk(bytearray())

    def _plan_slice(self) -> None:
        qid = self._qid
        have_list = self._have_lists.get(qid, ())
        budget = self.plan_slice
        if self._have_pos < len(have_list):
            end = self._have_pos + budget
            self._have.update(have_list[self._have_pos : end])
            self._have_pos = end
            return
        entries = self._sources[qid]
        end = min(len(entries), self._scan_pos + budget)
        have, pending, send = self._have, self._pending, self._send
        settled = self._settled.get(qid, ())
        kept = 0
        for entry in entries[self._scan_pos : end]:
            if not entry.journaled:
                continue
            mid = entry.message.mid
            if mid in have:
                have.discard(mid)  # what is left at the end is what the passive must drop
                kept += 1
            elif mid in settled:
                self.progress.skipped += 1
            else:
                pending.add(mid)
                send.append(entry)
        self.progress.kept += kept
        self._scan_pos = end
        if end >= len(entries):
            self._discard = sorted(have) if self.discard else []
            self._have = set()
            self._settled.pop(qid, None)
            self._planned = True

    def _fill(self) -> Chunk:
        # Encoded straight from the queue's entries: a chunk is up to thousands of
        # messages, and building an op object for each only to encode it was most
        # of the active's work per chunk (its loop is held meanwhile).
        qid = self._qid
        buf = bytearray()
        settles = 0
        if self._discard:
            fit = max(1, min(self.chunk_messages, self.chunk_bytes // _SETTLE_SIZE))
            take = self._discard[:fit]
            del self._discard[: len(take)]
            for mid in take:
                encode_settle(buf, qid, mid)
            settles = len(take)
            self.progress.discarded += settles
        send, pending = self._send, self._pending
        pos, end = self._send_pos, len(send)
        limit_bytes, limit_ops = self.chunk_bytes, self.chunk_messages - settles
        messages = 0
        while pos < end and len(buf) < limit_bytes and messages < limit_ops:
            entry = send[pos]
            pos += 1
            m = entry.message
            mid = m.mid
            if mid not in pending:
                continue  # settled live before its turn
            pending.discard(mid)
            encode_message(
                buf, mid, qid, m.exchange, m.routing_key, m.header, m.body, entry.expires_at
            )
            messages += 1
        self._send_pos = pos
        self.progress.sent += messages
        return Chunk(buf, messages, settles)

    def _next_queue(self) -> None:
        self._index += 1
        self._have = set()
        self._have_pos = self._scan_pos = self._send_pos = 0
        self._planned = False
        self._send = []
        self._pending = set()
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
    ) -> None:
        self.stream = stream
        self.link = link
        self.committer = committer
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
                    self._write(chunk, stream.finished)
                if stream.finished:
                    return
                await asyncio.sleep(0)  # let live batches and confirms through
        except (ConnectionError, RuntimeError) as exc:
            # The link died under us; its reader notices and drops it.
            log.debug("catch-up stream stopped: %r", exc)

    def _write(self, chunk: Chunk, last: bool) -> None:
        self.sent_chunk += 1
        flags = BATCH_CATCHUP | (BATCH_CATCHUP_LAST if last else 0)
        frame = encode_batch(self.sent_chunk, flags, chunk.payload)
        if not self.link.write(frame):
            return
        progress = self.stream.progress
        progress.chunks += 1
        progress.bytes += len(frame)
        messages = chunk.messages
        self._in_flight.append((self.sent_chunk, messages))
        metrics.CATCHUP_BYTES.inc(len(frame))
        metrics.CATCHUP_MESSAGES.inc(messages)
        if last:
            self.last_chunk = self.sent_chunk
