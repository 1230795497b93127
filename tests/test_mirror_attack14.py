"""Attacks on the DR switchover and failover paths (issue 14; docs/mirror.md,
"Switchover, failover, fencing", "DR failover").

Two real sites (`Sites`, reversible), pika clients publishing with confirms. Each test
is an unlucky operator's sequence; each ends by accounting for every confirmed message:
on the active site, or in an orphan queue (counted), never lost silently, never
delivered twice, and a consumed one never back.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pika
import pytest
from mirrorsites import Sites, browse, channel, demote, mirror_status, promote, publish
from test_mirror_reseed import ORPHANS, bodies

from twinmq.broker.admin_client import MirrorNotDrained
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for


def take(broker_url: str, queue: str, n: int) -> list[bytes]:
    """Consume and ack `n` messages of `queue` (basic.get, explicit acks): the bodies."""
    connection = pika.BlockingConnection(pika.URLParameters(broker_url))
    ch = connection.channel()
    out: list[bytes] = []
    for _ in range(n):
        method, _props, body = ch.basic_get(queue)
        assert method is not None
        ch.basic_ack(method.delivery_tag)
        out.append(body)
    connection.close()
    return out


@pytest.mark.slow
def test_a_forced_failover_during_a_timed_out_demotion_orphans_and_counts_its_backlog(
    tmp_path: Path,
) -> None:
    """A demotion times out (the mirror is away, its backlog cannot drain): the old
    source is fenced half-way, not yet a replica. B is then forced. A's link meets B's
    higher epoch: A fences itself, counts the backlog B never got and keeps those
    messages as orphans; nothing else is lost or doubled."""
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", bodies("a", 10))
        sites.caught_up()
        sites.mirror.stop()
        publish(sites.source, "orders", bodies("lost", 5))
        with pytest.raises(MirrorNotDrained):
            demote(sites.source, timeout=1)
        sites.mirror.start()
        # The operator gives up on the switchover and forces B before A's link retries.
        assert sites.promote_mirror(force=True).forced
        publish(sites.mirror, "orders", bodies("b", 3))
        wait_for("A fenced", lambda: mirror_status(sites.source)["role"] == "replica", 30)
        sites.caught_up(source=sites.mirror)
        lost = sites.loss_counted()
        assert lost["messages"] == 5
        assert drain(sites.mirror.url, "orders") == [*bodies("a", 10), *bodies("b", 3)]
        assert sorted(drain(sites.source.url, ORPHANS)) == sorted(bodies("lost", 5))


@pytest.mark.slow
def test_a_promote_replayed_after_a_kill_9_of_the_promoted_site_answers_the_same(
    tmp_path: Path,
) -> None:
    """The promoted site dies (kill -9) right after answering; the operator, unsure, sends
    the same promote again after its restart: the same answer, nothing doubled, the
    old source still a replica and fed by the promoted site."""
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", bodies("a", 20))
        token = demote(sites.source).token
        assert token is not None
        first = sites.promote_mirror(token)
        publish(sites.mirror, "orders", bodies("b", 5))
        sites.mirror.kill()
        sites.mirror.start()
        again = sites.promote_mirror(token)
        assert again.role == first.role == "source" and again.epoch == first.epoch
        assert again.token == first.token
        publish(sites.mirror, "orders", bodies("c", 5))
        sites.caught_up(source=sites.mirror)
        expected = [*bodies("a", 20), *bodies("b", 5), *bodies("c", 5)]
        # A holds the same, and nothing of it is an orphan.
        assert drain(sites.source.url, "orders") == expected
        assert drain(sites.mirror.url, "orders") == expected
        assert mirror_status(sites.source)["orphans"] == 0


@pytest.mark.slow
def test_a_kill_9_of_the_old_source_after_its_demotion_keeps_it_a_replica(
    tmp_path: Path,
) -> None:
    """The demoted source dies before the promote (kill -9) and comes back: still a
    replica (its role stored before the token was answered); B promoted with the token
    streams to it; every message once on both sites."""
    with Sites(tmp_path, reversible=True) as sites:
        sites.mirror.stop()
        publish(sites.source, "orders", bodies("a", 50))
        sites.mirror.start()
        token = demote(sites.source).token
        assert token is not None
        sites.source.kill()
        sites.source.start()
        assert mirror_status(sites.source)["role"] == "replica"
        assert sites.promote_mirror(token).role == "source"
        publish(sites.mirror, "orders", bodies("b", 5))
        sites.caught_up(source=sites.mirror)
        expected = [*bodies("a", 50), *bodies("b", 5)]
        assert drain(sites.source.url, "orders") == expected
        assert drain(sites.mirror.url, "orders") == expected


def test_messages_consumed_on_the_promoted_site_never_come_back_with_the_old_source(
    tmp_path: Path,
) -> None:
    """After a forced failover, consumers take and ack messages on B while A is away and
    while A is coming back; a failback then makes A the source: what B's consumers
    acked is nowhere, each message was delivered once, and A's unmirrored ones are
    its orphans."""
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", bodies("a", 30))
        sites.caught_up()
        sites.mirror.stop()
        publish(sites.source, "orders", bodies("lost", 4))
        sites.fail_over_by_force()
        consumed = take(sites.mirror.url, "orders", 10)
        publish(sites.mirror, "orders", bodies("b", 5))
        sites.source.start()  # A returns while B's consumers keep acking
        consumed += take(sites.mirror.url, "orders", 10)
        wait_for("A fenced", lambda: mirror_status(sites.source)["role"] == "replica", 30)
        consumed += take(sites.mirror.url, "orders", 5)
        sites.caught_up(source=sites.mirror)
        assert consumed == bodies("a", 25)
        assert promote(sites.source, demote(sites.mirror).token).role == "source"
        rest = drain(sites.source.url, "orders")
        assert rest == [*bodies("a", 30)[25:], *bodies("b", 5)]
        assert not set(rest) & set(consumed)
        # Only what A never mirrored is an orphan: what B's consumers acked is not (it
        # was, when B seeded A a second time from its state at A's return).
        assert sorted(drain(sites.source.url, ORPHANS)) == sorted(bodies("lost", 4))
        assert sites.mirror.log_path.read_text().count("mirror: seed (") == 1


@pytest.mark.slow
def test_a_failback_while_the_promoted_site_holds_unacked_deliveries_loses_none(
    tmp_path: Path,
) -> None:
    """B (promoted by switchover) has a consumer holding 10 deliveries unacked when the
    failback demotes it: its clients are closed, those deliveries return to the queue
    and are mirrored as such; A, promoted, holds them (flagged redelivered) and the
    consumer's late acks settle nothing."""
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", bodies("a", 20))
        assert sites.promote_mirror(demote(sites.source).token).role == "source"
        connection, ch = channel(sites.mirror)
        held = []
        for _ in range(10):
            method, _props, body = ch.basic_get("orders")
            assert method is not None
            held.append((method.delivery_tag, body))
        assert promote(sites.source, demote(sites.mirror).token).role == "source"
        with pytest.raises(pika.exceptions.AMQPError):
            for tag, _body in held:
                ch.basic_ack(tag)
            connection.process_data_events(0)
            ch.basic_get("orders")
        connection_a, ch_a = channel(sites.source)
        got = []
        redelivered = []
        while True:
            method, _props, body = ch_a.basic_get("orders", auto_ack=True)
            if method is None:
                break
            got.append(body)
            redelivered.append(method.redelivered)
        connection_a.close()
        assert sorted(got) == sorted(bodies("a", 20))
        assert sum(redelivered) >= 10
        assert mirror_status(sites.mirror)["orphans"] == 0


def orphaned(url: str) -> list[bytes]:
    """The orphan queue of the broker at `url`, read empty ([]: a site that never
    orphaned anything has none)."""
    try:
        return drain(url, ORPHANS)
    except pika.exceptions.ChannelClosedByBroker as exc:
        assert exc.reply_code == 404
        return []


def accounted(*parts: list[bytes]) -> list[bytes]:
    """Every body of `parts`, sorted (a multiset: a body twice shows twice)."""
    return sorted(body for part in parts for body in part)


def test_two_forced_failovers_in_a_row_account_for_every_confirmed_message(
    tmp_path: Path,
) -> None:
    """A -> B forced; B confirms messages, A returns and is fenced, then B dies (kill -9)
    before A is known to be rebuilt, and A is forced back (B -> A). B returns, is fenced
    and reversed. Every confirmed message is on A or in an orphan queue, exactly once,
    and both sites hold the same live messages."""
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", bodies("a", 10))
        sites.caught_up()
        sites.mirror.stop()
        publish(sites.source, "orders", bodies("lost", 5))  # only A has them
        sites.fail_over_by_force()
        publish(sites.mirror, "orders", bodies("b", 3))
        sites.source.start()
        wait_for("A fenced", lambda: mirror_status(sites.source)["role"] == "replica", 30)
        sites.mirror.kill()
        second = promote(sites.source, force=True)
        assert second.forced and second.epoch == 2
        publish(sites.source, "orders", bodies("c", 2))
        sites.mirror.start()
        wait_for("B fenced", lambda: mirror_status(sites.mirror)["role"] == "replica", 30)
        sites.caught_up()
        orphans_b = orphaned(sites.mirror.url)
        # What B confirmed and A never got is counted on B, as its RPO.
        unmirrored_b = (mirror_status(sites.mirror) or {}).get("unmirrored") or {}
        # A failback to B (a switchover): B streams only what A lacks, nothing of before.
        assert promote(sites.mirror, demote(sites.source).token).role == "source"
        sites.caught_up(source=sites.mirror)
        assert browse(sites.source, "orders") == browse(sites.mirror, "orders")
        live_b = drain(sites.mirror.url, "orders")
        orphans_a = orphaned(sites.source.url)
        every = [*bodies("a", 10), *bodies("lost", 5), *bodies("b", 3), *bodies("c", 2)]
        assert accounted(live_b, orphans_a, orphans_b) == sorted(every)
        assert [b for b in live_b if b.startswith(b"a-")] == bodies("a", 10)
        assert live_b[-2:] == bodies("c", 2)
        assert unmirrored_b.get("messages", 0) == len(orphans_b)


@pytest.mark.slow
def test_a_kill_9_of_the_source_in_the_middle_of_its_demotion_loses_nothing(
    tmp_path: Path,
) -> None:
    """The source dies (kill -9) while its demotion drains a backlog to an unreachable
    mirror; it restarts, the demotion is asked again and completes, B is promoted with
    the token: every confirmed message on B, once; A a replica of B."""
    with Sites(tmp_path, reversible=True) as sites:
        sites.mirror.stop()
        publish(sites.source, "orders", bodies("a", 200))
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(demote, sites.source, 30)
            wait_for("demoting", lambda: "mirror: demoting" in sites.source.log_path.read_text())
            sites.source.kill()
            with pytest.raises(Exception):  # noqa: B017 (the connection dies with the broker)
                pending.result()
        sites.source.start()
        sites.mirror.start()
        token = demote(sites.source).token
        assert token is not None
        assert sites.promote_mirror(token).role == "source"
        publish(sites.mirror, "orders", bodies("b", 5))
        sites.caught_up(source=sites.mirror)
        expected = [*bodies("a", 200), *bodies("b", 5)]
        assert drain(sites.mirror.url, "orders") == expected
        sites.caught_up(source=sites.mirror)
        assert drain(sites.source.url, "orders") == []
        assert mirror_status(sites.source)["orphans"] == 0


@pytest.mark.slow
def test_a_kill_9_of_the_replica_in_the_middle_of_its_promotion_then_a_replay(
    tmp_path: Path,
) -> None:
    """B dies (kill -9) while it is being promoted with a token; the operator restarts it
    and sends the same promotion again: one promoted source, every message once, and A
    its mirror."""
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", bodies("a", 100))
        token = demote(sites.source).token
        assert token is not None
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(sites.promote_mirror, token)
            sites.mirror.kill()
            # The promotion may or may not have answered before the kill.
            with contextlib.suppress(Exception):
                pending.result()
        sites.mirror.start()
        again = sites.promote_mirror(token)
        assert again.role == "source" and again.epoch == token.epoch
        assert sites.promote_mirror(token) == again
        assert mirror_status(sites.source)["role"] == "replica"
        publish(sites.mirror, "orders", bodies("b", 5))
        sites.caught_up(source=sites.mirror)
        expected = [*bodies("a", 100), *bodies("b", 5)]
        assert drain(sites.mirror.url, "orders") == expected
        sites.caught_up(source=sites.mirror)
        assert drain(sites.source.url, "orders") == []


@pytest.mark.slow
def test_the_old_source_killed_while_it_is_rebuilt_counts_and_orphans_once(
    tmp_path: Path,
) -> None:
    """After a forced failover the old source returns, is fenced, and dies (kill -9) while
    the promoted site's seed is compared and applied; back again, it ends as if nothing
    had happened: its 5 lost messages counted once and orphaned once, the rest the
    promoted site's, each once."""
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", bodies("a", 500))
        sites.caught_up()
        sites.mirror.stop()
        publish(sites.source, "orders", bodies("lost", 5))
        sites.fail_over_by_force()
        take(sites.mirror.url, "orders", 100)
        publish(sites.mirror, "orders", bodies("b", 5))
        sites.source.start()
        wait_for("A fenced", lambda: mirror_status(sites.source)["role"] == "replica", 30)
        sites.source.kill()
        sites.source.start()
        sites.caught_up(source=sites.mirror)
        lost = sites.loss_counted()
        assert lost["messages"] == 5
        expected = [*bodies("a", 500)[100:], *bodies("b", 5)]
        assert browse(sites.source, "orders") == expected
        assert drain(sites.mirror.url, "orders") == expected
        assert sorted(orphaned(sites.source.url)) == sorted(bodies("lost", 5))


@pytest.mark.slow
def test_a_forced_promotion_replayed_answers_the_same_and_seeds_once(tmp_path: Path) -> None:
    """The operator's forced promotion times out on its side and is sent again (once
    more after a restart of the promoted site): the same epoch, no second skip of ids, one
    seed, and the old source rebuilt with its lost messages orphaned once."""
    with Sites(tmp_path, reversible=True) as sites:
        publish(sites.source, "orders", bodies("a", 10))
        sites.caught_up()
        sites.mirror.stop()
        publish(sites.source, "orders", bodies("lost", 3))
        sites.source.kill()
        sites.mirror.start()
        first = sites.promote_mirror(force=True)
        assert sites.promote_mirror(force=True) == first
        sites.mirror.kill()
        sites.mirror.start()
        assert sites.promote_mirror(force=True) == first
        publish(sites.mirror, "orders", bodies("b", 2))
        sites.old_source_back()
        assert mirror_status(sites.source)["unmirrored"]["messages"] == 3
        assert sites.mirror.log_path.read_text().count("mirror: seed (") == 1
        assert drain(sites.source.url, "orders") == [*bodies("a", 10), *bodies("b", 2)]
        assert sorted(orphaned(sites.source.url)) == sorted(bodies("lost", 3))
