"""A promotion that lands while the passive writes its window keeps memory and journal one.

The passive applies a WITHDRAW in memory, writes its dedup window, then journals the
ops (the window first: a crash between the two leaves a message without its key,
never a key without its message). A promotion meanwhile (`set_role` stops the replica:
its task is cancelled) left the ops in memory only: the new active held an undone
ack's message its journal had settled, lost at its next restart. Now the ops are
journaled even then.

A real passive `Broker`, its apply loop fed the frames (as test_catchup_apply.py), its
window's write held until the loop is cancelled; then the broker restarted from its
journal.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from twinmq.broker.definitions import Definitions, QueueDef
from twinmq.broker.journal import JournalOp, Settle, StoredMessage, encode_ops
from twinmq.broker.replication.protocol import FrameDecoder, FrameType, encode, encode_batch
from twinmq.broker.replication.replica import ReplicaClient, _Session
from twinmq.broker.server import Broker
from twinmq.testing.sansio import NullWriter, passive_settings

QUEUE = "pr.q"
QID = 1
MID = 3


def _frame(batch: int, ops: list[JournalOp], ftype: FrameType = FrameType.BATCH) -> bytes:
    buf = bytearray()
    encode_ops(ops, buf)
    return encode_batch(batch, 0, buf, ftype)


def test_a_withdrawal_cut_short_by_a_promotion_is_journaled_as_it_is_held(
    tmp_path: Path,
) -> None:
    settings = passive_settings(tmp_path)
    message = StoredMessage(MID, QID, "", QUEUE, b"", b"acked in a failed transaction", None)
    stream = [
        encode(FrameType.DEFINITIONS, Definitions(queues=[QueueDef(name=QUEUE, qid=QID)])),
        _frame(1, [message]),
        _frame(2, [Settle(QID, MID)]),  # the failed transaction's ack
        _frame(2, [message], FrameType.WITHDRAW),  # its undo: the message stored again
    ]
    frames = FrameDecoder().feed(b"".join(stream))

    async def run() -> list[int]:
        broker = Broker(settings)
        broker.committer.start()
        writing = asyncio.Event()

        async def held() -> bool:
            writing.set()
            await asyncio.Event().wait()  # the promotion comes first
            return True

        broker.save_or_remove_dedup_window = held  # type: ignore[method-assign]
        replica = ReplicaClient(broker, "127.0.0.1:1")

        async def next_frame() -> tuple[FrameType, bytes]:
            if frames:
                return frames.pop(0)
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        task = asyncio.create_task(replica._apply(next_frame, _Session(replica, NullWriter())))  # type: ignore[arg-type]
        await writing.wait()
        task.cancel()  # the promotion stops the replica
        with contextlib.suppress(asyncio.CancelledError):
            await task
        held_in_memory = [e.message.mid for e in broker.vhost.queues[QUEUE].entries]
        assert held_in_memory == [MID], "the withdrawal was applied in memory"
        await broker.committer.stop()
        await broker.journal.close()
        restarted = Broker(settings)
        mids = [e.message.mid for e in restarted.vhost.queues[QUEUE].entries]
        await restarted.journal.close()
        return mids

    assert asyncio.run(run()) == [MID], "the restarted broker lost the undone ack's message"
