"""Recovery: read a journal directory back into the live index and the recovered messages.

Segments are replayed oldest first; per (qid, mid) the last enqueued copy lives
until a settle removes it. This module reads and decides; it changes no file.
`facade.Journal.open` then acts on the outcome:

* a torn tail (`segment.SegmentScan.classify`) of the last segment is truncated,
  or a last segment torn while being created is removed: neither was confirmed;
* a damaged (corrupt) segment is never truncated or unlinked: every intact
  record in it is replayed, its live messages are re-appended to the new head
  segment, and compaction then moves the file into the quarantine folder.
  Messages in the unreadable bytes are lost; messages that a settle in them had
  removed come back (a duplicate, never a loss).

`check` is the same reading for `twinmq-broker journal check`: no lock, no change.

Sequence numbers here: `segno` (a segment file), `mid` (a message), and the
journal positions (`lsn`) are not stored on disk at all.
"""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from twinmq.broker.definitions import Definitions
from twinmq.broker.journal import deflog
from twinmq.broker.journal.errors import JournalError
from twinmq.broker.journal.index import LiveIndex, SegmentInfo
from twinmq.broker.journal.ops import TAG_MSG, StoredMessage
from twinmq.broker.journal.segment import Damage, SegmentScan, scan, segment_name, segment_number

__all__ = [
    "DEFINITIONS",
    "MID_MARGIN",
    "CheckReport",
    "Corruption",
    "Recovered",
    "Replay",
    "SegmentReport",
    "check",
    "decode_snapshot",
    "encode_definitions",
    "encode_snapshot",
    "read_definitions",
    "replay",
    "segment_numbers",
]

log = logging.getLogger("twinmq.broker.journal")

DEFINITIONS = "definitions.json"
CHECKSUM_KEY = "crc32"  # the definitions file's checksum (`encode_snapshot`)
GENERATION_KEY = "generation"  # the definitions log that follows the snapshot (deflog.py)
# Mids skipped after corruption in the newest segment: no later header bounds the
# mids lost in it, and reusing one could make a peer's copy look like a new message.
MID_MARGIN = 1 << 32


@dataclass(frozen=True, slots=True)
class Corruption:
    """One unreadable stretch of a segment that was not a torn tail."""

    segment: str  # file name
    offset: int
    length: int
    reason: str

    def describe(self) -> str:
        """One line for logs and `Recovered.errors`."""
        return (
            f"{self.segment}: {self.reason} at offset {self.offset} ({self.length} bytes "
            "unreadable; messages in them are lost, messages they settled may come back)"
        )


@dataclass
class Recovered:
    """What `Journal.open` found on disk."""

    definitions: Definitions
    # per qid, in enqueue order; only live (unsettled) ones, only qids present in definitions
    messages: dict[int, list[StoredMessage]]
    next_mid: int  # greater than every mid ever journaled
    torn_bytes: int  # bytes of a torn tail (truncated unless the segment is damaged)
    segments: int
    records: int
    # bytes that could not be read and were not a torn tail (corruption, logged as errors)
    corrupt_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    corruption: list[Corruption] = field(default_factory=list)
    # damaged segment files moved to the quarantine folder by this open
    quarantined: list[Path] = field(default_factory=list)
    reappended: int = 0  # live messages re-appended out of damaged segments
    # bytes of a torn tail of the definitions log (a change never acknowledged), truncated
    definitions_torn_bytes: int = 0


@dataclass(frozen=True, slots=True)
class SegmentReport:
    """One segment as `check` saw it."""

    name: str
    size: int
    records: int
    header_ok: bool
    torn: Damage | None
    corruption: list[Damage]


@dataclass
class Replay:
    """The outcome of replaying a directory's segments, before anything is acted on."""

    recovered: Recovered
    messages: dict[int, dict[int, StoredMessage]]
    segnos: list[int]  # every segment file found, ascending
    torn_segment: int | None = None  # last segment to remove (no header, no record)
    torn_tail: tuple[int, int] | None = None  # (segno, offset) to truncate at
    damaged: list[int] = field(default_factory=list)
    reports: list[SegmentReport] = field(default_factory=list)


def _definitions_checksum(defs: Definitions, generation: int | None = None) -> int:
    crc = zlib.crc32(defs.model_dump_json().encode())
    if generation is None:
        return crc
    # Covered too: a misread generation would ignore (or wrongly replay) the log.
    return zlib.crc32(str(generation).encode(), crc)


def encode_definitions(defs: Definitions) -> bytes:
    """A snapshot without a generation (as versions before the definitions log wrote it)."""
    return _encode(defs, None)


def encode_snapshot(defs: Definitions, generation: int) -> bytes:
    """The definitions file's bytes: the topology as JSON, its log generation, a checksum.

    Most bit flips leave valid JSON: a `qid` misread makes recovery drop that queue's
    messages as a deleted queue's. The checksum is of the topology as read back (JSON
    in, model, compact JSON out), so writing and reading compute it the same way.
    `generation` names the definitions log that follows this snapshot (deflog.py).
    """
    return _encode(defs, generation)


def _encode(defs: Definitions, generation: int | None) -> bytes:
    topology = json.loads(defs.model_dump_json())
    if generation is not None:
        topology[GENERATION_KEY] = generation
    # Of the topology as read back, as `decode_snapshot` computes it.
    read_back = json.dumps({k: v for k, v in topology.items() if k != GENERATION_KEY})
    topology[CHECKSUM_KEY] = _definitions_checksum(
        Definitions.model_validate_json(read_back), generation
    )
    return json.dumps(topology, indent=1, ensure_ascii=False).encode()


def read_definitions(directory: Path) -> tuple[Definitions, bool]:
    """The stored topology (snapshot and definitions log), and whether none is stored.

    Raises JournalError for damage (deflog.load): never start without the topology,
    every message would be dropped. A snapshot without a checksum or generation
    (written by an older version) is read as it is.
    """
    loaded = deflog.load(directory)
    return loaded.state.definitions(), loaded.missing


def decode_definitions(data: bytes, path: Path) -> Definitions:
    """The topology in a snapshot's bytes (JournalError if it does not read back)."""
    return decode_snapshot(data, path)[0]


def decode_snapshot(data: bytes, path: Path) -> tuple[Definitions, int]:
    """The topology in a snapshot's bytes and its log generation (0 when it has none)."""
    try:
        topology = json.loads(data)
        if not isinstance(topology, dict):
            raise ValueError("not a JSON object")
        stored = topology.pop(CHECKSUM_KEY, None)
        generation = topology.pop(GENERATION_KEY, None)
        if generation is not None and (type(generation) is not int or generation < 0):
            raise ValueError(f"bad generation {generation!r}")
        unknown = set(topology) - set(Definitions.model_fields)
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}")
        # As JSON (not the parsed dict): arguments' typed values read back (definitions.py).
        defs = Definitions.model_validate_json(json.dumps(topology))
    except (ValueError, ValidationError) as exc:
        raise JournalError(f"cannot read {path}: {exc}") from exc
    if stored is not None and stored != _definitions_checksum(defs, generation):
        raise JournalError(
            f"{path} is damaged (its checksum does not match): refusing to start, which "
            "would drop the messages of every queue it misreads; restore the file (a "
            "backup, or rebuild it from the peer's, docs/journal.md)"
        )
    return defs, generation or 0


def segment_numbers(directory: Path) -> list[int]:
    """The segment files of `directory`, oldest first."""
    return sorted(
        n for p in directory.iterdir() if p.is_file() and (n := segment_number(p.name)) is not None
    )


def replay(directory: Path, index: LiveIndex, definitions: Definitions) -> Replay:
    """Scan and replay the segments of `directory` into `index`, one file at a time.

    Classifies torn tails and corruption (and logs the corruption); changes nothing.
    """
    rec = Recovered(definitions, {}, 0, 0, 0, 0)
    segnos = segment_numbers(directory)
    out = Replay(rec, {}, segnos)
    messages = out.messages
    next_mid = 0
    bounded = True  # an intact header after the newest damage bounds its mids
    for i, segno in enumerate(segnos):
        # One segment in memory at a time: only live messages are kept.
        sc = scan((directory / segment_name(segno)).read_bytes(), segno)
        torn, corrupt = sc.classify(i == len(segnos) - 1)
        out.reports.append(
            SegmentReport(sc.name, sc.size, len(sc.records), sc.header_ok, torn, corrupt)
        )
        if sc.header_ok:
            bounded = True
        if torn is not None and torn.offset == 0:
            # A crash while creating the segment: nothing in it was confirmed (the
            # first batch and the directory entry are synced together).
            out.torn_segment = sc.segno
            rec.torn_bytes += sc.size
            continue
        next_mid = max(next_mid, sc.next_mid)
        seg = SegmentInfo(sc.segno, directory / sc.name, sc.size, damaged=bool(corrupt))
        index.add_segment(seg)
        for record in sc.records:
            for tag, qid, mid, stored, target in record.ops:
                if tag == TAG_MSG:
                    assert stored is not None
                    index.enqueue(qid, mid, sc.segno)
                    per_queue = messages.setdefault(qid, {})
                    per_queue.pop(mid, None)  # a re-enqueue moves to the back
                    per_queue[mid] = stored
                elif index.settle(qid, mid, sc.segno, target):
                    del messages[qid][mid]
                if mid >= next_mid:
                    next_mid = mid + 1
            rec.records += 1
        if torn is not None:
            rec.torn_bytes += torn.length
            if not corrupt:
                out.torn_tail = (sc.segno, torn.offset)
                seg.size = torn.offset
        if corrupt:
            out.damaged.append(sc.segno)
            bounded = False
            for damage in corrupt:
                _report(rec, sc, damage)
    if not bounded:
        # No later header bounds the mids that were in the damaged bytes.
        next_mid += MID_MARGIN
    rec.next_mid = next_mid
    return out


def _report(rec: Recovered, sc: SegmentScan, damage: Damage) -> None:
    found = Corruption(sc.name, damage.offset, damage.length, damage.reason)
    rec.corruption.append(found)
    rec.corrupt_bytes += damage.length
    text = found.describe()
    rec.errors.append(text)
    log.error("journal corruption: %s", text)


@dataclass
class CheckReport:
    """What `check` found (read-only)."""

    directory: Path
    segments: list[SegmentReport]
    records: int
    live_messages: int
    queues: int
    next_mid: int
    torn_bytes: int
    corruption: list[Corruption]

    @property
    def clean(self) -> bool:
        """Neither a torn tail nor corruption."""
        return not self.torn_bytes and not self.corruption


def check(directory: Path) -> CheckReport:
    """Scan and replay `directory` without locking or changing anything.

    Raises JournalError when it cannot be read at all (definitions, format).
    """
    if not directory.is_dir():
        raise JournalError(f"{directory} is not a directory")
    loaded = deflog.load(directory)
    definitions = loaded.state.definitions()
    logger = log.disabled
    log.disabled = True  # the report says it all; no error lines from a read-only check
    try:
        out = replay(directory, LiveIndex(), definitions)
    finally:
        log.disabled = logger
    qids = {q.qid for q in definitions.queues}
    live = sum(len(ms) for qid, ms in out.messages.items() if qid in qids)
    return CheckReport(
        directory=directory,
        segments=out.reports,
        records=out.recovered.records,
        live_messages=live,
        queues=len(qids),
        next_mid=out.recovered.next_mid,
        torn_bytes=out.recovered.torn_bytes + loaded.torn_bytes,
        corruption=out.recovered.corruption,
    )
