"""Queues: ordered entries, consumers served round-robin, TTL and length limits.

No I/O here: a queue hands entries to consumers and reports the entries it
drops (expired, over length) through `on_drop`, so the virtual host can settle
them in the journal and dead-letter them.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from twinmq.broker import metrics
from twinmq.broker.codec import MAX_EXPIRY_MS
from twinmq.broker.definitions import QueueDef
from twinmq.broker.errors import AMQPError, ReplyCode, channel_error
from twinmq.broker.message import Entry

log = logging.getLogger(__name__)

_TRACED: set[str] = set()

DropReason = Literal["expired", "maxlen", "rejected", "delete"]
Overflow = Literal["drop-head", "reject-publish", "reject-publish-dlx"]


class Consumer(Protocol):
    """What a queue needs from a consumer (a channel's subscription)."""

    tag: str
    exclusive: bool

    def ready(self) -> bool:
        """Whether the consumer may take one more message now (prefetch, flow, socket)."""
        ...

    def deliver(self, queue: Queue, entry: Entry) -> None:
        """Take the entry (the queue has already removed it)."""
        ...


class Completion(Protocol):
    """How far group commit has got: entries of later batches are not visible yet."""

    @property
    def complete(self) -> int:
        """Every batch up to this one has its outcome (complete or failed)."""
        ...


class QueueArgs:
    """The `x-*` arguments a queue understands, validated as RabbitMQ validates them."""

    def __init__(self, arguments: dict[str, Any]) -> None:
        def non_negative(key: str) -> int | None:
            value = arguments.get(key)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise channel_error(
                    ReplyCode.PRECONDITION_FAILED,
                    f"invalid arg '{key}' for queue: {value!r} is not a non-negative integer",
                    (50, 10),
                )
            return value

        def timer(key: str) -> int | None:
            # A timer longer than RabbitMQ's bound (2^32-1 ms, 49 days) is refused as there.
            value = non_negative(key)
            if value is not None and value > MAX_EXPIRY_MS:
                raise channel_error(
                    ReplyCode.PRECONDITION_FAILED,
                    f"invalid arg '{key}' for queue: {value} is larger than {MAX_EXPIRY_MS}",
                    (50, 10),
                )
            return value

        self.message_ttl = timer("x-message-ttl")
        self.expires = timer("x-expires")
        if self.expires == 0:
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED, "invalid arg 'x-expires': must be positive", (50, 10)
            )
        self.max_length = non_negative("x-max-length")
        self.max_length_bytes = non_negative("x-max-length-bytes")
        overflow = arguments.get("x-overflow", "drop-head")
        if overflow not in ("drop-head", "reject-publish", "reject-publish-dlx"):
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED, f"invalid arg 'x-overflow': {overflow!r}", (50, 10)
            )
        self.overflow: Overflow = overflow
        dlx = arguments.get("x-dead-letter-exchange")
        dlrk = arguments.get("x-dead-letter-routing-key")
        for key, value in (("x-dead-letter-exchange", dlx), ("x-dead-letter-routing-key", dlrk)):
            if value is not None and not isinstance(value, str):
                raise channel_error(
                    ReplyCode.PRECONDITION_FAILED, f"invalid arg '{key}': not a string", (50, 10)
                )
            # Both end up in basic.deliver as short strings: 255 bytes at most.
            if value is not None and len(value.encode("utf-8", "surrogatepass")) > 255:
                raise channel_error(
                    ReplyCode.PRECONDITION_FAILED,
                    f"invalid arg '{key}': longer than 255 bytes",
                    (50, 10),
                )
        self.dead_letter_exchange: str | None = dlx
        self.dead_letter_routing_key: str | None = dlrk
        qtype = arguments.get("x-queue-type", "classic")
        # Quorum and stream declarations are accepted as durable classic queues: TwinMQ's
        # replication gives every durable queue the pair's guarantees.
        if qtype not in ("classic", "quorum"):
            raise channel_error(
                ReplyCode.PRECONDITION_FAILED, f"invalid arg 'x-queue-type': {qtype!r}", (50, 10)
            )

    @classmethod
    def lenient(cls, name: str, arguments: dict[str, Any]) -> QueueArgs:
        """The arguments of a queue that exists already (recovered or replicated).

        A queue declared under other rules (an older broker, a peer of another
        version) must still come back: an argument these rules refuse is ignored,
        with one error line, instead of failing the broker's start.
        """
        try:
            return cls(arguments)
        except AMQPError:
            pass
        kept: dict[str, Any] = {}
        for key, value in arguments.items():
            try:
                cls({**kept, key: value})
            except AMQPError as exc:
                log.error("queue %r: ignoring its argument %r: %s", name, key, exc.text)
                continue
            kept[key] = value
        return cls(kept)


@dataclass(frozen=True)
class LengthCap:
    """The broker's ceiling on every client queue (`--max-queue-length`,
    `--max-queue-length-bytes`; 0: none), counted as `x-max-length` counts: ready messages
    and their body bytes.

    A queue's own `x-max-length` may drop its head; the cap never does: a publish it
    refuses is refused as by `x-overflow: reject-publish` (nacked under confirms, a
    transaction's commit refused), since a limit the application never asked for must
    not drop a message it was confirmed.
    """

    messages: int = 0
    bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.messages or self.bytes)

    def refuses(self, queue: Queue, count: int, size: int) -> bool:
        """Whether `count` more messages of `size` body bytes in all take `queue` past it."""
        return queue.exceeds(count, size, self.messages or None, self.bytes or None)

    def describe(self) -> str:
        """The cap in words, for a refusal's reason."""
        parts = [f"{self.messages} messages" if self.messages else "",
                 f"{self.bytes} bytes" if self.bytes else ""]  # fmt: skip
        return "at most " + ", ".join(p for p in parts if p)


NO_CAP = LengthCap()
"""No ceiling (the default)."""


class Queue:
    """A message queue."""

    def __init__(
        self,
        definition: QueueDef,
        owner: object | None,
        on_drop: Callable[[Queue, Entry, DropReason], None],
        completion: Completion,
        *,
        lenient: bool = False,
    ) -> None:
        self.definition = definition
        self.args = (
            QueueArgs.lenient(definition.name, definition.arguments)
            if lenient
            else QueueArgs(definition.arguments)
        )
        self.owner = owner  # the connection of an exclusive queue
        self.entries: deque[Entry] = deque()
        self.bytes = 0
        self.consumers: list[Consumer] = []
        self.delivered: dict[int, Entry] = {}  # delivered, not yet settled, by mid
        # Entries whose handling failed (quarantined), by mid: never delivered, never
        # settled, so they stay in the journal and come back (and are retried) on restart.
        self.held_aside: dict[int, Entry] = {}
        self.had_consumers = False
        self.deleted = False
        self._next_consumer = 0
        self._on_drop = on_drop
        self._completion = completion

    @property
    def name(self) -> str:
        """The queue's name."""
        return self.definition.name

    @property
    def durable(self) -> bool:
        """Whether the queue survives a restart."""
        return self.definition.durable

    @property
    def unacked(self) -> int:
        """Delivered messages not yet acknowledged."""
        return len(self.delivered)

    def remove_mid(self, mid: int) -> Entry | None:
        """Remove a ready entry by replication ID (the passive applying a dequeue)."""
        entries = self.entries
        # Dequeues arrive nearly in queue order: the head is the usual hit.
        if entries and entries[0].message.mid == mid:
            entry = entries.popleft()
        else:
            for entry in entries:
                if entry.message.mid == mid:
                    entries.remove(entry)
                    break
            else:
                return None
        self.bytes -= entry.size
        return entry

    def sort_by_mid(self) -> None:
        """Restore publish order (replication IDs grow with it) after a catch-up."""
        self.entries = deque(sorted(self.entries, key=lambda e: e.message.mid))

    @property
    def message_count(self) -> int:
        """Ready messages (not counting those delivered and unacknowledged)."""
        return len(self.entries)

    def exceeds(self, count: int, size: int, messages: int | None, bytes_: int | None) -> bool:
        """Whether `count` more messages of `size` body bytes in all take the queue past
        `messages` ready messages or `bytes_` body bytes (None: no such limit)."""
        return (messages is not None and len(self.entries) + count > messages) or (
            bytes_ is not None and self.bytes + size > bytes_
        )

    def is_full_for(self, count: int, size: int) -> bool:
        """Whether `count` more messages of `size` bytes in all exceed its own length limits."""
        return self.exceeds(count, size, self.args.max_length, self.args.max_length_bytes)

    def push(self, entry: Entry) -> None:
        """Append an entry at the tail, enforcing drop-head length limits."""
        self.entries.append(entry)
        self.bytes += entry.size
        a = self.args
        if a.max_length is not None or a.max_length_bytes is not None:
            while self.entries and self.exceeds(0, 0, a.max_length, a.max_length_bytes):
                self._drop(self.entries.popleft(), "maxlen")

    def requeue(self, entries: list[Entry]) -> None:
        """Put delivered entries back at the head, oldest first, marked redelivered."""
        for entry in sorted(entries, key=lambda e: e.message.mid, reverse=True):
            entry.redelivered = True
            self.entries.appendleft(entry)
            self.bytes += entry.size

    def pop(self, now: float) -> Entry | None:
        """Remove and return the head entry, dropping expired ones first.

        None also while the head waits for its batch (in order: what was published
        after it waits too); `Visibility` dispatches the queue when it completes.
        """
        self.expire(now)
        entries = self.entries
        if not entries or entries[0].batch > self._completion.complete:
            return None
        entry = entries.popleft()
        self.bytes -= entry.size
        return entry

    def withdraw(self, batch: int) -> list[Entry]:
        """Take out the entries waiting for `batch` (it failed); return them."""
        gone = [e for e in self.entries if e.batch == batch]
        if gone:
            self.entries = deque(e for e in self.entries if e.batch != batch)
            self.bytes -= sum(e.size for e in gone)
        return gone

    def expire(self, now: float) -> None:
        """Drop expired entries at the head (RabbitMQ expires from the head only)."""
        entries = self.entries
        while entries:
            head = entries[0]
            if head.expires_at is None or head.expires_at > now:
                return
            entries.popleft()
            self.bytes -= head.size
            self._on_drop(self, head, "expired")

    def next_expiry(self) -> float | None:
        """When the head entry expires, if it does."""
        return self.entries[0].expires_at if self.entries else None

    def purge(self) -> list[Entry]:
        """Remove every ready entry and return them."""
        gone = list(self.entries)
        self.entries.clear()
        self.bytes = 0
        return gone

    def hold_aside(self, entry: Entry, stage: str, error: BaseException | str) -> None:
        """Quarantine an entry whose handling failed: one log line, a metric, kept.

        The failure stays with this message: the queue, its consumers and the
        client whose action led here carry on.
        """
        mid = entry.message.mid
        if mid in self.held_aside:
            return
        self.held_aside[mid] = entry
        metrics.QUARANTINED.labels(stage).inc()
        metrics.HELD_ASIDE.inc()
        reason = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        log.error(
            "queue %r: message %d quarantined during %s (%s); it is kept and retried on restart",
            self.name,
            mid,
            stage,
            reason,
        )
        if not isinstance(error, str) and stage not in _TRACED:
            # The first failure of a stage gets its traceback, for the bug report.
            _TRACED.add(stage)
            log.error("traceback of the first %s failure", stage, exc_info=error)

    def _drop(self, entry: Entry, reason: DropReason) -> None:
        self.bytes -= entry.size
        self._on_drop(self, entry, reason)

    def add_consumer(self, consumer: Consumer) -> None:
        """Subscribe a consumer; exclusivity is checked here."""
        if any(c.exclusive for c in self.consumers):
            raise channel_error(
                ReplyCode.ACCESS_REFUSED,
                f"queue '{self.name}' in vhost '/' has an exclusive consumer",
                (60, 20),
            )
        if consumer.exclusive and self.consumers:
            raise channel_error(
                ReplyCode.ACCESS_REFUSED,
                f"cannot obtain exclusive access to queue '{self.name}' in vhost '/'",
                (60, 20),
            )
        self.consumers.append(consumer)
        self.had_consumers = True

    def remove_consumer(self, consumer: Consumer) -> None:
        """Unsubscribe a consumer (no-op if it is not subscribed)."""
        if consumer in self.consumers:
            self.consumers.remove(consumer)

    def dispatch(self, now: float) -> None:
        """Hand ready entries to ready consumers, round-robin."""
        consumers = self.consumers
        entries = self.entries
        while entries and consumers:
            n = len(consumers)
            start = self._next_consumer % n
            for i in range(n):
                consumer = consumers[(start + i) % n]
                if consumer.ready():
                    break
            else:
                return
            entry = self.pop(now)
            if entry is None:
                return
            self._next_consumer = (start + i + 1) % n
            try:
                consumer.deliver(self, entry)
            except Exception as exc:  # one message's failure never stops the queue
                if entry.message.mid not in self.delivered:  # else it did go out
                    self.hold_aside(entry, "delivery", exc)
