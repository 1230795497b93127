"""The broker's audit log writer: rotated JSON-lines segments of `AuditRecord`s.

Written as batches complete (the group committer calls `batch_complete`), so
a `confirmed` record means what the publisher was told. Segments are named
`<broker>-e<epoch>-<seq>.jsonl`; the one being written ends in `.open` and is
renamed when closed, so a shipper only ever picks up complete segments. The
group committer flushes the records of completed batches to the OS before their
confirms go out, so a broker killed with kill -9 keeps the record of everything
it confirmed. Not fsynced: a power loss may lose the last records (the journal's
fdatasync does not cover them), never invent one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from twinmq.audit.records import AUDIT_FIELDS, AuditEvent
from twinmq.broker.codec import header_message_id
from twinmq.broker.journal import JournalOp, Settle, StoredMessage

log = logging.getLogger(__name__)

assert AUDIT_FIELDS == (
    "broker", "epoch", "queue", "replication_id", "message_id", "digest", "event", "time",
), "the writer below must follow AuditRecord's fields"  # fmt: skip


def body_digest(body: bytes) -> str:
    """The digest recorded for a body."""
    return hashlib.blake2b(body, digest_size=8).hexdigest()


class AuditLog:
    """Appends audit records to `<directory>/<broker>-e<epoch>-<seq>.jsonl` segments."""

    def __init__(
        self,
        directory: Path,
        broker: str,
        epoch: Callable[[], int],
        queue_name: Callable[[int], str],
        is_replica: Callable[[], bool],
        *,
        segment_bytes: int = 16 * 1024 * 1024,
        segment_seconds: float = 60.0,
    ) -> None:
        self.directory = directory
        self.broker = broker
        self.epoch = epoch
        self.queue_name = queue_name
        self.is_replica = is_replica
        self.segment_bytes = segment_bytes
        self.segment_seconds = segment_seconds
        directory.mkdir(parents=True, exist_ok=True)
        self._seq = self._last_seq() + 1
        self._file: object | None = None
        self._path: Path | None = None
        self._opened_at = 0.0
        self._epoch_of_file = -1
        self._written = 0
        self._buf: list[str] = []
        self._buf_epoch = epoch()
        self._broker_json = json.dumps(broker)
        self._close_leftovers()

    def _last_seq(self) -> int:
        seqs = [
            int(p.name.split("-")[-1].split(".")[0])
            for p in self.directory.glob(f"{self.broker}-e*-*.jsonl*")
            if p.name.split("-")[-1].split(".")[0].isdigit()
        ]
        return max(seqs, default=0)

    def _close_leftovers(self) -> None:
        # A segment left open by a crash is complete up to its last full line.
        for path in self.directory.glob(f"{self.broker}-e*-*.jsonl.open"):
            data = path.read_bytes()
            keep = data[: data.rfind(b"\n") + 1]
            if keep != data:
                path.write_bytes(keep)
            os.replace(path, path.with_suffix(""))

    def batch_complete(self, ops: Iterable[JournalOp], guarded: bool) -> None:
        """Record the messages and settles of a batch that just completed."""
        now = f"{time.time():.6f}"
        epoch = self.epoch()
        if epoch != self._buf_epoch:
            # A segment holds one epoch's records: write out the previous epoch's first.
            self.flush()
            self._buf_epoch = epoch
        stored_event = (
            AuditEvent.REPLICATED if self.is_replica()
            else AuditEvent.CONFIRMED if guarded else AuditEvent.CONFIRMED_ALONE
        ).value  # fmt: skip
        head = f'{{"broker":{self._broker_json},"epoch":{epoch},"queue":'
        buf = self._buf
        for op in ops:
            queue = json.dumps(self.queue_name(op.qid))
            if type(op) is StoredMessage:
                message_id = header_message_id(op.header)
                buf.append(
                    f'{head}{queue},"replication_id":{op.mid},"message_id":'
                    f'{json.dumps(message_id)},"digest":"{body_digest(op.body)}",'
                    f'"event":"{stored_event}","time":{now}}}\n'
                )
            elif type(op) is Settle:
                buf.append(
                    f'{head}{queue},"replication_id":{op.mid},"message_id":null,"digest":"",'
                    f'"event":"{AuditEvent.DEQUEUED.value}","time":{now}}}\n'
                )
        if len(buf) > 2048:
            self.flush()

    def flush(self) -> None:
        """Write buffered records; rotate the segment by size, age or epoch."""
        if not self._buf:
            return
        epoch = self._buf_epoch
        now = time.monotonic()
        if self._file is not None and (
            self._written >= self.segment_bytes
            or now - self._opened_at >= self.segment_seconds
            or epoch != self._epoch_of_file
        ):
            self.close_segment()
        if self._file is None:
            self._path = self.directory / f"{self.broker}-e{epoch:06d}-{self._seq:08d}.jsonl.open"
            self._seq += 1
            self._file = open(self._path, "a")  # noqa: SIM115 - kept open across flushes
            self._opened_at = now
            self._epoch_of_file = epoch
            self._written = 0
        data = "".join(self._buf)
        self._buf.clear()
        self._file.write(data)  # type: ignore[attr-defined]
        self._file.flush()  # type: ignore[attr-defined]
        self._written += len(data)

    def close_segment(self) -> None:
        """Close the open segment and publish it (rename off `.open`)."""
        if self._file is None or self._path is None:
            return
        self._file.close()  # type: ignore[attr-defined]
        os.replace(self._path, self._path.with_suffix(""))
        self._file = None
        self._path = None

    def tick(self) -> None:
        """Called every second: flush, and close a segment that has aged out."""
        self.flush()
        if self._file is not None and time.monotonic() - self._opened_at >= self.segment_seconds:
            self.close_segment()

    def close(self) -> None:
        """Flush and close (shutdown)."""
        self.flush()
        self.close_segment()
