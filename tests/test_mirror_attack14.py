"""Attacks on the DR switchover and failover paths (issue 14; docs/mirror.md,
"Switchover, failover, fencing", "DR failover").

Two real sites (`Sites`, reversible), pika clients publishing with confirms. Each test
is an unlucky operator's sequence; each ends by accounting for every confirmed message:
on the active site, or in an orphan queue (counted), never lost silently, never
delivered twice, and a consumed one never back.
"""

from __future__ import annotations

from pathlib import Path

import pika
import pytest
from mirrorsites import Sites, channel, demote, mirror_status, promote, publish
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
        lost = wait_for("the loss counted", lambda: mirror_status(sites.source)["unmirrored"], 30)
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


@pytest.mark.slow
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
