"""The bidirectional mode carries every virtual host (docs/mirror.md, "Virtual hosts").

Two real bidirectional sites (`mirrorsites.Ring`), one users file declaring `/`, `v1`
and `v2`, pika clients with publisher confirms: each site's own queues in `/` and `v1`
reach the other site once, acks settle both ways, the same queue name in two vhosts is
never confused (its messages, its ids, its acks), a vhost's topology (an exchange and
its binding, a queue's deletion) converges, and a site killed mid-stream loses and
repeats nothing of any vhost. Sans-I/O: `/`'s events are what they were before the
mode carried other vhosts, and a peer of that version refuses another vhost's ops
(dead-lettered, with the reason) rather than applying them to `/`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pika
import pydantic
import pytest
from mirrorsites import Ring
from test_mirror_vhosts import GRANTS, bodies, client_queues, consume, held, users, vhosts
from test_vhosts import _opens, connect, publish, users_file

from twinmq.broker.definitions import BindingDef, Definitions, QueueDef
from twinmq.broker.mirror.bidi import (
    BidiMeta,
    TopologyDelta,
    apply_delta,
    key_parts,
    make_key,
    vhost_deltas,
)
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.waiting import wait_for

PERSISTENT = pika.BasicProperties(delivery_mode=2)


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Ring]:
    with Ring(tmp_path, extra_args=["--users-file", users(tmp_path / "users.json")]) as ring:
        yield ring


def converged(ring: Ring, expected: dict[tuple[str, str], int]) -> None:
    """Wait until every site (of a ring or a mesh) holds `expected` messages per (vhost,
    queue) (no other client queue) and nothing is in flight."""
    seen: dict[str, dict[tuple[str, str], int]] = {}

    def done() -> bool:
        seen.update({site.name: client_queues(site) for site in ring.sites})
        return all(counts == expected for counts in seen.values())

    try:
        wait_for("every site converged", done, timeout=120)
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; seen last: {seen}") from None
    ring.caught_up()


def publish_one_by_one(broker: BrokerProcess, vhost: str, queue: str, items: list[bytes],
                       *, kill: BrokerProcess | None = None) -> None:  # fmt: skip
    """Publish `items` to `queue` in `vhost`, each confirmed before the next; `kill` is
    killed (-9) halfway."""
    conn = connect(broker, "admin", vhost)
    ch = conn.channel()
    ch.queue_declare(queue, durable=True)
    ch.confirm_delivery()
    for i, body in enumerate(items):
        if kill is not None and i == len(items) // 2:
            kill.kill()
        ch.basic_publish("", queue, body, PERSISTENT)
    conn.close()


def test_each_site_publishing_in_two_vhosts_reaches_the_other_once_and_acks_settle_both_ways(
    pair: Ring,
) -> None:
    a, b = pair.sites
    publish(a, "/", "work-a", bodies("a-root", 20))
    publish(a, "v1", "work-a", bodies("a-v1", 20))  # the same name in another vhost
    publish(b, "/", "work-b", bodies("b-root", 20))
    publish(b, "v1", "work-b", bodies("b-v1", 20))
    expected = {("/", "work-a"): 20, ("v1", "work-a"): 20, ("/", "work-b"): 20,
                ("v1", "work-b"): 20}  # fmt: skip
    converged(pair, expected)
    for site in pair.sites:
        assert held(site, "/", "work-a") == bodies("a-root", 20)
        assert held(site, "v1", "work-a") == bodies("a-v1", 20)
        assert held(site, "/", "work-b") == bodies("b-root", 20)
        assert held(site, "v1", "work-b") == bodies("b-v1", 20)
        assert {n: v["mirrored"] for n, v in vhosts(site).items()} == {
            "/": True, "v1": True, "v2": True,
        }  # fmt: skip
    # Acks both ways, in v1 only: B settles A's messages, A settles B's; `/`'s queues of
    # the same names keep theirs (the id map tells v1's messages from `/`'s).
    assert consume(b, "v1", "work-a", 5) == bodies("a-v1", 20)[:5]
    assert consume(a, "v1", "work-b", 7) == bodies("b-v1", 20)[:7]
    expected |= {("v1", "work-a"): 15, ("v1", "work-b"): 13}
    converged(pair, expected)
    for site in pair.sites:
        assert held(site, "v1", "work-a") == bodies("a-v1", 20)[5:]
        assert held(site, "v1", "work-b") == bodies("b-v1", 20)[7:]
        assert held(site, "/", "work-a") == bodies("a-root", 20)
    # A v1 queue deleted on B (A's) is gone on A; `/`'s queue of that name stays.
    conn = connect(b, "admin", "v1")
    conn.channel().queue_delete("work-a")
    conn.close()
    del expected[("v1", "work-a")]
    converged(pair, expected)
    assert held(a, "/", "work-a") == bodies("a-root", 20)


def test_a_vhosts_exchange_and_binding_reach_the_other_site_which_routes_through_them(
    pair: Ring,
) -> None:
    a, b = pair.sites
    conn = connect(a, "admin", "v1")
    ch = conn.channel()
    ch.exchange_declare("orders", "direct", durable=True)
    ch.queue_declare("routed", durable=True)
    ch.queue_bind("routed", "orders", routing_key="eu")
    conn.close()
    pair.caught_up()
    # B's clients route through A's exchange and binding, in v1 (`/` has neither).
    conn = connect(b, "admin", "v1")
    ch = conn.channel()
    ch.confirm_delivery()
    for body in bodies("via-b", 4):
        ch.basic_publish("orders", "eu", body, PERSISTENT)
    conn.close()
    converged(pair, {("v1", "routed"): 4})
    assert held(a, "v1", "routed") == bodies("via-b", 4)
    root = connect(b, "admin", "/")
    with pytest.raises(pika.exceptions.ChannelClosedByBroker):  # 404: not in `/`
        root.channel().exchange_declare("orders", passive=True)
    root.close()
    # A's unbind reaches B: B's publishes to that key are no longer routed.
    conn = connect(a, "admin", "v1")
    conn.channel().queue_unbind("routed", "orders", routing_key="eu")
    conn.close()
    pair.caught_up()
    conn = connect(b, "admin", "v1")
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("orders", "eu", b"unrouted", PERSISTENT)
    conn.close()
    converged(pair, {("v1", "routed"): 4})


def test_a_site_killed_mid_stream_in_another_vhost_loses_and_repeats_nothing(
    pair: Ring,
) -> None:
    a, b = pair.sites
    publish(b, "v1", "stream", bodies("b", 50))
    publish_one_by_one(a, "v1", "stream", bodies("a", 400), kill=b)
    publish(a, "/", "stream", bodies("root", 10))  # while B is away too
    b.start()
    publish(b, "v1", "stream", bodies("b-late", 20))
    converged(pair, {("v1", "stream"): 470, ("/", "stream"): 10})
    expected = sorted(bodies("a", 400) + bodies("b", 50) + bodies("b-late", 20))
    for site in pair.sites:
        assert sorted(held(site, "v1", "stream")) == expected
        assert held(site, "/", "stream") == bodies("root", 10)
    # B's id map survived: its acks of A's v1 messages settle them on A, after A's
    # restart too (A maps B's late ones).
    a.kill()
    a.start()
    consume(b, "v1", "stream", 300)
    converged(pair, {("v1", "stream"): 170, ("/", "stream"): 10})
    taken = consume(a, "v1", "stream", 170)
    assert len(set(taken)) == 170
    converged(pair, {("v1", "stream"): 0, ("/", "stream"): 10})


# -- the wire format ----------------------------------------------------------------------


class _SlashOnlyMeta(pydantic.BaseModel):
    """`BidiMeta` as a peer from before other vhosts were carried read it."""

    origin: str
    oseq: int
    hops: list[str]
    keys: list[tuple[str, str]] = []
    topology: TopologyDelta | None = None
    seed: str | None = None


def _meta(oseq: int, **fields: object) -> BidiMeta:
    return BidiMeta.model_validate({"origin": "site-a", "oseq": oseq, "hops": ["site-a"], **fields})


def test_slash_events_are_what_they_were_and_an_older_peer_refuses_another_vhosts_ops() -> None:
    root = _meta(
        7,
        keys=[make_key("/", "q", "site-a")],
        topology=TopologyDelta(declare_queues=[QueueDef(name="q", qid=3)]),
    )
    wire = root.model_dump_json(exclude_defaults=True)
    assert "vhost" not in wire
    # A peer from before reads `/`'s event and would write the same bytes.
    assert _SlashOnlyMeta.model_validate_json(wire).model_dump_json(exclude_defaults=True) == wire
    other = _meta(8, keys=[make_key("v1", "q", "site-a")])
    assert key_parts(other.keys[0]) == ("v1", "q", "site-a")
    with pytest.raises(pydantic.ValidationError):  # so it dead-letters it, with the reason
        _SlashOnlyMeta.model_validate_json(other.model_dump_json(exclude_defaults=True))
    # Another vhost's topology is a field such a peer ignores (it carries `/` only).
    bind = BindingDef(exchange="x", queue="q", routing_key="k", vhost="v1")
    topo = _meta(9, vhost_topology={"v1": TopologyDelta(bind=[bind])})
    seen = _SlashOnlyMeta.model_validate_json(topo.model_dump_json(exclude_defaults=True))
    assert seen.topology is None


def test_turning_the_mode_on_for_sites_with_messages_in_two_vhosts_mirrors_what_each_held(
    tmp_path: Path,
) -> None:
    file = ["--users-file", users(tmp_path / "users.json")]
    for name in ("site-a", "site-b"):
        with BrokerProcess(tmp_path / name / "data", name=f"{name}-before",
                           extra_args=file) as plain:  # fmt: skip
            publish(plain, "/", "existing", bodies(f"{name}-root", 30))
            publish(plain, "v1", "existing", bodies(f"{name}-v1", 30))
    with Ring(tmp_path, extra_args=file) as ring:
        converged(ring, {("/", "existing"): 60, ("v1", "existing"): 60})
        for site in ring.sites:
            assert sorted(held(site, "/", "existing")) == sorted(
                bodies("site-a-root", 30) + bodies("site-b-root", 30)
            )
            assert sorted(held(site, "v1", "existing")) == sorted(
                bodies("site-a-v1", 30) + bodies("site-b-v1", 30)
            )


def test_a_vhost_deleted_on_one_site_is_emptied_on_the_other_and_dropped_if_not_served(
    tmp_path: Path,
) -> None:
    path = tmp_path / "users.json"
    with Ring(tmp_path, extra_args=["--users-file", users(path)]) as ring:
        a, b = ring.sites
        publish(a, "v2", "jobs", bodies("a", 3))
        publish(b, "v2", "jobs", bodies("b", 2))
        publish(b, "v1", "jobs", bodies("b-v1", 2))
        converged(ring, {("v2", "jobs"): 5, ("v1", "jobs"): 2})
        users_file(path, ["/", "v1"], GRANTS)  # both sites retire v2
        wait_for("v2 retired", lambda: not any(_opens(site, "v2") for site in ring.sites), 30)
        deleted = a.admin.delete_vhost("v2")
        assert (deleted.queues, deleted.messages) == (1, 5)
        converged(ring, {("v1", "jobs"): 2})  # B's own v2 messages went with the queue
        wait_for("v2 dropped on B", lambda: "v2" not in vhosts(b), timeout=30)
        assert held(a, "v1", "jobs") == bodies("b-v1", 2)


def test_a_ring_of_three_forwards_another_vhosts_events_and_acks_once(tmp_path: Path) -> None:
    with Ring(tmp_path, 3, extra_args=["--users-file", users(tmp_path / "users.json")]) as ring:
        a, b, c = ring.sites
        publish(a, "v1", "relay", bodies("a", 10))  # reaches C through B only
        publish(c, "v1", "relay", bodies("c", 5))  # reaches B through A only
        publish(b, "/", "relay", bodies("b-root", 2))
        converged(ring, {("v1", "relay"): 15, ("/", "relay"): 2})
        for site in ring.sites:
            assert sorted(held(site, "v1", "relay")) == sorted(bodies("a", 10) + bodies("c", 5))
        assert len(set(consume(c, "v1", "relay", 15))) == 15
        converged(ring, {("v1", "relay"): 0, ("/", "relay"): 2})


def test_deltas_are_per_vhost_and_land_in_the_vhost_they_are_keyed_by() -> None:
    def defs(vhost: str, qid: int) -> Definitions:
        return Definitions(
            queues=[QueueDef(name="q", qid=qid, vhost=vhost)],
            bindings=[BindingDef(exchange="amq.direct", queue="q", routing_key="k", vhost=vhost)],
            next_qid=qid + 1,
        )

    before = defs("/", 1)
    v1 = defs("v1", 2)
    after = Definitions(
        queues=[*before.queues, *v1.queues], bindings=[*before.bindings, *v1.bindings], next_qid=3
    )
    root, others = vhost_deltas(before, after)
    assert root.empty() and list(others) == ["v1"]
    assert [q.name for q in others["v1"].declare_queues] == ["q"]
    # Applied here in v1 (whatever vhost its objects say): a new local qid, in v1.
    here, deleted = apply_delta(Definitions(next_qid=40), others["v1"], "v1")
    assert not deleted
    assert [(q.vhost, q.qid) for q in here.queues] == [("v1", 40)]
    assert [b.vhost for b in here.bindings] == ["v1"]
    # v1 gone from the origin's topology (its deletion): its queue deleted, `/` untouched.
    root, others = vhost_deltas(after, before)
    assert root.empty() and others["v1"].delete_queues == ["q"]
    gone, deleted = apply_delta(here, others["v1"], "v1")
    assert deleted and not gone.queues and not gone.bindings
