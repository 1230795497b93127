#!/usr/bin/env python3
"""TwinMQ's DR mirror vs a RabbitMQ dynamic shovel, the same load on both.

    .venv/bin/python bench/mirror_vs_shovel.py [--runs 3] [--seconds 8] [--cut-messages 20000]

Per run, alternating which goes first, two fresh sites of each on loopback, the link
through a `FaultProxy`: TwinMQ site A mirroring to site B (tests/mirrorsites.py
`Sites`); RabbitMQ node A with a dynamic shovel (rabbitmq_shovel, `ack-mode
on-confirm`, `reconnect-delay 1`, prefetch at its default) from queue Q on A to queue Q
on node B (bench/rabbitmq_node.py). A mirror copies (A keeps its messages), a shovel
moves (A's queue is drained): B's queue fills the same way in both. Phases:

1. load: one publisher on A keeps `--window` persistent 1000-byte messages unconfirmed
   for `--seconds` after a 1 s warm-up: confirms/s on A; B's queue depth is sampled every
   0.1 s (passive declare) and the **lag** of a sample is the age of the oldest message
   published on A and not yet in B's queue (0 when B has all); then the time until B
   holds every message after the last publish (to the next 0.1 s sample).
2. cut: `--cut-messages` confirmed messages on a second queue while the link is cut 3
   times (0.5 s each); once B's queue is quiet, it is consumed: confirmed-but-lost and
   duplicates.

Numbers only: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import mirrorsites  # noqa: E402
import rabbitmq_node  # noqa: E402
import xsite  # noqa: E402

from twinmq.testing.faultproxy import FaultProxy  # noqa: E402
from twinmq.testing.waiting import wait_for  # noqa: E402

LOAD_QUEUE = "bench-load"
CUT_QUEUE = "bench-cut"


@dataclass
class Rig:
    """Site A and site B (AMQP URLs), the link's proxy, and how to set up a queue."""

    name: str
    source_url: str
    dest_url: str
    proxy: FaultProxy
    prepare: Callable[[str], None]  # declare the queue; return once a message crosses

    @property
    def source(self) -> str:
        """host:port of site A."""
        return self.source_url.rsplit("@", 1)[1]

    @property
    def dest(self) -> str:
        """host:port of site B."""
        return self.dest_url.rsplit("@", 1)[1]


@contextlib.contextmanager
def _channel(url: str) -> Iterator[Any]:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        yield connection.channel()
    finally:
        with contextlib.suppress(Exception):
            connection.close()


def _warm_up(source_url: str, dest_url: str, queue: str) -> None:
    """Publish one message (phase 0) on A and wait until B's `queue` holds it."""
    with _channel(source_url) as ch:
        ch.confirm_delivery()
        ch.basic_publish("", queue, xsite.body(0, 1, 16), pika.BasicProperties(delivery_mode=2))

    def arrived() -> bool:
        with contextlib.suppress(Exception):
            return xsite.depth(dest_url, queue) >= 1
        return False

    wait_for(f"a message through the link into {queue}", arrived, 60)


@contextlib.contextmanager
def twinmq_rig(tmp: Path) -> Iterator[Rig]:
    """Site A mirroring to site B (tests/mirrorsites.py) through a proxy."""
    with mirrorsites.Sites(tmp, proxied=True) as sites:
        assert sites.link is not None
        source_url = f"amqp://guest:guest@127.0.0.1:{sites.source.port}"
        dest_url = f"amqp://guest:guest@127.0.0.1:{sites.mirror.port}"

        def prepare(queue: str) -> None:
            with _channel(source_url) as ch:
                ch.queue_declare(queue, durable=True)
            _warm_up(source_url, dest_url, queue)

        yield Rig("TwinMQ", source_url, dest_url, sites.link, prepare)


@contextlib.contextmanager
def rabbitmq_rig(tmp: Path) -> Iterator[Rig]:
    """Node A with rabbitmq_shovel, node B; each queue gets a dynamic shovel A -> B."""
    with (
        rabbitmq_node.RabbitNode(plugins=("rabbitmq_shovel",)) as a,
        rabbitmq_node.RabbitNode() as b,
        FaultProxy(f"127.0.0.1:{b.port}") as proxy,
    ):

        def prepare(queue: str) -> None:
            for node in (a, b):
                with _channel(node.url) as ch:
                    ch.queue_declare(queue, durable=True)
            shovel = {
                "src-protocol": "amqp091",
                "src-uri": a.url,
                "src-queue": queue,
                "dest-protocol": "amqp091",
                "dest-uri": f"amqp://guest:guest@{proxy.address}",
                "dest-queue": queue,
                "ack-mode": "on-confirm",
                "reconnect-delay": 1,
            }
            a.ctl("set_parameter", "shovel", f"shovel-{queue}", json.dumps(shovel))
            _warm_up(a.url, b.url, queue)

        yield Rig("RabbitMQ", a.url, b.url, proxy, prepare)


class DepthSampler:
    """B's queue depth every `interval` s on one connection, in a thread: (time, depth)."""

    def __init__(self, url: str, queue: str, interval: float = 0.1) -> None:
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url, queue, interval), daemon=True)

    def _run(self, url: str, queue: str, interval: float) -> None:
        connection = pika.BlockingConnection(pika.URLParameters(url))
        try:
            ch = connection.channel()
            while not self._stop.is_set():
                ok = ch.queue_declare(queue, passive=True)
                self.samples.append((time.perf_counter(), int(ok.method.message_count)))
                self._stop.wait(interval)
        finally:
            with contextlib.suppress(Exception):
                connection.close()

    def __enter__(self) -> DepthSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def phase_load(rig: Rig, opts: argparse.Namespace) -> dict[str, float]:
    rig.prepare(LOAD_QUEUE)
    base = 1  # the warm-up message
    with DepthSampler(rig.dest_url, LOAD_QUEUE) as sampler:
        published = asyncio.run(
            xsite.publish(
                rig.source,
                "",
                LOAD_QUEUE,
                phase=1,
                window=opts.window,
                size=opts.size,
                seconds=opts.seconds,
            )
        )
        total = len(published.sent_ns)
        wait_for(
            "B holds every message",
            lambda: bool(sampler.samples) and sampler.samples[-1][1] >= base + total,
            300,
            interval=0.05,
        )
    # From the last publish to the first sample with every message on B.
    complete = next(at for at, d in sampler.samples if d >= base + total)
    drained = max(0.0, complete - published.sent_ns[-1] / 1e9)
    sent = [ns / 1e9 for ns in published.sent_ns]
    start, end = sent[0] + 1.0, sent[0] + 1.0 + opts.seconds
    lags: list[float] = []
    for at, d in sampler.samples:
        if not start <= at < end:
            continue
        arrived = d - base
        sent_by_then = bisect.bisect_right(sent, at)
        lags.append(at - sent[arrived] if arrived < sent_by_then else 0.0)
    return {
        "confirms/s": published.measured,
        "lag p50 ms": xsite.percentile(lags, 0.5) * 1e3,
        "lag p99 ms": xsite.percentile(lags, 0.99) * 1e3,
        "drain s": drained,
    }


def phase_cut(rig: Rig, opts: argparse.Namespace) -> tuple[int, int, int]:
    rig.prepare(CUT_QUEUE)

    async def cuts(publisher: asyncio.Task[xsite.Published]) -> None:
        for _ in range(3):
            await asyncio.sleep(opts.cut_gap)
            if publisher.done():
                return
            rig.proxy.cut()
            await asyncio.sleep(0.5)
            rig.proxy.heal()

    async def run() -> xsite.Published:
        publisher = asyncio.create_task(
            xsite.publish(
                rig.source,
                "",
                CUT_QUEUE,
                phase=2,
                window=opts.window,
                size=opts.size,
                count=opts.cut_messages,
            )
        )
        await cuts(publisher)
        return await publisher

    published = asyncio.run(run())
    need = 1 + len(published.confirmed)
    # Quiet: B holds at least every confirmed message and its depth did not move for 5 s
    # (late duplicates would show).
    last: list[int] = [-1]
    since = [time.perf_counter()]

    def quiet() -> bool:
        d = xsite.depth(rig.dest_url, CUT_QUEUE)
        if d != last[0]:
            last[0], since[0] = d, time.perf_counter()
        return d >= need and time.perf_counter() - since[0] >= 5.0

    wait_for("B's queue quiet", quiet, 300, interval=0.2)
    held = last[0]

    async def drain() -> xsite.Received:
        received = xsite.Received()
        consumer = asyncio.create_task(xsite.consume(rig.dest, CUT_QUEUE, received))
        await xsite.wait_quiet(
            received, lambda: len(received.seqs) >= held, consumer, quiet=0.5, limit=300
        )
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await consumer
        return received

    return xsite.count_loss(published, asyncio.run(drain()), 2)


def one_run(name: str, tmp: Path, opts: argparse.Namespace, results: dict[str, Any]) -> None:
    rig_of = twinmq_rig if name == "TwinMQ" else rabbitmq_rig
    out = results[name]
    with rig_of(tmp) as rig:
        load = phase_load(rig, opts)
        for k, v in load.items():
            out.setdefault(k, []).append(v)
        confirmed, lost, dups = phase_cut(rig, opts)
        out.setdefault("confirmed", []).append(confirmed)
        out.setdefault("lost", []).append(lost)
        out.setdefault("duplicates", []).append(dups)
    print(
        f"  {name}: {load['confirms/s']:,.0f} confirms/s on A, lag p50 {load['lag p50 ms']:.0f}"
        f" ms p99 {load['lag p99 ms']:.0f} ms, B complete {load['drain s']:.2f} s after the "
        f"last publish; cut: {confirmed} confirmed, {lost} lost, {dups} duplicates",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs per broker (order alternated)")
    p.add_argument("--seconds", type=float, default=8.0, help="load phase, after 1 s warm-up")
    p.add_argument("--window", type=int, default=500, help="unconfirmed messages in flight")
    p.add_argument("--size", type=int, default=1000)
    p.add_argument("--cut-messages", type=int, default=20000)
    p.add_argument("--cut-gap", type=float, default=1.0, help="seconds between link cuts")
    opts = p.parse_args()
    rabbitmq_node.ensure_installed()
    results = xsite.run_alternated(
        opts.runs, "twinmq-xbench-mirror-", lambda name, tmp, res: one_run(name, tmp, opts, res)
    )
    rows = [
        ("confirms/s on A", "confirms/s", "{:,.0f}"),
        ("lag p50 ms (oldest message not yet on B)", "lag p50 ms", "{:.0f}"),
        ("lag p99 ms", "lag p99 ms", "{:.0f}"),
        ("B complete after the last publish, s (0.1 s samples)", "drain s", "{:.2f}"),
        (f"cut: confirmed of {opts.cut_messages}", "confirmed", "{:,.0f}"),
        ("cut: confirmed but lost on B", "lost", "{:,.0f}"),
        ("cut: twice on B", "duplicates", "{:,.0f}"),
    ]
    xsite.print_table(results, rows, opts.runs, ("TwinMQ mirror", "RabbitMQ shovel"))


if __name__ == "__main__":
    main()
