"""What a failed batch changed in the DR mirror source's own state is undone with it.

The source site is an HA pair mirroring to a DR site. Besides its events, a batch can
carry the source's changes to its replication queue: a re-seed drops the backlog and
queues a seed in one group commit (`MirrorSource.reseed`). When the active's journal
refuses that batch (a full disk) the seed is withdrawn with it
(tests/test_mirror_failed_batch.py); the drop must be too, here and on the passive
that applied it, or the backlog is gone with no seed to replace it: the DR site,
resuming from its mark, never gets the backlog's changes (docs/mirror.md, "A failed
batch and the source's own state").

In the bidirectional mode a batch also carries the id map's changes (`bidi.py`): a
failed commit's acks are undone, so the map records they dropped must come back too,
or the messages' next settles name them as this site's own and the peer keeps them.

Real brokers: the pair's on a tmpfs each (root only, `Pair(disk_bytes=...)`), only
the active's disk filled; the other site a broker of its own (the DR site stopped
while the backlog builds: its link down, nothing of it sent); pika clients. The id
map's case also sans-I/O (the real source, map, applier and journals).
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest
import test_mirror_failed_batch as mirrored_pair
from mirrorsites import TOKEN, all_linked, depth, publish
from test_failed_batch_pair import (
    BIG,
    PERSISTENT,
    QUEUE,
    STORED,
    _failed_tx,
    _failure_logged,
    _fill,
    _promote_after_kill,
    _stored,
)

from twinmq.broker.admin_client import MirrorRefused, mirror_reseed_call
from twinmq.broker.definitions import QueueDef
from twinmq.broker.journal import JournalOp, Settle, StoredMessage
from twinmq.broker.mirror.applier import MirrorApplier
from twinmq.broker.mirror.bidi import BidiMeta, IdMap, TopologyDelta, encode_bidi
from twinmq.broker.mirror.events import record_header
from twinmq.broker.mirror.source import MirrorSource
from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.pair import NoSmallDisk, Pair
from twinmq.testing.sansio import Harness
from twinmq.testing.waiting import wait_for

# The source pair mirroring to a DR site (its fixtures, shared).
dr_site = mirrored_pair.dr_site
pair = mirrored_pair.pair
_held = mirrored_pair._held
_mirrored = mirrored_pair._mirrored
LATE = [f"late{i}".encode() for i in range(5)]


def _failed_reseed(pair: Pair, dr: BrokerProcess) -> None:
    """`STORED` and a big message mirrored; the DR site stopped (its link down);
    `LATE` published (its events the backlog); the active's disk filled; a re-seed,
    whose seed of the big message the journal refuses."""
    conn, ch = _stored(pair)
    ch.basic_publish("", QUEUE, b"B" * BIG, PERSISTENT)
    _mirrored(pair.active)
    dr.stop()
    for body in LATE:
        ch.basic_publish("", QUEUE, body, PERSISTENT)
    conn.close()
    _fill(pair)
    with pytest.raises(MirrorRefused, match="refused the seed"):
        pair.active.admin.send(mirror_reseed_call(), 30)


def _expected() -> list[bytes]:
    return sorted([*STORED, b"B" * 8, *LATE])


def test_a_promoted_passive_sends_the_dr_site_the_backlog_of_a_failed_reseed(
    pair: Pair,
    dr_site: BrokerProcess,
) -> None:
    """Before, the passive had applied the failed re-seed's drop of the backlog (its
    seed withdrawn): promoted after `kill -9` of the active, it resumed the DR site
    from its mark, which never got the `LATE` messages."""
    _failed_reseed(pair, dr_site)
    _promote_after_kill(pair)
    dr_site.start()
    _mirrored(pair.active)
    assert _held(dr_site) == _expected()


def test_the_active_sends_the_dr_site_the_backlog_of_a_failed_reseed(
    pair: Pair,
    dr_site: BrokerProcess,
) -> None:
    """The active itself, its disk freed, still holds the backlog and sends it."""
    _failed_reseed(pair, dr_site)
    (pair.active.data_dir / "filler").unlink()
    dr_site.start()
    _mirrored(pair.active)
    assert _held(dr_site) == _expected()


def test_a_wiped_dr_site_whose_seed_the_journal_refuses_is_seeded_once_it_can_be(
    pair: Pair,
    dr_site: BrokerProcess,
) -> None:
    """The DR site comes back wiped (its mark 0) while the active's disk is full: the
    link's gap asks for a seed, which the journal refuses. Before, the link streamed on
    from mark 0 without it (the mirror held nothing of what was trimmed, and counted
    itself caught up); now the session ends and the next one seeds again."""
    conn, ch = _stored(pair)
    ch.basic_publish("", QUEUE, b"B" * BIG, PERSISTENT)
    conn.close()
    _mirrored(pair.active)
    dr_site.stop()
    shutil.rmtree(dr_site.data_dir)
    _fill(pair)
    dr_site.start()
    _failure_logged(pair)
    (pair.active.data_dir / "filler").unlink()
    _mirrored(pair.active)
    assert _held(dr_site) == sorted([*STORED, b"B" * 8])


# -- the bidirectional mode's id map (sans-I/O: the real source, map, applier, journal) ----


def _peer_event(oseq: int, ops: list[JournalOp], topology: TopologyDelta | None = None) -> bytes:
    meta = BidiMeta(
        origin="site-a", oseq=oseq, hops=["site-a"], keys=[("q", "site-a")], topology=topology
    )
    return encode_bidi(meta, ops, 0.0)


def test_a_failed_batch_that_acked_a_peers_message_keeps_its_id_map_record(
    tmp_path: Path,
) -> None:
    """Site B holds site A's message 500 (mapped to B's id). A transaction acks it on
    B and its batch fails: the ack is undone (the message is back), and so must be the
    drop of its id map record, in memory and on the passive that applied the batch.
    Before, the record stayed dropped: B's next settle of the message named it as B's
    own, which A does not hold (A's copy kept forever)."""
    site = Harness(tmp_path / "b")
    ids = IdMap(site.vhost, "site-b")
    applier = MirrorApplier(site.vhost, site.committer, site.clock.time, ids=ids)
    declare = TopologyDelta(declare_queues=[QueueDef(name="q", qid=77)])
    body = b"from-a"
    sent = StoredMessage(500, 0, "", "q", record_header(len(body)), body, None)
    applier.apply("site-a", [(1, _peer_event(1, [], declare)), (2, _peer_event(2, [sent]))])
    site.commit()
    local = ids.local("site-a", 500)
    assert local is not None
    source = MirrorSource(site.vhost, site.committer, site.clock.time)
    source.ids, source.name = ids, "site-b"
    source.activate()
    site.commit()
    qid = site.vhost.queues["q"].definition.qid
    # The pair's passive, in sync: what the site journaled so far, then what it streams.
    shutil.copytree(tmp_path / "b" / "journal", tmp_path / "passive" / "journal")
    passive = Harness(tmp_path / "passive")

    failed = 10**6  # the tap keys its changes by batch number only
    streamed = source.batch_closing(failed, [Settle(qid, local)], memoryview(b""))
    assert ids.origin_of(local) == (ids.name, local)  # the record dropped with the ack
    passive.vhost.apply_ops(streamed)
    withdrawal = source.batch_failed(failed)
    passive.vhost.apply_ops(withdrawal, catchup=True)

    assert ids.origin_of(local) == ("site-a", 500)
    assert IdMap(passive.vhost, "site-b").origin_of(local) == ("site-a", 500)
    site.close()
    passive.close()


@pytest.fixture
def bidi_pair(tmp_path: Path) -> Iterator[tuple[BrokerProcess, Pair]]:
    """Site A, a single broker, and site B, an HA pair on a 32 MiB tmpfs each (its
    active's disk filled for real), mirroring to each other (`--mirror-role
    bidirectional`); A's link goes to B's first active, `b1`."""
    port_a, ports = free_port(), {"b1": free_port(), "b2": free_port()}
    args = ["--mirror-token", TOKEN, "--mirror-role", "bidirectional"]
    site_a = BrokerProcess(
        tmp_path / "site-a" / "data", name="site-a",
        extra_args=["--mirror-port", str(port_a), "--mirror-to", f"127.0.0.1:{ports['b1']}",
                    "--mirror-id", "site-a", *args],
    )  # fmt: skip
    rig = Pair(
        tmp_path / "site-b", replication_timeout=20.0, disk_bytes=32 * 1024 * 1024,
        names=("b1", "b2"), link=False,
        broker_args=["--disk-free-limit", "0", "--segment-bytes", str(4 * BIG)],
    )  # fmt: skip
    for name, broker in rig.brokers.items():
        # One mirror port per broker (both on this host): the site's settings in each
        # broker's environment, not in shared flags.
        broker.env.update({
            "TWINMQ_MIRROR_PORT": str(ports[name]), "TWINMQ_MIRROR_TOKEN": TOKEN,
            "TWINMQ_MIRROR_TO": f"127.0.0.1:{port_a}", "TWINMQ_MIRROR_ID": "site-b",
            "TWINMQ_MIRROR_ROLE": "bidirectional",
        })  # fmt: skip
    site_a.start()
    try:
        try:
            rig.start()
        except NoSmallDisk as exc:
            pytest.skip(str(exc))
        try:
            all_linked([site_a, rig.active])
            yield site_a, rig
        finally:
            rig.stop()
    finally:
        site_a.stop()


def _both_at(site_a: BrokerProcess, pair: Pair, n: int, timeout: float = 60) -> None:
    def done() -> bool:
        return depth(site_a, QUEUE) == n and depth(pair.active, QUEUE) == n

    wait_for(f"{QUEUE} at {n} on both sites", done, timeout)


def _peers_commit_failed(site_a: BrokerProcess, pair: Pair) -> None:
    """A's 20 messages mirrored to B; on B's active (its disk full) a transaction acks 10
    of them and publishes a big one: its commit fails."""
    publish(site_a, QUEUE, STORED)
    _both_at(site_a, pair, 20)
    _fill(pair)
    conn = pika.BlockingConnection(pika.URLParameters(pair.active.url))
    _failed_tx(conn)
    with contextlib.suppress(pika.exceptions.AMQPError):
        conn.close()


def _ack(broker: BrokerProcess, n: int) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(broker.url))
    ch = conn.channel()
    for _ in range(n):
        method, _props, _body = ch.basic_get(QUEUE)
        assert method is not None
        ch.basic_ack(method.delivery_tag)
    conn.close()


def test_a_peers_messages_acked_after_a_failed_commit_leave_the_peer_too(
    bidi_pair: tuple[BrokerProcess, Pair],
) -> None:
    """B's disk freed, the 10 messages (back on B) are acked again: A loses them too.
    Before, the failed batch had dropped their id map records on B for good: B's
    settles named them as B's own messages, and A kept all 20."""
    site_a, pair = bidi_pair
    _peers_commit_failed(site_a, pair)
    (pair.active.data_dir / "filler").unlink()
    _both_at(site_a, pair, 20, 30)
    _ack(pair.active, 10)
    _both_at(site_a, pair, 10)


def test_a_promoted_passive_settles_on_the_peer_what_it_acks_after_a_failed_commit(
    bidi_pair: tuple[BrokerProcess, Pair],
) -> None:
    """B's passive, promoted after `kill -9` of B's active, acks the 10 messages: A
    loses them too. Before, the passive kept the failed batch's drop of their id map
    records (the withdrawal put the messages back, not the records)."""
    site_a, pair = bidi_pair
    _peers_commit_failed(site_a, pair)
    _promote_after_kill(pair)
    _ack(pair.active, 10)
    _both_at(site_a, pair, 10)
