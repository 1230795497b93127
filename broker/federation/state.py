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
from datetime import UTC, datetime
from typing import Any, Final, Literal

from pamqp import commands
from pydantic import BaseModel, Field

from twinmq.broker import codec
from twinmq.broker.vhost import BUILTIN_EXCHANGES, VirtualHost

log = logging.getLogger(__name__)

STATE_EXCHANGE: Final = "amq.twinmq.state"
INTERNAL_QUEUES: Final = "amq.twinmq."


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
    """The definitions as they stand, keyed for comparison."""

    exchanges: dict[str, ExchangeState] = Field(default_factory=dict)
    queues: dict[str, QueueState] = Field(default_factory=dict)
    bindings: dict[str, BindingState] = Field(default_factory=dict)


def _plain(arguments: dict[str, Any]) -> dict[str, Any]:
    # Arguments may hold bytes, decimals or timestamps: as JSON sees them (str otherwise).
    plain: dict[str, Any] = json.loads(json.dumps(arguments, default=str, sort_keys=True))
    return plain


def snapshot(vhost: VirtualHost) -> Snapshot:
    """This server's definitions now (built-in exchanges and internal queues left out)."""
    builtin = {name for name, _ in BUILTIN_EXCHANGES}
    out = Snapshot()
    for exchange in vhost.exchanges.values():
        if exchange.name in builtin and exchange.name != "":
            pass
        elif exchange.name:
            d = exchange.definition
            out.exchanges[d.name] = ExchangeState(
                name=d.name, type=d.type, durable=d.durable, auto_delete=d.auto_delete,
                internal=d.internal, arguments=_plain(d.arguments),
            )  # fmt: skip
        if exchange.name in ("", STATE_EXCHANGE):
            continue  # the default exchange's bindings are implicit; subscriptions are not state
        for binding in exchange.bindings.values():
            if binding.queue.startswith(INTERNAL_QUEUES):
                continue
            state = BindingState(
                exchange=exchange.name, queue=binding.queue, routing_key=binding.routing_key,
                arguments=_plain(binding.arguments),
            )  # fmt: skip
            out.bindings[state.model_dump_json()] = state
    for queue in vhost.queues.values():
        if queue.name.startswith(INTERNAL_QUEUES):
            continue
        q = queue.definition
        out.queues[q.name] = QueueState(
            name=q.name, durable=q.durable, exclusive=q.exclusive, auto_delete=q.auto_delete,
            arguments=_plain(q.arguments),
        )  # fmt: skip
    return out


def difference(old: Snapshot, new: Snapshot) -> tuple[Snapshot, Removed]:
    """What appeared or changed from `old` to `new`, and what went."""
    added = Snapshot(
        exchanges={k: v for k, v in new.exchanges.items() if old.exchanges.get(k) != v},
        queues={k: v for k, v in new.queues.items() if old.queues.get(k) != v},
        bindings={k: v for k, v in new.bindings.items() if k not in old.bindings},
    )
    removed = Removed(
        exchanges=sorted(k for k in old.exchanges if k not in new.exchanges),
        queues=sorted(k for k in old.queues if k not in new.queues),
        bindings=[v for k, v in old.bindings.items() if k not in new.bindings],
    )
    return added, removed


class StatePublisher:
    """Publishes this server's definitions on `amq.twinmq.state` (see the module)."""

    def __init__(self, server_id: str, vhost: VirtualHost, epoch: Callable[[], int]) -> None:
        self.server_id = server_id
        self.vhost = vhost
        self.epoch = epoch
        self.seq = 0
        self.full_states = 0  # sent (status)
        self.changes = 0  # `changes` messages published (status)
        self.last = snapshot(vhost)
        self._subscribers: set[str] = set(self._bound())
        self._pending = False
        vhost.definition_listeners.append(self._changed)
        vhost.binding_listeners.append(self._bindings_changed)

    @property
    def subscribers(self) -> int:
        """Queues bound to `amq.twinmq.state` now."""
        return len(self._subscribers)

    def _bound(self) -> set[str]:
        exchange = self.vhost.exchanges.get(STATE_EXCHANGE)
        if exchange is None:
            return set()
        return {binding.queue for binding in exchange.bindings.values()}

    def _changed(self) -> None:
        if not self._pending:
            # Coalesced: a queue deleted with its bindings is one message, not five.
            self._pending = True
            self.vhost.clock.call_later(0, self.flush)

    def flush(self) -> None:
        """Publish what changed since the last message (nothing if nothing did)."""
        self._pending = False
        current = snapshot(self.vhost)
        added, removed = difference(self.last, current)
        self.last = current
        if not (
            added.exchanges or added.queues or added.bindings
            or removed.exchanges or removed.queues or removed.bindings
        ):  # fmt: skip
            return
        self.seq += 1
        self.changes += 1
        self._publish(
            STATE_EXCHANGE,
            "changes",
            StateMessage(
                kind="changes", server_id=self.server_id, epoch=self.epoch(), seq=self.seq,
                exchanges=list(added.exchanges.values()), queues=list(added.queues.values()),
                bindings=list(added.bindings.values()), removed=removed, time=time.time(),
            ),
        )  # fmt: skip

    def _bindings_changed(self, exchange: str) -> None:
        if exchange != STATE_EXCHANGE:
            return
        bound = self._bound()
        new = bound - self._subscribers
        self._subscribers = bound
        if not new or self.vhost.replica:
            return
        # Every change before the subscription goes out first (seq <= the full's), then
        # the full state, into the new queue only: one queue, in order.
        self.flush()
        state = self.last
        message = StateMessage(
            kind="full", server_id=self.server_id, epoch=self.epoch(), seq=self.seq,
            exchanges=list(state.exchanges.values()), queues=list(state.queues.values()),
            bindings=list(state.bindings.values()), time=time.time(),
        )  # fmt: skip
        for queue in sorted(new):
            self.full_states += 1
            self._publish("", queue, message)

    def _publish(self, exchange_name: str, routing_key: str, message: StateMessage) -> None:
        exchange = self.vhost.exchanges.get(exchange_name)
        if exchange is None or self.vhost.replica:
            return
        try:
            body = message.model_dump_json().encode()
            properties = commands.Basic.Properties(
                content_type="application/json",
                delivery_mode=1,
                message_type=message.kind,
                timestamp=datetime.fromtimestamp(int(message.time), UTC),
                app_id="twinmq-state",
            )
            header = codec.encode_header_payload(properties, len(body))
            info = codec.decode_content_header(header)
            self.vhost.publish(exchange, routing_key, header, body, info, forward=False)
        except Exception as exc:  # a state message never stops the broker's work
            log.warning("amq.twinmq.state: a %s message was not published: %r", message.kind, exc)


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
