#!/usr/bin/env python3
"""Source confirm throughput with the DR mirror on vs off, and the mirror's lag meanwhile.

    .venv/bin/python bench/mirror_overhead.py [--runs 3] [--seconds 6] [--window 500]

Per run, alternating: "off" is one broker; "on" is the same broker with
`--mirror-to` a second broker (`--mirror-port`, the mirror site) on loopback.
One publisher on a raw AMQP connection (`audit_cost.publish`: no client library
on the hot path) keeps `--window` persistent 1000-byte messages unconfirmed and
counts confirms per second. With the mirror on, the source's `/status` is sampled
every 0.2 s for the age of its oldest unacknowledged event (the lag in seconds
as the source sees it) and, after the publisher stops, the time until the mirror
has acknowledged everything is measured. Numbers only: nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_cost import percentile, publish

from twinmq.testing.launcher import BrokerProcess, free_port

TOKEN = "bench-mirror-token"


def mirror_section(broker: BrokerProcess) -> dict[str, float]:
    status = broker.admin.status(timeout=5).model_dump(mode="json")
    section: dict[str, float] = status["mirror"]
    return section


def run_on(tmp: Path, opts: argparse.Namespace) -> tuple[float, list[float], float]:
    """Confirms/s, sampled lag ages, and seconds to drain after the publisher stopped."""
    port = free_port()
    mirror_args = ["--mirror-port", str(port), "--mirror-token", TOKEN]
    source_args = ["--mirror-to", f"127.0.0.1:{port}", "--mirror-token", TOKEN]
    ages: list[float] = []
    with (
        BrokerProcess(tmp / "mirror", name="bench-mirror", extra_args=mirror_args),
        BrokerProcess(tmp / "source", name="bench-source", extra_args=source_args) as source,
    ):
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
    return rate, ages, drain


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
    opts = p.parse_args()
    off: list[float] = []
    on: list[float] = []
    lag_p50: list[float] = []
    lag_p99: list[float] = []
    drains: list[float] = []
    for run in range(opts.runs):
        order = ("off", "on") if run % 2 == 0 else ("on", "off")
        for setting in order:
            with tempfile.TemporaryDirectory(prefix="twinmq-mirror-bench-") as tmp:
                if setting == "off":
                    off.append(run_off(Path(tmp), opts))
                    print(f"run {run + 1} off: {off[-1]:,.0f} confirms/s", flush=True)
                    continue
                rate, ages, drain = run_on(Path(tmp), opts)
                on.append(rate)
                lag_p50.append(percentile(ages, 0.5))
                lag_p99.append(percentile(ages, 0.99))
                drains.append(drain)
                print(
                    f"run {run + 1} on:  {rate:,.0f} confirms/s, oldest-event age p50 "
                    f"{lag_p50[-1]:.2f} s p99 {lag_p99[-1]:.2f} s, drained {drain:.2f} s after",
                    flush=True,
                )

    def cell(values: list[float], fmt: str) -> str:
        return (
            f"{fmt.format(statistics.median(values))} "
            f"({fmt.format(min(values))}-{fmt.format(max(values))})"
        )

    print()
    print("| setting | confirms/s median (min-max) | oldest unacked event age p50 / p99 s "
          "| drain after stop s |")  # fmt: skip
    print("|---|---:|---:|---:|")
    print(f"| mirror off | {cell(off, '{:,.0f}')} | - | - |")
    print(
        f"| mirror on | {cell(on, '{:,.0f}')} | {cell(lag_p50, '{:.2f}')} / "
        f"{cell(lag_p99, '{:.2f}')} | {cell(drains, '{:.2f}')} |"
    )
    print(f"overhead (median): {1 - statistics.median(on) / statistics.median(off):.1%}")


if __name__ == "__main__":
    main()
