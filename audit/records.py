"""The audit log's record: one shared definition for the brokers and the Spark audit.

Brokers write one JSON object per line in rotated segment files under
`<data-dir>/audit/`; the Spark schema is derived from `AuditRecord` (never
written out by hand).
"""

from __future__ import annotations

import enum

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
    digest: str = Field(description="BLAKE2b-64 of the body, hex ('' for dequeue events)")
    event: AuditEvent
    time: float = Field(description="Unix time in seconds")


AUDIT_FIELDS: tuple[str, ...] = tuple(AuditRecord.model_fields)
