"""A replicated source pair mirroring to a DR broker: a failover of the source pair neither
loses nor repeats mirror events (the replication queue is journaled like any queue, so
the promoted passive holds the same events under the same sequence numbers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from jepsen import queue_counts
from mirrorsites import ORIGIN, TOKEN, channel, demote, mirror_status, publish

from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.pair import Pair, status
from twinmq.testing.queues import drain
from twinmq.testing.waiting import wait_for


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[BrokerProcess]:
    args = ["--mirror-port", str(free_port()), "--mirror-token", TOKEN]
    with BrokerProcess(tmp_path / "dr" / "data", name="dr-site", extra_args=args) as broker:
        yield broker


@pytest.fixture
def source_pair(tmp_path: Path, mirror: BrokerProcess) -> Iterator[Pair]:
    port = mirror.extra_args[mirror.extra_args.index("--mirror-port") + 1]
    args = ["--mirror-to", f"127.0.0.1:{port}", "--mirror-token", TOKEN, "--mirror-id", ORIGIN]
    with Pair(tmp_path / "pair", replication_timeout=2.0, broker_args=args) as pair:
        yield pair


def caught_up(pair: Pair) -> None:
    def drained() -> bool:
        section = mirror_status(pair.active)
        return section is not None and section["connected"] and section["queue_events"] == 0

    wait_for("mirror caught up with the source pair's active", drained, 60)


def bodies(prefix: str, n: int) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(n)]


@pytest.mark.slow
def test_a_source_failover_while_streaming_neither_loses_nor_repeats_on_the_mirror(
    source_pair: Pair, mirror: BrokerProcess
) -> None:
    publish(source_pair.active, "orders", bodies("before", 800))
    assert source_pair.failover()  # kill -9 at once: events in flight or unacknowledged
    publish(source_pair.active, "orders", bodies("after", 100))
    caught_up(source_pair)
    assert drain(mirror.url, "orders") == bodies("before", 800) + bodies("after", 100)


@pytest.mark.slow
def test_events_pending_while_the_mirror_is_away_survive_a_source_failover(
    source_pair: Pair, mirror: BrokerProcess
) -> None:
    publish(source_pair.active, "orders", bodies("sent", 200))
    caught_up(source_pair)
    mirror.stop()
    publish(source_pair.active, "orders", bodies("pending", 300))
    # The passive holds the pending events too: replicated like any durable queue.
    held = queue_counts(status(source_pair.passive), "amq.twinmq.mirror")
    assert held is not None and held[0] > 0
    assert source_pair.failover()
    mirror.start()
    caught_up(source_pair)
    assert drain(mirror.url, "orders") == bodies("sent", 200) + bodies("pending", 300)


@pytest.mark.slow
def test_a_demoted_source_pair_stays_demoted_after_its_failover(
    source_pair: Pair, mirror: BrokerProcess
) -> None:
    publish(source_pair.active, "orders", bodies("sent", 50))
    demoted = demote(source_pair.active)
    assert demoted.token is not None
    assert source_pair.failover()  # the passive holds the role record like any op
    connection, ch = channel(source_pair.active)
    ch.confirm_delivery()
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        ch.basic_publish("", "orders", b"after the failover", pika.BasicProperties(delivery_mode=2))
    assert refused.value.reply_code == 403 and "DR mirror (replica)" in refused.value.reply_text
    connection.close()
    section = mirror_status(source_pair.active)
    assert section is not None and section["role"] == "replica"
    assert section["epoch"] == demoted.token.epoch
