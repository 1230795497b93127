"""The DR mirror carries every virtual host (docs/mirror.md, "Virtual hosts").

Two real sites (`mirrorsites.Sites`), each with a users file declaring vhosts, and pika
clients in them: the live changes of every vhost (messages, acks, TTL, dead-lettering,
purges, queue and vhost deletions) reach the replica, each message once; a switchover
loses nothing of any vhost and its clients go on on the new source; a mirror enabled on
a broker that already holds messages in another vhost gets them (the seed's snapshot);
a forced failover's old source, back, counts and keeps (orphans) what it alone had in
every vhost.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pika
from mirrorsites import Sites, demote, mirror_status
from test_vhosts import _opens, connect, publish, users_file

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import status
from twinmq.testing.waiting import wait_for

VHOSTS = ["/", "v1", "v2"]
GRANTS = [{"user": "admin", "vhost": v, "configure": ".*", "write": ".*", "read": ".*"}
          for v in VHOSTS]  # fmt: skip
ORPHANS = "amq.twinmq.mirror-orphans"
PERSISTENT = pika.BasicProperties(delivery_mode=2)


def bodies(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def users(path: Path, vhosts: list[str] = VHOSTS) -> str:
    """A users file declaring `vhosts` (the user `admin` may do anything in each)."""
    return str(users_file(path, vhosts, GRANTS))


def consume(
    broker: BrokerProcess, vhost: str, queue: str, n: int, *, on_disk: bool = False
) -> list[bytes]:
    """Take and ack `n` messages of `queue` in `vhost`. With `on_disk`, the acks are one
    transaction, returned only once its tx.commit-ok says they are on disk: a basic.ack
    has no reply, and the connection's close-ok does not wait for the group commit that
    journals it, so a `kill -9` right after can find it not yet written (the message is
    there again on restart and its settle was never made)."""
    conn = connect(broker, "admin", vhost)
    ch = conn.channel()
    if on_disk:
        ch.tx_select()
    got: list[bytes] = []
    for _ in range(n):
        method, _, body = ch.basic_get(queue)
        assert method is not None, f"{queue} in {vhost} on {broker.name}: empty"
        ch.basic_ack(method.delivery_tag)
        got.append(body)
    if on_disk:
        ch.tx_commit()
    conn.close()
    return got


def browse(broker: BrokerProcess, vhost: str, queue: str) -> list[tuple[bytes, dict[str, Any]]]:
    """Every message of `queue` in `vhost` with its headers, left in place (taken without
    an ack, then the connection closed: requeued, nothing settled, nothing mirrored)."""
    conn = connect(broker, "admin", vhost)
    ch = conn.channel()
    out: list[tuple[bytes, dict[str, Any]]] = []
    while (item := ch.basic_get(queue, auto_ack=False))[0] is not None:
        _, props, body = item
        out.append((body, dict(props.headers or {})))
    conn.close()
    return out


def held(broker: BrokerProcess, vhost: str, queue: str) -> list[bytes]:
    """The bodies `browse` finds."""
    return [body for body, _ in browse(broker, vhost, queue)]


def client_queues(broker: BrokerProcess) -> dict[tuple[str, str], int]:
    """(vhost, queue) -> messages, as `/status` lists them (the mirror's own left out)."""
    data = status(broker)
    assert data is not None, f"{broker.name} does not answer"
    return {(q["vhost"], q["name"]): q["messages"] + q["unacked"]
            for q in data["queues"] if not q["name"].startswith("amq.twinmq.")}  # fmt: skip


def vhosts(broker: BrokerProcess) -> dict[str, dict[str, Any]]:
    """The vhosts `/status` lists, by name."""
    data = status(broker)
    assert data is not None
    return {v["name"]: v for v in data["vhosts"]}


def test_every_vhost_reaches_the_replica_each_message_once_with_its_deletes(
    tmp_path: Path,
) -> None:
    # The replica's users file does not declare v2: the mirror makes it all the same.
    source_users = users(tmp_path / "users-a.json")
    with Sites(
        tmp_path,
        source_args=["--users-file", source_users],
        mirror_args=["--users-file", users(tmp_path / "users-b.json", ["/", "v1"])],
    ) as sites:
        source, mirror = sites.source, sites.mirror
        publish(source, "/", "orders", bodies("root", 4))
        publish(source, "v1", "orders", bodies("v1", 6))  # another queue of the same name
        publish(source, "v1", "gone", bodies("gone", 2))
        publish(source, "v1", "purged", bodies("purged", 3))
        publish(source, "v2", "jobs", bodies("v2", 3))
        assert consume(source, "v1", "orders", 2) == bodies("v1", 2)
        assert consume(source, "/", "orders", 1) == bodies("root", 1)
        conn = connect(source, "admin", "v1")
        ch = conn.channel()
        ch.queue_declare("dead", durable=True)
        ttl = {
            "x-message-ttl": 20,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "dead",
        }
        ch.queue_declare("short", durable=True, arguments=ttl)
        ch.confirm_delivery()
        for body in bodies("ttl", 2):
            ch.basic_publish("", "short", body, PERSISTENT)
        ch.queue_purge("purged")
        ch.queue_delete("gone")
        conn.close()
        wait_for("v1's expired messages dead-lettered",
                 lambda: client_queues(source).get(("v1", "dead")) == 2)  # fmt: skip
        sites.caught_up()
        expected = {("/", "orders"): 3, ("v1", "orders"): 4, ("v1", "purged"): 0,
                    ("v1", "short"): 0, ("v1", "dead"): 2, ("v2", "jobs"): 3}  # fmt: skip
        assert client_queues(source) == expected
        assert client_queues(mirror) == expected
        # Exactly the rest of each vhost, each once, in order.
        assert held(mirror, "/", "orders") == bodies("root", 4)[1:]
        assert held(mirror, "v1", "orders") == bodies("v1", 6)[2:]
        assert held(mirror, "v1", "dead") == bodies("ttl", 2)
        assert not vhosts(mirror)["v2"]["served"]  # made by the mirror, not by its file
        assert all(v["mirrored"] for v in vhosts(source).values())
        samples = source.admin.metrics().splitlines()
        assert 'twinmq_vhost_mirrored{vhost="v1"} 1.0' in samples

        # v2 retired at the source and deleted: the replica, which does not serve it,
        # drops it too.
        users_file(Path(source_users), ["/", "v1"], GRANTS)
        wait_for("v2 retired at the source", lambda: not _opens(source, "v2"), timeout=30)
        deleted = source.admin.delete_vhost("v2")
        assert (deleted.queues, deleted.messages) == (1, 3)
        publish(source, "v1", "orders", [b"after"])  # an event after the deletion's
        sites.caught_up()
        assert "v2" not in vhosts(mirror)
        assert client_queues(mirror) == {**{k: n for k, n in expected.items() if k[0] != "v2"},
                                         ("v1", "orders"): 5}  # fmt: skip


def test_a_switchover_keeps_every_vhost_and_its_clients_go_on_at_the_new_source(
    tmp_path: Path,
) -> None:
    file = ["--users-file", users(tmp_path / "users.json")]
    with Sites(tmp_path, reversible=True, source_args=file, mirror_args=file) as sites:
        sites.mirror.stop()  # a backlog for the demotion to drain
        publish(sites.source, "v1", "orders", bodies("v1", 200))
        publish(sites.source, "/", "orders", bodies("root", 20))
        consume(sites.source, "v1", "orders", 50)
        sites.mirror.start()
        demoted = demote(sites.source)
        assert demoted.token is not None
        assert sites.promote_mirror(demoted.token).role == "source"
        # v1's clients on the new source: the 150 left, then their own, mirrored back.
        publish(sites.mirror, "v1", "orders", [b"on-b"])
        assert consume(sites.mirror, "v1", "orders", 100) == bodies("v1", 200)[50:150]
        sites.caught_up(source=sites.mirror)
        rest = [*bodies("v1", 200)[150:], b"on-b"]
        assert held(sites.mirror, "v1", "orders") == rest
        assert held(sites.source, "v1", "orders") == rest  # A, now B's mirror
        assert held(sites.mirror, "/", "orders") == bodies("root", 20)
        log = sites.mirror.log_path
        assert log is not None and "mirror: seed (" not in log.read_text()  # no re-seed


def test_enabling_the_mirror_on_a_broker_with_messages_in_another_vhost_mirrors_them(
    tmp_path: Path,
) -> None:
    file = ["--users-file", users(tmp_path / "users.json")]
    before = BrokerProcess(tmp_path / "a" / "data", name="site-a-before-dr", extra_args=file)
    with before.start():
        publish(before, "v1", "orders", bodies("old", 300))
        publish(before, "/", "orders", bodies("root", 5))
        consume(before, "v1", "orders", 100)
    with Sites(tmp_path, source_args=file, mirror_args=file) as sites:  # the same data dir
        consume(sites.source, "v1", "orders", 50)  # acks of the snapshot's messages
        publish(sites.source, "v1", "orders", [b"new"])
        sites.caught_up()
        assert held(sites.mirror, "v1", "orders") == [*bodies("old", 300)[150:], b"new"]
        assert held(sites.mirror, "/", "orders") == bodies("root", 5)


def test_a_forced_failover_counts_and_keeps_what_the_old_source_alone_had_in_a_vhost(
    tmp_path: Path,
) -> None:
    file = ["--users-file", users(tmp_path / "users.json")]
    with Sites(tmp_path, reversible=True, source_args=file, mirror_args=file) as sites:
        publish(sites.source, "v1", "orders", bodies("v1", 10))
        publish(sites.source, "/", "orders", bodies("root", 3))
        sites.caught_up()
        sites.mirror.stop()  # a partition: B never sees what follows
        publish(sites.source, "v1", "orders", bodies("lost", 5))
        # v1-0, settled on A alone: on disk before A is killed, or there is no settle to count.
        consume(sites.source, "v1", "orders", 1, on_disk=True)
        sites.fail_over_by_force()
        assert consume(sites.mirror, "v1", "orders", 3) == bodies("v1", 3)  # B's clients
        sites.old_source_back()
        lost = sites.loss_counted()
        assert (lost["messages"], lost["settles"]) == (5, 1)
        on_b = bodies("v1", 10)[3:]
        assert held(sites.mirror, "v1", "orders") == on_b
        assert held(sites.source, "v1", "orders") == on_b  # A is B's copy: nothing erased
        orphans = browse(sites.source, "/", ORPHANS)
        assert sorted(body for body, _ in orphans) == sorted(bodies("lost", 5))
        assert {(h["x-mirror-orphan-vhost"], h["x-mirror-orphan-queue"]) for _, h in orphans} == {
            ("v1", "orders")
        }
        assert held(sites.mirror, "/", "orders") == bodies("root", 3)
        assert mirror_status(sites.source)["orphans"] == 5
