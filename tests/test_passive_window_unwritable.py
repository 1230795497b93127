"""A passive that cannot write its dedup window removes the file and carries on.

Before it acknowledges a withdrawal or a catch-up's end, a passive writes its dedup
window: a file still holding a key forgotten since would make it, restarted and
promoted, drop that message's re-send after confirming it (docs/replication.md,
"Duplicates"). On a nearly full disk (a new copy of the window needs room beside the
old one) that write failed at every catch-up's end and the passive exited (75),
restarted, caught up and exited again: the active stayed degraded for good. No file
holds no stale key either: the passive now removes it, and stops only if even that
fails.

A real passive `Broker`, its apply loop fed the frames of a catch-up (as
test_catchup_apply.py), its window's write failing with ENOSPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
from pathlib import Path

import pytest

from twinmq.broker import dedup as dedup_module
from twinmq.broker.dedup import DedupWindow
from twinmq.broker.definitions import Definitions, QueueDef
from twinmq.broker.replication.protocol import (
    BATCH_CATCHUP,
    BATCH_CATCHUP_LAST,
    FrameDecoder,
    FrameType,
    encode,
    encode_batch,
    encode_key,
    encode_u64,
)
from twinmq.broker.replication.replica import ReplicaClient, _Session
from twinmq.broker.server import Broker
from twinmq.testing.sansio import NullWriter, passive_settings

STALE = "\x00q\x00withdrawn-since"  # in the old file; the active's window lacks it
FRESH = "\x00q\x00kept"


class _Done(Exception):
    pass


def _full(path: Path, data: bytes) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_passive_that_cannot_write_its_window_removes_it_and_becomes_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    window_file = tmp_path / "dedup.json"
    window_file.write_text(json.dumps([STALE]))
    keys = bytearray()
    encode_key(keys, FRESH)
    stream = [
        encode(FrameType.DEFINITIONS, Definitions(queues=[QueueDef(name="q", qid=1)], next_qid=2)),
        encode_batch(1, BATCH_CATCHUP | BATCH_CATCHUP_LAST, keys, FrameType.DEDUP_KEYS),
        encode_u64(FrameType.CAUGHT_UP, 0),
    ]
    frames = FrameDecoder().feed(b"".join(stream))

    async def run() -> tuple[bool, bool, bool]:
        settings = passive_settings(tmp_path)
        broker = Broker(settings)
        assert STALE in broker.vhost.dedup, "the old file was loaded"
        broker.committer.start()
        monkeypatch.setattr(dedup_module, "replace_file", _full)
        replica = ReplicaClient(broker, "127.0.0.1:1")

        async def next_frame() -> tuple[FrameType, bytes]:
            if frames:
                return frames.pop(0)
            raise _Done

        with contextlib.suppress(_Done):
            await replica._apply(next_frame, _Session(replica, NullWriter()))  # type: ignore[arg-type]
        fresh = FRESH in broker.vhost.dedup
        await broker.committer.stop()
        await broker.journal.close()
        return broker.exit_requested.is_set(), replica.caught_up, fresh

    exiting, ready, fresh = asyncio.run(run())
    assert not exiting, "the passive stopped (exit 75): restarted, it fails the same way"
    assert ready, "the passive became ready"
    assert fresh, "the window in memory is the active's"
    assert not window_file.exists(), "the old window, with a key forgotten since, is gone"
    assert not window_file.with_suffix(".tmp").exists()
    restarted = DedupWindow(100, window_file)
    assert STALE not in restarted, "a restart brings no forgotten key back"
