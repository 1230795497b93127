"""A drop past the retention bound and its NeedsResync are one unit, on the pair's passive too.

The source site is an HA pair mirroring to a DR site that is down, so the replication
queue's backlog grows; past `--mirror-retention-events` the active drops it and goes to
NeedsResync (docs/mirror.md, "A failed batch and the source's own state"). The drop and
the role record that keeps NeedsResync are ops of one batch (one group commit, streamed
to the passive as one frame). Before, the record came one batch later: a `kill -9` of
the active between the two left the passive, promoted, with the backlog dropped but
without NeedsResync; it resumed the DR site from its mark and the dropped events never
reached it (silent loss at the DR site). A promoted passive also took NeedsResync from
its memory (as it started), not from the record it holds.

Deterministic: the pair replicates through a link proxy that passes the passive every
frame up to the first batch that drops the backlog, and nothing after (`hold_after`);
the active is killed once the passive holds that batch (its publish confirmed).

Real brokers on loopback (the pair, the DR site), pika clients; the failed batch's undo
also sans-I/O (the real source, role store and journals).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pika
import pytest
from mirrorsites import ORIGIN, TOKEN, browse, mirror_status
from test_failed_batch_pair import InThread, _promote_after_kill

from twinmq.broker.admin_client import mirror_reseed_call
from twinmq.broker.journal import Settle, StoredMessage
from twinmq.broker.journal.ops import decode_ops
from twinmq.broker.mirror.events import INTERNAL_QID_BASE
from twinmq.broker.mirror.source import QUEUE_QID
from twinmq.broker.replication.protocol import FrameType, decode_batch
from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.pair import Pair
from twinmq.testing.waiting import wait_for

QUEUE = "rd.q"
RETENTION = 8
PERSISTENT = pika.BasicProperties(delivery_mode=2)
STORED = [f"s{i}".encode() for i in range(5)]
LATE = [f"late{i}".encode() for i in range(RETENTION + 10)]


@pytest.fixture
def dr_site(tmp_path: Path) -> Iterator[BrokerProcess]:
    """The DR site: a single broker taking the source pair's mirror link."""
    args = ["--mirror-port", str(free_port()), "--mirror-token", TOKEN]
    with BrokerProcess(tmp_path / "dr" / "data", name="dr-site", extra_args=args) as broker:
        yield broker


@pytest.fixture
def pair(tmp_path: Path, dr_site: BrokerProcess) -> Iterator[Pair]:
    """The source pair in sync through its link proxy, mirroring to `dr_site` with a small
    retention bound; a long replication timeout (the active never goes on alone here)."""
    port = dr_site.extra_args[dr_site.extra_args.index("--mirror-port") + 1]
    mirror = [
        "--mirror-to", f"127.0.0.1:{port}", "--mirror-token", TOKEN, "--mirror-id", ORIGIN,
        "--mirror-retention-events", str(RETENTION),
    ]  # fmt: skip
    with Pair(tmp_path / "pair", replication_timeout=20.0, broker_args=mirror) as rig:
        yield rig


def _mirrored(source: BrokerProcess) -> None:
    """Wait until the DR site applied and acknowledged every event `source` holds."""

    def drained() -> bool:
        section = mirror_status(source)
        return section is not None and section["connected"] and section["queue_events"] == 0

    wait_for(f"the DR site caught up with {source.name}", drained, 60)


class DropBatch:
    """A predicate on the replication link's frames: the first live batch that settles more
    than `RETENTION` events of the replication queue (the drop: the DR site is down, so no
    acknowledgement trims any); keeps the bodies that batch publishes."""

    def __init__(self) -> None:
        self.published: list[bytes] = []

    def __call__(self, frame: bytes) -> bool:
        if frame[0] != FrameType.BATCH:
            return False
        _batch, flags, body = decode_batch(frame[1:])
        if flags:
            return False  # a catch-up chunk
        ops = decode_ops(body)
        dropped = [op for op in ops if type(op) is Settle and op.qid == QUEUE_QID]
        if len(dropped) <= RETENTION:
            return False
        self.published = [
            op.body for op in ops if type(op) is StoredMessage and op.qid < INTERNAL_QID_BASE
        ]
        return True


def _publish_one_by_one(url: str, confirmed: list[bytes]) -> None:
    """`LATE`, each confirmed before the next is published (`confirmed` as they are); blocks
    on the first publish the passive never gets, until the active dies."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.confirm_delivery()
    for body in LATE:
        ch.basic_publish("", QUEUE, body, PERSISTENT)
        confirmed.append(body)


def test_a_passive_promoted_right_after_a_retention_drop_needs_a_resync_and_loses_nothing(
    pair: Pair, dr_site: BrokerProcess
) -> None:
    """Killed right after the drop's batch, the promoted passive holds the drop and
    NeedsResync: it refuses to resume the DR site; a re-seed then gives the DR site every
    message the source holds (every confirmed one among them), none twice."""
    conn = pika.BlockingConnection(pika.URLParameters(pair.active.url))
    ch = conn.channel()
    ch.queue_declare(QUEUE, durable=True)
    ch.confirm_delivery()
    for body in STORED:
        ch.basic_publish("", QUEUE, body, PERSISTENT)
    conn.close()
    _mirrored(pair.active)
    dr_site.stop()  # the backlog grows from here on

    drop = DropBatch()
    pair.link.hold_after(drop)  # the passive reconnects, gated from its first frame
    pair.wait_healthy()
    confirmed: list[bytes] = []
    publisher = InThread(lambda: _publish_one_by_one(pair.active.url, confirmed))
    wait_for("the drop's batch passed to the passive", pair.link.held.is_set, 30)
    assert drop.published, "the drop's batch publishes the message that passed the bound"
    # Its publish confirmed: the passive has the drop's batch on its disk.
    wait_for("the drop's batch confirmed", lambda: set(drop.published) <= set(confirmed), 30)
    assert mirror_status(pair.active)["state"] == "needs-resync"

    _promote_after_kill(pair)
    wait_for("the publisher told of the dead active", publisher.done.is_set, 30)
    section = mirror_status(pair.active)
    assert section is not None
    assert section["state"] == "needs-resync", section
    assert section["needs_resync"] is not None and "retention bound" in section["needs_resync"]

    dr_site.start()
    # No link (NeedsResync): the DR site holds what it had; the source still refuses it.
    assert sorted(browse(dr_site, QUEUE)) == sorted(STORED)
    section = mirror_status(pair.active)
    assert section is not None and section["state"] == "needs-resync"
    assert not section["connected"]

    pair.active.admin.send(mirror_reseed_call(), 30)
    _mirrored(pair.active)
    held = browse(dr_site, QUEUE)
    duplicates = len(held) - len(set(held))
    assert duplicates == 0, f"{duplicates} messages twice at the DR site"
    source = browse(pair.active, QUEUE)
    assert sorted(held) == sorted(source)  # nothing lost at the DR site
    assert set(STORED) | set(confirmed) <= set(held)  # every confirmed message
