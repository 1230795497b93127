"""Attacks on vhost isolation with a real broker and pika (helper attack12).

Each test names the isolation property it proves; a failure is a way for a user with
rights in one vhost to affect another.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pika
import pytest

from twinmq.broker.connection import DEDUP_CLIENT_PROPERTY
from twinmq.testing.launcher import BrokerProcess

# `/` has a user whose rights stop at `/`; the vhost `orders` has its own tenant.
USERS = ["root-user", "tenant"]
GRANTS = [
    {"user": "root-user", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"},
    {"user": "tenant", "vhost": "orders", "configure": ".*", "write": ".*", "read": ".*"},
]


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    root = tmp_path_factory.mktemp("vhost-attacks")
    users = root / "users.json"
    users.write_text(
        json.dumps(
            {
                "users": [{"name": n, "password": f"{n}-pw"} for n in USERS],
                "vhosts": [{"name": "/"}, {"name": "orders"}],
                "permissions": GRANTS,
            }
        )
    )
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
