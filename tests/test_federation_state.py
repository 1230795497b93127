"""State replication (seed 002): a subscriber of `amq.twinmq.state` receives a server's
definitions, a full state then changes, in one queue; after a cut or a restart it
subscribes again and a new full state leaves nothing stale. Real brokers, pika."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pika
import pytest
from federationsites import (
    bind_queue,
    channel,
    federated,
    links,
    site,
    wait_running,
    wait_upstream_bindings,
)

from twinmq.broker.federation.agent import queue_name
from twinmq.broker.federation.state import STATE_EXCHANGE, StateMessage, StateView
from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import status
from twinmq.testing.waiting import wait_for


class Subscriber:
    """An operator's tool: its own exclusive queue bound to `amq.twinmq.state`."""

    def __init__(self, address: str, arguments: dict[str, Any] | None = None) -> None:
        self.connection = pika.BlockingConnection(
            pika.URLParameters(f"amqp://guest:guest@{address}/")
        )
        self.channel = self.connection.channel()
        self.queue = self.channel.queue_declare(
            "", exclusive=True, arguments=arguments
        ).method.queue
        self.channel.queue_bind(self.queue, STATE_EXCHANGE)
        self.view = StateView()
        self.kinds: list[str] = []

    def read(self) -> None:
        """Apply every message waiting."""
        while True:
            method, props, body = self.channel.basic_get(self.queue, auto_ack=True)
            if method is None:
                return
            message = StateMessage.model_validate_json(body)
            assert props.type == message.kind == method.routing_key or message.kind == "full"
            self.kinds.append(message.kind)
            self.view.apply(message)

    def ask_full_state(self) -> None:
        """After a gap: unbound and bound again, the queue gets a full state."""
        self.channel.queue_unbind(self.queue, STATE_EXCHANGE)
        self.channel.queue_bind(self.queue, STATE_EXCHANGE)

    def names(self) -> tuple[set[str], set[str], set[tuple[str, str, str]]]:
        """(exchanges, queues other than this subscriber's, bindings) in the view."""
        state = self.view.state
        if state is None:
            return set(), set(), set()
        return (
            set(state.exchanges),
            set(state.queues) - {self.queue},
            {(b.exchange, b.queue, b.routing_key) for b in state.bindings.values()},
        )

    def wait_view(
        self,
        exchanges: set[str],
        queues: set[str],
        bindings: set[tuple[str, str, str]],
    ) -> None:
        """Read until the view holds exactly these definitions."""

        def matches() -> bool:
            self.read()
            return self.names() == (exchanges, queues, bindings)

        wait_for(f"the view {exchanges} {queues} {bindings} (have {self.names()})", matches)

    def close(self) -> None:
        if self.connection.is_open:
            self.connection.close()


def _topology(broker: BrokerProcess) -> None:
    connection, ch = channel(broker)
    try:
        ch.exchange_declare("orders", "topic", durable=True)
        ch.queue_declare("q1", durable=True)
        ch.queue_bind("q1", "orders", "eu.#")
        ch.queue_declare("q2", durable=True)
    finally:
        connection.close()


def test_a_subscriber_gets_the_full_state_then_each_change_in_one_queue(tmp_path: Path) -> None:
    with site(tmp_path, "a") as broker:
        _topology(broker)
        sub = Subscriber(f"127.0.0.1:{broker.port}")
        try:
            sub.read()
            assert sub.kinds[-1:] == ["full"]
            assert sub.view.server_id == "a"
            # Built-in exchanges and internal queues are not state; user objects are.
            assert sub.names() == ({"orders"}, {"q1", "q2"}, {("orders", "q1", "eu.#")})
            full_seq = sub.view.seq
            connection, ch = channel(broker)
            try:
                ch.exchange_declare("audit", "fanout", durable=True)
                ch.queue_bind("q2", "audit", "")
                ch.queue_delete("q1")
                ch.exchange_delete("orders")
            finally:
                connection.close()
            sub.wait_view({"audit"}, {"q2"}, {("audit", "q2", "")})
            assert "changes" in sub.kinds and sub.view.seq > full_seq
            data = status(broker)
            assert data is not None
            state = data["federation"]["state"]
            assert state["subscribers"] == 1 and state["full_states_sent"] == 1
            assert (state["exchanges"], state["bindings"]) == (1, 1)
            # A second subscriber gets the state as it is now, the first nothing more.
            later = Subscriber(f"127.0.0.1:{broker.port}")
            try:
                later.read()
                assert later.kinds == ["full"]
                assert later.names() == ({"audit"}, {"q2", sub.queue}, {("audit", "q2", "")})
            finally:
                later.close()
        finally:
            sub.close()


def test_a_subscriber_cut_off_or_outliving_a_restart_gets_a_full_state_with_nothing_stale(
    tmp_path: Path,
) -> None:
    broker = site(tmp_path, "a")
    broker.start()
    proxy = FaultProxy(f"127.0.0.1:{broker.port}").start()
    try:
        _topology(broker)
        sub = Subscriber(proxy.address)
        sub.wait_view({"orders"}, {"q1", "q2"}, {("orders", "q1", "eu.#")})
        proxy.cut()
        # Changed while the subscriber is cut off: nothing reaches it.
        connection, ch = channel(broker)
        try:
            ch.queue_delete("q1")
            ch.queue_declare("q3", durable=True)
            ch.queue_bind("q3", "orders", "us.*")
            ch.queue_declare("scratch", durable=False)  # gone at a restart
        finally:
            connection.close()
        proxy.heal()
        sub = Subscriber(proxy.address)  # its old queue went with its connection
        sub.wait_view({"orders"}, {"q2", "q3", "scratch"}, {("orders", "q3", "us.*")})
        assert sub.kinds[0] == "full"
        sub.close()
        broker.stop()
        broker.start()
        sub = Subscriber(proxy.address)
        sub.wait_view({"orders"}, {"q2", "q3"}, {("orders", "q3", "us.*")})
        assert sub.kinds[0] == "full"
        sub.close()
    finally:
        proxy.close()
        broker.stop()


def _churn(broker: BrokerProcess, rng: random.Random, steps: int, follow: Subscriber) -> None:
    """`steps` declares, binds, unbinds and deletes (valid ones: a model of what exists),
    `follow` reading its messages as they come."""
    exchanges = {"t": "topic", "h": "headers", "d": "direct"}
    queues: set[str] = set()
    bound: set[tuple[str, str, str, str]] = set()
    tables = [{"x-match": "all", "k": "1"}, {"x-match": "any", "k": "1", "j": "2"}]
    connection, ch = channel(broker)
    try:
        for name, kind in exchanges.items():
            ch.exchange_declare(name, kind, durable=True)
        for step in range(steps):
            roll = rng.random()
            if roll < 0.15 or not queues:
                number = rng.randrange(60)
                ch.queue_declare(f"q{number}", durable=number % 2 == 0)  # a redeclare agrees
                name = f"q{number}"
                queues.add(name)
            elif roll < 0.6:
                queue, exchange = rng.choice(sorted(queues)), rng.choice(sorted(exchanges))
                table = rng.randrange(len(tables))
                key = "" if exchange == "h" else rng.choice(("a", "b", "a.*", "#"))
                args = tables[table] if exchange == "h" else None
                ch.queue_bind(queue, exchange, key, arguments=args)
                bound.add((queue, exchange, key, str(table)))
            elif roll < 0.85 and bound:
                queue, exchange, key, table = rng.choice(sorted(bound))
                args = tables[int(table)] if exchange == "h" else None
                ch.queue_unbind(queue, exchange, key, arguments=args)
                bound.discard((queue, exchange, key, table))
            elif roll < 0.97:
                name = rng.choice(sorted(queues))
                ch.queue_delete(name)
                queues.discard(name)
                bound = {b for b in bound if b[0] != name}
            else:  # an exchange deleted with its bindings, declared again
                name = rng.choice(sorted(exchanges))
                ch.exchange_delete(name)
                ch.exchange_declare(name, exchanges[name], durable=True)
                bound = {b for b in bound if b[1] != name}
            if step % 100 == 0:
                follow.read()
    finally:
        connection.close()


@pytest.mark.slow
def test_a_subscriber_following_thousands_of_changes_holds_the_state_and_a_gap_gets_a_full_one(
    tmp_path: Path,
) -> None:
    with site(tmp_path, "a") as broker:
        address = f"127.0.0.1:{broker.port}"
        follower = Subscriber(address)
        # Its queue keeps only the last message: the churn's changes overflow it.
        lossy = Subscriber(address, {"x-max-length": 1})
        try:
            lossy.read()  # its full state, before anything overflows it
            assert lossy.kinds == ["full"]
            _churn(broker, random.Random(15), 3000, follower)
            fresh = Subscriber(address)
            try:

                def same() -> bool:
                    for sub in (follower, fresh):
                        sub.read()
                    return follower.view.state == fresh.view.state

                wait_for("the follower's view equals a full state", same)
                assert follower.view.seq == fresh.view.seq and not follower.view.gaps
                assert follower.kinds[0] == "full" and len(follower.kinds) > 1000
                lossy.read()
                assert lossy.view.gap and lossy.view.gaps == 1
                lossy.ask_full_state()

                def repaired() -> bool:
                    for sub in (lossy, fresh):
                        sub.read()
                    return not lossy.view.gap and lossy.view.state == fresh.view.state

                wait_for("a full state after the gap", repaired)
                assert lossy.kinds.count("full") == 2
            finally:
                fresh.close()
        finally:
            follower.close()
            lossy.close()


def _peer_state(remote: BrokerProcess) -> dict[str, Any]:
    return links(remote)["market"]["upstream_state"] or {}


def _central_state(central: BrokerProcess) -> dict[str, Any]:
    data = status(central)
    assert data is not None
    state: dict[str, Any] = data["federation"]["state"]
    return state


def test_a_link_holds_its_upstreams_state_and_its_resync_removes_a_binding_only_the_state_shows(
    tmp_path: Path,
) -> None:
    """The federation link subscribes to its upstream's state at each session: its view
    follows the upstream's changes, and after a cut (or the upstream's restart) a new full
    state replaces it. The resync uses it: a binding of the link's queue upstream that
    the local record does not know (as a pair's old active leaves one) is removed."""
    with federated(tmp_path, "market", "topic", proxied=True) as sites:
        central, remote, proxy = sites.central, sites.remote, sites.proxy
        assert proxy is not None
        wait_running(remote, "market")
        bind_queue(remote, "eu", "market", "eu.#")
        link_queue = queue_name("market", "remote")
        wait_for("the view", lambda: _peer_state(remote).get("link_queue_bindings") == ["eu.#"])
        assert _peer_state(remote)["server_id"] == "central"
        # A binding of the link's queue made behind the link's back: in the view at once.
        connection, ch = channel(central)
        try:
            ch.queue_bind(link_queue, "market", "stale.*")
            ch.queue_declare("gone-while-cut", durable=True)
        finally:
            connection.close()
        wait_for(
            "the change in the view",
            lambda: _peer_state(remote).get("link_queue_bindings") == ["eu.#", "stale.*"],
        )
        proxy.cut()
        wait_for("the link down", lambda: links(remote)["market"]["state"] != "running")
        connection, ch = channel(central)
        try:
            ch.queue_delete("gone-while-cut")
            ch.queue_declare("made-while-cut", durable=True)
        finally:
            connection.close()
        proxy.heal()
        wait_running(remote, "market")
        wait_upstream_bindings(central, link_queue, {("market", "eu.#")})
        assert links(remote)["market"]["stale_unbound"] == 1
        wait_for(
            "the view equal to central's state",
            lambda: (
                _peer_state(remote).get("link_queue_bindings") == ["eu.#"]
                and _peer_state(remote)["queues"] == _central_state(central)["queues"]
            ),
        )
        # The upstream restarted: the next session's view is a new full state from it.
        central.stop()
        central.start()
        wait_running(remote, "market")
        wait_for(
            "a full state from the restarted upstream",
            lambda: (
                _central_state(central)["full_states_sent"] == 1
                and _peer_state(remote)["link_queue_bindings"] == ["eu.#"]
                and _peer_state(remote)["queues"] == _central_state(central)["queues"]
            ),
        )
