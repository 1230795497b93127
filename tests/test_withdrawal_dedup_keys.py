"""A failed batch's withdrawal takes its publishes' dedup keys off the passive, even
when a later batch already took the message off.

The sequence (docs/replication.md, "A failed batch on the passive"): batch N publishes
under `message_id` K, streamed, applied on the passive (K enters its window once
durable there); batch N+1 purges the queue, taking N's still-invisible message; N's
write fails on the active. The withdrawal's discard finds nothing to discard, so it
used to forget nothing (and, with no op left, no WITHDRAW was even sent): the passive
kept K and, promoted, dropped the publisher's re-send after the nack as a duplicate,
confirming it (a loss). The active's own window never admits the key of a failed
batch; now its withdrawal carries the batch's keys and the passive forgets them.

The active's side: `Broker._withdraw_failed` over a real `ReplicationSource`, its
in-sync passive a real loopback connection, and a real `DedupWindow`; what it writes is
fed, after the live batches, to a real passive `Broker`'s apply loop (as
test_catchup_apply.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import cast

from pamqp import commands
from test_withdrawal_fallback import _linked_source

from twinmq.broker import codec
from twinmq.broker.dedup import DedupWindow, dedup_key
from twinmq.broker.definitions import Definitions, QueueDef
from twinmq.broker.journal import JournalOp, Settle, StoredMessage, encode_ops
from twinmq.broker.replication.protocol import (
    FrameDecoder,
    FrameType,
    encode,
    encode_batch,
)
from twinmq.broker.replication.replica import ReplicaClient, _Session
from twinmq.broker.server import Broker
from twinmq.testing.sansio import NullWriter, passive_settings

QUEUE = "wk.q"
QID = 1
MID = 7
MESSAGE_ID = "order-42"
KEY = dedup_key("", QUEUE, MESSAGE_ID)
FAILED = 1  # the active's batch that fails


class _Done(Exception):
    pass


async def _active_withdrawal() -> bytes:
    """What the active sends its in-sync passive when batch FAILED fails: its publish
    under KEY waits in the window, its message is gone already (the purge)."""
    async with _linked_source() as (source, link, passive):
        link.withdrawal_keys = True  # (a passive of this version says so in its Snapshot)
        window = DedupWindow(100)
        window.add_when_durable(KEY, FAILED)
        # No vhost holds anything of the batch any more: the purge took its message.
        root = SimpleNamespace(vhosts={}, dedup=window)
        active = SimpleNamespace(
            role="active", vhost=SimpleNamespace(root=root), committer=source.broker.committer,
            source=source,
        )  # fmt: skip
        Broker._withdraw_failed(cast(Broker, active), FAILED, True)
        assert KEY not in window, "the active never admits the key of a failed batch"
        await link.writer.drain()
        link.writer.close()
        return await passive.read()


def _live(batch: int, ops: list[JournalOp]) -> bytes:
    buf = bytearray()
    encode_ops(ops, buf)
    return encode_batch(batch, 0, buf)


def test_a_withdrawal_forgets_the_key_of_a_message_a_later_batch_took_off_the_passive(
    tmp_path: Path,
) -> None:
    header = codec.encode_header_payload(
        commands.Basic.Properties(message_id=MESSAGE_ID, delivery_mode=2), 1
    )
    topology = Definitions(queues=[QueueDef(name=QUEUE, qid=QID)], next_qid=2)
    stream = [
        encode(FrameType.DEFINITIONS, topology),
        _live(FAILED, [StoredMessage(MID, QID, "", QUEUE, header, b"x", None)]),
        _live(FAILED + 1, [Settle(QID, MID)]),  # the purge
    ]

    async def run() -> tuple[bool, bool, list[str]]:
        withdrawal = await _active_withdrawal()
        settings = passive_settings(tmp_path)
        broker = Broker(settings)
        broker.committer.start()
        replica = ReplicaClient(broker, "127.0.0.1:1")
        decoder = FrameDecoder()
        frames = [f for raw in stream for f in decoder.feed(raw)]
        state = {"admitted": False}

        async def next_frame() -> tuple[FrameType, bytes]:
            if frames:
                return frames.pop(0)
            if not state["admitted"]:
                # The live batches durable here: KEY entered the passive's window.
                for _ in range(500):
                    if KEY in broker.vhost.dedup:
                        break
                    await asyncio.sleep(0.01)
                state["admitted"] = KEY in broker.vhost.dedup
                frames.extend(decoder.feed(withdrawal))
                if frames:
                    return frames.pop(0)
            raise _Done

        with contextlib.suppress(_Done):
            await replica._apply(next_frame, _Session(replica, NullWriter()))  # type: ignore[arg-type]
        kept = KEY in broker.vhost.dedup
        await broker.committer.stop()
        await broker.journal.close()
        saved = tmp_path / "dedup.json"
        return state["admitted"], kept, json.loads(saved.read_text()) if saved.exists() else []

    admitted, kept, saved = asyncio.run(run())
    assert admitted, "the passive had admitted the key before the withdrawal"
    assert not kept, "the passive, promoted, would drop the re-send after the nack"
    assert KEY not in saved


def test_a_passive_that_cannot_forget_keys_is_made_to_catch_up_again() -> None:
    """One of an older version (its Snapshot does not say `withdrawal_keys`): its catch-up
    starts from no admitted key and ends with the active's window."""

    async def run() -> None:
        async with _linked_source() as (source, link, _passive):
            assert source.withdraw(FAILED, [], [KEY]), "waits for the catch-up"
            assert link.closed and source.link is None

    asyncio.run(run())
