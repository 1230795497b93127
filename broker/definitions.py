"""Durable topology: the shapes of exchanges, queues and bindings as they are stored.

These models are the one definition of the broker's topology used by the journal's
definitions file, the admin API and (later) configuration replication.

Every object belongs to a virtual host (`vhost`, RabbitMQ's definitions field); what
was stored before vhosts existed has none and reads as `/`, so old data directories
open unchanged. Names are unique within a vhost only.
"""

from __future__ import annotations

import operator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ExchangeType = Literal["direct", "fanout", "topic", "headers"]
DEFAULT_VHOST = "/"


def _is_default_vhost(vhost: str) -> bool:
    return vhost == DEFAULT_VHOST


# Left out of the JSON when `/`: what `/` stores is byte for byte what was stored before
# vhosts (the definitions snapshot's checksum is of that JSON; old files keep matching).
VhostField = Field(DEFAULT_VHOST, exclude_if=_is_default_vhost)


class ExchangeDef(BaseModel):
    """A declared exchange."""

    model_config = ConfigDict(frozen=True)

    name: str
    type: ExchangeType
    vhost: str = VhostField
    durable: bool = True
    auto_delete: bool = False
    internal: bool = False
    arguments: dict[str, Any] = Field(default_factory=dict)


class QueueDef(BaseModel):
    """A declared queue.

    `qid` is the queue's incarnation: a queue deleted and declared again under the
    same name gets a new `qid`, so journal records of the old one never resurrect.
    """

    model_config = ConfigDict(frozen=True)

    name: str
    qid: int
    vhost: str = VhostField
    durable: bool = True
    exclusive: bool = False
    auto_delete: bool = False
    arguments: dict[str, Any] = Field(default_factory=dict)


class BindingDef(BaseModel):
    """A binding from an exchange to a queue (exchange-to-exchange bindings are not supported)."""

    model_config = ConfigDict(frozen=True)

    exchange: str
    queue: str
    routing_key: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    vhost: str = VhostField


class Definitions(BaseModel):
    """Everything durable except messages: what the definitions file holds."""

    exchanges: list[ExchangeDef] = Field(default_factory=list)
    queues: list[QueueDef] = Field(default_factory=list)
    bindings: list[BindingDef] = Field(default_factory=list)
    next_qid: int = 1

    def vhost_names(self) -> set[str]:
        """The vhosts some object of these definitions belongs to."""
        return (
            {e.vhost for e in self.exchanges}
            | {q.vhost for q in self.queues}
            | {b.vhost for b in self.bindings}
        )

    def of_vhost(self, vhost: str) -> Definitions:
        """The part of these definitions in `vhost` (`next_qid` is the broker's: all of it)."""
        return Definitions(
            exchanges=[e for e in self.exchanges if e.vhost == vhost],
            queues=[q for q in self.queues if q.vhost == vhost],
            bindings=[b for b in self.bindings if b.vhost == vhost],
            next_qid=self.next_qid,
        )


class DefinitionsDelta(BaseModel):
    """One change of the durable topology: what a declare, bind, unbind or delete did.

    Applied in this order (`TopologyState.apply`): removed bindings, removed exchanges
    and queues (with every binding that names them, as the broker unbinds them),
    added exchanges and queues (replacing one of the same name), added bindings,
    then `next_qid` (only ever raised). A delta is a change in one vhost (`vhost`: the
    one `del_exchanges` and `del_queues` name; the added objects carry it too). Each
    part sets or removes one object by its identity, so applying a delta twice, or a
    run of deltas to a topology that already holds them, changes nothing (the
    definitions log relies on it).
    """

    model_config = ConfigDict(frozen=True)

    add_exchanges: list[ExchangeDef] = Field(default_factory=list)
    del_exchanges: list[str] = Field(default_factory=list)
    add_queues: list[QueueDef] = Field(default_factory=list)
    del_queues: list[str] = Field(default_factory=list)
    add_bindings: list[BindingDef] = Field(default_factory=list)
    del_bindings: list[BindingDef] = Field(default_factory=list)
    next_qid: int = 0  # 0: unchanged
    vhost: str = VhostField
    # The vhost itself is deleted (`DELETE /vhosts/{name}`), after the deltas that deleted
    # its content: a passive drops it then, as the active did. Left out when false, so
    # what is stored and sent without it is what versions before it wrote.
    drop_vhost: bool = Field(False, exclude_if=operator.not_)

    def __bool__(self) -> bool:
        return bool(
            self.drop_vhost
            or self.add_exchanges
            or self.del_exchanges
            or self.add_queues
            or self.del_queues
            or self.add_bindings
            or self.del_bindings
            or self.next_qid
        )


BindingKey = tuple[str, str, str, str, str]
Named = tuple[str, str]  # (vhost, name): an exchange's or a queue's identity


def binding_key(b: BindingDef) -> BindingKey:
    """A binding's identity: vhost, exchange, queue, routing key and its arguments (as
    routing.py tells two bindings apart)."""
    return (b.vhost, b.exchange, b.queue, b.routing_key, repr(sorted(b.arguments.items())))


class TopologyState:
    """A `Definitions` kept as dicts, so that a delta applies in time independent of its size."""

    def __init__(self, defs: Definitions | None = None) -> None:
        self.exchanges: dict[Named, ExchangeDef] = {}
        self.queues: dict[Named, QueueDef] = {}
        self.bindings: dict[BindingKey, BindingDef] = {}
        # Which bindings name an exchange / a queue: deleting one unbinds them.
        self._by_exchange: dict[Named, set[BindingKey]] = {}
        self._by_queue: dict[Named, set[BindingKey]] = {}
        self.next_qid = 1
        if defs is not None:
            self.apply(
                DefinitionsDelta(
                    add_exchanges=defs.exchanges,
                    add_queues=defs.queues,
                    add_bindings=defs.bindings,
                    next_qid=defs.next_qid,
                )
            )

    def qids(self) -> set[int]:
        """The incarnation ids of the queues held."""
        return {q.qid for q in self.queues.values()}

    def apply(self, delta: DefinitionsDelta) -> list[int]:
        """Apply `delta`; return the qids of the queues it removed (or replaced)."""
        dropped: list[int] = []
        vhost = delta.vhost
        if delta.drop_vhost:
            # Its content went by the deltas before; whatever is left of it goes too.
            return self._drop_vhost(vhost)
        for b in delta.del_bindings:
            self._unbind(binding_key(b))
        for name in delta.del_exchanges:
            self.exchanges.pop((vhost, name), None)
            for key in list(self._by_exchange.get((vhost, name), ())):
                self._unbind(key)
        for name in delta.del_queues:
            old = self.queues.pop((vhost, name), None)
            if old is not None:
                dropped.append(old.qid)
            for key in list(self._by_queue.get((vhost, name), ())):
                self._unbind(key)
        for e in delta.add_exchanges:
            self.exchanges[(e.vhost, e.name)] = e
        for q in delta.add_queues:
            old = self.queues.get((q.vhost, q.name))
            if old is not None and old.qid != q.qid:
                dropped.append(old.qid)
            self.queues[(q.vhost, q.name)] = q
        for b in delta.add_bindings:
            key = binding_key(b)
            self.bindings[key] = b
            self._by_exchange.setdefault((b.vhost, b.exchange), set()).add(key)
            self._by_queue.setdefault((b.vhost, b.queue), set()).add(key)
        self.next_qid = max(self.next_qid, delta.next_qid)
        return dropped

    def _drop_vhost(self, vhost: str) -> list[int]:
        dropped = [q.qid for key, q in self.queues.items() if key[0] == vhost]
        for binding in [k for k in self.bindings if k[0] == vhost]:
            self._unbind(binding)
        for named in [k for k in self.exchanges if k[0] == vhost]:
            del self.exchanges[named]
        for named in [k for k in self.queues if k[0] == vhost]:
            del self.queues[named]
        return dropped

    def _unbind(self, key: BindingKey) -> None:
        if self.bindings.pop(key, None) is None:
            return
        exchange, queue = (key[0], key[1]), (key[0], key[2])
        self._by_exchange[exchange].discard(key)
        if not self._by_exchange[exchange]:
            del self._by_exchange[exchange]
        self._by_queue[queue].discard(key)
        if not self._by_queue[queue]:
            del self._by_queue[queue]

    def definitions(self) -> Definitions:
        """The whole topology (bindings whose exchange or queue is not held are left out)."""
        return Definitions(
            exchanges=list(self.exchanges.values()),
            queues=list(self.queues.values()),
            bindings=[
                b
                for b in self.bindings.values()
                if (b.vhost, b.exchange) in self.exchanges and (b.vhost, b.queue) in self.queues
            ],
            next_qid=self.next_qid,
        )
