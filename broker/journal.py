"""Crash-safe message journal and definitions store.

Durable queues' persistent messages live here, so that a broker killed with
`kill -9` loses nothing it confirmed.

On-disk layout (one directory per broker)::

    LOCK                      flock(2)ed while a Journal has the directory open
    definitions.json          the durable topology; replaced atomically (tmp, fsync, rename)
    00000000000000000001.seg  append-only segments, oldest first
    00000000000000000002.seg
    ...

A segment is a 32-byte header followed by records::

    header: magic "TMQJ" | u32 version | u64 seq | u64 next_mid | u32 reserved | u32 crc32
    record: u32 length | u32 crc32(length bytes + payload) | payload

A record's payload is one *group* of ops, the unit `Journal.append` takes: a
transaction's publishes and acks are one record, so the checksum makes the group
atomic (all of it is recovered or none). Ops are tagged little-endian structs:

    message  = u8 1 | u64 mid | u64 qid | f64 expires_at (NaN = never)
               | u16 len(exchange) | u16 len(routing_key) | u32 len(header) | u32 len(body)
               | exchange | routing_key | header | body
    settle   = u8 2 | u64 qid | u64 mid
    carried  = u8 3 | u64 qid | u64 mid | u64 target segment   (written by compaction only)

Recovery replays the segments in order and keeps, per (qid, mid), the last
enqueued copy until a settle removes it.

Rules this module keeps (the reasons are at the code that keeps them):

* A group is applied to the in-memory bookkeeping only once it is durable, and in
  file order, so that bookkeeping always equals what a recovery would compute.
* A failed write (a full disk) is rolled back on disk (truncated to the last good
  offset) and the failed groups are as if never appended; waiters get the error.
* Compaction deletes a segment once every message it holds is settled. Settles
  that it holds for messages in older segments still on disk are first
  re-appended ("carried") to the head segment, targeted at the segment of the
  message they settle, so a deletion can never resurrect a message. Deletions
  happen oldest first with a directory fsync after each.
* A torn tail of the last segment is truncated (that data was never confirmed).
  A bad record in an earlier segment is media corruption, not a crash: recovery
  logs an error, skips the rest of that segment (the following records cannot be
  framed) and goes on with the later segments, whose records are intact and were
  confirmed. Stopping there would throw away every later confirmed message to
  protect against duplicates, the wrong trade for an at-least-once broker.
  The corrupt file is left as it is for inspection until compaction removes it
  (a segment whose header is bad is never removed; every open logs it again).
* Known limit: a segment stays while any message in it is live (sparse segments
  are not rewritten), so one long-lived message pins its whole segment.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import heapq
import logging
import math
import os
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from twinmq.broker.definitions import Definitions

__all__ = [
    "DiskFullError",
    "Journal",
    "JournalError",
    "JournalOp",
    "JournalStats",
    "Recovered",
    "Settle",
    "StoredMessage",
    "decode_ops",
    "encode_ops",
]

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class StoredMessage:
    """A persistent message enqueued on a durable queue, as the journal stores it."""

    mid: int  # broker-wide message sequence number, unique, increasing
    qid: int  # queue incarnation id (QueueDef.qid)
    exchange: str
    routing_key: str
    header: bytes  # raw AMQP content-header properties payload, opaque to the journal
    body: bytes
    expires_at: float | None  # absolute unix time (TTL), None = never


@dataclass(slots=True, frozen=True)
class Settle:
    """The message left the queue: acked, dropped, expired, dead-lettered or purged."""

    qid: int
    mid: int


JournalOp = StoredMessage | Settle


@dataclass
class Recovered:
    """What `Journal.open` found on disk."""

    definitions: Definitions
    # per qid, in enqueue order; only live (unsettled) ones, only qids present in definitions
    messages: dict[int, list[StoredMessage]]
    next_mid: int  # greater than every mid ever journaled
    torn_bytes: int  # bytes truncated from a torn tail (0 if clean)
    segments: int
    records: int
    # bytes of earlier segments that could not be read (corruption, logged as errors)
    corrupt_bytes: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class JournalStats:
    """A snapshot of the journal for metrics and the admin API."""

    segments: int
    disk_bytes: int
    live_messages: int
    last_fsync_seconds: float
    pending_bytes: int  # appended, not yet known durable
    fsyncs: int
    appended_lsn: int
    durable_lsn: int
    disk_full: bool  # the last write failed for lack of space (block publishers)


class JournalError(Exception):
    """The journal cannot do what was asked (I/O error, corruption, misuse)."""


class DiskFullError(JournalError):
    """A write failed for lack of space; it was rolled back and the journal still works."""


# --- encoding -------------------------------------------------------------------------

_MAGIC = b"TMQJ"
_VERSION = 1
_HEADER = struct.Struct("<4sIQQII")  # magic, version, seq, next_mid, reserved, crc
_HEADER_CRC = struct.Struct("<4sIQQI")  # the header bytes the crc covers
_REC = struct.Struct("<II")  # length, crc
_LEN = struct.Struct("<I")
_MSG = struct.Struct("<BQQdHHII")
_SETTLE = struct.Struct("<BQQ")
_CARRIED = struct.Struct("<BQQQ")
_TAG_MSG = 1
_TAG_SETTLE = 2
_TAG_CARRIED = 3
_PLACEHOLDER = bytes(_REC.size)
_NAN = math.nan
_DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_SEGMENT_SUFFIX = ".seg"
_DEFINITIONS = "definitions.json"


def _segment_name(seq: int) -> str:
    return f"{seq:020d}{_SEGMENT_SUFFIX}"


def _encode_header(seq: int, next_mid: int) -> bytes:
    crc = zlib.crc32(_HEADER_CRC.pack(_MAGIC, _VERSION, seq, next_mid, 0))
    return _HEADER.pack(_MAGIC, _VERSION, seq, next_mid, 0, crc)


def _frame(payload: bytes) -> bytes:
    """One record around `payload` (used off the hot path; `append` frames in place)."""
    length = _LEN.pack(len(payload))
    return length + _LEN.pack(zlib.crc32(payload, zlib.crc32(length))) + payload


class _CorruptRecord(Exception):
    """A checksum-valid record that does not decode: a format we do not know."""


# An op as replay sees it: (tag, qid, mid, message or None, carried target or 0).
_Decoded = tuple[int, int, int, StoredMessage | None, int]


def _decode_group(data: bytes, start: int, end: int) -> list[_Decoded]:
    """Decode one record's payload. Raises _CorruptRecord on anything malformed."""
    out: list[_Decoded] = []
    pos = start
    try:
        while pos < end:
            tag = data[pos]
            if tag == _TAG_MSG:
                _, mid, qid, exp, lx, lr, lh, lb = _MSG.unpack_from(data, pos)
                pos += _MSG.size
                stop = pos + lx + lr + lh + lb
                if stop > end:
                    raise _CorruptRecord("message runs past its record")
                exchange = data[pos : pos + lx].decode()
                pos += lx
                routing_key = data[pos : pos + lr].decode()
                pos += lr
                header = data[pos : pos + lh]
                pos += lh
                body = data[pos:stop]
                pos = stop
                msg = StoredMessage(
                    mid, qid, exchange, routing_key, header, body, None if exp != exp else exp
                )
                out.append((_TAG_MSG, qid, mid, msg, 0))
            elif tag == _TAG_SETTLE:
                _, qid, mid = _SETTLE.unpack_from(data, pos)
                pos += _SETTLE.size
                out.append((_TAG_SETTLE, qid, mid, None, 0))
            elif tag == _TAG_CARRIED:
                _, qid, mid, target = _CARRIED.unpack_from(data, pos)
                pos += _CARRIED.size
                out.append((_TAG_CARRIED, qid, mid, None, target))
            else:
                raise _CorruptRecord(f"unknown op tag {tag}")
    except (struct.error, UnicodeDecodeError, IndexError) as exc:
        raise _CorruptRecord(str(exc)) from exc
    if pos != end:
        raise _CorruptRecord("op runs past its record")
    return out


def encode_ops(ops: Sequence[JournalOp], buf: bytearray) -> int:
    """Append the binary form of `ops` to `buf`; return 1 + the highest mid they name.

    The same bytes are a journal record's payload and a replication batch's body.
    Raises ValueError (nothing useful appended: callers truncate) for an op that
    does not fit the format, TypeError for something that is not an op.
    """
    next_mid = 0
    try:
        for op in ops:
            if type(op) is StoredMessage:
                ex = op.exchange.encode()
                rk = op.routing_key.encode()
                header = op.header
                body = op.body
                exp = op.expires_at
                buf += _MSG.pack(
                    _TAG_MSG,
                    op.mid,
                    op.qid,
                    _NAN if exp is None else exp,
                    len(ex),
                    len(rk),
                    len(header),
                    len(body),
                )
                buf += ex
                buf += rk
                buf += header
                buf += body
            elif type(op) is Settle:
                buf += _SETTLE.pack(_TAG_SETTLE, op.qid, op.mid)
            else:
                raise TypeError(f"not a journal op: {op!r}")
            if op.mid >= next_mid:
                next_mid = op.mid + 1
    except struct.error as exc:
        raise ValueError(f"cannot encode journal op: {exc}") from exc
    return next_mid


def decode_ops(data: bytes) -> list[JournalOp]:
    """Decode what `encode_ops` wrote (messages and settles only); ValueError if malformed."""
    try:
        decoded = _decode_group(data, 0, len(data))
    except _CorruptRecord as exc:
        raise ValueError(f"malformed ops: {exc}") from exc
    ops: list[JournalOp] = []
    for tag, qid, mid, msg, _target in decoded:
        if tag == _TAG_MSG and msg is not None:
            ops.append(msg)
        elif tag == _TAG_SETTLE:
            ops.append(Settle(qid, mid))
        else:
            raise ValueError(f"op tag {tag} cannot travel outside a journal")
    return ops


# --- bookkeeping ----------------------------------------------------------------------


class _Segment:
    """What compaction needs to know about one segment file."""

    __slots__ = ("live", "path", "referrers", "refs", "seq", "size")

    def __init__(self, seq: int, path: Path, size: int) -> None:
        self.seq = seq
        self.path = path
        self.size = size
        self.live = 0  # messages recorded here and not yet settled
        # Settles recorded here for messages that live in older segments, by that
        # segment: deleting this one must first carry these forward while the
        # target still exists, or recovery would resurrect those messages.
        self.refs: dict[int, list[tuple[int, int]]] = {}
        self.referrers: set[int] = set()  # newer segments whose refs point here


@dataclass(slots=True)
class _Plan:
    delete: list[int]  # ascending: targets before the segments that settle them
    carry: dict[int, list[tuple[int, int]]]  # target segment -> (qid, mid) settles


class _Fatal(JournalError):
    """The file could not be put back in a known state: stop writing for good."""


class Journal:
    """Append-only segmented journal with group commit. See the module docstring.

    Threading: every method runs on the event loop (or, for `open`,
    `save_definitions` and `close`, before/after it). File writes, fsyncs and
    unlinks run one at a time in a private worker thread, which only touches the
    head segment's file descriptor and the bytes it is handed.
    """

    def __init__(
        self,
        directory: Path,
        *,
        segment_bytes: int = 64 * 1024 * 1024,
        fsync: bool = True,
        on_fsync: Callable[[float], None] | None = None,
    ) -> None:
        if segment_bytes < 1024:
            raise ValueError("segment_bytes must be at least 1024")
        self._dir = Path(directory)
        self._segment_bytes = segment_bytes
        self._fsync = fsync
        self._on_fsync = on_fsync

        self._opened = False
        self._closing = False
        self._broken: JournalError | None = None
        self._lock_fd = -1
        self._dir_fd = -1

        # Segments on disk, by seq; the head is the one being appended to.
        self._segments: dict[int, _Segment] = {}
        self._head: _Segment | None = None
        self._head_fd = -1
        self._next_seq = 1
        # Live messages: qid -> mid -> seq of the segment holding the live copy.
        self._where: dict[int, dict[int, int]] = {}
        self._live_total = 0
        self._dropped: set[int] = set()  # deleted queue incarnations
        self._def_qids: set[int] = set()
        self._compact_due = False

        # Appending: one bytearray per group commit, swapped by the writer.
        self._buf = bytearray()
        self._buf_groups: list[tuple[JournalOp, ...]] = []
        self._lsn = 0  # last appended group
        self._done_lsn = 0  # last group whose write finished (either way)
        self._inflight_bytes = 0
        self._next_mid = 0  # one past the highest mid journaled or appended
        self._failed: list[tuple[int, int, JournalError]] = []  # merged lsn ranges
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._waiter_seq = 0
        self._idle_waiters: list[asyncio.Future[None]] = []

        self._executor: ThreadPoolExecutor | None = None
        self._task: asyncio.Task[None] | None = None
        self._kick: asyncio.Event | None = None

        self._fsyncs = 0
        self._last_fsync = 0.0
        self._disk_full = False

    # --- opening ------------------------------------------------------------------

    def open(self) -> Recovered:
        """Lock the directory, load the definitions and replay the segments.

        Truncates a torn tail of the last segment, drops messages of queues that
        are not in the definitions, starts a new head segment and deletes the
        segments that no longer hold live messages. Synchronous: call it before
        serving clients.
        """
        if self._opened:
            raise JournalError("journal already open")
        self._dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self._dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise JournalError(f"journal directory {self._dir} is in use") from None
        self._dir_fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            return self._open_locked()
        except BaseException:
            self._release_fds()
            raise

    def _open_locked(self) -> Recovered:
        defs_path = self._dir / _DEFINITIONS
        with contextlib.suppress(FileNotFoundError):
            (self._dir / (_DEFINITIONS + ".tmp")).unlink()
        defs_missing = not defs_path.exists()
        if defs_missing:
            definitions = Definitions()
        else:
            try:
                definitions = Definitions.model_validate_json(defs_path.read_bytes())
            except ValidationError as exc:
                # Never start without the topology: every message would be dropped.
                raise JournalError(f"cannot read {defs_path}: {exc}") from exc
        self._def_qids = {q.qid for q in definitions.queues}

        seqs = sorted(
            int(p.name[: -len(_SEGMENT_SUFFIX)])
            for p in self._dir.iterdir()
            if p.name.endswith(_SEGMENT_SUFFIX) and p.name[: -len(_SEGMENT_SUFFIX)].isdigit()
        )
        messages: dict[int, dict[int, StoredMessage]] = {}
        recovered = Recovered(definitions, {}, 0, 0, 0, 0)
        for i, seq in enumerate(seqs):
            self._replay_segment(seq, i == len(seqs) - 1, messages, recovered)
        if seqs:
            self._next_seq = seqs[-1] + 1

        # Queues deleted before the crash: their messages are garbage.
        for qid in list(self._where):
            if qid not in self._def_qids:
                if defs_missing and self._where[qid]:
                    raise JournalError(
                        f"{defs_path} is missing but the journal holds live messages; "
                        "refusing to drop them (restore the definitions file)"
                    )
                self._drop(qid)
                messages.pop(qid, None)
        recovered.messages = {qid: list(d.values()) for qid, d in messages.items() if d}
        recovered.next_mid = self._next_mid
        recovered.segments = len(self._segments)
        self._opened = True

        try:
            self._roll_head_sync()
        except DiskFullError:
            # Serving clients with transient messages beats refusing to start; the
            # first write will try to create the head again.
            log.warning("disk full: cannot create a new journal segment yet")
        if self._head is not None:
            self._compact_sync()
        log.info(
            "journal opened: %d segments, %d records, %d live messages, next mid %d",
            recovered.segments,
            recovered.records,
            self._live_total,
            recovered.next_mid,
        )
        return recovered

    def _replay_segment(
        self,
        seq: int,
        last: bool,
        messages: dict[int, dict[int, StoredMessage]],
        rec: Recovered,
    ) -> None:
        path = self._dir / _segment_name(seq)
        data = path.read_bytes()
        size = len(data)
        if size < _HEADER.size or not self._header_ok(data, seq):
            if last:
                # A crash while creating the segment: nothing in it was confirmed
                # (the first batch and the directory entry are synced together).
                log.warning("journal: removing torn segment %s (%d bytes)", path.name, size)
                rec.torn_bytes += size
                path.unlink()
                os.fsync(self._dir_fd)
                return
            if size >= _HEADER.size and data[:4] == _MAGIC:
                version = _HEADER.unpack_from(data)[1]
                if version != _VERSION:
                    raise JournalError(f"{path}: unknown journal version {version}")
            # Not registered as a segment, so compaction never deletes it: it stays
            # for an operator to look at, and every open logs it again.
            msg = f"{path.name}: bad segment header; skipping the whole segment ({size} bytes)"
            log.error("journal corruption: %s", msg)
            rec.errors.append(msg)
            rec.corrupt_bytes += size
            return
        self._next_mid = max(self._next_mid, _HEADER.unpack_from(data)[3])
        seg = _Segment(seq, path, size)
        self._segments[seq] = seg
        view = memoryview(data)
        pos = _HEADER.size
        bad = ""
        while pos < size:
            bad = ""
            if size - pos < _REC.size:
                bad = "short record header"
            else:
                length, crc = _REC.unpack_from(data, pos)
                end = pos + _REC.size + length
                if end > size:
                    bad = "record runs past the end of the file"
                elif zlib.crc32(view[pos + 8 : end], zlib.crc32(view[pos : pos + 4])) != crc:
                    bad = "checksum mismatch"
            if bad:
                break
            try:
                ops = _decode_group(data, pos + _REC.size, end)
            except _CorruptRecord as exc:
                # The checksum holds, so this is not a torn write but a format we do
                # not understand: refuse rather than truncate someone's data.
                raise JournalError(f"{path}: undecodable record at {pos}: {exc}") from exc
            for tag, qid, mid, stored, target in ops:
                if tag == _TAG_MSG:
                    assert stored is not None
                    self._enqueue(qid, mid, seq)
                    per_queue = messages.setdefault(qid, {})
                    per_queue.pop(mid, None)  # a re-enqueue moves to the back
                    per_queue[mid] = stored
                elif self._settle(qid, mid, seq, target):
                    del messages[qid][mid]
                if mid >= self._next_mid:
                    self._next_mid = mid + 1
            rec.records += 1
            pos = end
        view.release()
        if pos == size:
            return
        lost = size - pos
        if last:
            log.warning(
                "journal: truncating torn tail of %s at offset %d (%d bytes: %s)",
                path.name,
                pos,
                lost,
                bad,
            )
            with open(path, "r+b") as f:
                f.truncate(pos)
                os.fsync(f.fileno())
            seg.size = pos
            rec.torn_bytes += lost
        else:
            msg = (
                f"{path.name}: {bad} at offset {pos}; the remaining {lost} bytes of this "
                "segment are unreadable and skipped (messages in them are lost, messages "
                "they settled may be redelivered); later segments are replayed"
            )
            log.error("journal corruption: %s", msg)
            rec.errors.append(msg)
            rec.corrupt_bytes += lost

    @staticmethod
    def _header_ok(data: bytes, seq: int) -> bool:
        magic, version, hseq, next_mid, reserved, crc = _HEADER.unpack_from(data)
        return bool(
            magic == _MAGIC
            and version == _VERSION
            and hseq == seq
            and zlib.crc32(_HEADER_CRC.pack(magic, version, hseq, next_mid, reserved)) == crc
        )

    # --- definitions --------------------------------------------------------------

    def save_definitions(self, defs: Definitions) -> None:
        """Atomically replace the definitions file (write tmp, fsync, rename, fsync dir).

        Save a queue's definition before journaling messages for it: recovery
        drops the messages of every qid the definitions do not hold. Queues that
        this save removes count as dropped (see `drop_queue`).
        """
        self._require_open()
        data = defs.model_dump_json(indent=1).encode()
        tmp = self._dir / (_DEFINITIONS + ".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._dir / _DEFINITIONS)
            os.fsync(self._dir_fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if exc.errno in _DISK_FULL_ERRNOS:
                raise DiskFullError(f"saving definitions: {exc}") from exc
            raise JournalError(f"saving definitions: {exc}") from exc
        qids = {q.qid for q in defs.queues}
        for qid in self._def_qids - qids:
            self.drop_queue(qid)
        self._def_qids = qids

    def drop_queue(self, qid: int) -> None:
        """A queue was deleted (definitions already saved without it).

        Its messages count as settled for compaction, including any still
        buffered or being written now.
        """
        self._require_open()
        self._drop(qid)
        self._kick_writer()

    def _drop(self, qid: int) -> None:
        self._dropped.add(qid)
        where = self._where.pop(qid, None)
        if not where:
            return
        for seq in where.values():
            self._unlive(seq)

    # --- the hot path -------------------------------------------------------------

    def append(self, ops: Sequence[JournalOp]) -> int:
        """Buffer one atomic group of ops and return its LSN (no syscall).

        All ops of a group are recovered or none. Pass the LSN to `sync` to wait
        until it is on disk. An empty group returns the last LSN appended.
        Preconditions: the ops' queues are in the saved definitions; a (qid, mid)
        is not enqueued again while it is live (a later enqueue supersedes).
        """
        if self._broken is not None:
            raise JournalError(f"journal failed: {self._broken}") from self._broken
        if not self._opened or self._closing:
            raise JournalError("journal is not open")
        if not ops:
            return self._lsn
        buf = self._buf
        start = len(buf)
        buf += _PLACEHOLDER
        try:
            next_mid = max(self._next_mid, encode_ops(ops, buf))
        except BaseException:
            del buf[start:]
            raise
        length = len(buf) - start - _REC.size
        # crc over the length too, so a zero-filled tail never passes as a record.
        crc = zlib.crc32(memoryview(buf)[start + _REC.size :], zlib.crc32(_LEN.pack(length)))
        _REC.pack_into(buf, start, length, crc)
        self._next_mid = next_mid
        self._buf_groups.append(tuple(ops))
        self._lsn += 1
        self._kick_writer()
        return self._lsn

    async def sync(self, lsn: int) -> None:
        """Return once group `lsn` (and every earlier one that did not fail) is on disk.

        Raises DiskFullError or JournalError if the write holding `lsn` failed;
        that group was rolled back and will never be recovered.
        """
        if lsn > self._lsn:
            raise ValueError(f"lsn {lsn} was never appended (last is {self._lsn})")
        if lsn <= self._done_lsn:
            self._raise_if_failed(lsn)
            return
        if self._broken is not None:
            raise JournalError(f"journal failed: {self._broken}") from self._broken
        self._ensure_writer()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter_seq += 1
        heapq.heappush(self._waiters, (lsn, self._waiter_seq, fut))
        await fut

    async def flush(self) -> None:
        """Write and fsync everything appended so far and finish pending compaction."""
        self._require_open()
        await self.sync(self._lsn)
        self._compact_due = True
        self._ensure_writer()
        assert self._kick is not None
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(fut)
        self._kick.set()
        await fut

    def _raise_if_failed(self, lsn: int) -> None:
        for lo, hi, exc in reversed(self._failed):
            if lo <= lsn <= hi:
                raise type(exc)(str(exc)) from exc
            if hi < lsn:
                return

    def _kick_writer(self) -> None:
        kick = self._kick
        if kick is not None and self._task is not None and not self._task.done():
            if not kick.is_set():
                kick.set()
            return
        with contextlib.suppress(RuntimeError):  # no running loop: sync() starts it
            asyncio.get_running_loop()
            self._ensure_writer()
            assert self._kick is not None
            self._kick.set()

    @property
    def stats(self) -> JournalStats:
        """Segments, bytes on disk, live messages, last fsync time, pending bytes."""
        return JournalStats(
            segments=len(self._segments),
            disk_bytes=sum(s.size for s in self._segments.values()),
            live_messages=self._live_total,
            last_fsync_seconds=self._last_fsync,
            pending_bytes=len(self._buf) + self._inflight_bytes,
            fsyncs=self._fsyncs,
            appended_lsn=self._lsn,
            durable_lsn=self._done_lsn,
            disk_full=self._disk_full,
        )

    # --- bookkeeping (loop side, durable ops only) --------------------------------

    def _enqueue(self, qid: int, mid: int, seq: int) -> None:
        if qid in self._dropped:
            return
        where = self._where.get(qid)
        if where is None:
            where = self._where[qid] = {}
        old = where.pop(mid, None)
        if old is not None:
            # A re-enqueue of a live (qid, mid) supersedes the old copy exactly as
            # a settle of it would, including the carry-forward duty.
            self._unlive(old)
            if old != seq:
                self._add_ref(seq, old, qid, mid)
        where[mid] = seq
        self._segments[seq].live += 1
        self._live_total += 1

    def _settle(self, qid: int, mid: int, seq: int, target: int = 0) -> bool:
        """Apply a settle recorded in segment `seq`; a carried one only hits `target`."""
        where = self._where.get(qid)
        if where is None:
            return False
        old = where.get(mid)
        if old is None or (target and old != target):
            return False  # unknown: compacted, never persisted, or superseded
        del where[mid]
        self._unlive(old)
        if old != seq:
            self._add_ref(seq, old, qid, mid)
        return True

    def _unlive(self, seq: int) -> None:
        seg = self._segments[seq]
        seg.live -= 1
        self._live_total -= 1
        if seg.live == 0 and seg is not self._head:
            self._compact_due = True

    def _add_ref(self, seq: int, target: int, qid: int, mid: int) -> None:
        seg = self._segments[seq]
        refs = seg.refs.get(target)
        if refs is None:
            refs = seg.refs[target] = []
            self._segments[target].referrers.add(seq)
        refs.append((qid, mid))

    def _apply(self, groups: list[tuple[JournalOp, ...]], seq: int) -> None:
        for ops in groups:
            for op in ops:
                if type(op) is StoredMessage:
                    self._enqueue(op.qid, op.mid, seq)
                else:
                    self._settle(op.qid, op.mid, seq)

    # --- the writer ---------------------------------------------------------------

    def _ensure_writer(self) -> None:
        if self._task is not None and not self._task.done():
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal")
        self._kick = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="journal-writer")

    async def _run(self) -> None:
        assert self._kick is not None
        kick = self._kick
        try:
            while True:
                if self._buf:
                    await self._write_buffer()
                    continue  # whatever was appended meanwhile is the next group commit
                if self._compact_due and self._head is not None and self._broken is None:
                    await self._compact()
                    continue
                for fut in self._idle_waiters:
                    if not fut.done():
                        fut.set_result(None)
                self._idle_waiters.clear()
                if self._closing:
                    return
                kick.clear()
                await kick.wait()
        except BaseException as exc:
            err = JournalError(f"journal writer stopped: {exc!r}")
            if not isinstance(exc, asyncio.CancelledError):
                log.exception("journal writer crashed")
            self._broken = self._broken or err
            self._fail_all(err)
            raise

    async def _write_buffer(self) -> None:
        buf, self._buf = self._buf, bytearray()
        groups, self._buf_groups = self._buf_groups, []
        lo, hi = self._done_lsn + 1, self._lsn
        self._inflight_bytes = len(buf)
        head = self._head
        if head is None or head.size >= self._segment_bytes:
            seq, header = self._next_seq, _encode_header(self._next_seq, self._next_mid)
        else:
            seq, header = head.seq, b""
        roll = bool(header)
        if self._broken is not None:
            # Nothing more reaches the disk after an I/O error.
            self._inflight_bytes = 0
            self._write_failed(lo, hi, self._broken)
            return
        loop = asyncio.get_running_loop()
        try:
            secs = await loop.run_in_executor(self._executor, self._io_write, buf, seq, header)
        except JournalError as exc:
            self._inflight_bytes = 0
            self._write_failed(lo, hi, exc)
            return
        self._inflight_bytes = 0
        self._disk_full = False
        if roll:
            self._install_head(seq, len(header) + len(buf))
        else:
            assert head is not None
            head.size += len(buf)
        self._apply(groups, seq)
        self._done_lsn = hi
        self._note_fsync(secs)
        self._wake_waiters()

    def _write_failed(self, lo: int, hi: int, exc: JournalError) -> None:
        if isinstance(exc, DiskFullError):
            self._disk_full = True
            log.error("journal: disk full, %d groups rolled back: %s", hi - lo + 1, exc)
        else:
            log.error("journal: write failed, %d groups rolled back: %s", hi - lo + 1, exc)
        if not isinstance(exc, DiskFullError):
            # After an I/O error (not a full disk) the file's contents are unknown;
            # like PostgreSQL after a failed fsync, stop rather than confirm more.
            self._broken = exc
        if self._failed and self._failed[-1][1] == lo - 1:
            self._failed[-1] = (self._failed[-1][0], hi, exc)
        else:
            self._failed.append((lo, hi, exc))
        self._done_lsn = hi
        self._wake_waiters()
        if self._broken is not None:
            self._fail_all(self._broken)

    def _install_head(self, seq: int, size: int) -> None:
        old = self._head
        self._head = _Segment(seq, self._dir / _segment_name(seq), size)
        self._segments[seq] = self._head
        self._next_seq = seq + 1
        if old is not None and old.live == 0:
            self._compact_due = True

    def _note_fsync(self, secs: float | None) -> None:
        if secs is None:
            return
        self._fsyncs += 1
        self._last_fsync = secs
        if self._on_fsync is not None:
            try:
                self._on_fsync(secs)
            except Exception:
                log.exception("journal on_fsync callback failed")

    def _wake_waiters(self) -> None:
        waiters = self._waiters
        done = self._done_lsn
        while waiters and waiters[0][0] <= done:
            lsn, _, fut = heapq.heappop(waiters)
            if fut.done():
                continue  # the caller was cancelled; the write went ahead anyway
            try:
                self._raise_if_failed(lsn)
            except JournalError as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(None)

    def _fail_all(self, exc: JournalError) -> None:
        for _, _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(JournalError(str(exc)))
        self._waiters.clear()
        for fut in self._idle_waiters:
            if not fut.done():
                fut.set_exception(JournalError(str(exc)))
        self._idle_waiters.clear()

    # --- file I/O (worker thread; one call at a time) -----------------------------

    def _io_write(self, data: bytes | bytearray, seq: int, header: bytes) -> float | None:
        """Write `data` to segment `seq` (creating it if `header`) and fdatasync it.

        On failure the file is put back exactly as it was (truncated, or a new
        segment removed), so the next write appends after the last good record.
        Returns the fsync duration, or None when fsync is off.
        """
        if header:
            path = self._dir / _segment_name(seq)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except OSError as exc:
                raise self._io_error("creating segment", exc) from exc
            offset = 0
            data = header + data
        else:
            assert self._head is not None
            fd, offset, path = self._head_fd, self._head.size, None
        try:
            self._write_all(fd, data, offset)
            secs = self._sync_fd(fd)
            if header:
                self._sync_dir()  # the new name must survive a crash with its data
        except OSError as exc:
            try:
                if header:
                    os.close(fd)
                    assert path is not None
                    path.unlink()
                else:
                    os.ftruncate(fd, offset)
            except OSError as exc2:
                raise _Fatal(f"cannot roll back a failed write ({exc}): {exc2}") from exc2
            raise self._io_error("writing", exc) from exc
        if header:
            if self._head_fd >= 0:
                os.close(self._head_fd)
            self._head_fd = fd
        return secs

    def _io_compact(self, plan: _Plan) -> tuple[float | None, int, list[int]]:
        """Append the carried settles, make them durable, then delete segments in order.

        Returns the fsync time, the bytes appended to the head and the segments deleted.
        """
        secs = None
        # Encoded here, not on the loop: a long-lived segment can have many settles.
        payload = bytearray()
        for target, pairs in plan.carry.items():
            for qid, mid in pairs:
                payload += _CARRIED.pack(_TAG_CARRIED, qid, mid, target)
        carry = _frame(bytes(payload)) if payload else b""
        if carry:
            assert self._head is not None
            offset = self._head.size
            try:
                self._write_all(self._head_fd, carry, offset)
                secs = self._sync_fd(self._head_fd)
            except OSError as exc:
                try:
                    os.ftruncate(self._head_fd, offset)
                except OSError as exc2:
                    raise _Fatal(f"cannot roll back a failed write ({exc}): {exc2}") from exc2
                raise self._io_error("carrying settles", exc) from exc
        deleted: list[int] = []
        for seq in plan.delete:
            try:
                (self._dir / _segment_name(seq)).unlink()
                # One at a time, durably: a later deletion relies on this one.
                self._sync_dir()
            except OSError as exc:
                log.error("journal: cannot delete segment %d: %s", seq, exc)
                break
            deleted.append(seq)
        return secs, len(carry), deleted

    @staticmethod
    def _write_all(fd: int, data: bytes | bytearray, offset: int) -> None:
        view = memoryview(data)
        try:
            while view:
                n = os.pwrite(fd, view, offset)
                view = view[n:]
                offset += n
        finally:
            view.release()

    def _sync_fd(self, fd: int) -> float | None:
        if not self._fsync:
            return None
        t0 = time.perf_counter()
        os.fdatasync(fd)
        return time.perf_counter() - t0

    def _sync_dir(self) -> None:
        if self._fsync:
            os.fsync(self._dir_fd)

    @staticmethod
    def _io_error(what: str, exc: OSError) -> JournalError:
        if exc.errno in _DISK_FULL_ERRNOS:
            return DiskFullError(f"{what}: {exc}")
        return JournalError(f"{what}: {exc}")

    def _roll_head_sync(self) -> None:
        seq = self._next_seq
        header = _encode_header(seq, self._next_mid)
        secs = self._io_write(b"", seq, header)
        self._install_head(seq, len(header))
        self._note_fsync(secs)

    # --- compaction ---------------------------------------------------------------

    def _plan(self, allow_carry: bool) -> _Plan:
        """Which all-settled segments to delete, and which settles to carry first.

        Ascending order matters: a segment's refs point only at older segments,
        so when we reach it we already know which of its targets are going too
        (those need no carrying: their messages go with them).
        """
        head = self._head
        delete: list[int] = []
        gone: set[int] = set()
        carry: dict[int, list[tuple[int, int]]] = {}
        for seq in sorted(self._segments):
            seg = self._segments[seq]
            if seg is head or seg.live:
                continue
            needed = [t for t in seg.refs if t not in gone and t in self._segments]
            if needed and not allow_carry:
                continue
            for target in needed:
                keep = [(q, m) for q, m in seg.refs[target] if q not in self._dropped]
                if keep:
                    carry.setdefault(target, []).extend(keep)
            delete.append(seq)
            gone.add(seq)
        return _Plan(delete, carry)

    async def _compact(self) -> None:
        self._compact_due = False
        plan = self._plan(allow_carry=True)
        if not plan.delete:
            return
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._executor, self._io_compact, plan)
        except DiskFullError as exc:
            # Deleting is how space comes back: do what needs no carrying.
            log.warning("journal: cannot carry settles (%s); compacting what needs none", exc)
            self._disk_full = True
            plan = self._plan(allow_carry=False)
            if not plan.delete:
                return
            result = await loop.run_in_executor(self._executor, self._io_compact, plan)
        except JournalError as exc:
            self._broken = exc
            self._fail_all(exc)
            return
        self._finish_compaction(plan, *result)

    def _compact_sync(self) -> None:
        plan = self._plan(allow_carry=True)
        if plan.delete:
            self._finish_compaction(plan, *self._io_compact(plan))
        self._compact_due = False

    def _finish_compaction(
        self, plan: _Plan, secs: float | None, carried: int, deleted: list[int]
    ) -> None:
        head = self._head
        assert head is not None
        if carried:
            head.size += carried
            for target, pairs in plan.carry.items():
                if pairs:
                    head.refs.setdefault(target, []).extend(pairs)
                    self._segments[target].referrers.add(head.seq)
        self._note_fsync(secs)
        for seq in deleted:
            seg = self._segments.pop(seq)
            for target in seg.refs:
                other = self._segments.get(target)
                if other is not None:
                    other.referrers.discard(seq)
            for referrer in seg.referrers:
                other = self._segments.get(referrer)
                if other is not None:
                    other.refs.pop(seq, None)
        if deleted:
            log.info("journal: compacted %d segments", len(deleted))
        # A segment that could not be unlinked is retried at the next trigger, not
        # in a loop here.

    # --- closing ------------------------------------------------------------------

    async def close(self) -> None:
        """Flush and fsync everything pending, stop the writer, release the directory."""
        if not self._opened:
            return
        if self._broken is None and (self._buf or self._task is not None):
            self._ensure_writer()
        self._closing = True
        if self._task is not None:
            assert self._kick is not None
            self._kick.set()
            with contextlib.suppress(JournalError):
                await self._task
        self._shutdown()

    def _simulate_crash(self) -> None:
        """Tests only: drop everything in memory and let go of the files, like kill -9."""
        if self._task is not None:
            self._task.cancel()
        self._buf = bytearray()
        self._buf_groups = []
        self._shutdown()

    def _shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._release_fds()
        self._opened = False

    def _release_fds(self) -> None:
        for name in ("_head_fd", "_dir_fd", "_lock_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, -1)

    def _require_open(self) -> None:
        if not self._opened:
            raise JournalError("journal is not open")
