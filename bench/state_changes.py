#!/usr/bin/env python3
"""What a `changes` message of state replication costs the broker, with a large state held.

    .venv/bin/python bench/state_changes.py [--queues 10000] [--bindings 10000]
        [--changes 300] [--runs 3] [--tree NAME=FILE ...]

A real `VirtualHost` over a real journal (`sansio.Harness`, fsync off: the
publisher's cost is measured, not the disk's), `--queues` transient queues and
`--bindings` bindings of them to a direct exchange (whose routing table a bind
changes in place: a topic exchange's is rebuilt at each bind, which is not what is
measured here), and one subscriber queue bound
to `amq.twinmq.state`. Then `--changes` times: one `queue.bind` (or its unbind,
alternately), then the end of the event-loop turn, which publishes its `changes`
message (`StatePublisher.flush`). Reported: the median, mean and p99 microseconds
of the flush alone, and the mean of bind + flush, per tree. Each `--tree` names a `state.py` (e.g.
`git show main:broker/federation/state.py > /tmp/state_main.py`) loaded in place
of this tree's; trees are alternated run by run so the machine's load falls on all
alike. The subscriber's queue is emptied between runs, not timed.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from twinmq.broker.federation import state as this_state
from twinmq.testing.sansio import Harness


def load(path: str) -> ModuleType:
    """A `state.py` of another tree, as a module (it runs against this tree's broker)."""
    spec = importlib.util.spec_from_file_location(f"state_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def run_once(module: ModuleType, queues: int, bindings: int, changes: int) -> list[float]:
    """[flush µs, bind+flush µs] per change, interleaved."""
    with tempfile.TemporaryDirectory() as directory:
        harness = Harness(Path(directory))
        vhost, clock = harness.vhost, harness.clock
        try:
            owner = object()
            vhost.declare_exchange(
                "x", "direct", passive=False, durable=False, auto_delete=False, internal=False,
                arguments={},
            )  # fmt: skip
            for i in range(queues):
                vhost.declare_queue(
                    f"q{i}", passive=False, durable=False, exclusive=False, auto_delete=False,
                    arguments={}, owner=owner,
                )  # fmt: skip
            for i in range(bindings):
                vhost.bind(f"q{i % queues}", "x", f"k.{i}", {}, owner)
            publisher = module.StatePublisher("a", vhost, lambda: 1)
            sub = vhost.declare_queue(
                "sub", passive=False, durable=False, exclusive=True, auto_delete=False,
                arguments={}, owner=owner,
            )  # fmt: skip
            vhost.bind("sub", module.STATE_EXCHANGE, "", {}, owner)
            clock.advance(60)
            sub.purge()
            flushes: list[float] = []
            totals: list[float] = []
            for n in range(changes):
                started = time.perf_counter()
                vhost.bind("q0", "x", "churn", {}, owner, unbind=n % 2 == 1)
                flushing = time.perf_counter()
                # The old publisher waits COST_FACTOR times its last comparison: flush now.
                publisher.flush()
                done = time.perf_counter()
                clock.advance(60)  # (the turn's scheduled flush: nothing left to send)
                flushes.append((done - flushing) * 1e6)
                totals.append((done - started) * 1e6)
            assert publisher.changes == changes, publisher.changes
            return [*flushes, *totals]
        finally:
            harness.close()


def main() -> None:
    """Run the trees alternated and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queues", type=int, default=10000)
    parser.add_argument("--bindings", type=int, default=10000)
    parser.add_argument("--changes", type=int, default=300)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[], help="NAME=path/to/state.py")
    args = parser.parse_args()
    trees: list[tuple[str, ModuleType]] = [("this", this_state)]
    for spec in args.tree:
        name, path = spec.split("=", 1)
        trees.append((name, load(path)))
    results: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _ in trees}
    for _ in range(args.runs):
        for name, module in trees:
            out = run_once(module, args.queues, args.bindings, args.changes)
            results[name][0].extend(out[: args.changes])
            results[name][1].extend(out[args.changes :])
    print(
        f"{args.queues} queues, {args.bindings} bindings held; {args.changes} changes x {args.runs}"
    )
    print(
        f"{'tree':>8} {'flush median µs':>16} {'flush mean µs':>14} {'flush p99 µs':>13} "
        f"{'bind+flush mean µs':>19}"
    )
    for name, (flushes, totals) in results.items():
        p99 = statistics.quantiles(flushes, n=100)[98]
        print(
            f"{name:>8} {statistics.median(flushes):>16.0f} {statistics.fmean(flushes):>14.0f} "
            f"{p99:>13.0f} {statistics.fmean(totals):>19.0f}"
        )


if __name__ == "__main__":
    main()
