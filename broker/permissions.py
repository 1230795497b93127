"""Who may do what: RabbitMQ's configure / write / read permissions per user and vhost.

A users file with a `permissions` list (RabbitMQ's definitions shape:
`{"user", "vhost", "configure", "write", "read"}`, each a regular expression
searched in the resource's name, as RabbitMQ does) restricts every user to what
it grants; a user without an entry for the vhost may not open it. Without the
list every user of the file may do everything (the users files written before keep
their meaning); a user removed from the file has no rights left, on a connection it
still holds too (RabbitMQ keeps that connection open, as TwinMQ does). The checks
follow RabbitMQ's table (docs/security.md):

| operation | configure | write | read |
|---|---|---|---|
| exchange.declare (not passive), exchange.delete | exchange | | |
| queue.declare (not passive), queue.delete | queue | | |
| queue.declare with `x-dead-letter-exchange` | queue | that exchange | queue |
| queue.bind, queue.unbind | | queue | exchange |
| basic.publish | | exchange | |
| basic.get, basic.consume, queue.purge | | | queue |

The default exchange is named `amq.default` for these checks, and a queue the
server names (`queue.declare` with an empty name) `amq.gen`, as in RabbitMQ.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, field_validator

Operation = Literal["configure", "write", "read"]
Resource = Literal["exchange", "queue"]
DEFAULT_EXCHANGE = "amq.default"
SERVER_NAMED_QUEUE = "amq.gen"


class Permission(BaseModel):
    """One user's rights in one vhost (RabbitMQ's definitions entry)."""

    user: str
    vhost: str = "/"
    configure: str = ""
    write: str = ""
    read: str = ""

    @field_validator("configure", "write", "read")
    @classmethod
    def _a_regular_expression(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"{value!r} is not a regular expression: {exc}") from exc
        return value


class AccessControl:
    """The permissions of a users file; `None` grants everything to everyone, or, with
    `users`, to each of them (the file's users: a connection whose user was removed from
    it since it logged in may do nothing more)."""

    def __init__(
        self, permissions: list[Permission] | None, users: Iterable[str] | None = None
    ) -> None:
        everyone = permissions is None
        self._everyone = frozenset(users) if everyone and users is not None else None
        self.unrestricted = everyone and self._everyone is None
        self._grants: dict[tuple[str, str], dict[Operation, re.Pattern[str]]] = {}
        for p in permissions or []:
            # An empty expression grants nothing (RabbitMQ's "^$" is the usual spelling).
            self._grants[(p.user, p.vhost)] = {
                op: re.compile(getattr(p, op) or r"(?!)") for op in ("configure", "write", "read")
            }

    def may_open(self, user: str, vhost: str) -> bool:
        """Whether `user` may open `vhost` at all."""
        if self._everyone is not None:
            return user in self._everyone
        return self.unrestricted or (user, vhost) in self._grants

    def allows(self, user: str, vhost: str, op: Operation, name: str) -> bool:
        """Whether `user` may do `op` on the resource called `name` in `vhost`."""
        if self._everyone is not None:
            return user in self._everyone
        if self.unrestricted:
            return True
        grant = self._grants.get((user, vhost))
        return grant is not None and grant[op].search(name) is not None
