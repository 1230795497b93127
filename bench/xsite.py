"""The cross-site benchmarks' load generator and summaries, the same for TwinMQ and RabbitMQ.

One asyncio publisher (`twinmq.testing.amqpclient.AMQPClient`: pamqp frames, no client
library in between) keeps `window` persistent messages unconfirmed; every body starts
with (phase, sequence number, send time in ns of this process's monotonic clock), so a
consumer in the same process reads the end-to-end latency, and the sequence numbers
count what was lost or delivered twice. Numbers only: nothing here asserts a timing.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pika

from twinmq.testing.amqpclient import AMQPClient, ClientError

_STAMP = struct.Struct(">IQQ")  # phase, seq (1-based), perf_counter_ns at the publish


def body(phase: int, seq: int, size: int) -> bytes:
    """A message body of `size` bytes (at least the stamp) stamped now."""
    stamp = _STAMP.pack(phase, seq, time.perf_counter_ns())
    return stamp + b"x" * max(0, size - len(stamp))


def stamp(data: bytes) -> tuple[int, int, int]:
    """(phase, seq, send time ns) of a body made by `body`."""
    return _STAMP.unpack_from(data)


@dataclass
class Published:
    """What a publisher sent and what the broker confirmed."""

    sent_ns: list[int] = field(default_factory=list)  # sent_ns[seq - 1]
    status: bytearray = field(default_factory=bytearray)  # per seq: 0 open, 1 ack, 2 nack
    floor: int = 0  # every seq <= floor is settled
    measured: float = 0.0  # confirms per second over the measured span
    answered: int = 0  # seqs settled (ack or nack): `settled()` is asked per publish round

    @property
    def confirmed(self) -> set[int]:
        """Sequence numbers the broker acknowledged."""
        return {seq for seq, s in enumerate(self.status, 1) if s == 1}

    def settle(self, tag: int, multiple: bool, ack: bool) -> None:
        """Record a basic.ack / basic.nack."""
        mark = 1 if ack else 2
        if multiple:
            for seq in range(self.floor + 1, tag + 1):
                if self.status[seq - 1] == 0:
                    self.status[seq - 1] = mark
                    self.answered += 1
        elif self.status[tag - 1] == 0:
            self.status[tag - 1] = mark
            self.answered += 1
        while self.floor < len(self.status) and self.status[self.floor]:
            self.floor += 1

    def abandon(self) -> None:
        """Count every publish still unanswered as not confirmed (its connection is gone:
        it may or may not have reached the broker)."""
        for index, state in enumerate(self.status):
            if state == 0:
                self.status[index] = 2
                self.answered += 1
        self.floor = len(self.status)

    def settled(self) -> int:
        """How many publishes were answered (ack or nack); constant time (it was a
        count over every publish: a million-message run slowed to tens a second)."""
        return self.answered


async def publish(
    address: str,
    exchange: str,
    key: str,
    *,
    phase: int,
    window: int,
    size: int,
    seconds: float | None = None,
    count: int | None = None,
    warmup: float = 1.0,
    out: Published | None = None,
) -> Published:
    """Publish persistent messages with confirms, at most `window` unconfirmed, for
    `warmup` + `seconds` (confirms/s measured over `seconds`) or `count` messages; waits
    for the last confirms (up to 60 s) before returning. With `out` (a publisher going on
    after its broker went away: `Published.abandon` first), the sequence numbers go on
    from what it holds and `count` counts them all."""
    client = await AMQPClient.connect(address, heartbeat=10, within=10)
    out = out if out is not None else Published()
    base = len(out.sent_ns)  # this connection's delivery tags start after what was sent
    more = asyncio.Event()

    def on_confirm(tag: int, multiple: bool, ack: bool) -> None:
        out.settle(base + tag, multiple, ack)
        more.set()

    client.on_confirm = on_confirm
    await client.confirm_select()
    start = time.perf_counter()
    measure_from = start + warmup
    end = measure_from + (seconds or 0.0)
    counted_from: int | None = None
    try:
        while True:
            now = time.perf_counter()
            if seconds is not None:
                if counted_from is None and now >= measure_from:
                    counted_from = out.settled()
                if now >= end:
                    break
            elif len(out.sent_ns) >= (count or 0):
                break
            room = window - (len(out.sent_ns) - out.settled())
            if count is not None:
                room = min(room, count - len(out.sent_ns))
            if room <= 0:
                more.clear()
                with _quiet():
                    await asyncio.wait_for(more.wait(), 1.0)
                client.check()
                continue
            for _ in range(min(room, 50)):
                seq = len(out.sent_ns) + 1
                out.status.append(0)
                data = body(phase, seq, size)
                out.sent_ns.append(_STAMP.unpack_from(data)[2])
                client.publish(key, data, exchange=exchange)
            await client.drain()
        if seconds is not None:
            out.measured = (out.settled() - (counted_from or 0)) / seconds
        deadline = time.perf_counter() + 60
        while out.settled() < len(out.sent_ns) and time.perf_counter() < deadline:
            more.clear()
            with _quiet():
                await asyncio.wait_for(more.wait(), 1.0)
            client.check()  # a closed connection answers nothing more
    finally:
        await client.close()
    return out


class _quiet:
    """Suppress a wait's timeout (a loop re-checks its condition)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, *_: object) -> bool:
        return kind is TimeoutError


@dataclass
class Received:
    """What a consumer got: (phase, seq) in arrival order and latencies in seconds."""

    seqs: list[tuple[int, int]] = field(default_factory=list)
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (arrival, latency)
    last_ns: int = 0


async def consume(address: str, queue: str, out: Received, prefetch: int = 1000) -> None:
    """Consume `queue` with acks into `out` until cancelled."""
    client = await AMQPClient.connect(address, heartbeat=10, within=10)
    try:
        await client.qos(prefetch)
        await client.consume(queue)
        while True:
            delivery = await client.deliveries.get()
            if delivery is None:
                raise client.error or ClientError("consumer closed")
            now = time.perf_counter_ns()
            if len(delivery.body) < _STAMP.size:  # a probe or warm-up message, not load
                client.ack(delivery.tag)
                continue
            phase, seq, sent = stamp(delivery.body)
            out.seqs.append((phase, seq))
            out.latencies.append((now / 1e9, (now - sent) / 1e9))
            out.last_ns = now
            client.ack(delivery.tag)
    finally:
        await client.close()


async def wait_quiet(
    received: Received,
    done: Callable[[], bool],
    consumer: asyncio.Task[None],
    quiet: float = 3.0,
    limit: float = 120.0,
) -> None:
    """Return once `done()` holds and nothing arrived for `quiet` s (to see late duplicates),
    or after `limit` s; raise the `consumer`'s error if it failed."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        if consumer.done():
            consumer.result()  # raises what stopped it
            raise ClientError("the consumer stopped")
        idle = (time.perf_counter_ns() - received.last_ns) / 1e9
        if done() and idle >= quiet:
            return
        await asyncio.sleep(0.2)


def count_loss(published: Published, received: Received, phase: int) -> tuple[int, int, int]:
    """(confirmed, confirmed but never delivered, delivered more than once) for `phase`."""
    got = [seq for p, seq in received.seqs if p == phase]
    confirmed = published.confirmed
    return len(confirmed), len(confirmed - set(got)), len(got) - len(set(got))


def depth(url: str, queue: str) -> int:
    """Messages ready in `queue` (a passive declare on a fresh connection)."""
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ok = connection.channel().queue_declare(queue, passive=True)
        return int(ok.method.message_count)
    finally:
        connection.close()


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, nearest rank (nan if empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def cell(values: list[float], fmt: str) -> str:
    """`median (min-max)` of `values` with `fmt` ('-' if empty)."""
    if not values:
        return "-"
    return (
        f"{fmt.format(statistics.median(values))} "
        f"({fmt.format(min(values))}-{fmt.format(max(values))})"
    )


def ratio(twinmq: list[float], rabbitmq: list[float]) -> str:
    """TwinMQ / RabbitMQ of the medians."""
    if not twinmq or not rabbitmq or statistics.median(rabbitmq) == 0:
        return "-"
    return f"{statistics.median(twinmq) / statistics.median(rabbitmq):.2f}x"


def load_average() -> str:
    """The 1/5/15-minute load average."""
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


Results = dict[str, dict[str, list[float]]]
"""Per broker ("TwinMQ", "RabbitMQ"): per measure, one value per run."""


def run_alternated(
    runs: int, prefix: str, one_run: Callable[[str, Path, Results], None]
) -> Results:
    """`one_run(broker, folder, results)` `runs` times per broker, the order alternated,
    each in a fresh temporary folder; the load average printed around it all."""
    results: Results = {"TwinMQ": {}, "RabbitMQ": {}}
    print(f"load average at the start: {load_average()}", flush=True)
    for run in range(runs):
        order = ("TwinMQ", "RabbitMQ") if run % 2 == 0 else ("RabbitMQ", "TwinMQ")
        print(f"run {run + 1} ({' then '.join(order)}), load {load_average()}", flush=True)
        for name in order:
            with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
                one_run(name, Path(tmp), results)
    print(f"load average at the end: {load_average()}")
    return results


def print_table(
    results: Results, rows: list[tuple[str, str, str]], runs: int, columns: tuple[str, str]
) -> None:
    """`rows` (label, measure, format) as a Markdown table, median (min-max) per broker
    under `columns` and their ratio (a measure neither broker has is left out), then
    every run's values."""
    t, r = results["TwinMQ"], results["RabbitMQ"]
    print()
    print(f"{runs} runs per broker, median (min-max); ratio = TwinMQ / RabbitMQ (medians)")
    print()
    print(f"| measure | {columns[0]} | {columns[1]} | ratio |")
    print("|---|---:|---:|---:|")
    for label, key, fmt in rows:
        if key not in t and key not in r:
            continue
        tv, rv = t.get(key, []), r.get(key, [])
        print(f"| {label} | {cell(tv, fmt)} | {cell(rv, fmt)} | {ratio(tv, rv)} |")
    print()
    for name in ("TwinMQ", "RabbitMQ"):
        print(
            f"{name} run by run: "
            + json.dumps({k: [round(x, 2) for x in v] for k, v in results[name].items()})
        )
