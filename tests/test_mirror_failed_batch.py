"""A failure told to a client leaves none of its batch's mirror events anywhere either.

The source site is an HA pair mirroring to a DR site. A batch is streamed to the
passive before the active's write; when that write fails (the active's disk is
full) the active withdraws the batch from the passive before it tells its clients
(docs/replication.md, "A failed batch on the passive"). The batch also holds the
DR mirror's event of it (one more op of the same group commit, the replication
queue's: docs/mirror.md): withdrawn too, or the passive, promoted, sends the DR site
an enqueue for a message its publisher was told failed (a message invented there)
and a settle for an ack the failed commit undid (a message lost there while the
source still holds it).

Real brokers: the pair's on a tmpfs each (root only, `Pair(disk_bytes=...)`), only
the active's disk filled; the DR site a broker of its own; pika clients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest
from mirrorsites import ORIGIN, TOKEN, browse, mirror_status
from test_failed_batch_pair import (
    BIG,
    PERSISTENT,
    QUEUE,
    STORED,
    _failed_tx,
    _fill,
    _promote_after_kill,
    _stored,
    failing_with_the_passive_paused,
    started_on_small_disks,
)

from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.pair import Pair
from twinmq.testing.waiting import wait_for


@pytest.fixture
def dr_site(tmp_path: Path) -> Iterator[BrokerProcess]:
    """The DR site: a single broker taking the source pair's mirror link."""
    args = ["--mirror-port", str(free_port()), "--mirror-token", TOKEN]
    with BrokerProcess(tmp_path / "dr" / "data", name="dr-site", extra_args=args) as broker:
        yield broker


@pytest.fixture
def pair(tmp_path: Path, dr_site: BrokerProcess) -> Iterator[Pair]:
    """The source pair in sync, mirroring to `dr_site`: each broker on a 32 MiB tmpfs,
    no free-space alarm (the disk fills for real), a long replication timeout (the
    active never goes on alone here)."""
    port = dr_site.extra_args[dr_site.extra_args.index("--mirror-port") + 1]
    mirror = ["--mirror-to", f"127.0.0.1:{port}", "--mirror-token", TOKEN, "--mirror-id", ORIGIN]
    with started_on_small_disks(tmp_path / "pair", 20.0, mirror) as rig:
        yield rig


def _mirrored(source: BrokerProcess) -> None:
    """Wait until the DR site applied and acknowledged every event `source` holds."""

    def drained() -> bool:
        section = mirror_status(source)
        return section is not None and section["connected"] and section["queue_events"] == 0

    wait_for(f"the DR site caught up with {source.name}", drained, 60)


def _held(dr_site: BrokerProcess) -> list[bytes]:
    """The DR site's messages of `QUEUE`, sorted, each cut to 8 bytes (a failed batch's
    big message shows as its first bytes)."""
    return sorted(body[:8] for body in browse(dr_site, QUEUE))


def _nacked_and_failed_commit(pair: Pair) -> None:
    """`STORED` confirmed (and mirrored), then the active's disk filled: a confirm-mode
    publish nacked, a transaction (10 acks, a publish) whose commit fails."""
    conn, ch = _stored(pair)
    _mirrored(pair.active)
    _fill(pair)
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", QUEUE, b"N" * BIG, PERSISTENT)
    _failed_tx(conn)
    with contextlib.suppress(pika.exceptions.AMQPError):
        conn.close()


def test_a_promoted_passive_sends_the_dr_site_nothing_of_a_nacked_publish_or_failed_commit(
    pair: Pair, dr_site: BrokerProcess
) -> None:
    """Before, the promoted passive sent both failed batches' events: the DR site held
    the nacked message and the failed commit's, and lost the 10 messages it acked."""
    _nacked_and_failed_commit(pair)
    _promote_after_kill(pair)
    _mirrored(pair.active)
    assert _held(dr_site) == sorted(STORED)


def test_the_active_sends_the_dr_site_nothing_of_its_failed_batches(
    pair: Pair, dr_site: BrokerProcess
) -> None:
    """The active itself, its disk freed, sends the events of the batches after the
    failed ones and none of theirs."""
    _nacked_and_failed_commit(pair)
    (pair.active.data_dir / "filler").unlink()
    conn = pika.BlockingConnection(pika.URLParameters(pair.active.url))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.basic_publish("", QUEUE, b"after", PERSISTENT)
    conn.close()
    _mirrored(pair.active)
    assert _held(dr_site) == sorted([*STORED, b"after"])


def test_a_passive_that_caught_up_after_a_failed_commit_holds_none_of_its_events(
    pair: Pair, dr_site: BrokerProcess
) -> None:
    """The passive is paused when the transaction's write fails, then killed and started
    again: it catches up from the active (the path of a passive that takes no
    withdrawals, an older version) and, promoted, sends the DR site nothing of it."""
    conn, _ch = _stored(pair)
    conn.close()
    _mirrored(pair.active)
    commit = failing_with_the_passive_paused(pair)
    pair.passive.kill()
    pair.passive.start()
    assert commit.done.wait(30), "the failure was never told"
    assert commit.error is None, repr(commit.error)
    _promote_after_kill(pair)
    _mirrored(pair.active)
    assert _held(dr_site) == sorted(STORED)
