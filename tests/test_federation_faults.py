"""Federation across link cuts: at-least-once delivery with deduplication on arrival.

The remote reaches the central broker through a FaultProxy that the test cuts while
a publisher sends with confirms; every confirmed message must arrive downstream
exactly once (deliveries whose upstream ack was lost are re-delivered and dropped by
the (origin, seq) window).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pika
import pytest
from federationsites import (
    bind_queue,
    channel,
    federated,
    get_all,
    links,
    queue_depth,
    queue_settled,
    wait_running,
    wait_upstream_bindings,
)

from twinmq.broker.federation.agent import queue_name
from twinmq.testing.waiting import wait_for

TOTAL = 3000


def _publish(url: str, confirmed: list[int], stop: threading.Event) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    ch = connection.channel()
    ch.confirm_delivery()
    for i in range(TOTAL):
        ch.basic_publish(
            "orders", "order.new", str(i).encode(), pika.BasicProperties(delivery_mode=2)
        )
        confirmed.append(i)  # basic_publish returned: the broker confirmed it
        if stop.is_set():
            break
    connection.close()


@pytest.mark.slow
def test_link_cuts_under_traffic_lose_no_confirmed_message_and_deliver_none_twice(
    tmp_path: Path,
) -> None:
    with federated(tmp_path, "orders", "direct", proxied=True, prefetch=64) as sites:
        central, remote, proxy = sites.central, sites.remote, sites.proxy
        assert proxy is not None
        wait_running(remote, "orders")
        bind_queue(remote, "inbox", "orders", "order.new")
        wait_upstream_bindings(central, queue_name("orders", "remote"), {("orders", "order.new")})
        confirmed: list[int] = []
        stop = threading.Event()
        publisher = threading.Thread(target=_publish, args=(central.url, confirmed, stop))
        publisher.start()
        try:
            for cut in range(1, 4):
                received = links(remote)["orders"]["messages_received"]
                wait_for(
                    f"traffic across the link before cut {cut}",
                    lambda r=received: (
                        links(remote)["orders"]["messages_received"] > r + 50
                        or not publisher.is_alive()
                    ),
                )
                proxy.cut()
                wait_for("the link down", lambda: links(remote)["orders"]["state"] != "running")
                proxy.heal()
                wait_running(remote, "orders")
        finally:
            publisher.join(120)
            stop.set()
        assert len(confirmed) == TOTAL
        wait_for(
            "every confirmed message downstream",
            lambda: (
                queue_depth(remote, "inbox") >= TOTAL
                and queue_settled(central, queue_name("orders", "remote"))
            ),
            timeout=120,
        )
        bodies = [int(body) for _key, body, _headers in get_all(remote, "inbox", TOTAL)]
        assert sorted(bodies) == list(range(TOTAL))  # none lost, none twice
        link = links(remote)["orders"]
        assert link["messages_received"] == TOTAL
        assert link["state"] == "running"


def test_a_redelivery_of_a_message_already_republished_is_dropped_as_a_duplicate(
    tmp_path: Path,
) -> None:
    """The gap the window closes: delivered and republished here, its upstream ack lost
    (the link is cut before the ack is sent: the proxy partitions first), re-delivered."""
    with federated(tmp_path, "orders", "direct", proxied=True) as sites:
        central, remote, proxy = sites.central, sites.remote, sites.proxy
        assert proxy is not None
        wait_running(remote, "orders")
        bind_queue(remote, "inbox", "orders", "k")
        link_queue = queue_name("orders", "remote")
        wait_upstream_bindings(central, link_queue, {("orders", "k")})
        # Partition after the deliveries left central: the remote republishes them, its
        # acks stay in the proxy; then the cut drops those acks: central re-delivers.
        proxy.delay(3.0)
        connection, ch = channel(central)
        ch.confirm_delivery()
        for i in range(20):
            ch.basic_publish("orders", "k", str(i).encode(), pika.BasicProperties(delivery_mode=2))
        connection.close()
        wait_for("twenty republished", lambda: queue_depth(remote, "inbox") == 20)
        proxy.cut()
        proxy.heal()
        wait_running(remote, "orders")
        wait_for("central's link queue settled", lambda: queue_settled(central, link_queue))
        wait_for(
            "the re-deliveries dropped",
            lambda: links(remote)["orders"]["duplicates_dropped"] > 0,
        )
        assert sorted(int(b) for _k, b, _h in get_all(remote, "inbox", 20)) == list(range(20))


def test_a_link_that_ran_reconnects_after_the_first_pause_however_often_it_was_cut(
    tmp_path: Path,
) -> None:
    """The reconnect backoff doubles per failed attempt, and starts over after a session
    that ran (which also ends by an error: the cut): a link that flaps now and then
    must not wait `reconnect-max-seconds` after every cut."""
    with federated(tmp_path, "orders", "direct", proxied=True) as sites:
        remote, proxy = sites.remote, sites.proxy
        assert proxy is not None
        pauses: list[float] = []
        for _ in range(4):
            wait_running(remote, "orders")
            proxy.cut()
            pauses.append(
                wait_for(
                    "the link waiting to reconnect",
                    lambda: links(remote)["orders"]["reconnect_pause"],
                    interval=0.05,
                )
            )
            proxy.heal()
        assert pauses == [1.0, 1.0, 1.0, 1.0]


def test_a_cut_while_a_binding_waits_for_its_reply_leaves_the_link_reconnecting(
    tmp_path: Path,
) -> None:
    """A bind sent upstream, its reply held by a partition, then the connection reset:
    the session ends like any cut and the link comes back (it used to end the link's
    task for good, the pending reply cancelled under it: `connecting` until a restart)."""
    with federated(tmp_path, "orders", "direct", proxied=True) as sites:
        central, remote, proxy = sites.central, sites.remote, sites.proxy
        assert proxy is not None
        wait_running(remote, "orders")
        proxy.partition()
        bind_queue(remote, "inbox", "orders", "order.new")  # its upstream bind is held
        wait_for("the bind sent upstream", lambda: links(remote)["orders"]["local_bindings"] == 1)
        proxy.cut()
        wait_for(
            "the link down", lambda: links(remote)["orders"]["state"] == "connecting", timeout=60
        )
        proxy.heal()
        wait_running(remote, "orders")
        wait_upstream_bindings(central, queue_name("orders", "remote"), {("orders", "order.new")})
