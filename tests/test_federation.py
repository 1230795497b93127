"""Exchange federation between real brokers, driven through pika (seed 002's pub-sub
worked example, binding propagation and normalisation, identity refusal, loops)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pytest
from federationsites import (
    bind_queue,
    channel,
    federated,
    federation_file,
    get_all,
    links,
    publish_confirmed,
    queue_depth,
    site,
    upstream_bindings,
    wait_running,
    wait_upstream_bindings,
)
from pika.adapters.blocking_connection import BlockingChannel

from twinmq.broker import fieldtable
from twinmq.broker.admin_client import metric_samples
from twinmq.broker.federation.agent import HELD_QUEUE, queue_name
from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.waiting import wait_for

LINK_QUEUE = queue_name("market", "remote")


@pytest.fixture
def central_and_remote(tmp_path: Path) -> Iterator[tuple[BrokerProcess, BrokerProcess]]:
    """`central` (upstream) and `remote`, which federates central's topic exchange `market`."""
    with federated(tmp_path, "market", "topic") as sites:
        yield sites.central, sites.remote


def test_a_remote_subscriber_receives_what_is_published_centrally_and_only_what_it_bound(
    central_and_remote: tuple[BrokerProcess, BrokerProcess],
) -> None:
    central, remote = central_and_remote
    wait_running(remote, "market")
    bind_queue(remote, "nyse-watcher", "market", "stock.nyse.*")
    wait_upstream_bindings(central, LINK_QUEUE, {("market", "stock.nyse.*")})
    publish_confirmed(
        central,
        "market",
        [("stock.nyse.ibm", b"ibm 1"), ("stock.lse.bp", b"bp 1"), ("stock.nyse.ge", b"ge 1")],
    )
    wait_for("two messages on the remote", lambda: queue_depth(remote, "nyse-watcher") == 2)
    received = get_all(remote, "nyse-watcher", 2)
    assert [(key, body) for key, body, _ in received] == [
        ("stock.nyse.ibm", b"ibm 1"),
        ("stock.nyse.ge", b"ge 1"),
    ]
    headers = received[0][2]
    assert headers["x-twinmq-origin"] == "central"
    assert headers["x-twinmq-federation-path"] == ["central", "remote"]
    link = links(remote)["market"]
    assert link["upstream_server_id"] == "central"
    assert link["messages_received"] == 2
    assert link["duplicates_dropped"] == 0
    samples = metric_samples(remote.admin.metrics(timeout=5))
    assert samples['twinmq_federation_link_running{link="market"}'] == 1
    assert samples['twinmq_federation_messages_received_total{link="market"}'] == 2
    assert samples['twinmq_federation_bindings{link="market"}'] == 1


def test_many_identical_bindings_downstream_are_one_upstream_binding_until_the_last_goes(
    central_and_remote: tuple[BrokerProcess, BrokerProcess],
) -> None:
    central, remote = central_and_remote
    wait_running(remote, "market")
    connection, ch = channel(remote)
    for i in range(10):
        ch.queue_declare(f"q{i}", durable=True)
        ch.queue_bind(f"q{i}", "market", "news.#")
    ch.queue_bind("q0", "market", "sport.*")
    wait_upstream_bindings(central, LINK_QUEUE, {("market", "news.#"), ("market", "sport.*")})
    assert links(remote)["market"]["bindings"] == 2
    publish_confirmed(central, "market", [("news.world", b"one message, ten queues")])
    wait_for("ten copies", lambda: all(queue_depth(remote, f"q{i}") == 1 for i in range(10)))
    # Only one message crossed the link for ten downstream queues (counted once its
    # batch is durable, after the copies are queued: waited for).
    wait_for("one received", lambda: links(remote)["market"]["messages_received"] == 1)
    for i in range(9):
        ch.queue_unbind(f"q{i}", "market", "news.#")
    ch.queue_delete("q0")  # its sport.* binding goes with it
    wait_upstream_bindings(central, LINK_QUEUE, {("market", "news.#")})
    ch.queue_unbind("q9", "market", "news.#")
    wait_upstream_bindings(central, LINK_QUEUE, set())
    connection.close()


def test_binding_churn_leaves_the_upstream_with_exactly_the_normalised_set(
    central_and_remote: tuple[BrokerProcess, BrokerProcess],
) -> None:
    central, remote = central_and_remote
    wait_running(remote, "market")
    connection, ch = channel(remote)
    queues = [f"churn{i}" for i in range(8)]
    for q in queues:
        ch.queue_declare(q, durable=False)
    expected: dict[tuple[str, str], None] = {}
    bound: set[tuple[str, str]] = set()
    for round_ in range(25):
        for n, q in enumerate(queues):
            key = f"k.{(round_ + n) % 5}"
            if (q, key) in bound:
                ch.queue_unbind(q, "market", key)
                bound.discard((q, key))
            else:
                ch.queue_bind(q, "market", key)
                bound.add((q, key))
    expected = {("market", key): None for _q, key in bound}
    wait_upstream_bindings(central, LINK_QUEUE, set(expected))
    assert links(remote)["market"]["bindings"] == len(expected)
    connection.close()


def test_a_reconnect_resynchronises_the_upstream_bindings_with_no_stale_one(
    tmp_path: Path,
) -> None:
    with federated(tmp_path, "market", "direct") as sites:
        central, remote = sites.central, sites.remote
        wait_running(remote, "market")
        connection, ch = channel(remote)
        ch.queue_declare("a", durable=True)
        ch.queue_bind("a", "market", "old")
        ch.queue_bind("a", "market", "kept")
        connection.close()
        wait_upstream_bindings(central, LINK_QUEUE, {("market", "old"), ("market", "kept")})
        remote.stop()
        # While the link is down: the bindings change downstream (on restart) ...
        remote.extra_args = [*remote.extra_args]
        remote.start()
        connection, ch = channel(remote)
        ch.queue_unbind("a", "market", "old")
        ch.queue_bind("a", "market", "new")
        connection.close()
        wait_running(remote, "market")
        # ... and the upstream ends with exactly the new set: "old" was unbound.
        wait_upstream_bindings(central, LINK_QUEUE, {("market", "kept"), ("market", "new")})


def test_a_fanout_exchange_needs_one_upstream_binding_for_any_number_of_downstream_ones(
    tmp_path: Path,
) -> None:
    with federated(tmp_path, "events", "fanout") as sites:
        central, remote = sites.central, sites.remote
        wait_running(remote, "events")
        connection, ch = channel(remote)
        for q in ("f1", "f2", "f3"):
            ch.queue_declare(q, durable=True)
            ch.queue_bind(q, "events", q)
        connection.close()
        wait_upstream_bindings(central, queue_name("events", "remote"), {("events", "")})
        publish_confirmed(central, "events", [("anything", b"x")])
        wait_for(
            "three copies", lambda: all(queue_depth(remote, q) == 1 for q in ("f1", "f2", "f3"))
        )


def test_an_upstream_with_the_downstreams_own_server_id_is_refused_on_both_sides(
    tmp_path: Path,
) -> None:
    twin = site(tmp_path, "same-id", name="central")
    config = federation_file(
        tmp_path / "remote.json",
        {"central": f"127.0.0.1:{twin.port}"},
        [{"exchange": "market", "upstream": "central"}],
    )
    remote = site(tmp_path, "same-id", federation=config, name="remote")
    twin.start()
    remote.start()
    try:
        link = wait_for(
            "the link refused",
            lambda: (
                (links(remote).get("market") or {}).get("state") == "refused"
                and links(remote)["market"]
            ),
        )
        assert "duplicate server id 'same-id'" in link["error"]
        upstream_side = wait_for(
            "the upstream's refusal", lambda: (status_of(twin) or {}).get("refused_peers")
        )
        assert "duplicate server id 'same-id'" in upstream_side[0]
        assert remote.log_path is not None and twin.log_path is not None
        assert "REFUSED" in remote.log_path.read_text()
        assert "REFUSED" in twin.log_path.read_text()
        samples = metric_samples(twin.admin.metrics(timeout=5))
        assert samples["twinmq_federation_peers_refused_total"] >= 1
        assert (
            metric_samples(remote.admin.metrics(timeout=5))[
                'twinmq_federation_link_refused{link="market"}'
            ]
            == 1
        )
    finally:
        remote.stop()
        twin.stop()


def status_of(broker: BrokerProcess) -> dict[str, object] | None:
    """The federation section of a broker's status."""
    from twinmq.testing.pair import status

    data = status(broker)
    return None if data is None else data["federation"]


def test_two_exchanges_federated_both_ways_do_not_bounce_messages_back(tmp_path: Path) -> None:
    a = site(tmp_path, "a")
    b = site(tmp_path, "b")
    a_config = federation_file(
        tmp_path / "a.json",
        {"b": f"127.0.0.1:{b.port}"},
        [{"exchange": "x", "upstream": "b", "type": "fanout", "max-hops": 3}],
    )
    b_config = federation_file(
        tmp_path / "b.json",
        {"a": f"127.0.0.1:{a.port}"},
        [{"exchange": "x", "upstream": "a", "type": "fanout", "max-hops": 3}],
    )
    a.extra_args += ["--federation-config", str(a_config)]
    b.extra_args += ["--federation-config", str(b_config)]
    a.start()
    b.start()
    try:
        wait_running(a, "x")
        wait_running(b, "x")
        for broker in (a, b):
            bind_queue(broker, "sink", "x", "")
        wait_upstream_bindings(a, queue_name("x", "b"), {("x", "")})
        wait_upstream_bindings(b, queue_name("x", "a"), {("x", "")})
        publish_confirmed(a, "x", [("", b"from a")])
        publish_confirmed(b, "x", [("", b"from b")])
        wait_for(
            "each sink holds both", lambda: queue_depth(a, "sink") == queue_depth(b, "sink") == 2
        )
        # The copy sent back to its origin is dropped there (its origin is on its path).
        wait_for(
            "the echoes dropped",
            lambda: links(a)["x"]["loops_dropped"] == 1 and links(b)["x"]["loops_dropped"] == 1,
        )
        assert sorted(body for _k, body, _h in get_all(a, "sink", 2)) == [b"from a", b"from b"]
        assert sorted(body for _k, body, _h in get_all(b, "sink", 2)) == [b"from a", b"from b"]
        assert upstream_bindings(a, queue_name("x", "b")) == {("x", "")}
    finally:
        a.stop()
        b.stop()


@dataclass
class Triangle:
    """Started A, B and C: B federates A's `t`; C federates A's `t` directly and B's `t`
    as `t-via-b` (max-hops 2), its link to B through `to_b`; C's `sink` bound to both."""

    a: BrokerProcess
    b: BrokerProcess
    c: BrokerProcess
    to_b: FaultProxy

    def through(self, link: str) -> int:
        """Deliveries C's link `link` has settled: republished or dropped as copies."""
        state = links(self.c)[link]
        return int(state["messages_received"] + state["duplicates_dropped"])


@contextmanager
def triangle(
    tmp_path: Path, exchange_type: str, key: str, settings: dict[str, Any] | None = None
) -> Iterator[Triangle]:
    """The triangle A -> B -> C and A -> C, started, `sink` on C bound with `key` to both
    of C's exchanges and every binding propagated upstream; `settings`: C's file's (its
    `dedup-window`). Every broker stopped after."""
    a = site(tmp_path, "a")
    b = site(tmp_path, "b")
    c = site(tmp_path, "c")
    fed = {"type": exchange_type, "max-hops": 2}
    b.extra_args += [
        "--federation-config",
        str(
            federation_file(
                tmp_path / "b.json",
                {"a": f"127.0.0.1:{a.port}"},
                [{"exchange": "t", "upstream": "a", **fed}],
            )
        ),
    ]
    with FaultProxy(f"127.0.0.1:{b.port}") as to_b:
        # C's two links federate two local exchanges, both bound into one sink queue.
        c.extra_args += [
            "--federation-config",
            str(
                federation_file(
                    tmp_path / "c.json",
                    {"a": f"127.0.0.1:{a.port}", "b": to_b.address},
                    [
                        {"exchange": "t", "upstream": "a", **fed},
                        {"exchange": "t-via-b", "upstream": "b", "upstream-exchange": "t", **fed},
                    ],
                    settings,
                )
            ),
        ]
        for broker in (a, b, c):
            broker.start()
        try:
            shape = Triangle(a, b, c, to_b)
            wait_running(b, "t")
            wait_running(c, "t")
            wait_running(c, "t-via-b")
            connection, ch = channel(c)
            ch.queue_declare("sink", durable=True)
            ch.queue_bind("sink", "t", key)
            ch.queue_bind("sink", "t-via-b", key)
            connection.close()
            # C's link queue on B is a binding of B's `t`: B's link propagates it to A.
            wait_upstream_bindings(a, queue_name("t", "c"), {("t", key)})
            wait_upstream_bindings(b, queue_name("t", "c"), {("t", key)})
            wait_upstream_bindings(a, queue_name("t", "b"), {("t", key)})
            yield shape
        finally:
            for broker in (c, b, a):
                broker.stop()


def test_a_message_reaching_a_server_by_two_paths_is_delivered_there_once(
    tmp_path: Path,
) -> None:
    """Each message published on A reaches C directly and through B: one copy is dropped
    by its (origin, seq) key, whichever arrives second."""
    with triangle(tmp_path, "topic", "price.#") as shape:
        publish_confirmed(shape.a, "t", [(f"price.{i}", str(i).encode()) for i in range(50)])
        wait_for(
            "both paths delivered to C",
            lambda: shape.through("t") == 50 and shape.through("t-via-b") == 50,
        )
        bodies = sorted(int(body) for _k, body, _h in get_all(shape.c, "sink", 50))
        assert bodies == list(range(50))
        dropped = links(shape.c)["t"]["duplicates_dropped"]
        assert dropped + links(shape.c)["t-via-b"]["duplicates_dropped"] == 50


def lag_path_via_b(shape: Triangle, warm_up: int, late: int = 100, restart_c: bool = False) -> None:
    """`warm_up` messages from A by both paths, then B -> C partitioned while `late` more
    reach C directly (C restarted then if `restart_c`), then healed: C's `sink` must hold
    each of them once."""
    if warm_up:
        publish_confirmed(shape.a, "t", [("", str(i).encode()) for i in range(warm_up)])
        wait_for("both paths delivered", lambda: shape.through("t-via-b") == warm_up)
        wait_for("the direct path delivered", lambda: shape.through("t") == warm_up)
    total = warm_up + late
    shape.to_b.partition()
    publish_confirmed(shape.a, "t", [("", str(i).encode()) for i in range(warm_up, total)])
    wait_for("the direct path delivered", lambda: shape.through("t") == total, 60)
    if restart_c:
        shape.c.stop()
        shape.c.start()
        wait_running(shape.c, "t")  # the link via B cannot connect before the heal
    shape.to_b.heal()
    # After a restart the links' counts start again from 0: only the late copies come.
    brought = late if restart_c else total
    wait_for("the lagging path delivered", lambda: shape.through("t-via-b") == brought, 120)
    bodies = sorted(int(body) for _k, body, _h in get_all(shape.c, "sink", total))
    assert bodies == list(range(total))
    assert queue_depth(shape.c, "sink") == 0


def test_a_second_path_lagging_past_the_window_brings_no_second_copy(tmp_path: Path) -> None:
    """Seen in the topology runs at a million messages: the link queues back up by more
    than the window's 100,000 keys, and the window forgot a key once `dedup-window`
    newer keys had come, however far another path into the server still lagged behind:
    that path's copy was delivered again (here: 81 of 100). With a window of 20, B -> C
    is partitioned while 100 messages published on A reach C directly, then heals; the
    window keeps the keys the lagging link has not passed yet, and each of B's 100 late
    copies is dropped."""
    with triangle(tmp_path, "fanout", "", {"dedup-window": 20}) as shape:
        lag_path_via_b(shape, warm_up=10)


@pytest.mark.soak  # minutes on a loaded machine: `make soak`; test_federation_marks.py
# keeps a link that never brings an origin in make test
def test_a_path_that_never_brought_an_origin_before_it_lagged_brings_no_second_copy(
    tmp_path: Path,
) -> None:
    """Traced in the mesh at 100,000 messages with a window of 10,000 (docs/federation.md):
    a link that brings an origin's messages only now and then was not waited for until
    it had brought that origin once, and its late copies were delivered again. Here
    B -> C is partitioned before it has brought anything of A while 5,000 messages reach
    C directly (enough for the direct link's marks to be in force: it has brought 4,096
    keys more), with a window of 1,000: the window waits for the link via B all the
    same, and each of its 5,000 late copies is dropped."""
    with triangle(tmp_path, "fanout", "", {"dedup-window": 1000}) as shape:
        lag_path_via_b(shape, warm_up=0, late=5000)


def test_a_restart_between_the_two_copies_of_a_lagging_path_brings_no_second_copy(
    tmp_path: Path,
) -> None:
    """As the lagging path above, with C restarted while B -> C is partitioned: the window
    rebuilt from its records must still wait for the lagging link (a restart, as a pair's
    promotion, had forgotten how far each link had got and kept `dedup-window` keys)."""
    with triangle(tmp_path, "fanout", "", {"dedup-window": 20}) as shape:
        lag_path_via_b(shape, warm_up=10, restart_c=True)


def watch_everything(central: BrokerProcess, remote: BrokerProcess) -> None:
    """The remote's queue `watcher` bound to every key of `market`, bound upstream too."""
    wait_running(remote, "market")
    bind_queue(remote, "watcher", "market", "#")
    wait_upstream_bindings(central, LINK_QUEUE, {("market", "#")})


def test_a_message_a_client_library_cannot_decode_crosses_the_link_unchanged(
    central_and_remote: tuple[BrokerProcess, BrokerProcess],
) -> None:
    """Found by fuzzing (`make fuzz`, content_header): a timestamp past the year 9999 is
    valid AMQP (a u64) and the broker accepts it, but pamqp (under aiormq, the link's
    former client) failed on it and closed the connection; the message was redelivered
    and failed again, and the link stopped for good. The link now keeps content headers
    as received and changes only the federation path."""
    central, remote = central_and_remote
    watch_everything(central, remote)
    odd = pika.BasicProperties(
        delivery_mode=2, timestamp=2**62, content_type="x/odd", headers={"k": "v"}
    )
    connection, ch = channel(central)
    ch.confirm_delivery()
    ch.basic_publish("market", "odd", b"odd", odd)
    connection.close()
    publish_confirmed(central, "market", [("after", b"after")])
    wait_for("both messages on the remote", lambda: queue_depth(remote, "watcher") == 2)
    connection, ch = channel(remote)
    try:
        # Counted in /status once queued, visible once its batch is durable: wait for each.
        properties, body = _get_one(ch, "watcher")
        assert body == b"odd"
        assert properties.timestamp == 2**62 and properties.content_type == "x/odd"
        assert properties.headers["k"] == "v"
        assert properties.headers["x-twinmq-federation-path"] == ["central", "remote"]
        assert _get_one(ch, "watcher")[1] == b"after"
    finally:
        connection.close()
    assert links(remote)["market"]["state"] == "running"


def test_a_message_past_this_servers_bounds_is_kept_in_the_held_queue_and_the_link_goes_on(
    central_and_remote: tuple[BrokerProcess, BrokerProcess],
) -> None:
    """A headers table at the size limit (accepted upstream) outgrows it with the origin
    stamps and the path: the downstream cannot republish it. It is kept as received in
    `amq.twinmq.federation-held`, never dropped nor rewritten; the next message flows."""
    central, remote = central_and_remote
    watch_everything(central, remote)
    # 4 (table size) + 4 ("pad" as a short string) + 1 ("S") + 4 (its length) + the text.
    pad = "x" * (fieldtable.MAX_TABLE_BYTES - 13)
    connection, ch = channel(central)
    ch.confirm_delivery()
    ch.basic_publish("market", "big", b"big", pika.BasicProperties(headers={"pad": pad}))
    connection.close()
    publish_confirmed(central, "market", [("after", b"after")])
    wait_for("the next message on the remote", lambda: queue_depth(remote, "watcher") == 1)
    wait_for("the big one held", lambda: queue_depth(remote, HELD_QUEUE) == 1)
    (held,) = get_all(remote, HELD_QUEUE, 1)
    assert held[1] == b"big" and held[2]["pad"] == pad and "x-twinmq-origin" in held[2]
    assert [body for _key, body, _h in get_all(remote, "watcher", 1)] == [b"after"]
    assert links(remote)["market"]["messages_held"] == 1
    assert queue_depth(central, LINK_QUEUE) == 0
    # Journaled with the batch it arrived in: a kill -9 keeps it.
    connection, ch = channel(central)
    ch.confirm_delivery()
    ch.basic_publish("market", "big", b"big again", pika.BasicProperties(headers={"pad": pad}))
    connection.close()
    wait_for("the second one held", lambda: queue_depth(remote, HELD_QUEUE) == 1)
    remote.kill()
    remote.start()
    wait_for("the link running again", lambda: links(remote)["market"]["state"] == "running")
    assert queue_depth(remote, HELD_QUEUE) == 1


def _get_one(ch: BlockingChannel, queue: str) -> tuple[pika.BasicProperties, bytes]:
    """The next message of `queue` (basic.get until one is visible)."""
    got: list[tuple[pika.BasicProperties, bytes]] = []

    def take() -> bool:
        method, properties, body = ch.basic_get(queue, auto_ack=True)
        if method is not None:
            got.append((properties, body))
        return bool(got)

    wait_for(f"a message from {queue}", take)
    return got[0]
