"""A passive writes a run of replicated topology changes as one definitions-log record
(one append, one fsync), as the active's group commit does, and acknowledges nothing
after them before that record is on disk (broker/replication/replica.py).

A real `Broker` in the passive role (journal with fsync, group commit, virtual host)
and its `ReplicaClient`'s apply loop, fed the frames an active sends; its
acknowledgements read from what it writes, and at each one the definitions log read
back from disk as a restart would."""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Awaitable, Callable
from pathlib import Path

from twinmq.broker.definitions import (
    BindingDef,
    Definitions,
    DefinitionsDelta,
    ExchangeDef,
    QueueDef,
)
from twinmq.broker.journal import deflog
from twinmq.broker.replication.protocol import (
    FrameDecoder,
    FrameType,
    decode_u64,
    encode,
    encode_batch,
)
from twinmq.broker.replication.replica import ReplicaClient, _Session
from twinmq.broker.server import EXIT_JOURNAL_FAILED, Broker
from twinmq.testing.sansio import NullTransport, passive_settings

EX, Q = "grp.x", "grp.q"


class Link:
    """The passive's writer: each acknowledgement, with the bindings on disk then."""

    def __init__(self, journal_dir: Path) -> None:
        self.transport = NullTransport()
        self.journal_dir = journal_dir
        self.decoder = FrameDecoder()
        self.acks: list[tuple[int, int]] = []  # (acknowledged, bindings durable then)

    def write(self, data: bytes) -> None:
        for ftype, payload in self.decoder.feed(data):
            if ftype in (FrameType.ACK, FrameType.CATCHUP_ACK):
                stored = deflog.load(self.journal_dir).state
                self.acks.append((decode_u64(payload), len(stored.bindings)))


class Done(Exception):
    """Every frame handed out."""


def _full(step: str) -> None:
    if step == "append":
        raise OSError(errno.ENOSPC, "No space left on device")


def _delta(key: str, *, unbind: bool = False) -> bytes:
    binding = BindingDef(exchange=EX, queue=Q, routing_key=key)
    delta = DefinitionsDelta(**{"del_bindings" if unbind else "add_bindings": [binding]})
    return encode(FrameType.DEFINITIONS_DELTA, delta)


def _acknowledged(remote: int) -> bytes:
    """A DEDUP_KEYS frame with no key: acknowledged once all before it is durable."""
    return encode_batch(remote, 0, b"", FrameType.DEDUP_KEYS)


async def _passive(
    tmp_path: Path, runs: list[list[bytes]], full_disk_from: int | None = None
) -> tuple[Broker, Link, list[int]]:
    """Feed `runs` of frames (the loop gets a turn between two runs); the number of
    definitions-log records after each run. From run `full_disk_from` on, every append
    to the definitions log fails (ENOSPC)."""
    settings = passive_settings(tmp_path, fsync=True)
    broker = Broker(settings)
    broker.committer.start()
    replica = ReplicaClient(broker, "127.0.0.1:1")
    link = Link(tmp_path / "journal")
    session = _Session(replica, link)  # type: ignore[arg-type]
    broker.committer.await_durable(session)
    topology = Definitions(
        exchanges=[ExchangeDef(name=EX, type="direct")],
        queues=[QueueDef(name=Q, qid=1)],
        next_qid=2,
    )
    frames = [encode(FrameType.DEFINITIONS, topology)]
    records: list[int] = []
    decoder = FrameDecoder()
    pending = [[*frames, *runs[0]], *runs[1:]]

    async def next_frame() -> tuple[FrameType, bytes]:
        while not frames_now:
            if not pending:
                raise Done
            if records or len(pending) < len(runs):
                await asyncio.sleep(0)  # the end of a network read: the loop's turn
                await asyncio.sleep(0)
                records.append(deflog.load(tmp_path / "journal").log_records)
            if full_disk_from is not None and len(runs) - len(pending) == full_disk_from:
                broker.journal._defs.fault = _full
            frames_now.extend(f for raw in pending.pop(0) for f in decoder.feed(raw))
        return frames_now.pop(0)

    frames_now: list[tuple[FrameType, bytes]] = []
    apply: Callable[[], Awaitable[None]] = lambda: replica._apply(next_frame, session)  # noqa: E731
    with contextlib.suppress(Done):
        await apply()
    records.append(deflog.load(tmp_path / "journal").log_records)
    await broker.committer.stop()
    await broker.journal.close()
    return broker, link, records


def test_a_run_of_replicated_changes_is_one_record_written_before_the_next_acknowledgement(
    tmp_path: Path,
) -> None:
    keys = [f"k{i}" for i in range(50)]
    run = [*(_delta(k) for k in keys), _acknowledged(1)]
    broker, link, records = asyncio.run(_passive(tmp_path, [run]))
    # The whole topology is a snapshot; the 50 changes after it, one record.
    assert records[-1] == 1
    stored = deflog.load(tmp_path / "journal").state
    assert sorted(b.routing_key for b in stored.bindings.values()) == sorted(keys)
    assert sorted(b.routing_key for b in broker.vhost.exchanges[EX].bindings.values()) == sorted(
        keys
    )
    # Acknowledged once, and then all 50 were on disk already.
    assert link.acks == [(1, 50)]


def test_runs_split_by_the_network_are_one_record_each_and_none_is_acknowledged_early(
    tmp_path: Path,
) -> None:
    first = [_delta(f"a{i}") for i in range(10)]  # the loop's turn ends after them
    second = [*(_delta(f"a{i}", unbind=True) for i in range(5)), _acknowledged(2)]
    third = [_delta("b"), _delta("c"), _acknowledged(3)]
    _broker, link, records = asyncio.run(_passive(tmp_path, [first, second, third]))
    assert records == [1, 2, 3]
    # Each acknowledgement found every change before it on disk.
    assert link.acks == [(2, 5), (3, 7)]


def test_a_run_the_disk_refuses_stops_the_passive_and_is_never_acknowledged(
    tmp_path: Path,
) -> None:
    first = [_delta("kept"), _acknowledged(1)]
    second = [_delta("lost.1"), _delta("lost.2"), _acknowledged(2)]
    broker, link, records = asyncio.run(_passive(tmp_path, [first, second], full_disk_from=1))
    assert link.acks == [(1, 1)]  # the second run's acknowledgement never went
    assert broker.exit_requested.is_set() and broker.exit_code == EXIT_JOURNAL_FAILED
    assert records == [1, 1]
    stored = deflog.load(tmp_path / "journal").state
    assert [b.routing_key for b in stored.bindings.values()] == ["kept"]
