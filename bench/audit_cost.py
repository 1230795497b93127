#!/usr/bin/env python3
"""Confirm throughput and latency of one broker process with the audit log on and off.

    .venv/bin/python bench/audit_cost.py [--runs 5] [--seconds 8] [--window 500]

Starts a real broker (`twinmq-broker`, fsync on) per run, alternating `--audit`
and `--no-audit` so both see the same machine load over time; one publisher on
a raw AMQP connection (`bench/amqp_raw.py`, then asyncio streams, no client library
on the hot path) keeps `--window` persistent `--size`-byte messages unconfirmed on a
durable queue and counts confirms. Each run reports confirms per second and the
per-confirm-frame latency (publish written to its ack read) p50/p99, after a
warm-up of one second. Numbers only: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import struct
import sys
import tempfile
import time
from pathlib import Path

from pamqp import commands

sys.path.insert(0, str(Path(__file__).resolve().parent))
from amqp_raw import open_channel

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.rawamqp import publish as publish_frames

QUEUE = "audit-cost"
_HEAD = struct.Struct(">BHI")
_ACK = b"\x00\x3c\x00\x50"  # basic.ack (class 60, method 80)


async def publish(port: int, seconds: float, window: int, size: int) -> tuple[float, list[float]]:
    """Confirms per second over `seconds` after a 1 s warm-up, and confirm latencies."""
    # Set up blocking, then publish and read acks on asyncio streams over the same socket.
    setup = open_channel("127.0.0.1", port, QUEUE, durable=True)
    reader, writer = await asyncio.open_connection(sock=setup.sock)
    persistent = commands.Basic.Properties(delivery_mode=2)
    one = publish_frames(1, QUEUE, b"x" * size, properties=persistent)
    sent = 0
    confirmed = 0
    sent_at: dict[int, float] = {}
    latencies: list[float] = []
    more = asyncio.Event()
    start = time.perf_counter()
    measure_from = start + 1.0
    end = measure_from + seconds
    counted_from = 0

    async def read_acks() -> None:
        nonlocal confirmed, counted_from
        buf = bytearray()
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                raise ConnectionError("broker closed the connection")
            buf += chunk
            pos = 0
            now = time.perf_counter()
            while len(buf) - pos >= 8:
                _kind, _ch, size_ = _HEAD.unpack_from(buf, pos)
                if len(buf) - pos < size_ + 8:
                    break
                payload = bytes(buf[pos + 7 : pos + 7 + size_])
                pos += size_ + 8
                if payload[:4] == _ACK:
                    tag = struct.unpack_from(">Q", payload, 4)[0]
                    if tag in sent_at and now >= measure_from:
                        latencies.append(now - sent_at[tag])
                    for t in range(confirmed + 1, tag + 1):
                        sent_at.pop(t, None)
                    confirmed = max(confirmed, tag)
                    if not counted_from and now >= measure_from:
                        counted_from = confirmed
                    more.set()
            del buf[:pos]

    acks = asyncio.create_task(read_acks())
    try:
        while time.perf_counter() < end:
            room = window - (sent - confirmed)
            if room <= 0:
                more.clear()
                await more.wait()
                continue
            batch = min(room, 50)
            now = time.perf_counter()
            for _ in range(batch):
                sent += 1
                sent_at[sent] = now
            writer.write(one * batch)
            await writer.drain()
        counted = confirmed - counted_from
    finally:
        acks.cancel()
        writer.close()
    return counted / seconds, latencies


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="runs per setting (alternating)")
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--window", type=int, default=500, help="unconfirmed messages in flight")
    p.add_argument("--size", type=int, default=1000)
    opts = p.parse_args()
    results: dict[str, list[tuple[float, float, float]]] = {"audit on": [], "audit off": []}
    for run in range(opts.runs):
        for name, flag in (("audit on", "--audit"), ("audit off", "--no-audit")):
            with (
                tempfile.TemporaryDirectory(prefix="twinmq-audit-cost-") as tmp,
                BrokerProcess(Path(tmp) / "data", name="audit-cost", extra_args=[flag]) as b,
            ):
                rate, lat = asyncio.run(publish(b.port, opts.seconds, opts.window, opts.size))
            p50, p99 = percentile(lat, 0.5) * 1e3, percentile(lat, 0.99) * 1e3
            results[name].append((rate, p50, p99))
            print(
                f"run {run + 1} {name}: {rate:,.0f} confirms/s, p50 {p50:.2f} ms, p99 {p99:.2f} ms"
            )
    print()
    print(
        "| setting | confirms/s median (min-max) | p50 ms median (min-max) "
        "| p99 ms median (min-max) |"
    )
    print("|---|---:|---:|---:|")
    for name, rows in results.items():
        cells = []
        for i, fmt in ((0, "{:,.0f}"), (1, "{:.2f}"), (2, "{:.2f}")):
            col = [r[i] for r in rows]
            cells.append(
                f"{fmt.format(statistics.median(col))} "
                f"({fmt.format(min(col))}-{fmt.format(max(col))})"
            )
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
