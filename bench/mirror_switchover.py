#!/usr/bin/env python3
"""DR switchover time: demote the source under a backlog, promote its mirror with the token.

    .venv/bin/python bench/mirror_switchover.py [--runs 5] [--seconds 3] [--window 500]
        [--paused-mirror]

Per run, two fresh sites on loopback, each with both ends (docs/mirror.md,
"Switchover"): site A the source, site B its replica. One publisher on a raw
AMQP connection (`audit_cost.publish`) keeps `--window` persistent 1000-byte
messages unconfirmed for `--seconds` (after 1 s of warm-up), so the mirror
lags (with `--paused-mirror` site B is SIGSTOPped while the publisher runs and
SIGCONTed just before the demotion: the demotion then drains the whole
backlog); right after it stops, `POST /mirror/demote` on A (clients closed, queue
drained to zero, token) then `POST /mirror/promote` on B. Prints the backlog at
the demotion, the drain time, the promotion time and the whole switchover as
the caller sees it, and the queue's message count on A after its demotion and
on B after its promotion (equal: nothing lost). Numbers only: nothing asserts a
timing.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_cost import QUEUE, publish

from twinmq.broker.admin_client import mirror_demote_call, mirror_promote_call
from twinmq.broker.api import MirrorDemoteRequest, MirrorPromoteRequest
from twinmq.testing.launcher import BrokerProcess, free_port

TOKEN = "bench-mirror-token"


def messages(broker: BrokerProcess) -> int:
    status = broker.admin.status(timeout=5)
    return next(q.messages + q.unacked for q in status.queues if q.name == QUEUE)


def run(tmp: Path, opts: argparse.Namespace) -> dict[str, float]:
    a_port, b_port = free_port(), free_port()
    common = ["--mirror-token", TOKEN]
    a_args = ["--mirror-to", f"127.0.0.1:{b_port}", "--mirror-port", str(a_port),
              "--mirror-role", "source", "--mirror-id", "site-a", *common]  # fmt: skip
    b_args = ["--mirror-to", f"127.0.0.1:{a_port}", "--mirror-port", str(b_port),
              "--mirror-role", "replica", "--mirror-id", "site-b", *common]  # fmt: skip
    with (
        BrokerProcess(tmp / "b", name="bench-site-b", extra_args=b_args) as b,
        BrokerProcess(tmp / "a", name="bench-site-a", extra_args=a_args) as a,
    ):
        if opts.paused_mirror:
            b.signal(signal.SIGSTOP)
        rate, _ = asyncio.run(publish(a.port, opts.seconds, opts.window, 1000))
        backlog = a.admin.status(timeout=5).mirror
        started = time.perf_counter()
        if opts.paused_mirror:
            b.signal(signal.SIGCONT)
        demoted = a.admin.send(mirror_demote_call(MirrorDemoteRequest(timeout=120)), 130)
        assert demoted.token is not None
        promoted = b.admin.send(mirror_promote_call(MirrorPromoteRequest(token=demoted.token)), 40)
        total = time.perf_counter() - started
        return {
            "rate": rate,
            "backlog": float(backlog.queue_events if backlog is not None else 0),
            "drain": demoted.seconds,
            "promote": promoted.seconds,
            "total": total,
            "on_a": float(messages(a)),
            "on_b": float(messages(b)),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--window", type=int, default=500, help="unconfirmed messages in flight")
    p.add_argument("--paused-mirror", action="store_true", help="SIGSTOP B while publishing")
    opts = p.parse_args()
    results = []
    for n in range(opts.runs):
        with tempfile.TemporaryDirectory(prefix="twinmq-switch-bench-") as tmp:
            r = run(Path(tmp), opts)
        results.append(r)
        print(f"run {n + 1}: {r['rate']:,.0f} confirms/s before; backlog {r['backlog']:.0f} "
              f"events; drain {r['drain']:.3f} s, promote {r['promote']:.3f} s, switchover "
              f"{r['total']:.3f} s; messages on A {r['on_a']:.0f}, on B {r['on_b']:.0f}",
              flush=True)  # fmt: skip

    def cell(key: str) -> str:
        values = [r[key] for r in results]
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    print()
    print("| backlog events | drain s | promote s | switchover s | lost |")
    print("|---:|---:|---:|---:|---:|")
    lost = sum(int(r["on_a"] - r["on_b"]) for r in results)
    print(f"| {cell('backlog')} | {cell('drain')} | {cell('promote')} | {cell('total')} | {lost} |")


if __name__ == "__main__":
    main()
