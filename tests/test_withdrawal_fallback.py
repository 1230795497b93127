"""A withdrawal that cannot be made falls back to a new catch-up, never wedges the pair.

A failed batch's withdrawal is one WITHDRAW frame (docs/replication.md, "A failed batch
on the passive"), and it can be large: an undone ack stores its message again, body and
all; a failed retention drop or re-seed of the DR mirror puts the whole backlog back.
Over the frame limit the passive's reader refused it (the link reset on every attempt);
over 4 GiB its length did not pack and the exception, raised inside the group commit's
sync task, ended that task: every later confirm waited for good. Now an oversize or
failing withdrawal makes the passive catch up again (`ReplicationSource.resync`), and the
group commit outlives any error of its `on_withdraw` hook.

The committer over a real journal on a real full tmpfs (root), as
test_failed_batch_withdrawal_order.py; the source over a real loopback connection.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from disks import small_tmpfs
from test_failed_batch_withdrawal_order import Outcomes, _failed_then_good

from twinmq.broker import server as server_module
from twinmq.broker.commit import GroupCommitter
from twinmq.broker.journal import Journal, StoredMessage
from twinmq.broker.replication import source as source_module
from twinmq.broker.replication.source import ReplicationSource, SourceLink
from twinmq.broker.server import Broker


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs with 15 MiB taken (needs root; skipped where mounting is refused)."""
    with small_tmpfs(tmp_path / "disk", "16m") as mount:
        (mount / "filler").write_bytes(b"\0" * (15 * 1024 * 1024))
        yield mount


def test_a_withdrawal_hook_that_raises_leaves_later_batches_confirming(full_disk: Path) -> None:
    async def run() -> None:
        journal = Journal(full_disk / "j", segment_bytes=64 * 1024 * 1024)
        journal.open()
        committer = GroupCommitter(journal, asyncio.get_running_loop())
        outcomes = Outcomes()
        committer.await_durable(outcomes)

        def withdraw(batch: int, streamed: bool) -> bool:
            raise RuntimeError("the withdrawal could not be built")

        committer.on_withdraw = withdraw
        committer.guard(True)  # a passive in sync
        await _failed_then_good(journal, committer)
        committer.replica_acked(2)
        assert outcomes.told == [(1, True), (2, False)], "the failed batch is nacked"
        committer.add([StoredMessage(3, 1, "", "q", b"", b"z" * 1024, None)])
        committer.flush_now()
        await committer._sync_once()
        committer.replica_acked(3)
        assert outcomes.told[-1] == (3, False), "a later batch still confirms"
        await journal.close()

    asyncio.run(run())


@contextlib.asynccontextmanager
async def _linked_source() -> Any:
    """A source whose in-sync passive (taking withdrawals) is a real loopback
    connection; yields (source, link, the passive's reader)."""
    accepted: asyncio.Queue[asyncio.StreamReader] = asyncio.Queue()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accepted.put(reader)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    passive = await accepted.get()
    committer = SimpleNamespace(guarded=True, on_batch=None, tap=None)
    vhost = SimpleNamespace(on_topology_change=None, on_topology_delta=None)
    settings = SimpleNamespace(replication_timeout=30.0)
    broker = SimpleNamespace(committer=committer, vhost=vhost, settings=settings, lease=None)
    source = ReplicationSource(cast(Any, broker))
    link = SourceLink("127.0.0.1", "passive", writer, 0, withdrawals=True)
    link.in_sync = True
    source.link = link
    try:
        yield source, link, passive
    finally:
        source._cancel_degrade()
        writer.transport.abort()
        server.close()


def test_a_withdrawal_over_the_frame_limit_makes_the_passive_catch_up_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The limit lowered for the test, as a 512 MiB withdrawal would be too big for it.
    monkeypatch.setattr(source_module, "MAX_FRAME", 64 * 1024, raising=False)

    async def run() -> None:
        async with _linked_source() as (source, link, passive):
            ops = [StoredMessage(7, 1, "", "q", b"", b"b" * (128 * 1024), None)]
            assert source.withdraw(5, ops), "the outcome waits for the new catch-up"
            assert link.closed, "the link is reset: the passive reconnects and catches up"
            assert source.link is None
            assert link.withdrawal_sent == 0
            assert await passive.read() == b"", "no frame the passive would refuse"

    asyncio.run(run())


def test_a_withdrawal_within_the_frame_limit_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(source_module, "MAX_FRAME", 64 * 1024, raising=False)

    async def run() -> None:
        async with _linked_source() as (source, link, _passive):
            ops = [StoredMessage(7, 1, "", "q", b"", b"b" * 1024, None)]
            assert source.withdraw(5, ops)
            assert not link.closed
            assert link.withdrawal_sent == 5

    asyncio.run(run())


def test_a_withdrawal_that_fails_to_build_makes_the_passive_catch_up_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*_args: object) -> list[object]:
        raise MemoryError("the withdrawal's ops")

    monkeypatch.setattr(server_module, "withdraw_everywhere", broken)
    resyncs: list[str] = []
    source = SimpleNamespace(resync=resyncs.append)
    vhost = SimpleNamespace(root=SimpleNamespace(vhosts={}))
    committer = SimpleNamespace(tap=None, guarded=True)
    broker = SimpleNamespace(role="active", vhost=vhost, committer=committer, source=source)
    assert Broker._withdraw_failed(cast(Broker, broker), 4, True), "waits for the catch-up"
    assert len(resyncs) == 1
