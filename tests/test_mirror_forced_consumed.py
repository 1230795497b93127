"""A forced failover after the promoted site's clients consumed (docs/mirror.md, "DR
failover": "The RPO as a count"): the old source, back and fenced, counts what it made
that the promoted site never got and keeps those messages (its orphan queue), and a
message the promoted site's clients consumed never comes back, on either site: not
through the old source's backlog, not through the seed (as an orphan beside the lost
ones), not at a failback."""

from __future__ import annotations

from pathlib import Path

import pytest
from mirrorsites import Sites, browse, channel, demote, mirror_status, promote, publish
from test_mirror_delta import consume_every
from test_mirror_reseed import ORPHANS, bodies, consume

from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for


def consume_on_disk(broker: BrokerProcess, queue: str, n: int) -> None:
    """Take and ack `n` messages of `queue` in one transaction, returning once its
    tx.commit-ok says the acks are on disk. A plain basic.ack has no reply and the
    connection's close-ok does not wait for the group commit that journals it: a
    `kill -9` right after sometimes found it unwritten (no settle to count: (5, 0))."""
    connection, ch = channel(broker)
    ch.tx_select()
    for _ in range(n):
        method, _, _ = ch.basic_get(queue)
        assert method is not None
        ch.basic_ack(method.delivery_tag)
    ch.tx_commit()
    connection.close()


def test_messages_consumed_on_the_promoted_site_never_come_back_and_the_lost_are_kept(
    tmp_path: Path,
) -> None:
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", bodies("a", 10))
        publish(sites.source, "audit", bodies("c", 3))
        sites.caught_up()
        sites.mirror.stop()  # a partition: B will never see what follows
        publish(sites.source, "orders", bodies("lost", 5))
        consume_on_disk(sites.source, "audit", 1)  # c-0, settled on A alone: B still has it
        sites.source.kill()
        sites.mirror.start()
        assert sites.promote_mirror(force=True).forced
        # B's clients at once, as after any failover: 4 of A's messages and 2 of B's own
        # consumed and acked.
        consume(sites.mirror, "orders", 4)
        publish(sites.mirror, "own", bodies("b", 5))
        consume(sites.mirror, "own", 2)
        on_b = {"orders": bodies("a", 10)[4:], "own": bodies("b", 5)[2:], "audit": bodies("c", 3)}

        sites.old_source_back()
        lost = sites.loss_counted()
        # A counts what B never got: 5 messages and the settle of c-0 (c-0 is B's again,
        # back on A with B's seed: asynchronous DR cannot avoid it, it is reported).
        assert (lost["messages"], lost["settles"]) == (5, 1)
        assert (lost["unverified_events"], lost["unverified_messages"]) == (0, 0)
        assert mirror_status(sites.source)["queue_events"] == 0  # dropped, never replayed
        for queue, expected in on_b.items():
            assert browse(sites.mirror, queue) == expected  # nothing came back on B
            assert browse(sites.source, queue) == expected  # A is B's copy
        # A keeps exactly the 5 it alone had: a message B consumed is not an orphan (an
        # operator re-publishing the orphans would deliver it again).
        assert sorted(browse(sites.source, ORPHANS)) == sorted(bodies("lost", 5))

        back = demote(sites.mirror)  # the failback: A the source again
        assert back.token is not None
        assert promote(sites.source, back.token).role == "source"
        publish(sites.source, "orders", [b"after"])
        sites.caught_up()
        assert drain(sites.mirror.url, "orders") == [*on_b["orders"], b"after"]
        assert drain(sites.mirror.url, "own") == on_b["own"]
        assert drain(sites.mirror.url, "audit") == on_b["audit"]
        assert mirror_status(sites.mirror)["orphans"] == 0
        assert sorted(drain(sites.source.url, ORPHANS)) == sorted(bodies("lost", 5))


@pytest.mark.slow
def test_the_old_source_restarted_mid_comparison_counts_once_and_resurrects_nothing(
    tmp_path: Path,
) -> None:
    """As above, with A `kill -9`ed while B compares its seed with what A holds (the
    comparison slowed by a throttled link): the session cut before its first event counts
    nothing, the next one counts what the first would have, once."""
    with FaultProxy("127.0.0.1:1") as proxy:
        sites = Sites(tmp_path, reversible=True, mirror_to=proxy.address)
        proxy.retarget(f"127.0.0.1:{sites.source_port}")  # B -> proxy -> A, once reversed
        with sites:
            publish(sites.source, "orders", bodies("a", 300))
            sites.caught_up()
            sites.mirror.stop()  # a partition
            # 50 settles B never sees, spread over the queue: every range of the
            # comparison differs and is split down to listed ids (several round trips).
            settled_on_a = consume_every(sites, "orders", 6, 300)
            publish(sites.source, "orders", bodies("lost", 5))
            sites.source.kill()
            sites.mirror.start()
            assert sites.promote_mirror(force=True).forced
            consume(sites.mirror, "orders", 4)  # a-0 (settled on A too) .. a-3
            publish(sites.mirror, "own", bodies("b", 5))
            consume(sites.mirror, "own", 2)
            on_b = {"orders": bodies("a", 300)[4:], "own": bodies("b", 5)[2:]}

            proxy.throttle(300)  # the comparison's round trips take seconds
            sites.source.start()
            wait_for("A fenced", lambda: mirror_status(sites.source)["role"] == "replica", 30)

            def comparing() -> bool:
                section = mirror_status(sites.source)
                return section is not None and section["sources_connected"] == 1

            wait_for("B's session on A", comparing, 60)
            sites.source.kill()
            assert "compared in" not in sites.mirror.log_path.read_text()  # cut mid-way
            sites.source.start()
            proxy.throttle(None)
            sites.caught_up(source=sites.mirror)
            lost = wait_for(
                "the loss counted", lambda: mirror_status(sites.source)["unmirrored"], 30
            )
            assert (lost["messages"], lost["settles"]) == (5, len(settled_on_a))
            assert (lost["unverified_events"], lost["unverified_messages"]) == (0, 0)
            assert mirror_status(sites.source)["queue_events"] == 0
            for queue, expected in on_b.items():
                assert browse(sites.mirror, queue) == expected
                assert sorted(browse(sites.source, queue)) == sorted(expected)
            assert sorted(browse(sites.source, ORPHANS)) == sorted(bodies("lost", 5))
            assert "compared in" in sites.mirror.log_path.read_text()


def test_a_forced_failover_after_a_switchover_and_failback_still_seeds_and_counts(
    tmp_path: Path,
) -> None:
    """B was the source once (a switchover, then a failback): its replication queue is
    there when it is forced. It seeds all the same, and A counts, orphans and converges
    as after a first failover (before: no seed, A never counted, kept the 5 lost among
    its queues and lacked what it had consumed behind the partition: two copies apart)."""
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", bodies("a", 10))
        sites.caught_up()
        there = demote(sites.source)
        assert promote(sites.mirror, there.token).role == "source"
        publish(sites.mirror, "orders", bodies("b", 2))
        sites.caught_up(source=sites.mirror)
        back = demote(sites.mirror)
        assert promote(sites.source, back.token).role == "source"
        sites.caught_up()
        sites.mirror.stop()  # a partition
        publish(sites.source, "orders", bodies("lost", 5))
        consume_on_disk(sites.source, "orders", 1)  # a-0, settled on A alone
        sites.source.kill()
        sites.mirror.start()
        assert sites.promote_mirror(force=True).forced
        assert mirror_status(sites.mirror)["last_seed"].startswith("forced promotion")
        consume(sites.mirror, "orders", 2)  # a-0 (again: B never knew) and a-1
        on_b = [*bodies("a", 10)[2:], *bodies("b", 2)]
        sites.old_source_back()
        lost = sites.loss_counted()
        assert (lost["messages"], lost["settles"]) == (5, 1)
        assert (lost["unverified_events"], lost["unverified_messages"]) == (0, 0)
        assert browse(sites.mirror, "orders") == on_b
        assert browse(sites.source, "orders") == on_b
        assert sorted(browse(sites.source, ORPHANS)) == sorted(bodies("lost", 5))
