"""State replication's incremental `changes` (docs/federation.md, "State replication"):
the publisher follows what each change touched, not the whole state, and a subscriber
that applies its messages in order holds exactly the server's state; a missed message
is a gap, and only a full state repairs it.

A real `VirtualHost` over a real journal (`sansio.Harness`), changed through the same
methods a client's declare, bind, unbind and delete reach; the subscriber's messages
read from its queue, as a client would get them."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from twinmq.broker.errors import AMQPError
from twinmq.broker.federation.state import (
    STATE_EXCHANGE,
    StateMessage,
    StatePublisher,
    StateView,
    rows,
)
from twinmq.testing.sansio import Harness

EXCHANGES = ("x1", "x2")
QUEUES = ("q1", "q2", "q3")
KEYS = ("a", "b", "a.#")
TABLES: tuple[dict[str, Any], ...] = ({}, {"x-match": "all", "h": "1"})


def churn(rng: random.Random, count: int) -> list[tuple[Any, ...]]:
    """`count` random steps, weighted so that objects live long enough to be bound,
    and deleted with their bindings after a turn has told the subscribers of them."""
    steps: list[tuple[Any, ...]] = []
    for _ in range(count):
        kind = rng.choices(
            ("declare_exchange", "delete_exchange", "declare_queue", "delete_queue", "bind",
             "flush"),
            weights=(10, 4, 12, 6, 40, 20),
        )[0]  # fmt: skip
        if kind == "declare_exchange":
            steps.append((kind, rng.choice(EXCHANGES), rng.choice(("topic", "headers")),
                          rng.random() < 0.7, rng.random() < 0.3))  # fmt: skip
        elif kind in ("delete_exchange", "delete_queue"):
            steps.append((kind, rng.choice(EXCHANGES if kind == "delete_exchange" else QUEUES)))
        elif kind == "declare_queue":
            steps.append((kind, rng.choice(QUEUES), rng.random() < 0.5,
                          rng.choice(({}, {"x-max-length": 5}))))  # fmt: skip
        elif kind == "bind":
            steps.append((kind, rng.choice(QUEUES), rng.choice(EXCHANGES), rng.choice(KEYS),
                          rng.randrange(len(TABLES)), rng.random() < 0.35))  # fmt: skip
        else:
            steps.append((kind,))
    return steps


class Site:
    """A virtual host with a state publisher and one subscriber queue on it."""

    def __init__(self, directory: Path) -> None:
        self.harness = Harness(directory)
        self.vhost = self.harness.vhost
        self.publisher = StatePublisher("a", self.vhost, lambda: 1)
        self.owner = object()
        self.view = StateView()
        self.subscribe(self.vhost.declare_queue(
            "sub", passive=False, durable=False, exclusive=True, auto_delete=False,
            arguments={}, owner=self.owner,
        ).name)  # fmt: skip

    def subscribe(self, queue: str, *, unbind_first: bool = False) -> None:
        if unbind_first:
            self.vhost.bind(queue, STATE_EXCHANGE, "", {}, self.owner, unbind=True)
        self.vhost.bind(queue, STATE_EXCHANGE, "", {}, self.owner)

    def do(self, step: tuple[Any, ...]) -> None:
        vhost, owner = self.vhost, self.owner
        kind = step[0]
        try:
            if kind == "declare_exchange":
                _, name, etype, durable, auto_delete = step
                vhost.declare_exchange(
                    name, etype, passive=False, durable=durable, auto_delete=auto_delete,
                    internal=False, arguments={},
                )  # fmt: skip
            elif kind == "delete_exchange":
                vhost.delete_exchange(step[1], if_unused=False)
            elif kind == "declare_queue":
                _, name, durable, arguments = step
                vhost.declare_queue(
                    name, passive=False, durable=durable, exclusive=False, auto_delete=False,
                    arguments=arguments, owner=owner,
                )  # fmt: skip
            elif kind == "delete_queue":
                vhost.delete_queue(step[1], if_unused=False, if_empty=False, owner=owner)
            elif kind == "bind":
                _, queue, exchange, key, table, unbind = step
                vhost.bind(queue, exchange, key, dict(TABLES[table]), owner, unbind=unbind)
            else:
                self.harness.clock.advance(0)
        except AMQPError:
            pass  # refused (no such queue, another type): changes nothing

    def read(self) -> list[StateMessage]:
        """Flush what is pending, then every message in the subscriber's queue."""
        self.harness.clock.advance(0)
        queue = self.vhost.queues["sub"]
        out = []
        while (entry := queue.pop(self.harness.clock.time())) is not None:
            out.append(StateMessage.model_validate_json(entry.message.body))
        return out

    def follow(self) -> None:
        for message in self.read():
            self.view.apply(message)

    def expected(self) -> tuple[dict[str, Any], dict[str, Any], set[tuple[str, ...]]]:
        """The server's state now, as a view holds it."""
        now = rows(self.vhost)
        return (
            {n: (t, d, a, i, json.loads(args)) for n, (t, d, a, i, args) in now.exchanges.items()},
            {n: (d, x, a, json.loads(args)) for n, (d, x, a, args) in now.queues.items()},
            set(now.bindings),
        )

    def seen(self) -> tuple[dict[str, Any], dict[str, Any], set[tuple[str, ...]]]:
        state = self.view.state
        assert state is not None
        return (
            {
                e.name: (e.type, e.durable, e.auto_delete, e.internal, e.arguments)
                for e in state.exchanges.values()
            },
            {
                q.name: (q.durable, q.exclusive, q.auto_delete, q.arguments)
                for q in state.queues.values()
            },
            {
                (b.exchange, b.queue, b.routing_key, json.dumps(b.arguments, sort_keys=True))
                for b in state.bindings.values()
            },
        )

    def close(self) -> None:
        self.harness.close()


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.randoms(use_true_random=False), st.integers(1, 150))
def test_a_subscriber_following_the_changes_of_any_churn_holds_the_state(
    rng: random.Random, count: int
) -> None:
    steps = churn(rng, count)
    with tempfile.TemporaryDirectory() as directory:
        site = Site(Path(directory))
        try:
            # Checked at every end of a turn, not only at the end: a stale binding would
            # often be cleaned up by a later change (its exchange deleted).
            for step in [*steps, ("flush",)]:
                site.do(step)
                if step[0] != "flush":
                    continue
                site.follow()
                assert not site.view.gap
                assert site.seen() == site.expected()
                # What the publisher keeps is the state too (the next change starts from it).
                tracker = site.publisher.tracker
                assert tracker is not None and tracker.rows == rows(site.vhost)
        finally:
            site.close()


def test_a_change_after_thousands_of_bindings_names_only_what_it_touched(tmp_path: Path) -> None:
    site = Site(tmp_path)
    try:
        site.do(("declare_exchange", "x1", "topic", True, False))
        for i in range(2000):
            site.do(("declare_queue", f"q{i}", i % 2 == 0, {}))
            site.vhost.bind(f"q{i}", "x1", f"k.{i}", {}, site.owner)
        site.follow()
        site.vhost.delete_queue("q7", if_unused=False, if_empty=False, owner=site.owner)
        (message,) = site.read()
        assert message.kind == "changes" and not message.exchanges and not message.queues
        assert message.removed.queues == ["q7"]
        assert [(b.queue, b.routing_key) for b in message.removed.bindings] == [("q7", "k.7")]
        site.view.apply(message)
        site.do(("delete_exchange", "x1"))
        site.follow()
        assert site.seen() == site.expected()
        assert site.expected()[2] == set()
    finally:
        site.close()


def test_a_missed_changes_message_is_a_gap_and_a_full_state_repairs_it(tmp_path: Path) -> None:
    site = Site(tmp_path)
    try:
        site.do(("declare_exchange", "x1", "topic", True, False))
        site.do(("declare_queue", "q1", True, {}))
        site.follow()
        site.do(("bind", "q1", "x1", "a", 0, False))
        lost = site.read()  # never applied: as a queue's length limit would drop it
        assert [m.kind for m in lost] == ["changes"]
        site.do(("bind", "q1", "x1", "b", 0, False))
        (after,) = site.read()
        assert not site.view.apply(after) and site.view.gap
        # Nothing applies until a full state, even the next change in order after it.
        site.do(("bind", "q1", "x1", "b", 0, True))
        assert not any(site.view.apply(m) for m in site.read())
        # Unbound and bound again: a full state, as of now, then changes in order again.
        site.subscribe("sub", unbind_first=True)
        site.follow()
        assert not site.view.gap and site.view.gaps == 1
        assert site.seen() == site.expected()
        site.do(("delete_queue", "q1"))
        site.follow()
        assert not site.view.gap and site.seen() == site.expected()
    finally:
        site.close()
