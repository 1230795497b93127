#!/usr/bin/env python3
"""Source confirm throughput with the DR mirror on vs off, and the mirror's lag meanwhile.

    .venv/bin/python bench/mirror_overhead.py [--runs 3] [--seconds 6] [--window 500]
        [--mirror-only] [--rtt 0]

Per run, alternating: "off" is one broker; "on" is the same broker with
`--mirror-to` a second broker (`--mirror-port`, the mirror site) on loopback.
One publisher on a raw AMQP connection (`audit_cost.publish`: no client library
on the hot path) keeps `--window` persistent 1000-byte messages unconfirmed and
counts confirms per second. With the mirror on (the clock starts once the link is
connected), the lag is read two ways: the source's histogram
`twinmq_mirror_event_lag_seconds` (each event, from its creation in its group
commit to the mirror's acknowledgement of it durable, on the source's clock),
counted over the run and the drain after it, as p50/p99 interpolated like
Prometheus' `histogram_quantile` and as the share of events at or under 250 ms
(a bucket bound: exact); and the source's `/status`, sampled every 0.2 s for the
age of its oldest unacknowledged event. After the publisher stops, the time
until the mirror has acknowledged everything is measured. `--mirror-only` skips
the "off" runs. `--rtt MS` puts the link through a proxy that delays every chunk
MS/2 each way (`twinmq.testing.faultproxy` in a process of its own, pipelined: a
long link, not a slow one), since netem is not in this machine's kernel. Numbers
only: nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_cost import percentile, publish
from mirror_bidi import GOAL, buckets, quantile, within

from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.launcher import BrokerProcess, free_port

TOKEN = "bench-mirror-token"


def mirror_section(broker: BrokerProcess) -> dict[str, float]:
    status = broker.admin.status(timeout=5).model_dump(mode="json")
    section: dict[str, float] = status["mirror"]
    return section


def _serve_delayed(upstream: str, rtt: float, conn: Connection) -> None:
    with FaultProxy(upstream) as link:
        link.delay(rtt / 2)  # each way
        conn.send(link.address)
        conn.recv()  # until the bench is done with it


@contextlib.contextmanager
def delayed_link(upstream: str, rtt: float) -> Iterator[str]:
    """A proxy to `upstream` adding `rtt` seconds of round trip, in a process of its own
    (in this one it would take the publisher's interpreter lock); yields its address."""
    ours, theirs = multiprocessing.Pipe()
    proxy = multiprocessing.Process(target=_serve_delayed, args=(upstream, rtt, theirs))
    proxy.start()
    try:
        yield str(ours.recv())
    finally:
        ours.send("done")
        proxy.join(10)


def run_on(
    tmp: Path, opts: argparse.Namespace
) -> tuple[float, list[float], float, dict[str, float]]:
    """Confirms/s, sampled lag ages, seconds to drain after the publisher stopped, and
    the lag histogram's p50, p99, share within 250 ms and event count over the run."""
    port = free_port()
    mirror_args = ["--mirror-port", str(port), "--mirror-token", TOKEN]
    ages: list[float] = []
    with contextlib.ExitStack() as stack:
        target = f"127.0.0.1:{port}"
        if opts.rtt:
            target = stack.enter_context(delayed_link(target, opts.rtt / 1000))
        stack.enter_context(
            BrokerProcess(tmp / "mirror", name="bench-mirror", extra_args=mirror_args)
        )
        source = stack.enter_context(
            BrokerProcess(
                tmp / "source",
                name="bench-source",
                extra_args=["--mirror-to", target, "--mirror-token", TOKEN],
            )
        )
        while not mirror_section(source)["connected"]:
            time.sleep(0.1)  # the link is up (a heartbeat came back) before the clock starts
        before = buckets(source)
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.2):
                ages.append(mirror_section(source)["oldest_event_age_seconds"])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        rate, _ = asyncio.run(publish(source.port, opts.seconds, opts.window, opts.size))
        stop.set()
        sampler.join()
        stopped = time.perf_counter()
        while mirror_section(source)["queue_events"] > 0:
            time.sleep(0.05)
        drain = time.perf_counter() - stopped
        after = buckets(source)
    histogram = {
        "p50": quantile(0.5, before, after),
        "p99": quantile(0.99, before, after),
        "within": within(GOAL, before, after),
        "events": after[float("inf")] - before.get(float("inf"), 0.0),
    }
    return rate, ages, drain, histogram


def run_off(tmp: Path, opts: argparse.Namespace) -> float:
    with BrokerProcess(tmp / "alone", name="bench-alone") as broker:
        rate, _ = asyncio.run(publish(broker.port, opts.seconds, opts.window, opts.size))
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs per setting (alternating)")
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--window", type=int, default=500, help="unconfirmed messages in flight")
    p.add_argument("--size", type=int, default=1000)
    p.add_argument("--mirror-only", action="store_true", help="skip the runs without a mirror")
    p.add_argument("--rtt", type=float, default=0.0, help="round trip added to the link, ms")
    opts = p.parse_args()
    off: list[float] = []
    on: list[float] = []
    lag_p50: list[float] = []
    lag_p99: list[float] = []
    drains: list[float] = []
    hist: list[dict[str, float]] = []
    for run in range(opts.runs):
        order = ("off", "on") if run % 2 == 0 else ("on", "off")
        for setting in order:
            if setting == "off" and opts.mirror_only:
                continue
            with tempfile.TemporaryDirectory(prefix="twinmq-mirror-bench-") as tmp:
                if setting == "off":
                    off.append(run_off(Path(tmp), opts))
                    print(f"run {run + 1} off: {off[-1]:,.0f} confirms/s", flush=True)
                    continue
                rate, ages, drain, histogram = run_on(Path(tmp), opts)
                on.append(rate)
                hist.append(histogram)
                lag_p50.append(percentile(ages, 0.5))
                lag_p99.append(percentile(ages, 0.99))
                drains.append(drain)
                print(
                    f"run {run + 1} on:  {rate:,.0f} confirms/s, oldest-event age p50 "
                    f"{lag_p50[-1]:.2f} s p99 {lag_p99[-1]:.2f} s, drained {drain:.2f} s after; "
                    f"event lag p50 {histogram['p50'] * 1000:.0f} ms p99 "
                    f"{histogram['p99'] * 1000:.0f} ms, {histogram['within']:.1%} <= 250 ms "
                    f"of {histogram['events']:.0f} events",
                    flush=True,
                )

    def cell(values: list[float], fmt: str) -> str:
        return (
            f"{fmt.format(statistics.median(values))} "
            f"({fmt.format(min(values))}-{fmt.format(max(values))})"
        )

    def lag(key: str, fmt: str, scale: float) -> str:
        return cell([h[key] * scale for h in hist], fmt)

    print()
    print("| setting | confirms/s median (min-max) | event lag p50 ms | event lag p99 ms "
          "| events <= 250 ms | oldest unacked event age p50 / p99 s "
          "| drain after stop s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|")
    if off:
        print(f"| mirror off | {cell(off, '{:,.0f}')} | - | - | - | - | - |")
    print(
        f"| mirror on | {cell(on, '{:,.0f}')} | {lag('p50', '{:.0f}', 1000)} "
        f"| {lag('p99', '{:.0f}', 1000)} | {lag('within', '{:.1%}', 1)} "
        f"| {cell(lag_p50, '{:.2f}')} / {cell(lag_p99, '{:.2f}')} | {cell(drains, '{:.2f}')} |"
    )
    if off:
        print(f"overhead (median): {1 - statistics.median(on) / statistics.median(off):.1%}")


if __name__ == "__main__":
    main()
