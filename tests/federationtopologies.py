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

Any server can be a pair (active + passive, replicated; both with the server's id):
its clients and the links from it reach it through a proxy moved to the new active at a
failover (the virtual IP's stand-in), and `run_traffic` kills its active (kill -9) while
the messages flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import queue
import random
import sys
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import federationsites
from federationsites import (
    PASSWORD_ENV,
    channel,
    federation_file,
    queue_depth,
    site,
    upstream_bindings,
    wait_running,
)

from twinmq.broker.federation.agent import queue_name
from twinmq.testing.amqpclient import ClientError
from twinmq.testing.faultproxy import FaultProxy
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import Pair
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
    """Started servers (by name: a single broker or a pair) and the proxy of each link."""

    links: list[Link]
    singles: dict[str, BrokerProcess]
    proxies: dict[Link, FaultProxy]
    max_hops: int
    pairs: dict[str, Pair] = field(default_factory=dict)
    vips: dict[str, FaultProxy] = field(default_factory=dict)  # a pair's virtual IP

    @property
    def names(self) -> list[str]:
        """Every server, sorted."""
        return sorted([*self.singles, *self.pairs])

    @property
    def servers(self) -> dict[str, BrokerProcess]:
        """The broker serving each server's clients now (a pair's active)."""
        return {name: self.broker(name) for name in self.names}

    def broker(self, name: str) -> BrokerProcess:
        """The broker serving `name`'s clients now (a pair's active)."""
        return self.pairs[name].active if name in self.pairs else self.singles[name]

    def address(self, name: str) -> str:
        """host:port for `name`'s clients (a pair's virtual IP)."""
        if name in self.vips:
            return self.vips[name].address
        broker = self.singles[name]
        return f"{broker.host}:{broker.port}"

    def failover(self, name: str) -> bool:
        """kill -9 the active of the pair `name`, promote its passive and move its virtual
        IP and the links from it (their proxies) there; whether it was promoted (a passive
        not ready is not: the old active restarts, on the same address)."""
        pair = self.pairs[name]
        pair.wait_healthy(timeout=300)  # caught up since the last failover

        def move() -> None:
            target = f"{pair.active.host}:{pair.active.port}"
            self.vips[name].retarget(target)
            for link, proxy in self.proxies.items():
                if link[1] == name:
                    proxy.retarget(target)

        return pair.failover(ready_timeout=60, on_promoted=move)


@contextlib.contextmanager
def federated_servers(
    tmp: Path, links: list[Link], pairs: Collection[str] = (), dedup_window: int | None = None
) -> Iterator[Mesh]:
    """Start every server of `links` with its federation file (those named in `pairs` as
    a pair), each link through a proxy; wait until every link runs and `sink` is bound
    everywhere; stop everything after. `dedup_window`: every server's `dedup-window`
    (default: the broker's), smaller to see at 100,000 messages what a million does to
    the default window."""
    names = sorted({name for link in links for name in link})
    max_hops = len(names)
    singles = {name: site(tmp, name) for name in names if name not in pairs}
    pair_of = {
        name: Pair(tmp / name, broker_args=["--server-id", name], names=(f"{name}a", f"{name}b"))
        for name in names
        if name in pairs
    }
    for pair in pair_of.values():
        for broker in pair.brokers.values():
            broker.env[PASSWORD_ENV] = "guest"
    # Every port is known before anything starts (`site` and `Pair` pick free ones).
    port = {name: broker.port for name, broker in singles.items()}
    port.update({name: pair.active.port for name, pair in pair_of.items()})
    proxies: dict[Link, FaultProxy] = {}
    vips: dict[str, FaultProxy] = {}
    mesh = Mesh(links, singles, proxies, max_hops, pair_of, vips)
    started: list[Pair] = []
    try:
        for name in pair_of:
            vips[name] = FaultProxy(f"127.0.0.1:{port[name]}").start()
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
                proxies[link] = FaultProxy(f"127.0.0.1:{port[link[1]]}").start()
                upstreams[link[1]] = proxies[link].address
            settings = {} if dedup_window is None else {"dedup-window": dedup_window}
            path = federation_file(tmp / f"{name}.json", upstreams, exchanges, settings)
            if name in pair_of:
                pair_of[name].broker_args += ["--federation-config", str(path)]
            else:
                singles[name].extra_args += ["--federation-config", str(path)]
        for broker in singles.values():
            broker.start()
        for pair in pair_of.values():
            started.append(pair.start())
        for link in links:
            wait_running(mesh.broker(link[0]), local_exchange(links, link), timeout=120)
        # Every exchange exists now (a link declares its own and the upstream's).
        for name, broker in mesh.servers.items():
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
                lambda up=up, queue=queue: bool(upstream_bindings(mesh.broker(up), queue)),
                120,
            )
        for pair in pair_of.values():
            pair.wait_healthy(timeout=120)
        yield mesh
    finally:
        for broker in singles.values():
            broker.stop()
        for pair in started:
            pair.stop()
        for proxy in [*proxies.values(), *vips.values()]:
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
    failovers: int = 0  # a pair's active killed and its passive promoted
    seconds: float = 0.0
    dedup_dropped: int = 0
    loops_dropped: int = 0
    missing: dict[str, str] = field(default_factory=dict)  # per server: (origin, seq) ranges

    @property
    def total_lost(self) -> int:
        """Confirmed messages some server that should have them never got."""
        return sum(self.lost.values())

    @property
    def total_duplicates(self) -> int:
        """Deliveries past the first of one message to one server."""
        return sum(self.duplicates.values())


def _consume(
    address: str, stop: Any, expected_in: Any, distinct: Any, judged: Any, last: Any, out: Any
) -> None:
    """A consumer process: `sink` at `address` until `stop`, then every (origin, seq) it
    got, in order, into `out`; `distinct` and `last` (arrival, perf_counter s) kept up to
    date. `distinct` counts the distinct messages got, and once the set this server must
    get arrives on `expected_in` (`judged` then set) only those of it: a message whose
    confirm a failover lost may arrive too, and counting it would call a server complete
    that still misses a confirmed one."""

    async def run() -> list[tuple[int, int]]:
        received = xsite.Received()
        task = asyncio.create_task(xsite.consume(address, SINK, received))
        seen: set[tuple[int, int]] = set()
        wanted: set[tuple[int, int]] | None = None
        got_wanted = 0
        done = 0  # received.seqs[:done] are in `seen`
        while not stop.is_set():
            await asyncio.sleep(0.2)
            if task.done():
                task.result()  # raises what stopped it
            if wanted is None:
                with contextlib.suppress(queue.Empty):
                    wanted = expected_in.get_nowait()
                    got_wanted = len(seen & wanted)
            for item in received.seqs[done:]:
                if item not in seen:
                    seen.add(item)
                    got_wanted += wanted is not None and item in wanted
            done = len(received.seqs)
            distinct.value = len(seen) if wanted is None else got_wanted
            judged.value = wanted is not None
            last.value = received.last_ns / 1e9
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return received.seqs

    out.put(asyncio.run(run()))


async def _publish_through(
    address: str, phase: int, count: int, window: int, size: int
) -> xsite.Published:
    """`count` confirmed messages on `x` at `address`, connecting again when the broker goes
    away (a pair's failover): what was unconfirmed then counts as not confirmed (it may
    arrive, once), and the sequence numbers go on."""
    out = xsite.Published()
    deadline = time.monotonic() + max(600.0, count / 20)
    while time.monotonic() < deadline:
        try:
            await xsite.publish(
                address, EXCHANGE, "", phase=phase, window=window, size=size, count=count, out=out
            )
            return out
        except (ClientError, OSError):
            out.abandon()
            await asyncio.sleep(0.2)
    return out


def _publish(address: str, phase: int, count: int, window: int, size: int, out: Any) -> None:
    """A publisher process: `count` confirmed messages on `x`; the confirmed seqs into `out`."""
    published = asyncio.run(_publish_through(address, phase, count, window, size))
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
    failovers: int = 0,
) -> Outcome:
    """Publish `messages` confirmed messages spread over every server (its origin id is the
    phase of xsite's stamp) while random links are partitioned or reset (every
    ~`flap_every` s, for up to `flap_for` s); consume every `sink`; count per server what
    it should have got (`recipients`, plus its own) but did not, and what it got twice.
    Each publisher and consumer is a process of its own (in one process the publishers
    starved the consumers: tens of deliveries a second).

    With `failovers` (and pairs in the mesh), the pairs' actives are killed in turn that
    many times while the messages flow (the k-th once the pair's `sink` holds k/(n+1) of
    its share), and a pair's `sink` is consumed only after the last failover: a consumer
    cut by a kill gets what it had not acknowledged again (AMQP's redelivery to a
    consumer, flagged `redelivered`), which would hide or fake a second copy; left in the
    queue, every copy counted is a message the servers made."""
    names = mesh_.names
    phase_of = {name: i + 1 for i, name in enumerate(names)}
    address = {name: mesh_.address(name) for name in names}
    rng = random.Random(seed)
    outcome = Outcome()
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    distinct = {name: ctx.Value("q", 0) for name in names}
    judged = {name: ctx.Value("b", False) for name in names}
    expected_in = {name: ctx.Queue() for name in names}
    last = {name: ctx.Value("d", 0.0) for name in names}
    seqs_out = {name: ctx.Queue() for name in names}
    confirmed_out = ctx.Queue()
    started = time.monotonic()
    consumers = {
        name: ctx.Process(
            target=_consume,
            args=(
                address[name],
                stop,
                expected_in[name],
                distinct[name],
                judged[name],
                last[name],
                seqs_out[name],
            ),
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
    killed = sorted(mesh_.pairs) if failovers else []
    for name, process in consumers.items():
        if name not in killed:
            process.start()
    for process in publishers:
        process.start()
    done_failovers = 0

    def failover_due() -> str | None:
        """The pair to fail over now, if its `sink` has grown past the next mark."""
        if done_failovers >= failovers or not killed:
            return None
        name = killed[done_failovers % len(killed)]
        mark = (done_failovers + 1) * messages // (len(names) * (failovers + 1))
        return name if queue_depth(mesh_.broker(name), SINK) >= mark else None

    def fail_over(name: str) -> None:
        nonlocal done_failovers
        done_failovers += 1
        promoted = mesh_.failover(name)
        outcome.failovers += int(promoted)
        if progress:
            print(f"  {time.monotonic() - started:.0f} s: failover of {name}: {promoted}")

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
        if (due := failover_due()) is not None:
            fail_over(due)
        flap()
    for process in publishers:
        process.join(60)
    while done_failovers < failovers and killed:  # the publishers were quicker than the marks
        fail_over(killed[done_failovers % len(killed)])
    for name in killed:
        mesh_.pairs[name].wait_healthy(timeout=300)
        consumers[name].start()
    expected = {
        name: {
            (phase_of[origin], seq)
            for origin in names
            if origin == name or name in recipients(mesh_.links, origin, mesh_.max_hops)
            for seq in confirmed[phase_of[origin]]
        }
        for name in names
    }
    for name in names:
        expected_in[name].put(expected[name])
    deadline = time.monotonic() + max(600.0, messages / 100)
    while time.monotonic() < deadline:
        complete = all(
            judged[name].value and distinct[name].value >= len(expected[name]) for name in names
        )
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
        missing = sorted(expected[name] - set(got))
        outcome.lost[name] = len(missing)
        if missing:
            outcome.missing[name] = _ranges(missing)
        outcome.duplicates[name] = len(got) - len(set(got))
        outcome.delivered[name] = len(got)
    outcome.confirmed = {name: len(confirmed[phase_of[name]]) for name in names}
    outcome.seconds = time.monotonic() - started
    for broker in mesh_.servers.values():
        for link in federationsites.links(broker).values():
            outcome.dedup_dropped += int(link.get("duplicates_dropped", 0))
            outcome.loops_dropped += int(link.get("loops_dropped", 0))
    return outcome


def _ranges(keys: list[tuple[int, int]], at_most: int = 10) -> str:
    """(phase, seq) keys, sorted, as `phase:first-last` runs (the first `at_most`)."""
    runs: list[list[int]] = []
    for phase, seq in keys:
        if runs and runs[-1][0] == phase and runs[-1][2] == seq - 1:
            runs[-1][2] = seq
        else:
            runs.append([phase, seq, seq])
    shown = [f"{p}:{a}-{b}" if a != b else f"{p}:{a}" for p, a, b in runs[:at_most]]
    return " ".join(shown) + (f" (+{len(runs) - at_most} runs)" if len(runs) > at_most else "")


def describe(outcome: Outcome) -> dict[str, Any]:
    """The outcome as one JSON-friendly record."""
    return {
        "confirmed": sum(outcome.confirmed.values()),
        "delivered": sum(outcome.delivered.values()),
        "lost": outcome.total_lost,
        "duplicates": outcome.total_duplicates,
        "flaps": outcome.flaps,
        "failovers": outcome.failovers,
        "seconds": round(outcome.seconds, 1),
        "second_copies_dropped": outcome.dedup_dropped,
        "loops_dropped": outcome.loops_dropped,
        **({"missing": outcome.missing} if outcome.missing else {}),
    }
