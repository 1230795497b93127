"""The cost of the permission check every basic.publish makes (broker/permissions.py).

    .venv/bin/python bench/permission_check.py

Times `Connection.authorize` for a publish to the default exchange, with no
`permissions` list (everyone may do everything) and with one (the answer cached
per connection after the first check), one million calls each, three rounds.
"""

from __future__ import annotations

import statistics
import timeit
from types import SimpleNamespace

from twinmq.broker.auth import Authenticator, User
from twinmq.broker.connection import Connection, Limits
from twinmq.broker.permissions import Permission


class Context:
    """The part of a broker a connection's permission check reads."""

    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator
        self.vhost = SimpleNamespace(name="/")  # the check reads only its name
        self.limits = Limits()
        self.product_version = "bench"


def per_check_ns(permissions: list[Permission] | None, calls: int = 1_000_000) -> float:
    auth = Authenticator([User(name="app", password="pw")], permissions)
    conn = Connection(Context(auth), "bench", loopback=True, wake=lambda: None)  # type: ignore[arg-type]
    conn.user = "app"
    seconds = timeit.timeit(
        lambda: conn.authorize("write", "exchange", "amq.default", (60, 40)), number=calls
    )
    return seconds / calls * 1e9


def main() -> None:
    grant = [Permission(user="app", configure=".*", write=r"^(amq\.default|orders)$", read=".*")]
    for name, permissions in (("no permissions list", None), ("permissions list", grant)):
        runs = [per_check_ns(permissions) for _ in range(3)]
        print(f"{name}: {statistics.median(runs):.0f} ns per publish "
              f"({min(runs):.0f}-{max(runs):.0f})")  # fmt: skip


if __name__ == "__main__":
    main()
