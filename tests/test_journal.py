"""Tests for the crash-safe journal (`twinmq.broker.journal`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
from disks import small_tmpfs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinmq.broker.definitions import Definitions, DefinitionsDelta, QueueDef
from twinmq.broker.journal import (
    DiskFullError,
    Journal,
    JournalError,
    JournalOp,
    Recovered,
    Settle,
    StoredMessage,
    compaction,
    ops,
    segment,
)
from twinmq.broker.journal import index as live_index
from twinmq.broker.journal.index import LiveIndex

# --- helpers ------------------------------------------------------------------------


def defs(*qids: int) -> Definitions:
    """Definitions holding one durable queue per qid."""
    return Definitions(
        queues=[QueueDef(name=f"q{q}", qid=q) for q in qids],
        next_qid=max(qids, default=0) + 1,
    )


def msg(mid: int, qid: int = 1, size: int = 100, expires_at: float | None = None) -> StoredMessage:
    return StoredMessage(
        mid=mid,
        qid=qid,
        exchange="amq.direct",
        routing_key=f"key.{mid}",
        header=b"\x80\x00" + mid.to_bytes(4, "little"),
        body=bytes([mid % 251]) * size,
        expires_at=expires_at,
    )


def segment_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


def records(path: Path) -> list[tuple[int, int, list[ops.DecodedOp]]]:
    """(start, end, ops) of every record in a well-formed segment file."""
    data = path.read_bytes()
    pos = segment.HEADER.size
    out = []
    while pos < len(data):
        length, _ = segment.REC.unpack_from(data, pos)
        end = pos + segment.REC.size + length
        out.append((pos, end, ops.decode_group(data, pos + segment.REC.size, end)))
        pos = end
    return out


def reopen(directory: Path, **kwargs: object) -> Recovered:
    """Open the journal, return what it recovered, close it again."""

    async def go() -> Recovered:
        j = Journal(directory, fsync=False, **kwargs)  # type: ignore[arg-type]
        rec = j.open()
        await j.close()
        return rec

    return asyncio.run(go())


def mids(rec: Recovered) -> dict[int, list[int]]:
    return {qid: [m.mid for m in ms] for qid, ms in rec.messages.items()}


async def publish(j: Journal, *ops: JournalOp) -> int:
    lsn = j.append(list(ops))
    await j.sync(lsn)
    return lsn


# --- basics -------------------------------------------------------------------------


def test_roundtrip_preserves_every_field_and_order(tmp_path: Path) -> None:
    odd = StoredMessage(7, 2, "", "é/日本", b"", b"", 1234.5)

    async def go() -> None:
        j = Journal(tmp_path)
        rec = j.open()
        assert rec.messages == {} and rec.next_mid == 0 and rec.torn_bytes == 0
        j.save_definitions(defs(1, 2))
        await publish(j, msg(1), msg(2, size=10_000))
        await publish(j, odd, msg(9, qid=1))
        await j.close()

    asyncio.run(go())
    rec = reopen(tmp_path)
    assert rec.definitions == defs(1, 2)
    assert rec.messages == {1: [msg(1), msg(2, size=10_000), msg(9)], 2: [odd]}
    assert rec.next_mid == 10
    assert rec.records == 2 and rec.torn_bytes == 0 and rec.corrupt_bytes == 0


def test_settled_and_unknown_settles(tmp_path: Path) -> None:
    async def go() -> None:
        j = Journal(tmp_path, fsync=False)
        j.open()
        j.save_definitions(defs(1))
        await publish(j, msg(1), msg(2), msg(3))
        # 99 was never persisted, (2, 1) is another queue: both are ignored.
        await publish(j, Settle(1, 2), Settle(1, 99), Settle(2, 1))
        assert j.stats.live_messages == 2
        await j.close()

    asyncio.run(go())
    rec = reopen(tmp_path)
    assert mids(rec) == {1: [1, 3]}
    assert rec.next_mid == 100  # settles count as "seen" too


def test_expired_messages_are_returned_with_expiry(tmp_path: Path) -> None:
    past = time.time() - 3600

    async def go() -> None:
        j = Journal(tmp_path, fsync=False)
        j.open()
        j.save_definitions(defs(1))
        await publish(j, msg(1, expires_at=past), msg(2, expires_at=None))
        await j.close()

    asyncio.run(go())
    rec = reopen(tmp_path)
    assert [(m.mid, m.expires_at) for m in rec.messages[1]] == [(1, past), (2, None)]


def test_bad_op_leaves_buffer_intact_and_misuse_errors(tmp_path: Path) -> None:
    async def go() -> None:
        j = Journal(tmp_path, fsync=False)
        with pytest.raises(JournalError):
            j.append([msg(1)])  # not open yet
        j.open()
        j.save_definitions(defs(1))
        lsn = j.append([msg(1)])
        with pytest.raises(TypeError):
            j.append([msg(2), "nope"])  # type: ignore[list-item]
        with pytest.raises(ValueError):
            j.append([StoredMessage(3, 1, "x" * 70_000, "", b"", b"", None)])
        assert j.append([]) == lsn
        with pytest.raises(ValueError):
            await j.sync(lsn + 1)
        await j.sync(lsn)
        await j.sync(0)
        await j.close()

    asyncio.run(go())
    assert mids(reopen(tmp_path)) == {1: [1]}


def test_ops_added_by_more_share_the_record_and_see_its_encoding(tmp_path: Path) -> None:
    """`append(more=)`: the callback sees the ops' encoding (the bytes recorded for them),
    its ops land in the same record after them; if it raises, nothing of the group is
    written and the journal goes on."""
    seen: list[bytes] = []

    def more(encoded: memoryview) -> list[JournalOp]:
        seen.append(bytes(encoded))  # a copy: the view is valid during the call only
        return [msg(50, qid=2, size=len(encoded))]

    def refuse(encoded: memoryview) -> list[JournalOp]:
        raise ValueError("no")

    async def go() -> None:
        j = Journal(tmp_path, fsync=False)
        j.open()
        j.save_definitions(defs(1, 2))
        await publish(j, msg(1))
        await j.sync(j.append([msg(2), msg(3), Settle(1, 1)], more=more))
        appended = j.stats.appended_lsn
        with pytest.raises(ValueError):
            j.append([msg(4)], more=refuse)
        assert j.stats.appended_lsn == appended
        await publish(j, msg(5))
        await j.close()

    asyncio.run(go())
    expected = bytearray()
    ops.encode_ops([msg(2), msg(3), Settle(1, 1)], expected)
    assert seen == [bytes(expected)]
    [_, (_, _, group), _] = records(segment_files(tmp_path)[0])
    assert [(tag, qid, mid) for tag, qid, mid, _, _ in group] == [
        (ops.TAG_MSG, 1, 2), (ops.TAG_MSG, 1, 3), (ops.TAG_SETTLE, 1, 1), (ops.TAG_MSG, 2, 50)
    ]  # fmt: skip
    assert mids(reopen(tmp_path)) == {1: [2, 3, 5], 2: [50]}


def test_directory_is_locked(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.open()
    with pytest.raises(JournalError, match="in use"):
        Journal(tmp_path).open()
    asyncio.run(j.close())
    reopen(tmp_path)


def test_definitions_saved_atomically_and_required_for_messages(tmp_path: Path) -> None:
    async def go() -> None:
        j = Journal(tmp_path, fsync=False)
        j.open()
        j.save_definitions(defs(1))
        j.save_definitions(defs(1, 5))
        await publish(j, msg(1))
        await j.close()

    asyncio.run(go())
    assert not (tmp_path / "definitions.json.tmp").exists()
    assert reopen(tmp_path).definitions == defs(1, 5)
    # Losing the definitions file must not silently drop every message.
    (tmp_path / "definitions.json").unlink()
    with pytest.raises(JournalError, match="refusing"):
        reopen(tmp_path)
    (tmp_path / "definitions.json").write_text("{not json")
    with pytest.raises(JournalError, match="cannot read"):
        reopen(tmp_path)


# --- atomicity and torn tails -------------------------------------------------------


def test_torn_tail_at_every_byte_of_the_last_record(tmp_path: Path) -> None:
    src = tmp_path / "src"

    async def build() -> tuple[int, int]:
        j = Journal(src, fsync=False)
        j.open()
        j.save_definitions(defs(1, 2))
        await publish(j, msg(1))
        await publish(j, msg(2))
        (seg,) = segment_files(src)
        start = seg.stat().st_size
        # One transaction: two publishes and an ack. All of it, or none of it.
        await publish(j, msg(3, size=10), msg(4, qid=2, size=10), Settle(1, 1))
        end = seg.stat().st_size
        await j.close()
        return start, end

    start, end = asyncio.run(build())
    (seg,) = segment_files(src)
    assert seg.stat().st_size == end
    for cut in range(start, end + 1):
        work = tmp_path / f"cut{cut}"
        shutil.copytree(src, work)
        target = work / seg.name
        os.truncate(target, cut)
        rec = reopen(work)
        if cut == end:
            assert rec.messages == {1: [msg(2), msg(3, size=10)], 2: [msg(4, qid=2, size=10)]}
            assert rec.torn_bytes == 0
        else:
            assert mids(rec) == {1: [1, 2]}, cut
            assert rec.torn_bytes == cut - start
            assert target.stat().st_size == start  # the torn bytes are gone for good
            if cut % 7 == 0:
                assert reopen(work).torn_bytes == 0
        shutil.rmtree(work)


def test_torn_segment_header_is_removed(tmp_path: Path) -> None:
    async def go() -> None:
        j = Journal(tmp_path, fsync=False)
        j.open()
        j.save_definitions(defs(1))
        await publish(j, msg(1))
        await j.close()

    asyncio.run(go())
    # A crash while creating the next segment leaves part of a header behind.
    (tmp_path / segment.segment_name(99)).write_bytes(segment.encode_header(99, 5)[:10])
    rec = reopen(tmp_path)
    assert mids(rec) == {1: [1]} and rec.torn_bytes == 10
    assert not (tmp_path / segment.segment_name(99)).exists()


def _build_segments(directory: Path, count: int) -> None:
    """One message per record, small segments: several full segments plus a head."""

    async def go() -> None:
        j = Journal(directory, segment_bytes=1024, fsync=False)
        j.open()
        j.save_definitions(defs(1))
        for mid in range(1, count + 1):
            await publish(j, msg(mid, size=200))
        await j.close()

    asyncio.run(go())


# Corruption (a bad header or record that is not a torn tail): tests/test_journal_corruption.py.


def test_undecodable_record_with_a_good_checksum_refuses_to_open(tmp_path: Path) -> None:
    _build_segments(tmp_path, 1)
    last = segment_files(tmp_path)[-1]
    with last.open("ab") as f:
        f.write(segment.frame(b"\x09unknown op"))
    size = last.stat().st_size
    with pytest.raises(JournalError, match="undecodable"):
        reopen(tmp_path)
    assert last.stat().st_size == size  # not truncated: it may be a newer format


# --- compaction ---------------------------------------------------------------------


def test_compaction_deletes_settled_segments(tmp_path: Path) -> None:
    async def go() -> None:
        j = Journal(tmp_path, segment_bytes=4096, fsync=False)
        j.open()
        j.save_definitions(defs(1))
        for mid in range(200):
            await publish(j, msg(mid, size=300))
        assert j.stats.segments > 10
        for mid in range(0, 200, 10):
            await publish(j, *(Settle(1, m) for m in range(mid, mid + 10)))
        await j.flush()
        assert j.stats.live_messages == 0
        assert j.stats.segments <= 2
        await j.close()

    asyncio.run(go())
    assert len(segment_files(tmp_path)) <= 2
    rec = reopen(tmp_path)
    assert rec.messages == {} and rec.next_mid == 200


def test_compaction_carries_settles_so_nothing_resurrects(tmp_path: Path) -> None:
    """Segment B settles messages of the older segment A, which stays (one message
    in it is still live). Deleting B as-is would bring those messages back."""

    async def go() -> None:
        j = Journal(tmp_path, segment_bytes=1024, fsync=False)
        j.open()
        j.save_definitions(defs(1))
        a = segment_files(tmp_path)[0]
        for mid in range(1, 5):  # A: 1 (stays live), 2, 3, 4
            await publish(j, msg(mid, size=200))
        await publish(j, msg(5, size=200))  # rolls over to B
        b = segment_files(tmp_path)[-1]
        assert b != a
        assert [op[2] for _, _, ops in records(a) for op in ops] == [1, 2, 3, 4]
        await publish(j, Settle(1, 2), Settle(1, 3), Settle(1, 4), Settle(1, 5))
        await publish(j, msg(6, size=900))  # fills B
        await publish(j, msg(7))  # rolls over to C: B is no longer the head
        await publish(j, Settle(1, 6))
        await j.flush()
        assert a.exists() and not b.exists()
        await j.close()
        head = segment_files(tmp_path)[-1]
        carried = [op for _, _, group in records(head) for op in group if op[0] == ops.TAG_CARRIED]
        assert sorted((op[1], op[2], op[4]) for op in carried) == [
            (1, 2, 1),
            (1, 3, 1),
            (1, 4, 1),
        ]

    asyncio.run(go())
    assert mids(reopen(tmp_path)) == {1: [1, 7]}


def test_dropped_queue_compacts_and_redeclared_queue_gets_a_new_qid(tmp_path: Path) -> None:
    async def go() -> None:
        j = Journal(tmp_path, segment_bytes=2048, fsync=False)
        j.open()
        j.save_definitions(defs(1, 2))
        for mid in range(40):
            await publish(j, msg(mid, qid=1 if mid % 2 else 2, size=300))
        before = j.stats.segments
        # Delete queue 2 ("orders") and declare it again: new incarnation, qid 3.
        j.save_definitions(defs(1))
        j.drop_queue(2)  # idempotent with what save_definitions already did
        redeclared = [QueueDef(name="q1", qid=1), QueueDef(name="q2", qid=3)]
        j.save_definitions(Definitions(queues=redeclared))
        await publish(j, msg(100, qid=3))
        await publish(j, *(Settle(1, m) for m in range(1, 40, 2)))
        await j.flush()
        assert j.stats.live_messages == 1
        assert j.stats.segments < before
        await j.close()

    asyncio.run(go())
    rec = reopen(tmp_path)
    assert mids(rec) == {3: [100]}


def test_deleted_queues_leave_nothing_behind(tmp_path: Path) -> None:
    """Queue churn: a durable queue declared and deleted leaves nothing in the journal's
    bookkeeping (it kept every deleted qid for the life of the process: found by the
    connection core's fuzzer, its memory growing with its inputs), and a message routed
    to it before its delete but appended after (the commit path saves the topology
    first, then the batch) is garbage at once, as recovery counts it."""
    churn = 3000

    async def go() -> int:
        j = Journal(tmp_path, segment_bytes=4096, fsync=False)
        j.open()
        j.save_definitions(defs(1))
        await publish(j, msg(0))
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            for qid in range(2, churn + 2):
                queue = QueueDef(name="churn", qid=qid)
                j.save_delta(DefinitionsDelta(add_queues=[queue], next_qid=qid + 1))
                j.save_delta(DefinitionsDelta(del_queues=["churn"]))
                await publish(j, msg(qid, qid=qid, size=300))  # the late message
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        assert j.stats.live_messages == 1
        await j.flush()
        assert j.stats.segments <= 2  # the late messages' segments compacted
        await j.close()
        only_index = [tracemalloc.Filter(True, live_index.__file__)]
        grown = after.filter_traces(only_index).compare_to(
            before.filter_traces(only_index), "filename"
        )
        return sum(stat.size_diff for stat in grown)

    grown = asyncio.run(go())
    # A few KiB of tables at most; a qid kept per deleted queue is ~50 bytes each.
    assert grown < 10 * churn, f"the index grew {grown} bytes over {churn} deleted queues"
    assert mids(reopen(tmp_path)) == {1: [0]}


def test_queue_missing_from_definitions_is_dropped_at_open(tmp_path: Path) -> None:
    async def go() -> None:
        j = Journal(tmp_path, fsync=False)
        j.open()
        j.save_definitions(defs(1, 2))
        await publish(j, msg(1, qid=1), msg(2, qid=2))
        await j.close()

    asyncio.run(go())
    # The broker crashed after saving the definitions without queue 2 (as an older
    # version wrote them: a snapshot alone, no definitions log).
    (tmp_path / "definitions.json").write_text(defs(1).model_dump_json())
    (tmp_path / "definitions.log").unlink()
    assert mids(reopen(tmp_path)) == {1: [1]}
    assert mids(reopen(tmp_path)) == {1: [1]}


# A random walk over enqueue / settle / transaction / re-enqueue / queue delete /
# reopen / crash, checked against a plain dict after every reopen. Walks need some
# length before a settle lands in a later segment that empties while its message's
# segment stays (the carry-forward case); test_walks_reach_the_hard_cases checks
# that they do.
_settle = st.tuples(st.just("settle"), st.integers(0, 10_000), st.integers(1, 6))
_actions = st.lists(
    st.one_of(
        st.tuples(st.just("pub"), st.integers(0, 2), st.integers(1, 4)),
        _settle,
        _settle,
        st.tuples(st.just("txn"), st.integers(0, 2), st.integers(0, 10_000)),
        st.tuples(st.just("reenqueue"), st.integers(0, 10_000), st.just(0)),
        st.tuples(st.just("drop"), st.integers(0, 2), st.just(0)),
        st.tuples(st.sampled_from(["reopen", "crash", "flush"]), st.just(0), st.just(0)),
    ),
    min_size=10,
    max_size=150,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions=_actions, sizes=st.lists(st.integers(0, 400), min_size=1, max_size=8))
def test_compaction_never_resurrects_or_loses_property(
    actions: list[tuple[str, int, int]], sizes: list[int]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_walk(Path(tmp), actions, sizes))


async def _walk(directory: Path, actions: list[tuple[str, int, int]], sizes: list[int]) -> None:
    queues = [1, 2, 3]
    model: dict[int, dict[int, StoredMessage]] = {q: {} for q in queues}
    settled: list[StoredMessage] = []
    next_mid = 1
    next_qid = 4

    def definitions() -> Definitions:
        return Definitions(queues=[QueueDef(name=f"q{i}", qid=q) for i, q in enumerate(queues)])

    def new(qid: int) -> StoredMessage:
        nonlocal next_mid
        next_mid += 1
        return msg(next_mid, qid, size=sizes[next_mid % len(sizes)])

    def live() -> list[StoredMessage]:
        return [m for q in queues for m in model[q].values()]

    def check(rec: Recovered) -> None:
        expect = {q: list(ms.values()) for q, ms in model.items() if ms}
        assert rec.messages == expect
        assert all(rec.next_mid > m.mid for m in settled + live())
        assert rec.definitions == definitions()

    j = Journal(directory, segment_bytes=1024, fsync=False)
    j.open()
    j.save_definitions(definitions())
    for action, a, b in actions:
        ops: list[JournalOp] = []
        if action == "pub":
            ops = [new(queues[a]) for _ in range(b)]
        elif action in ("settle", "txn") and live():
            pool = live()
            picks = [pool[(a + i) % len(pool)] for i in range(b if action == "settle" else 1)]
            ops = [Settle(m.qid, m.mid) for m in dict.fromkeys(picks)]
            if action == "txn":
                ops.append(new(queues[b % 3]))
        elif action == "reenqueue" and settled:
            old = settled[a % len(settled)]
            if old.qid in queues and old.mid not in model[old.qid]:
                ops = [old]  # the same (qid, mid) enqueued again after it was settled
        elif action == "drop":
            old_qid, queues[a] = queues[a], next_qid
            next_qid += 1
            settled.extend(model.pop(old_qid).values())
            model[queues[a]] = {}
            j.save_definitions(definitions())
        elif action == "flush":
            await j.flush()
        elif action in ("reopen", "crash"):
            if action == "crash":
                j._simulate_crash()
            else:
                await j.close()
            j = Journal(directory, segment_bytes=1024, fsync=False)
            check(j.open())
        if ops:
            await publish(j, *ops)
            for op in ops:
                if isinstance(op, StoredMessage):
                    model[op.qid].pop(op.mid, None)
                    model[op.qid][op.mid] = op
                else:
                    settled.append(model[op.qid].pop(op.mid))
    # Settle everything: compaction must leave nothing but the head segment.
    if live():
        await publish(j, *(Settle(m.qid, m.mid) for m in live()))
        for q in queues:
            model[q] = {}
    await j.flush()
    assert j.stats.live_messages == 0
    assert j.stats.segments == 1
    await j.close()
    j = Journal(directory, segment_bytes=1024, fsync=False)
    check(j.open())
    await j.close()


def test_walks_reach_the_hard_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeded walks: carried settles and superseded copies must actually happen."""
    import random

    seen = {"carried": 0, "superseded": 0}
    finish, enqueue = compaction.finish, LiveIndex.enqueue

    def counting_finish(index: LiveIndex, plan: compaction.CompactionPlan, *args: int) -> None:
        seen["carried"] += sum(len(v) for v in plan.carry.values())
        finish(index, plan, *args)  # type: ignore[arg-type]

    def counting_enqueue(self: LiveIndex, qid: int, mid: int, segno: int) -> None:
        # On replay, a re-enqueue whose earlier settle was carried past it.
        seen["superseded"] += mid in self.where.get(qid, {})
        enqueue(self, qid, mid, segno)

    monkeypatch.setattr(compaction, "finish", counting_finish)
    monkeypatch.setattr(LiveIndex, "enqueue", counting_enqueue)
    kinds = ["pub", "pub", "settle", "settle", "txn", "reenqueue", "drop", "reopen", "crash"]
    rnd = random.Random(7)
    for _ in range(12):
        walk = [
            (
                k,
                rnd.randint(0, 2) if k in ("pub", "drop", "txn") else rnd.randint(0, 9999),
                rnd.randint(1, 4),
            )
            for k in (rnd.choice(kinds) for _ in range(80))
        ]
        with tempfile.TemporaryDirectory() as tmp:
            asyncio.run(_walk(Path(tmp), walk, [rnd.randint(0, 400) for _ in range(5)]))
    assert seen["carried"] > 0 and seen["superseded"] > 0, seen


# --- group commit -------------------------------------------------------------------


def test_group_commit_shares_fsyncs(tmp_path: Path) -> None:
    fsyncs: list[float] = []

    async def go() -> None:
        j = Journal(tmp_path, on_fsync=fsyncs.append)
        j.open()
        j.save_definitions(defs(1))
        fsyncs.clear()  # creating the head segment fsyncs once

        async def publisher(first: int) -> None:
            for mid in range(first, first + 5):
                await publish(j, msg(mid, size=1024))

        await asyncio.gather(*(publisher(i * 5) for i in range(200)))
        assert j.stats.durable_lsn == 1000
        assert len(fsyncs) < 100, len(fsyncs)  # 1000 confirms, far fewer fsyncs
        assert all(s >= 0 for s in fsyncs)
        await j.close()

    asyncio.run(go())
    assert sum(len(v) for v in mids(reopen(tmp_path)).values()) == 1000


def test_cancelled_waiter_does_not_stop_the_write(tmp_path: Path) -> None:
    async def go() -> None:
        j = Journal(tmp_path, fsync=False)
        j.open()
        j.save_definitions(defs(1))
        lsn = j.append([msg(1)])
        waiter = asyncio.ensure_future(j.sync(lsn))
        await asyncio.sleep(0)
        waiter.cancel()
        await j.sync(lsn)
        await j.close()

    asyncio.run(go())
    assert mids(reopen(tmp_path)) == {1: [1]}


# --- disk full ----------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs of the test's own (needs root; skipped where mounting is refused)."""
    with small_tmpfs(tmp_path / "mnt", "2m") as mount:
        yield mount


def _fill(path: Path) -> None:
    with path.open("wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)


def test_disk_full_rolls_back_and_recovers(small_disk: Path) -> None:
    directory = small_disk / "journal"
    confirmed: list[int] = []

    async def go() -> None:
        j = Journal(directory, segment_bytes=8192)
        j.open()
        j.save_definitions(defs(1))
        mid = 0
        for _ in range(30):
            mid += 1
            await publish(j, msg(mid, size=1024))
            confirmed.append(mid)
        _fill(small_disk / "filler")
        failed_lsn = 0
        for _ in range(200):
            mid += 1
            lsn = j.append([msg(mid, size=1024)])
            try:
                await j.sync(lsn)
            except DiskFullError:
                failed_lsn = lsn
                break
            confirmed.append(mid)  # fitted in a page tmpfs had already given us
        assert failed_lsn, "the disk never filled up"
        assert j.stats.disk_full
        with pytest.raises(DiskFullError):
            await j.sync(failed_lsn)  # a late waiter hears about it too
        # Several concurrent publishers fail together, nothing half-written stays.
        lsns = [j.append([msg(mid + i, size=1024)]) for i in range(1, 6)]
        mid += 5
        results = await asyncio.gather(*(j.sync(x) for x in lsns), return_exceptions=True)
        assert all(isinstance(r, DiskFullError) for r in results)

        (small_disk / "filler").unlink()  # space is back
        for _ in range(30):
            mid += 1
            await publish(j, msg(mid, size=1024))
            confirmed.append(mid)
        assert not j.stats.disk_full
        await j.close()

    asyncio.run(go())
    rec = reopen(directory)
    assert mids(rec) == {1: confirmed}
    assert rec.torn_bytes == 0 and rec.corrupt_bytes == 0


# --- kill -9 ------------------------------------------------------------------------

_CHILD = r"""
import asyncio, sys
from pathlib import Path
from twinmq.broker.definitions import Definitions, QueueDef
from twinmq.broker.journal import Journal, Settle, StoredMessage

async def main() -> None:
    j = Journal(Path(sys.argv[1]), segment_bytes=128 * 1024)
    rec = j.open()
    j.save_definitions(Definitions(queues=[QueueDef(name="q", qid=1)], next_qid=2))
    state = {"mid": rec.next_mid}
    out = sys.stdout

    async def publisher() -> None:
        while True:
            mid = state["mid"]
            state["mid"] += 1
            await j.sync(j.append([StoredMessage(mid, 1, "", "q", b"", b"x" * 1024, None)]))
            out.write(f"P {mid}\n")
            out.flush()
            if mid % 2 == 0:
                await j.sync(j.append([Settle(1, mid)]))
                out.write(f"S {mid}\n")
                out.flush()

    out.write("ready\n")
    out.flush()
    await asyncio.gather(*(publisher() for _ in range(16)))

asyncio.run(main())
"""


def _kill_cycle(directory: Path, lines: int) -> tuple[set[int], set[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(directory)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        assert proc.stdout.readline() == "ready\n"
        for _ in range(lines):
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
        proc.send_signal(signal.SIGKILL)  # mid-stream: appends and fsyncs in flight
        proc.wait(timeout=30)
        rest = "".join(seen) + proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    published: set[int] = set()
    settled: set[int] = set()
    for line in rest.split("\n")[:-1]:  # a last line without "\n" may be cut
        kind, mid = line.split()
        (published if kind == "P" else settled).add(int(mid))
    return published, settled


def _kill_cycles(directory: Path, cycles: int, lines: int) -> None:
    """SIGKILL a publishing child `cycles` times; after each, check what recovery finds."""
    confirmed: set[int] = set()
    settled: set[int] = set()
    for _ in range(cycles):
        published, acked = _kill_cycle(directory, lines)
        confirmed |= published
        settled |= acked
        rec = reopen(directory)
        recovered = {m.mid for m in rec.messages.get(1, [])}
        # Every confirmed message the child never tried to ack is there (an even mid
        # may be gone: its ack can be on disk without having been confirmed).
        assert {m for m in confirmed if m % 2} <= recovered
        assert not recovered & settled  # no confirmed ack is undone
        assert rec.next_mid > max(confirmed)
        assert rec.corrupt_bytes == 0
    assert len(confirmed) >= cycles * lines // 2


def test_kill_9_loses_nothing_confirmed(tmp_path: Path) -> None:
    _kill_cycles(tmp_path, cycles=3, lines=2000)


@pytest.mark.slow
def test_kill_9_many_cycles(tmp_path: Path) -> None:
    _kill_cycles(tmp_path, cycles=20, lines=5000)


# --- the format is what the module docstring says -----------------------------------


def test_record_framing_matches_the_documented_layout(tmp_path: Path) -> None:
    async def go() -> None:
        j = Journal(tmp_path, fsync=False)
        j.open()
        j.save_definitions(defs(1))
        await publish(j, Settle(1, 2))
        await j.close()

    asyncio.run(go())
    (seg,) = segment_files(tmp_path)
    data = seg.read_bytes()
    assert data[:4] == b"TMQJ"
    length, crc = struct.unpack_from("<II", data, 32)
    payload = data[40 : 40 + length]
    assert payload == struct.pack("<BQQ", 2, 1, 2)
    import zlib

    assert crc == zlib.crc32(data[32:36] + payload)
