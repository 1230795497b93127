"""The audit log's record: one shared definition for the brokers and the Spark audit.

Brokers write JSON lines in rotated segment files under `<data-dir>/audit/`; the
Spark schema is derived from `AuditRecord` (never written out by hand). A line is
either one `AuditRecord` (format 1, still read) or, as brokers write since format
2, an `AuditBatch`: the records of one group commit for one queue and event, the
per-message fields as lists (one line per batch instead of one per message keeps
the broker's cost per message small). `segment_columns` reads both into records.
"""

from __future__ import annotations

import enum
import json
import zlib
from typing import Any

from pydantic import BaseModel, Field


class AuditEvent(enum.StrEnum):
    """What happened to a message on the broker that wrote the record."""

    CONFIRMED = "confirmed"  # active: on its disk and acknowledged by the in-sync passive
    CONFIRMED_ALONE = "confirmed-alone"  # active, degraded: on its own disk only
    REPLICATED = "replicated"  # passive: on its disk
    DEQUEUED = "dequeued"  # acknowledged, expired, dropped or discarded: settled for good


class AuditRecord(BaseModel):
    """One replication event."""

    broker: str = Field(description="Name of the broker that wrote the record")
    epoch: int = Field(description="The broker's epoch when it wrote the record")
    queue: str = Field(description="Queue name")
    replication_id: int = Field(description="The message's replication ID (same on both brokers)")
    message_id: str | None = Field(description="The publisher's message-id property, if set")
    digest: str = Field(
        description="Body digest: CRC-32, 8 hex digits (BLAKE2b-64, 16 hex digits, in "
        "format 1); '' for dequeue events"
    )
    event: AuditEvent
    time: float = Field(description="Unix time in seconds")


class AuditBatch(BaseModel):
    """One line of a segment (format 2): the records of one batch, one queue, one event.

    `message_ids` and `digests` (one per replication id, in order) are present for
    the stored events and absent for `dequeued` (no message id, digest '').
    """

    broker: str
    epoch: int
    queue: str
    event: AuditEvent
    time: float
    replication_ids: list[int]
    message_ids: list[str | None] | None = None
    digests: list[str] | None = None


AUDIT_FIELDS: tuple[str, ...] = tuple(AuditRecord.model_fields)
BATCH_FIELDS: tuple[str, ...] = tuple(AuditBatch.model_fields)
_LIST_FIELDS = {
    "replication_ids": "replication_id",
    "message_ids": "message_id",
    "digests": "digest",
}


def body_digest(body: bytes) -> str:
    """The digest a broker records for a body (CRC-32, as the journal's records use)."""
    return "%08x" % zlib.crc32(body)  # noqa: UP031 (the writer maps this format in C)


class SegmentFormatError(ValueError):
    """A segment line that is neither an `AuditRecord` nor an `AuditBatch`."""


def segment_columns(data: bytes) -> dict[str, list[Any]]:
    """The records of a segment's JSON lines (either format, mixed), as columns by field.

    Records keep the order of the log: a batch's records in list order, where its
    line stands. Types are checked by whoever builds the table (`AuditRecord`,
    Arrow); the shapes (known fields, equal list lengths) here.
    """
    cols: dict[str, list[Any]] = {name: [] for name in AUDIT_FIELDS}
    record_fields = set(AUDIT_FIELDS)
    batch_fields = set(BATCH_FIELDS)
    for number, line in enumerate(data.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise SegmentFormatError(f"line {number}: not JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise SegmentFormatError(f"line {number}: not an object")
        if "replication_ids" not in obj:  # format 1: one record
            if not obj.keys() <= record_fields:
                unknown = obj.keys() - record_fields
                raise SegmentFormatError(f"line {number}: unknown fields {unknown}")
            for name in AUDIT_FIELDS:
                cols[name].append(obj.get(name))
            continue
        if not obj.keys() <= batch_fields:
            raise SegmentFormatError(f"line {number}: unknown fields {obj.keys() - batch_fields}")
        ids = obj["replication_ids"]
        if not isinstance(ids, list):
            raise SegmentFormatError(f"line {number}: replication_ids is not a list")
        n = len(ids)
        for plural, name in _LIST_FIELDS.items():
            values = obj.get(plural)
            if values is None:  # dequeued: none of either; stored: digests not recorded
                values = [None if name == "message_id" else ""] * n
            elif not isinstance(values, list) or len(values) != n:
                raise SegmentFormatError(f"line {number}: {plural} does not match replication_ids")
            cols[name] += values
        for name in ("broker", "epoch", "queue", "event", "time"):
            cols[name] += [obj.get(name)] * n
    return cols


def segment_records(data: bytes) -> list[AuditRecord]:
    """The records of a segment's JSON lines (either format), validated."""
    cols = segment_columns(data)
    return [
        AuditRecord.model_validate(dict(zip(AUDIT_FIELDS, values, strict=True)))
        for values in zip(*cols.values(), strict=True)
    ]
