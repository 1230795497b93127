#!/usr/bin/env python3
"""TwinMQ exchange federation vs RabbitMQ's federation plugin, the same load on both.

    .venv/bin/python bench/federation_vs_rabbitmq.py [--runs 3] [--seconds 8] [--queues 10]
        [--bindings 10000] [--trials 30] [--cut-messages 20000]

Per run, alternating which broker goes first, two fresh sites of each: an upstream
(TwinMQ `central`, tests/federationsites.py; a RabbitMQ node, bench/rabbitmq_node.py)
and a downstream federating the upstream's direct exchange `bench-fed` through a
`FaultProxy` (the link; RabbitMQ: a `federation-upstream` parameter and a policy,
`ack-mode on-confirm`, `reconnect-delay 1` like TwinMQ's first retry; prefetch and
max-hops at each one's default). Phases:

1. load: `--queues` downstream queues bound with the same key (the first consumed with
   acks, the others capped with x-max-length 1000), one publisher upstream keeps
   `--window` persistent 1000-byte messages unconfirmed: confirms/s upstream, deliveries/s
   downstream, publish -> delivered latency p50/p99, bytes through the link per message.
2. propagation: `--trials` times, bind a queue downstream with a new key and probe the
   upstream with mandatory publishes every 5 ms until the key routes; then unbind and
   probe until it no longer does (time from bind-ok / unbind-ok).
3. resync: `--bindings` keys bound downstream on one queue; once all are upstream, cut
   the link, unbind half and bind as many new ones, heal; time until the upstream's
   binding set equals the downstream's (TwinMQ: `/status`; RabbitMQ: `rabbitmqctl
   list_bindings`, polled as fast as it answers: its poll time is the resolution).
4. cut: `--cut-messages` confirmed messages while the link is cut 3 times (0.5 s each):
   confirmed-but-lost and duplicates on a downstream queue.

Numbers only: nothing here asserts a timing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import pika.exceptions

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import federationsites  # noqa: E402
import rabbitmq_node  # noqa: E402
import xsite  # noqa: E402

from twinmq.testing.faultproxy import FaultProxy  # noqa: E402

EXCHANGE = "bench-fed"
LOAD_KEY = "load"
CUT_KEY = "cut"
PROBE_QUEUE = "bench-probe"
RESYNC_QUEUE = "bench-resync"
CUT_QUEUE = "bench-cut"
CAPPED = {"x-max-length": 1000}


@dataclass
class Rig:
    """Two federated sites: AMQP URLs of each, the link's proxy, the upstream's keys."""

    name: str
    upstream_url: str
    downstream_url: str
    proxy: FaultProxy
    upstream_keys: Callable[[], set[str]]

    @property
    def upstream(self) -> str:
        """host:port of the upstream."""
        return self.upstream_url.rsplit("@", 1)[1]

    @property
    def downstream(self) -> str:
        """host:port of the downstream."""
        return self.downstream_url.rsplit("@", 1)[1]


@contextlib.contextmanager
def twinmq_rig(tmp: Path) -> Iterator[Rig]:
    """`central` and `remote` (tests/federationsites.py), linked through a proxy."""
    with federationsites.federated(tmp, EXCHANGE, "direct", proxied=True) as fed:
        assert fed.proxy is not None
        federationsites.wait_running(fed.remote, EXCHANGE)
        queue = f"federation:{EXCHANGE}:remote"

        def keys() -> set[str]:
            return {key for _, key in federationsites.upstream_bindings(fed.central, queue)}

        yield Rig(
            "TwinMQ",
            f"amqp://guest:guest@127.0.0.1:{fed.central.port}",
            f"amqp://guest:guest@127.0.0.1:{fed.remote.port}",
            fed.proxy,
            keys,
        )


@contextlib.contextmanager
def rabbitmq_rig(tmp: Path) -> Iterator[Rig]:
    """Two RabbitMQ nodes with rabbitmq_federation; the downstream's upstream is the proxy."""
    plugins = ("rabbitmq_federation",)
    with (
        rabbitmq_node.RabbitNode(plugins=plugins) as up,
        rabbitmq_node.RabbitNode(plugins=plugins) as down,
        FaultProxy(f"127.0.0.1:{up.port}") as proxy,
    ):
        for node in (up, down):
            with _channel(node.url) as ch:
                ch.exchange_declare(EXCHANGE, "direct", durable=True)
        upstream = {
            "uri": f"amqp://guest:guest@{proxy.address}",
            "ack-mode": "on-confirm",
            "reconnect-delay": 1,
        }
        down.ctl("set_parameter", "federation-upstream", "central", json.dumps(upstream))
        policy = json.dumps({"federation-upstream": "central"})
        down.ctl("set_policy", "bench-fed", f"^{EXCHANGE}$", policy, "--apply-to", "exchanges")

        def keys() -> set[str]:
            out = up.ctl(
                "list_bindings",
                "-q",
                "--no-table-headers",
                "source_name",
                "destination_name",
                "routing_key",
            )
            found = set()
            for line in out.splitlines():
                parts = line.split("\t")
                if len(parts) == 3 and parts[0] == EXCHANGE and parts[1].startswith("federation:"):
                    found.add(parts[2])
            return found

        yield Rig("RabbitMQ", up.url, down.url, proxy, keys)


@contextlib.contextmanager
def _channel(url: str) -> Iterator[Any]:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        yield connection.channel()
    finally:
        with contextlib.suppress(Exception):
            connection.close()


def routable(ch: Any, key: str) -> bool:
    """Does a mandatory publish to the upstream exchange with `key` reach a queue?"""
    try:
        ch.basic_publish(
            EXCHANGE, key, b"probe", pika.BasicProperties(delivery_mode=1), mandatory=True
        )
        return True
    except pika.exceptions.UnroutableError:
        return False


def wait_routable(ch: Any, key: str, want: bool, timeout: float = 60.0) -> float:
    """Seconds until `routable(key) == want`, probing every 5 ms."""
    start = time.perf_counter()
    while routable(ch, key) != want:
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"{key} routable != {want} after {timeout} s")
        time.sleep(0.005)
    return time.perf_counter() - start


# -- phases -----------------------------------------------------------------------------


def phase_load(rig: Rig, opts: argparse.Namespace) -> dict[str, float]:
    with _channel(rig.downstream_url) as ch:
        for i in range(opts.queues):
            ch.queue_declare(f"bench-q{i}", durable=True, arguments=None if i == 0 else CAPPED)
            ch.queue_bind(f"bench-q{i}", EXCHANGE, LOAD_KEY)
    with _channel(rig.upstream_url) as up:
        up.confirm_delivery()
        wait_routable(up, LOAD_KEY, True)

    async def run() -> tuple[xsite.Published, xsite.Received, int]:
        received = xsite.Received()
        consumer = asyncio.create_task(xsite.consume(rig.downstream, "bench-q0", received))
        before = rig.proxy.bytes_forwarded
        published = await xsite.publish(
            rig.upstream,
            EXCHANGE,
            LOAD_KEY,
            phase=1,
            window=opts.window,
            size=opts.size,
            seconds=opts.seconds,
        )
        total = len(published.sent_ns)
        await xsite.wait_quiet(
            received, lambda: len(received.seqs) >= total, consumer, quiet=0.5, limit=60
        )
        link_bytes = rig.proxy.bytes_forwarded - before
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await consumer
        return published, received, link_bytes

    published, received, link_bytes = asyncio.run(run())
    start = published.sent_ns[0] / 1e9 + 1.0  # after the warm-up
    end = start + opts.seconds
    window = [lat for at, lat in received.latencies if start <= at < end]
    delivered = sum(1 for at, _ in received.latencies if start <= at < end)
    return {
        "confirms/s": published.measured,
        "delivered/s": delivered / opts.seconds,
        "p50 ms": xsite.percentile(window, 0.5) * 1e3,
        "p99 ms": xsite.percentile(window, 0.99) * 1e3,
        "link bytes/msg": link_bytes / max(1, len(received.seqs)),
    }


def phase_propagation(rig: Rig, opts: argparse.Namespace) -> tuple[list[float], list[float]]:
    binds: list[float] = []
    unbinds: list[float] = []
    with _channel(rig.downstream_url) as down, _channel(rig.upstream_url) as up:
        up.confirm_delivery()
        down.queue_declare(PROBE_QUEUE, durable=True, arguments={"x-max-length": 10})
        for i in range(opts.trials):
            key = f"probe-{i}"
            start = time.perf_counter()
            down.queue_bind(PROBE_QUEUE, EXCHANGE, key)
            binds.append(time.perf_counter() - start + wait_routable(up, key, True))
            start = time.perf_counter()
            down.queue_unbind(PROBE_QUEUE, EXCHANGE, key)
            unbinds.append(time.perf_counter() - start + wait_routable(up, key, False))
    return binds, unbinds


def phase_resync(rig: Rig, opts: argparse.Namespace) -> dict[str, float]:
    n = opts.bindings
    old = [f"r{i}" for i in range(n)]
    new = [f"s{i}" for i in range(n // 2)]
    with _channel(rig.downstream_url) as down:
        down.queue_declare(RESYNC_QUEUE, durable=True, arguments={"x-max-length": 10})
        start = time.perf_counter()
        for key in old:
            down.queue_bind(RESYNC_QUEUE, EXCHANGE, key)
        bound = time.perf_counter() - start
        initial = _wait_keys(rig, set(old))
        rig.proxy.cut()
        time.sleep(2.0)  # the link sees the cut (RST) and starts retrying
        for key in old[: n // 2]:
            down.queue_unbind(RESYNC_QUEUE, EXCHANGE, key)
        for key in new:
            down.queue_bind(RESYNC_QUEUE, EXCHANGE, key)
        want = set(old[n // 2 :]) | set(new)
        rig.proxy.heal()
        resync = _wait_keys(rig, want)
    return {"bind s": bound, "initial s": initial, "resync s": resync}


def _wait_keys(rig: Rig, want: set[str], timeout: float = 300.0) -> float:
    """Seconds until the upstream's r*/s* keys are exactly `want` (polled back to back)."""
    start = time.perf_counter()
    while True:
        with contextlib.suppress(Exception):
            have = {k for k in rig.upstream_keys() if k[:1] in ("r", "s") and k[1:].isdigit()}
            if have == want:
                return time.perf_counter() - start
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"{rig.name}: upstream bindings did not converge")
        time.sleep(0.05)


def phase_cut(rig: Rig, opts: argparse.Namespace) -> tuple[int, int, int]:
    with _channel(rig.downstream_url) as ch:
        ch.queue_declare(CUT_QUEUE, durable=True)
        ch.queue_bind(CUT_QUEUE, EXCHANGE, CUT_KEY)
    with _channel(rig.upstream_url) as up:
        up.confirm_delivery()
        wait_routable(up, CUT_KEY, True)

    async def cuts(published: asyncio.Task[xsite.Published]) -> None:
        for _ in range(3):
            await asyncio.sleep(opts.cut_gap)
            if published.done():
                return
            rig.proxy.cut()
            await asyncio.sleep(0.5)
            rig.proxy.heal()

    async def run() -> tuple[int, int, int]:
        received = xsite.Received()
        consumer = asyncio.create_task(xsite.consume(rig.downstream, CUT_QUEUE, received))
        publisher = asyncio.create_task(
            xsite.publish(
                rig.upstream,
                EXCHANGE,
                CUT_KEY,
                phase=4,
                window=opts.window,
                size=opts.size,
                count=opts.cut_messages,
            )
        )
        await cuts(publisher)
        published = await publisher
        confirmed = published.confirmed

        def all_there() -> bool:
            return confirmed <= {seq for p, seq in received.seqs if p == 4}

        await xsite.wait_quiet(received, all_there, consumer, quiet=5.0, limit=180)
        consumer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await consumer
        return xsite.count_loss(published, received, 4)

    return asyncio.run(run())


# -- driver -----------------------------------------------------------------------------


def one_run(name: str, tmp: Path, opts: argparse.Namespace, results: dict[str, Any]) -> None:
    rig_of = twinmq_rig if name == "TwinMQ" else rabbitmq_rig
    out = results[name]
    with rig_of(tmp) as rig:
        load = phase_load(rig, opts)
        for k, v in load.items():
            out.setdefault(k, []).append(v)
        binds, unbinds = phase_propagation(rig, opts)
        out.setdefault("bind p50 ms", []).append(xsite.percentile(binds, 0.5) * 1e3)
        out.setdefault("bind p99 ms", []).append(xsite.percentile(binds, 0.99) * 1e3)
        out.setdefault("unbind p50 ms", []).append(xsite.percentile(unbinds, 0.5) * 1e3)
        out.setdefault("unbind p99 ms", []).append(xsite.percentile(unbinds, 0.99) * 1e3)
        resync: dict[str, float] = {}
        if opts.bindings:
            resync = phase_resync(rig, opts)
            for k, v in resync.items():
                out.setdefault(k, []).append(v)
        confirmed, lost, dups = phase_cut(rig, opts)
        out.setdefault("confirmed", []).append(confirmed)
        out.setdefault("lost", []).append(lost)
        out.setdefault("duplicates", []).append(dups)
    print(
        f"  {name}: {load['confirms/s']:,.0f} confirms/s, {load['delivered/s']:,.0f} delivered/s,"
        f" latency p50 {load['p50 ms']:.1f} ms p99 {load['p99 ms']:.1f} ms, link "
        f"{load['link bytes/msg']:,.0f} B/msg; bind p99 {out['bind p99 ms'][-1]:.1f} ms, "
        f"unbind p99 {out['unbind p99 ms'][-1]:.1f} ms; "
        + (
            f"{opts.bindings} bindings: bound in {resync['bind s']:.1f} s, upstream after "
            f"{resync['initial s']:.2f} s, resync {resync['resync s']:.2f} s; "
            if resync
            else ""
        )
        + f"cut: {confirmed} confirmed, {lost} lost, {dups} duplicates",
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs per broker (order alternated)")
    p.add_argument("--seconds", type=float, default=8.0, help="load phase, after 1 s warm-up")
    p.add_argument("--window", type=int, default=500, help="unconfirmed messages in flight")
    p.add_argument("--size", type=int, default=1000)
    p.add_argument("--queues", type=int, default=10, help="downstream queues on the load key")
    p.add_argument("--trials", type=int, default=30, help="bind/unbind propagation trials")
    p.add_argument("--bindings", type=int, default=10000, help="resync phase (0: skip)")
    p.add_argument("--cut-messages", type=int, default=20000)
    p.add_argument("--cut-gap", type=float, default=1.0, help="seconds between link cuts")
    opts = p.parse_args()
    rabbitmq_node.ensure_installed()
    results = xsite.run_alternated(
        opts.runs, "twinmq-xbench-fed-", lambda name, tmp, res: one_run(name, tmp, opts, res)
    )
    report(results, opts)


def report(results: dict[str, dict[str, list[float]]], opts: argparse.Namespace) -> None:
    rows = [
        ("confirms/s upstream", "confirms/s", "{:,.0f}"),
        ("delivered/s downstream (queue 1 of N)", "delivered/s", "{:,.0f}"),
        ("latency p50 ms (publish -> delivered)", "p50 ms", "{:.1f}"),
        ("latency p99 ms", "p99 ms", "{:.1f}"),
        ("bytes on the link per message", "link bytes/msg", "{:,.0f}"),
        ("bind propagation p50 ms", "bind p50 ms", "{:.1f}"),
        ("bind propagation p99 ms", "bind p99 ms", "{:.1f}"),
        ("unbind propagation p50 ms", "unbind p50 ms", "{:.1f}"),
        ("unbind propagation p99 ms", "unbind p99 ms", "{:.1f}"),
        (
            f"{opts.bindings} bindings: all upstream after the last bind-ok, s",
            "initial s",
            "{:.2f}",
        ),
        (
            f"{opts.bindings} bindings: resync after a link cut (half changed), s",
            "resync s",
            "{:.2f}",
        ),
        (f"cut: confirmed of {opts.cut_messages}", "confirmed", "{:,.0f}"),
        ("cut: confirmed but lost", "lost", "{:,.0f}"),
        ("cut: delivered twice", "duplicates", "{:,.0f}"),
    ]
    xsite.print_table(results, rows, opts.runs, ("TwinMQ", "RabbitMQ"))


if __name__ == "__main__":
    main()
