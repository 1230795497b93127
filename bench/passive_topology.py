#!/usr/bin/env python3
"""What the passive's writes of replicated topology changes cost: one record per change
against one record per run of changes.

    .venv/bin/python bench/passive_topology.py [--changes 2000] [--run 64] [--runs 3]

A real `Broker` in the passive role (journal on this machine's disk, fsync on, no
audit) given a durable direct exchange and queue (a DEFINITIONS frame), then
`--changes` bindings of them as DEFINITIONS_DELTA frames, as an active sends a
pipelined resync's binds: `--run` of them back to back, then the frame that follows
a group on the link (an acknowledged one). Two ways, alternated run by run:

- `per-change`: each delta decoded and applied with its own save (`apply_delta`
  without staging: one append and one fsync of the definitions log each, as the
  passive did before);
- `grouped`: the passive's apply loop (`ReplicaClient._apply`), which stages each
  run and writes it before the next frame (one append, one fsync per run).

Reported: wall microseconds per change (mean of the runs) and definitions-log
records written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
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
    decode_model,
    encode,
    encode_batch,
)
from twinmq.broker.replication.replica import ReplicaClient, _Session
from twinmq.broker.server import Broker
from twinmq.broker.settings import BrokerSettings

EX, Q = "bench.x", "bench.q"
TOPOLOGY = Definitions(
    exchanges=[ExchangeDef(name=EX, type="direct")], queues=[QueueDef(name=Q, qid=1)], next_qid=2
)


class _Transport:
    def is_closing(self) -> bool:
        return False


class _Link:
    transport = _Transport()

    def write(self, data: bytes) -> None:
        """The passive's acknowledgements (not looked at)."""


class _Done(Exception):
    pass


def _deltas(count: int) -> list[bytes]:
    return [
        encode(
            FrameType.DEFINITIONS_DELTA,
            DefinitionsDelta(add_bindings=[BindingDef(exchange=EX, queue=Q, routing_key=f"k.{i}")]),
        )
        for i in range(count)
    ]


async def run_once(directory: Path, grouped: bool, changes: int, run: int) -> tuple[float, int]:
    """(wall seconds, definitions-log records) for `changes` replicated changes."""
    settings = BrokerSettings.model_validate(
        {"data_dir": directory, "port": 0, "admin_port": 0, "fsync": True, "audit": False,
         "log_level": "WARNING", "role": "passive", "epoch": 1}
    )  # fmt: skip
    broker = Broker(settings)
    broker.committer.start()
    try:
        broker.vhost.apply_definitions(TOPOLOGY)
        frames = _deltas(changes)
        decoder = FrameDecoder()
        started = time.perf_counter()
        if grouped:
            replica = ReplicaClient(broker, "127.0.0.1:1")
            session = _Session(replica, _Link())  # type: ignore[arg-type]
            queued: list[tuple[FrameType, bytes]] = []
            for n in range(0, changes, run):
                for raw in frames[n : n + run]:
                    queued.extend(decoder.feed(raw))
                queued.extend(decoder.feed(encode_batch(n + 1, 0, b"", FrameType.DEDUP_KEYS)))

            async def next_frame() -> tuple[FrameType, bytes]:
                if not queued:
                    raise _Done
                return queued.pop(0)

            with contextlib.suppress(_Done):
                await replica._apply(next_frame, session)
        else:
            for raw in frames:
                ((_ftype, payload),) = decoder.feed(raw)
                broker.vhost.apply_delta(decode_model(DefinitionsDelta, payload))
        wall = time.perf_counter() - started
        records = deflog.load(directory / "journal").log_records
        assert len(broker.vhost.exchanges[EX].bindings) == changes
        return wall, records
    finally:
        await broker.committer.stop()
        await broker.journal.close()


def main() -> None:
    """Both ways, alternated; a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=2000)
    parser.add_argument("--run", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default="/var/tmp", help="where the data directories go")
    args = parser.parse_args()
    walls: dict[str, list[float]] = {"per-change": [], "grouped": []}
    records: dict[str, int] = {}
    for _ in range(args.runs):
        for name in walls:
            with tempfile.TemporaryDirectory(dir=args.dir) as directory:
                wall, written = asyncio.run(
                    run_once(Path(directory), name == "grouped", args.changes, args.run)
                )
            walls[name].append(wall)
            records[name] = written
    print(f"{args.changes} changes, runs of {args.run}, fsync on, {args.runs} runs each")
    print(f"{'way':>11} {'µs per change':>14} {'min':>8} {'max':>8} {'log records':>12}")
    for name, values in walls.items():
        per = [v / args.changes * 1e6 for v in values]
        print(
            f"{name:>11} {statistics.fmean(per):>14.0f} {min(per):>8.0f} {max(per):>8.0f} "
            f"{records[name]:>12}"
        )


if __name__ == "__main__":
    main()
