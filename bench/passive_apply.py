#!/usr/bin/env python3
"""CPU cost per message of the passive's side of a catch-up, in-process, without sockets.

    .venv/bin/python bench/passive_apply.py [--messages 100000] [--size 1024] [--profile]

A real `Broker` in the passive role (journal, group commit, audit log, virtual
host) and its `ReplicaClient`'s apply loop, fed the frames an active sends in a
catch-up: the topology, then the chunks `CatchupStream` builds (1 MiB or 4,096
messages), at most `WINDOW` of them unacknowledged, as `CatchupSender` keeps
them. A fake link collects the passive's CATCHUP_ACKs. Everything the passive
does with a chunk runs: decode, apply to the queue, journal (write and, with
`--fsync`, fdatasync), audit records, acknowledgement. The result is the
process CPU time per message (all threads), the event loop thread's own CPU
time per message and per chunk (p50, max: how long the passive's loop is held
by one chunk), and the garbage collector's runs meanwhile; CPU time is
disturbed by the machine's other load far less than wall time. `--profile`
adds a cProfile table (the event loop's thread only). For instruction counts,
run it under callgrind with two sizes and take the difference per message
(docs/benchmarks.md has the command).
The chunks are built before the clock starts (that is the active's work).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import io
import pstats
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from catchup_chunks import Collections, quantile  # bench/, on the path when run from there

from twinmq.broker.definitions import Definitions, QueueDef
from twinmq.broker.journal import StoredMessage, encode_ops
from twinmq.broker.replication.catchup import CHUNK_BYTES, CHUNK_MESSAGES, WINDOW
from twinmq.broker.replication.protocol import (
    BATCH_CATCHUP,
    BATCH_CATCHUP_LAST,
    FrameDecoder,
    FrameType,
    decode_u64,
    encode_batch,
)
from twinmq.broker.replication.replica import ReplicaClient, _Session
from twinmq.broker.server import Broker
from twinmq.broker.settings import BrokerSettings

QID = 1
_HEADER = struct.Struct(">HHQHB")  # class, weight, body size, property flags, delivery-mode


class _Transport:
    def __init__(self) -> None:
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def abort(self) -> None:
        self.closing = True


class FakeLink:
    """The passive's writer: reads the CATCHUP_ACKs it writes."""

    def __init__(self) -> None:
        self.transport = _Transport()
        self.decoder = FrameDecoder()
        self.acked = 0
        self.changed = asyncio.Event()

    def write(self, data: bytes) -> None:
        for ftype, payload in self.decoder.feed(data):
            if ftype is FrameType.CATCHUP_ACK:
                self.acked = decode_u64(payload)
                self.changed.set()


class Done(Exception):
    """Every chunk acknowledged: the apply loop is ended by this."""


def build_chunks(messages: int, size: int) -> list[bytes]:
    """The BATCH frames of a catch-up of `messages` x `size` bytes, cut as the active cuts."""
    per_chunk = max(1, min(CHUNK_MESSAGES, CHUNK_BYTES // (size + 64)))
    body = b"x" * size
    header = _HEADER.pack(60, 0, size, 0x1000, 2)  # persistent, no other property
    frames: list[bytes] = []
    mid = 1
    while mid <= messages:
        count = min(per_chunk, messages - mid + 1)
        ops = [
            StoredMessage(m, QID, "", "backlog", header, body, None)
            for m in range(mid, mid + count)
        ]
        mid += count
        buf = bytearray()
        encode_ops(ops, buf)
        last = BATCH_CATCHUP_LAST if mid > messages else 0
        frames.append(encode_batch(len(frames) + 1, BATCH_CATCHUP | last, buf))
    return frames


def frame_source(
    chunks: list[bytes], link: FakeLink, per_chunk: list[float]
) -> Callable[[], Awaitable[tuple[FrameType, bytes]]]:
    """`next_frame` for the apply loop: the topology, then the chunks within the window.

    Appends to `per_chunk` the loop thread's CPU time from handing out one chunk
    to being asked for the next (its decode, apply, journal append, and whatever
    else the loop ran meanwhile: acknowledgements of durable chunks).
    """
    decoder = FrameDecoder()
    handed: float | None = None
    topology = Definitions(queues=[QueueDef(name="backlog", qid=QID)], next_qid=QID + 1)
    pending: list[tuple[FrameType, bytes]] = [
        (FrameType.DEFINITIONS, topology.model_dump_json().encode())
    ]
    sent = 0

    async def next_frame() -> tuple[FrameType, bytes]:
        nonlocal sent, handed
        if handed is not None:
            per_chunk.append(time.thread_time() - handed)
            handed = None
        if pending:
            return pending.pop()
        while sent == len(chunks) or sent - link.acked >= WINDOW:
            if link.acked >= len(chunks):
                raise Done
            link.changed.clear()
            await link.changed.wait()
        ((ftype, payload),) = decoder.feed(chunks[sent])
        sent += 1
        handed = time.thread_time()
        return ftype, payload

    return next_frame


async def run(opts: argparse.Namespace) -> dict[str, Any]:
    """One catch-up into a fresh passive; CPU and wall seconds."""
    tmp = Path(tempfile.mkdtemp(prefix="twinmq-passive-apply-"))
    settings = BrokerSettings.model_validate(
        {
            "data_dir": tmp,
            "port": 0,
            "admin_port": 0,
            "fsync": opts.fsync,
            "audit": opts.audit,
            "log_level": "WARNING",
            "role": "passive",
            "epoch": 1,
        }
    )
    chunks = build_chunks(opts.messages, opts.size)
    broker = Broker(settings)
    broker.committer.start()
    replica = ReplicaClient(broker, "127.0.0.1:1")
    link = FakeLink()
    session = _Session(replica, link)  # type: ignore[arg-type]
    broker.committer.await_durable(session)
    profiler = cProfile.Profile() if opts.profile else None
    per_chunk: list[float] = []
    collections = Collections()
    gc.callbacks.append(collections)
    collections.active = True
    cpu, wall, loop_cpu = time.process_time(), time.perf_counter(), time.thread_time()
    if profiler is not None:
        profiler.enable()
    with contextlib.suppress(Done):
        await replica._apply(frame_source(chunks, link, per_chunk), session)
    if profiler is not None:
        profiler.disable()
    loop_cpu = time.thread_time() - loop_cpu
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    collections.active = False
    gc.callbacks.remove(collections)
    held = sum(len(q.entries) for q in broker.vhost.queues.values())
    assert held == opts.messages, f"the passive holds {held} of {opts.messages}"
    await broker.committer.stop()
    await broker.journal.close()
    if broker.committer.audit is not None:
        broker.committer.audit.close()
    result: dict[str, Any] = {
        "messages": opts.messages,
        "size": opts.size,
        "chunks": len(chunks),
        "cpu_us_per_message": round(cpu / opts.messages * 1e6, 2),
        "loop_cpu_us_per_message": round(loop_cpu / opts.messages * 1e6, 2),
        "chunk_loop_cpu_ms_p50": round(quantile(per_chunk, 0.5) * 1e3, 2),
        "chunk_loop_cpu_ms_max": round(max(per_chunk, default=0) * 1e3, 2),
        "gc_runs_gen012": [sum(1 for g, _ in collections.runs if g == n) for n in range(3)],
        "gc_longest_ms": round(max((s for _, s in collections.runs), default=0) * 1e3, 1),
        "gc_total_ms": round(sum(s for _, s in collections.runs) * 1e3, 1),
        "wall_s": round(wall, 2),
        "mb_per_s_cpu_bound": round(sum(map(len, chunks)) / cpu / 1e6, 1),
    }
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        result["profile"] = out.getvalue()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--fsync", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--audit", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--profile", action="store_true")
    opts = parser.parse_args()
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    result = runner(run(opts))
    profile = result.pop("profile", None)
    print(result)
    if profile:
        print(profile)


if __name__ == "__main__":
    main()
