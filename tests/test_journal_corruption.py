"""Corruption is detected, refused loudly, never erased (`twinmq.broker.journal.recovery`).

Real segment files with a flipped bit: in a header or in a record followed by
valid records, in the last segment and in an earlier one. After each, every
record outside the damaged one is recovered, the damaged file sits in
quarantine/ byte for byte as it was, and the next open is clean. A torn tail
stays what it was: truncated, a warning.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from twinmq.broker.definitions import Definitions, QueueDef
from twinmq.broker.journal import Journal, JournalOp, Recovered, Settle, StoredMessage
from twinmq.broker.journal.ops import TAG_MSG, decode_group
from twinmq.broker.journal.recovery import MID_MARGIN, check
from twinmq.broker.journal.segment import HEADER, REC

COUNT = 24


def _defs() -> Definitions:
    return Definitions(queues=[QueueDef(name="q", qid=1)], next_qid=2)


def _msg(mid: int) -> StoredMessage:
    return StoredMessage(mid, 1, "", "q", b"\x80\x00", bytes([mid % 251]) * 200, None)


def _build(directory: Path, groups: list[list[JournalOp]]) -> None:
    """One record per group, 1 KiB segments (about four records each)."""

    async def go() -> None:
        j = Journal(directory, segment_bytes=1024, fsync=False)
        j.open()
        j.save_definitions(_defs())
        for ops in groups:
            await j.sync(j.append(ops))
        await j.close()

    asyncio.run(go())


def _build_messages(directory: Path, count: int = COUNT) -> None:
    _build(directory, [[_msg(mid)] for mid in range(1, count + 1)])


def _reopen(directory: Path) -> Recovered:
    async def go() -> Recovered:
        j = Journal(directory, fsync=False)
        rec = j.open()
        await j.close()
        return rec

    return asyncio.run(go())


def _segments(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.seg"))


def _records(path: Path) -> list[tuple[int, int, set[int]]]:
    """(start, end, mids of its messages) of every record of an intact segment."""
    data = path.read_bytes()
    pos, out = HEADER.size, []
    while pos < len(data):
        length, _ = REC.unpack_from(data, pos)
        end = pos + REC.size + length
        ops = decode_group(data, pos + REC.size, end)
        out.append((pos, end, {op[2] for op in ops if op[0] == TAG_MSG}))
        pos = end
    return out


def _flip(path: Path, offset: int, mask: int = 0x01) -> bytes:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))
    return bytes(data)


def _live(rec: Recovered) -> list[int]:
    return [m.mid for m in rec.messages.get(1, [])]


def _assert_quarantined(directory: Path, name: str, damaged: bytes, rec: Recovered) -> None:
    assert not (directory / name).exists()
    kept = directory / "quarantine" / name
    assert kept.read_bytes() == damaged, "the damaged file changed"
    assert rec.quarantined == [kept]


def _assert_next_open_is_clean(directory: Path, expected: list[int]) -> None:
    again = _reopen(directory)
    assert sorted(_live(again)) == expected
    assert again.corruption == [] and again.errors == [] and again.torn_bytes == 0


@pytest.mark.parametrize("which", ["last", "earlier"])
def test_flipped_bit_in_a_segment_header_keeps_every_record(tmp_path: Path, which: str) -> None:
    _build_messages(tmp_path)
    segs = _segments(tmp_path)
    assert len(segs) >= 4
    victim = segs[-1] if which == "last" else segs[1]
    assert _records(victim), "the victim holds records"
    damaged = _flip(victim, 12)  # inside the segment number

    rec = _reopen(tmp_path)

    assert sorted(_live(rec)) == list(range(1, COUNT + 1)), "a record behind the header was lost"
    assert [(c.segment, c.offset, c.reason) for c in rec.corruption] == [
        (victim.name, 0, "bad segment header")
    ]
    assert rec.errors and victim.name in rec.errors[0]
    assert rec.torn_bytes == 0
    _assert_quarantined(tmp_path, victim.name, damaged, rec)
    assert rec.reappended == len({m for _, _, ms in _records_of(damaged) for m in ms})
    _assert_next_open_is_clean(tmp_path, list(range(1, COUNT + 1)))


def _records_of(data: bytes) -> list[tuple[int, int, set[int]]]:
    """Like _records, for a file whose header is damaged (the records are intact)."""
    pos, out = HEADER.size, []
    while pos < len(data):
        length, _ = REC.unpack_from(data, pos)
        end = pos + REC.size + length
        out.append((pos, end, {op[2] for op in decode_group(data, pos + REC.size, end)}))
        pos = end
    return out


@pytest.mark.parametrize("which", ["last", "earlier"])
@pytest.mark.parametrize("where", ["payload", "length"])
def test_flipped_bit_in_a_record_followed_by_valid_records_loses_only_that_record(
    tmp_path: Path, which: str, where: str
) -> None:
    _build_messages(tmp_path)
    segs = _segments(tmp_path)
    victim = segs[-1] if which == "last" else segs[1]
    recs = _records(victim)
    assert len(recs) >= 3
    start, end, lost = recs[1]
    # A payload bit leaves the length intact; a length bit makes the scan resynchronise.
    damaged = _flip(victim, start + 20 if where == "payload" else start + 1, 0x10)

    rec = _reopen(tmp_path)

    expected = [m for m in range(1, COUNT + 1) if m not in lost]
    assert sorted(_live(rec)) == expected
    assert [(c.segment, c.offset, c.length) for c in rec.corruption] == [
        (victim.name, start, end - start)
    ]
    assert rec.corrupt_bytes == end - start and rec.torn_bytes == 0
    _assert_quarantined(tmp_path, victim.name, damaged, rec)
    _assert_next_open_is_clean(tmp_path, expected)


def test_a_lost_settle_brings_its_message_back_never_loses_one(tmp_path: Path) -> None:
    """The settle of message 1 is in the damaged record: 1 comes back (a duplicate)."""
    groups: list[list[JournalOp]] = [[_msg(m)] for m in range(1, 9)]
    groups.append([Settle(1, 1), Settle(1, 2)])
    groups += [[_msg(m)] for m in range(9, 13)]
    _build(tmp_path, groups)
    victim = next(p for p in _segments(tmp_path) if any(not ms for _, _, ms in _records(p)))
    start = next(s for s, _, ms in _records(victim) if not ms)
    _flip(victim, start + REC.size + 3)
    rec = _reopen(tmp_path)
    assert sorted(_live(rec)) == list(range(1, 13))
    assert len(rec.corruption) == 1


def test_a_torn_tail_is_still_truncated_with_a_warning_not_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _build_messages(tmp_path, 6)
    last = _segments(tmp_path)[-1]
    start, end, lost = _records(last)[-1]
    with last.open("r+b") as f:
        f.truncate(end - 5)  # a crash in the middle of writing the last group
    caplog.set_level(logging.WARNING, logger="twinmq.broker.journal")
    rec = _reopen(tmp_path)
    assert sorted(_live(rec)) == [m for m in range(1, 7) if m not in lost]
    assert rec.torn_bytes == end - 5 - start
    assert rec.corruption == [] and rec.errors == [] and rec.quarantined == []
    assert last.stat().st_size == start
    assert not (tmp_path / "quarantine").exists()
    assert any("torn tail" in r.message for r in caplog.records if r.levelno == logging.WARNING)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_corruption_in_the_newest_segment_skips_a_block_of_mids(tmp_path: Path) -> None:
    """A mid lost in the damaged bytes must never be assigned again (a peer may hold it)."""
    _build_messages(tmp_path, 6)
    last = _segments(tmp_path)[-1]
    start, _, _ = _records(last)[0]
    _flip(last, start + 20)
    rec = _reopen(tmp_path)
    assert rec.next_mid >= 7 + MID_MARGIN


def test_check_reports_without_changing_anything(tmp_path: Path) -> None:
    _build_messages(tmp_path)
    segs = _segments(tmp_path)
    start, end, _ = _records(segs[1])[1]
    _flip(segs[1], start + 20)
    before = {p.name: p.read_bytes() for p in _segments(tmp_path)}
    report = check(tmp_path)
    assert [(c.segment, c.offset, c.length) for c in report.corruption] == [
        (segs[1].name, start, end - start)
    ]
    assert report.live_messages == COUNT - 1
    assert {p.name: p.read_bytes() for p in _segments(tmp_path)} == before
    assert not (tmp_path / "quarantine").exists()


def test_a_crash_between_re_append_and_quarantine_keeps_one_copy(tmp_path: Path) -> None:
    """The damaged file is still in place next to the re-appended copies: no duplicates."""
    _build_messages(tmp_path)
    victim = _segments(tmp_path)[1]
    recs = _records(victim)
    damaged = _flip(victim, recs[1][0] + 20)
    lost = recs[1][2]
    _reopen(tmp_path)
    # Put the damaged file back, as if the rename had not happened.
    (tmp_path / "quarantine" / victim.name).rename(victim)
    rec = _reopen(tmp_path)
    live = _live(rec)
    assert sorted(live) == [m for m in range(1, COUNT + 1) if m not in lost]
    assert len(live) == len(set(live))
    assert (tmp_path / "quarantine" / victim.name).read_bytes() == damaged
