#!/usr/bin/env python3
"""The bidirectional mirror's lag with both directions busy.

    .venv/bin/python bench/mirror_bidi.py [--runs 3] [--seconds 6] [--window 500]

Per run: two fresh sites on loopback, each `--mirror-role bidirectional` naming the
other (docs/mirror.md, "Bidirectional mode"). One publisher per site, at once, on a raw
AMQP connection (`audit_cost.publish`), keeps `--window` persistent `--size`-byte
messages unconfirmed on one shared queue name, so both sites write and both links carry
events the whole time. Measured per site:

- the lag histogram `twinmq_mirror_event_lag_seconds` (each acknowledged event, from its
  creation to the other site's acknowledgement, both read on the source's clock), the
  counts taken over the publishing window and the drain after it: p50 and p99 as
  Prometheus' `histogram_quantile` interpolates them, and the share of events at or
  under 250 ms (a bucket bound: exact);
- the age of the oldest unacknowledged event, sampled every 0.2 s from `/status`;
- confirms per second.

Numbers only: nothing asserts a timing.
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
HISTOGRAM = "twinmq_mirror_event_lag_seconds_bucket"
GOAL = 0.25


def buckets(broker: BrokerProcess) -> dict[float, float]:
    """The lag histogram's cumulative bucket counts (upper bound -> count)."""
    out: dict[float, float] = {}
    for line in broker.admin.metrics(timeout=5).splitlines():
        if line.startswith(HISTOGRAM + "{"):
            label, value = line.rsplit(" ", 1)
            bound = label.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if bound == "+Inf" else float(bound)] = float(value)
    return out


def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float:
    """`histogram_quantile(q, ...)` over the counts added between two scrapes."""
    counts = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    total = counts[-1][1]
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound, cumulative in counts:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower  # as Prometheus: the highest finite bound
            share = (rank - below) / (cumulative - below) if cumulative > below else 1.0
            return lower + (bound - lower) * share
        lower, below = bound, cumulative
    return lower


def within(limit: float, before: dict[float, float], after: dict[float, float]) -> float:
    """The share of the events added between two scrapes whose lag was at most `limit`."""
    total = after[float("inf")] - before.get(float("inf"), 0.0)
    return (after[limit] - before.get(limit, 0.0)) / total if total > 0 else float("nan")


def status_of(broker: BrokerProcess) -> dict[str, float]:
    section: dict[str, float] = broker.admin.status(timeout=5).model_dump(mode="json")["mirror"]
    return section


def one_run(tmp: Path, opts: argparse.Namespace) -> list[dict[str, float]]:
    """Per site: confirms/s, lag p50/p99 (histogram), share <= 250 ms, sampled oldest
    unacknowledged event age p99, and the events acknowledged."""
    ports = [free_port(), free_port()]
    names = ("site-a", "site-b")
    args = [
        ["--mirror-id", name, "--mirror-role", "bidirectional", "--mirror-token", TOKEN,
         "--mirror-port", str(ports[i]), "--mirror-to", f"127.0.0.1:{ports[1 - i]}"]
        for i, name in enumerate(names)
    ]  # fmt: skip
    sites = [BrokerProcess(tmp / n, name=n, extra_args=a) for n, a in zip(names, args, strict=True)]
    with sites[0], sites[1]:
        while not all(status_of(site)["connected"] for site in sites):
            time.sleep(0.1)  # both links up (a heartbeat came back) before the clock starts
        before = [buckets(site) for site in sites]
        ages: list[list[float]] = [[], []]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.2):
                for i, site in enumerate(sites):
                    ages[i].append(status_of(site)["oldest_event_age_seconds"])

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()

        async def both() -> list[tuple[float, list[float]]]:
            return list(await asyncio.gather(*(
                publish(site.port, opts.seconds, opts.window, opts.size) for site in sites
            )))  # fmt: skip

        rates = [rate for rate, _ in asyncio.run(both())]
        stop.set()
        sampler.join()
        while any(status_of(site)["queue_events"] > 0 for site in sites):
            time.sleep(0.05)  # the drain's events are part of the run's lag
        after = [buckets(site) for site in sites]
    return [
        {
            "rate": rates[i],
            "p50": quantile(0.5, before[i], after[i]),
            "p99": quantile(0.99, before[i], after[i]),
            "within": within(GOAL, before[i], after[i]),
            "age_p99": percentile(ages[i], 0.99),
            "events": after[i][float("inf")] - before[i].get(float("inf"), 0.0),
        }
        for i in range(2)
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--window", type=int, default=500, help="unconfirmed messages per publisher")
    p.add_argument("--size", type=int, default=1000)
    opts = p.parse_args()
    rows: list[dict[str, float]] = []
    for run in range(opts.runs):
        with tempfile.TemporaryDirectory(prefix="twinmq-mirror-bidi-bench-") as tmp:
            for name, row in zip(("A", "B"), one_run(Path(tmp), opts), strict=True):
                rows.append(row)
                print(
                    f"run {run + 1} site {name}: {row['rate']:,.0f} confirms/s, event lag p50 "
                    f"{row['p50'] * 1000:.0f} ms p99 {row['p99'] * 1000:.0f} ms, "
                    f"{row['within']:.1%} <= 250 ms ({row['events']:,.0f} events), oldest "
                    f"unacked age p99 {row['age_p99']:.2f} s",
                    flush=True,
                )

    def cell(key: str, fmt: str, scale: float = 1.0) -> str:
        values = [row[key] * scale for row in rows]
        return (
            f"{fmt.format(statistics.median(values))} "
            f"({fmt.format(min(values))}-{fmt.format(max(values))})"
        )

    print()
    print("| per site, both publishing | median (min-max) over sites x runs |")
    print("|---|---:|")
    print(f"| confirms/s | {cell('rate', '{:,.0f}')} |")
    print(f"| event lag p50 ms | {cell('p50', '{:.0f}', 1000)} |")
    print(f"| event lag p99 ms | {cell('p99', '{:.0f}', 1000)} |")
    print(f"| events <= 250 ms | {cell('within', '{:.1%}')} |")
    print(f"| oldest unacked event age p99 s (sampled) | {cell('age_p99', '{:.2f}')} |")


if __name__ == "__main__":
    main()
