"""Durable topology: the shapes of exchanges, queues and bindings as they are stored.

These models are the one definition of the broker's topology used by the journal's
definitions file, the admin API and (later) configuration replication.

Every object belongs to a virtual host (`vhost`, RabbitMQ's definitions field); what
was stored before vhosts existed has none and reads as `/`, so old data directories
open unchanged. Names are unique within a vhost only.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import decimal
import math
import operator
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationInfo,
)

ExchangeType = Literal["direct", "fanout", "topic", "headers"]
DEFAULT_VHOST = "/"


def _is_default_vhost(vhost: str) -> bool:
    return vhost == DEFAULT_VHOST


# Left out of the JSON when `/`: what `/` stores is byte for byte what was stored before
# vhosts (the definitions snapshot's checksum is of that JSON; old files keep matching).
VhostField = Field(DEFAULT_VHOST, exclude_if=_is_default_vhost)


# Arguments are AMQP field tables; JSON has no byte arrays, decimals, timestamps or
# non-finite floats. Each such value is stored as a one-key object named for its type
# (a table whose one key is such a name is wrapped in `__table__`), so that what a
# client declared reads back the same after a restart, on a passive, at a mirror:
# stored as it came, a byte array read back as a string (its re-declare was refused as
# inequivalent, a headers binding on it stopped matching). Plain values are stored as
# before, so older files read, and checksum, unchanged.
_BYTES, _DECIMAL, _TIMESTAMP, _FLOAT, _TABLE = (
    "__bytes__",
    "__decimal__",
    "__timestamp__",
    "__float__",
    "__table__",
)
_TAGS = frozenset((_BYTES, _DECIMAL, _TIMESTAMP, _FLOAT, _TABLE))


def _value_to_json(value: Any) -> Any:
    if isinstance(value, dict):
        table = {key: _value_to_json(item) for key, item in value.items()}
        return {_TABLE: table} if len(table) == 1 and next(iter(table)) in _TAGS else table
    if isinstance(value, list | tuple):
        return [_value_to_json(item) for item in value]
    if isinstance(value, bytes | bytearray):
        return {_BYTES: base64.b64encode(value).decode()}
    if isinstance(value, decimal.Decimal):
        return {_DECIMAL: str(value)}
    if isinstance(value, datetime.datetime):
        return {_TIMESTAMP: value.isoformat()}
    if isinstance(value, float) and not math.isfinite(value):
        return {_FLOAT: repr(value)}  # 'nan', 'inf', '-inf': float() reads them back
    return value


def _value_from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [_value_from_json(item) for item in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag in _TAGS and isinstance(inner, str):
            try:
                if tag == _BYTES:
                    # A bytearray, as pamqp decodes a byte array: a binding is told apart
                    # by the repr of its arguments (binding_key), so an unbind matches.
                    return bytearray(base64.b64decode(inner, validate=True))
                if tag == _DECIMAL:
                    return decimal.Decimal(inner)
                if tag == _TIMESTAMP:
                    return datetime.datetime.fromisoformat(inner)
                if tag == _FLOAT:
                    return float(inner)
            except (ValueError, binascii.Error, decimal.InvalidOperation) as exc:
                raise ValueError(f"argument {tag} {inner!r} does not read back: {exc}") from exc
        if tag == _TABLE and isinstance(inner, dict):
            return {key: _value_from_json(item) for key, item in inner.items()}
    return {key: _value_from_json(item) for key, item in value.items()}


def _arguments_from_json(value: Any, info: ValidationInfo) -> Any:
    # Only what was read from JSON carries the tags; a client's table in memory (python
    # mode) is taken as it is, even one whose key looks like a tag.
    return _value_from_json(value) if info.mode == "json" and isinstance(value, dict) else value


Arguments = Annotated[
    dict[str, Any],
    BeforeValidator(_arguments_from_json),
    PlainSerializer(_value_to_json, when_used="json"),
]
"""A field table of declare or bind arguments, stored losslessly as JSON."""


class ExchangeDef(BaseModel):
    """A declared exchange."""

    model_config = ConfigDict(frozen=True)

    name: str
    type: ExchangeType
    vhost: str = VhostField
    durable: bool = True
    auto_delete: bool = False
    internal: bool = False
    arguments: Arguments = Field(default_factory=dict)


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
    arguments: Arguments = Field(default_factory=dict)


class BindingDef(BaseModel):
    """A binding from an exchange to a queue (exchange-to-exchange bindings are not supported)."""

    model_config = ConfigDict(frozen=True)

    exchange: str
    queue: str
    routing_key: str
    arguments: Arguments = Field(default_factory=dict)
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
