"""Global routing keys (seed 002, "Global Message Routing"): request-response across sites
with the remote's temporary queues bound and their `reply-to` made global by the broker,
between real brokers through pika."""

from __future__ import annotations

from pathlib import Path

import pika
from federationsites import channel, federated, wait_running, wait_upstream_bindings
from pika.adapters.blocking_connection import BlockingChannel

from twinmq.broker.federation.agent import queue_name
from twinmq.testing.pair import status
from twinmq.testing.waiting import wait_for


def _take(ch: BlockingChannel, queue: str) -> tuple[pika.BasicProperties, bytes]:
    got: list[tuple[pika.BasicProperties, bytes]] = []

    def one() -> bool:
        method, props, body = ch.basic_get(queue, auto_ack=True)
        if method is not None:
            got.append((props, body))
        return bool(got)

    wait_for(f"a message in {queue}", one)
    return got[0]


def test_a_remote_client_gets_replies_without_binding_its_temporary_queues(
    tmp_path: Path,
) -> None:
    """Seed 002's request-response with `global-keys`: the remote client declares its
    reply queues (one server-named, one exclusive it named itself) and binds nothing; the
    broker binds them to `rpc` under their global keys (propagated upstream) and makes
    the named one's `reply-to` global (`remote.replies`). The central service answers
    one on the federated exchange and one on the default exchange; both replies reach
    the remote client."""
    with federated(tmp_path, "rpc", "direct", forward=True, **{"global-keys": True}) as sites:
        central, remote = sites.central, sites.remote
        wait_running(remote, "rpc")
        service_connection, service = channel(central)
        service.queue_declare("calculator", durable=True)
        service.queue_bind("calculator", "rpc", "calculator")
        client_connection, client = channel(remote)
        try:
            generated = client.queue_declare("", exclusive=True).method.queue
            assert generated.startswith("amq.gen-remote.")
            client.queue_declare("replies", exclusive=True)
            wait_upstream_bindings(
                central,
                queue_name("rpc", "remote"),
                {("rpc", generated), ("rpc", "remote.replies")},
            )
            client.confirm_delivery()
            for reply_to, question in ((generated, b"6*7"), ("replies", b"2+2")):
                client.basic_publish(
                    "rpc",
                    "calculator",
                    question,
                    pika.BasicProperties(
                        reply_to=reply_to, correlation_id=question.decode(), delivery_mode=2
                    ),
                )
            first, q1 = _take(service, "calculator")
            second, q2 = _take(service, "calculator")
            assert (q1, first.reply_to) == (b"6*7", generated)
            # Made global at the remote; every other property as the client set it.
            assert (q2, second.reply_to, second.correlation_id) == (
                b"2+2", "remote.replies", "2+2",
            )  # fmt: skip
            # On the federated exchange, and on the default one (as any RPC server does).
            service.basic_publish(
                "rpc", first.reply_to, b"42", pika.BasicProperties(correlation_id="6*7")
            )
            service.basic_publish(
                "", second.reply_to, b"4", pika.BasicProperties(correlation_id="2+2")
            )
            props, answer = _take(client, generated)
            assert (answer, props.correlation_id) == (b"42", "6*7")
            props, answer = _take(client, "replies")
            assert (answer, props.correlation_id) == (b"4", "2+2")
            data = status(remote)
            assert data is not None
            assert data["federation"]["global_keys_bound"] == 2
            assert data["federation"]["reply_to_rewritten"] == 1
        finally:
            client_connection.close()
            service_connection.close()
        # The queues gone with their connection: their upstream bindings go too.
        wait_upstream_bindings(central, queue_name("rpc", "remote"), set())


def test_a_local_service_answers_a_global_reply_to_on_the_default_exchange(
    tmp_path: Path,
) -> None:
    """A request that stays at the remote site carries the global `reply-to` too; a
    service there answering on the default exchange reaches the requester's queue (the
    server's own prefix names its local queue)."""
    with federated(tmp_path, "rpc", "direct", forward=True, **{"global-keys": True}) as sites:
        remote = sites.remote
        wait_running(remote, "rpc")
        connection, ch = channel(remote)
        try:
            ch.queue_declare("local-service", exclusive=True)
            ch.queue_bind("local-service", "rpc", "local")
            ch.queue_declare("my-replies", exclusive=True)
            ch.basic_publish("rpc", "local", b"ping", pika.BasicProperties(reply_to="my-replies"))
            props, _body = _take(ch, "local-service")
            assert props.reply_to == "remote.my-replies"
            ch.basic_publish("", props.reply_to, b"pong")
            _props, answer = _take(ch, "my-replies")
            assert answer == b"pong"
        finally:
            connection.close()
