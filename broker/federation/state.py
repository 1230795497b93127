"""State replication (seed 002): this server's definitions for subscribers, over AMQP.

Every server has the fanout exchange `amq.twinmq.state` (built in). A subscriber (an
operator's tool, another broker) binds a queue to it and receives, **in that one queue**:

1. a `full` state as soon as its binding is made: every exchange, queue and binding here
   (the built-in exchanges and the broker's internal `amq.twinmq.*` queues left out);
2. then `changes` messages, each the difference since the previous one (what appeared or
   changed, what went), published after each change (coalesced within one turn of the
   event loop).

One queue for both, as the seed asks ("state changes ... must be serialised with
respect to the receiving server; it is not suitable to create two channels"): the full
state is enqueued into the new subscriber's queue in the same turn of the event loop as
its binding, after every change before it was flushed to the exchange; every message
carries `seq` (this server's change counter) and a `changes` message with `seq` at most
the last `full`'s is already in that full state. A subscriber applies changes with a
greater `seq` and ignores the others. After a lost connection (its exclusive queue gone)
it subscribes again and gets a full state again, which replaces what it held: no stale
object survives a cut. `epoch` (the pair's epoch) and `seq` together order the
messages of one active broker; a new active (failover, restart) starts `seq` again,
and the subscriber's connection to the old one ended anyway.

Messages are JSON (`StateMessage`), transient, routing key and `type` the kind; nothing
is published on a passive.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from pydantic import BaseModel, Field

from twinmq.broker.federation.peer import publish_status
from twinmq.broker.vhost import BUILTIN_EXCHANGES, VirtualHost

log = logging.getLogger(__name__)

STATE_EXCHANGE: Final = "amq.twinmq.state"
INTERNAL_QUEUES: Final = "amq.twinmq."
COST_FACTOR: Final = 10.0
"""A comparison of the whole state starts at most once per this many times its last cost."""
_BUILTIN: Final = frozenset(name for name, _ in BUILTIN_EXCHANGES)


class ExchangeState(BaseModel):
    """An exchange's definition."""

    name: str
    type: str
    durable: bool
    auto_delete: bool
    internal: bool
    arguments: dict[str, Any] = Field(default_factory=dict)


class QueueState(BaseModel):
    """A queue's definition."""

    name: str
    durable: bool
    exclusive: bool
    auto_delete: bool
    arguments: dict[str, Any] = Field(default_factory=dict)


class BindingState(BaseModel):
    """A binding of a queue to an exchange."""

    exchange: str
    queue: str
    routing_key: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class Removed(BaseModel):
    """What went since the previous message (names; bindings in full)."""

    exchanges: list[str] = Field(default_factory=list)
    queues: list[str] = Field(default_factory=list)
    bindings: list[BindingState] = Field(default_factory=list)


class StateMessage(BaseModel):
    """One message on `amq.twinmq.state` (JSON body)."""

    kind: Literal["full", "changes"] = Field(
        description="full: every definition here; changes: since the previous message"
    )
    server_id: str = Field(description="This server's identifier")
    epoch: int = Field(description="The broker (pair) epoch: a new active starts seq again")
    seq: int = Field(description="This server's change counter; a full state is as of seq")
    exchanges: list[ExchangeState] = Field(
        default_factory=list, description="full: all; changes: appeared or changed"
    )
    queues: list[QueueState] = Field(default_factory=list)
    bindings: list[BindingState] = Field(default_factory=list)
    removed: Removed = Field(default_factory=Removed, description="changes: what went")
    time: float = Field(description="When, in seconds since the epoch")


class Snapshot(BaseModel):
    """Definitions keyed for lookup (a subscriber's view, `StateView`)."""

    exchanges: dict[str, ExchangeState] = Field(default_factory=dict)
    queues: dict[str, QueueState] = Field(default_factory=dict)
    bindings: dict[str, BindingState] = Field(default_factory=dict)


# The publisher compares plain tuples, not models: it compares the whole state at every
# change (coalesced per turn of the event loop), so that has to be cheap.
ExchangeRow = tuple[str, bool, bool, bool, str]
"""type, durable, auto-delete, internal, arguments (JSON)"""
QueueRow = tuple[bool, bool, bool, str]
"""durable, exclusive, auto-delete, arguments (JSON)"""
BindingRow = tuple[str, str, str, str]
"""exchange, queue, routing key, arguments (JSON)"""


@dataclass(slots=True)
class Rows:
    """This server's definitions as the publisher compares them."""

    exchanges: dict[str, ExchangeRow] = field(default_factory=dict)
    queues: dict[str, QueueRow] = field(default_factory=dict)
    bindings: set[BindingRow] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.exchanges or self.queues or self.bindings)


def _json(arguments: dict[str, Any]) -> str:
    # Arguments may hold bytes, decimals or timestamps: as JSON sees them (str otherwise).
    return json.dumps(arguments, default=str, sort_keys=True) if arguments else "{}"


def rows(vhost: VirtualHost) -> Rows:
    """This server's definitions now (built-in exchanges and internal queues left out)."""
    out = Rows()
    for exchange in vhost.exchanges.values():
        name = exchange.name
        if name not in _BUILTIN:
            d = exchange.definition
            out.exchanges[name] = (d.type, d.durable, d.auto_delete, d.internal, _json(d.arguments))
        if name in ("", STATE_EXCHANGE):
            continue  # the default exchange's bindings are implicit; subscriptions are not state
        for binding in exchange.bindings.values():
            if not binding.queue.startswith(INTERNAL_QUEUES):
                out.bindings.add(
                    (name, binding.queue, binding.routing_key, _json(binding.arguments))
                )
    for queue in vhost.queues.values():
        if not queue.name.startswith(INTERNAL_QUEUES):
            q = queue.definition
            out.queues[q.name] = (q.durable, q.exclusive, q.auto_delete, _json(q.arguments))
    return out


def difference(old: Rows, new: Rows) -> tuple[Rows, Rows]:
    """(what appeared or changed, what went) from `old` to `new`."""
    added = Rows(
        {k: v for k, v in new.exchanges.items() if old.exchanges.get(k) != v},
        {k: v for k, v in new.queues.items() if old.queues.get(k) != v},
        new.bindings - old.bindings,
    )
    removed = Rows(
        {k: v for k, v in old.exchanges.items() if k not in new.exchanges},
        {k: v for k, v in old.queues.items() if k not in new.queues},
        old.bindings - new.bindings,
    )
    return added, removed


def _exchanges(part: Rows) -> list[ExchangeState]:
    return [
        ExchangeState(
            name=name,
            type=t,
            durable=durable,
            auto_delete=auto_delete,
            internal=internal,
            arguments=json.loads(arguments),
        )
        for name, (t, durable, auto_delete, internal, arguments) in sorted(part.exchanges.items())
    ]


def _queues(part: Rows) -> list[QueueState]:
    return [
        QueueState(
            name=name,
            durable=durable,
            exclusive=exclusive,
            auto_delete=auto_delete,
            arguments=json.loads(arguments),
        )
        for name, (durable, exclusive, auto_delete, arguments) in sorted(part.queues.items())
    ]


def _bindings(part: Rows) -> list[BindingState]:
    return [
        BindingState(exchange=e, queue=q, routing_key=k, arguments=json.loads(a))
        for e, q, k, a in sorted(part.bindings)
    ]


class StatePublisher:
    """Publishes this server's definitions on `amq.twinmq.state` (see the module).

    With no subscriber nothing is compared or kept: a change costs one set lookup."""

    def __init__(self, server_id: str, vhost: VirtualHost, epoch: Callable[[], int]) -> None:
        self.server_id = server_id
        self.vhost = vhost
        self.epoch = epoch
        self.seq = 0
        self.full_states = 0  # sent (status)
        self.changes = 0  # `changes` messages published (status)
        self._subscribers: set[str] = self._bound()
        # The state as the subscribers last heard it (None: no subscriber).
        self.last: Rows | None = rows(vhost) if self._subscribers else None
        self._pending = False
        self._next_flush = 0.0  # time.monotonic() before which no comparison starts
        vhost.definition_listeners.append(self._changed)
        vhost.binding_listeners.append(self._bindings_changed)

    @property
    def subscribers(self) -> int:
        """Queues bound to `amq.twinmq.state` now."""
        return len(self._subscribers)

    def counts(self) -> tuple[int, int, int]:
        """(exchanges, queues, bindings) in the state now (status)."""
        state = self.last if self.last is not None and not self._pending else rows(self.vhost)
        return len(state.exchanges), len(state.queues), len(state.bindings)

    def _bound(self) -> set[str]:
        exchange = self.vhost.exchanges.get(STATE_EXCHANGE)
        if exchange is None:
            return set()
        return {binding.queue for binding in exchange.bindings.values()}

    def _changed(self) -> None:
        if self.last is None or self._pending:
            return
        # Coalesced: a queue deleted with its bindings is one message, not five; and
        # the whole state is compared at most once per COST_FACTOR times what the last
        # comparison took (about 30 ms for 10,000 queues and bindings here: a `changes`
        # message at most every 0.3 s under churn, the broker's time spent on it bounded).
        self._pending = True
        delay = max(0.0, self._next_flush - time.monotonic())
        self.vhost.clock.call_later(delay, self.flush)

    def flush(self) -> None:
        """Publish what changed since the last message (nothing if nothing did)."""
        self._pending = False
        if self.last is None:
            return  # no subscriber: nothing to tell
        started = time.monotonic()
        current = rows(self.vhost)
        added, removed = difference(self.last, current)
        self.last = current
        self._next_flush = started + COST_FACTOR * (time.monotonic() - started)
        if not (added or removed):
            return
        self.seq += 1
        self.changes += 1
        self._publish(
            STATE_EXCHANGE,
            "changes",
            StateMessage(
                kind="changes", server_id=self.server_id, epoch=self.epoch(), seq=self.seq,
                exchanges=_exchanges(added), queues=_queues(added), bindings=_bindings(added),
                removed=Removed(
                    exchanges=sorted(removed.exchanges), queues=sorted(removed.queues),
                    bindings=_bindings(removed),
                ),
                time=time.time(),
            ),
        )  # fmt: skip

    def _bindings_changed(self, exchange: str) -> None:
        if exchange != STATE_EXCHANGE:
            return
        bound = self._bound()
        new = bound - self._subscribers
        self._subscribers = bound
        if not bound:
            self.last = None  # nobody listens: stop comparing
            return
        if not new or self.vhost.replica:
            return
        # Every change before the subscription goes out first (seq <= the full's), then
        # the full state, into the new queue only: one queue, in order.
        self.flush()
        if self.last is None:
            self.last = rows(self.vhost)
        state = self.last
        message = StateMessage(
            kind="full", server_id=self.server_id, epoch=self.epoch(), seq=self.seq,
            exchanges=_exchanges(state), queues=_queues(state), bindings=_bindings(state),
            time=time.time(),
        )  # fmt: skip
        for queue in sorted(new):
            self.full_states += 1
            self._publish("", queue, message)

    def _publish(self, exchange_name: str, routing_key: str, message: StateMessage) -> None:
        publish_status(
            self.vhost, exchange_name, routing_key, message, message.kind, message.time,
            "twinmq-state",
        )  # fmt: skip


class StateView:
    """A subscriber's copy of a peer's definitions, built from its `amq.twinmq.state`
    messages (an ops tool's, a test's): a full state replaces everything; a `changes`
    message applies if its `seq` is past the last full state's, and is ignored before
    the first full state."""

    def __init__(self) -> None:
        self.state: Snapshot | None = None
        self.server_id: str | None = None
        self.epoch = 0
        self.seq = 0

    def apply(self, message: StateMessage) -> bool:
        """Apply one message in queue order; whether it changed the view."""
        if message.kind == "full":
            self.state = Snapshot(
                exchanges={e.name: e for e in message.exchanges},
                queues={q.name: q for q in message.queues},
                bindings={b.model_dump_json(): b for b in message.bindings},
            )
            self.server_id, self.epoch, self.seq = message.server_id, message.epoch, message.seq
            return True
        if self.state is None or message.epoch != self.epoch or message.seq <= self.seq:
            return False
        self.seq = message.seq
        for name in message.removed.exchanges:
            self.state.exchanges.pop(name, None)
        for name in message.removed.queues:
            self.state.queues.pop(name, None)
        for binding in message.removed.bindings:
            self.state.bindings.pop(binding.model_dump_json(), None)
        for exchange in message.exchanges:
            self.state.exchanges[exchange.name] = exchange
        for queue in message.queues:
            self.state.queues[queue.name] = queue
        for binding in message.bindings:
            self.state.bindings[binding.model_dump_json()] = binding
        return True
