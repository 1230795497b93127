"""Message forwarding downstream -> upstream and request-response across sites (seed 002's
second worked example), between real brokers through pika."""

from __future__ import annotations

import threading
from pathlib import Path

import pika
import pika.exceptions
import pytest
from federationsites import (
    bind_queue,
    channel,
    federated,
    get_all,
    links,
    publish_confirmed,
    queue_depth,
    wait_running,
    wait_upstream_bindings,
)

from twinmq.broker.admin_client import metric_samples
from twinmq.broker.federation.agent import queue_name
from twinmq.testing.pair import status
from twinmq.testing.waiting import wait_for


def test_messages_published_downstream_reach_the_upstream_exchange_once_and_never_echo(
    tmp_path: Path,
) -> None:
    with federated(tmp_path, "requests", "direct", forward=True) as sites:
        central, remote = sites.central, sites.remote
        wait_running(remote, "requests")
        bind_queue(central, "service", "requests", "svc")
        # A local queue downstream wants the same key: the binding goes upstream too, so
        # central routes each forwarded message back down; it is dropped there (a loop).
        bind_queue(remote, "local-audit", "requests", "svc")
        wait_upstream_bindings(central, queue_name("requests", "remote"), {("requests", "svc")})
        publish_confirmed(remote, "requests", [("svc", f"r{i}".encode()) for i in range(20)])
        wait_for("twenty on central", lambda: queue_depth(central, "service") == 20)
        received = get_all(central, "service", 20)
        assert [body for _k, body, _h in received] == [f"r{i}".encode() for i in range(20)]
        headers = received[0][2]
        assert headers["x-twinmq-origin"] == "remote"
        assert headers["x-twinmq-federation-path"] == ["remote", "central"]
        wait_for(
            "all confirmed upstream",
            lambda: (
                links(remote)["requests"]["messages_forwarded"] == 20
                and links(remote)["requests"]["forward_pending"] == 0
            ),
        )
        wait_for("the echoes dropped", lambda: links(remote)["requests"]["loops_dropped"] == 20)
        # The local copies only: nothing came back down twice.
        assert len(get_all(remote, "local-audit", 20)) == 20
        assert queue_depth(remote, "local-audit") == 0
        data = status(central)
        assert data is not None
        assert data["federation"]["forwarded_received"] == 20
        samples = metric_samples(remote.admin.metrics(timeout=5))
        assert samples['twinmq_federation_messages_forwarded_total{link="requests"}'] == 20


def test_forwarding_is_off_unless_the_federation_file_asks_for_it(tmp_path: Path) -> None:
    with federated(tmp_path, "requests", "direct") as sites:
        central, remote = sites.central, sites.remote
        wait_running(remote, "requests")
        bind_queue(central, "service", "requests", "svc")
        bind_queue(remote, "local", "requests", "svc")
        publish_confirmed(remote, "requests", [("svc", b"stays here")])
        wait_for("the local copy", lambda: queue_depth(remote, "local") == 1)
        assert queue_depth(central, "service") == 0
        assert links(remote)["requests"]["forward"] is False


def test_a_request_from_the_remote_site_gets_its_reply_through_the_federated_exchange(
    tmp_path: Path,
) -> None:
    """Seed 002, request-response: the remote client's temporary queue (server-named,
    so carrying the remote's server id) is bound to the federated direct exchange under
    its own name; the request, with reply-to that name, is forwarded to the central
    service; the service replies on the same exchange with the reply-to as routing key;
    the binding propagated upstream brings the reply back to the remote client."""
    with federated(tmp_path, "rpc", "direct", forward=True) as sites:
        central, remote = sites.central, sites.remote
        wait_running(remote, "rpc")
        service_connection, service = channel(central)
        service.queue_declare("calculator", durable=True)
        service.queue_bind("calculator", "rpc", "calculator")
        client_connection, client = channel(remote)
        try:
            reply_queue = client.queue_declare("", exclusive=True).method.queue
            assert reply_queue.startswith("amq.gen-remote.")
            client.queue_bind(reply_queue, "rpc", reply_queue)
            wait_upstream_bindings(central, queue_name("rpc", "remote"), {("rpc", reply_queue)})
            client.confirm_delivery()
            client.basic_publish(
                "rpc",
                "calculator",
                b"6*7",
                pika.BasicProperties(reply_to=reply_queue, correlation_id="q1", delivery_mode=2),
            )
            # The central service: one request, answered on the federated exchange.
            requests: list[tuple[pika.BasicProperties, bytes]] = []

            def got_request() -> bool:
                method, props, body = service.basic_get("calculator", auto_ack=True)
                if method is not None:
                    requests.append((props, body))
                return bool(requests)

            wait_for("the request on central", got_request)
            props, body = requests[0]
            assert body == b"6*7" and props.reply_to == reply_queue
            service.basic_publish(
                "rpc",
                props.reply_to,
                b"42",
                pika.BasicProperties(correlation_id=props.correlation_id, delivery_mode=2),
            )
            replies: list[tuple[pika.BasicProperties, bytes]] = []

            def got_reply() -> bool:
                method, rprops, rbody = client.basic_get(reply_queue, auto_ack=True)
                if method is not None:
                    replies.append((rprops, rbody))
                return bool(replies)

            wait_for("the reply on the remote", got_reply)
            assert replies[0][1] == b"42" and replies[0][0].correlation_id == "q1"
        finally:
            client_connection.close()
            service_connection.close()


def test_a_forward_whose_confirm_is_lost_in_a_link_cut_is_sent_again_and_dropped_upstream(
    tmp_path: Path,
) -> None:
    """The upstream's window at work: the forwarded messages reached central, their
    confirms are held in the proxy and dropped by the cut; the remote sends them again
    on the next session and central drops the copies by their (origin, seq) key."""
    with federated(tmp_path, "requests", "direct", proxied=True, forward=True) as sites:
        central, remote, proxy = sites.central, sites.remote, sites.proxy
        assert proxy is not None
        wait_running(remote, "requests")
        bind_queue(central, "service", "requests", "svc")
        proxy.delay(3.0)
        publish_confirmed(remote, "requests", [("svc", str(i).encode()) for i in range(20)])
        wait_for("twenty on central", lambda: queue_depth(central, "service") == 20)
        proxy.cut()
        proxy.heal()
        wait_running(remote, "requests")
        wait_for(
            "every forward confirmed",
            lambda: links(remote)["requests"]["forward_pending"] == 0,
        )
        data = status(central)
        assert data is not None and data["federation"]["forwarded_dropped"] > 0
        bodies = sorted(int(body) for _k, body, _h in get_all(central, "service", 20))
        assert bodies == list(range(20))


REQUESTS = 300


@pytest.mark.slow
def test_link_cuts_during_request_response_lose_no_request_or_reply_and_repeat_none(
    tmp_path: Path,
) -> None:
    """Seed 002's request-response under three link cuts: a remote client sends 300
    confirmed requests (reply-to its server-named queue) while a central service answers
    each one it receives; the service sees each request once and the client gets each
    reply once."""
    with federated(tmp_path, "rpc", "direct", proxied=True, forward=True, prefetch=32) as sites:
        central, remote, proxy = sites.central, sites.remote, sites.proxy
        assert proxy is not None
        wait_running(remote, "rpc")
        bind_queue(central, "calculator", "rpc", "calculator")
        connection, ch = channel(remote)
        reply_queue = ch.queue_declare("", durable=True).method.queue
        assert reply_queue.startswith("amq.gen-remote.")
        ch.queue_bind(reply_queue, "rpc", reply_queue)
        connection.close()
        wait_upstream_bindings(central, queue_name("rpc", "remote"), {("rpc", reply_queue)})
        seen: list[int] = []
        stop = threading.Event()
        client = threading.Thread(target=_requests, args=(remote.url, reply_queue))
        service = threading.Thread(target=_service, args=(central.url, seen, stop))
        service.start()
        client.start()
        try:
            for cut in range(1, 4):
                done = len(seen)
                wait_for(
                    f"requests answered before cut {cut}",
                    lambda d=done: len(seen) > d + 20 or not client.is_alive(),
                )
                proxy.cut()
                wait_for("the link down", lambda: links(remote)["rpc"]["state"] != "running")
                proxy.heal()
                wait_running(remote, "rpc")
            client.join(120)
            assert not client.is_alive()
            wait_for("every request answered", lambda: len(seen) >= REQUESTS, timeout=120)
        finally:
            stop.set()
            service.join(30)
        assert sorted(seen) == list(range(REQUESTS))  # each request once at the service
        replies = [int(body) for _k, body, _h in get_all(remote, reply_queue, REQUESTS)]
        assert sorted(replies) == [2 * i for i in range(REQUESTS)]  # each reply once
        assert queue_depth(remote, reply_queue) == 0


def _requests(url: str, reply_queue: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    ch = connection.channel()
    ch.confirm_delivery()
    for i in range(REQUESTS):
        properties = pika.BasicProperties(
            reply_to=reply_queue, correlation_id=str(i), delivery_mode=2
        )
        ch.basic_publish("rpc", "calculator", str(i).encode(), properties)
    connection.close()


def _service(url: str, seen: list[int], stop: threading.Event) -> None:
    """Answer each request with twice its number, on the federated exchange."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    ch = connection.channel()
    ch.confirm_delivery()
    while not stop.is_set():
        method, properties, body = ch.basic_get("calculator", auto_ack=False)
        if method is None:
            connection.sleep(0.05)
            continue
        n = int(body)
        ch.basic_publish(
            "rpc",
            properties.reply_to,
            str(2 * n).encode(),
            pika.BasicProperties(correlation_id=properties.correlation_id, delivery_mode=2),
        )
        ch.basic_ack(method.delivery_tag)  # after the reply is confirmed
        seen.append(n)
    connection.close()


def test_forwarding_blocked_by_the_upstreams_resource_alarm_does_not_stop_deliveries_down(
    tmp_path: Path,
) -> None:
    """A publish during a resource alarm stops the reads of its connection: forwarding
    has its own, so the link's consumer still acknowledges (prefetch 10, 50 messages
    waiting upstream) while the forward waits for the alarm to clear."""
    with federated(tmp_path, "x", "direct", forward=True, prefetch=10) as sites:
        central, remote = sites.central, sites.remote
        wait_running(remote, "x")
        bind_queue(remote, "inbox", "x", "down")
        wait_upstream_bindings(central, queue_name("x", "remote"), {("x", "down")})
        remote.stop()
        publish_confirmed(central, "x", [("down", str(i).encode()) for i in range(50)])
        central.stop()
        # A free-space limit no disk meets: central's disk alarm is on from the start.
        central.extra_args = [*central.extra_args, "--disk-free-limit", str(10**18)]
        central.start()
        remote.start()
        # Into the outbox before the link runs: forwarded as soon as it does.
        publish_confirmed(remote, "x", [("up", b"blocked by the alarm")])
        wait_running(remote, "x")
        wait_for("all fifty down", lambda: queue_depth(remote, "inbox") == 50)
        assert sorted(int(b) for _k, b, _h in get_all(remote, "inbox", 50)) == list(range(50))
        # The forward itself was read before its connection's reads stopped: confirmed.
        wait_for("the forward confirmed", lambda: links(remote)["x"]["forward_pending"] == 0)


def test_a_service_replying_on_the_default_exchange_reaches_the_remote_temporary_queue(
    tmp_path: Path,
) -> None:
    """The RabbitMQ habit: the service answers on the default exchange with the reply-to
    as routing key. No queue of that name on central (it names the remote's temporary
    queue, `amq.gen-remote.…`): central routes it to the remote's link queue that holds
    the binding the client made, once."""
    with federated(tmp_path, "rpc", "direct", forward=True) as sites:
        central, remote = sites.central, sites.remote
        wait_running(remote, "rpc")
        service_connection, service = channel(central)
        service.queue_declare("calculator", durable=True)
        service.queue_bind("calculator", "rpc", "calculator")
        client_connection, client = channel(remote)
        try:
            reply_queue = client.queue_declare("", exclusive=True).method.queue
            client.queue_bind(reply_queue, "rpc", reply_queue)
            wait_upstream_bindings(central, queue_name("rpc", "remote"), {("rpc", reply_queue)})
            client.basic_publish(
                "rpc", "calculator", b"1+1", pika.BasicProperties(reply_to=reply_queue)
            )
            got: list[tuple[pika.BasicProperties, bytes]] = []

            def request() -> bool:
                method, props, body = service.basic_get("calculator", auto_ack=True)
                if method is not None:
                    got.append((props, body))
                return bool(got)

            wait_for("the request on central", request)
            service.confirm_delivery()
            service.basic_publish("", got[0][0].reply_to, b"2", mandatory=True)  # routed
            replies: list[bytes] = []

            def reply() -> bool:
                method, _props, body = client.basic_get(reply_queue, auto_ack=True)
                if method is not None:
                    replies.append(body)
                return bool(replies)

            wait_for("the reply on the remote", reply)
            assert replies == [b"2"]
            # Another server's name with no link binding it is unroutable, as anywhere.
            with pytest.raises(pika.exceptions.UnroutableError):
                service.basic_publish("", "amq.gen-remote.nobody", b"x", mandatory=True)
        finally:
            client_connection.close()
            service_connection.close()
