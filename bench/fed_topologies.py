#!/usr/bin/env python3
"""Exchange federation over several servers with random link flaps (issue 15's proof).

    .venv/bin/python bench/fed_topologies.py [--topologies ring,diamond,mesh]
        [--servers 3,5] [--messages 1000000] [--flap-every 1.0] [--seed 1]
        [--pairs s1 --failovers 2] [--dedup-window 10000]

For each topology and server count (a diamond has 4), fresh servers
(tests/federationtopologies.py: every link through a proxy, the same `max-hops` on every
link, no tuning) take `--messages` confirmed messages spread over every server while
random links are partitioned or reset; every server's `sink` is consumed. Reported per
run: confirmed, delivered, confirmed messages a server that should have them never got
(lost), second deliveries (duplicates), flaps, the second copies the dedup window dropped,
the copies that came back to their origin, and per server the keys its window forgot at
its stretch while a link had not passed them (`dedup_forced`). With `--pairs`, those
servers are pairs (active + passive) and `--failovers` kill -9s of their actives (in
turn) happen while the messages flow. `--dedup-window` sets every server's window (the
broker's default, 100,000, if not given): a tenth of it at 100,000 messages puts the
window under the pressure a million puts the default one under. No timing is asserted;
the exit status is 1 if anything was lost or delivered twice.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import federationtopologies as ft  # noqa: E402
import xsite  # noqa: E402

from twinmq.broker.admin_client import metric_samples  # noqa: E402
from twinmq.testing.launcher import BrokerProcess  # noqa: E402


def dedup_forced(broker: BrokerProcess) -> int:
    """Keys the server's dedup window forgot at its stretch while a link had not passed
    them (a count of where a copy could have come twice; 0 when the window never filled)."""
    samples = metric_samples(broker.admin.metrics(timeout=10))
    return int(samples.get("twinmq_federation_dedup_forced_total", 0))


def dedup_keys(broker: BrokerProcess) -> int:
    """Keys the server's dedup window holds at the end (the newest `dedup-window` and the
    older ones a link may still bring, compacted): what a link that never brings an origin
    makes grow."""
    federation = broker.admin.status(timeout=10).federation
    return max((link.dedup_keys for link in federation.links), default=0) if federation else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topologies", default="ring,diamond,mesh")
    parser.add_argument("--servers", default="3,5", help="server counts for ring and mesh")
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--flap-every", type=float, default=1.0)
    parser.add_argument("--flap-for", type=float, default=0.8)
    parser.add_argument("--window", type=int, default=200)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pairs", default="", help="servers that are pairs, e.g. s1,s3")
    parser.add_argument("--failovers", type=int, default=0, help="kill -9s of a pair's active")
    parser.add_argument("--dedup-window", type=int, default=None, help="every server's window")
    opts = parser.parse_args()
    faulthandler.register(signal.SIGUSR1)  # kill -USR1: every thread's stack, for a stall
    runs: list[tuple[str, int]] = []
    for name in opts.topologies.split(","):
        counts = [4] if name == "diamond" else [int(n) for n in opts.servers.split(",")]
        runs += [(name, n) for n in counts]
    failed = False
    print(f"load average at the start: {xsite.load_average()}", flush=True)
    for name, servers in runs:
        links = ft.topology(name, servers)
        pairs = [p for p in opts.pairs.split(",") if p]
        print(
            f"{name} of {servers}: {len(links)} links, {opts.messages} messages, "
            f"pairs {pairs or 'none'}, {opts.failovers} failovers",
            flush=True,
        )
        started = time.monotonic()
        with (
            tempfile.TemporaryDirectory(prefix="twinmq-fedtopo-") as tmp,
            ft.federated_servers(Path(tmp), links, pairs, opts.dedup_window) as mesh,
        ):
            outcome = ft.run_traffic(
                mesh,
                opts.messages,
                flap_every=opts.flap_every,
                flap_for=opts.flap_for,
                window=opts.window,
                size=opts.size,
                seed=opts.seed,
                progress=True,
                failovers=opts.failovers,
            )
            forced = {server: dedup_forced(mesh.broker(server)) for server in mesh.names}
            held = {server: dedup_keys(mesh.broker(server)) for server in mesh.names}
            # The upstreams tell their marks when idle too (every second, marks.py): the
            # keys still held 20 s after the traffic are what stays.
            time.sleep(20)
            settled = {server: dedup_keys(mesh.broker(server)) for server in mesh.names}
        record = {"topology": name, "servers": servers, "pairs": pairs, **ft.describe(outcome)}
        record["dedup_window"] = opts.dedup_window
        record["dedup_forced"] = forced
        record["dedup_keys"] = held
        record["dedup_keys_20s_later"] = settled
        record["load"] = xsite.load_average()
        record["wall_seconds"] = round(time.monotonic() - started, 1)
        print(json.dumps(record), flush=True)
        failed |= outcome.total_lost > 0 or outcome.total_duplicates > 0
    print(f"load average at the end: {xsite.load_average()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
