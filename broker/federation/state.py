"""State replication (seed 002): this server's definitions for subscribers, over AMQP.

Every server has the fanout exchange `amq.twinmq.state` (built in). A subscriber (an
operator's tool, another broker) binds a queue to it and receives, **in that one queue**:

1. a `full` state as soon as its binding is made: every exchange, queue and binding here
   (the built-in exchanges and the broker's internal `amq.twinmq.*` queues left out);
2. then `changes` messages, each the difference since the previous one (what appeared or
   changed, what went), published after each change (coalesced within one turn of the
   event loop) and computed from what the changes touched (`Tracker`: O(change), not
   O(state)).

One queue for both, as the seed asks ("state changes ... must be serialised with
respect to the receiving server; it is not suitable to create two channels"): the full
state is enqueued into the new subscriber's queue in the same turn of the event loop as
its binding, after every change before it was flushed to the exchange; every message
carries `seq` (this server's change counter) and a `changes` message with `seq` at most
the last `full`'s is already in that full state; each `changes` message's `seq` is the
previous one's plus one. A subscriber applies the next one, ignores those at or before
its `seq`, and on a gap (a message missed: a length limit on its queue, a publish that
failed) unbinds its queue and binds it again, and so gets a full state again. After a
lost connection (its exclusive queue gone) it subscribes again and gets a full state
again, which replaces what it held: no stale object survives a cut. `epoch` (the
pair's epoch) and `seq` together order the messages of one active broker; a new active
(failover, restart) starts `seq` again, and the subscriber's connection to the old one
ended anyway.

Messages are JSON (`StateMessage`), transient, routing key and `type` the kind; nothing
is published on a passive.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar

from pydantic import BaseModel, Field

from twinmq.broker.definitions import BindingDef
from twinmq.broker.federation.peer import publish_status
from twinmq.broker.queue import Queue
from twinmq.broker.routing import Exchange
from twinmq.broker.vhost import BUILTIN_EXCHANGES, Touched, VirtualHost

log = logging.getLogger(__name__)

STATE_EXCHANGE: Final = "amq.twinmq.state"
INTERNAL_QUEUES: Final = "amq.twinmq."
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


# The publisher keeps plain tuples, not models: what the subscribers last heard, brought
# up to date one touched name at a time (`Tracker`), so that has to be cheap.
ExchangeRow = tuple[str, bool, bool, bool, str]
"""type, durable, auto-delete, internal, arguments (JSON)"""
QueueRow = tuple[bool, bool, bool, str]
"""durable, exclusive, auto-delete, arguments (JSON)"""
BindingRow = tuple[str, str, str, str]
"""exchange, queue, routing key, arguments (JSON)"""


@dataclass(slots=True)
class Rows:
    """This server's definitions as the publisher keeps them."""

    exchanges: dict[str, ExchangeRow] = field(default_factory=dict)
    queues: dict[str, QueueRow] = field(default_factory=dict)
    bindings: set[BindingRow] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.exchanges or self.queues or self.bindings)


def _json(arguments: dict[str, Any]) -> str:
    # Arguments may hold bytes, decimals or timestamps: as JSON sees them (str otherwise).
    return json.dumps(arguments, default=str, sort_keys=True) if arguments else "{}"


def _exchange_row(exchange: Exchange) -> ExchangeRow:
    d = exchange.definition
    return (d.type, d.durable, d.auto_delete, d.internal, _json(d.arguments))


def _queue_row(queue: Queue) -> QueueRow:
    q = queue.definition
    return (q.durable, q.exclusive, q.auto_delete, _json(q.arguments))


def _binding_row(binding: BindingDef) -> BindingRow:
    return (binding.exchange, binding.queue, binding.routing_key, _json(binding.arguments))


def _stated_bindings(name: str) -> bool:
    # The default exchange's bindings are implicit; subscriptions are not state.
    return name not in ("", STATE_EXCHANGE)


def _scan(vhost: VirtualHost) -> tuple[Rows, dict[BindingRow, BindingDef]]:
    out = Rows()
    defs: dict[BindingRow, BindingDef] = {}
    for exchange in vhost.exchanges.values():
        name = exchange.name
        if name not in _BUILTIN:
            out.exchanges[name] = _exchange_row(exchange)
        if not _stated_bindings(name):
            continue
        for binding in exchange.bindings.values():
            if not binding.queue.startswith(INTERNAL_QUEUES):
                row = _binding_row(binding)
                out.bindings.add(row)
                defs[row] = binding
    for queue in vhost.queues.values():
        if not queue.name.startswith(INTERNAL_QUEUES):
            out.queues[queue.name] = _queue_row(queue)
    return out, defs


def rows(vhost: VirtualHost) -> Rows:
    """This server's definitions now (built-in exchanges and internal queues left out)."""
    return _scan(vhost)[0]


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


_R = TypeVar("_R")


class Tracker:
    """The state as the subscribers last heard it (`rows`), kept up to date from what
    each change touched (`VirtualHost.state_listeners`): `changes` compares only the
    touched names with what they were, so a change costs O(change), not O(state).

    A touched exchange or queue is compared by its row; when its *object* is not the one
    last seen (created, deleted, replaced), every binding last heard under its name is
    checked again too (a deleted queue's bindings go with it, without a binding change
    each). A touched binding is looked up in its exchange now. `Touched.everything`
    (a passive's replicated topology, an undone change: rare) compares the whole state.
    """

    def __init__(self, vhost: VirtualHost) -> None:
        self.vhost = vhost
        self.rows = Rows()
        self._defs: dict[BindingRow, BindingDef] = {}
        self._by_exchange: dict[str, set[BindingRow]] = {}
        self._by_queue: dict[str, set[BindingRow]] = {}
        self._exchange_objects: dict[str, Exchange] = {}
        self._queue_objects: dict[str, Queue] = {}
        self._exchanges: set[str] = set()
        self._queues: set[str] = set()
        self._bindings: dict[BindingRow, BindingDef] = {}
        self._everything = False
        self._load()

    def _load(self) -> None:
        self.rows, defs = _scan(self.vhost)
        self._defs, self._by_exchange, self._by_queue = {}, {}, {}
        for row, binding in defs.items():
            self._hold(row, binding)
        self._exchange_objects = dict(self.vhost.exchanges)
        self._queue_objects = dict(self.vhost.queues)

    def touch(self, touched: Touched) -> None:
        """Note what a change touched (compared at the next `changes`)."""
        if touched.everything:
            self._everything = True
            return
        self._exchanges.update(touched.exchanges)
        self._queues.update(touched.queues)
        for binding in touched.bindings:
            self._bindings[_binding_row(binding)] = binding

    @property
    def pending(self) -> bool:
        """Whether something was touched since the last `changes`."""
        return bool(self._everything or self._exchanges or self._queues or self._bindings)

    def changes(self) -> tuple[Rows, Rows]:
        """(what appeared or changed, what went) since the last call; `rows` made current."""
        if self._everything:
            old = self.rows
            self._everything = False
            self._exchanges.clear()
            self._queues.clear()
            self._bindings.clear()
            self._load()
            return difference(old, self.rows)
        added, removed = Rows(), Rows()
        exchanges, self._exchanges = self._exchanges, set()
        queues, self._queues = self._queues, set()
        bindings, self._bindings = self._bindings, {}
        last = self.rows
        for name in exchanges:
            exchange = self.vhost.exchanges.get(name)
            stated = exchange is not None and name not in _BUILTIN
            erow = _exchange_row(exchange) if exchange is not None and stated else None
            _compare(last.exchanges, name, erow, added.exchanges, removed.exchanges)
            if exchange is not self._exchange_objects.get(name):
                self._recheck(self._by_exchange.get(name, ()), bindings)
                if exchange is None:
                    self._exchange_objects.pop(name, None)
                else:
                    self._exchange_objects[name] = exchange
                    if _stated_bindings(name):
                        for binding in exchange.bindings.values():
                            bindings.setdefault(_binding_row(binding), binding)
        for name in queues:
            queue = self.vhost.queues.get(name)
            internal = name.startswith(INTERNAL_QUEUES)
            qrow = _queue_row(queue) if queue is not None and not internal else None
            _compare(last.queues, name, qrow, added.queues, removed.queues)
            if queue is not self._queue_objects.get(name):
                self._recheck(self._by_queue.get(name, ()), bindings)
                if queue is None:
                    self._queue_objects.pop(name, None)
                else:
                    self._queue_objects[name] = queue
        for brow, binding in bindings.items():
            held = self._holds(binding)
            if held and brow not in last.bindings:
                last.bindings.add(brow)
                self._hold(brow, binding)
                added.bindings.add(brow)
            elif not held and brow in last.bindings:
                last.bindings.discard(brow)
                self._release(brow)
                removed.bindings.add(brow)
        return added, removed

    def _recheck(self, held: Iterable[BindingRow], into: dict[BindingRow, BindingDef]) -> None:
        for row in held:
            into.setdefault(row, self._defs[row])

    def _holds(self, binding: BindingDef) -> bool:
        """Whether `binding` is state now (its exchange has it)."""
        if not _stated_bindings(binding.exchange) or binding.queue.startswith(INTERNAL_QUEUES):
            return False
        exchange = self.vhost.exchanges.get(binding.exchange)
        return exchange is not None and Exchange.binding_key(binding) in exchange.bindings

    def _hold(self, row: BindingRow, binding: BindingDef) -> None:
        self._defs[row] = binding
        self._by_exchange.setdefault(binding.exchange, set()).add(row)
        self._by_queue.setdefault(binding.queue, set()).add(row)

    def _release(self, row: BindingRow) -> None:
        binding = self._defs.pop(row)
        for index, name in ((self._by_exchange, binding.exchange), (self._by_queue, binding.queue)):
            rows_of = index[name]
            rows_of.discard(row)
            if not rows_of:
                del index[name]


def _compare(
    last: dict[str, _R], name: str, row: _R | None, added: dict[str, _R], removed: dict[str, _R]
) -> None:
    if row == last.get(name):
        return
    if row is None:
        removed[name] = last.pop(name)
    else:
        added[name] = last[name] = row


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

    With no subscriber nothing is kept: a change costs one attribute lookup. With
    subscribers a change costs what it touched (`Tracker`), whatever the state's size."""

    def __init__(self, server_id: str, vhost: VirtualHost, epoch: Callable[[], int]) -> None:
        self.server_id = server_id
        self.vhost = vhost
        self.epoch = epoch
        self.seq = 0
        self.full_states = 0  # sent (status)
        self.changes = 0  # `changes` messages published (status)
        self._subscribers: set[str] = self._bound()
        # The state as the subscribers last heard it (None: no subscriber).
        self.tracker: Tracker | None = Tracker(vhost) if self._subscribers else None
        self._pending = False
        vhost.state_listeners.append(self._touched)
        vhost.binding_listeners.append(self._bindings_changed)

    @property
    def subscribers(self) -> int:
        """Queues bound to `amq.twinmq.state` now."""
        return len(self._subscribers)

    def counts(self) -> tuple[int, int, int]:
        """(exchanges, queues, bindings) in the state now (status)."""
        tracker = self.tracker
        state = tracker.rows if tracker is not None and not tracker.pending else rows(self.vhost)
        return len(state.exchanges), len(state.queues), len(state.bindings)

    def _bound(self) -> set[str]:
        exchange = self.vhost.exchanges.get(STATE_EXCHANGE)
        if exchange is None:
            return set()
        return {binding.queue for binding in exchange.bindings.values()}

    def _touched(self, touched: Touched) -> None:
        if self.tracker is None:
            return
        self.tracker.touch(touched)
        if self._pending:
            return
        # Coalesced within one turn of the event loop: a queue deleted with its bindings
        # is one message, not five.
        self._pending = True
        self.vhost.clock.call_later(0.0, self.flush)

    def flush(self) -> None:
        """Publish what changed since the last message (nothing if nothing did)."""
        self._pending = False
        if self.tracker is None:
            return  # no subscriber: nothing to tell
        added, removed = self.tracker.changes()
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
            self.tracker = None  # nobody listens: keep nothing
            return
        if not new or self.vhost.replica:
            return
        # Every change before the subscription goes out first (seq <= the full's), then
        # the full state, into the new queue only: one queue, in order.
        self.flush()
        if self.tracker is None:
            self.tracker = Tracker(self.vhost)
        state = self.tracker.rows
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
    message applies if its `seq` is the next after the view's, is ignored before the
    first full state and at or before the view's `seq` (already in it), and past the
    next one is a **gap** (a message missed: `gap` set, nothing applied until a full
    state). On a gap, ask for a full state: unbind the queue from `amq.twinmq.state`
    and bind it again; the full state follows in the same queue."""

    def __init__(self) -> None:
        self.state: Snapshot | None = None
        self.server_id: str | None = None
        self.epoch = 0
        self.seq = 0
        self.gap = False
        self.gaps = 0  # seen (status, tests)

    def apply(self, message: StateMessage) -> bool:
        """Apply one message in queue order; whether it changed the view."""
        if message.kind == "full":
            self.state = Snapshot(
                exchanges={e.name: e for e in message.exchanges},
                queues={q.name: q for q in message.queues},
                bindings={b.model_dump_json(): b for b in message.bindings},
            )
            self.server_id, self.epoch, self.seq = message.server_id, message.epoch, message.seq
            self.gap = False
            return True
        if self.state is None or self.gap or message.epoch != self.epoch:
            return False
        if message.seq <= self.seq:
            return False
        if message.seq != self.seq + 1:
            # A message missed (its queue's length limit, a publish that failed): what
            # this view holds can no longer be brought up to date by changes.
            self.gap = True
            self.gaps += 1
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
