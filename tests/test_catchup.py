"""Catch-up as a stream, with real broker processes: any size, resumable, never stalling confirms.

Each test starts a pair (`jepsen.Pair`) whose catch-up chunks are small
(`--catchup-chunk-bytes`), so a backlog of a few hundred KiB is many chunks,
and slows the catch-up with the link's proxy (a thin pipe) or freezes it
mid-way (a partition): what happens during the catch-up is then driven by
events (chunks acknowledged, confirms received, the passive not ready), never
by timings.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest
from jepsen import log_since, log_size, queue_counts

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair, status
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for

CHUNK = 16 * 1024  # catch-up chunk bytes: ~15 messages of 1 KiB
PIPE = 64 * 1024  # bytes per second through the proxy: a catch-up of seconds
# A thin link: a chunk takes more than two replication timeouts to cross it (finding 8).
# (The proxy moves 8 KiB at a time: a third of a second apart, well inside the passive's
# allowed silence of half a timeout.)
THIN_TIMEOUT = 2.0
THIN_CHUNK = 128 * 1024
THIN_PIPE = 24 * 1024
THIN_BACKLOG = 260  # about two chunks and a bit: ten seconds of pipe
Q1, Q2 = "first", "second"


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    """A pair in sync, with small catch-up chunks."""
    started = Pair(tmp_path, replication_timeout=2.0)
    for broker in started.brokers.values():
        broker.env["TWINMQ_CATCHUP_CHUNK_BYTES"] = str(CHUNK)
    with started:
        yield started


@pytest.fixture
def thin_pair(tmp_path: Path) -> Iterator[Pair]:
    """A pair in sync whose catch-up chunks take longer than its timeout on a thin link."""
    started = Pair(tmp_path, replication_timeout=THIN_TIMEOUT)
    for broker in started.brokers.values():
        broker.env["TWINMQ_CATCHUP_CHUNK_BYTES"] = str(THIN_CHUNK)
    with started:
        yield started


def bodies(prefix: str, n: int) -> list[bytes]:
    """`n` distinct 1 KiB bodies."""
    return [f"{prefix}-{i:06d}-".encode().ljust(1024, b".") for i in range(n)]


def publish(broker: BrokerProcess, queue: str, sent: list[bytes], *, confirm: bool = True) -> None:
    """Publish persistent messages; with `confirm`, return once every one is confirmed."""
    connection = pika.BlockingConnection(pika.URLParameters(broker.url))
    try:
        channel = connection.channel()
        channel.queue_declare(queue, durable=True)
        if confirm:
            channel.confirm_delivery()
        for body in sent:
            channel.basic_publish("", queue, body, pika.BasicProperties(delivery_mode=2))
    finally:
        connection.close()


def take(broker: BrokerProcess, queue: str, n: int) -> list[bytes]:
    """basic.get and ack `n` messages from the head of `queue`."""
    connection = pika.BlockingConnection(pika.URLParameters(broker.url))
    got: list[bytes] = []
    try:
        channel = connection.channel()
        while len(got) < n:
            method, _, body = channel.basic_get(queue)
            assert method is not None, f"{queue} ran dry after {len(got)}"
            channel.basic_ack(method.delivery_tag)
            got.append(body)
    finally:
        connection.close()
    return got


def replication(broker: BrokerProcess) -> dict[str, Any]:
    """The `replication` section of the broker's status."""
    data = status(broker)
    assert data is not None, f"{broker.name} does not answer"
    section: dict[str, Any] = data["replication"]
    return section


def catchup(broker: BrokerProcess) -> dict[str, Any] | None:
    """The active's view of its passive's catch-up."""
    section: dict[str, Any] | None = replication(broker)["catchup"]
    return section


def messages(broker: BrokerProcess, queue: str) -> int | None:
    """Ready + unacked messages of `queue`."""
    counts = queue_counts(status(broker), queue)
    return None if counts is None else sum(counts)


def slow_catch_up(
    pair: Pair, backlog: dict[str, list[bytes]], *, chunks: int = 2, pipe: int = PIPE
) -> None:
    """Give the passive a backlog to catch up through a pipe of `pipe` bytes a second;
    return once `chunks` chunks are on its disk and the catch-up is still under way."""
    active, passive = pair.active, pair.passive
    passive.kill()
    for queue, sent in backlog.items():
        publish(active, queue, sent)  # confirmed by the active alone, after the timeout
    pair.link.throttle(pipe)
    passive.start()

    def under_way() -> bool:
        state = catchup(active)
        return state is not None and state["in_progress"] and state["acked_chunks"] >= chunks

    wait_for(f"{chunks} catch-up chunks on the passive's disk", under_way, 20, interval=0.02)


def test_a_catch_up_of_many_chunks_completes_and_a_failover_loses_nothing(pair: Pair) -> None:
    backlog = bodies("backlog", 300)
    pair.passive.kill()
    publish(pair.active, Q1, backlog)
    pair.passive.start()
    pair.wait_healthy(20)
    state = catchup(pair.active)
    assert state is not None and not state["in_progress"]
    assert state["sent"] == 300 and state["chunks"] > 10  # many chunks, not one frame
    assert messages(pair.passive, Q1) == 300
    pair.active.kill()
    pair.promote_passive()
    assert drain(pair.active.url, Q1) == backlog


def test_a_catch_up_cut_by_kill_9_resumes_without_resending_what_the_passive_had(
    pair: Pair,
) -> None:
    backlog = bodies("backlog", 400)
    slow_catch_up(pair, {Q1: backlog})
    pair.link.partition()  # freeze it: no chunk or acknowledgement moves any more
    first = catchup(pair.active)
    assert first is not None and first["in_progress"]
    durable = first["acked_messages"]  # on the passive's disk: acknowledged
    assert 0 < durable < 400, first
    pair.passive.kill()
    pair.link.heal()
    pair.passive.start()
    pair.wait_healthy(20)
    second = catchup(pair.active)
    assert second is not None and not second["in_progress"]
    # The second catch-up resumed: what the first made durable was kept, not sent again.
    assert second["kept"] >= durable, (first, second)
    assert second["kept"] + second["sent"] == 400 and second["sent"] < 400, second
    assert messages(pair.passive, Q1) == 400
    pair.active.kill()
    pair.promote_passive()
    assert drain(pair.active.url, Q1) == backlog


def test_confirms_flow_and_live_traffic_lands_right_during_a_catch_up(pair: Pair) -> None:
    backlog = {Q1: bodies("one", 200), Q2: bodies("two", 200)}
    slow_catch_up(pair, backlog)
    pair.link.partition()  # the catch-up cannot end until healed
    active, passive = pair.active, pair.passive
    live = {Q1: bodies("live-one", 20), Q2: bodies("live-two", 20)}
    for queue, sent in live.items():
        publish(active, queue, sent)  # returns once all are confirmed
    # ... and they were confirmed before the catch-up ended.
    state = catchup(active)
    assert state is None or state["in_progress"], state  # None: dropped as stalled, unfinished
    assert not replication(passive)["ready"]
    # Settled meanwhile: Q1's head went out in chunks already, Q2 is not planned yet.
    taken = {Q1: take(active, Q1, 40), Q2: take(active, Q2, 40)}
    assert taken == {Q1: backlog[Q1][:40], Q2: backlog[Q2][:40]}
    pair.link.heal()
    pair.wait_healthy(20)
    expected = {q: backlog[q][40:] + live[q] for q in (Q1, Q2)}
    assert {q: messages(passive, q) for q in (Q1, Q2)} == {q: 180 for q in (Q1, Q2)}
    # Its journal holds live messages before older ones sent in chunks: a restart
    # recovers publish order all the same.
    passive.kill()
    passive.start()
    pair.wait_healthy(20)
    pair.active.kill()
    pair.promote_passive()
    assert {q: drain(pair.active.url, q) for q in (Q1, Q2)} == expected


def test_a_passive_reconnecting_during_its_catch_up_never_holds_up_confirms(pair: Pair) -> None:
    active, passive = pair.active, pair.passive
    # The in-sync passive's link is lost: the active holds confirms for the timeout at
    # most, then goes on alone, although the passive is back and catching up.
    pair.link.cut()
    publish(active, Q1, bodies("backlog", 300), confirm=False)
    pair.link.heal()
    pair.link.throttle(PIPE)  # (heal opens the pipe wide: thin it again)
    wait_for("catch-up", lambda: (s := catchup(active)) is not None and s["acked_chunks"] >= 1, 20)
    publish(active, Q1, bodies("live", 10))
    assert not replication(passive)["ready"], "confirms waited for the catch-up to end"
    # A reconnect loop during the catch-up (cut, back, cut, back) extends nothing.
    for round_ in range(2):
        pair.link.cut()
        pair.link.heal()
        pair.link.throttle(PIPE)
        wait_for(
            f"catch-up resumed ({round_})",
            lambda: (s := catchup(active)) is not None and s["in_progress"] and s["kept"] > 0,
            20,
        )
        publish(active, Q1, bodies(f"live{round_}", 10))
        assert not replication(passive)["ready"], "confirms waited for the catch-up to end"
    pair.wait_healthy(30)
    assert messages(passive, Q1) == messages(active, Q1) == 330


@pytest.mark.slow
def test_a_catch_up_through_a_link_thinner_than_a_chunk_per_timeout_needs_no_reconnect(
    thin_pair: Pair,
) -> None:
    pair = thin_pair
    backlog = bodies("backlog", THIN_BACKLOG)
    offset = log_size(pair.active)
    slow_catch_up(pair, {Q1: backlog}, chunks=1, pipe=THIN_PIPE)
    connections = pair.link.accepted
    pair.wait_healthy(60)
    state = catchup(pair.active)
    assert state is not None and not state["in_progress"] and state["sent"] == THIN_BACKLOG, state
    # The fault hit: a chunk is more than the pipe carries in a timeout.
    assert state["bytes"] / state["chunks"] > THIN_PIPE * THIN_TIMEOUT, state
    # One link carried it all: the passive was never dropped as stalled.
    assert pair.link.accepted == connections
    assert "stalled" not in log_since(pair.active, offset)
    assert messages(pair.passive, Q1) == THIN_BACKLOG


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigstop", "partition"])
def test_a_passive_that_stops_during_a_thin_catch_up_is_still_dropped_and_resumes_after(
    thin_pair: Pair, fault: str
) -> None:
    pair = thin_pair
    active, passive = pair.active, pair.passive
    backlog = bodies("backlog", THIN_BACKLOG)
    slow_catch_up(pair, {Q1: backlog}, chunks=1, pipe=THIN_PIPE)
    offset = log_size(active)
    if fault == "sigstop":
        passive.signal(signal.SIGSTOP)
    else:
        pair.link.partition()  # the link moves nothing either way
    try:
        wait_for(
            "the stopped passive dropped", lambda: not replication(active)["link_connected"], 30
        )
        assert "stalled" in log_since(active, offset)
    finally:
        if fault == "sigstop":
            passive.signal(signal.SIGCONT)
    pair.link.heal()
    pair.wait_healthy(30)
    state = catchup(active)
    assert state is not None and state["kept"] > 0, state  # resumed, not started over
    assert messages(passive, Q1) == THIN_BACKLOG
