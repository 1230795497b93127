"""The bidirectional DR mirror (`--mirror-role bidirectional`): two or three real sites,
each writable, mirroring to the next (A <-> B, or the ring A -> B -> C -> A), driven
through pika. Every confirmed message ends up exactly once on every site, an ack on one
site settles the message everywhere, nothing echoes back to its origin, and a cut link,
a killed site or a topology change on either side converge."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from mirrorsites import Ring, browse, channel, depth, metric, publish, queues

from twinmq.broker.admin_client import AdminError, mirror_demote_call
from twinmq.broker.api import MirrorDemoteRequest
from twinmq.broker.definitions import BindingDef, Definitions, QueueDef
from twinmq.broker.journal import Settle, StoredMessage
from twinmq.broker.mirror.bidi import (
    BidiMeta,
    apply_delta,
    decode_bidi,
    encode_bidi,
    forwarded,
    topology_delta,
)
from twinmq.broker.settings import BrokerSettings
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for

PERSISTENT = pika.BasicProperties(delivery_mode=2)


def bodies(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


def settle(site: BrokerProcess, queue: str, n: int, how: str = "ack") -> None:
    """Take `n` messages of `queue` at `site` and ack them (or reject them, not requeued)."""
    connection, ch = channel(site)
    for _ in range(n):
        method, _props, _body = ch.basic_get(queue, auto_ack=False)
        assert method is not None
        if how == "ack":
            ch.basic_ack(method.delivery_tag)
        else:
            ch.basic_reject(method.delivery_tag, requeue=False)
    connection.close()


def converged(ring: Ring, queue: str, expected: int) -> None:
    """Wait until every site holds `expected` messages in `queue` and nothing is in flight."""
    seen: dict[str, int] = {}

    def done() -> bool:
        seen.update({site.name: depth(site, queue) for site in ring.sites})
        return all(n == expected for n in seen.values())

    # 120 s: a healed link reconnects within seconds, but a loaded machine (a CI run
    # beside other work) stretches the catch-up.
    try:
        wait_for(f"{queue} at {expected} on every site", done, timeout=120)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; depths seen last: {seen}") from None
    ring.caught_up()


def counters(ring: Ring) -> dict[str, tuple[float, float]]:
    """Per site: events it passed on, and events that came back to it (or came twice)."""
    return {
        site.name: (
            metric(site, "twinmq_mirror_forwarded_events_total") or 0.0,
            metric(site, "twinmq_mirror_looped_events_total") or 0.0,
        )
        for site in ring.sites
    }


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Ring]:
    with Ring(tmp_path, 2) as started:
        yield started


def test_two_sites_publishing_to_one_queue_each_hold_every_confirmed_message_once(
    pair: Ring,
) -> None:
    a, b = pair.sites
    before = counters(pair)
    publish(a, "orders", bodies("a", 200))
    publish(b, "orders", bodies("b", 200))
    converged(pair, "orders", 400)
    expected = sorted(bodies("a", 200) + bodies("b", 200))
    for site in pair.sites:
        assert sorted(browse(site, "orders")) == expected
    # No echo: once linked, an applied event is never passed back to its origin.
    assert counters(pair) == before


def test_an_ack_on_one_site_settles_the_message_on_the_other(pair: Ring) -> None:
    a, b = pair.sites
    publish(a, "work", bodies("a", 100))
    publish(b, "work", bodies("b", 100))
    converged(pair, "work", 200)
    taken = drain(b.url, "work")  # every message consumed and acked on B ...
    assert sorted(taken) == sorted(bodies("a", 100) + bodies("b", 100))
    converged(pair, "work", 0)  # ... is settled on A too, its own and B's
    publish(a, "work", bodies("again", 10))  # the queue goes on working both ways
    converged(pair, "work", 10)
    settle(a, "work", 4)
    converged(pair, "work", 6)


def test_each_site_active_for_its_own_queues_converges_without_deleting_the_others(
    pair: Ring,
) -> None:
    a, b = pair.sites
    connection, ch = channel(a)
    ch.queue_declare("a-orders", durable=True, arguments={"x-max-length": 1000})
    ch.exchange_declare("a-events", "topic", durable=True)
    ch.queue_bind("a-orders", "a-events", "order.#")
    ch.confirm_delivery()
    for i in range(20):
        ch.basic_publish("a-events", f"order.{i}", f"a-{i}".encode(), PERSISTENT)
    connection.close()
    publish(b, "b-orders", bodies("b", 30))
    converged(pair, "a-orders", 20)
    converged(pair, "b-orders", 30)
    connection, ch = channel(b)  # declared there with A's arguments: an equal redeclare
    ch.queue_declare("a-orders", durable=True, arguments={"x-max-length": 1000})
    with pytest.raises(pika.exceptions.ChannelClosedByBroker, match="PRECONDITION_FAILED"):
        ch.queue_declare("a-orders", durable=True, arguments={"x-max-length": 5})
    connection.close()
    # A's topology change (a queue of its own deleted) deletes that queue only: a full
    # state from A would have deleted B's queue on A and A's on B.
    connection, ch = channel(a)
    ch.queue_declare("a-temp", durable=True)
    connection.close()
    wait_for("a-temp on B", lambda: "a-temp" in queues(b))
    connection, ch = channel(a)
    ch.queue_delete("a-temp")
    connection.close()
    wait_for("a-temp deleted on B", lambda: "a-temp" not in queues(b))
    pair.caught_up()
    for site in pair.sites:
        assert {"a-orders", "b-orders"} <= set(queues(site))
    # A message routed through A's exchange on B lands in the same queue.
    connection, ch = channel(b)
    ch.confirm_delivery()
    ch.basic_publish("a-events", "order.b", b"through-b", PERSISTENT)
    connection.close()
    converged(pair, "a-orders", 21)
    # A queue deleted at one site is deleted at the other with its messages.
    connection, ch = channel(b)
    ch.queue_delete("b-orders")
    connection.close()
    wait_for("b-orders deleted on A", lambda: "b-orders" not in queues(a))


def test_a_link_cut_and_healed_mid_stream_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    with Ring(tmp_path, 2, proxied=True) as ring:
        a, b = ring.sites
        link_ab, link_ba = ring.links
        assert link_ab is not None and link_ba is not None
        cut_done = threading.Event()

        def publish_from_b() -> None:
            publish(b, "stream", bodies("b", 300))

        def cut_and_heal() -> None:
            link_ab.cut()
            link_ba.cut()
            cut_done.set()

        writer = threading.Thread(target=publish_from_b)
        writer.start()
        connection, ch = channel(a)
        ch.queue_declare("stream", durable=True)
        ch.confirm_delivery()
        for i, body in enumerate(bodies("a", 300)):
            if i == 150:
                cut_and_heal()  # mid-stream, both directions
            ch.basic_publish("", "stream", body, PERSISTENT)
        connection.close()
        writer.join()
        assert cut_done.is_set()
        link_ab.heal()
        link_ba.heal()
        converged(ring, "stream", 600)
        expected = sorted(bodies("a", 300) + bodies("b", 300))
        for site in ring.sites:
            assert sorted(browse(site, "stream")) == expected


def test_a_three_site_ring_delivers_every_message_once_everywhere_and_settles_everywhere(
    tmp_path: Path,
) -> None:
    with Ring(tmp_path, 3) as ring:
        a, b, c = ring.sites
        before = counters(ring)
        for site in ring.sites:
            publish(site, "ring", bodies(site.name, 100))
        converged(ring, "ring", 300)
        expected = sorted(bodies("site-a", 100) + bodies("site-b", 100) + bodies("site-c", 100))
        for site in ring.sites:
            assert sorted(browse(site, "ring")) == expected
        # Each site passed on the other two's events only up to the site before their
        # origin: A's reaches C through B, never back to A (a loop would never drain).
        after = counters(ring)
        for site in ring.sites:
            assert after[site.name][0] > before[site.name][0]  # forwarded
            assert after[site.name][1] == before[site.name][1]  # none came back
        # Acks on C settle on A and B (messages of all three origins).
        taken = drain(c.url, "ring")
        assert sorted(taken) == expected
        converged(ring, "ring", 0)
        publish(b, "ring", bodies("late", 5))
        converged(ring, "ring", 5)
        assert sorted(browse(a, "ring")) == sorted(bodies("late", 5))


def test_the_middle_site_of_a_ring_killed_while_passing_events_on_loses_and_repeats_nothing(
    tmp_path: Path,
) -> None:
    with Ring(tmp_path, 3) as ring:
        a, b, c = ring.sites
        connection, ch = channel(a)
        ch.queue_declare("relay", durable=True)
        ch.confirm_delivery()
        for i, body in enumerate(bodies("a", 400)):
            if i == 200:
                b.kill()  # A's events reach C only through B: its forwards as on its disk
            ch.basic_publish("", "relay", body, PERSISTENT)
        connection.close()
        publish(c, "relay", bodies("c", 50))  # C's go to A directly, to B through A
        b.start()
        converged(ring, "relay", 450)
        expected = sorted(bodies("a", 400) + bodies("c", 50))
        for site in ring.sites:
            assert sorted(browse(site, "relay")) == expected


def test_a_site_killed_mid_stream_keeps_its_id_map_acks_still_settle_both_ways(
    pair: Ring,
) -> None:
    a, b = pair.sites
    publish(b, "durable-map", bodies("b", 50))
    connection, ch = channel(a)
    ch.queue_declare("durable-map", durable=True)
    ch.confirm_delivery()
    for i, body in enumerate(bodies("a", 400)):
        if i == 200:
            b.kill()  # mid-stream: B's map, marks and applied messages as on its disk
        ch.basic_publish("", "durable-map", body, PERSISTENT)
    connection.close()
    b.start()
    converged(pair, "durable-map", 450)
    expected = sorted(bodies("a", 400) + bodies("b", 50))
    for site in pair.sites:
        assert sorted(browse(site, "durable-map")) == expected
    # After the restart B still maps A's messages to its own ids, and A maps B's: acks
    # on either side settle on the other.
    a.kill()
    a.start()
    settle(b, "durable-map", 300)
    converged(pair, "durable-map", 150)
    taken = drain(a.url, "durable-map")
    assert len(taken) == 150 and len(set(taken)) == 150
    converged(pair, "durable-map", 0)


def test_a_message_published_on_one_site_and_dead_lettered_on_the_other_moves_on_both(
    pair: Ring,
) -> None:
    a, b = pair.sites
    connection, ch = channel(a)
    ch.exchange_declare("dlx", "fanout", durable=True)
    ch.queue_declare("parking", durable=True)
    ch.queue_bind("parking", "dlx")
    ch.queue_declare("inbox", durable=True, arguments={"x-dead-letter-exchange": "dlx"})
    ch.confirm_delivery()
    for body in bodies("a", 5):
        ch.basic_publish("", "inbox", body, PERSISTENT)
    connection.close()
    converged(pair, "inbox", 5)
    settle(b, "inbox", 2, "reject")  # B's consumer rejects A's messages
    converged(pair, "parking", 2)
    converged(pair, "inbox", 3)
    # The parked messages are still A's on both sites: an ack on A settles B's copy.
    assert len(drain(a.url, "parking")) == 2
    converged(pair, "parking", 0)


def test_turning_the_mode_on_for_sites_with_messages_mirrors_what_each_held(
    tmp_path: Path,
) -> None:
    for name in ("site-a", "site-b"):
        with BrokerProcess(tmp_path / name / "data", name=f"{name}-before") as plain:
            publish(plain, "existing", bodies(name, 50))
    with Ring(tmp_path, 2) as ring:
        converged(ring, "existing", 100)
        expected = sorted(bodies("site-a", 50) + bodies("site-b", 50))
        for site in ring.sites:
            assert sorted(browse(site, "existing")) == expected
        assert len(drain(ring.sites[0].url, "existing")) == 100
        converged(ring, "existing", 0)


def test_a_bidirectional_site_has_no_switchover(pair: Ring) -> None:
    with pytest.raises(AdminError, match="bidirectional"):
        pair.sites[0].admin.send(mirror_demote_call(MirrorDemoteRequest(timeout=1)), 10)


# -- sans-I/O -------------------------------------------------------------------------------


def test_a_forwarded_event_keeps_its_origin_and_ops_and_adds_the_hop() -> None:
    meta = BidiMeta(origin="site-a", oseq=7, hops=["site-a"], keys=[("q", "site-a")])
    ops = [StoredMessage(5, 0, "", "q", b"h", b"body", 12.5), Settle(0, 3)]
    body = encode_bidi(meta, ops, 1.0)
    passed = decode_bidi(9, forwarded(body, decode_bidi(9, body).meta, "site-b"))
    assert passed.meta.origin == "site-a" and passed.meta.oseq == 7
    assert passed.meta.hops == ["site-a", "site-b"]
    assert passed.ops == ops and passed.created == 1.0


def test_a_topology_delta_never_deletes_by_omission_only_by_an_explicit_delete() -> None:
    mine = Definitions(queues=[QueueDef(name="a-q", qid=1)], next_qid=2)
    theirs_before = Definitions(queues=[QueueDef(name="b-q", qid=1)], next_qid=2)
    theirs_after = Definitions(
        queues=[QueueDef(name="b-q", qid=1), QueueDef(name="b-new", qid=2)],
        bindings=[BindingDef(exchange="amq.topic", queue="b-new", routing_key="x")],
        next_qid=3,
    )
    merged, deleted = apply_delta(mine, topology_delta(theirs_before, theirs_after))
    assert not deleted
    assert {q.name: q.qid for q in merged.queues} == {"a-q": 1, "b-new": 2}  # local ids
    assert merged.bindings == theirs_after.bindings
    gone, deleted = apply_delta(merged, topology_delta(theirs_after, theirs_before))
    assert deleted and [q.name for q in gone.queues] == ["a-q"] and gone.bindings == []


def test_a_redeclare_with_new_arguments_is_a_delete_and_a_declare() -> None:
    before = Definitions(queues=[QueueDef(name="q", qid=1)], next_qid=2)
    after = Definitions(queues=[QueueDef(name="q", qid=2, arguments={"x-max-length": 5})])
    delta = topology_delta(before, after)
    assert delta.delete_queues == ["q"] and [q.name for q in delta.declare_queues] == ["q"]
    here = Definitions(queues=[QueueDef(name="q", qid=40)], next_qid=41)
    merged, deleted = apply_delta(here, delta)
    assert deleted and merged.queues == [QueueDef(name="q", qid=41, arguments={"x-max-length": 5})]


def test_the_bidirectional_role_needs_both_ends() -> None:
    with pytest.raises(ValueError, match="bidirectional needs"):
        BrokerSettings(mirror_to="127.0.0.1:1", mirror_token="t", mirror_role="bidirectional")
    BrokerSettings(
        mirror_to="127.0.0.1:1", mirror_port=2, mirror_token="t", mirror_role="bidirectional"
    )
