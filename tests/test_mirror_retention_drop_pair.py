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

import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pika
import pika.exceptions
import pytest
from mirrorsites import ORIGIN, TOKEN, all_linked, browse, mirror_status
from test_failed_batch_pair import (
    BIG,
    InThread,
    _fill,
    _promote_after_kill,
    _stored,
    started_on_small_disks,
)
from test_failed_batch_pair import QUEUE as FB_QUEUE
from test_failed_batch_pair import STORED as STORED_FB
from test_mirror_failed_batch import _mirrored

from twinmq.broker.admin_client import mirror_reseed_call
from twinmq.broker.journal import JournalOp, Settle, StoredMessage
from twinmq.broker.journal.ops import decode_ops
from twinmq.broker.mirror.bidi import IdMap
from twinmq.broker.mirror.durable import BatchFutures
from twinmq.broker.mirror.events import INTERNAL_QID_BASE, record_header
from twinmq.broker.mirror.role import ROLE_QID, RoleStore, SiteRole
from twinmq.broker.mirror.source import (
    QUEUE_NAME,
    QUEUE_QID,
    MirrorSource,
    TargetCursor,
    cursor_queue,
)
from twinmq.broker.replication.protocol import FrameType, decode_batch
from twinmq.testing.launcher import BrokerProcess, free_port
from twinmq.testing.pair import Pair
from twinmq.testing.sansio import Harness
from twinmq.testing.waiting import wait_for

QUEUE = "rd.q"
# Well above what a connected DR site lags by on a loaded machine (`test_mirror_reseed`).
RETENTION = 30
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
    all_linked([pair.active])
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


# -- a failed batch undoes the drop and the record together (sans-I/O: the real source,
# role store, committer and journals) ----------------------------------------------------


def _message(mid: int) -> StoredMessage:
    body = f"m{mid}".encode()
    return StoredMessage(mid, 3, "", "q", record_header(len(body)), body, None)


def _source(h: Harness) -> tuple[MirrorSource, RoleStore]:
    """A one-way source with a retention bound of 3 and its role store, wired as the site
    wires them (`Mirroring._needs_resync`: the record's ops join the drop's batch)."""
    roles = RoleStore(h.vhost, h.committer, BatchFutures(), "source")
    source = MirrorSource(h.vhost, h.committer, h.clock.time)
    source.retention = 3
    source.needs_resync = roles.current.needs_resync

    def record(reason: str) -> tuple[list[JournalOp], Callable[[], list[JournalOp]]]:
        return roles.replace(roles.current.model_copy(update={"needs_resync": reason}))

    source.on_needs_resync = record
    h.committer.tap = source
    h.committer.await_durable(source)
    return source, roles


def _mids(h: Harness) -> list[int]:
    queue = h.vhost.queues.get(QUEUE_NAME)
    return [] if queue is None else [e.message.mid for e in queue.entries]


def _mesh_with_c_away(tmp_path: Path) -> tuple[Harness, MirrorSource]:
    """A full mesh's source (targets b:1 and c:1), two events mirrored: b:1 acknowledged
    each, c:1 is away (its backlog holds both)."""
    site = Harness(tmp_path / "a")
    source = MirrorSource(site.vhost, site.committer, site.clock.time)
    source.ids = IdMap(site.vhost, "site-a")
    source.name = "site-a"
    source.targets = ["b:1", "c:1"]
    site.committer.tap = source
    site.committer.await_durable(source)
    source.activate()
    site.commit()
    for mid in (1, 2):
        site.committer.add([_message(mid)])
        site.commit()
        source.acked(source.head, "b:1")  # b:1 keeps up, c:1 is away
        site.commit()
    return site, source


def test_a_failed_batch_undoes_a_retention_drop_and_its_needs_resync_record_together(
    tmp_path: Path,
) -> None:
    """The batch that passes the bound fails: the backlog, NeedsResync clear and the
    previous role record come back, here and on the passive that applied the batch; the
    next batch drops again, the drop and the record in one group commit (a restart holds
    both)."""
    site = Harness(tmp_path / "a")
    source, roles = _source(site)
    roles.record(SiteRole(role="source"))  # the record a failed batch must put back
    source.activate(snapshot=False)
    for mid in (1, 2):
        site.committer.add([_message(mid)])
        site.commit()
    backlog = _mids(site)
    assert 0 < len(backlog) <= 3 and source.needs_resync is None
    # The pair's passive, in sync: what the site journaled so far, then what it streams.
    shutil.copytree(tmp_path / "a" / "journal", tmp_path / "passive" / "journal")
    passive = Harness(tmp_path / "passive")

    failed = 10**6  # the tap keys its changes by batch number only
    streamed = source.batch_closing(failed, [_message(3), _message(4)], memoryview(b""))
    assert source.needs_resync is not None and _mids(site) == []
    assert roles.current.needs_resync is not None
    assert any(op.qid == ROLE_QID for op in streamed)  # the record: the drop's batch
    assert not source.ensure_active()  # as the link asks meanwhile: the queue released
    passive.vhost.apply_ops(streamed)
    withdrawal = source.batch_failed(failed)
    passive.vhost.apply_ops(withdrawal, catchup=True)

    assert source.needs_resync is None and roles.current.needs_resync is None
    assert _mids(site) == backlog
    passive_roles = RoleStore(passive.vhost, passive.committer, BatchFutures(), "source")
    assert passive_roles.current.needs_resync is None
    assert _mids(passive) == backlog
    passive.close()

    site.committer.add([_message(5), _message(6)])  # passes the bound again, for real
    site.commit()
    assert source.needs_resync is not None and _mids(site) == []
    site.close()
    restarted = Harness(tmp_path / "a")
    restarted_roles = RoleStore(restarted.vhost, restarted.committer, BatchFutures(), "source")
    assert restarted_roles.current.needs_resync is not None
    assert _mids(restarted) == []
    restarted.close()


def test_a_failed_batch_undoes_a_mesh_targets_drop_and_its_cursor_record_together(
    tmp_path: Path,
) -> None:
    """A full mesh: the batch that takes target c:1 past the bound (its backlog trimmed,
    NeedsResync in its cursor record, one group commit) fails: the events, c:1's good
    standing and its previous record come back, here and on the passive that applied the
    batch; the next batch takes c:1 past the bound again, for good."""
    site, source = _mesh_with_c_away(tmp_path)
    backlog, cursors = _mids(site), dict(source.cursors)
    assert backlog and source.backlog("c:1") == len(backlog) and source.backlog("b:1") == 0
    source.retention = len(backlog)  # one more event passes it
    shutil.copytree(tmp_path / "a" / "journal", tmp_path / "passive" / "journal")
    passive = Harness(tmp_path / "passive")

    failed = 10**6
    streamed = source.batch_closing(failed, [_message(3)], memoryview(b""))
    assert source.target_resync.keys() == {"c:1"} and _mids(site) == [source.head]
    assert _resync(site, "c:1") is not None
    passive.vhost.apply_ops(streamed)
    withdrawal = source.batch_failed(failed)
    passive.vhost.apply_ops(withdrawal, catchup=True)

    assert not source.target_resync and source.cursors == cursors
    assert _mids(site) == backlog and source.backlog("c:1") == len(backlog)
    assert _resync(site, "c:1") is None
    assert _resync(passive, "c:1") is None and _mids(passive) == backlog
    passive.close()

    site.committer.add([_message(4)])  # passes the bound again, for real
    site.commit()
    assert source.target_resync.keys() == {"c:1"}
    site.close()
    restarted = Harness(tmp_path / "a")
    assert _resync(restarted, "c:1") is not None
    assert len(_mids(restarted)) == 1  # the last event: b:1 lacks it
    restarted.close()


def test_a_failed_retention_drop_keeps_needs_resync_when_a_later_batch_got_no_event(
    tmp_path: Path,
) -> None:
    """The drop's batch fails after a later batch closed while the source was in
    NeedsResync (no event of its message 7, no id-map change): undoing the drop in full
    would resume the DR site from its mark, and message 7 (confirmed) would never reach
    it. The backlog comes back, NeedsResync stays, and its role record is journaled
    again in a new batch (here, on the passive, and after a restart)."""
    site = Harness(tmp_path / "a")
    source, roles = _source(site)
    roles.record(SiteRole(role="source"))
    source.activate(snapshot=False)
    for mid in (1, 2):
        site.committer.add([_message(mid)])
        site.commit()
    backlog = _mids(site)
    shutil.copytree(tmp_path / "a" / "journal", tmp_path / "passive" / "journal")
    passive = Harness(tmp_path / "passive")
    rejournaled: list[list[JournalOp]] = []
    site.committer.on_batch = lambda _batch, ops: rejournaled.append(list(ops))

    failed = 10**6
    streamed = source.batch_closing(failed, [_message(3), _message(4)], memoryview(b""))
    assert source.needs_resync is not None
    assert source.batch_closing(failed + 1, [_message(7)], memoryview(b"")) == []
    passive.vhost.apply_ops(streamed)
    withdrawal = source.batch_failed(failed)
    passive.vhost.apply_ops(withdrawal, catchup=True)

    assert source.needs_resync is not None and roles.current.needs_resync is not None
    assert _mids(site) == backlog  # as the active's journal holds it (the drop failed)
    site.commit()  # the record's new batch
    assert any(op.qid == ROLE_QID for ops in rejournaled for op in ops)
    for ops in rejournaled:
        passive.vhost.apply_ops(ops)
    passive_roles = RoleStore(passive.vhost, passive.committer, BatchFutures(), "source")
    assert passive_roles.current.needs_resync is not None  # a promoted passive re-seeds
    passive.close()
    site.close()
    restarted = Harness(tmp_path / "a")
    restarted_roles = RoleStore(restarted.vhost, restarted.committer, BatchFutures(), "source")
    assert restarted_roles.current.needs_resync is not None
    restarted.close()


def test_a_failed_reseed_leaves_a_later_retention_drops_needs_resync(tmp_path: Path) -> None:
    """A re-seed's batch R fails after later batches made an event (message 5's) and
    dropped the backlog past the bound, for good (NeedsResync): R's undo must not clear
    that NeedsResync nor lower the trim mark, or the DR site resumes from its mark past
    message 5's dropped event."""
    site = Harness(tmp_path / "a")
    source, _roles = _source(site)
    source.activate(snapshot=False)
    for mid in (1, 2):
        site.committer.add([_message(mid)])
        site.commit()
    source.reseed("by hand")
    reseed = site.committer.last_appended + 1  # the open batch: the drop and the seed
    made = source.batch_closing(10**6, [_message(5)], memoryview(b""))
    assert made and source.needs_resync is None  # message 5's event
    source.batch_closing(10**6 + 1, [_message(6), _message(7)], memoryview(b""))
    dropped = source.needs_resync
    assert dropped is not None and made[0].mid <= source.trimmed_seq
    trimmed = source.trimmed_seq

    source.batch_failed(reseed)
    assert source.needs_resync == dropped and source.trimmed_seq == trimmed
    site.close()


def test_a_failed_mesh_drop_keeps_the_target_in_needs_resync_when_trimmed_since(
    tmp_path: Path,
) -> None:
    """A full mesh: batch B takes c:1 past the bound (trimmed to b:1's cursor); before B's
    outcome b:1 acknowledges one more event, trimmed in a later batch that succeeds (c:1
    no longer counted). B fails: that event is gone for c:1 too, so c:1 stays in
    NeedsResync (its record journaled again) and the trim mark stays where it is, or c:1
    resumes from its cursor over a hole that `gap` does not see."""
    site, source = _mesh_with_c_away(tmp_path)
    site.committer.add([_message(10)])  # b:1 has not acknowledged its event yet
    site.commit()
    lagging = source.head
    source.retention = source.backlog("c:1")

    failed = 10**6
    source.batch_closing(failed, [_message(3)], memoryview(b""))
    assert source.target_resync.keys() == {"c:1"} and _mids(site)[0] == lagging
    source.acked(lagging, "b:1")  # trimmed in a later batch, which succeeds
    site.commit()
    assert source.trimmed_seq == lagging
    source.batch_failed(failed)

    assert source.target_resync.keys() == {"c:1"}
    assert source.trimmed_seq == lagging
    site.commit()  # c:1's record, journaled again
    assert _resync(site, "c:1") is not None
    site.close()
    restarted = Harness(tmp_path / "a")
    assert _resync(restarted, "c:1") is not None
    restarted.close()


def _resync(h: Harness, target: str) -> str | None:
    """Why `target` needs a re-seed, as its cursor record in `h` says (None: no record)."""
    queue = h.vhost.queues.get(cursor_queue(target)[0])
    if queue is None or not queue.entries:
        return None
    return TargetCursor.model_validate_json(queue.entries[-1].message.body).needs_resync


# -- a failed batch on real brokers: the pair's on a tmpfs each, the active's disk filled --


@pytest.fixture
def small_pair(tmp_path: Path, dr_site: BrokerProcess) -> Iterator[Pair]:
    """The source pair on a 32 MiB tmpfs each (root only), mirroring to `dr_site` with a
    retention bound of `RETENTION`."""
    port = dr_site.extra_args[dr_site.extra_args.index("--mirror-port") + 1]
    mirror = [
        "--mirror-to", f"127.0.0.1:{port}", "--mirror-token", TOKEN, "--mirror-id", ORIGIN,
        "--mirror-retention-events", str(RETENTION),
    ]  # fmt: skip
    with started_on_small_disks(tmp_path / "pair", 20.0, mirror) as rig:
        yield rig


def test_a_passive_promoted_after_a_failed_retention_drop_sends_the_dr_site_the_backlog(
    small_pair: Pair, dr_site: BrokerProcess
) -> None:
    """The batch whose event passes the bound is a publish the full disk refuses: the drop
    and its NeedsResync record are undone with it, here and on the passive. Promoted after
    a `kill -9` of the active, the passive holds the backlog and no NeedsResync: it resumes
    the DR site, which gets every confirmed message and not the nacked one."""
    pair = small_pair
    all_linked([pair.active])
    conn, ch = _stored(pair)
    _mirrored(pair.active)
    dr_site.stop()
    late: list[bytes] = []
    while (mirror_status(pair.active) or {}).get("queue_events", 0) < RETENTION:
        late.append(f"late{len(late)}".encode())
        ch.basic_publish("", FB_QUEUE, late[-1], PERSISTENT)
    assert mirror_status(pair.active)["queue_events"] == RETENTION  # one more passes it
    _fill(pair)
    with pytest.raises(pika.exceptions.NackError):
        ch.basic_publish("", FB_QUEUE, b"N" * BIG, PERSISTENT)
    with contextlib.suppress(pika.exceptions.AMQPError):
        conn.close()
    section = mirror_status(pair.active)
    assert section is not None and section["state"] != "needs-resync", section

    _promote_after_kill(pair)
    section = mirror_status(pair.active)
    assert section is not None and section["needs_resync"] is None, section
    dr_site.start()
    _mirrored(pair.active)
    held = sorted(body[:8] for body in browse(dr_site, FB_QUEUE))
    assert held == sorted([*STORED_FB, *late])
