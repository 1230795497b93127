#!/usr/bin/env python3
"""CPU cost of TwinMQ's hot path per message, in-process, without sockets or a load generator.

    .venv/bin/python bench/hotpath.py [--messages 200000] [--batch 50] [--profile]

A real `Broker` (journal, group commit, virtual host) on a uvloop loop; a
publisher and a consumer `AMQPProtocol` get bytes through `data_received` and
write into fake transports. Per round the publisher sends `--batch` persistent
1 KB publishes into a quorum-declared queue (confirm mode), the loop turns so
the batch is journaled and confirmed, and the consumer acks every delivery one
by one, as PerfTest does. The result is the process CPU time per message
(main thread and journal thread), which does not depend on the machine's other
load the way a socket benchmark does; `--profile` adds a cProfile table.
fsync is off by default (the syscall's latency is not CPU): `--fsync` turns it on.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop
from pamqp import commands, frame, header
from pamqp.body import ContentBody

from twinmq.broker.server import AMQPProtocol, Broker
from twinmq.broker.settings import BrokerSettings


class FakeTransport:
    """Collects what the broker writes; counts frames of interest."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.bytes = 0
        self.writes = 0
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def write(self, data: bytes) -> None:
        self.writes += 1
        self.bytes += len(data)
        self.chunks.append(data)

    def take(self) -> bytes:
        data = b"".join(self.chunks)
        self.chunks.clear()
        return data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def abort(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """Split raw output into (type, channel, payload)."""
    out = []
    pos = 0
    while pos + 7 <= len(data):
        ftype, channel, size = struct.unpack_from(">BHI", data, pos)
        out.append((ftype, channel, data[pos + 7 : pos + 7 + size]))
        pos += 8 + size
    return out


def enc(channel: int, value: Any) -> bytes:
    return frame.marshal(value, channel)


def handshake() -> bytes:
    return b"".join(
        (
            b"AMQP\x00\x00\x09\x01",
            enc(
                0,
                commands.Connection.StartOk(
                    client_properties={"capabilities": {}},
                    mechanism="PLAIN",
                    response="\0guest\0guest",
                    locale="en_US",
                ),
            ),
            enc(0, commands.Connection.TuneOk(channel_max=2047, frame_max=131072, heartbeat=0)),
            enc(0, commands.Connection.Open(virtual_host="/")),
            enc(1, commands.Channel.Open()),
        )
    )


class BatchDone:
    """A durability waiter (like a channel) that resolves a future at a given batch."""

    def __init__(self, batch: int) -> None:
        self.batch = batch
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def durable(self, batch: int, failed: bool = False) -> bool:
        if batch >= self.batch:
            if not self.done.done():
                self.done.set_result(None)
            return False
        return True

    @staticmethod
    async def wait(broker: Broker) -> None:
        """Return once the group committer told its waiters of the last batch appended."""
        committer = broker.committer
        if committer.last_appended == 0:
            return
        waiter = BatchDone(committer.last_appended)
        committer.await_durable(waiter)
        if committer.last_appended <= committer.complete_batch and not committer.confirm_point():
            return  # already told (before this waiter registered)
        await waiter.done


class _NoMetric:
    """Stands in for a prometheus-client metric (--stub-metrics: what do metrics cost?)."""

    # Per-message counters are added to in place (`metrics.DELIVERED.value += 1`): that
    # addition stays (on this stub), so it is not counted as the metrics' cost.
    value = 0

    def inc(self, amount: float = 1) -> None:
        pass

    def observe(self, amount: float) -> None:
        pass

    def labels(self, *args: object) -> _NoMetric:
        return self


def stub_metrics() -> None:
    from twinmq.broker import metrics

    for name in (
        "PUBLISHED", "DELIVERED", "ACKED", "CONFIRMS", "CONFIRM_LATENCY",
        "COMMIT_BATCH", "FSYNC_LATENCY", "UNROUTABLE",
        # Since the hot-path metrics became plain counters (absent before: skipped).
        "CONFIRMS_ACK", "CONFIRMS_NACK", "AUDIT_RECORDS", "AUDIT_WRITES", "AUDIT_FSYNC_LATENCY",
    ):  # fmt: skip
        if hasattr(metrics, name):
            setattr(metrics, name, _NoMetric())


async def run(opts: argparse.Namespace) -> dict[str, float]:
    if opts.stub_metrics:
        stub_metrics()
    tmp = Path(tempfile.mkdtemp(prefix="twinmq-hotpath-"))
    overrides: dict[str, Any] = dict(kv.split("=", 1) for kv in opts.set)
    settings = BrokerSettings.model_validate(
        {
            "data_dir": tmp,
            "port": 0,
            "admin_port": 0,
            "fsync": opts.fsync,
            "log_level": "WARNING",
            **overrides,
        }
    )
    broker = Broker(settings)
    broker.committer.start()
    pub_t, con_t = FakeTransport(), FakeTransport()
    pub, con = AMQPProtocol(broker), AMQPProtocol(broker)
    pub.connection_made(pub_t)  # type: ignore[arg-type]
    con.connection_made(con_t)  # type: ignore[arg-type]
    queue = "hotpath"
    pub.data_received(
        handshake()
        + enc(
            1,
            commands.Queue.Declare(queue=queue, durable=True, arguments={"x-queue-type": "quorum"}),
        )
        + enc(1, commands.Confirm.Select())
    )
    con.data_received(
        handshake()
        + enc(1, commands.Basic.Qos(prefetch_count=opts.qos))
        + enc(1, commands.Basic.Consume(queue=queue, consumer_tag="c"))
    )
    await asyncio.sleep(0.05)
    pub_t.take()
    con_t.take()
    body = b"x" * opts.size
    one = b"".join(
        (
            enc(1, commands.Basic.Publish(exchange="", routing_key=queue)),
            enc(1, header.ContentHeader(0, len(body), commands.Basic.Properties(delivery_mode=2))),
            enc(1, ContentBody(body)),
        )
    )
    # The client sends in TCP-sized reads: whole batches in one data_received.
    batch = one * opts.batch
    ack = struct.Struct(">BHIHHQBB")
    rounds = opts.messages // opts.batch
    confirmed = delivered = 0
    next_ack = 1

    async def turn() -> None:
        # Let call_soon callbacks (group commit flush, transport flush) and the journal run.
        for _ in range(4):
            await asyncio.sleep(0)

    async def settle() -> None:
        # Flush the group commit, wait (blocked, not spinning) for the journal thread to
        # make it durable, then let the committer confirm and the transports flush.
        await turn()
        await broker.journal.sync(broker.journal.stats.appended_lsn)
        await turn()
        # Wait (blocked) until the waiters heard of the last batch, as a channel does:
        # confirms may also wait for their audit records' fdatasync.
        await BatchDone.wait(broker)
        await turn()

    profiler = cProfile.Profile() if opts.profile else None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if profiler:
        profiler.enable()
    for _ in range(rounds):
        pub.data_received(batch)
        await settle()
        for ftype, _, payload in frames(pub_t.take()):
            if ftype == 1 and payload[:4] == b"\x00\x3c\x00\x50":
                confirmed = struct.unpack_from(">Q", payload, 4)[0]
        n = sum(
            1
            for ftype, _, payload in frames(con_t.take())
            if ftype == 1 and payload[:4] == b"\x00\x3c\x00\x3c"
        )
        delivered += n
        if n:
            con.data_received(
                b"".join(
                    ack.pack(1, 1, 13, 60, 80, tag, 0, 0xCE)
                    for tag in range(next_ack, next_ack + n)
                )
            )
            next_ack += n
    await settle()
    if profiler:
        profiler.disable()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    await broker.committer.stop()
    await broker.journal.close()
    if profiler:
        s = io.StringIO()
        stats = pstats.Stats(profiler, stream=s)
        stats.sort_stats("tottime").print_stats(opts.profile_top)
        print(s.getvalue())
    n = rounds * opts.batch
    if delivered != n or confirmed != n:
        print(f"warning: {delivered} delivered, {confirmed} confirmed of {n}", file=sys.stderr)
    return {
        "messages": n,
        "cpu_us_per_msg": cpu * 1e6 / n,
        "wall_us_per_msg": wall * 1e6 / n,
        "msgs_per_cpu_second": n / cpu,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--messages", type=int, default=200_000)
    p.add_argument("--batch", type=int, default=50, help="publishes per data_received")
    p.add_argument("--size", type=int, default=1000)
    p.add_argument("--qos", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3, help="runs; the best is reported")
    p.add_argument("--fsync", action="store_true")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a broker setting"
    )
    p.add_argument(
        "--stub-metrics", action="store_true", help="replace prometheus metrics by no-ops"
    )
    p.add_argument("--profile", action="store_true", help="cProfile (slows everything ~2x)")
    p.add_argument("--profile-top", type=int, default=30)
    opts = p.parse_args()
    results = [uvloop.run(run(opts)) for _ in range(1 if opts.profile else opts.repeat)]
    best = min(results, key=lambda r: r["cpu_us_per_msg"])
    print(
        f"{best['messages']:.0f} persistent {opts.size}-byte messages, batch {opts.batch}: "
        f"{best['cpu_us_per_msg']:.2f} µs CPU/msg (best of {len(results)}: "
        + ", ".join(f"{r['cpu_us_per_msg']:.2f}" for r in results)
        + f"), {best['msgs_per_cpu_second']:,.0f} msg per CPU-second"
    )


if __name__ == "__main__":
    main()
