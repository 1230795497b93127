"""Several federated servers in a ring, a diamond or a mesh, every link through a
`FaultProxy` that can be partitioned: the issue-15 proof that every message reaches
every server it should exactly once, with no `max-hops` tuned per topology.

Each server has the fanout exchange `x` its clients publish on and the queue `sink`
bound to every exchange it has. A link is (downstream, upstream): the downstream's
first link federates its own `x` from the upstream's `x` (so what arrives there
travels on), any other link a local exchange `x.from.<upstream>` (the federation file
allows one upstream per exchange; seed 002's triangle does the same) bound into
`sink` too. Every link has the same `max-hops`, the number of servers: enough for
any path, so nothing is tuned to the topology and only the origin id + message id
dedup window keeps a message that arrives by two paths (or comes back round a ring)
from being delivered twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import queue
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import federationsites
from federationsites import channel, federation_file, site, upstream_bindings, wait_running

from twinmq.broker.federation.agent import queue_name
from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.waiting import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import xsite

EXCHANGE = "x"
SINK = "sink"
Link = tuple[str, str]  # (downstream, upstream)


def ring(n: int) -> list[Link]:
    """s0 <- s(n-1), s1 <- s0, ...: each server federates from the one before it."""
    return [(f"s{i}", f"s{(i - 1) % n}") for i in range(n)]


def diamond() -> list[Link]:
    """s0 feeds s1 and s2, both feed s3 (two paths from s0 to s3)."""
    return [("s1", "s0"), ("s2", "s0"), ("s3", "s1"), ("s3", "s2")]


def mesh(n: int) -> list[Link]:
    """Every server federates from every other one (the ring's links first: those
    carry on what they bring, so most messages reach a server by several paths)."""
    links = ring(n)
    links += [(f"s{d}", f"s{u}") for d in range(n) for u in range(n) if d != u]
    return list(dict.fromkeys(links))


TOPOLOGIES = {"ring": ring, "mesh": mesh}


def topology(name: str, servers: int) -> list[Link]:
    """The links of the topology `name` (ring, mesh: `servers` of them; diamond: 4)."""
    return diamond() if name == "diamond" else TOPOLOGIES[name](servers)


def local_exchange(links: list[Link], link: Link) -> str:
    """The downstream exchange a link feeds: `x` for the downstream's first link."""
    first = next(candidate for candidate in links if candidate[0] == link[0])
    return EXCHANGE if first == link else f"{EXCHANGE}.from.{link[1]}"


def recipients(links: list[Link], origin: str, max_hops: int) -> set[str]:
    """The servers a message published on `origin`'s `x` reaches (other than the origin):
    along links, while it lands in an `x` that is federated on, within `max_hops`."""
    reached: set[str] = set()
    frontier = {origin}
    for _ in range(max_hops):
        travels_on: set[str] = set()
        for down, up in links:
            if up in frontier and down != origin:
                reached.add(down)
                if local_exchange(links, (down, up)) == EXCHANGE:
                    travels_on.add(down)
        frontier = travels_on
    return reached


@dataclass
class Mesh:
    """Started servers (by name) and the proxy of each link."""

    links: list[Link]
    servers: dict[str, BrokerProcess]
    proxies: dict[Link, FaultProxy]
    max_hops: int


@contextlib.contextmanager
def federated_servers(tmp: Path, links: list[Link]) -> Iterator[Mesh]:
    """Start every server of `links` with its federation file, each link through a proxy;
    wait until every link runs and `sink` is bound everywhere; stop everything after."""
    names = sorted({name for link in links for name in link})
    max_hops = len(names)
    servers = {name: site(tmp, name) for name in names}
    proxies: dict[Link, FaultProxy] = {}
    try:
        for name in names:
            upstream_links = [link for link in links if link[0] == name]
            if not upstream_links:
                continue
            exchanges = [
                {
                    "exchange": local_exchange(links, link),
                    "upstream": link[1],
                    "upstream-exchange": EXCHANGE,
                    "type": "fanout",
                    "max-hops": max_hops,
                }
                for link in upstream_links
            ]
            upstreams: dict[str, str] = {}
            for link in upstream_links:
                # The upstream's port is known before it starts (`site` picks a free one).
                proxies[link] = FaultProxy(f"127.0.0.1:{servers[link[1]].port}").start()
                upstreams[link[1]] = proxies[link].address
            path = federation_file(tmp / f"{name}.json", upstreams, exchanges)
            servers[name].extra_args += ["--federation-config", str(path)]
        for broker in servers.values():
            broker.start()
        for link in links:
            wait_running(servers[link[0]], local_exchange(links, link), timeout=120)
        # Every exchange exists now (a link declares its own and the upstream's).
        for name, broker in servers.items():
            connection, ch = channel(broker)
            try:
                ch.queue_declare(SINK, durable=True)
                for exchange in _exchanges(links, name):
                    ch.queue_bind(SINK, exchange, "")
            finally:
                connection.close()
        for down, up in links:
            queue = queue_name(EXCHANGE, down)
            wait_for(
                f"{down}'s binding on {up}",
                lambda up=up, queue=queue: bool(upstream_bindings(servers[up], queue)),
                120,
            )
        yield Mesh(links, servers, proxies, max_hops)
    finally:
        for broker in servers.values():
            broker.stop()
        for proxy in proxies.values():
            proxy.close()


def _exchanges(links: list[Link], server: str) -> list[str]:
    """`x` and the `x.from.*` exchanges of `server`."""
    return [EXCHANGE] + [
        local_exchange(links, link)
        for link in links
        if link[0] == server and local_exchange(links, link) != EXCHANGE
    ]


@dataclass
class Outcome:
    """What a run did: per server, what it should have got and what it got."""

    confirmed: dict[str, int] = field(default_factory=dict)  # per origin
    lost: dict[str, int] = field(default_factory=dict)  # per receiving server
    duplicates: dict[str, int] = field(default_factory=dict)  # per receiving server
    delivered: dict[str, int] = field(default_factory=dict)
    flaps: int = 0
    seconds: float = 0.0
    dedup_dropped: int = 0
    loops_dropped: int = 0

    @property
    def total_lost(self) -> int:
        """Confirmed messages some server that should have them never got."""
        return sum(self.lost.values())

    @property
    def total_duplicates(self) -> int:
        """Deliveries past the first of one message to one server."""
        return sum(self.duplicates.values())


def _consume(address: str, stop: Any, distinct: Any, last: Any, out: Any) -> None:
    """A consumer process: `sink` at `address` until `stop`, then every (origin, seq) it
    got, in order, into `out`; `distinct` and `last` (arrival, perf_counter s) kept up to date."""

    async def run() -> list[tuple[int, int]]:
        received = xsite.Received()
        task = asyncio.create_task(xsite.consume(address, SINK, received))
        seen: set[tuple[int, int]] = set()
        while not stop.is_set():
            await asyncio.sleep(0.2)
            if task.done():
                task.result()  # raises what stopped it
            for item in received.seqs[len(seen) :]:
                seen.add(item)
            distinct.value = len(seen)
            last.value = received.last_ns / 1e9
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return received.seqs

    out.put(asyncio.run(run()))


def _publish(address: str, phase: int, count: int, window: int, size: int, out: Any) -> None:
    """A publisher process: `count` confirmed messages on `x`; the confirmed seqs into `out`."""
    published = asyncio.run(
        xsite.publish(address, EXCHANGE, "", phase=phase, window=window, size=size, count=count)
    )
    out.put((phase, sorted(published.confirmed)))


def run_traffic(
    mesh_: Mesh,
    messages: int,
    *,
    flap_every: float = 1.0,
    flap_for: float = 0.8,
    window: int = 200,
    size: int = 256,
    seed: int = 1,
    progress: bool = False,
) -> Outcome:
    """Publish `messages` confirmed messages spread over every server (its origin id is the
    phase of xsite's stamp) while random links are partitioned or reset (every
    ~`flap_every` s, for up to `flap_for` s); consume every `sink`; count per server what
    it should have got (`recipients`, plus its own) but did not, and what it got twice.
    Each publisher and consumer is a process of its own (in one process the publishers
    starved the consumers: tens of deliveries a second)."""
    names = sorted(mesh_.servers)
    phase_of = {name: i + 1 for i, name in enumerate(names)}
    address = {name: f"127.0.0.1:{mesh_.servers[name].port}" for name in names}
    rng = random.Random(seed)
    outcome = Outcome()
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    distinct = {name: ctx.Value("q", 0) for name in names}
    last = {name: ctx.Value("d", 0.0) for name in names}
    seqs_out = {name: ctx.Queue() for name in names}
    confirmed_out = ctx.Queue()
    started = time.monotonic()
    consumers = {
        name: ctx.Process(
            target=_consume,
            args=(address[name], stop, distinct[name], last[name], seqs_out[name]),
            daemon=True,
        )
        for name in names
    }
    share = [messages // len(names) + (i < messages % len(names)) for i in range(len(names))]
    publishers = [
        ctx.Process(
            target=_publish,
            args=(address[name], phase_of[name], share[i], window, size, confirmed_out),
            daemon=True,
        )
        for i, name in enumerate(names)
    ]
    for process in [*consumers.values(), *publishers]:
        process.start()

    def report() -> None:
        got = ", ".join(f"{name} {distinct[name].value}" for name in names)
        print(f"  {time.monotonic() - started:.0f} s: received {got}", flush=True)

    links = list(mesh_.proxies)
    reported = time.monotonic()

    def flap() -> None:
        """Partition or reset a random link for a while (the caller waited ~flap_every)."""
        nonlocal reported
        if links:
            proxy = mesh_.proxies[rng.choice(links)]
            proxy.partition() if rng.random() < 0.5 else proxy.cut()
            outcome.flaps += 1
            time.sleep(rng.uniform(0.05, flap_for))
            proxy.heal()
        if progress and time.monotonic() - reported >= 10:
            reported = time.monotonic()
            report()

    confirmed: dict[int, list[int]] = {}
    while len(confirmed) < len(names):
        with contextlib.suppress(queue.Empty):
            phase, seqs = confirmed_out.get(timeout=rng.uniform(0.2, 2 * flap_every))
            confirmed[phase] = seqs
            continue
        flap()
    for process in publishers:
        process.join(60)
    expected = {
        name: {
            (phase_of[origin], seq)
            for origin in names
            if origin == name or name in recipients(mesh_.links, origin, mesh_.max_hops)
            for seq in confirmed[phase_of[origin]]
        }
        for name in names
    }
    deadline = time.monotonic() + max(600.0, messages / 100)
    while time.monotonic() < deadline:
        complete = all(distinct[name].value >= len(expected[name]) for name in names)
        idle = time.perf_counter() - max(last[name].value for name in names)
        if complete and idle >= 3.0:
            break
        if any(not process.is_alive() for process in consumers.values()):
            break  # a consumer failed: what it got is still counted (as lost, if short)
        # Links flap on until everything arrived; then 3 s of quiet for late duplicates.
        time.sleep(rng.uniform(0.2, 2 * flap_every) if not complete else 0.5)
        if not complete:
            flap()
    stop.set()
    received = {name: seqs_out[name].get(timeout=120) for name in names}
    for process in consumers.values():
        process.join(30)
    for name in names:
        got = received[name]
        outcome.lost[name] = len(expected[name] - set(got))
        outcome.duplicates[name] = len(got) - len(set(got))
        outcome.delivered[name] = len(got)
    outcome.confirmed = {name: len(confirmed[phase_of[name]]) for name in names}
    outcome.seconds = time.monotonic() - started
    for broker in mesh_.servers.values():
        for link in federationsites.links(broker).values():
            outcome.dedup_dropped += int(link.get("duplicates_dropped", 0))
            outcome.loops_dropped += int(link.get("loops_dropped", 0))
    return outcome


def describe(outcome: Outcome) -> dict[str, Any]:
    """The outcome as one JSON-friendly record."""
    return {
        "confirmed": sum(outcome.confirmed.values()),
        "delivered": sum(outcome.delivered.values()),
        "lost": outcome.total_lost,
        "duplicates": outcome.total_duplicates,
        "flaps": outcome.flaps,
        "seconds": round(outcome.seconds, 1),
        "second_copies_dropped": outcome.dedup_dropped,
        "loops_dropped": outcome.loops_dropped,
    }
