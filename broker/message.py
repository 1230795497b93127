"""Messages as the broker holds them, and their place in a queue."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Message:
    """One published message; shared by every queue it was routed to.

    `header` is the raw content-header payload as the publisher sent it, re-sent
    unchanged to consumers; `mid` is the broker-wide sequence number the journal
    and replication know it by.
    """

    mid: int
    exchange: str
    routing_key: str
    header: bytes
    body: bytes
    persistent: bool
    expiration_ms: int | None
    message_id: str | None


@dataclass(slots=True, eq=False)
class Entry:
    """A message in one queue: its own expiry, redelivery flag and journal status.

    `batch` is the group-commit batch whose outcome decides whether the entry is
    taken at all (docs/journal.md, Visibility): until that batch is complete no
    consumer sees it, and if it fails the entry is withdrawn. 0: visible now.
    """

    message: Message
    expires_at: float | None
    journaled: bool
    redelivered: bool = False
    batch: int = 0

    @property
    def size(self) -> int:
        """Body size in bytes (what `x-max-length-bytes` counts)."""
        return len(self.message.body)
