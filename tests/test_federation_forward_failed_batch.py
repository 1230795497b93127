"""A forward sent again while its original's batch is in flight shares that batch's outcome.

The upstream side of federation forwarding (`Federation.receive`, docs/federation.md,
"Forwarding"): a downstream whose confirm was lost in a link cut sends the message
again on its next session; its key is still claimed by the original, whose batch has
no outcome yet. That batch then fails (a full disk): the original is withdrawn here
and its key released. The re-send must not be confirmed: the downstream settles what
is confirmed from its outbox, and the message would be nowhere. It was confirmed on
whatever batch was outstanding when it came (`confirm_point`: a later, good batch), or
at once when it came between the failure told and the key's release. And the failed
batch's key record (`amq.twinmq.federation-dedup`) must leave with it, from memory and
from the passive that applied it: a passive promoted loads the window from the records
it holds, and one of a failed batch made it drop the re-send (a forward), or the
re-delivery (a link's republish), as a duplicate.

Sans-I/O: the real `Federation`, `VirtualHost`, `Connection` and `Channel` (the
downstream's two sessions), over the group committer and a real journal on a real
full tmpfs (root), the committer driven by hand as in
tests/test_failed_batch_withdrawal_order.py: a passive guards (the test plays its
acknowledgements), so the failed batch is told only once its withdrawal is, and the
re-send can come at any point in between.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from disks import small_tmpfs
from pamqp import commands
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from twinmq.broker.auth import Authenticator
from twinmq.broker.codec import ContentHeaderInfo
from twinmq.broker.commit import GroupCommitter
from twinmq.broker.connection import Connection, Limits
from twinmq.broker.federation.config import FederationConfig
from twinmq.broker.federation.dedup import QUEUE_NAME as DEDUP_QUEUE
from twinmq.broker.federation.dedup import DurableKeys, scoped
from twinmq.broker.federation.headers import ORIGIN, ORIGIN_SEQ, PATH
from twinmq.broker.federation.identity import SERVER_ID_PROPERTY
from twinmq.broker.federation.service import Federation
from twinmq.broker.federation.wire import Delivery
from twinmq.broker.journal import Journal, JournalError, JournalOp
from twinmq.broker.replication.withdrawal import withdraw_everywhere
from twinmq.broker.routing import Exchange
from twinmq.broker.vhost import PublishResult, VirtualHost
from twinmq.testing.rawamqp import PROTOCOL_HEADER, decode_frames, encode, plain_response
from twinmq.testing.sansio import Context, Harness, ManualClock, Peer

UPSTREAM = "sansio"  # the sans-I/O context's server id: a forward's path ends here
DOWNSTREAM = "down"
QUEUE = "q"
BIG = b"x" * (4 * 1024 * 1024)  # does not fit on the full disk: its batch fails
SMALL = b"y" * 1024
CHUNK = 64 * 1024  # body frames under the negotiated frame_max


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs with 15 MiB taken (needs root; skipped where mounting is refused)."""
    with small_tmpfs(tmp_path / "disk", "16m") as mount:
        (mount / "filler").write_bytes(b"\0" * (15 * 1024 * 1024))
        yield mount


class Upstream(Context):
    """The broker's context with federation's upstream side: forwards go to `receive`."""

    def __init__(
        self,
        vhost: VirtualHost,
        committer: GroupCommitter,
        state: Path,
        config: FederationConfig | None = None,
    ) -> None:
        super().__init__(vhost, committer, Authenticator(list(Harness.USERS)), Limits())
        self.federation = Federation(UPSTREAM, config, vhost, committer, lambda: None, state)

    def receive_forwarded(
        self,
        exchange: Exchange,
        routing_key: str,
        header: bytes,
        body: bytes,
        info: ContentHeaderInfo,
        *,
        hold: bool,
    ) -> PublishResult:
        return self.federation.receive(exchange, routing_key, header, body, info, hold=hold)


class Rig:
    """The upstream broker's core on the full disk, a passive guarding (played here)."""

    def __init__(self, journal: Journal, state: Path, config: FederationConfig | None) -> None:
        self.journal = journal
        recovered = journal.open()
        self.committer = committer = GroupCommitter(journal, asyncio.get_running_loop())
        # A failed batch was streamed to the passive: told once its withdrawal is.
        committer.on_withdraw = lambda batch, streamed: committer.guarded
        committer.guard(True)
        self.vhost = VirtualHost(committer, ManualClock(), recovered)
        self.vhost.declare_queue(
            QUEUE, passive=False, durable=True, exclusive=False, auto_delete=False,
            arguments={}, owner=None,
        )  # fmt: skip
        self.ctx = Upstream(self.vhost, committer, state, config)
        self.streamed: list[list[JournalOp]] = []  # the batches, as the passive got them
        self.withdrawals: list[list[JournalOp]] = []  # ... and the failed one's withdrawal
        committer.on_batch = lambda batch, ops: self.streamed.append(list(ops))
        committer.on_withdraw = self._withdraw

    def _withdraw(self, batch: int, streamed: bool) -> bool:
        """A failed batch: withdrawn here at once, streamed to the passive, told once the
        passive has it (`withdrawn`), as the broker's hook does (server.py)."""
        self.withdrawals.append(withdraw_everywhere([self.vhost], batch))
        return self.committer.guarded

    def session(self) -> Peer:
        """A downstream's federation link session: its forwarder's channel in confirm mode."""
        return session(self.ctx)

    async def write(self) -> None:
        """Close the open batch and let the journal write it (its failure is read later,
        by the committer's round)."""
        self.committer.flush_now()
        with contextlib.suppress(JournalError):
            await self.journal.sync(self.journal.stats.appended_lsn)

    def sizes(self) -> list[int]:
        """The sizes of the messages the queue holds (visible or not)."""
        return sizes(self.vhost)


def session(ctx: Upstream) -> Peer:
    """A downstream's federation link session: its forwarder's channel in confirm mode."""
    conn = Connection(ctx, "127.0.0.1:40000", loopback=True, wake=lambda: None)
    peer = Peer(conn, ctx.committer.flush_topology)
    start_ok = commands.Connection.StartOk(
        client_properties={"product": "downstream", "capabilities": {},
                           SERVER_ID_PROPERTY: DOWNSTREAM},
        mechanism="PLAIN", response=plain_response("guest", "guest"),
    )  # fmt: skip
    for step in (
        PROTOCOL_HEADER,
        encode(0, start_ok),
        encode(0, commands.Connection.TuneOk(channel_max=16, frame_max=131072, heartbeat=0))
        + encode(0, commands.Connection.Open(virtual_host="/")),
        encode(1, commands.Channel.Open()) + encode(1, commands.Confirm.Select()),
    ):
        peer.feed(step)
    return peer


def sizes(vhost: VirtualHost) -> list[int]:
    """The sizes of the messages `vhost`'s queue holds (visible or not)."""
    return [len(entry.message.body) for entry in vhost.queues[QUEUE].entries]


def forward(peer: Peer, seq: int, body: bytes) -> list[bool]:
    """The downstream forwards its message `seq` (stamped with origin and path); the
    confirms the upstream sent meanwhile (True: basic.ack, False: basic.nack)."""
    properties = commands.Basic.Properties(
        delivery_mode=2, headers={ORIGIN: DOWNSTREAM, ORIGIN_SEQ: seq, PATH: [DOWNSTREAM, UPSTREAM]}
    )
    data = encode(1, commands.Basic.Publish(exchange="", routing_key=QUEUE))
    data += encode(1, ContentHeader(0, len(body), properties))
    data += b"".join(
        encode(1, ContentBody(body[i : i + CHUNK])) for i in range(0, len(body), CHUNK)
    )
    return confirms(peer.feed(data))


def confirms(data: bytes) -> list[bool]:
    """The publisher confirms in `data`, in order."""
    return [
        isinstance(frame, commands.Basic.Ack)
        for _, frame in decode_frames(data)
        if isinstance(frame, (commands.Basic.Ack, commands.Basic.Nack))
    ]


@contextlib.asynccontextmanager
async def rig(
    full_disk: Path, tmp_path: Path, config: FederationConfig | None = None
) -> AsyncIterator[Rig]:
    journal = Journal(full_disk / "j", segment_bytes=64 * 1024 * 1024)
    try:
        yield Rig(journal, tmp_path / "federation", config)
    finally:
        await journal.close()


@contextlib.asynccontextmanager
async def promoted_passive(
    up: Rig, directory: Path
) -> AsyncIterator[tuple[VirtualHost, GroupCommitter]]:
    """The passive of `up`, promoted: it applied every batch streamed, then the
    withdrawals (as its replica loop does: a WITHDRAW as a catch-up's ops), on a disk of
    its own."""
    journal = Journal(directory)
    recovered = journal.open()
    committer = GroupCommitter(journal, asyncio.get_running_loop())
    passive = VirtualHost(committer, ManualClock(), recovered, replica=True)
    try:
        passive.apply_definitions(up.vhost.all_definitions())
        for ops in up.streamed:
            passive.apply_ops(ops)
        for ops in up.withdrawals:
            passive.apply_ops(ops, catchup=True)
        passive.set_replica(False)
        passive.next_mid = up.vhost.next_mid
        yield passive, committer
    finally:
        await journal.close()


def test_a_resend_racing_its_failed_original_is_not_confirmed_on_a_later_batch(
    full_disk: Path, tmp_path: Path
) -> None:
    async def run() -> None:
        async with rig(full_disk, tmp_path) as up:
            first = up.session()
            assert forward(first, 7, BIG) == []  # batch 1: its write fails
            await up.write()
            assert forward(first, 8, SMALL) == []  # batch 2: written
            await up.write()
            first.conn.connection_lost()  # the link is cut: both confirms lost
            second = up.session()
            told = forward(second, 7, BIG)  # sent again, while batch 1 has no outcome yet
            await up.committer._sync_once()  # batch 1 failed (withdrawn at once), 2 durable
            up.committer.replica_acked(2)
            told += confirms(second.conn.data_to_send())
            assert told == [], "confirmed before the passive dropped the failed batch"
            up.committer.withdrawn(1)
            told += confirms(second.conn.data_to_send())
            assert len(BIG) not in up.sizes(), "the failed batch's message is withdrawn"
            assert told == [False], "the re-send of a failed forward was confirmed: lost"

    asyncio.run(run())


def test_a_resend_between_the_failure_told_and_the_keys_release_is_published_again(
    full_disk: Path, tmp_path: Path
) -> None:
    async def run() -> None:
        async with rig(full_disk, tmp_path) as up:
            first = up.session()
            forward(first, 7, BIG)
            await up.write()
            first.conn.connection_lost()
            await up.committer._sync_once()
            up.committer.withdrawn(1)  # told now (a nack to nobody); no loop turn since
            second = up.session()
            told = forward(second, 7, BIG)
            assert told == [], "a re-send of a failed forward confirmed at once: lost"
            await up.write()  # published again: its own batch, which fails too (full)
            await up.committer._sync_once()
            up.committer.withdrawn(2)
            told += confirms(second.conn.data_to_send())
            assert told == [False]
            assert len(BIG) not in up.sizes()

    asyncio.run(run())


def test_a_resend_racing_its_durable_original_is_confirmed_and_kept_once(
    full_disk: Path, tmp_path: Path
) -> None:
    async def run() -> None:
        async with rig(full_disk, tmp_path) as up:
            first = up.session()
            forward(first, 7, SMALL)
            await up.write()
            first.conn.connection_lost()
            second = up.session()
            told = forward(second, 7, SMALL)
            await up.committer._sync_once()
            up.committer.replica_acked(1)
            told += confirms(second.conn.data_to_send())
            assert told == [True]
            assert up.sizes() == [len(SMALL)], "once"
            await asyncio.sleep(0)  # the key's callback: it is in the window now
            assert forward(second, 7, SMALL) == [True]
            assert up.sizes() == [len(SMALL)]

    asyncio.run(run())


def test_a_failed_forwards_key_record_leaves_the_passive_with_the_batch(
    full_disk: Path, tmp_path: Path
) -> None:
    # The passive applied the failed batch (the message and its key's record), then its
    # withdrawal. Promoted, it loads the window from the records it holds: the
    # downstream's re-send must be published there, not dropped as a duplicate (and
    # confirmed) of a message nobody holds. The record stayed in the active's memory
    # too, and a catch-up from there would have carried it to the next passive.
    async def run() -> None:
        async with rig(full_disk, tmp_path) as up:
            first = up.session()
            forward(first, 7, BIG)
            await up.write()
            first.conn.connection_lost()
            await up.committer._sync_once()
            up.committer.withdrawn(1)
            records = up.vhost.queues[DEDUP_QUEUE].entries
            assert not records, "the failed batch's key record is still in memory"

            async with promoted_passive(up, tmp_path / "passive") as (passive, committer):
                promoted = Upstream(passive, committer, tmp_path / "promoted")
                promoted.federation.start()  # the window from the records held here
                again = session(promoted)
                told = forward(again, 7, BIG)  # the downstream sends it again
                assert sizes(passive) == [len(BIG)], (
                    "the re-send was dropped as a duplicate of a message nobody holds"
                )
                committer.flush_now()
                await committer._sync_once()
                told += confirms(again.conn.data_to_send())
                assert told == [True]

    asyncio.run(run())


class Settles:
    """The link's channel to its upstream, as `_republish` uses it: what it acked, nacked."""

    def __init__(self) -> None:
        self.acked: list[int] = []
        self.nacked: list[int] = []

    def basic_ack(self, tag: int) -> None:
        self.acked.append(tag)

    def basic_nack(self, tag: int, requeue: bool = True) -> None:
        self.nacked.append(tag)


LINKED = FederationConfig.model_validate({
    "upstreams": {"central": {"uri": "amqp://central:5672/"}},
    "exchanges": [{"exchange": "fx", "upstream": "central"}],
})  # fmt: skip


def test_a_failed_republishs_key_record_leaves_the_passive_with_the_batch(
    full_disk: Path, tmp_path: Path
) -> None:
    # The downstream side: a link republishes its upstream's message here; the batch
    # (message and key record) fails, the link nacks it upstream (requeued). Promoted,
    # the passive must republish the re-delivery, not drop it as a duplicate and ack it
    # upstream (gone from there, never taken here).
    async def run() -> None:
        async with rig(full_disk, tmp_path, LINKED) as here:
            federation = here.ctx.federation
            link = next(iter(federation.links.values()))
            link.declare_exchange()
            here.vhost.bind(QUEUE, "fx", "k", {}, None)
            link.upstream_id = "central"
            properties = commands.Basic.Properties(
                delivery_mode=2, headers={ORIGIN: "central", ORIGIN_SEQ: 7}
            )
            header = ContentHeader(0, len(BIG), properties).marshal()
            delivery = Delivery(1, False, "fx", "k", header, BIG)
            channel = Settles()
            republish = asyncio.ensure_future(link._republish(channel, [delivery]))  # type: ignore[arg-type]
            await asyncio.sleep(0)  # published, its record added: the batch is open
            await here.write()
            await here.committer._sync_once()
            here.committer.withdrawn(1)
            await republish
            assert (channel.acked, channel.nacked) == ([], [1]), "requeued upstream"
            assert not here.vhost.queues[DEDUP_QUEUE].entries, "the failed record is in memory"
            async with promoted_passive(here, tmp_path / "passive") as (passive, _):
                keys = DurableKeys(100)
                keys.load(passive)  # what the promoted passive's links start from
                assert scoped("/", "central\x007") not in keys, (
                    "the re-delivery would be dropped as a duplicate: acked upstream, lost"
                )

    asyncio.run(run())
