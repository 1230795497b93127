"""Attacks on vhost isolation with a real broker and pika (helper attack12).

Each test names the isolation property it proves; a failure is a way for a user with
rights in one vhost to affect another.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from mirrorsites import Sites, mirror_status

from twinmq.broker.connection import DEDUP_CLIENT_PROPERTY
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import status

# `/` has a user whose rights stop at `/`; the vhost `orders` has its own tenant.
USERS = ["root-user", "tenant"]
GRANTS = [
    {"user": "root-user", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
    {"user": "tenant", "vhost": "orders", "configure": ".*", "write": ".*", "read": ".*"},
]


def users_file(path: Path) -> Path:
    """The users file of these attacks: `/` and `orders`, USERS with GRANTS."""
    path.write_text(
        json.dumps(
            {
                "users": [{"name": n, "password": f"{n}-pw"} for n in USERS],
                "vhosts": [{"name": "/"}, {"name": "orders"}],
                "permissions": GRANTS,
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    root = tmp_path_factory.mktemp("vhost-attacks")
    users = users_file(root / "users.json")
    with BrokerProcess(
        root / "data", name="vha", extra_args=["--users-file", str(users)]
    ).start() as started:
        yield started


def connect(broker: BrokerProcess, user: str, vhost: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            host="127.0.0.1",
            port=broker.port,
            virtual_host=vhost,
            credentials=pika.PlainCredentials(user, f"{user}-pw"),
            connection_attempts=1,
            client_properties={DEDUP_CLIENT_PROPERTY: True},
        )
    )


def test_a_publish_in_one_vhost_never_deduplicates_a_publish_in_another(
    broker: BrokerProcess,
) -> None:
    """The dedup window is the broker's, its keys scoped by vhost: a user of `/` who
    names an exchange after the vhost `orders` and puts a NUL in a message id must not
    make the tenant's confirmed publish of `m-1` a "duplicate" (confirmed, never queued)."""
    attacker = connect(broker, "root-user", "/")
    ch = attacker.channel()
    ch.confirm_delivery()
    ch.exchange_declare("orders", "fanout")
    ch.queue_declare("sink")
    ch.queue_bind("sink", "orders")
    # Scoped key of `/`: "orders" NUL "" NUL "work\x00m-1", i.e. exactly the key of
    # ("orders", exchange "", routing key "work", message id "m-1").
    ch.basic_publish("orders", "", b"decoy", pika.BasicProperties(message_id="work\x00m-1"))
    attacker.close()

    tenant = connect(broker, "tenant", "orders")
    tch = tenant.channel()
    tch.confirm_delivery()
    tch.queue_declare("work", durable=True)
    tch.basic_publish(
        "", "work", b"real order", pika.BasicProperties(message_id="m-1", delivery_mode=2)
    )
    method, _, body = tch.basic_get("work", auto_ack=True)
    tenant.close()
    assert method is not None and body == b"real order"


def _closed_with(code: int, call: object) -> str:
    """`call()` must close its channel with `code`; the reply text."""
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
        call()  # type: ignore[operator]
    assert caught.value.reply_code == code
    return str(caught.value.reply_text)


def test_a_user_of_one_vhost_cannot_reach_another_vhosts_queue_by_its_name(
    broker: BrokerProcess,
) -> None:
    """The tenant's queue (a plain one, a server-named one, an exclusive one) is not found
    from `/` by passive declare, basic.get, purge, bind, consume or delete; `/`'s
    exclusive queue of the same name is its own; nothing published in `/`, in a
    transaction or not, reaches the tenant's queue."""
    tenant = connect(broker, "tenant", "orders")
    tch = tenant.channel()
    tch.confirm_delivery()
    tch.queue_declare("secret", durable=True)
    tch.basic_publish("", "secret", b"tenant's", pika.BasicProperties(delivery_mode=2))
    generated = tch.queue_declare("", exclusive=True).method.queue
    tch.queue_declare("mine-only", exclusive=True)

    attacker = connect(broker, "root-user", "/")
    for name in ("secret", generated):
        assert "in vhost '/'" in _closed_with(
            404, lambda n=name: attacker.channel().queue_declare(n, passive=True)
        )
        _closed_with(404, lambda n=name: attacker.channel().basic_get(n, auto_ack=True))
        _closed_with(404, lambda n=name: attacker.channel().queue_purge(n))
        _closed_with(404, lambda n=name: attacker.channel().queue_bind(n, "amq.fanout"))
        _closed_with(404, lambda n=name: attacker.channel().basic_consume(n, lambda *a: None))
    ach = attacker.channel()
    ach.queue_delete("secret")  # RabbitMQ: deleting a missing queue is ok; it is `/`'s
    ach.queue_declare("mine-only", exclusive=True)  # not locked by the tenant's
    ach.tx_select()
    ach.basic_publish("", "secret", b"from root")
    ach.basic_publish("amq.direct", "secret", b"from root")
    ach.tx_commit()
    attacker.close()

    tch.queue_declare("mine-only", passive=True)  # still the tenant's own
    method, _, body = tch.basic_get("secret", auto_ack=True)
    assert method is not None and body == b"tenant's"
    assert tch.basic_get("secret", auto_ack=True)[0] is None
    tenant.close()


def test_a_dead_letter_exchange_names_an_exchange_of_its_own_vhost(
    broker: BrokerProcess,
) -> None:
    """A `/` queue whose x-dead-letter-exchange is the name of the tenant's exchange
    dead-letters into `/`'s exchange of that name (missing: dropped), never the tenant's."""
    tenant = connect(broker, "tenant", "orders")
    tch = tenant.channel()
    tch.exchange_declare("tenant-dlx", "fanout", durable=True)
    tch.queue_declare("tenant-dead", durable=True)
    tch.queue_bind("tenant-dead", "tenant-dlx")

    attacker = connect(broker, "root-user", "/")
    ach = attacker.channel()
    ach.confirm_delivery()
    ach.queue_declare("doomed", arguments={"x-dead-letter-exchange": "tenant-dlx"})
    ach.basic_publish("", "doomed", b"injected")
    method, _, _ = ach.basic_get("doomed")
    assert method is not None
    ach.basic_reject(method.delivery_tag, requeue=False)
    ach.queue_declare("doomed", passive=True)  # the reject is processed
    attacker.close()

    assert tch.basic_get("tenant-dead", auto_ack=True)[0] is None
    tenant.close()


def test_a_vhost_name_is_matched_exactly(broker: BrokerProcess) -> None:
    """Neither `%2F` nor `Orders` nor `orders/` opens `orders` or `/`."""
    for name in ("%2F", "Orders", "orders/", "orders\x00"):
        with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as caught:
            connect(broker, "tenant", name)
        assert "NOT_ALLOWED" in str(caught.value)


def test_a_tenant_flooding_message_ids_does_not_evict_another_vhosts_dedup_keys(
    tmp_path: Path,
) -> None:
    """The dedup window is the broker's and bounded (`--dedup-window`): a tenant that
    publishes more distinct message ids than it holds must not push `/`'s keys out, or
    a `/` publisher's re-send (after a lost confirm) is enqueued twice. Fails on main:
    one window, evicted oldest first, shared by every vhost (a fix: a window per vhost,
    or a share of it per vhost)."""
    users = users_file(tmp_path / "users.json")
    with BrokerProcess(
        tmp_path / "data",
        name="vhd",
        extra_args=["--users-file", str(users), "--dedup-window", "8"],
    ).start() as broker:
        root = connect(broker, "root-user", "/")
        rch = root.channel()
        rch.confirm_delivery()
        rch.queue_declare("payments", durable=True)
        resend = pika.BasicProperties(message_id="pay-1", delivery_mode=2)
        rch.basic_publish("", "payments", b"pay", resend)

        tenant = connect(broker, "tenant", "orders")
        tch = tenant.channel()
        tch.confirm_delivery()
        tch.queue_declare("flood")
        for n in range(8):
            tch.basic_publish("", "flood", b"x", pika.BasicProperties(message_id=f"f-{n}"))
        tenant.close()

        rch.basic_publish("", "payments", b"pay", resend)  # the re-send
        got = [rch.basic_get("payments", auto_ack=True)[0] is not None for _ in range(3)]
        root.close()
        assert got == [True, False, False]


def test_a_tenant_deleting_and_purging_its_queues_reaches_the_dr_mirror_as_just_that(
    tmp_path: Path,
) -> None:
    """The mirror carries every vhost: a tenant's queue deleted with its messages, purged,
    or expiring them (their settles, in batches where the queue may be gone already)
    reaches the mirror as exactly that, never as an error, and `/` keeps mirroring."""
    users = users_file(tmp_path / "users.json")
    with Sites(tmp_path, source_args=["--users-file", str(users)]) as sites:
        tenant = connect(sites.source, "tenant", "orders")
        tch = tenant.channel()
        tch.confirm_delivery()
        for name in ("gone", "purged", "expiring"):
            args = {"x-message-ttl": 1} if name == "expiring" else None
            tch.queue_declare(name, durable=True, arguments=args)
            for _ in range(5):
                tch.basic_publish("", name, b"t", pika.BasicProperties(delivery_mode=2))
        tch.queue_delete("gone")
        tch.queue_purge("purged")
        tenant.close()
        root = connect(sites.source, "root-user", "/")
        rch = root.channel()
        rch.confirm_delivery()
        rch.queue_declare("after", durable=True)
        rch.basic_publish("", "after", b"r", pika.BasicProperties(delivery_mode=2))
        root.close()
        sites.caught_up()
        data = status(sites.mirror)
        assert data is not None
        mirrored = {
            (q["vhost"], q["name"]): q["messages"]
            for q in data["queues"]
            if not q["name"].startswith("amq.twinmq.")
        }
        assert mirrored == {("/", "after"): 1, ("orders", "purged"): 0, ("orders", "expiring"): 0}
        mirror = mirror_status(sites.source)
        assert mirror is not None and not mirror.get("link_error")
        log = sites.mirror.log_path
        assert log is not None
        assert " ERROR " not in log.read_text() and "Traceback" not in log.read_text()
