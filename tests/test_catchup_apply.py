"""The passive's apply loop on catch-up chunks, in-process: a real passive `Broker`, frames fed in.

The link is replaced by a function handing out frames (the active's topology,
then one catch-up chunk as `CatchupStream` encodes it) and a writer that
discards the passive's acknowledgements: what is checked is what the passive
does with a chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from pathlib import Path

from twinmq.broker.definitions import Definitions, QueueDef
from twinmq.broker.message import Entry, Message
from twinmq.broker.replication.catchup import CatchupStream
from twinmq.broker.replication.protocol import (
    BATCH_CATCHUP,
    BATCH_CATCHUP_LAST,
    FrameDecoder,
    FrameType,
    encode_batch,
)
from twinmq.broker.replication.replica import ReplicaClient, _Session
from twinmq.broker.server import Broker
from twinmq.testing.sansio import NullWriter, passive_settings

MESSAGES = 500


class _LinkEnded(Exception):
    pass


def _catchup_chunk() -> bytes:
    """The payload of a BATCH frame: one final catch-up chunk of MESSAGES messages."""
    entries = [
        Entry(Message(mid, "", "backlog", b"\x10\x00\x02", b"x" * 64, True, None, None), None, True)
        for mid in range(1, MESSAGES + 1)
    ]
    stream = CatchupStream({1: entries}, {}, MESSAGES + 1, queue_exists=lambda qid: True)
    while (chunk := stream.step()) is None:
        pass
    assert stream.finished and chunk.messages == MESSAGES
    ((ftype, payload),) = FrameDecoder().feed(
        encode_batch(1, BATCH_CATCHUP | BATCH_CATCHUP_LAST, chunk.payload)
    )
    assert ftype is FrameType.BATCH
    return payload


def test_a_passive_takes_the_messages_of_a_catch_up_chunk_out_of_the_collectors_generations(
    tmp_path: Path,
) -> None:
    """Full collections must not walk the backlog again and again (a quarter of the CPU)."""
    frames = [
        (FrameType.DEFINITIONS, Definitions(queues=[QueueDef(name="backlog", qid=1)], next_qid=2)
         .model_dump_json().encode()),
        (FrameType.BATCH, _catchup_chunk()),
    ]  # fmt: skip

    async def next_frame() -> tuple[FrameType, bytes]:
        if not frames:
            raise _LinkEnded
        return frames.pop(0)

    async def apply() -> Broker:
        settings = passive_settings(tmp_path)
        broker = Broker(settings)
        broker.committer.start()
        replica = ReplicaClient(broker, "127.0.0.1:1")
        with contextlib.suppress(_LinkEnded):
            await replica._apply(next_frame, _Session(replica, NullWriter()))  # type: ignore[arg-type]
        await broker.committer.stop()
        await broker.journal.close()
        return broker

    gc.unfreeze()
    try:
        broker = asyncio.run(apply())
        frozen = gc.get_freeze_count()
        (queue,) = broker.vhost.queues.values()
        assert [e.message.mid for e in queue.entries] == list(range(1, MESSAGES + 1))
        # Each message's Entry and Message at least, out of the generations.
        assert frozen >= 2 * MESSAGES
        first = queue.entries[0]
        assert gc.is_tracked(first) and all(o is not first for o in gc.get_objects())
    finally:
        gc.unfreeze()
