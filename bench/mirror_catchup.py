#!/usr/bin/env python3
"""The DR mirror's catch-up after a long disconnect: the backlog queued while the mirror was
down, applied once it is back.

    .venv/bin/python bench/mirror_catchup.py [--runs 2] [--seconds 10] [--window 500]

Per run: a fresh source and mirror on loopback (`--mirror-to`, `--mirror-port`). Once the
link is connected the mirror broker is stopped (SIGTERM, a clean exit: the link is down,
the source keeps accepting publishes). One publisher on a raw AMQP connection
(`audit_cost.publish`) keeps `--window` persistent `--size`-byte messages unconfirmed for
`--seconds` (after a 1 s warm-up); the source's replication queue then holds the backlog
(events, bytes; each event is one group commit's messages). The mirror is started again
on its data directory; from its ready line the source's `/status` is polled every 0.05 s:
*reconnect* is the time until the link is connected again (the source retries every 2 s),
*catch-up* the time from then until the replication queue is empty (every event applied
and made durable on the mirror, and acknowledged). Rates: backlog events and messages
over the catch-up time; and, less sensitive to a loaded machine than those, the CPU time
each broker process used over the catch-up (all threads, from /proc), per message.
Numbers only: nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_cost import QUEUE, publish

from twinmq.testing.launcher import BrokerProcess, free_port

TOKEN = "bench-mirror-token"


def mirror_section(broker: BrokerProcess) -> dict[str, float]:
    section: dict[str, float] = broker.admin.status(timeout=5).model_dump(mode="json")["mirror"]
    return section


def queue_messages(broker: BrokerProcess) -> int:
    """Ready messages in the publisher's queue."""
    for queue in broker.admin.status(timeout=5).queues:
        if queue.name == QUEUE:
            return queue.messages
    return 0


def cpu_seconds(broker: BrokerProcess) -> float:
    """User and system CPU time of the broker's process so far (all threads)."""
    assert broker.proc is not None
    fields = Path(f"/proc/{broker.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until(check: Callable[[], object], poll: float = 0.05, limit: float = 600.0) -> float:
    """Seconds until `check()` is true."""
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > limit:
            raise TimeoutError(f"not done after {limit} s")
        time.sleep(poll)
    return time.perf_counter() - start


def one_run(tmp: Path, opts: argparse.Namespace) -> dict[str, float]:
    port = free_port()
    mirror = BrokerProcess(
        tmp / "mirror",
        name="bench-mirror",
        extra_args=["--mirror-port", str(port), "--mirror-token", TOKEN],
    )
    source_args = ["--mirror-to", f"127.0.0.1:{port}", "--mirror-token", TOKEN]
    with mirror, BrokerProcess(tmp / "source", name="bench-source", extra_args=source_args) as src:
        wait_until(lambda: mirror_section(src)["connected"])
        mirror.stop()
        wait_until(lambda: not mirror_section(src)["connected"])
        asyncio.run(publish(src.port, opts.seconds, opts.window, opts.size))
        backlog = mirror_section(src)
        messages = queue_messages(src)
        mirror.start()
        reconnect = wait_until(lambda: mirror_section(src)["connected"])
        cpu = cpu_seconds(mirror), cpu_seconds(src)
        catchup = wait_until(lambda: mirror_section(src)["queue_events"] == 0)
        mirror_cpu, source_cpu = cpu_seconds(mirror) - cpu[0], cpu_seconds(src) - cpu[1]
        mirrored = queue_messages(mirror)
    return {
        "events": backlog["queue_events"],
        "mbytes": backlog["queue_bytes"] / 1e6,
        "messages": messages,
        "reconnect": reconnect,
        "catchup": catchup,
        "events_s": backlog["queue_events"] / catchup,
        "messages_s": messages / catchup,
        "missing": messages - mirrored,
        "mirror_us": mirror_cpu / messages * 1e6,
        "source_us": source_cpu / messages * 1e6,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument(
        "--seconds", type=float, default=10.0, help="publishing while the mirror is down"
    )
    p.add_argument("--window", type=int, default=500, help="unconfirmed messages in flight")
    p.add_argument("--size", type=int, default=1000)
    opts = p.parse_args()
    rows: list[dict[str, float]] = []
    for run in range(opts.runs):
        with tempfile.TemporaryDirectory(prefix="twinmq-mirror-catchup-") as tmp:
            row = one_run(Path(tmp), opts)
        rows.append(row)
        print(
            f"run {run + 1}: backlog {row['events']:,.0f} events, {row['messages']:,.0f} "
            f"messages ({row['mbytes']:,.0f} MB); reconnect {row['reconnect']:.2f} s; catch-up "
            f"{row['catchup']:.2f} s: {row['events_s']:,.0f} events/s, "
            f"{row['messages_s']:,.0f} messages/s; CPU per message: mirror "
            f"{row['mirror_us']:.1f} us, source {row['source_us']:.1f} us; missing on the "
            f"mirror {row['missing']:.0f}",
            flush=True,
        )

    def cell(key: str, fmt: str) -> str:
        values = [r[key] for r in rows]
        return (
            f"{fmt.format(statistics.median(values))} "
            f"({fmt.format(min(values))}-{fmt.format(max(values))})"
        )

    print()
    print("| backlog events | messages | MB | reconnect s | catch-up s | events/s | messages/s "
          "| mirror CPU us/message | source CPU us/message | missing |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {cell('events', '{:,.0f}')} | {cell('messages', '{:,.0f}')} "
        f"| {cell('mbytes', '{:,.0f}')} | {cell('reconnect', '{:.2f}')} "
        f"| {cell('catchup', '{:.2f}')} | {cell('events_s', '{:,.0f}')} "
        f"| {cell('messages_s', '{:,.0f}')} | {cell('mirror_us', '{:.1f}')} "
        f"| {cell('source_us', '{:.1f}')} | {cell('missing', '{:.0f}')} |"
    )


if __name__ == "__main__":
    main()
