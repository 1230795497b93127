"""The durable topology on disk: a snapshot plus an append-only log of changes.

Files (in the journal directory)::

    definitions.json   the snapshot (recovery.py's format; `"generation": g` since the log)
    definitions.log    header: magic "TMQD" | u32 version | u64 generation | u32 crc32
                       (of the 16 bytes before it), then records framed like the
                       journal's (segment.py): u32 length | u32 crc32 | JSON of one
                       `DefinitionsDelta`, or a JSON array of them (a group commit)

Every declare, bind, unbind or delete appends one record and fsyncs the log (the
caller blocks, so a declare-ok still means durable): its cost does not grow with
the topology, where rewriting the whole snapshot did. The changes of one loop turn
go together (`append_many`, the group commit of commit.py): one record holding all
of them (a JSON array of deltas; a single change stays one object, as an older
version wrote it), one write, one fsync. The group has one CRC, so a crash leaves
all of it or a torn tail (none of it was acknowledged before the fsync): never
some of a group's changes without the ones before them. When the log grows past the
snapshot's size (and `COMPACT_MIN_BYTES`), the topology is written as a new
snapshot of generation g+1 (tmp, fsync, rename, directory fsync) and only then an
empty log of generation g+1 replaces the old one (tmp, fsync, rename, directory
fsync). Recovery reads the snapshot and replays the log only if the generations
match, so a crash at any step recovers the same topology: before the snapshot's
rename the old snapshot and its whole log; after it, the new snapshot (which holds
every change of the old log, or replaces them: `replace`) and a stale log, ignored.

A torn tail of the log (a crash mid-append: the change was never acknowledged) is
truncated. Any other unreadable record is damage: the topology after it cannot be
known, and guessing would drop the messages of a queue whose declaration was in
the lost bytes, so opening refuses with an error naming the file and offset and
changes nothing (like a damaged snapshot). A data directory without a log (an
older version's) loads as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from twinmq.broker.definitions import Definitions, DefinitionsDelta, TopologyState
from twinmq.broker.journal.errors import (
    DefinitionsDamaged,
    DiskFullError,
    JournalError,
    io_error,
)
from twinmq.broker.journal.segment import REC, frame, frame_at

__all__ = [
    "COMPACT_MIN_BYTES",
    "LOG",
    "DefinitionsStore",
    "LoadedDefinitions",
    "load",
]

log = logging.getLogger("twinmq.broker.journal")

LOG = "definitions.log"
SNAPSHOT = "definitions.json"
MAGIC = b"TMQD"
VERSION = 1
_HEADER = struct.Struct("<4sIQI")  # magic, version, generation, crc
_HEADER_CRC = struct.Struct("<4sIQ")
# Below this the log is never compacted: a small topology would be rewritten too often.
COMPACT_MIN_BYTES = 256 * 1024

# Tests only: called with a step's name before it runs (a crash there is an exception).
FaultHook = Callable[[str], None]


def encode_log_header(generation: int) -> bytes:
    """The header of a log of `generation`."""
    crc = zlib.crc32(_HEADER_CRC.pack(MAGIC, VERSION, generation))
    return _HEADER.pack(MAGIC, VERSION, generation, crc)


_GROUP = TypeAdapter(list[DefinitionsDelta])


def encode_record(deltas: list[DefinitionsDelta]) -> bytes:
    """A record's payload: one delta as an object, a group of them as an array."""
    if len(deltas) == 1:
        return deltas[0].model_dump_json(exclude_defaults=True).encode()
    items = b",".join(d.model_dump_json(exclude_defaults=True).encode() for d in deltas)
    return b"[" + items + b"]"


def decode_record(payload: bytes) -> list[DefinitionsDelta]:
    """The deltas of a record's payload (raises ValidationError if it is not one)."""
    if payload[:1] == b"[":
        return _GROUP.validate_json(payload)
    return [DefinitionsDelta.model_validate_json(payload)]


@dataclass
class LoadedDefinitions:
    """What `load` read: the topology and how the files stood."""

    state: TopologyState
    generation: int
    missing: bool  # no snapshot and no log: a new directory
    snapshot_bytes: int
    log_bytes: int  # the valid length of the log (header and intact records); 0: none
    log_records: int
    torn_bytes: int  # bytes of a torn tail past `log_bytes` (truncated by the store)
    stale_log: bool  # the log is of an older generation (a crash after a snapshot)


def load(directory: Path) -> LoadedDefinitions:
    """Read the snapshot and replay its log; change nothing.

    Raises JournalError for damage (a snapshot that does not read back, a log
    header or a record before the tail that does not).
    """
    # Imported here: recovery imports this module for `check`.
    from twinmq.broker.journal.recovery import decode_snapshot

    snap = directory / SNAPSHOT
    path = directory / LOG
    try:
        data = snap.read_bytes()
    except FileNotFoundError:
        data = None
    defs, generation = (Definitions(), 0) if data is None else decode_snapshot(data, snap)
    state = TopologyState(defs)
    out = LoadedDefinitions(state, generation, data is None, len(data or b""), 0, 0, 0, False)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return out
    out.missing = False
    if len(raw) < _HEADER.size:
        raise JournalError(f"{path} is damaged: short header ({len(raw)} bytes); restore it")
    magic, version, log_gen, crc = _HEADER.unpack_from(raw)
    if magic != MAGIC or zlib.crc32(_HEADER_CRC.pack(magic, version, log_gen)) != crc:
        raise JournalError(f"{path} is damaged: bad header; refusing to start (restore it)")
    if version != VERSION:
        raise JournalError(f"{path}: unknown definitions log version {version}")
    if log_gen < generation:
        out.stale_log = True  # the snapshot already holds (or replaced) all of it
        return out
    if data is None:
        raise JournalError(
            f"{snap} is missing but {path} follows it: refusing to start, which would "
            "drop the messages of every queue in it (restore the snapshot)"
        )
    if log_gen > generation:
        raise JournalError(
            f"{path} is of generation {log_gen} but {snap} of {generation}: the snapshot "
            "is not the one this log follows (restore the pair together)"
        )
    pos, size = _HEADER.size, len(raw)
    view = memoryview(raw)
    try:
        while pos < size:
            end, why = frame_at(raw, view, pos, size)
            if not end:
                if _intact_record_after(raw, view, pos, size):
                    raise DefinitionsDamaged(
                        f"{path} is damaged: {why} at offset {pos} with intact changes after "
                        "it; refusing to start rather than guess the topology (the file is "
                        "kept; restore it, or rebuild the data directory from the peer)",
                        file=LOG,
                        offset=pos,
                        length=size - pos,
                        reason=str(why),
                    )
                out.torn_bytes = size - pos
                break
            try:
                deltas = decode_record(raw[pos + REC.size : end])
            except ValidationError as exc:
                raise JournalError(
                    f"{path}: intact record at offset {pos} that does not decode: {exc}"
                ) from exc
            for delta in deltas:
                state.apply(delta)
            out.log_records += 1
            pos = end
    finally:
        view.release()
    out.log_bytes = pos
    return out


def _intact_record_after(data: bytes, view: memoryview, pos: int, size: int) -> bool:
    """Whether an intact record starts anywhere after a bad one at `pos` (damage, not a tail).

    A torn append leaves only a prefix of one record, so nothing intact follows it.
    Records are JSON objects or arrays: candidates are the offsets 8 bytes before a
    '{' or a '['.
    """
    start = pos + 1 + REC.size
    while True:
        found = [i for i in (data.find(b"{", start), data.find(b"[", start)) if i >= 0]
        if not found:
            return False
        brace = min(found)
        if frame_at(data, view, brace - REC.size, size)[0]:
            return True
        start = brace + 1


class DefinitionsStore:
    """The snapshot and its log, open for appending (the journal owns one)."""

    def __init__(
        self,
        directory: Path,
        dir_fd: Callable[[], int],
        *,
        fsync: bool = True,
        compact_min_bytes: int = COMPACT_MIN_BYTES,
    ) -> None:
        self._dir = directory
        self._dir_fd = dir_fd
        self._fsync = fsync
        self._compact_min = compact_min_bytes
        self._fd = -1
        self._broken: JournalError | None = None
        self.state = TopologyState()
        self.generation = 0
        self.snapshot_bytes = 0
        self.log_bytes = 0  # 0: no log file yet
        self.log_records = 0
        self.compactions = 0
        self.fault: FaultHook | None = None  # tests only

    def open(self) -> LoadedDefinitions:
        """Load (`load`), remove leftovers of a crash, truncate a torn tail."""
        for name in (SNAPSHOT + ".tmp", LOG + ".tmp"):
            with contextlib.suppress(FileNotFoundError):
                (self._dir / name).unlink()
        loaded = load(self._dir)
        self.state = loaded.state
        self.generation = loaded.generation
        self.snapshot_bytes = loaded.snapshot_bytes
        self.log_records = loaded.log_records
        path = self._dir / LOG
        if loaded.stale_log:
            log.info("definitions log of an older generation (a compaction's crash): reset")
            self._new_log()
        elif loaded.log_bytes:
            self._fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            self.log_bytes = loaded.log_bytes
            if loaded.torn_bytes:
                log.warning(
                    "definitions log: truncating torn tail at offset %d (%d bytes, a change "
                    "that was never acknowledged)",
                    loaded.log_bytes,
                    loaded.torn_bytes,
                )
                try:
                    os.ftruncate(self._fd, loaded.log_bytes)
                    self._sync(self._fd)
                except OSError as exc:
                    raise io_error("truncating the definitions log's torn tail", exc) from exc
        return loaded

    def close(self) -> None:
        """Close the log."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = -1

    def definitions(self) -> Definitions:
        """The whole topology as stored."""
        return self.state.definitions()

    def append(self, delta: DefinitionsDelta) -> list[int]:
        """Durably record one change (one write, one fsync); return the qids it dropped.

        On failure nothing of it is on disk or in `state`: DiskFullError for a full
        disk (the log is cut back), JournalError otherwise.
        """
        return self.append_many([delta])

    def append_many(self, deltas: list[DefinitionsDelta]) -> list[int]:
        """Durably record changes in order, all in one write and one fsync (a group
        commit); return the qids they dropped.

        All or nothing, as `append`: on failure none of them is in `state` and the
        log is cut back to where it was.
        """
        if not deltas:
            return []
        if self._broken is not None:
            raise JournalError(f"definitions log failed: {self._broken}") from self._broken
        if self._fd < 0:
            if self.snapshot_bytes:
                self._new_log()
            else:
                # A log always follows a snapshot: a lost snapshot is then never
                # mistaken for a new directory (whose messages recovery would drop).
                self._write_snapshot(self.state.definitions())
            if self._fd < 0:
                self._new_log()  # the snapshot's own attempt failed: its error, now
        record = frame(encode_record(deltas))
        try:
            self._hook("append")  # inside: a test's OSError is a write that failed
            written = os.pwrite(self._fd, record, self.log_bytes)
            if written != len(record):
                raise OSError(28, "No space left on device (short write)")
            self._sync(self._fd)
        except OSError as exc:
            err = io_error("appending to the definitions log", exc)
            try:
                os.ftruncate(self._fd, self.log_bytes)
            except OSError as cut:
                self._broken = io_error("cutting back a failed definitions log append", cut)
                raise self._broken from exc
            if not isinstance(err, DiskFullError):
                # After a failed fsync the file's contents are unknown (journal's rule).
                self._broken = err
            raise err from exc
        self.log_bytes += len(record)
        self.log_records += 1
        dropped = [qid for d in deltas for qid in self.state.apply(d)]
        if self.log_bytes > max(self.snapshot_bytes, self._compact_min):
            try:
                self._write_snapshot(self.state.definitions())
            except JournalError as exc:
                # The change is durable in the log; the snapshot waits for a later change.
                log.warning("definitions log not compacted (it stays valid): %s", exc)
        return dropped

    def checkpoint(self) -> None:
        """Fold the log into a new snapshot if it holds any change (a clean shutdown).

        A stopped broker's definitions.json is then its whole topology, readable as it
        is; a failure leaves the log, which stays valid.
        """
        if self.log_records and self._broken is None:
            try:
                self._write_snapshot(self.state.definitions())
            except JournalError as exc:
                log.warning("definitions log not folded into the snapshot at close: %s", exc)

    def replace(self, defs: Definitions) -> list[int]:
        """Durably replace the whole topology (a passive's catch-up); return the qids dropped."""
        if self._broken is not None:
            raise JournalError(f"definitions log failed: {self._broken}") from self._broken
        old = self.state.qids()
        self._write_snapshot(defs)
        self.state = TopologyState(defs)
        return sorted(old - self.state.qids())

    def _write_snapshot(self, defs: Definitions) -> None:
        """Snapshot of generation g+1, then an empty log of g+1 (the order the module names)."""
        from twinmq.broker.journal.recovery import encode_snapshot

        generation = self.generation + 1
        data = encode_snapshot(defs, generation)
        tmp = self._dir / (SNAPSHOT + ".tmp")
        try:
            self._hook("snapshot-write")
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                self._sync(f.fileno())
            self._hook("snapshot-rename")
            os.replace(tmp, self._dir / SNAPSHOT)
            self._sync(self._dir_fd())
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise io_error("saving definitions", exc) from exc
        self.generation = generation
        self.snapshot_bytes = len(data)
        self.compactions += 1
        self._hook("log-reset")
        try:
            self._new_log()
        except JournalError as exc:
            # The new snapshot holds everything: the old log is stale from now on, and
            # the next append tries a new one again.
            log.warning("definitions log not reset yet: %s", exc)
            self.close()
            self.log_bytes = 0

    def _new_log(self) -> None:
        """An empty log of the current generation in place of any other (tmp, fsync, rename)."""
        tmp = self._dir / (LOG + ".tmp")
        header = encode_log_header(self.generation)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, header)
                self._sync(fd)
                os.replace(tmp, self._dir / LOG)
                self._sync(self._dir_fd())
            except BaseException:
                os.close(fd)
                raise
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise io_error("starting a definitions log", exc) from exc
        self.close()
        self._fd = fd
        self.log_bytes = len(header)
        self.log_records = 0

    def _sync(self, fd: int) -> None:
        if self._fsync:
            os.fsync(fd)

    def _hook(self, step: str) -> None:
        if self.fault is not None:
            self.fault(step)
