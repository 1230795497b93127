"""Binding normalisation and the upstream binding set (sans-I/O).

The downstream's bindings on a federated exchange become bindings of the link's one
upstream queue, normalised so that each message crosses the link once however many
downstream queues want it:

- direct and topic: one upstream binding per distinct routing key (arguments do not
  take part in their routing);
- fanout: one upstream binding for any number of downstream bindings;
- headers: one per distinct argument table (the routing key does not take part).

`UpstreamBindings` counts references (how many downstream bindings need each upstream
one) and says what to bind and unbind to go from what the upstream holds to what is
needed. Subsumption (`#` covering every other topic key) is not applied yet.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from twinmq.broker.definitions import BindingDef


@dataclass(frozen=True, slots=True, order=True)
class UpstreamBinding:
    """One binding of the link's upstream queue: a routing key and arguments (as JSON)."""

    routing_key: str
    arguments_json: str = "{}"

    @property
    def arguments(self) -> dict[str, Any]:
        """The binding arguments to send."""
        decoded: dict[str, Any] = json.loads(self.arguments_json)
        return decoded


def normalise(kind: str, binding: BindingDef) -> UpstreamBinding:
    """The upstream binding a downstream binding needs on an exchange of type `kind`."""
    if kind == "fanout":
        return UpstreamBinding("")
    if kind == "headers":
        return UpstreamBinding("", json.dumps(binding.arguments, sort_keys=True, default=str))
    return UpstreamBinding(binding.routing_key)


def needed(kind: str, bindings: Iterable[BindingDef]) -> Counter[UpstreamBinding]:
    """Reference counts: each upstream binding and how many downstream bindings need it."""
    return Counter(normalise(kind, b) for b in bindings)


@dataclass(frozen=True, slots=True)
class Changes:
    """What to do upstream: bind these, unbind those."""

    bind: list[UpstreamBinding]
    unbind: list[UpstreamBinding]

    def __bool__(self) -> bool:
        return bool(self.bind or self.unbind)


def changes(held: Iterable[UpstreamBinding], wanted: Iterable[UpstreamBinding]) -> Changes:
    """Go from `held` (bound upstream, as far as known) to `wanted`."""
    held_set, wanted_set = set(held), set(wanted)
    return Changes(sorted(wanted_set - held_set), sorted(held_set - wanted_set))


def resync(maybe_held: Iterable[UpstreamBinding], wanted: Iterable[UpstreamBinding]) -> Changes:
    """After a reconnect: bind everything wanted (idempotent), unbind everything that may
    be held and is not wanted (an unbind of a missing binding is harmless)."""
    wanted_set = set(wanted)
    return Changes(sorted(wanted_set), sorted(set(maybe_held) - wanted_set))


def encode(bindings: Iterable[UpstreamBinding]) -> str:
    """The durable record of what may be bound upstream (JSON)."""
    return json.dumps([[b.routing_key, b.arguments_json] for b in sorted(bindings)])


def decode(text: str) -> set[UpstreamBinding]:
    """Read `encode`'s record."""
    return {UpstreamBinding(key, args) for key, args in json.loads(text)}
