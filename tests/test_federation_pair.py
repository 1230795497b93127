"""A downstream pair: its link runs on the active broker only and moves to the promoted
passive at a failover (the passive has the replicated topology and messages)."""

from __future__ import annotations

import threading
from pathlib import Path

import pika
import pika.exceptions
import pytest
from federationsites import (
    bind_queue,
    federated_pair,
    get_all,
    links,
    publish_confirmed,
    queue_depth,
    queue_settled,
    wait_running,
    wait_upstream_bindings,
)

from twinmq.broker.federation.agent import queue_name
from twinmq.testing.waiting import wait_for


@pytest.mark.slow
def test_the_link_runs_on_the_active_only_and_follows_a_failover(tmp_path: Path) -> None:
    with federated_pair(tmp_path, "market", "direct") as (central, pair):
        wait_running(pair.active, "market")
        assert links(pair.passive)["market"]["state"] != "running"
        bind_queue(pair.active, "inbox", "market", "k")
        link_queue = queue_name("market", "remote")
        wait_upstream_bindings(central, link_queue, {("market", "k")})
        publish_confirmed(central, "market", [("k", f"{i}".encode()) for i in range(100)])
        wait_for("100 on the active", lambda: queue_depth(pair.active, "inbox") == 100)
        # Every delivery acknowledged upstream before the kill: this test is about the
        # link moving to the promoted passive; redeliveries at a kill under traffic are
        # the next test's (docs/federation.md, "Pairs").
        wait_for("the link queue settled", lambda: queue_settled(central, link_queue))
        pair.wait_healthy()
        assert pair.failover()
        wait_running(pair.active, "market")
        publish_confirmed(central, "market", [("k", f"{i}".encode()) for i in range(100, 200)])
        try:
            wait_for("200 on the new active", lambda: queue_depth(pair.active, "inbox") == 200)
        except TimeoutError as exc:
            raise AssertionError(
                f"{exc}: {links(pair.active)} {queue_depth(pair.active, 'inbox')} "
                f"{queue_depth(central, link_queue)}"
            ) from None
        bodies = sorted(int(b) for _k, b, _h in get_all(pair.active, "inbox", 200))
        assert bodies == list(range(200))


@pytest.mark.slow
def test_a_failover_of_the_downstream_pair_under_traffic_loses_nothing_and_repeats_nothing(
    tmp_path: Path,
) -> None:
    """kill -9 of the downstream's active while deliveries flow: the batches it had
    republished reached the passive with their dedup keys (same group commit), so their
    re-deliveries to the promoted passive are dropped, and nothing confirmed upstream is
    lost."""
    total = 600
    with federated_pair(tmp_path, "market", "direct", prefetch=32) as (central, pair):
        wait_running(pair.active, "market")
        bind_queue(pair.active, "inbox", "market", "k")
        link_queue = queue_name("market", "remote")
        wait_upstream_bindings(central, link_queue, {("market", "k")})
        publisher = threading.Thread(
            target=publish_confirmed,
            args=(central, "market", [("k", f"{i}".encode()) for i in range(total)]),
        )
        publisher.start()
        try:
            wait_for(
                "deliveries flowing into the active",
                lambda: links(pair.active)["market"]["messages_received"] >= 100,
            )
            assert pair.failover()
        finally:
            publisher.join(120)
        wait_running(pair.active, "market")
        wait_for("the link queue settled", lambda: queue_settled(central, link_queue))
        bodies = sorted(int(b) for _k, b, _h in get_all(pair.active, "inbox", total))
        assert bodies == list(range(total))


def _publish_counted(url: str, total: int, confirmed: list[int]) -> None:
    """Publish `total` confirmed messages on `requests` until the broker goes away."""
    try:
        connection = pika.BlockingConnection(pika.URLParameters(url))
        ch = connection.channel()
        ch.confirm_delivery()
        for i in range(total):
            ch.basic_publish(
                "requests", "svc", str(i).encode(), pika.BasicProperties(delivery_mode=2)
            )
            confirmed.append(i)
        connection.close()
    except pika.exceptions.AMQPError:
        pass  # the active was killed: what was confirmed is in `confirmed`


@pytest.mark.slow
def test_a_failover_of_the_downstream_pair_while_forwarding_loses_nothing_and_repeats_nothing(
    tmp_path: Path,
) -> None:
    """kill -9 of the downstream's active while its clients' messages are forwarded: the
    outbox reached the passive like any queue; the promoted passive sends what was not
    confirmed upstream, and central drops the copies it had (its window)."""
    total = 3000
    with federated_pair(tmp_path, "requests", "direct", forward=True, prefetch=32) as (
        central,
        pair,
    ):
        bind_queue(central, "service", "requests", "svc")
        wait_running(pair.active, "requests")
        confirmed: list[int] = []
        publisher = threading.Thread(
            target=_publish_counted, args=(pair.active.url, total, confirmed)
        )
        publisher.start()
        try:
            wait_for(
                "forwards flowing from the active",
                lambda: links(pair.active)["requests"]["messages_forwarded"] >= 100,
            )
            assert pair.failover()
        finally:
            publisher.join(120)
        assert confirmed, "nothing was confirmed before the kill"
        wait_running(pair.active, "requests")
        wait_for(
            "the outbox forwarded",
            lambda: links(pair.active)["requests"]["forward_pending"] == 0,
            timeout=120,
        )
        bodies = [int(b) for _k, b, _h in get_all(central, "service", len(confirmed))]
        assert len(bodies) == len(set(bodies))  # none twice
        assert set(confirmed) <= set(bodies)  # none confirmed lost
