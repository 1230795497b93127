#!/usr/bin/env python3
"""The federation link's own cost per downstream binding change (no broker, no I/O
but its binding record): what `agent._sync` does for one local bind, N times.

    .venv/bin/python bench/federation_link_cost.py [--bindings 10000]

1. direct: N bindings with distinct keys added one at a time; after each, the change
   drained from the `UpstreamSet` and appended to the record (`bindings.Record`), as the
   link does before it sends the bind;
2. topic: N literal keys under a `#`, then the `#` removed: the time to find the N keys
   to bind again.

Numbers only.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from twinmq.broker.definitions import BindingDef
from twinmq.broker.federation import bindings as fb


def _binding(queue: str, key: str) -> BindingDef:
    return BindingDef(exchange="x", queue=queue, routing_key=key, arguments={})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bindings", type=int, default=10000)
    n = p.parse_args().bindings
    with tempfile.TemporaryDirectory() as tmp:
        record = fb.Record(Path(tmp) / "x.bindings.json")
        needed = fb.UpstreamSet("direct")
        bound: set[fb.UpstreamBinding] = set()
        start = time.perf_counter()
        for i in range(n):
            needed.add(_binding("q", f"r{i}"))
            changes = needed.drain(bound)
            record.add(changes.bind)
            bound.update(changes.bind)
        spent = time.perf_counter() - start
    print(f"direct: {n:,} binds, {spent:.2f} s ({spent / n * 1e6:.0f} us per bind)")
    topic = fb.UpstreamSet("topic")
    start = time.perf_counter()
    topic.add(_binding("all", "#"))
    for i in range(n):
        topic.add(_binding("q", f"a.{i}.b"))
    covered = time.perf_counter() - start
    start = time.perf_counter()
    topic.remove(_binding("all", "#"))
    changes = topic.drain({fb.UpstreamBinding("#")})
    uncovered = time.perf_counter() - start
    print(
        f"topic: {n:,} keys added under '#' in {covered:.2f} s; '#' removed: "
        f"{len(changes.bind):,} to bind, 1 to unbind, found in {uncovered:.2f} s"
    )


if __name__ == "__main__":
    main()
