"""Virtual hosts with RabbitMQ's semantics, with real brokers and real clients (pika, aio-pika).

Each vhost the users file declares has its own exchanges (its own `amq.*`), queues and
bindings; a user's permissions are per vhost; its durable state survives a restart and
a failover of the pair (kill -9), and what `/` stored before vhosts existed opens as `/`.
"""

from __future__ import annotations

import asyncio
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import amqp.exceptions
import kombu
import pika
import pika.exceptions
import pytest
from disks import end_log_at_a_page, small_tmpfs
from jepsen import DiskFiller

from twinmq.broker.admin_client import AdminError
from twinmq.broker.definitions import (
    BindingDef,
    DefinitionsDelta,
    ExchangeDef,
    QueueDef,
    TopologyState,
)
from twinmq.broker.federation.identity import SERVER_ID_PROPERTY
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair, status
from twinmq.testing.waiting import wait_for

USERS = ["admin", "alice", "bob"]
VHOSTS = ["/", "tenant-a", "tenant-b"]
GRANTS: list[dict[str, str]] = [
    *({"user": "admin", "vhost": v, "configure": ".*", "write": ".*", "read": ".*"}
      for v in VHOSTS),
    # alice: everything in tenant-a, nothing in `/` (no entry: she may not open it).
    {"user": "alice", "vhost": "tenant-a", "configure": ".*", "write": ".*", "read": ".*"},
    # bob: reads `orders` in tenant-a, and may do nothing else there.
    {"user": "bob", "vhost": "tenant-a", "configure": "^$", "write": "^$", "read": "^orders$"},
]  # fmt: skip


def users_file(
    path: Path, vhosts: list[str] = VHOSTS, grants: list[dict[str, str]] = GRANTS
) -> Path:
    # Tagged `federation`: each may be a federation link's user (the link tests log in so).
    users = [{"name": name, "password": f"{name}-pw", "tags": ["federation"]} for name in USERS]
    served = set(vhosts)
    path.write_text(
        json.dumps(
            {
                "users": users,
                "vhosts": [{"name": v} for v in vhosts],
                "permissions": [g for g in grants if g["vhost"] in served],
            }
        )
    )
    return path


def connect(broker: BrokerProcess, user: str, vhost: str) -> pika.BlockingConnection:
    return pika.BlockingConnection(
        pika.ConnectionParameters(
            host="127.0.0.1", port=broker.port, virtual_host=vhost,
            credentials=pika.PlainCredentials(user, f"{user}-pw"), connection_attempts=1,
        )
    )  # fmt: skip


def publish(broker: BrokerProcess, vhost: str, queue: str, bodies: list[bytes]) -> None:
    """Declare the durable `queue` in `vhost` and publish `bodies` to it, confirmed."""
    conn = connect(broker, "admin", vhost)
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    ch.confirm_delivery()
    for body in bodies:
        ch.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
    conn.close()


def drain(broker: BrokerProcess, vhost: str, queue: str) -> list[bytes]:
    conn = connect(broker, "admin", vhost)
    ch = conn.channel()
    got = []
    while (item := ch.basic_get(queue, auto_ack=True))[0] is not None:
        got.append(item[2])
    conn.close()
    return got


def open_refused(broker: BrokerProcess, user: str, vhost: str) -> str:
    """connect as `user` to `vhost`: it must be refused with 530; the reason."""
    # pika's name for a connection.close in reply to connection.open.
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as caught:
        connect(broker, user, vhost)
    text = str(caught.value)
    assert '(530) "NOT_ALLOWED - ' in text
    return text


def queues_by_vhost(broker: BrokerProcess) -> dict[tuple[str, str], int]:
    data = status(broker)
    assert data is not None
    return {(q["vhost"], q["name"]): q["messages"] for q in data["queues"]}


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    root = tmp_path_factory.mktemp("vhosts")
    users = users_file(root / "users.json")
    with BrokerProcess(
        root / "data", name="vh", extra_args=["--users-file", str(users)]
    ).start() as started:
        yield started


def test_the_same_queue_name_in_two_vhosts_is_two_queues(broker: BrokerProcess) -> None:
    publish(broker, "/", "orders", [b"root-1"])
    publish(broker, "tenant-a", "orders", [b"a-1", b"a-2"])
    assert queues_by_vhost(broker)[("/", "orders")] == 1
    assert queues_by_vhost(broker)[("tenant-a", "orders")] == 2
    assert drain(broker, "tenant-a", "orders") == [b"a-1", b"a-2"]
    assert drain(broker, "/", "orders") == [b"root-1"]


def test_each_vhost_has_its_own_exchanges_and_bindings(broker: BrokerProcess) -> None:
    a = connect(broker, "admin", "tenant-a")
    cha = a.channel()
    cha.exchange_declare("events", "topic", durable=True)
    cha.queue_declare("audit", durable=True)
    cha.queue_bind("audit", "events", "#")
    cha.queue_bind("audit", "amq.fanout")  # tenant-a's own amq.fanout
    b = connect(broker, "admin", "tenant-b")
    chb = b.channel()
    chb.queue_declare("audit", durable=True)
    chb.exchange_declare("amq.fanout", "fanout", passive=True)  # tenant-b has its amq.* set
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
        chb.exchange_declare("events", "topic", passive=True)
    assert caught.value.reply_code == 404
    assert "no exchange 'events' in vhost 'tenant-b'" in caught.value.reply_text
    chb = b.channel()
    chb.confirm_delivery()
    chb.basic_publish("amq.fanout", "", b"b-fanout")  # tenant-b's amq.fanout: no binding
    cha.confirm_delivery()
    cha.basic_publish("events", "x.y", b"a-event")
    cha.basic_publish("amq.fanout", "", b"a-fanout")
    a.close()
    b.close()
    assert drain(broker, "tenant-a", "audit") == [b"a-event", b"a-fanout"]
    assert drain(broker, "tenant-b", "audit") == []


def test_connection_open_to_an_unknown_vhost_is_refused(broker: BrokerProcess) -> None:
    assert "vhost 'nowhere' not found" in open_refused(broker, "admin", "nowhere")


def test_connection_open_without_permission_on_the_vhost_is_refused(
    broker: BrokerProcess,
) -> None:
    reason = open_refused(broker, "alice", "/")
    assert "NOT_ALLOWED - access to vhost '/' refused for user 'alice'" in reason
    reason = open_refused(broker, "bob", "tenant-b")
    assert "access to vhost 'tenant-b' refused for user 'bob'" in reason
    connect(broker, "alice", "tenant-a").close()  # where she has permissions


def test_a_federation_link_opens_any_vhost_its_user_may_use(broker: BrokerProcess) -> None:
    """Federation serves every vhost (docs/federation.md, "Virtual hosts"): a connection
    announcing a server id (a federation link) opens any vhost its user has permissions
    in, and is refused with RabbitMQ's words in one where it has none."""

    def link(vhost: str, user: str = "admin") -> pika.BlockingConnection:
        return pika.BlockingConnection(
            pika.ConnectionParameters(
                host="127.0.0.1", port=broker.port, virtual_host=vhost,
                credentials=pika.PlainCredentials(user, f"{user}-pw"), connection_attempts=1,
                client_properties={SERVER_ID_PROPERTY: "some-other-server"},
            )
        )  # fmt: skip

    link("tenant-a").close()
    link("/").close()
    with pytest.raises(pika.exceptions.ProbableAccessDeniedError) as caught:
        link("tenant-b", "alice")
    assert "access to vhost 'tenant-b' refused for user 'alice'" in str(caught.value)


def test_permissions_are_those_of_the_vhost_opened(broker: BrokerProcess) -> None:
    publish(broker, "tenant-a", "orders", [b"for-bob"])
    conn = connect(broker, "bob", "tenant-a")
    method, _, body = conn.channel().basic_get("orders", auto_ack=True)
    assert method is not None and body == b"for-bob"  # read on orders: granted
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as caught:
        conn.channel().queue_declare("bobs-own", durable=True)
    assert caught.value.reply_code == 403
    assert (
        "configure access to queue 'bobs-own' in vhost 'tenant-a' refused for user 'bob'"
        in caught.value.reply_text
    )
    conn.close()


def test_aio_pika_works_in_a_vhost_and_sees_the_refusals(broker: BrokerProcess) -> None:
    base = f"127.0.0.1:{broker.port}"

    async def run() -> None:
        connection = await aio_pika.connect(f"amqp://alice:alice-pw@{base}/tenant-a")
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.declare_queue("aio", durable=True)
        await channel.default_exchange.publish(aio_pika.Message(b"aio-a"), "aio")
        got = await queue.get(no_ack=True, fail=False)
        assert got is not None and got.body == b"aio-a"
        await connection.close()
        # aiormq reports the connection.close in reply to open without its text (pika's
        # test above checks the words).
        with pytest.raises(Exception, match=r"Connection\.Close"):
            await aio_pika.connect(f"amqp://alice:alice-pw@{base}/")

    asyncio.run(run())
    assert ("/", "aio") not in queues_by_vhost(broker)


def test_kombu_works_in_a_vhost_and_sees_the_refusal(broker: BrokerProcess) -> None:
    url = f"amqp://alice:alice-pw@127.0.0.1:{broker.port}/tenant-a"
    with kombu.Connection(url) as conn:
        queue = kombu.Queue("kombu-q", durable=True, channel=conn.channel())
        queue.declare()
        conn.Producer().publish(b"via-kombu", routing_key="kombu-q", delivery_mode=2)
        got = queue.get(no_ack=True)
        assert got is not None and got.body == b"via-kombu"
    bob = kombu.Connection(f"amqp://bob:bob-pw@127.0.0.1:{broker.port}/tenant-a")
    with bob, pytest.raises(amqp.exceptions.AccessRefused, match="vhost 'tenant-a'"):
        kombu.Queue("bobs-kombu", channel=bob.channel()).declare()
    assert ("/", "kombu-q") not in queues_by_vhost(broker)


def test_status_lists_the_vhosts_and_what_the_mirror_and_federation_cover(
    broker: BrokerProcess,
) -> None:
    data = status(broker)
    assert data is not None
    vhosts = {v["name"]: v for v in data["vhosts"]}
    assert set(vhosts) >= set(VHOSTS)
    # The one-way DR mirror carries every vhost (the bidirectional mode `/` only:
    # tests/test_mirror_vhosts.py); federation every vhost.
    assert vhosts["/"]["mirrored"] and vhosts["/"]["federated"]
    assert vhosts["tenant-a"]["mirrored"] and vhosts["tenant-a"]["federated"]
    assert all(v["served"] for v in vhosts.values())
    # The same on /metrics.
    samples = broker.admin.metrics().splitlines()
    for name in ("twinmq_vhost_mirrored", "twinmq_vhost_federated"):
        assert f'{name}{{vhost="/"}} 1.0' in samples
    assert 'twinmq_vhost_mirrored{vhost="tenant-a"} 1.0' in samples
    assert 'twinmq_vhost_federated{vhost="tenant-a"} 1.0' in samples


def _queue_gauges(broker: BrokerProcess, queue: str) -> dict[tuple[str, str], float]:
    """The per-queue gauges of `queue` on `/metrics`: (series name, vhost) -> value."""
    found = {}
    for line in broker.admin.metrics().splitlines():
        if line.startswith("twinmq_queue_messages_") and f'queue="{queue}"' in line:
            series, value = line.rsplit(" ", 1)
            name, labels = series.split("{", 1)
            vhost = labels.split('vhost="', 1)[1].split('"', 1)[0]
            found[(name, vhost)] = float(value)
    return found


def test_two_vhosts_queues_of_one_name_are_two_prometheus_series(broker: BrokerProcess) -> None:
    publish(broker, "/", "metered", [b"root-1"])
    publish(broker, "tenant-a", "metered", [b"a-1", b"a-2"])
    gauges = _queue_gauges(broker, "metered")
    assert gauges[("twinmq_queue_messages_ready", "/")] == 1
    assert gauges[("twinmq_queue_messages_ready", "tenant-a")] == 2
    assert gauges[("twinmq_queue_messages_unacknowledged", "tenant-a")] == 0
    drain(broker, "tenant-a", "metered")
    conn = connect(broker, "admin", "tenant-a")
    conn.channel().queue_delete("metered")
    conn.close()
    # The deleted queue's series goes; `/`'s of that name stays.
    gauges = _queue_gauges(broker, "metered")
    assert ("twinmq_queue_messages_ready", "tenant-a") not in gauges
    assert gauges[("twinmq_queue_messages_ready", "/")] == 1
    assert drain(broker, "/", "metered") == [b"root-1"]


def test_vhosts_survive_a_restart_and_follow_the_users_file_without_one(tmp_path: Path) -> None:
    users = users_file(tmp_path / "users.json", ["/", "tenant-a"])
    broker = BrokerProcess(
        tmp_path / "data", name="vh-restart", extra_args=["--users-file", str(users)]
    )
    with broker.start():
        publish(broker, "/", "orders", [b"root"])
        publish(broker, "tenant-a", "orders", [b"a-1", b"a-2"])
        assert "vhost 'tenant-b' not found" in open_refused(broker, "admin", "tenant-b")
        users_file(users, VHOSTS)  # tenant-b added: served without a restart
        wait_for("tenant-b served", lambda: _opens(broker, "tenant-b"), timeout=30)
        publish(broker, "tenant-b", "orders", [b"b-1"])
    with broker.start():
        counts = queues_by_vhost(broker)
        assert counts[("/", "orders")] == 1
        assert counts[("tenant-a", "orders")] == 2
        assert counts[("tenant-b", "orders")] == 1
        users_file(users, ["/", "tenant-a"])  # tenant-b removed: refused, its content kept
        wait_for("tenant-b refused", lambda: not _opens(broker, "tenant-b"), timeout=30)
        assert "vhost 'tenant-b' not found" in open_refused(broker, "admin", "tenant-b")
        data = status(broker)
        assert data is not None
        retired = next(v for v in data["vhosts"] if v["name"] == "tenant-b")
        assert not retired["served"] and retired["queues"] == 1
        assert queues_by_vhost(broker)[("tenant-b", "orders")] == 1
        assert drain(broker, "tenant-a", "orders") == [b"a-1", b"a-2"]
        assert drain(broker, "/", "orders") == [b"root"]
        users_file(users, VHOSTS)  # back: served again, with what it held
        wait_for("tenant-b served again", lambda: _opens(broker, "tenant-b"), timeout=30)
        assert drain(broker, "tenant-b", "orders") == [b"b-1"]


def _opens(broker: BrokerProcess, vhost: str) -> bool:
    try:
        connect(broker, "admin", vhost).close()
    except pika.exceptions.ProbableAccessDeniedError:
        return False
    return True


def test_a_data_dir_written_before_vhosts_opens_with_its_queues_in_slash(tmp_path: Path) -> None:
    """The definitions snapshot as versions before vhosts wrote it (no `vhost` fields,
    its checksum over that JSON) opens unchanged: its objects are `/`'s."""
    topology: dict[str, Any] = {
        "exchanges": [
            {"name": "legacy-x", "type": "direct", "durable": True, "auto_delete": False,
             "internal": False, "arguments": {}},
        ],
        "queues": [
            {"name": "legacy", "qid": 1, "durable": True, "exclusive": False,
             "auto_delete": False, "arguments": {}},
        ],
        "bindings": [
            {"exchange": "legacy-x", "queue": "legacy", "routing_key": "k", "arguments": {}},
        ],
        "next_qid": 2,
    }  # fmt: skip
    compact = json.dumps(topology, separators=(",", ":")).encode()
    journal = tmp_path / "data" / "journal"
    journal.mkdir(parents=True)
    (journal / "definitions.json").write_text(
        json.dumps({**topology, "crc32": zlib.crc32(compact)}, indent=1)
    )
    users = users_file(tmp_path / "users.json")
    broker = BrokerProcess(
        tmp_path / "data", name="vh-old", extra_args=["--users-file", str(users)]
    )
    with broker.start():
        assert ("/", "legacy") in queues_by_vhost(broker)
        conn = connect(broker, "admin", "/")
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("legacy-x", "k", b"routed", pika.BasicProperties(delivery_mode=2))
        conn.close()
        assert drain(broker, "/", "legacy") == [b"routed"]
        a = connect(broker, "admin", "tenant-a")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker):
            a.channel().queue_declare("legacy", passive=True)  # `/`'s, not tenant-a's
        a.close()


def test_a_failover_keeps_every_vhost(tmp_path: Path) -> None:
    users = users_file(tmp_path / "users.json")
    with Pair(tmp_path / "pair", broker_args=["--users-file", str(users)]) as pair:
        publish(pair.active, "/", "orders", [b"root-1", b"root-2"])
        publish(pair.active, "tenant-a", "orders", [b"a-1"])
        publish(pair.active, "tenant-b", "other", [b"b-1", b"b-2", b"b-3"])
        passive = queues_by_vhost(pair.passive)
        assert passive[("/", "orders")] == 2
        assert passive[("tenant-a", "orders")] == 1
        assert passive[("tenant-b", "other")] == 3
        pair.active.kill()  # kill -9
        wait_for(
            "passive ready",
            lambda: (status(pair.passive) or {}).get("replication", {}).get("ready"),
            10,
        )
        pair.promote_passive()
        assert drain(pair.active, "tenant-b", "other") == [b"b-1", b"b-2", b"b-3"]
        assert drain(pair.active, "tenant-a", "orders") == [b"a-1"]
        assert drain(pair.active, "/", "orders") == [b"root-1", b"root-2"]


def test_a_retired_vhost_keeps_its_content_until_the_admin_deletes_it(tmp_path: Path) -> None:
    users = users_file(tmp_path / "users.json")
    broker = BrokerProcess(
        tmp_path / "data", name="vh-delete", extra_args=["--users-file", str(users)]
    )
    with broker.start():
        publish(broker, "tenant-b", "orders", [b"b-1", b"b-2"])
        publish(broker, "tenant-a", "orders", [b"a-1"])
        conn = connect(broker, "admin", "tenant-b")
        ch = conn.channel()
        ch.exchange_declare("b-events", "fanout", durable=True)
        with pytest.raises(AdminError) as caught:
            broker.admin.delete_vhost("tenant-b")
        assert caught.value.status == 409 and "is in the users file" in str(caught.value)
        users_file(users, ["/", "tenant-a"])
        wait_for("tenant-b refused", lambda: not _opens(broker, "tenant-b"), timeout=30)
        # Open before the retirement: not closed (its permissions went with the vhost).
        assert conn.is_open
        for name, status_code in (("/", 409), ("nowhere", 404)):
            with pytest.raises(AdminError) as caught:
                broker.admin.delete_vhost(name)
            assert caught.value.status == status_code
        done = broker.admin.delete_vhost("tenant-b")
        assert (done.queues, done.exchanges, done.messages, done.connections) == (1, 1, 2, 1)
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
            conn.process_data_events(time_limit=5)
        assert closed.value.reply_code == 320 and "is deleted" in closed.value.reply_text
        assert ("tenant-b", "orders") not in queues_by_vhost(broker)
    with broker.start():  # the deletion is durable
        assert ("tenant-b", "orders") not in queues_by_vhost(broker)
        assert queues_by_vhost(broker)[("tenant-a", "orders")] == 1
        users_file(users, VHOSTS)  # declared again: a new, empty vhost
        wait_for("tenant-b served again", lambda: _opens(broker, "tenant-b"), timeout=30)
        again = connect(broker, "admin", "tenant-b")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker):
            again.channel().exchange_declare("b-events", "fanout", passive=True)
        again.close()


def _served(broker: BrokerProcess, vhost: str) -> bool:
    data = status(broker)
    assert data is not None
    return any(v["name"] == vhost and v["served"] for v in data["vhosts"])


def _vhost_names(broker: BrokerProcess) -> list[str]:
    data = status(broker)
    assert data is not None
    return sorted(v["name"] for v in data["vhosts"])


def test_the_passive_drops_a_vhost_the_active_deleted_without_a_restart(tmp_path: Path) -> None:
    users = users_file(tmp_path / "users.json")
    with Pair(tmp_path / "pair", broker_args=["--users-file", str(users)]) as pair:
        publish(pair.active, "tenant-b", "orders", [b"b-1", b"b-2"])
        publish(pair.active, "tenant-a", "orders", [b"a-1"])
        conn = connect(pair.active, "admin", "tenant-b")
        conn.channel().exchange_declare("b-events", "fanout", durable=True)
        conn.close()
        wait_for(
            "tenant-b on the passive",
            lambda: ("tenant-b", "orders") in queues_by_vhost(pair.passive),
            10,
        )
        users_file(users, ["/", "tenant-a"])  # both brokers read this file
        wait_for("tenant-b retired", lambda: not _opens(pair.active, "tenant-b"), timeout=30)
        done = pair.active.admin.delete_vhost("tenant-b")
        assert (done.queues, done.exchanges, done.messages) == (1, 1, 2)
        assert "tenant-b" not in _vhost_names(pair.active)
        wait_for(
            "the passive's vhosts are the active's",
            lambda: _vhost_names(pair.passive) == _vhost_names(pair.active),
            10,
        )
        assert "tenant-b" not in _vhost_names(pair.passive)
        assert queues_by_vhost(pair.passive) == queues_by_vhost(pair.active)
        # Still in sync after it: a failover keeps the rest.
        publish(pair.active, "tenant-a", "orders", [b"a-2"])
        pair.active.kill()
        wait_for(
            "passive ready",
            lambda: (status(pair.passive) or {}).get("replication", {}).get("ready"),
            10,
        )
        pair.promote_passive()
        assert "tenant-b" not in _vhost_names(pair.active)
        assert drain(pair.active, "tenant-a", "orders") == [b"a-1", b"a-2"]


def test_a_passive_unlinked_during_a_vhost_deletion_drops_it_when_it_links_again(
    tmp_path: Path,
) -> None:
    """Unlinked, the passive misses the deletion's records; the topology it gets whole when
    it links again does not name the vhost, which its users file no longer declares."""
    users = users_file(tmp_path / "users.json")
    with Pair(tmp_path / "pair", broker_args=["--users-file", str(users)]) as pair:
        publish(pair.active, "tenant-b", "orders", [b"b-1"])
        publish(pair.active, "tenant-a", "orders", [b"a-1"])
        wait_for(
            "tenant-b on the passive",
            lambda: ("tenant-b", "orders") in queues_by_vhost(pair.passive),
            10,
        )
        users_file(users, ["/", "tenant-a"])
        wait_for("tenant-b retired", lambda: not _opens(pair.active, "tenant-b"), timeout=30)
        # The passive reads the file on its own: it must have retired tenant-b too.
        wait_for(
            "tenant-b retired on the passive", lambda: not _served(pair.passive, "tenant-b"), 30
        )
        pair.link.cut()  # every connection reset, new ones too
        wait_for(
            "the link is down",
            lambda: not (status(pair.passive) or {}).get("replication", {}).get("link_connected"),
            30,
        )
        pair.active.admin.delete_vhost("tenant-b")
        assert "tenant-b" in _vhost_names(pair.passive)
        pair.link.heal()
        pair.wait_healthy(30)
        wait_for(
            "the passive's vhosts are the active's",
            lambda: _vhost_names(pair.passive) == _vhost_names(pair.active),
            10,
        )
        assert queues_by_vhost(pair.passive) == queues_by_vhost(pair.active)


def test_a_passive_catches_up_on_every_vhost_and_a_failover_keeps_them(tmp_path: Path) -> None:
    """The catch-up (not the live stream) carries other vhosts' topology and messages."""
    users = users_file(tmp_path / "users.json")
    with Pair(tmp_path / "pair", broker_args=["--users-file", str(users)]) as pair:
        publish(pair.active, "tenant-a", "orders", [b"a-before"])
        passive = pair.passive
        passive.kill()
        publish(pair.active, "tenant-a", "orders", [b"a-during"])
        publish(pair.active, "tenant-b", "orders", [b"b-during"])
        publish(pair.active, "/", "orders", [b"root-during"])
        passive.start()
        pair.wait_healthy(10)
        counts = queues_by_vhost(passive)
        assert counts[("tenant-a", "orders")] == 2
        assert counts[("tenant-b", "orders")] == 1
        assert counts[("/", "orders")] == 1
        pair.active.kill()
        pair.promote_passive()
        assert drain(pair.active, "tenant-a", "orders") == [b"a-before", b"a-during"]
        assert drain(pair.active, "tenant-b", "orders") == [b"b-during"]
        assert drain(pair.active, "/", "orders") == [b"root-during"]


def test_a_delta_without_a_vhost_is_of_slash_and_names_are_unique_per_vhost() -> None:
    """The definitions log's records written before vhosts (no `vhost`) apply to `/`; the
    same names in two vhosts are two objects; `/` is stored as before (no field)."""
    old = DefinitionsDelta.model_validate_json(
        '{"add_queues":[{"name":"q","qid":1}],"add_exchanges":[{"name":"x","type":"fanout"}],'
        '"add_bindings":[{"exchange":"x","queue":"q","routing_key":""}],"next_qid":2}'
    )
    assert old.vhost == "/" and old.add_queues[0].vhost == "/"
    state = TopologyState()
    state.apply(old)
    state.apply(
        DefinitionsDelta(
            vhost="t",
            add_queues=[QueueDef(name="q", qid=2, vhost="t")],
            add_exchanges=[ExchangeDef(name="x", type="fanout", vhost="t")],
            add_bindings=[BindingDef(exchange="x", queue="q", routing_key="", vhost="t")],
            next_qid=3,
        )
    )
    defs = state.definitions()
    assert sorted((q.vhost, q.qid) for q in defs.queues) == [("/", 1), ("t", 2)]
    assert len(defs.bindings) == 2
    assert state.apply(DefinitionsDelta(vhost="t", del_queues=["q"])) == [2]  # t's only
    assert [b.vhost for b in state.definitions().bindings] == ["/"]
    assert '"vhost"' not in old.model_dump_json()
    assert '"vhost":"t"' in QueueDef(name="q", qid=2, vhost="t").model_dump_json()


def test_a_vhost_deletion_record_drops_only_that_vhost_and_older_records_lack_it() -> None:
    """`drop_vhost` (the last record of `DELETE /vhosts/{name}`) takes what is left of the
    vhost out of the topology, never another's; records without it are stored as before."""
    state = TopologyState()
    for vhost, qid in (("/", 1), ("t", 2)):
        state.apply(
            DefinitionsDelta(
                vhost=vhost,
                add_queues=[QueueDef(name="q", qid=qid, vhost=vhost)],
                add_exchanges=[ExchangeDef(name="x", type="fanout", vhost=vhost)],
                add_bindings=[BindingDef(exchange="x", queue="q", routing_key="", vhost=vhost)],
            )
        )
    dropped = DefinitionsDelta(vhost="t", drop_vhost=True)
    assert dropped  # not an empty delta: it is recorded and sent
    assert state.apply(dropped) == [2]
    defs = state.definitions()
    assert {(o.vhost, o.name) for o in [*defs.queues, *defs.exchanges]} == {("/", "q"), ("/", "x")}
    assert [b.vhost for b in defs.bindings] == ["/"]
    assert "drop_vhost" not in DefinitionsDelta(del_queues=["q"]).model_dump_json()
    assert DefinitionsDelta.model_validate_json(dropped.model_dump_json()) == dropped


def test_deleting_a_vhost_on_a_full_disk_answers_507_and_loses_nothing_recorded(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "disk", "16m") as disk:
        users = users_file(tmp_path / "users.json")
        args = ["--users-file", str(users), "--disk-free-limit", "0"]
        broker = BrokerProcess(
            disk / "data", name="vh-full", extra_args=args, log_path=tmp_path / "vh-full.log"
        )
        with broker.start():
            publish(broker, "tenant-b", "orders", [b"b-1", b"b-2"])
            users_file(users, ["/", "tenant-a"])
            wait_for("tenant-b retired", lambda: not _opens(broker, "tenant-b"), timeout=30)
            admin_url = f"amqp://admin:admin-pw@127.0.0.1:{broker.port}/%2F"
            end_log_at_a_page(admin_url, disk / "data" / "journal")  # the delete needs a page
            filler = DiskFiller(disk)
            try:
                with pytest.raises(AdminError) as caught:
                    broker.admin.delete_vhost("tenant-b")
            finally:
                filler.release()
            assert caught.value.status == 507 and "delete it again" in str(caught.value)
            assert broker.proc is not None and broker.proc.poll() is None  # still serving
        with broker.start():  # nothing recorded was lost: the vhost's queue is whole
            assert queues_by_vhost(broker)[("tenant-b", "orders")] == 2
            done = broker.admin.delete_vhost("tenant-b")
            assert (done.queues, done.messages) == (1, 2)
