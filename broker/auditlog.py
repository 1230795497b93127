"""The broker's audit log writer: rotated JSON-lines segments of audit records.

A record says what a broker did with a message: `confirmed` (or
`confirmed-alone`) means the publisher was told, `replicated` that the passive
acknowledged it to the active, `dequeued` that it was settled for good. So a
record is durable before what it describes leaves the broker: the group
committer (`broker/commit.py`) hands the ops of each completed batch to
`batch_complete`, then holds the batch's confirms (on the passive, its
replication ACK) until `write` has appended the records *and fdatasynced the
audit file*. A power loss can then lose only records of batches never
confirmed; a record never claims a confirm that was not about to go out.

Format. One line per batch, queue and event (`twinmq.audit.records.AuditBatch`,
format 3): the replication ids of the batch's messages in that queue (one
`[first, count]` run when consecutive, the usual case, else listed), with their
message ids (left out when none has one) and body digests (CRC-32 as
`body_digest`, concatenated in `digests_hex`) for the stored events. The shipper
expands lines into `AuditRecord`s (`segment_columns`), so the audit job sees one
record per message as before. The broker's own records (internal queues: mirror
events, applied marks, the DR role) are journaled and replicated but not audited:
they are not messages, and the mirror event copies the batch's bodies, whose CRC
would double the audit's work.

Cost. The event loop only queues `(ops, event, time, epoch, queues)` per batch
(no formatting); `write` runs in the audit's own writer thread (`writer`, a
`WriterThread`), once per group commit: it formats the lines, mapping C functions
over the ops (no Python frame per message: the CRC of the body into an array, the
ids compared with a range, the content headers compared with the first one),
appends them with one `pwrite` and makes them durable with one `fdatasync`; a new
segment's name is made durable with an fsync of the directory. The writer runs
in parallel with the journal's writer thread, so a group commit costs one extra
fdatasync, overlapped with the next batch's journal write.

A DR mirror's lines for what it applied from another site carry that site's
mirror id (`origin`, format 4): the batch journals the applied mark of that origin
with the effects, so one look at the batch's queues finds it. A bidirectional site
maps message ids per origin, so its stored lines with `origin` also say where the
messages were published and their ids there (`message_origin`, `origin_id_runs`,
format 5): the batch journals the id map's record of each copy it applies
(`amq.twinmq.mirror-ids`), which the writer reads (a message of its own, for
example one another site dead-lettered, has no record: this site's id and name).
That costs a dictionary entry per applied copy, in the writer thread, on applied
batches only; a site's client traffic pays nothing more.

A queue of another vhost than `/` is named by its own name and the line's `vhost`
(format 6; `/`'s lines are as before).

Segments are named `<broker>-e<epoch>-<seq>.jsonl`; the one being written ends
in `.open` and is renamed when closed (by size, age or epoch), so a shipper
only ever picks up complete segments. A segment left `.open` by a crash is cut
at its last full line and closed at the next start: the torn line described a
batch never confirmed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import struct
import sys
import threading
import time
import zlib
from array import array
from collections.abc import Callable, Iterable, Sequence
from itertools import groupby
from pathlib import Path

from twinmq.audit.records import BATCH_FIELDS, DEFAULT_VHOST, AuditEvent, line_vhost
from twinmq.broker.atomicfile import sync_dir
from twinmq.broker.journal import JournalOp, StoredMessage
from twinmq.broker.mirror.bidi import IDS_QID, id_record
from twinmq.broker.mirror.events import INTERNAL_PREFIX, INTERNAL_QID_BASE
from twinmq.broker.writerthread import WriterThread

log = logging.getLogger(__name__)

assert BATCH_FIELDS == (
    "broker", "epoch", "queue", "event", "time", "replication_ids", "replication_id_runs",
    "message_ids", "digests", "digests_hex", "origin", "message_origin", "origin_ids",
    "origin_id_runs", "vhost",
), "the writer below must follow AuditBatch's fields"  # fmt: skip

# One completed batch waiting to be written: its ops, the event of its stored messages,
# the time (formatted), the epoch it completed in, the queues (qids) of its ops and the
# `origin` member of its lines ('' unless a DR mirror applied it).
PendingBatch = tuple[Sequence[JournalOp], str, str, int, set[int], str]

_json_str: Callable[[str], str] = json.encoder.encode_basestring_ascii
_U32 = struct.Struct(">I")
_DEQUEUED = AuditEvent.DEQUEUED.value
# A DR mirror's apply journals its applied mark (`amq.twinmq.mirror-applied.<origin>`,
# broker/mirror/applier.py) in the same group commit as the effects: that record names
# the origin of the batch's messages, at no cost per message.
_MARK_PREFIX = INTERNAL_PREFIX + "mirror-applied."
# Per message the writer only maps C functions over a batch's ops (no Python frame per
# message): these pick the fields.
_qid = operator.attrgetter("qid")
_mid = operator.attrgetter("mid")
_body = operator.attrgetter("body")
_header = operator.attrgetter("header")
_flags_low = operator.itemgetter(13)  # the low byte of a content header's property flags
_has_message_id = (0x80).__and__
_LITTLE_ENDIAN = sys.byteorder == "little"
assert array("I").itemsize == 4, "digests_hex packs CRC-32s as 4-byte unsigned ints"


def message_id_json(header: bytes) -> str:
    """The message-id property of a raw content header, as JSON (`null` if absent).

    Walks the property flags up to message-id (a header without one, the common
    case, costs one comparison). Headers were validated at publish; one that
    cannot be read here anyway is recorded without a message id.
    """
    if len(header) < 14 or not header[13] & 0x80:
        return "null"
    try:
        flags = header[12] << 8 | header[13]
        pos = 14
        if flags & 0x8000:  # content-type
            pos += 1 + header[pos]
        if flags & 0x4000:  # content-encoding
            pos += 1 + header[pos]
        if flags & 0x2000:  # headers (a table: u32 length)
            pos += 4 + _U32.unpack_from(header, pos)[0]
        if flags & 0x1000:  # delivery-mode
            pos += 1
        if flags & 0x0800:  # priority
            pos += 1
        if flags & 0x0400:  # correlation-id
            pos += 1 + header[pos]
        if flags & 0x0200:  # reply-to
            pos += 1 + header[pos]
        if flags & 0x0100:  # expiration
            pos += 1 + header[pos]
        end = pos + 1 + header[pos]
        if end > len(header):
            return "null"
        return _json_str(header[pos + 1 : end].decode("utf-8"))
    except (IndexError, struct.error, UnicodeDecodeError):
        return "null"


def _replication_ids_json(mids: list[int], name: str = "replication_id") -> str:
    """The replication ids of a line: one run when consecutive (the common case), else listed.

    A run costs the same for 1 or 500 ids; listing formats every id.
    """
    first, count = mids[0], len(mids)
    if mids[-1] - first == count - 1 and mids == list(range(first, first + count)):
        return f'"{name}_runs":[[{first},{count}]]'
    return f'"{name}s":[{",".join(map(str, mids))}]'


def _digests_hex(ops: Sequence[JournalOp]) -> str:
    """The CRC-32 of each message's body, as 8 hex digits each (big-endian bytes: each
    digest's hex reads as `body_digest`)."""
    digests = array("I", map(zlib.crc32, map(_body, ops)))
    if _LITTLE_ENDIAN:
        digests.byteswap()
    return digests.tobytes().hex()


def _mapped_ids(ops: Sequence[JournalOp]) -> dict[tuple[int, int], tuple[str, int]]:
    """(local qid, local mid) -> (message origin, id there) of the id map records in a
    batch (a bidirectional apply journals one per copy, beside the copy)."""
    out: dict[tuple[int, int], tuple[str, int]] = {}
    for op in ops:
        if op.qid == IDS_QID and type(op) is StoredMessage:
            qid, mid, omid, origin = id_record(op.body)
            out[(qid, mid)] = (origin, omid)
    return out


def _message_ids(headers: list[bytes]) -> str:
    """The `message_ids` member of a batch's line; none at all when no message has one."""
    first = headers[0]
    if len(first) >= 14 and not first[13] & 0x80 and headers.count(first) == len(headers):
        return ""  # one header for the whole line (a publisher's usual case), without an id
    try:
        if not any(map(_has_message_id, map(_flags_low, headers))):
            return ""
    except IndexError:  # a header too short to hold flags: read each one by one
        pass
    return f',"message_ids":[{",".join(map(message_id_json, headers))}]'


class AuditLog:
    """Appends audit records to `<directory>/<broker>-e<epoch>-<seq>.jsonl` segments.

    Threading: `batch_complete`, `take` and `tick` run on the event loop; `write`
    in `writer` (the committer awaits it); `flush` and `close` anywhere when
    no `write` is running (tests, shutdown). File state is guarded by a lock.
    """

    def __init__(
        self,
        directory: Path,
        broker: str,
        epoch: Callable[[], int],
        queue_name: Callable[[int], str],
        is_replica: Callable[[], bool],
        *,
        queue_vhost: Callable[[int], str] = lambda _qid: DEFAULT_VHOST,
        segment_bytes: int = 16 * 1024 * 1024,
        segment_seconds: float = 60.0,
        fsync: bool = True,
        mirror_id: str = "",
    ) -> None:
        self.directory = directory
        # A bidirectional site's mirror id: its applied lines say where messages come from.
        self.mirror_id = mirror_id
        self.broker = broker
        self.epoch = epoch
        self.queue_name = queue_name
        self.queue_vhost = queue_vhost
        self.is_replica = is_replica
        self.segment_bytes = segment_bytes
        self.segment_seconds = segment_seconds
        self.fsync = fsync
        directory.mkdir(parents=True, exist_ok=True)
        self._seq = self._last_seq() + 1
        self._fd = -1
        self._path: Path | None = None
        self._opened_at = 0.0
        self._epoch_of_file = -1
        self._size = 0  # bytes written and kept in the open segment
        self._pending: list[PendingBatch] = []
        self._broker_json = _json_str(broker)
        # qid -> the queue's name as JSON (with the `vhost` member after it, for a queue
        # of another vhost: format 6), filled on the loop, read by the writer thread;
        # qids (queue incarnations) are never reused, so an entry is never stale.
        self._queue_json: dict[int, str] = {}
        # internal qid -> the `origin` member its records give a line ('' for most)
        self._origin_json: dict[int, str] = {}
        self._lock = threading.Lock()
        self._writer: WriterThread | None = None
        self._close_leftovers()

    @property
    def writer(self) -> WriterThread:
        """The audit's writer thread (one: writes are ordered), started on first use."""
        if self._writer is None:
            self._writer = WriterThread("audit")
        return self._writer

    def _last_seq(self) -> int:
        seqs = [
            int(p.name.split("-")[-1].split(".")[0])
            for p in self.directory.glob(f"{self.broker}-e*-*.jsonl*")
            if p.name.split("-")[-1].split(".")[0].isdigit()
        ]
        return max(seqs, default=0)

    def _close_leftovers(self) -> None:
        # A segment left open by a crash is complete up to its last full line; a torn
        # line described a batch whose confirms never went out (they wait for the sync).
        for path in self.directory.glob(f"{self.broker}-e*-*.jsonl.open"):
            data = path.read_bytes()
            keep = data[: data.rfind(b"\n") + 1]
            if keep != data:
                with open(path, "r+b") as f:
                    f.truncate(len(keep))
                    os.fsync(f.fileno())
            os.replace(path, path.with_suffix(""))
        self._sync_dir()

    # -- event loop side --------------------------------------------------------------------

    def batch_complete(self, ops: Iterable[JournalOp], guarded: bool) -> None:
        """Queue the records of a batch that just completed (formatted by `write`)."""
        stored_event = (
            AuditEvent.REPLICATED if self.is_replica()
            else AuditEvent.CONFIRMED if guarded else AuditEvent.CONFIRMED_ALONE
        ).value  # fmt: skip
        ops = ops if isinstance(ops, list | tuple) else list(ops)
        names = self._queue_json
        qids = set(map(_qid, ops))
        for qid in qids.difference(names):
            # Looked up here, on the loop that owns the queues, once per queue.
            name = self.queue_name(qid)
            vhost = line_vhost(name, self.queue_vhost(qid))
            names[qid] = _json_str(name) + ("" if vhost is None else f',"vhost":{_json_str(vhost)}')
            if qid >= INTERNAL_QID_BASE:
                origin = name[len(_MARK_PREFIX) :] if name.startswith(_MARK_PREFIX) else ""
                self._origin_json[qid] = f',"origin":{_json_str(origin)}' if origin else ""
        origin_json = ""
        if len(qids) > 1:  # a client batch on one queue never holds an applied mark
            marks = self._origin_json
            origin_json = next((marks[q] for q in qids if marks.get(q)), "")
        self._pending.append(
            (ops, stored_event, f"{time.time():.6f}", self.epoch(), qids, origin_json)
        )

    def take(self) -> list[PendingBatch]:
        """The batches queued so far, for one `write` (event loop)."""
        pending, self._pending = self._pending, []
        return pending

    def give_back(self, batches: list[PendingBatch]) -> None:
        """Queue batches again, first, after their `write` failed (event loop)."""
        self._pending[:0] = batches

    @property
    def pending(self) -> bool:
        """Whether batches wait to be written."""
        return bool(self._pending)

    def tick(self) -> None:
        """Called every second on the loop: close a segment that aged out (in the thread)."""
        if self._fd >= 0 and time.monotonic() - self._opened_at >= self.segment_seconds:
            self.writer.submit(self._close_if_aged)

    # -- the writer thread ------------------------------------------------------------------

    def write(self, batches: list[PendingBatch]) -> int:
        """Format, append and fdatasync the records of `batches`; return how many.

        On an OSError the segment is put back as it was (no partial line) and the
        error raised: nothing of `batches` counts as written (of one epoch's run: a write
        spanning two epochs that fails in the second has written the first). Any other
        error (a record it cannot format) is raised before anything is written.
        """
        count = 0  # records (messages), not lines
        with self._lock:
            # Every line formatted before the first is written: an error formatting
            # one (a bug) then leaves nothing of `batches` on disk, to be retried whole.
            runs: list[tuple[int, bytes]] = []
            start = 0
            while start < len(batches):
                # A segment holds one epoch's records.
                epoch = batches[start][3]
                end = start + 1
                while end < len(batches) and batches[end][3] == epoch:
                    end += 1
                runs.append((epoch, "".join(self._format(batches[start:end])).encode()))
                count += sum(len(b[0]) for b in batches[start:end])
                start = end
            for epoch, data in runs:
                self._append(data, epoch)
        return count

    def _format(self, batches: Sequence[PendingBatch]) -> list[str]:
        """One line per batch, queue and event (an `AuditBatch`, format 3)."""
        names = self._queue_json
        out: list[str] = []
        for ops, stored_event, now, epoch, qids, origin in batches:
            # A bidirectional apply: its copies' own origin and ids, from the id map records.
            mapped = _mapped_ids(ops) if origin and self.mirror_id else None
            groups: dict[tuple[type, int], list[JournalOp]] = {}
            if len(qids) == 1:  # the common case: runs by kind only, no key tuple per op
                (qid,) = qids
                for kind, run in groupby(ops, type):
                    groups.setdefault((kind, qid), []).extend(run)
            else:
                # Runs of one queue, then of one kind: two int and type keys per op are
                # cheaper than a (class, qid) tuple each; the broker's own records (the
                # mirror's event in most client batches) are left out at once.
                for qid, run in groupby(ops, _qid):
                    if qid >= INTERNAL_QID_BASE:
                        continue
                    for kind, same in groupby(run, type):
                        groups.setdefault((kind, qid), []).extend(same)
            head = f'{{"broker":{self._broker_json},"epoch":{epoch},"queue":'
            for (kind, qid), group in groups.items():
                if qid >= INTERNAL_QID_BASE:
                    continue  # the broker's own records (mirror events, marks): no messages
                ids = _replication_ids_json(list(map(_mid, group)))
                if kind is not StoredMessage:
                    out.append(
                        f'{head}{names[qid]},"event":"{_DEQUEUED}","time":{now},{ids}{origin}}}\n'
                    )
                    continue
                if mapped is not None:
                    out += self._format_mapped(head + names[qid], stored_event, now, group,
                                               origin, mapped)  # fmt: skip
                    continue
                out.append(
                    f'{head}{names[qid]},"event":"{stored_event}","time":{now},{ids}'
                    f"{_message_ids(list(map(_header, group)))},"
                    f'"digests_hex":"{_digests_hex(group)}"{origin}}}\n'
                )
        return out

    def _format_mapped(
        self,
        head: str,
        stored_event: str,
        now: str,
        group: list[JournalOp],
        origin: str,
        mapped: dict[tuple[int, int], tuple[str, int]],
    ) -> list[str]:
        """A bidirectional apply's stored line(s) for one queue: one per message origin,
        each with the ids there (format 5)."""
        by_origin: dict[str, list[tuple[JournalOp, int]]] = {}
        own = self.mirror_id
        for op in group:
            morigin, omid = mapped.get((op.qid, op.mid), (own, op.mid))
            by_origin.setdefault(morigin, []).append((op, omid))
        out = []
        for morigin, pairs in by_origin.items():
            ops = [op for op, _ in pairs]
            out.append(
                f'{head},"event":"{stored_event}","time":{now},'
                f"{_replication_ids_json(list(map(_mid, ops)))}"
                f"{_message_ids(list(map(_header, ops)))},"
                f'"digests_hex":"{_digests_hex(ops)}"{origin},'
                f'"message_origin":{_json_str(morigin)},'
                f"{_replication_ids_json([o for _, o in pairs], 'origin_id')}}}\n"
            )
        return out

    def _append(self, data: bytes, epoch: int) -> None:
        now = time.monotonic()
        if self._fd >= 0 and (
            self._size >= self.segment_bytes
            or now - self._opened_at >= self.segment_seconds
            or epoch != self._epoch_of_file
        ):
            self._close_segment()
        new = self._fd < 0
        if new:
            path = self.directory / f"{self.broker}-e{epoch:06d}-{self._seq:08d}.jsonl.open"
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._seq += 1
            self._path = path
            self._opened_at = now
            self._epoch_of_file = epoch
            self._size = 0
        try:
            view = memoryview(data)
            offset = self._size
            while view:
                n = os.pwrite(self._fd, view, offset)
                view = view[n:]
                offset += n
            if self.fsync:
                os.fdatasync(self._fd)
            if new:
                self._sync_dir()  # the new name must survive a power loss with its data
        except OSError:
            self._roll_back()
            raise
        self._size += len(data)

    def _roll_back(self) -> None:
        # Put the segment back as it was; if even that fails, leave it `.open` (cut at
        # its last full line at the next start) and continue in a new one.
        try:
            os.ftruncate(self._fd, self._size)
        except OSError as exc:
            log.error("audit: cannot roll back a failed write of %s: %s", self._path, exc)
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1
            self._path = None

    def _close_if_aged(self) -> None:
        with self._lock:
            if self._fd >= 0 and time.monotonic() - self._opened_at >= self.segment_seconds:
                self._close_segment()

    def _close_segment(self) -> None:
        if self._fd < 0 or self._path is None:
            return
        os.close(self._fd)
        self._fd = -1
        os.replace(self._path, self._path.with_suffix(""))
        self._sync_dir()
        self._path = None

    def _sync_dir(self) -> None:
        if self.fsync:
            sync_dir(self.directory)

    # -- anywhere, when no write runs ----------------------------------------------------------

    def flush(self) -> None:
        """Write (and fdatasync) every queued record now, in the calling thread."""
        batches = self.take()
        if batches:
            self.write(batches)

    def close_segment(self) -> None:
        """Close the open segment and publish it (rename off `.open`)."""
        with self._lock:
            self._close_segment()

    def close(self) -> None:
        """Flush, close the segment and stop the writer thread (shutdown)."""
        if self._writer is not None:
            self._writer.stop()
            self._writer = None
        self.flush()
        self.close_segment()
