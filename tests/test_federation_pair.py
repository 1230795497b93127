"""Pairs on either side of a federation link. A downstream pair: its link runs on the
active broker only and moves to the promoted passive at a failover (the passive has the
replicated topology and messages). An upstream pair: the link reaches it through its
virtual IP (a proxy here) and a failover there is a reconnect to the promoted passive,
which has the link queue, the outbox's arrivals and the dedup window replicated."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pika
import pika.exceptions
import pytest
from federationsites import (
    bind_queue,
    federated_pair,
    federated_upstream_pair,
    get_all,
    links,
    publish_confirmed,
    publish_counted,
    queue_depth,
    queue_settled,
    wait_running,
    wait_upstream_bindings,
)

from twinmq.broker.federation.agent import queue_name
from twinmq.testing.pair import status
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


@pytest.mark.slow
def test_a_failover_of_the_upstream_pair_under_traffic_both_ways_loses_nothing_and_repeats_nothing(
    tmp_path: Path,
) -> None:
    """kill -9 of central's active while central's clients publish to a remote queue
    (deliveries down the link) and the remote's clients publish to a central queue
    (forwarded up the link): every confirmed message once at its queue. Down: the link
    queue and central's stamps (origin `central`, the replication ID) are the same on the
    promoted passive, so what the old active delivered but never had acknowledged comes
    again and is dropped by the remote's window. Up: central's window is journaled and
    replicated, so a forward confirmed by nobody (the confirm lost with the old active)
    and sent again is dropped by the promoted passive."""
    total = 2000
    with federated_upstream_pair(tmp_path, "market", "direct", forward=True, prefetch=32) as (
        sites
    ):
        bind_queue(sites.central, "service", "market", "up")
        wait_running(sites.remote, "market")
        bind_queue(sites.remote, "inbox", "market", "down")
        link_queue = queue_name("market", "remote")
        wait_upstream_bindings(sites.central, link_queue, {("market", "down")})
        sites.pair.wait_healthy()
        down: list[int] = []
        up: list[int] = []
        publishers = [
            threading.Thread(
                target=publish_counted, args=(sites.vip_url, "market", "down", total, down)
            ),
            threading.Thread(
                target=publish_counted, args=(sites.remote.url, "market", "up", total, up)
            ),
        ]
        for publisher in publishers:
            publisher.start()
        try:
            wait_for(
                "deliveries and forwards flowing through central's active",
                lambda: (
                    (link := links(sites.remote).get("market")) is not None
                    and link["messages_received"] >= 200
                    and link["messages_forwarded"] >= 200
                ),
                timeout=120,
            )
            assert sites.failover()
        finally:
            for publisher in publishers:
                publisher.join(240)
        wait_running(sites.remote, "market", timeout=120)
        wait_for(
            "the outbox forwarded",
            lambda: links(sites.remote)["market"]["forward_pending"] == 0,
            timeout=120,
        )
        wait_for(
            "the link queue settled",
            lambda: queue_settled(sites.central, link_queue),
            timeout=120,
        )
        received_down = [int(b) for _k, b, _h in get_all(sites.remote, "inbox", len(down))]
        received_up = [int(b) for _k, b, _h in get_all(sites.central, "service", len(up))]
        remote_link = links(sites.remote)["market"]
        central_status = status(sites.central)
        assert central_status is not None
        print(
            f"down: {len(down)} confirmed, {len(received_down)} received, "
            f"{remote_link['duplicates_dropped']} re-deliveries dropped; "
            f"up: {len(up)} confirmed, {len(received_up)} received, "
            f"{central_status['federation']['forwarded_dropped']} re-sends dropped"
        )
        for name, confirmed, received in (
            ("down", down, received_down),
            ("up", up, received_up),
        ):
            twice = sorted(b for b, n in Counter(received).items() if n > 1)
            lost = sorted(set(confirmed) - set(received))
            assert not twice, f"{name}: {len(twice)} delivered twice: {twice[:20]}"
            assert not lost, f"{name}: {len(lost)} confirmed lost: {lost[:20]}"
