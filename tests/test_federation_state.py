"""State replication (seed 002): a subscriber of `amq.twinmq.state` receives a server's
definitions, a full state then changes, in one queue; after a cut or a restart it
subscribes again and a new full state leaves nothing stale. Real brokers, pika."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pika
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

    def __init__(self, address: str) -> None:
        self.connection = pika.BlockingConnection(
            pika.URLParameters(f"amqp://guest:guest@{address}/")
        )
        self.channel = self.connection.channel()
        self.queue = self.channel.queue_declare("", exclusive=True).method.queue
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
