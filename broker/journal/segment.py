"""The segment file format: header, record framing, and scanning a file back.

A segment is a 32-byte header followed by records::

    header: magic "TMQJ" | u32 version | u64 segment number | u64 next_mid | u32 reserved
            | u32 crc32 (of the 28 bytes before it)
    record: u32 length | u32 crc32(length bytes + payload) | payload (one group of ops)

Segments are named by their *segment number* (`segno`, 20 digits + `.seg`),
oldest first; the header repeats it. `next_mid` is one past the highest mid
journaled before the segment was created, so it bounds the mids of every older
segment. The crc covers the length too, so a zero-filled tail never passes as a
record.

`scan` reads a file back without changing it and says what is intact and what
is not; `SegmentScan.classify` tells a torn tail (a crash while writing, never
confirmed) from corruption (damage to bytes that were once durable):

* A *torn tail* is only an unreadable stretch at the very end of the last
  segment with nothing valid after it, or a last segment whose header is
  unreadable and that holds no valid record (a crash while creating it).
* Everything else unreadable is *corruption*: a bad header followed by valid
  records, a bad record followed by a valid one (found by resynchronising: the
  scan looks for the next offset where a frame with a valid length and crc
  starts), and any damage in a segment that is not the last.
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass, field

from twinmq.broker.journal.errors import JournalError
from twinmq.broker.journal.ops import (
    TAG_CARRIED,
    TAG_MSG,
    TAG_SETTLE,
    CorruptRecord,
    DecodedOp,
    decode_group,
)

__all__ = [
    "HEADER",
    "MAGIC",
    "PLACEHOLDER",
    "REC",
    "SUFFIX",
    "VERSION",
    "Damage",
    "Record",
    "SegmentScan",
    "encode_header",
    "frame",
    "header_ok",
    "scan",
    "seal_record",
    "segment_name",
    "segment_number",
]

MAGIC = b"TMQJ"
VERSION = 1
HEADER = struct.Struct("<4sIQQII")  # magic, version, segno, next_mid, reserved, crc
_HEADER_CRC = struct.Struct("<4sIQQI")  # the header bytes the crc covers
REC = struct.Struct("<II")  # length, crc
_LEN = struct.Struct("<I")
PLACEHOLDER = bytes(REC.size)
SUFFIX = ".seg"
_TAG_BYTE = re.compile(bytes([ord("["), TAG_MSG, TAG_SETTLE, TAG_CARRIED, ord("]")]))


def segment_name(segno: int) -> str:
    """The file name of segment `segno`."""
    return f"{segno:020d}{SUFFIX}"


def segment_number(name: str) -> int | None:
    """The segment number of a file name, None if it is not a segment."""
    stem = name[: -len(SUFFIX)]
    if name.endswith(SUFFIX) and stem.isdigit():
        return int(stem)
    return None


def encode_header(segno: int, next_mid: int) -> bytes:
    """A segment's header."""
    crc = zlib.crc32(_HEADER_CRC.pack(MAGIC, VERSION, segno, next_mid, 0))
    return HEADER.pack(MAGIC, VERSION, segno, next_mid, 0, crc)


def header_ok(data: bytes, segno: int) -> bool:
    """Whether `data` starts with the intact header of segment `segno`.

    Raises JournalError for an intact header of another format version: that is
    not damage but a journal this code cannot read.
    """
    if len(data) < HEADER.size:
        return False
    magic, version, hseq, next_mid, reserved, crc = HEADER.unpack_from(data)
    if zlib.crc32(_HEADER_CRC.pack(magic, version, hseq, next_mid, reserved)) != crc:
        return False
    if magic == MAGIC and version != VERSION:
        raise JournalError(f"{segment_name(segno)}: unknown journal version {version}")
    return bool(magic == MAGIC and hseq == segno)


def frame(payload: bytes) -> bytes:
    """One record around `payload` (off the hot path; `seal_record` frames in place)."""
    length = _LEN.pack(len(payload))
    return length + _LEN.pack(zlib.crc32(payload, zlib.crc32(length))) + payload


def seal_record(buf: bytearray, start: int) -> None:
    """Fill in the length and crc of the record whose placeholder is at `buf[start]`."""
    length = len(buf) - start - REC.size
    crc = zlib.crc32(memoryview(buf)[start + REC.size :], zlib.crc32(_LEN.pack(length)))
    REC.pack_into(buf, start, length, crc)


@dataclass(frozen=True, slots=True)
class Damage:
    """An unreadable stretch of a segment file."""

    offset: int
    length: int
    reason: str


@dataclass(slots=True)
class Record:
    """An intact record: its byte range and its decoded ops."""

    start: int
    end: int
    ops: list[DecodedOp]


@dataclass
class SegmentScan:
    """What `scan` found in one segment file."""

    segno: int
    size: int
    header_ok: bool
    next_mid: int  # from the header; 0 when the header is unreadable
    records: list[Record] = field(default_factory=list)
    # Unreadable stretches in file order (a bad header is the stretch at offset 0).
    bad: list[Damage] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The file name."""
        return segment_name(self.segno)

    def classify(self, last: bool) -> tuple[Damage | None, list[Damage]]:
        """(torn tail, corruption) of this segment, `last` if it is the newest one.

        A whole torn segment (header unreadable, no record) is a torn tail at 0.
        """
        if not self.bad:
            return None, []
        if not last:
            return None, list(self.bad)
        if not self.header_ok and not self.records:
            return Damage(0, self.size, "torn segment header"), []
        tail = self.bad[-1]
        if tail.offset + tail.length == self.size and tail.offset > 0:
            return tail, self.bad[:-1]
        return None, list(self.bad)


def frame_at(data: bytes, view: memoryview, pos: int, size: int) -> tuple[int, str]:
    """(end, "") if an intact record frame starts at `pos`, else (0, why not) (a journal
    segment's records and the definitions log's are framed alike)."""
    if size - pos < REC.size:
        return 0, "short record header"
    length, crc = REC.unpack_from(data, pos)
    end = pos + REC.size + length
    if end > size:
        return 0, "record runs past the end of the file"
    if zlib.crc32(view[pos + REC.size : end], zlib.crc32(view[pos : pos + 4])) != crc:
        return 0, "checksum mismatch"
    return end, ""


def _resync(data: bytes, view: memoryview, pos: int, size: int) -> int:
    """The next offset after a bad record at `pos` where an intact, decodable record starts.

    First where the bad record's own length says the next one is (a flipped bit
    in a payload leaves the length intact), then byte by byte. A candidate must
    start with a known op tag, pass the crc and decode, so a stretch of a message
    body is not mistaken for a record. Returns `size` if there is none.
    """
    if size - pos >= REC.size:
        guess = pos + REC.size + int(REC.unpack_from(data, pos)[0])
        if pos < guess < size and _decodable(data, view, guess, size):
            return guess
    # Candidates are the offsets whose first payload byte is an op tag: found by the
    # regex engine, so long stretches of other bytes cost no Python loop.
    for match in _TAG_BYTE.finditer(data, pos + 1 + REC.size):
        p = match.start() - REC.size
        if _decodable(data, view, p, size):
            return p
    return size


def _decodable(data: bytes, view: memoryview, pos: int, size: int) -> bool:
    end, _ = frame_at(data, view, pos, size)
    if not end or end == pos + REC.size:
        return False
    try:
        decode_group(data, pos + REC.size, end)
    except CorruptRecord:
        return False
    return True


def scan(data: bytes, segno: int) -> SegmentScan:
    """Read every intact record of segment `segno` (its bytes); change nothing.

    Raises JournalError for a record that is intact (crc) but does not decode
    where the record chain expects one: a format this code does not know, to be
    refused rather than skipped.
    """
    size = len(data)
    ok = header_ok(data, segno)
    result = SegmentScan(segno, size, ok, HEADER.unpack_from(data)[3] if ok else 0)
    if size < HEADER.size:
        result.bad.append(Damage(0, size, "short segment header"))
        return result
    if not ok:
        result.bad.append(Damage(0, HEADER.size, "bad segment header"))
    view = memoryview(data)
    try:
        pos = HEADER.size
        while pos < size:
            end, why = frame_at(data, view, pos, size)
            if not end:
                resume = _resync(data, view, pos, size)
                result.bad.append(Damage(pos, resume - pos, why))
                pos = resume
                continue
            try:
                ops = decode_group(data, pos + REC.size, end)
            except CorruptRecord as exc:
                raise JournalError(
                    f"{segment_name(segno)}: undecodable record at {pos}: {exc}"
                ) from exc
            result.records.append(Record(pos, end, ops))
            pos = end
    finally:
        view.release()
    return result
