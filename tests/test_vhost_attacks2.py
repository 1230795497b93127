"""Attacks on the DR mirror and on federation across virtual hosts (docs/mirror.md and
docs/federation.md, "Virtual hosts").

Both are new code over id spaces shared by a broker's vhosts (queue ids and message ids
are the broker's, not a vhost's). Each test tries to lose, duplicate or leak a confirmed
message through one path, with real brokers and pika. What held:

- a vhost deleted at the source and made again with the same queue name (other
  arguments) while the mirror is away, on a replica that serves it and on one that does
  not, and with the replica `kill -9`ed while it applies that backlog: the replica holds
  the new queue's messages only, each once, none orphaned;
- a switchover right after a vhost's deletion, its events still queued: nothing of the
  deleted vhost comes back on either site, the rest of every vhost is there;
- a forced failover after which the promoted site deletes the vhost holding the old
  source's unmirrored messages: the old source, back, counts and orphans its 5, and not
  the 10 the promoted site deleted on purpose;
- both sites declaring a queue in another vhost during a partition (the same qid, the
  broker's counter): the old source's 5 orphaned, the promoted site's queue intact;
- a `t1` federation link cut under confirmed load while its user's permission on the
  upstream's `t1` is revoked: refused, retried, nothing lost or doubled once granted;
- a `t1` publisher upstream stamping `t2`'s scoped origin (`["t2", "central"]`).

- one queue name with other arguments (a length limit; a TTL dead-lettering into `dead`,
  a name `/` has too) in two vhosts, across a replica restart and a switchover;
- a forced failover to a site whose users file does not declare a vhost: kept there,
  served once declared, the old source's own loss in it orphaned.

What broke, fixed since (both found here): the upstream kept an origin header its clients
set, and the downstream's dedup key space is the local vhost's, so a publisher of
upstream vhost `t2` (or of another exchange of the same vhost) who stamped the upstream's
own origin with the message ids coming next made the downstream drop the other tenant's
confirmed messages as duplicates (a broker now strips federation headers from clients'
publishes).

And a downstream vhost deleted and made again (`DELETE /vhosts/t1`, then served again)
was never federated into until a restart: the link kept the dropped vhost object (it
follows the new one now).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pika
import pytest
from mirrorsites import Sites, demote, mirror_status
from test_federation_vhosts import (
    bind,
    broker,
    drain,
    federation_file,
    links,
    settled,
    wait_running,
)
from test_federation_vhosts import connect as fed_connect
from test_federation_vhosts import publish as fed_publish
from test_mirror_vhosts import GRANTS, ORPHANS, bodies, browse, client_queues, consume, held
from test_mirror_vhosts import vhosts as vhost_status
from test_vhosts import _opens, connect, publish, users_file

from twinmq.broker.federation.agent import queue_name
from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import status
from twinmq.testing.waiting import wait_for

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def serve(path: Path, names: list[str]) -> None:
    """Rewrite the users file at `path` to declare `names` (`admin` may do anything)."""
    users_file(path, names, GRANTS)


def vhost_sites(
    tmp_path: Path, source_vhosts: list[str], mirror_vhosts: list[str], *, reversible: bool = False
) -> tuple[Sites, Path, Path]:
    """Two DR sites whose users files declare `source_vhosts` and `mirror_vhosts`: the
    sites (to enter) and the two files (a test rewrites them)."""
    source_users, mirror_users = tmp_path / "users-a.json", tmp_path / "users-b.json"
    serve(source_users, source_vhosts)
    serve(mirror_users, mirror_vhosts)
    sites = Sites(
        tmp_path,
        reversible=reversible,
        source_args=["--users-file", str(source_users)],
        mirror_args=["--users-file", str(mirror_users)],
    )
    return sites, source_users, mirror_users


def orphaned(broker: BrokerProcess) -> int:
    """Messages in the broker's orphan queue (0 when it was never made)."""
    data = status(broker)
    assert data is not None, f"{broker.name} does not answer"
    return sum(q["messages"] + q["unacked"] for q in data["queues"] if q["name"] == ORPHANS)


def wait_bound(remote: BrokerProcess, vhost: str, exchange: str) -> None:
    """Wait until the link of `exchange` in `vhost` holds its one binding upstream."""
    wait_for(
        f"{vhost}/{exchange}'s binding upstream",
        lambda: links(remote)[(vhost, exchange)]["bindings"] == 1,
    )


def delete_vhost(broker: BrokerProcess, users: Path, keep: list[str], name: str) -> None:
    """Retire `name` from the broker's users file (`keep` stays), then delete it."""
    serve(users, keep)
    wait_for(f"{name} retired on {broker.name}", lambda: not _opens(broker, name), timeout=30)
    broker.admin.delete_vhost(name)


def declare_and_publish(
    broker: BrokerProcess, vhost: str, queue: str, args: dict[str, object], sent: list[bytes]
) -> None:
    """Declare `queue` durable with `args` and publish `sent` persistent, confirmed."""
    conn = connect(broker, "admin", vhost)
    ch = conn.channel()
    ch.queue_declare(queue, durable=True, arguments=args)
    ch.confirm_delivery()
    for body in sent:
        ch.basic_publish("", queue, body, PERSISTENT)
    conn.close()


@pytest.mark.parametrize("replica_serves", [True, False], ids=["served", "not-served"])
def test_a_vhost_deleted_and_made_again_while_the_mirror_is_away_holds_only_the_new_queue(
    tmp_path: Path, replica_serves: bool
) -> None:
    rig, source_users, mirror_users = vhost_sites(
        tmp_path, ["/", "v1"], ["/", "v1"] if replica_serves else ["/"]
    )
    with rig as sites:
        source, mirror = sites.source, sites.mirror
        publish(source, "/", "orders", bodies("root", 3))
        publish(source, "v1", "orders", bodies("first", 5))
        sites.caught_up()
        assert client_queues(mirror)[("v1", "orders")] == 5
        mirror.stop()  # the deletion and the new vhost queued behind each other
        publish(source, "v1", "orders", bodies("old", 4))  # never seen by the mirror
        consume(source, "v1", "orders", 2)
        delete_vhost(source, source_users, ["/"], "v1")
        serve(source_users, ["/", "v1"])
        wait_for("v1 served again", lambda: _opens(source, "v1"), timeout=30)
        # The same name, another queue (another qid), other arguments.
        declare_and_publish(source, "v1", "orders", {"x-max-length": 3}, bodies("new", 5))
        mirror.start()
        sites.caught_up()
        expected = {("/", "orders"): 3, ("v1", "orders"): 3}
        assert client_queues(source) == expected
        assert client_queues(mirror) == expected
        assert orphaned(mirror) == 0  # nothing of the old queue kept as new
        assert vhost_status(mirror)["v1"]["served"] is replica_serves
        if not replica_serves:  # the operator serves v1 on B (before a failover): its copy
            serve(mirror_users, ["/", "v1"])
            wait_for("v1 served on B", lambda: _opens(mirror, "v1"), timeout=30)
        assert held(mirror, "v1", "orders") == bodies("new", 5)[2:]
        assert held(mirror, "/", "orders") == bodies("root", 3)
        # The replica's v1 queue is the new one: its limit applies after a restart too.
        mirror.stop()
        mirror.start()
        declare_and_publish(source, "v1", "orders", {"x-max-length": 3}, [b"after"])
        sites.caught_up()
        assert held(mirror, "v1", "orders") == [*bodies("new", 5)[3:], b"after"]


def test_a_switchover_right_after_a_vhost_deletion_brings_nothing_of_it_back(
    tmp_path: Path,
) -> None:
    rig, source_users, _mirror_users = vhost_sites(
        tmp_path, ["/", "v1", "v2"], ["/", "v1"], reversible=True
    )  # v2: made by the mirror only
    with rig as sites:
        source, mirror = sites.source, sites.mirror
        publish(source, "v1", "orders", bodies("v1", 30))
        publish(source, "v2", "orders", bodies("v2", 30))  # another queue, the same name
        publish(source, "/", "orders", bodies("root", 10))
        sites.caught_up()
        mirror.stop()  # a backlog: more of v2, its deletion, more of v1
        publish(source, "v2", "orders", bodies("v2-late", 20))
        delete_vhost(source, source_users, ["/", "v1"], "v2")
        publish(source, "v1", "orders", bodies("v1-late", 20))
        consume(source, "v1", "orders", 5)
        mirror.start()
        demoted = demote(source)  # drains the backlog, deletion included
        assert demoted.token is not None
        assert sites.promote_mirror(demoted.token).role == "source"
        assert "v2" not in vhost_status(mirror)
        on_b = {("/", "orders"): 10, ("v1", "orders"): 45}
        assert client_queues(mirror) == on_b
        assert held(mirror, "v1", "orders") == [*bodies("v1", 30)[5:], *bodies("v1-late", 20)]
        # A, now B's mirror, ends the same; nothing of v2 on either site, nor orphaned.
        sites.caught_up(source=mirror)
        assert client_queues(source) == on_b
        assert orphaned(source) == 0
        assert orphaned(mirror) == 0


def test_a_forced_failover_whose_promoted_site_deletes_the_vhost_keeps_the_old_sources_loss(
    tmp_path: Path,
) -> None:
    rig, _a_users, b_users = vhost_sites(tmp_path, ["/", "v1"], ["/", "v1"], reversible=True)
    with rig as sites:
        publish(sites.source, "v1", "orders", bodies("v1", 10))
        publish(sites.source, "/", "orders", bodies("root", 3))
        sites.caught_up()
        sites.mirror.stop()  # a partition: B never sees what follows
        publish(sites.source, "v1", "orders", bodies("lost", 5))
        sites.fail_over_by_force()
        # B's operator retires v1 and deletes it, with the 10 messages B had of it.
        delete_vhost(sites.mirror, b_users, ["/"], "v1")
        sites.old_source_back()
        lost = sites.loss_counted()
        assert lost["messages"] == 5
        orphans = browse(sites.source, "/", ORPHANS)
        # The 5 A alone had are kept, each once; what B deleted on purpose is not
        # brought back (as messages B's clients consumed are not).
        assert sorted(body for body, _ in orphans) == sorted(bodies("lost", 5))
        assert {h.get("x-mirror-orphan-vhost") for _, h in orphans} == {"v1"}
        assert ("v1", "orders") not in client_queues(sites.source)
        assert held(sites.mirror, "/", "orders") == bodies("root", 3)
        assert held(sites.source, "/", "orders") == bodies("root", 3)
        assert (mirror_status(sites.source) or {}).get("orphans") == 5


# (victim link, attacker link, the origin the attacker stamps given the upstream's id)
FORGERIES = {
    # `remote`'s `t1` federates `orders` from central's `t1` and `prices` from central's
    # `t2`: both links' keys are in `t1`'s key space, and central's message ids are the
    # broker's, so a client of `t2` stamping central's id with the ids coming next would
    # claim the keys of `t1`'s next messages.
    "an-upstream-tenant": ("t1", "orders", "t1", "t1", "prices", "t2", False),
    # The same within one vhost: `t1`'s `prices` and `orders` both from central's `t1`.
    "another-exchange": ("t1", "orders", "t1", "t1", "prices", "t1", False),
    # `t1` and `t2` federate their `orders` from central's `t1` and `t2`: a client of
    # central's `t1` stamps `["t2", "central"]`, the form `t2`'s keys take in the window
    # (`dedup.scoped`), with `t2`'s coming ids.
    "a-scoped-spelling": ("t2", "orders", "t2", "t1", "orders", "t1", True),
}


@pytest.mark.parametrize("forgery", FORGERIES.values(), ids=FORGERIES.keys())
def test_a_client_stamping_federation_origins_cannot_suppress_another_publishers_messages(
    tmp_path: Path, forgery: tuple[str, str, str, str, str, str, bool]
) -> None:
    """A client publishing upstream with `x-twinmq-origin`/`-seq` set (another publisher's
    coming dedup keys) gets nothing of that publisher's dropped downstream: all 20 of its
    confirmed messages arrive, none counted as a duplicate."""
    vv, vx, vu, av, ax, au, scoped = forgery
    attack = ForgedOrigins(
        victim=Link(vv, vx, vu), attacker=Link(av, ax, au),
        forge=(lambda origin: json.dumps([vv, origin])) if scoped else (lambda origin: origin),
    )  # fmt: skip
    assert attack.run(tmp_path) == (bodies(vv, 20), 0)


@dataclass(frozen=True)
class Link:
    """A federated exchange of `remote`: its local vhost, its name, its upstream vhost."""

    vhost: str
    exchange: str
    upstream_vhost: str

    def entry(self) -> dict[str, str]:
        """Its entry in the federation file (upstream `central`)."""
        return {"exchange": self.exchange, "vhost": self.vhost, "upstream": "central",
                "type": "direct", "upstream-vhost": self.upstream_vhost}  # fmt: skip

    @property
    def queue(self) -> str:
        """The local queue bound to it (key `k`)."""
        return f"{self.vhost}-{self.exchange}"


@dataclass(frozen=True)
class ForgedOrigins:
    """A client of central's `attacker.upstream_vhost` publishes 400 messages whose origin
    header is `forge(the upstream's origin)` and whose seqs are the ids central gives next
    (after those its own 400 take); then 20 genuine messages are published in the victim's
    upstream vhost."""

    victim: Link
    attacker: Link
    forge: Callable[[str], str]

    def run(self, tmp: Path) -> tuple[list[bytes], int]:
        """What of the 20 genuine messages reached the victim's queue downstream, and the
        victim link's count of duplicates dropped."""
        central = broker(tmp, "central")
        with central.start():
            config = federation_file(
                tmp / "remote-federation.json",
                {"central": f"guest@127.0.0.1:{central.port}/"},
                [self.victim.entry(), self.attacker.entry()],
            )
            remote = broker(tmp, "remote", config)
            with remote.start():
                return self._attack(central, remote)

    def _attack(self, central: BrokerProcess, remote: BrokerProcess) -> tuple[list[bytes], int]:
        victim, attacker = self.victim, self.attacker
        for link in (victim, attacker):
            wait_running(remote, link.vhost, link.exchange)
            bind(remote, link.vhost, link.queue, link.exchange, "k")
            wait_bound(remote, link.vhost, link.exchange)
        # A probe tells the attacker the upstream's origin and its current message id.
        fed_publish(central, victim.upstream_vhost, victim.exchange, "k", [b"probe"])
        conn = fed_connect(remote, victim.vhost)
        ch = conn.channel()
        found: list[dict[str, object]] = []

        def probed() -> bool:
            method, props, _body = ch.basic_get(victim.queue, auto_ack=True)
            if method is not None:
                found.append(dict(props.headers or {}))
            return bool(found)

        wait_for("the probe federated", probed)
        conn.close()
        origin, seq = found[0]["x-twinmq-origin"], found[0]["x-twinmq-origin-seq"]
        assert origin == "central" and isinstance(seq, int)
        conn = fed_connect(central, attacker.upstream_vhost)
        ch = conn.channel()
        ch.confirm_delivery()
        for i in range(1, 401):
            forged = {"x-twinmq-origin": self.forge(origin), "x-twinmq-origin-seq": seq + 400 + i}
            ch.basic_publish(attacker.exchange, "k", f"forged-{i}".encode(),
                             pika.BasicProperties(delivery_mode=2, headers=forged))  # fmt: skip
        conn.close()
        # The forged messages are the attacker's own: they reach its queue, all of them.
        assert len(drain(remote, attacker.vhost, attacker.queue, 400)) == 400
        genuine = bodies(victim.vhost, 20)
        fed_publish(central, victim.upstream_vhost, victim.exchange, "k", genuine)
        # The victim's link took and settled all of them upstream (republished or dropped).
        link_queue = queue_name(victim.exchange, "remote")
        wait_for(
            "the victim's link queue settled",
            lambda: settled(central, victim.upstream_vhost, link_queue),
        )
        dropped = links(remote)[(victim.vhost, victim.exchange)]["duplicates_dropped"]
        return drain(remote, victim.vhost, victim.queue), dropped


def test_queues_both_sites_declared_in_other_vhosts_during_a_partition_lose_nothing(
    tmp_path: Path,
) -> None:
    """During a partition each site declares a new queue in its own vhost: queue ids are a
    broker's counter, so both new queues may get the same qid (A's `v1/a-only`, B's
    `v2/b-only`). A, back, must keep its 5 confirmed messages (orphans), not take B's
    queue of that qid for its own."""
    users = tmp_path / "users.json"
    serve(users, ["/", "v1", "v2"])
    file = ["--users-file", str(users)]
    with Sites(tmp_path, reversible=True, source_args=file, mirror_args=file) as sites:
        publish(sites.source, "/", "orders", bodies("root", 3))
        sites.caught_up()
        sites.mirror.stop()  # a partition
        publish(sites.source, "v1", "a-only", bodies("a", 5))
        sites.fail_over_by_force()
        publish(sites.mirror, "v2", "b-only", bodies("b", 4))
        sites.old_source_back()
        lost = sites.loss_counted()
        assert lost["messages"] == 5
        orphans = browse(sites.source, "/", ORPHANS)
        assert sorted(body for body, _ in orphans) == sorted(bodies("a", 5))
        assert {
            (h.get("x-mirror-orphan-vhost"), h["x-mirror-orphan-queue"]) for _, h in orphans
        } == {("v1", "a-only")}
        on_b = {("/", "orders"): 3, ("v2", "b-only"): 4}
        assert client_queues(sites.mirror) == on_b
        assert client_queues(sites.source) == on_b
        assert held(sites.source, "v2", "b-only") == bodies("b", 4)


def test_a_t1_link_cut_under_confirmed_load_while_its_permissions_are_revoked_loses_nothing(
    tmp_path: Path,
) -> None:
    """`remote`'s `t1` exchange federates central's `t1` as `limited` (who may use `t1`
    only) through a proxy. Under a publisher confirming one by one in central's `t1`, the
    link is cut while `limited`'s permission there is revoked: the link is refused at
    `connection.open` (its status says so) and retries; the permission back, every
    confirmed message reaches `t1` downstream once, in order, and nothing reaches `/`."""
    central = broker(tmp_path, "central")
    central_users = tmp_path / "central.json"  # what `broker` wrote: its users file
    with central.start():
        proxy = FaultProxy(f"127.0.0.1:{central.port}").start()
        try:
            config = federation_file(
                tmp_path / "remote-federation.json",
                {"limited": f"limited@{proxy.address}/t1", "central": f"guest@{proxy.address}/"},
                [
                    {"exchange": "orders", "vhost": "t1", "upstream": "limited", "type": "direct"},
                    # `/`'s exchange of the same name, from central's `/`, over the same proxy.
                    {"exchange": "orders", "upstream": "central", "type": "direct"},
                ],
            )
            remote = broker(tmp_path, "remote", config)
            with remote.start():
                _revoked_under_load(central, remote, proxy, central_users)
        finally:
            proxy.close()


def _limited_opens(central: BrokerProcess) -> bool:
    """Whether `limited` may open central's `t1` (a new connection)."""
    try:
        pika.BlockingConnection(
            pika.ConnectionParameters(
                host="127.0.0.1", port=central.port, virtual_host="t1",
                credentials=pika.PlainCredentials("limited", "guest"), connection_attempts=1,
            )
        ).close()  # fmt: skip
    except pika.exceptions.ProbableAccessDeniedError:
        return False
    return True


def _revoked_under_load(
    central: BrokerProcess, remote: BrokerProcess, proxy: FaultProxy, users: Path
) -> None:
    granted = json.loads(users.read_text())
    revoked = {
        **granted,
        "permissions": [p for p in granted["permissions"] if p["user"] != "limited"],
    }
    wait_running(remote, "t1", "orders")
    wait_running(remote, "/", "orders")
    bind(remote, "t1", "t1-orders", "orders", "k")
    bind(remote, "/", "root-orders", "orders", "k")
    for vhost in ("t1", "/"):
        wait_bound(remote, vhost, "orders")
    confirmed: list[bytes] = []
    failure: list[BaseException] = []
    stop = threading.Event()

    def publisher() -> None:
        """Publish one by one, each confirmed, until told to stop."""
        try:
            conn = fed_connect(central, "t1")
            ch = conn.channel()
            ch.confirm_delivery()
            while not stop.is_set():
                body = f"m-{len(confirmed)}".encode()
                ch.basic_publish("orders", "k", body, PERSISTENT)
                confirmed.append(body)
            conn.close()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=publisher)
    thread.start()
    try:
        wait_for("100 confirmed", lambda: len(confirmed) >= 100)
        users.write_text(json.dumps(revoked))
        wait_for("the revocation read", lambda: not _limited_opens(central), timeout=30)
        proxy.cut()
        proxy.heal()  # the link comes back to a vhost it may no longer open
        wait_for(
            "the link refused at connection.open",
            lambda: "refused" in str(links(remote)[("t1", "orders")]["error"] or ""),
            timeout=30,
        )
        during = len(confirmed)
        users.write_text(json.dumps(granted))
        wait_running(remote, "t1", "orders")
        wait_for("100 more confirmed", lambda: len(confirmed) >= during + 100)
    finally:
        stop.set()
        thread.join()
    assert not failure, failure
    got = drain(remote, "t1", "t1-orders", len(confirmed))
    assert got == confirmed
    assert links(remote)[("/", "orders")]["state"] == "running"
    assert drain(remote, "/", "root-orders") == []  # nothing crossed into `/`


def test_a_replica_killed_while_it_applies_a_vhosts_deletion_and_new_queue_ends_the_same(
    tmp_path: Path,
) -> None:
    """A backlog holding 2,000 messages of `v1`, `v1`'s deletion, `v1` made again and
    the new queue of the same name: the replica is `kill -9`ed as it applies it, then
    started: it applies what was not acknowledged again, each message once, and ends
    with the new queue's messages only."""
    rig, users, _mirror_users = vhost_sites(tmp_path, ["/", "v1"], ["/", "v1"])
    with rig as sites:
        source, mirror = sites.source, sites.mirror
        publish(source, "/", "orders", bodies("root", 3))
        sites.caught_up()
        mirror.stop()
        publish(source, "v1", "orders", bodies("old", 2000))
        delete_vhost(source, users, ["/"], "v1")
        serve(users, ["/", "v1"])
        wait_for("v1 served again", lambda: _opens(source, "v1"), timeout=30)
        publish(source, "v1", "orders", bodies("new", 7))
        mirror.start()
        wait_for("the replica linked", lambda: (mirror_status(source) or {}).get("connected"))
        mirror.kill()  # somewhere in the backlog: the ack of what it applied may be lost
        mirror.start()
        sites.caught_up()
        expected = {("/", "orders"): 3, ("v1", "orders"): 7}
        assert client_queues(mirror) == client_queues(source) == expected
        assert held(mirror, "v1", "orders") == bodies("new", 7)
        assert held(mirror, "/", "orders") == bodies("root", 3)
        assert orphaned(mirror) == 0


def test_one_queue_name_with_other_arguments_in_two_vhosts_stays_two_queues_on_the_replica(
    tmp_path: Path,
) -> None:
    """`jobs` is a length-limited queue in `/` and a dead-lettering TTL queue in `v1`,
    `dead` exists in both: each vhost's limit, expiry and dead-lettering reach the
    replica as that vhost's, also across the replica's restart and a switchover."""
    users = tmp_path / "users.json"
    serve(users, ["/", "v1"])
    file = ["--users-file", str(users)]
    with Sites(tmp_path, reversible=True, source_args=file, mirror_args=file) as sites:
        source, mirror = sites.source, sites.mirror
        ttl = {"x-message-ttl": 20, "x-dead-letter-exchange": "",
               "x-dead-letter-routing-key": "dead"}  # fmt: skip
        declare_and_publish(source, "/", "dead", {}, [b"root-dead"])
        declare_and_publish(source, "v1", "dead", {}, [])
        declare_and_publish(source, "/", "jobs", {"x-max-length": 2}, bodies("root", 5))
        declare_and_publish(source, "v1", "jobs", ttl, bodies("v1", 5))
        wait_for("v1's jobs dead-lettered",
                 lambda: client_queues(source).get(("v1", "dead")) == 5)  # fmt: skip
        sites.caught_up()
        expected = {("/", "dead"): 1, ("/", "jobs"): 2, ("v1", "dead"): 5, ("v1", "jobs"): 0}
        assert client_queues(mirror) == client_queues(source) == expected
        mirror.stop()
        mirror.start()
        sites.caught_up()
        assert client_queues(mirror) == expected
        demoted = demote(source)
        assert demoted.token is not None
        assert sites.promote_mirror(demoted.token).role == "source"
        assert held(mirror, "/", "jobs") == bodies("root", 5)[3:]
        assert held(mirror, "/", "dead") == [b"root-dead"]
        assert held(mirror, "v1", "dead") == bodies("v1", 5)
        # B's own: each vhost's arguments, B's now.
        declare_and_publish(mirror, "/", "jobs", {"x-max-length": 2}, [b"on-b"])
        declare_and_publish(mirror, "v1", "jobs", ttl, [b"on-b"])
        wait_for("B's v1 job dead-lettered",
                 lambda: client_queues(mirror).get(("v1", "dead")) == 6)  # fmt: skip
        sites.caught_up(source=mirror)
        assert held(source, "/", "jobs") == [bodies("root", 5)[4], b"on-b"]
        assert held(source, "v1", "dead") == [*bodies("v1", 5), b"on-b"]
        assert held(source, "/", "dead") == [b"root-dead"]


def test_a_forced_failover_to_a_site_not_serving_a_vhost_keeps_it_for_when_it_is_served(
    tmp_path: Path,
) -> None:
    """B's users file does not declare `v2`: promoted by force, B keeps the `v2` it
    mirrored (refusing its clients), serves it once its file declares it, and the old
    source, back, orphans what it alone had in `v2` and holds B's copy."""
    rig, _a_users, b_users = vhost_sites(tmp_path, ["/", "v2"], ["/"], reversible=True)
    with rig as sites:
        publish(sites.source, "v2", "orders", bodies("v2", 10))
        sites.caught_up()
        sites.mirror.stop()  # a partition
        publish(sites.source, "v2", "orders", bodies("lost", 5))
        sites.fail_over_by_force()
        assert not _opens(sites.mirror, "v2")
        assert client_queues(sites.mirror) == {("v2", "orders"): 10}
        serve(b_users, ["/", "v2"])
        wait_for("v2 served on B", lambda: _opens(sites.mirror, "v2"), timeout=30)
        assert consume(sites.mirror, "v2", "orders", 2) == bodies("v2", 2)
        sites.old_source_back()
        assert sites.loss_counted()["messages"] == 5
        orphans = browse(sites.source, "/", ORPHANS)
        assert sorted(body for body, _ in orphans) == sorted(bodies("lost", 5))
        assert held(sites.source, "v2", "orders") == bodies("v2", 10)[2:]
        assert held(sites.mirror, "v2", "orders") == bodies("v2", 10)[2:]


def _fed_opens(site: BrokerProcess, vhost: str) -> bool:
    """Whether `guest` may open `vhost` on `site` (a new connection)."""
    try:
        fed_connect(site, vhost).close()
    except pika.exceptions.ProbableAccessDeniedError:
        return False
    return True


def test_a_downstream_vhost_deleted_and_made_again_federates_into_the_new_one(
    tmp_path: Path,
) -> None:
    """`remote`'s `t1` federates `orders` from central's `t1`. The operator retires and
    deletes `t1` on `remote` (`DELETE /vhosts/t1`), then serves it again and binds a new
    queue: the link must republish into the new `t1`, where the queue is, not into the
    vhost deleted (every confirmed message upstream acked by the link and lost)."""
    central = broker(tmp_path, "central")
    with central.start():
        config = federation_file(
            tmp_path / "remote-federation.json",
            {"central": f"guest@127.0.0.1:{central.port}/"},
            [Link("t1", "orders", "t1").entry()],
        )
        remote = broker(tmp_path, "remote", config)
        remote_users = tmp_path / "remote.json"  # what `broker` wrote: its users file
        served = json.loads(remote_users.read_text())
        with remote.start():
            wait_running(remote, "t1", "orders")
            bind(remote, "t1", "t1-orders", "orders", "k")
            wait_bound(remote, "t1", "orders")
            fed_publish(central, "t1", "orders", "k", bodies("before", 3))
            assert drain(remote, "t1", "t1-orders", 3) == bodies("before", 3)
            retired = {
                **served,
                "vhosts": [v for v in served["vhosts"] if v["name"] != "t1"],
                "permissions": [p for p in served["permissions"] if p["vhost"] != "t1"],
            }
            remote_users.write_text(json.dumps(retired))
            wait_for("t1 retired on remote", lambda: not _fed_opens(remote, "t1"), timeout=30)
            remote.admin.delete_vhost("t1")
            remote_users.write_text(json.dumps(served))
            wait_for("t1 served again on remote", lambda: _fed_opens(remote, "t1"), timeout=30)
            wait_running(remote, "t1", "orders")
            # The new t1 lacks the federated exchange the file names (made at start only):
            # declared as a client would (RabbitMQ's federation needs that anyway).
            conn = fed_connect(remote, "t1")
            conn.channel().exchange_declare("orders", "direct", durable=True)
            conn.close()
            bind(remote, "t1", "t1-orders", "orders", "k")
            wait_for(
                "the link counting the new t1's binding",
                lambda: links(remote)[("t1", "orders")]["local_bindings"] == 1,
                timeout=20,
            )
            wait_bound(remote, "t1", "orders")
            after = bodies("after", 5)
            fed_publish(central, "t1", "orders", "k", after)
            link_queue = queue_name("orders", "remote")
            wait_for("the link queue settled", lambda: settled(central, "t1", link_queue))
            assert drain(remote, "t1", "t1-orders") == after
