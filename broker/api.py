"""The admin API's wire shapes (shared with the operator and the kubectl plugin)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

Role = Literal["active", "passive"]


class QueueStatus(BaseModel):
    """One queue as `GET /status` reports it."""

    name: str
    durable: bool
    exclusive: bool
    messages: int = Field(description="Ready messages")
    unacked: int = Field(description="Delivered, not yet acknowledged")
    consumers: int
    bytes: int = Field(description="Bytes of ready message bodies")


class JournalStatus(BaseModel):
    """The journal's state."""

    segments: int
    bytes: int
    live_messages: int
    durable_batch: int = Field(description="Newest group-commit batch known durable")


class BrokerStatus(BaseModel):
    """`GET /status`."""

    name: str
    version: str
    role: Role
    epoch: int
    ready: bool = Field(description="Serving clients (active), or promotable without loss")
    uptime_seconds: float
    connections: int
    channels: int
    alarms: list[str]
    queues: list[QueueStatus]
    journal: JournalStatus


class ErrorBody(BaseModel):
    """Body of every admin API error."""

    error: str
    detail: str = ""
