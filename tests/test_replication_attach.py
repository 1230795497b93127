"""A restarted passive attaches however long its snapshot takes to reach the active.

After the handshake the passive sends its snapshot (the IDs it holds) and the
active sends nothing, not even pings, until it has read it and planned the
catch-up over it. A passive that applied its link-silence rule (half the
replication timeout) to that wait gave up on a large snapshot over a slow link
(or on a loaded active) and retried with the same snapshot forever: the fault
matrix's compound class saw a passive stay unlinked for a minute
(docs/reliability.md).
"""

from __future__ import annotations

from pathlib import Path

import pika
import pytest
from jepsen import log_since, log_size, queue_counts

from twinmq.testing.pair import Pair, status
from twinmq.testing.waiting import wait_for

QUEUE = "held"
MESSAGES = 30_000  # a snapshot of ~330 KB: seconds through the thin pipe below
PIPE = 100_000  # bytes per second through the link's proxy


def publish_unconfirmed(url: str, n: int) -> None:
    """`n` small persistent messages into QUEUE (the pair replicates them)."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.queue_declare(QUEUE, durable=True)
        persistent = pika.BasicProperties(delivery_mode=2)
        for i in range(n):
            channel.basic_publish("", QUEUE, f"m{i}".encode(), persistent)
    finally:
        connection.close()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_passive_whose_snapshot_outlasts_the_link_silence_still_attaches(
    tmp_path: Path,
) -> None:
    with Pair(tmp_path, replication_timeout=1.0) as pair:  # link silence: 0.5 s
        active, passive = pair.active, pair.passive
        publish_unconfirmed(active.url, MESSAGES)
        wait_for(
            "every message on the passive",
            lambda: queue_counts(status(passive), QUEUE) == (MESSAGES, 0),
            60,
            interval=0.2,
        )
        passive.stop()
        pair.link.throttle(PIPE)
        active_mark, passive_mark = log_size(active), log_size(passive)
        passive.start()
        pair.wait_healthy(60)  # before the fix: never, a new link every 1.5 s
        assert queue_counts(status(passive), QUEUE) == (MESSAGES, 0)
        assert log_since(active, active_mark).count(") attached: catch-up") == 1
        assert "replication link to" not in log_since(passive, passive_mark)
