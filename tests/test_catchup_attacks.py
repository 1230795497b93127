"""An attack round on catch-up (issue 11, docs/reliability.md findings 11-): what a client
or an operator does to the active while its passive catches up, with real brokers.

Each test starts a catch-up of many small chunks through a thin link and freezes it
mid-way (a partition, `test_catchup.slow_catch_up`), changes the active meanwhile (a
purge, a queue deleted and declared again, messages expiring into a dead-letter queue,
message ids the window must remember), lets the catch-up finish, and then fails over:
the promoted passive must hold exactly what the active held (nothing confirmed lost,
nothing settled come back, no re-send of a remembered id enqueued twice).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from test_catchup import (
    CHUNK,
    PIPE,
    Q1,
    Q2,
    bodies,
    catchup,
    messages,
    publish,
    slow_catch_up,
    take,
)

from twinmq.testing.pair import Pair
from twinmq.testing.queues import drain, opted_in
from twinmq.testing.waiting import wait_for

DEAD, TTL = "dead", "expiring"


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    """A pair in sync whose catch-ups are many chunks (test_catchup's, whose module is
    not imported for it: its tests would run twice)."""
    started = Pair(tmp_path, replication_timeout=2.0)
    for broker in started.brokers.values():
        broker.env["TWINMQ_CATCHUP_CHUNK_BYTES"] = str(CHUNK)
    with started:
        yield started


def _chunks_acked(pair: Pair) -> int:
    """Catch-up chunks the passive has acknowledged, while a catch-up is under way (else 0)."""
    state = catchup(pair.active)
    return state["acked_chunks"] if state is not None and state["in_progress"] else 0


def _failover(pair: Pair) -> None:
    """kill -9 the active and promote the (ready) passive."""
    pair.active.kill()
    pair.promote_passive()


@pytest.mark.parametrize("change", ["purge", "delete-and-declare-again"])
def test_a_queue_purged_or_replaced_during_a_catch_up_holds_only_what_came_after(
    pair: Pair, change: str
) -> None:
    """Purged, or deleted and declared again (a new incarnation), on the active while the
    catch-up is frozen with Q1 partly streamed and Q2 not planned yet: nothing of before
    may come back on the promoted passive."""
    slow_catch_up(pair, {Q1: bodies("one", 300), Q2: bodies("two", 200)})
    pair.link.partition()
    active = pair.active
    connection = pika.BlockingConnection(pika.URLParameters(active.url))
    channel = connection.channel()
    for queue in (Q1, Q2):
        if change == "purge":
            channel.queue_purge(queue)
        else:
            channel.queue_delete(queue)
    connection.close()
    live = {Q1: bodies("after-one", 10), Q2: bodies("after-two", 10)}
    for queue, sent in live.items():
        publish(active, queue, sent)  # (declares a deleted queue again)
    pair.link.heal()
    pair.wait_healthy(30)
    assert {q: messages(pair.passive, q) for q in (Q1, Q2)} == {Q1: 10, Q2: 10}
    _failover(pair)
    assert {q: drain(pair.active.url, q) for q in (Q1, Q2)} == live


def test_messages_expiring_into_a_dead_letter_queue_during_a_catch_up_arrive_there_once(
    pair: Pair,
) -> None:
    active, passive = pair.active, pair.passive
    passive.kill()
    connection = pika.BlockingConnection(pika.URLParameters(active.url))
    channel = connection.channel()
    channel.queue_declare(DEAD, durable=True)
    dead_letter = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": DEAD}
    # 20 s: long enough to outlast the catch-up's start on a loaded machine (at 8 s one
    # expired first there), short enough to expire while the catch-up is frozen.
    channel.queue_declare(TTL, durable=True, arguments={"x-message-ttl": 20000, **dead_letter})
    channel.confirm_delivery()
    expiring = bodies("expiring", 200)
    for body in expiring:
        channel.basic_publish("", TTL, body, pika.BasicProperties(delivery_mode=2))
    connection.close()
    publish(active, Q1, bodies("one", 300))
    pair.link.throttle(PIPE)
    passive.start()
    wait_for("two catch-up chunks on the passive's disk", lambda: _chunks_acked(pair) >= 2, 20)
    pair.link.partition()
    assert messages(active, TTL) == 200, "they expired before the catch-up: nothing proven"
    # They expire on the active while the catch-up is frozen (a passive runs no timers).
    wait_for("every message dead-lettered", lambda: messages(active, DEAD) == 200, 60)
    pair.link.heal()
    pair.wait_healthy(30)
    assert {q: messages(passive, q) for q in (TTL, DEAD)} == {TTL: 0, DEAD: 200}
    _failover(pair)
    assert drain(pair.active.url, TTL) == []
    assert drain(pair.active.url, DEAD) == expiring


def _publish_with_ids(pair: Pair, queue: str, sent: list[bytes], prefix: str) -> None:
    """Publish with message ids `prefix-i`, opted in to duplicate detection, confirmed."""
    connection = opted_in(pair.active)
    channel = connection.channel()
    channel.queue_declare(queue, durable=True)
    channel.confirm_delivery()
    for i, body in enumerate(sent):
        props = pika.BasicProperties(delivery_mode=2, message_id=f"{prefix}-{i}")
        channel.basic_publish("", queue, body, props)
    connection.close()


def _interrupted_catch_up(pair: Pair) -> None:
    """Restart the (killed) passive over a thin link, kill it once two chunks are on its
    disk, restart it and wait until the pair is in sync again."""
    passive = pair.passive
    pair.link.throttle(PIPE)
    passive.start()
    wait_for("two catch-up chunks on the passive's disk", lambda: _chunks_acked(pair) >= 2, 20)
    pair.link.partition()
    passive.kill()  # interrupted: what it acknowledged is durable, the rest comes next time
    pair.link.heal()
    passive.start()
    pair.wait_healthy(30)


def test_resends_after_an_interrupted_catch_up_and_a_failover_are_not_enqueued_twice(
    pair: Pair,
) -> None:
    pair.passive.kill()
    sent = bodies("dedup", 300)
    _publish_with_ids(pair, Q1, sent, "m")
    _interrupted_catch_up(pair)
    _failover(pair)
    # The publisher never heard its confirms (as after a failover) and sends all again.
    _publish_with_ids(pair, Q1, sent, "m")
    _publish_with_ids(pair, Q1, [b"new"], "new")
    assert drain(pair.active.url, Q1) == [*sent, b"new"]


def test_a_resend_of_a_message_consumed_while_the_passive_was_away_is_not_enqueued_again(
    pair: Pair,
) -> None:
    pair.passive.kill()
    consumed = bodies("consumed", 20)
    _publish_with_ids(pair, Q2, consumed, "c")
    # Consumed on the active while the passive is away: the active's window keeps their
    # ids (a re-send there is dropped); the passive never gets the messages.
    assert take(pair.active, Q2, 20) == consumed
    _publish_with_ids(pair, Q1, bodies("dedup", 300), "m")  # a catch-up of many chunks
    _interrupted_catch_up(pair)
    _failover(pair)
    _publish_with_ids(pair, Q2, consumed, "c")
    assert drain(pair.active.url, Q2) == [], "a re-send of a consumed message was enqueued again"


def test_the_window_reaches_a_passive_whose_catch_up_was_cut_while_it_carried_the_window(
    pair: Pair,
) -> None:
    """Cut (partition, kill -9) once the active has sent some of its window and the passive
    has acknowledged a chunk, with the rest still under way: the restarted passive's next
    catch-up carries the window again, whole. Nothing else is to be caught up here (the
    queue is empty on both), so every chunk is one of keys."""
    active, passive = pair.active, pair.passive
    passive.kill()
    consumed = bodies("consumed", 3000)
    # Ids of 200 bytes: 3,000 keys are about 40 chunks, seconds through the pipe (a pipe
    # thinner than a chunk per replication timeout would be a stall, finding 8).
    prefix = "w" * 200
    _publish_with_ids(pair, Q2, consumed, prefix)
    assert len(drain(active.url, Q2)) == 3000
    pair.link.throttle(PIPE)
    passive.start()

    def carrying() -> bool:
        state = catchup(active)
        return (
            state is not None and state["in_progress"] and state["dedup_keys"] > 0
            and state["acked_chunks"] >= 1
        )  # fmt: skip

    wait_for("a chunk of the window on the passive's disk", carrying, 20, interval=0.02)
    pair.link.partition()
    state = catchup(active)
    assert state is not None and state["in_progress"], "the window went whole: nothing proven"
    passive.kill()
    pair.link.heal()
    passive.start()
    pair.wait_healthy(30)
    state = catchup(active)
    assert state is not None and state["dedup_keys"] >= 3000
    _failover(pair)
    _publish_with_ids(pair, Q2, consumed, prefix)
    _publish_with_ids(pair, Q2, [b"new"], "new")
    assert drain(pair.active.url, Q2) == [b"new"]


def test_a_message_a_catch_up_discards_keeps_its_key_while_the_active_remembers_it(
    pair: Pair,
) -> None:
    """The passive held them (in sync), they were consumed while it was away: its catch-up
    discards them, which forgets their keys (a key without its message could swallow a
    re-send of a message nobody has), and the window that follows brings the keys back, as
    the active still remembers them. Promoted, it drops their re-sends as the active would."""
    sent = bodies("discarded", 20)
    _publish_with_ids(pair, Q2, sent, "d")
    wait_for("the passive holds them", lambda: messages(pair.passive, Q2) == 20, 20)
    pair.passive.kill()
    assert take(pair.active, Q2, 20) == sent
    pair.passive.start()
    pair.wait_healthy(30)
    state = catchup(pair.active)
    assert state is not None and state["discarded"] == 20, state
    _failover(pair)
    _publish_with_ids(pair, Q2, sent, "d")
    _publish_with_ids(pair, Q2, [b"new"], "new")
    assert drain(pair.active.url, Q2) == [b"new"]
