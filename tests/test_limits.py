"""Limits against exhaustion, with clear errors: connections (total and per user), queues,
the queue length cap."""

from __future__ import annotations

import json
from pathlib import Path

import pika
import pika.exceptions
import pytest
from federationsites import (
    bind_queue,
    federated,
    federation_file,
    get_all,
    links,
    publish_confirmed,
    queue_depth,
    site,
    wait_running,
    wait_upstream_bindings,
)

from twinmq.broker.federation.agent import queue_name
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for


def connect(broker: BrokerProcess, user: str = "guest") -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            host="127.0.0.1", port=broker.port,
            credentials=pika.PlainCredentials(user, f"{user}-pw" if user != "guest" else "guest"),
            connection_attempts=1,
        )
    )  # fmt: skip


def test_connections_beyond_the_limit_are_closed_at_once_and_counted(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path, name="lim", extra_args=["--max-connections", "2"]).start() as b:
        first, second = connect(b), connect(b)
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            connect(b)
        first.close()
        third = connect(b)  # a freed slot is usable again
        third.close()
        second.close()
        assert 'twinmq_connections_refused_total{limit="total"} 1.0' in b.admin.metrics()
        assert b.log_path is not None and "the limit of 2 is reached" in b.log_path.read_text()


def test_a_user_at_its_connection_limit_is_refused_with_530_and_others_are_not(
    tmp_path: Path,
) -> None:
    users = tmp_path / "users.json"
    users.write_text(json.dumps({"users": [{"name": "app", "password": "app-pw"},
                                           {"name": "guest", "password": "guest"}]}))  # fmt: skip
    args = ["--users-file", str(users), "--max-connections-per-user", "1"]
    with BrokerProcess(tmp_path / "data", name="lim", extra_args=args).start() as b:
        held = connect(b, "app")
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as caught:
            connect(b, "app")
        assert "530" in str(caught.value)
        assert "user 'app' has reached its limit of 1 connections" in str(caught.value)
        connect(b, "guest").close()  # another user is not counted against app
        held.close()
        connect(b, "app").close()


def test_a_queue_declare_beyond_the_queue_limit_is_refused_with_406(tmp_path: Path) -> None:
    with BrokerProcess(tmp_path, name="lim", extra_args=["--max-queues", "2"]).start() as b:
        conn = connect(b)
        ch = conn.channel()
        ch.queue_declare("one")
        ch.queue_declare("two")
        ch.queue_declare("two")  # an existing queue at the limit: still declare-ok
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
            ch.queue_declare("three")
        assert caught.value.reply_code == 406
        assert "queue limit (2) is reached" in caught.value.reply_text
        ch = conn.channel()
        ch.queue_delete("one")
        ch.queue_declare("three")
        conn.close()


PERSISTENT = pika.BasicProperties(delivery_mode=2)


def test_the_queue_length_cap_refuses_publishes_beyond_it_and_never_drops_one(
    tmp_path: Path,
) -> None:
    with BrokerProcess(tmp_path, name="lim", extra_args=["--max-queue-length", "3"]).start() as b:
        conn = connect(b)
        ch = conn.channel()
        ch.queue_declare("capped", durable=True)
        ch.queue_declare("own-lower", durable=True, arguments={"x-max-length": 2})
        ch.queue_declare("own-higher", durable=True, arguments={"x-max-length": 10})
        ch.confirm_delivery()
        for queue in ("capped", "own-higher"):
            for i in range(3):
                ch.basic_publish("", queue, f"{queue}-{i}".encode(), PERSISTENT)
            with pytest.raises(pika.exceptions.NackError):
                ch.basic_publish("", queue, b"one too many", PERSISTENT)
        # The queue's own lower limit keeps its own overflow (drop-head, as declared).
        for i in range(3):
            ch.basic_publish("", "own-lower", f"own-lower-{i}".encode(), PERSISTENT)
        conn.close()
        assert drain(b.url, "capped") == [b"capped-0", b"capped-1", b"capped-2"]
        assert drain(b.url, "own-higher") == [b"own-higher-0", b"own-higher-1", b"own-higher-2"]
        assert drain(b.url, "own-lower") == [b"own-lower-1", b"own-lower-2"]
        assert "twinmq_messages_refused_by_length_cap_total 2.0" in b.admin.metrics()
        assert b.log_path is not None
        assert (
            "queue 'capped' in vhost '/' is at the broker's queue length limit "
            "(at most 3 messages)" in b.log_path.read_text()
        )


def test_the_byte_cap_counts_ready_bodies_and_a_consumed_message_makes_room(
    tmp_path: Path,
) -> None:
    args = ["--max-queue-length-bytes", "10"]
    with BrokerProcess(tmp_path, name="lim", extra_args=args).start() as b:
        conn = connect(b)
        ch = conn.channel()
        ch.queue_declare("bytes")
        ch.confirm_delivery()
        ch.basic_publish("", "bytes", b"123456")
        with pytest.raises(pika.exceptions.NackError):
            ch.basic_publish("", "bytes", b"abcdef")
        method, _, _ = ch.basic_get("bytes", auto_ack=True)
        assert method is not None
        ch.basic_publish("", "bytes", b"abcdef")  # room again
        conn.close()
        assert drain(b.url, "bytes") == [b"abcdef"]


def test_a_publish_one_queue_refuses_goes_to_no_queue_and_is_nacked(
    tmp_path: Path,
) -> None:
    with BrokerProcess(tmp_path, name="lim", extra_args=["--max-queue-length", "1"]).start() as b:
        conn = connect(b)
        ch = conn.channel()
        ch.exchange_declare("fan", "fanout")
        for queue in ("full", "free"):
            ch.queue_declare(queue)
            ch.queue_bind(queue, "fan")
        ch.basic_publish("", "full", b"filler")
        ch.confirm_delivery()
        with pytest.raises(pika.exceptions.NackError):
            ch.basic_publish("fan", "", b"both")
        conn.close()
        # Not kept where there was room (RabbitMQ keeps it): a nack means not taken.
        assert drain(b.url, "free") == []
        assert drain(b.url, "full") == [b"filler"]


def test_a_transaction_past_the_cap_is_refused_whole_and_its_acks_come_back(
    tmp_path: Path,
) -> None:
    with BrokerProcess(tmp_path, name="lim", extra_args=["--max-queue-length", "3"]).start() as b:
        conn = connect(b)
        ch = conn.channel()
        ch.queue_declare("work", durable=True)
        ch.queue_declare("out", durable=True)
        for body in (b"w1", b"o1", b"o2"):
            ch.basic_publish("", "out" if body.startswith(b"o") else "work", body, PERSISTENT)
        ch.tx_select()
        method, _, _ = ch.basic_get("work")
        assert method is not None
        ch.basic_ack(method.delivery_tag)
        ch.basic_publish("", "out", b"o3", PERSISTENT)  # fits alone
        ch.basic_publish("", "out", b"o4", PERSISTENT)  # not with o3
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
            ch.tx_commit()
        assert caught.value.reply_code == 406
        assert "tx.commit refused: queue 'out' in vhost '/'" in caught.value.reply_text
        assert "at most 3 messages" in caught.value.reply_text
        ch = conn.channel()
        ch.tx_select()
        ch.basic_publish("", "out", b"o3", PERSISTENT)
        ch.tx_commit()  # one fits: committed
        conn.close()
        assert drain(b.url, "out") == [b"o1", b"o2", b"o3"]
        assert drain(b.url, "work") == [b"w1"]  # its ack went with the refused commit


def test_messages_down_a_federation_link_are_not_capped_so_none_is_lost(tmp_path: Path) -> None:
    # Refused downstream, a message would be acknowledged upstream and gone: the cap
    # applies where clients publish (the link's queue upstream), not to the link's delivery.
    central = site(tmp_path, "central")
    with central.start():
        config = federation_file(
            tmp_path / "remote.json",
            {"central": f"127.0.0.1:{central.port}"},
            [{"exchange": "market", "upstream": "central", "type": "topic"}],
        )
        remote = site(tmp_path, "remote", federation=config)
        remote.extra_args += ["--max-queue-length", "1"]
        with remote.start():
            wait_running(remote, "market")
            bind_queue(remote, "watcher", "market", "stock.#")
            wait_upstream_bindings(central, queue_name("market", "remote"), {("market", "stock.#")})
            publish_confirmed(central, "market", [("stock.a", b"1"), ("stock.b", b"2")])
            wait_for("both downstream", lambda: queue_depth(remote, "watcher") == 2)
            assert [body for _, body, _ in get_all(remote, "watcher", 2)] == [b"1", b"2"]


def test_a_federation_outbox_is_capped_while_its_upstream_is_away_and_drains_after(
    tmp_path: Path,
) -> None:
    """The outbox of a forwarding exchange is filled by clients' publishes: uncapped, it
    grew without end while the upstream was away or refused. At the cap a publish on the
    exchange is nacked (taken by no queue); once the upstream is back the outbox drains
    and publishes are taken again, each forwarded once."""
    with federated(tmp_path, "requests", "direct", forward=True) as sites:
        central, remote = sites.central, sites.remote
        bind_queue(central, "service", "requests", "svc")
        remote.stop()
        remote.extra_args += ["--max-queue-length", "2"]
        remote.start()
        wait_running(remote, "requests")
        central.stop()
        publish_confirmed(remote, "requests", [("svc", b"1"), ("svc", b"2")])
        with pytest.raises(pika.exceptions.NackError):
            publish_confirmed(remote, "requests", [("svc", b"refused")])
        central.start()
        wait_for("the outbox forwarded", lambda: queue_depth(central, "service") == 2, timeout=60)
        wait_for("the outbox empty", lambda: links(remote)["requests"]["forward_pending"] == 0)
        publish_confirmed(remote, "requests", [("svc", b"3")])
        bodies = [body for _, body, _ in get_all(central, "service", 3)]
        assert bodies == [b"1", b"2", b"3"]
