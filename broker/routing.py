"""Exchanges: which queues a routing key (and headers) selects.

Plain objects with no I/O; the virtual host owns them and keeps bindings in step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from twinmq.broker.definitions import BindingDef, ExchangeDef, ExchangeType


class Exchange:
    """Base class: a named router from routing keys to queue names."""

    type: ExchangeType

    def __init__(self, definition: ExchangeDef) -> None:
        self.definition = definition
        self.bindings: dict[tuple[str, str, str], BindingDef] = {}
        # Told of each binding added (True) or removed (False), as it happens: a
        # federation link follows the bindings one change at a time, with no rescan.
        self.watchers: list[Callable[[BindingDef, bool], None]] = []

    @property
    def name(self) -> str:
        """The exchange's name."""
        return self.definition.name

    @staticmethod
    def binding_key(binding: BindingDef) -> tuple[str, str, str]:
        """Identity of a binding: queue, routing key and arguments, as AMQP defines it."""
        return (binding.queue, binding.routing_key, repr(sorted(binding.arguments.items())))

    def bind(self, binding: BindingDef) -> bool:
        """Add a binding; False when an identical one exists already."""
        key = self.binding_key(binding)
        if key in self.bindings:
            return False
        self.bindings[key] = binding
        self._added(binding)
        for watcher in self.watchers:
            watcher(binding, True)
        return True

    def unbind(self, binding: BindingDef) -> bool:
        """Remove a binding; False when it did not exist."""
        gone = self.bindings.pop(self.binding_key(binding), None)
        if gone is None:
            return False
        self._removed([gone])
        for watcher in self.watchers:
            watcher(gone, False)
        return True

    def unbind_queue(self, queue: str) -> list[BindingDef]:
        """Remove every binding to `queue` and return them."""
        gone = [b for k, b in self.bindings.items() if k[0] == queue]
        for binding in gone:
            del self.bindings[self.binding_key(binding)]
        if gone:
            self._removed(gone)
        for watcher in self.watchers:
            for binding in gone:
                watcher(binding, False)
        return gone

    def _added(self, binding: BindingDef) -> None:
        """`binding` was added (by default: rebuild everything, `_changed`)."""
        self._changed()

    def _removed(self, bindings: list[BindingDef]) -> None:
        """`bindings` were removed (by default: rebuild everything, `_changed`)."""
        self._changed()

    def _changed(self) -> None:
        """Rebuild lookup structures after the bindings changed."""

    def route(self, routing_key: str, headers: Mapping[str, Any] | None) -> Iterable[str]:
        """Queue names the message goes to (may repeat; the caller de-duplicates)."""
        raise NotImplementedError


class DirectExchange(Exchange):
    """Routes on exact routing-key equality."""

    type: ExchangeType = "direct"

    def __init__(self, definition: ExchangeDef) -> None:
        super().__init__(definition)
        self._table: dict[str, list[str]] = {}
        # Bindings per (routing key, queue): several differ only in their arguments.
        self._refs: dict[tuple[str, str], int] = {}

    # Kept up to date one binding at a time: a rebuild per bind made building n
    # bindings (a client's, or recovery's) cost n^2.
    def _added(self, binding: BindingDef) -> None:
        pair = (binding.routing_key, binding.queue)
        count = self._refs.get(pair, 0)
        self._refs[pair] = count + 1
        if not count:
            self._table.setdefault(binding.routing_key, []).append(binding.queue)

    def _removed(self, bindings: list[BindingDef]) -> None:
        for binding in bindings:
            pair = (binding.routing_key, binding.queue)
            count = self._refs.pop(pair) - 1
            if count:
                self._refs[pair] = count
                continue
            queues = self._table[binding.routing_key]
            queues.remove(binding.queue)
            if not queues:
                del self._table[binding.routing_key]

    def _changed(self) -> None:
        self._table, self._refs = {}, {}
        for binding in self.bindings.values():
            self._added(binding)

    def route(self, routing_key: str, headers: Mapping[str, Any] | None) -> Iterable[str]:
        return self._table.get(routing_key, ())


class FanoutExchange(Exchange):
    """Routes to every bound queue."""

    type: ExchangeType = "fanout"

    def __init__(self, definition: ExchangeDef) -> None:
        super().__init__(definition)
        self._queues: list[str] = []

    def _changed(self) -> None:
        self._queues = list(dict.fromkeys(b.queue for b in self.bindings.values()))

    def route(self, routing_key: str, headers: Mapping[str, Any] | None) -> Iterable[str]:
        return self._queues


def topic_matches(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    """Whether routing-key words match a topic pattern (`*` one word, `#` zero or more)."""
    # reachable[j]: the pattern prefix read so far can consume exactly words[:j].
    reachable = [True] + [False] * len(words)
    for token in pattern:
        if token == "#":
            for j in range(1, len(words) + 1):
                reachable[j] = reachable[j] or reachable[j - 1]
        else:
            for j in range(len(words), 0, -1):
                reachable[j] = reachable[j - 1] and (token == "*" or token == words[j - 1])
            reachable[0] = False
    return reachable[-1]


class TopicExchange(Exchange):
    """Routes on dotted routing-key patterns; results cached per routing key."""

    type: ExchangeType = "topic"

    def __init__(self, definition: ExchangeDef) -> None:
        super().__init__(definition)
        self._patterns: list[tuple[tuple[str, ...], str]] = []
        self._cache: dict[str, list[str]] = {}

    def _changed(self) -> None:
        self._patterns = [
            (tuple(b.routing_key.split(".")), b.queue) for b in self.bindings.values()
        ]
        self._cache = {}

    def route(self, routing_key: str, headers: Mapping[str, Any] | None) -> Iterable[str]:
        hit = self._cache.get(routing_key)
        if hit is None:
            words = tuple(routing_key.split("."))
            hit = list(dict.fromkeys(q for p, q in self._patterns if topic_matches(p, words)))
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache[routing_key] = hit
        return hit


class HeadersExchange(Exchange):
    """Routes on message headers: `x-match` all/any (and the `-with-x` variants)."""

    type: ExchangeType = "headers"

    def route(self, routing_key: str, headers: Mapping[str, Any] | None) -> Iterable[str]:
        headers = headers or {}
        # A queue bound with two tables that both match gets the message once, as with
        # every other exchange type (and RabbitMQ).
        return list(
            dict.fromkeys(
                b.queue for b in self.bindings.values() if headers_match(b.arguments, headers)
            )
        )


def headers_match(arguments: Mapping[str, Any], headers: Mapping[str, Any]) -> bool:
    """Whether a message's headers satisfy a headers-exchange binding's arguments."""
    mode = str(arguments.get("x-match", "all"))
    with_x = mode.endswith("-with-x")
    wanted = {
        k: v for k, v in arguments.items() if k != "x-match" and (with_x or not k.startswith("x-"))
    }
    if not wanted:
        return mode.startswith("all")

    def one(key: str, value: Any) -> bool:
        if key not in headers:
            return False
        # A binding argument of void type matches on the key's presence alone.
        return value is None or _same(headers[key], value)

    if mode.startswith("any"):
        return any(one(k, v) for k, v in wanted.items())
    return all(one(k, v) for k, v in wanted.items())


def _same(header: Any, argument: Any) -> bool:
    """Value equality as RabbitMQ compares header values: text and bytes by their bytes.

    (A long string that is not UTF-8, or a byte array, decodes to bytes; its UTF-8
    twin to str.) Never raises: an odd value simply does not match.
    """
    try:
        if isinstance(header, bytes | bytearray) and isinstance(argument, str):
            return bytes(header) == argument.encode("utf-8", "surrogatepass")
        if isinstance(argument, bytes | bytearray) and isinstance(header, str):
            return bytes(argument) == header.encode("utf-8", "surrogatepass")
        return bool(header == argument)
    except Exception:
        return False


EXCHANGE_TYPES: dict[str, type[Exchange]] = {
    "direct": DirectExchange,
    "fanout": FanoutExchange,
    "topic": TopicExchange,
    "headers": HeadersExchange,
}


def make_exchange(definition: ExchangeDef) -> Exchange:
    """Build the exchange object for a definition."""
    return EXCHANGE_TYPES[definition.type](definition)
