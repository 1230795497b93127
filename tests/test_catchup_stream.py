"""The catch-up stream's plan and chunks, without sockets: a passive ends up equal to the active.

A model passive (per queue, the set of replication IDs it holds) applies the
chunks of a `CatchupStream` interleaved with live batches (settles, enqueues,
queue deletions) filtered by the stream, in random orders; at the end it must
hold exactly the active's journaled messages, having been sent nothing twice
and nothing it already had, in chunks no larger than asked.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from twinmq.broker.journal import JournalOp, Settle, StoredMessage, decode_ops, encode_ops
from twinmq.broker.message import Entry, Message
from twinmq.broker.replication.catchup import CatchupSender, CatchupStream
from twinmq.broker.replication.protocol import (
    BATCH_CATCHUP,
    FrameDecoder,
    FrameType,
    ProtocolError,
    Snapshot,
    decode_batch,
    decode_keys,
    encode_batch,
    encode_key,
)
from twinmq.testing.waiting import until

BODY = 100


def step(stream: CatchupStream) -> list[JournalOp] | None:
    """One step of `stream`: None (a planning slice) or the ops of the chunk it encoded."""
    chunk = stream.step()
    if chunk is None:
        return None
    ops = decode_ops(bytes(chunk.payload))
    assert (chunk.messages, chunk.settles) == (
        sum(1 for op in ops if type(op) is StoredMessage),
        sum(1 for op in ops if type(op) is Settle),
    )
    return ops


def encoded(ops: list[JournalOp]) -> bytearray:
    """The bytes of ops in a BATCH frame."""
    buf = bytearray()
    encode_ops(ops, buf)
    return buf


def entry(mid: int, journaled: bool = True) -> Entry:
    """A message of BODY bytes in a queue."""
    return Entry(Message(mid, "", "q", b"", b"x" * BODY, journaled, None, None), None, journaled)


class Model:
    """An active (live entries per queue) and a passive (IDs per queue) joined by a stream."""

    def __init__(self, rng: random.Random, queues: int, messages: int) -> None:
        self.rng = rng
        self.active: dict[int, list[Entry]] = {}
        self.passive: dict[int, set[int]] = {}
        mid = 1
        for qid in range(1, queues + 1):
            self.active[qid] = []
            for _ in range(rng.randrange(messages)):
                self.active[qid].append(entry(mid, journaled=rng.random() > 0.1))
                mid += 1
            # Delivered and requeued messages come first in a capture: out of ID order.
            front = [e for e in self.active[qid] if rng.random() < 0.2]
            self.active[qid] = front + [e for e in self.active[qid] if e not in front]
            journaled = [e.message.mid for e in self.active[qid] if e.journaled]
            # The passive holds some of them, and some the active no longer has.
            held = {m for m in journaled if rng.random() < 0.5}
            held |= {10_000 + qid * 100 + i for i in range(rng.randrange(4))}
            self.passive[qid] = held
        self.next_mid = mid
        self.had = {qid: set(held) for qid, held in self.passive.items()}
        self.received: list[int] = []
        self.chunks: list[list[JournalOp]] = []

    def apply(self, ops: list[JournalOp]) -> None:
        """The passive applies a batch (chunk or live) to the queues it has."""
        for op in ops:
            held = self.passive.get(op.qid)
            if held is None:
                continue
            if type(op) is StoredMessage:
                held.add(op.mid)
            else:
                held.discard(op.mid)

    def live(self, stream: CatchupStream, ops: list[JournalOp]) -> None:
        """A live batch, filtered by the stream, reaches the passive."""
        self.apply(stream.filter_live(ops))

    def settle_one(self, stream: CatchupStream) -> None:
        """A consumer acknowledges (or TTL drops) a random live message."""
        candidates = [q for q, entries in self.active.items() if entries]
        if not candidates:
            return
        qid = self.rng.choice(candidates)
        entries = self.active[qid]
        gone = entries.pop(self.rng.randrange(len(entries)))
        if gone.journaled:
            self.live(stream, [Settle(qid, gone.message.mid)])

    def enqueue_one(self, stream: CatchupStream) -> None:
        """A publish: a new message, streamed live."""
        if not self.active:
            return
        qid = self.rng.choice(list(self.active))
        new = entry(self.next_mid)
        self.next_mid += 1
        self.active[qid].append(new)
        m = new.message
        self.live(stream, [StoredMessage(m.mid, qid, "", "q", b"", m.body, None)])

    def delete_queue(self) -> None:
        """A queue deleted on the active; the topology drops it on the passive."""
        if self.active:
            qid = self.rng.choice(list(self.active))
            del self.active[qid]
            del self.passive[qid]

    def expected(self) -> dict[int, set[int]]:
        """What the passive must hold: the active's journaled messages."""
        return {q: {e.message.mid for e in es if e.journaled} for q, es in self.active.items()}


def run(rng: random.Random, chunk_messages: int, chunk_bytes: int) -> tuple[Model, CatchupStream]:
    model = Model(rng, queues=rng.randrange(1, 5), messages=40)
    stream = CatchupStream(
        {qid: list(entries) for qid, entries in model.active.items()},
        {qid: sorted(held) for qid, held in model.passive.items()},
        model.next_mid,
        queue_exists=lambda qid: qid in model.active,
        chunk_bytes=chunk_bytes,
        chunk_messages=chunk_messages,
        plan_slice=rng.randrange(1, 20),
    )
    while not stream.finished:
        action = rng.random()
        if action < 0.5:
            ops = step(stream)
            if ops is not None:
                model.chunks.append(ops)
                model.received += [op.mid for op in ops if type(op) is StoredMessage]
                model.apply(ops)
        elif action < 0.7:
            model.settle_one(stream)
        elif action < 0.9:
            model.enqueue_one(stream)
        elif action < 0.91:
            model.delete_queue()
    # After the catch-up, live batches go through unchanged.
    for _ in range(5):
        model.settle_one(stream)
        model.enqueue_one(stream)
    return model, stream


@settings(max_examples=150, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(1, 8), st.integers(1, 1000))
def test_passive_ends_equal_to_the_active_under_live_traffic(
    rng: random.Random, chunk_messages: int, chunk_bytes: int
) -> None:
    model, stream = run(rng, chunk_messages, chunk_bytes)
    assert model.passive == model.expected()
    assert len(model.received) == len(set(model.received)), "a message was sent twice"
    for qid, had in model.had.items():
        assert not had & set(model.received), f"queue {qid}: sent what the passive had"
    for ops in model.chunks:
        assert len(ops) <= chunk_messages
        # A chunk stops at the first message that reaches the byte bound.
        assert len(encoded(ops[:-1])) < chunk_bytes
    assert stream.progress.sent == len(model.received)


def test_an_empty_catch_up_is_one_empty_final_chunk() -> None:
    stream = CatchupStream({1: []}, {}, 1, queue_exists=lambda qid: True)
    while (ops := step(stream)) is None:
        pass
    assert ops == [] and stream.finished


def test_chunks_are_bounded_by_bytes_and_the_plan_keeps_and_discards() -> None:
    entries = [entry(mid) for mid in range(1, 101)]
    stream = CatchupStream(
        {7: entries},
        {7: [1, 2, 3, 500]},  # 1-3 kept, 500 discarded (the active does not have it)
        101,
        queue_exists=lambda qid: True,
        chunk_bytes=10 * BODY,
    )
    chunks: list[list[JournalOp]] = []
    while not stream.finished:
        ops = step(stream)
        if ops:
            chunks.append(ops)
    sent = [op.mid for ops in chunks for op in ops if type(op) is StoredMessage]
    assert sent == list(range(4, 101))
    # Discards come once the cursor has met all the active's entries: in the last chunk.
    assert [op for ops in chunks for op in ops if type(op) is Settle] == [Settle(7, 500)]
    assert chunks[-1][-1] == Settle(7, 500)
    for ops in chunks:  # the encoded chunk passes the bound by its last message at most
        assert len(encoded(ops[:-1])) < 10 * BODY <= len(encoded(ops)) or ops is chunks[-1]
    p = stream.progress
    assert (p.sent, p.kept, p.discarded, p.candidates) == (97, 3, 1, 100)


def test_a_message_settled_before_its_chunk_is_not_sent_nor_its_settle_forwarded() -> None:
    entries = [entry(mid) for mid in range(1, 11)]
    stream = CatchupStream({1: entries}, {}, 11, queue_exists=lambda qid: True, chunk_messages=2)
    while step(stream) is None:  # planned, first chunk (1, 2) out
        pass
    early = stream.filter_live([Settle(1, 2)])  # sent already: forwarded
    late = stream.filter_live([Settle(1, 9), StoredMessage(11, 1, "", "q", b"", b"", None)])
    assert early == [Settle(1, 2)]
    assert late == [StoredMessage(11, 1, "", "q", b"", b"", None)]
    sent: list[int] = []
    while not stream.finished:
        sent += [op.mid for op in step(stream) or []]
    assert 9 not in sent and stream.progress.skipped == 1


class CountingEntries(list[Entry]):
    """A queue's captured entries that count how many a step looks at."""

    looked = 0

    def __getitem__(self, index):  # type: ignore[no-untyped-def]
        self.looked += 1
        return super().__getitem__(index)


def test_a_step_looks_at_a_bounded_slice_when_the_passive_holds_everything() -> None:
    """A resumed catch-up of a queue the passive already holds sends nothing, a slice per step."""
    entries = CountingEntries(entry(mid) for mid in range(1, 50_001))
    stream = CatchupStream(
        {1: entries}, {1: range(1, 50_001)}, 50_001,
        queue_exists=lambda qid: True, plan_slice=1000, chunk_messages=100,
    )  # fmt: skip
    steps = 0
    while not stream.finished:
        before = entries.looked
        assert step(stream) in (None, [])
        assert entries.looked - before <= 1000
        steps += 1
    assert steps >= 100  # 50 slices of the passive's IDs, 50 of the entries
    p = stream.progress
    assert (p.sent, p.kept, p.discarded) == (0, 50_000, 0)


def test_a_packed_snapshot_decodes_any_slice_back_to_its_ids() -> None:
    rng = random.Random(7)
    for n in (0, 1, 2, 3, 5, 8, 100):
        ids = [rng.randrange(1 << 62) for _ in range(n)]
        snapshot = Snapshot.model_validate_json(Snapshot.of({3: ids}).model_dump_json())
        packed = snapshot.ids()[3]
        assert len(packed) == n
        assert all(packed[a:b] == ids[a:b] for a in range(n + 1) for b in range(a, n + 2))


def test_a_damaged_active_discards_nothing_from_its_passive() -> None:
    """Without discards (a damaged active) the passive keeps what the active lacks."""
    ops: dict[bool, list[JournalOp]] = {}
    for discard in (True, False):
        stream = CatchupStream(
            {1: [entry(1), entry(3)]}, {1: [1, 2, 4]}, 5,
            queue_exists=lambda qid: True, discard=discard,
        )  # fmt: skip
        ops[discard] = []
        while not stream.finished:
            ops[discard] += step(stream) or []
    assert [op for op in ops[True] if type(op) is Settle] == [Settle(1, 2), Settle(1, 4)]
    assert [op for op in ops[False] if type(op) is Settle] == []
    assert [op.mid for op in ops[False] if type(op) is StoredMessage] == [3]


class RecordingLink:
    """A `ChunkLink` that keeps each frame with the loop's time it was written, and
    acknowledges it at once (so only the rate cap can slow the sender)."""

    def __init__(self) -> None:
        self.writes: list[tuple[float, int]] = []
        self.sender: CatchupSender | None = None
        self.dropped = False

    @property
    def closed(self) -> bool:
        return self.dropped

    def close(self) -> None:
        self.dropped = True

    def write(self, data: bytes) -> bool:
        self.writes.append((asyncio.get_running_loop().time(), len(data)))
        assert self.sender is not None
        asyncio.get_running_loop().call_soon(self.sender.on_ack, len(self.writes))
        return True

    async def drain(self) -> None:
        return None


def test_a_rate_capped_catch_up_writes_no_byte_before_the_cap_allows_it() -> None:
    """`--catchup-max-rate`: every chunk after the first goes out no earlier than the
    bytes before it allow at the cap (the sender sleeps; a lower bound, not a timing
    guess)."""
    rate = 2_000_000  # bytes a second: 40 chunks of ~10 KB take ~0.2 s
    stream = CatchupStream(
        {1: [entry(mid) for mid in range(400)]},
        {},
        400,
        queue_exists=lambda qid: True,
        chunk_bytes=10 * BODY,
    )
    link = RecordingLink()
    sender = CatchupSender(stream, link, max_rate=rate)
    link.sender = sender

    async def run() -> None:
        sender.start()
        await until("every chunk acknowledged", lambda: sender.done or None, within=10)

    asyncio.run(run())
    assert len(link.writes) > 10
    first = link.writes[0][0]
    sent = 0
    for at, size in link.writes:
        assert at - first >= sent / rate, "a chunk went out faster than the cap"
        sent += size


@pytest.mark.parametrize("packed", ["AAAA", "AAAAAAAAAA==", "!!!!AAAAAAA="])
def test_a_snapshot_whose_packed_ids_do_not_decode_is_a_protocol_error(packed: str) -> None:
    """Found by fuzzing (`make fuzz`, replication_frames): a binascii error from the
    passive's snapshot escaped the catch-up task, which then died without closing the
    link. A shape that is not whole u64s is refused at once, bad characters when read."""
    snapshot = Snapshot(packed={1: packed})
    with pytest.raises(ProtocolError):
        list(snapshot.ids()[1])


def test_a_catch_up_stopped_by_a_malformed_snapshot_closes_the_link() -> None:
    """The passive attaches again with a fresh snapshot; the catch-up never hangs half done."""
    stream = CatchupStream(
        {1: [entry(mid) for mid in range(1, 4)]},
        Snapshot(packed={1: "!!!!AAAAAAA="}).ids(),
        4,
        queue_exists=lambda qid: True,
    )
    link = RecordingLink()
    sender = CatchupSender(stream, link)
    link.sender = sender

    async def run() -> None:
        sender.start()
        await until("the link closed", lambda: link.dropped or None, within=10)

    asyncio.run(run())
    assert not sender.done


def test_the_dedup_window_follows_every_message_and_discard_in_bounded_chunks() -> None:
    """The active's window comes last (a key never ahead of its message on the passive, and
    after the discards that forget keys), oldest first, whole, in chunks no larger than asked;
    the last one is the final chunk, and a key of any str (lone surrogates too) round-trips."""
    window = [f"\x00q\x00id-{i}" for i in range(25)] + ["ex\x00rk\x00\udcff-\u00e9"]
    stream = CatchupStream(
        {1: [entry(mid) for mid in range(1, 31)]}, {1: [1, 99]}, 31,
        queue_exists=lambda qid: True, chunk_messages=10, window=lambda: list(window),
    )  # fmt: skip
    kinds: list[str] = []
    keys: list[str] = []
    while not stream.finished:
        chunk = stream.step()
        if chunk is None:
            continue
        if chunk.frame is FrameType.DEDUP_KEYS:
            frame = encode_batch(1, BATCH_CATCHUP, chunk.payload, chunk.frame)
            ((ftype, payload),) = FrameDecoder().feed(frame)
            body = decode_batch(payload)[2]
            assert ftype is FrameType.DEDUP_KEYS and len(decode_keys(body)) == chunk.keys <= 10
            keys += decode_keys(body)
            kinds.append("keys")
        else:
            ops = decode_ops(bytes(chunk.payload))
            kinds.append("settle" if any(type(op) is Settle for op in ops) else "messages")
    assert keys == window and stream.progress.dedup_keys == len(window)
    assert kinds == ["messages"] * 2 + ["settle"] + ["keys"] * 3, kinds


def test_a_catch_up_without_a_window_or_keys_still_ends_with_one_final_chunk() -> None:
    for window in (None, list):
        stream = CatchupStream({1: [entry(1)]}, {}, 2, queue_exists=lambda qid: True,
                               window=window)  # fmt: skip
        chunks = []
        while not stream.finished:
            chunk = stream.step()
            if chunk is not None:
                chunks.append(chunk)
        assert [(c.frame, c.messages, c.keys) for c in chunks] == [(FrameType.BATCH, 1, 0)]


def test_a_malformed_keys_chunk_is_a_protocol_error_not_a_partial_window() -> None:
    buf = bytearray()
    encode_key(buf, "a\x00b\x00c")
    for bad in (bytes(buf[:-1]), bytes(buf) + b"\x00", b"\x00\x02\xff\xfe"):
        with pytest.raises(ProtocolError):
            decode_keys(bad)
