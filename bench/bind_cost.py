#!/usr/bin/env python3
"""Wall time per durable `queue.bind` as an exchange's bindings grow, per band.

    .venv/bin/python bench/bind_cost.py [--bindings 10000] [--band 500] [--runs 1]
        [--pipeline N] [--tree NAME=DIR ...]

One broker process per run (its own data directory on the machine's disk, fsync
on), one pika connection: a durable direct exchange and a durable queue, then
`--bindings` bindings of the queue with distinct routing keys, one `queue.bind` at
a time (each waits for its bind-ok, which the broker sends once the change is
durable). With `--pipeline N` the binds go N to a write (a raw client, as a
federation link's resync sends them) and the bind-oks are read after each write:
the broker's group commit makes each write's binds one definitions-log append and
one fsync. Reported: the mean milliseconds per bind in each band of `--band`
bindings. Each `--tree` is a source tree whose `twinmq` broker runs (the
default: this one); several are run alternated, run by run, so the machine's
load falls on all of them alike. A tree is put first on the broker's PYTHONPATH
through a `twinmq` symlink to it (a checkout of another commit: `git archive`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import pika
from pamqp import commands

from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.rawamqp import RawClient, encode

HERE = Path(__file__).resolve().parent.parent


def run_once(
    tree: Path | None, bindings: int, band: int, budget: float, pipeline: int = 1
) -> list[float]:
    """ms per bind, per band, for one broker of `tree` (the bands done within `budget` s)."""
    with tempfile.TemporaryDirectory(prefix="bindcost-", dir=os.environ.get("BIND_COST_DIR")) as d:
        root = Path(d)
        env = {}
        if tree is not None:
            (root / "path").mkdir()
            (root / "path" / "twinmq").symlink_to(tree)
            env["PYTHONPATH"] = str(root / "path")
        broker = BrokerProcess(root / "data", name="bindcost", env=env).start()
        try:
            if pipeline > 1:
                return _pipelined(broker, bindings, band, budget, pipeline)
            conn = pika.BlockingConnection(pika.URLParameters(broker.url))
            ch = conn.channel()
            ch.exchange_declare("bench.x", "direct", durable=True)
            ch.queue_declare("bench.q", durable=True)
            out: list[float] = []
            start = began = time.perf_counter()
            for i in range(bindings):
                ch.queue_bind("bench.q", "bench.x", f"key.{i}")
                if (i + 1) % band == 0:
                    now = time.perf_counter()
                    out.append((now - start) * 1000 / band)
                    start = now
                    if now - began > budget:
                        break
            conn.close()
            return out
        finally:
            broker.stop()


def _pipelined(
    broker: BrokerProcess, bindings: int, band: int, budget: float, pipeline: int
) -> list[float]:
    """ms per bind, per band, with `pipeline` binds per write (raw frames)."""
    with RawClient(broker.host, broker.port, timeout=60) as client:
        client.handshake()
        client.open_channel(1)
        client.send_frame(
            1, commands.Exchange.Declare(exchange="bench.x", exchange_type="direct", durable=True)
        )
        client.expect(commands.Exchange.DeclareOk, 1)
        client.send_frame(1, commands.Queue.Declare(queue="bench.q", durable=True))
        client.expect(commands.Queue.DeclareOk, 1)
        out: list[float] = []
        start = began = time.perf_counter()
        done = 0
        while done < bindings:
            n = min(pipeline, bindings - done)
            client.send(
                b"".join(
                    encode(
                        1,
                        commands.Queue.Bind(
                            queue="bench.q", exchange="bench.x", routing_key=f"key.{done + i}"
                        ),
                    )
                    for i in range(n)
                )
            )
            for _ in range(n):
                client.expect(commands.Queue.BindOk, 1)
            for i in range(done, done + n):
                if (i + 1) % band == 0:
                    now = time.perf_counter()
                    out.append((now - start) * 1000 / band)
                    start = now
            done += n
            if time.perf_counter() - began > budget:
                break
        return out


def main() -> None:
    """Parse the arguments, run the trees alternated, print one table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bindings", type=int, default=10_000)
    parser.add_argument("--band", type=int, default=500)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument(
        "--budget", type=float, default=3600, help="seconds per run; later bands are not run"
    )
    parser.add_argument(
        "--pipeline", type=int, default=1, help="binds per write (1: one at a time, pika)"
    )
    parser.add_argument(
        "--tree", action="append", default=[], metavar="NAME=DIR", help="a tree to measure"
    )
    args = parser.parse_args()
    trees: list[tuple[str, Path | None]] = [
        (name, Path(path).resolve()) for name, path in (t.split("=", 1) for t in args.tree)
    ] or [("this", None)]
    results: dict[str, list[list[float]]] = {name: [] for name, _ in trees}
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    for run in range(args.runs):
        for name, tree in trees:
            t0 = time.monotonic()
            bands = run_once(tree, args.bindings, args.band, args.budget, args.pipeline)
            results[name].append(bands)
            print(
                f"run {run + 1} {name}: {time.monotonic() - t0:.0f} s, "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    names = [name for name, _ in trees]
    print("\n| bindings | " + " | ".join(f"{n} ms/bind" for n in names) + " |")
    print("|---|" + "---:|" * len(names))
    for b in range(args.bindings // args.band):
        cells = [
            f"{statistics.median(r[b] for r in done):.1f}"
            if (done := [r for r in results[n] if len(r) > b])
            else "not reached"
            for n in names
        ]
        print(f"| {b * args.band:,}-{(b + 1) * args.band:,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
