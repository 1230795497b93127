"""A Jepsen-style total-queue test of a TwinMQ pair: checker, clients, pair, nemesis.

- `check` is the checker, a pure function over what the clients saw: every
  producer's sent and confirmed message numbers and the bodies the consumers
  received. Lost (confirmed, never received) and unexpected (received, never
  sent) must both be empty; duplicates are counted.
- `Workload` runs numbered producers with publisher confirms and consumers with
  acks on one asyncio loop. They know both brokers' addresses and reconnect to
  whichever is active (a passive one refuses them with 320).
- `Pair` is two broker processes, active and passive, the passive replicating
  through a `FaultProxy` the test controls; its `failover` is the operator's
  procedure over the admin API.
- `Nemesis` performs faults on the pair (kill -9 and promote, SIGSTOP/SIGCONT,
  cut or partitioned replication link, passive restarted mid-catch-up) and
  waits for the pair to be whole again after each.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from amqpclient import AMQPClient, ClientError, Delivery, Refused
from faultproxy import FaultProxy

from twinmq.broker.launcher import BrokerProcess

T = TypeVar("T")
Key = tuple[str, int]  # (producer, message number)

# -- the checker --------------------------------------------------------------------------


def encode_body(producer: str, number: int, padding: int = 0) -> bytes:
    """The body a producer sends: `<producer>:<number>:` and optional padding."""
    return f"{producer}:{number}:".encode() + b"x" * padding


def decode_body(body: bytes) -> Key | None:
    """(producer, number) of a body, None if it is not one of ours."""
    try:
        producer, number, rest = body.split(b":", 2)
        if rest.strip(b"x"):
            return None
        return producer.decode(), int(number)
    except ValueError:
        return None


@dataclass(frozen=True)
class Verdict:
    """What the checker found."""

    sent: int
    confirmed: int
    received: int  # distinct messages received
    deliveries: int  # every delivery, duplicates included
    lost: list[Key]  # confirmed, never received
    unexpected: list[bytes]  # received, never sent (or not a body of ours)
    duplicates: dict[Key, int]  # message -> extra deliveries
    recovered: int  # received though never confirmed (the confirm was lost in a fault)

    @property
    def ok(self) -> bool:
        """No confirmed message lost, nothing unexpected."""
        return not self.lost and not self.unexpected

    @property
    def duplicate_count(self) -> int:
        """Extra deliveries over all messages."""
        return sum(self.duplicates.values())

    def summary(self) -> str:
        """One line of figures."""
        return (
            f"sent {self.sent}, confirmed {self.confirmed}, received {self.received} "
            f"({self.deliveries} deliveries), lost {len(self.lost)}, "
            f"unexpected {len(self.unexpected)}, duplicates {self.duplicate_count} "
            f"(of {len(self.duplicates)} messages), received unconfirmed {self.recovered}"
        )


def check(
    sent: Mapping[str, Iterable[int]],
    confirmed: Mapping[str, Iterable[int]],
    received: Iterable[bytes],
) -> Verdict:
    """The total-queue checker: lost = confirmed - received, unexpected = received - sent."""
    sent_keys = {(p, n) for p, numbers in sent.items() for n in numbers}
    confirmed_keys = {(p, n) for p, numbers in confirmed.items() for n in numbers}
    counts: Counter[Key] = Counter()
    unexpected: list[bytes] = []
    deliveries = 0
    for body in received:
        deliveries += 1
        key = decode_body(body)
        if key is None or key not in sent_keys:
            unexpected.append(body)
        else:
            counts[key] += 1
    got = set(counts)
    return Verdict(
        sent=len(sent_keys),
        confirmed=len(confirmed_keys),
        received=len(got),
        deliveries=deliveries,
        lost=sorted(confirmed_keys - got),
        unexpected=unexpected,
        duplicates={k: c - 1 for k, c in sorted(counts.items()) if c > 1},
        recovered=len(got - confirmed_keys),
    )


# -- admin API ------------------------------------------------------------------------------


def status(broker: BrokerProcess, timeout: float = 2.0) -> dict[str, Any] | None:
    """`GET /status`, or None when the broker does not answer (dead, stopped)."""
    try:
        with urllib.request.urlopen(broker.admin_url + "/status", timeout=timeout) as response:
            data: dict[str, Any] = json.loads(response.read())
            return data
    except (OSError, ValueError):
        return None


def post_role(
    broker: BrokerProcess,
    role: str,
    epoch: int,
    replicate_from: str | None = None,
    timeout: float = 10.0,
    *,
    force: bool = False,
) -> tuple[int, dict[str, Any]]:
    """`POST /role`: (HTTP status, JSON body)."""
    body: dict[str, Any] = {"role": role, "epoch": epoch}
    if force:
        body["force"] = True
    if replicate_from is not None:
        body["replicate_from"] = replicate_from
    request = urllib.request.Request(
        broker.admin_url + "/role",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def queue_counts(data: dict[str, Any] | None, *queues: str) -> tuple[int, int] | None:
    """(ready, unacked) over `queues` in a status, None if one is absent."""
    if data is None:
        return None
    found = {q["name"]: (int(q["messages"]), int(q["unacked"])) for q in data["queues"]}
    if any(name not in found for name in queues):
        return None
    return sum(found[n][0] for n in queues), sum(found[n][1] for n in queues)


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `predicate` until it returns something truthy; raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout}s")
        time.sleep(interval)


# -- the pair -------------------------------------------------------------------------------


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def stable_port(rng: random.Random = random.Random()) -> int:  # noqa: B008 - one shared rng
    """A free loopback port outside the kernel's ephemeral range.

    Brokers are killed and restarted on the same ports while clients reconnect
    all the time: a port from the ephemeral range may meanwhile be the source
    port of some client connection, and the restart would fail to bind.
    """
    low, high = _ephemeral_range()
    candidates = [(1024, low - 1)] if low > 11024 else [(high + 1, 65535)]
    lo, hi = candidates[0]
    for _ in range(200):
        port = rng.randint(max(lo, 10000), hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port outside the ephemeral range")


class Pair:
    """Brokers `a` and `b`: one active, one passive replicating through `self.link`."""

    TOKEN = "fault-suite-replication-token"

    def __init__(self, root: Path, *, replication_timeout: float = 1.0) -> None:
        self.root = root
        self.replication_timeout = replication_timeout
        self.epoch = 1
        env = {"TWINMQ_REPLICATION_TOKEN": self.TOKEN}
        self.brokers = {
            name: BrokerProcess(
                root / name,
                name=name,
                env=dict(env),
                port=stable_port(),
                admin_port=stable_port(),
                replication_port=stable_port(),
            )
            for name in ("a", "b")
        }
        self.active_name, self.passive_name = "a", "b"
        self.link = FaultProxy(self.brokers["a"].replication_address, port=stable_port())
        self.events: list[str] = []
        self.started = time.monotonic()

    @property
    def active(self) -> BrokerProcess:
        """The broker serving clients."""
        return self.brokers[self.active_name]

    @property
    def passive(self) -> BrokerProcess:
        """The replica."""
        return self.brokers[self.passive_name]

    @property
    def amqp_addresses(self) -> list[str]:
        """Both brokers' AMQP addresses (clients find the active one)."""
        return [f"{b.host}:{b.port}" for b in self.brokers.values()]

    def note(self, text: str) -> None:
        """Record a nemesis event."""
        self.events.append(f"{time.monotonic() - self.started:8.2f}s {text}")

    def args(self, role: str) -> list[str]:
        """Command-line flags for a broker of the pair in `role` at the current epoch."""
        args = ["--epoch", str(self.epoch), "--replication-timeout", str(self.replication_timeout)]
        if role == "passive":
            args += ["--role", "passive", "--replicate-from", self.link.address]
        return args

    def start(self) -> Pair:
        """Start the proxy, the active, then the passive; wait until the passive is ready."""
        self.link.start()
        self.active.extra_args = self.args("active")
        self.active.start()
        self.passive.extra_args = self.args("passive")
        self.passive.start()
        self.wait_healthy()
        return self

    def stop(self) -> None:
        """Stop everything (SIGCONT first, in case a broker is paused)."""
        for broker in self.brokers.values():
            broker.signal(signal.SIGCONT)
            broker.stop()
        self.link.close()

    def __enter__(self) -> Pair:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def healthy(self) -> bool:
        """The active has a passive in sync and the passive says it is ready."""
        active, passive = status(self.active), status(self.passive)
        return bool(
            active is not None
            and passive is not None
            and active["role"] == "active"
            and passive["role"] == "passive"
            and active["replication"]["ready"]
            and passive["replication"]["ready"]
        )

    def wait_healthy(self, timeout: float = 30.0) -> None:
        """Wait until `healthy`; raise with both statuses if it does not happen."""
        try:
            wait_for(self.healthy, timeout, "pair in sync", interval=0.1)
        except TimeoutError as exc:
            raise TimeoutError(
                f"{exc}\nactive {self.active_name}: {status(self.active)}\n"
                f"passive {self.passive_name}: {status(self.passive)}\n"
                + "\n".join(self.events[-10:])
            ) from None

    def failover(self, ready_timeout: float = 10.0) -> bool:
        """kill -9 the active; promote the passive if it is ready, else restart the active.

        The operator's procedure: only a passive whose status says `ready` is
        promoted (epoch+1) and the old active comes back as its passive; with
        no ready passive the old active is started again, active, same epoch.
        Returns whether the passive was promoted.
        """
        old, new = self.active, self.passive
        old.kill()
        self.note(f"kill -9 active {old.name}")
        try:
            wait_for(
                lambda: (s := status(new)) is not None and s["replication"]["ready"],
                ready_timeout,
                f"passive {new.name} ready for promotion",
            )
        except TimeoutError:
            self.note(f"passive {new.name} not ready: restarting {old.name} as active")
            self.link.heal()
            old.extra_args = self.args("active")
            old.start()
            return False
        self.promote_passive()
        old.extra_args = self.args("passive")
        old.start()
        self.note(f"{old.name} restarted as passive of {new.name} (epoch {self.epoch})")
        return True

    def promote_passive(self) -> None:
        """`POST /role` active at epoch+1 on the passive; point the link at it."""
        new = self.passive
        self.epoch += 1
        code, body = post_role(new, "active", self.epoch)
        if code != 200 or body.get("role") != "active":
            raise AssertionError(f"promotion of {new.name} failed: {code} {body}")
        self.note(f"promoted {new.name} to active in epoch {self.epoch}")
        new.extra_args = self.args("active")  # what it would restart with
        self.link.retarget(new.replication_address)
        self.active_name, self.passive_name = self.passive_name, self.active_name


# -- the clients ----------------------------------------------------------------------------


async def connect_active(
    addresses: list[str], stop: Callable[[], bool], heartbeat: int = 1
) -> AMQPClient | None:
    """Try every address until one accepts us (an active broker); None once `stop()`."""
    while not stop():
        for address in addresses:
            try:
                return await AMQPClient.connect(address, within=2.0, heartbeat=heartbeat)
            except Refused as exc:
                if exc.code != 320:
                    raise
            except ClientError:
                pass
        await asyncio.sleep(0.1)
    return None


@dataclass
class ProducerLog:
    """What one producer did."""

    name: str
    sent: set[int] = field(default_factory=set)
    confirmed: set[int] = field(default_factory=set)
    nacked: set[int] = field(default_factory=set)
    connections: int = 0


class Producer:
    """Publishes numbered persistent messages with confirms, `window` unconfirmed at most."""

    def __init__(
        self, name: str, addresses: list[str], queues: list[str], *, window: int,
        interval: float, padding: int,
    ) -> None:  # fmt: skip
        self.log = ProducerLog(name)
        self.addresses = addresses
        self.queues = queues
        self.window = window
        self.interval = interval
        self.padding = padding
        self.stopping = False
        self._next = 0
        self._outstanding: dict[int, int] = {}  # confirm tag -> message number
        self._room = asyncio.Event()
        self._settled = asyncio.Event()  # nothing outstanding

    def _on_confirm(self, tag: int, multiple: bool, ack: bool) -> None:
        tags = [t for t in self._outstanding if t <= tag] if multiple else [tag]
        for t in tags:
            number = self._outstanding.pop(t, None)
            if number is not None:
                (self.log.confirmed if ack else self.log.nacked).add(number)
        if len(self._outstanding) < self.window:
            self._room.set()
        if not self._outstanding:
            self._settled.set()

    async def run(self) -> None:
        """Publish until `stopping`; then wait a little for the last confirms."""
        while not self.stopping:
            client = await connect_active(self.addresses, lambda: self.stopping)
            if client is None:
                return
            self.log.connections += 1
            self._outstanding = {}
            self._room.set()
            try:
                client.on_confirm = self._on_confirm
                for queue in self.queues:
                    await client.queue_declare(queue)
                await client.confirm_select()
                await self._publish(client)
                # Stopping: give the last publishes a chance to be confirmed.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._confirmed_all(client), 10)
                await client.close()
            except ClientError:
                pass  # what is outstanding stays unconfirmed: sent, fate unknown
            finally:
                client.abort()

    async def _publish(self, client: AMQPClient) -> None:
        while not self.stopping:
            if len(self._outstanding) >= self.window:
                self._room.clear()
                waiter = asyncio.ensure_future(self._room.wait())
                closed = asyncio.ensure_future(client.closed.wait())
                await asyncio.wait({waiter, closed}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                closed.cancel()
                client.check()  # raises once the connection is gone
                continue
            number = self._next
            self._next += 1
            self.log.sent.add(number)
            queue = self.queues[number % len(self.queues)]
            tag = client.publish(queue, encode_body(self.log.name, number, self.padding))
            self._outstanding[tag] = number
            await client.drain()
            if self.interval:
                await asyncio.sleep(self.interval)

    async def _confirmed_all(self, client: AMQPClient) -> None:
        if self._outstanding:
            self._settled.clear()
            waiters = {
                asyncio.ensure_future(self._settled.wait()),
                asyncio.ensure_future(client.closed.wait()),
            }
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()


class Consumer:
    """Consumes with acks; records every body it is delivered."""

    def __init__(self, name: str, addresses: list[str], queues: list[str], prefetch: int) -> None:
        self.name = name
        self.addresses = addresses
        self.queues = queues
        self.prefetch = prefetch
        self.received: list[bytes] = []
        self.stopping = False
        self.paused = False  # set from the nemesis thread
        self.last_delivery = time.monotonic()
        self.connections = 0

    async def run(self) -> None:
        """Consume until `stopping`; reconnect after every fault."""
        while not self.stopping:
            if self.paused:
                await asyncio.sleep(0.05)
                continue
            client = await connect_active(self.addresses, lambda: self.stopping or self.paused)
            if client is None:
                continue
            self.connections += 1
            try:
                await client.qos(self.prefetch)
                for queue in self.queues:
                    await client.queue_declare(queue)
                    await client.consume(queue)
                await self._consume(client)
                await client.close()
            except ClientError:
                pass
            finally:
                client.abort()

    async def _consume(self, client: AMQPClient) -> None:
        while not self.stopping and not self.paused:
            try:
                delivery: Delivery | None = await asyncio.wait_for(client.deliveries.get(), 0.2)
            except TimeoutError:
                continue
            if delivery is None:
                raise client.error or ClientError("closed")
            self.received.append(delivery.body)
            self.last_delivery = time.monotonic()
            client.ack(delivery.tag)


class Workload:
    """Producers and consumers on one asyncio loop, against a pair's two addresses."""

    def __init__(
        self,
        addresses: list[str],
        queues: int = 2,
        *,
        producers: int = 3,
        consumers: int = 2,
        window: int = 20,
        interval: float = 0.002,
        padding: int = 100,
        prefetch: int = 50,
    ) -> None:
        self.queues = [f"jepsen-{i}" for i in range(queues)]
        self.producers = [
            Producer(
                f"p{i}", addresses, self.queues, window=window, interval=interval, padding=padding
            )
            for i in range(producers)
        ]
        self.consumers = [
            Consumer(f"c{i}", addresses, self.queues, prefetch) for i in range(consumers)
        ]
        self._tasks: list[asyncio.Task[None]] = []
        self.passive_left: tuple[int, int] | None = None  # (ready, unacked) at the end

    def start(self) -> None:
        """Start every client task (on the running loop)."""
        clients: list[Producer | Consumer] = [*self.producers, *self.consumers]
        for client in clients:
            self._tasks.append(asyncio.ensure_future(client.run()))

    def pause_consumers(self, paused: bool) -> None:
        """Disconnect the consumers (a backlog builds up) or let them back in."""
        for consumer in self.consumers:
            consumer.paused = paused

    @property
    def confirmed(self) -> int:
        """Confirms so far, over all producers."""
        return sum(len(p.log.confirmed) for p in self.producers)

    async def finish(self, pair: Pair, within: float = 60.0) -> None:
        """Stop the producers, let the consumers drain the queue, stop them."""
        for producer in self.producers:
            producer.stopping = True
        self.pause_consumers(False)
        await asyncio.wait_for(asyncio.gather(*self._tasks[: len(self.producers)]), within)

        def drained() -> bool:
            counts = queue_counts(status(pair.active), *self.queues)
            idle = min(time.monotonic() - c.last_delivery for c in self.consumers)
            return counts == (0, 0) and idle > 1.0

        await asyncio.to_thread(wait_for, drained, within, "queue drained", 0.2)
        for consumer in self.consumers:
            consumer.stopping = True
        await asyncio.wait_for(asyncio.gather(*self._tasks), within)

        # The passive must have followed every dequeue: its queues end empty too.
        def passive_left() -> tuple[int, int] | None:
            self.passive_left = queue_counts(status(pair.passive), *self.queues)
            return None if self.passive_left != (0, 0) else self.passive_left

        with contextlib.suppress(TimeoutError):
            await asyncio.to_thread(wait_for, passive_left, 15, "passive drained", 0.2)

    def verdict(self) -> Verdict:
        """Run the checker over what the clients saw."""
        return check(
            {p.log.name: p.log.sent for p in self.producers},
            {p.log.name: p.log.confirmed for p in self.producers},
            [body for c in self.consumers for body in c.received],
        )


# -- the nemesis ----------------------------------------------------------------------------

FAULTS = (
    "failover",
    "pause-active",
    "pause-passive",
    "cut-link",
    "partition-link",
    "restart-passive-mid-catchup",
    "failover-link-down",
    "replace-paused-active",
    "slow-link",
    "failover-slow-link",
)


@dataclass
class NemesisLog:
    """What the nemesis did."""

    cycles: int = 0
    by_fault: Counter[str] = field(default_factory=Counter)
    interrupted_catchups: int = 0
    degraded_seen: int = 0
    promotions_refused: int = 0  # kill -9 of the active found the passive not ready


class Nemesis:
    """Faults on a pair, one at a time; after each, the pair must be whole again."""

    def __init__(self, pair: Pair, workload: Workload, rng: random.Random) -> None:
        self.pair = pair
        self.workload = workload
        self.rng = rng
        self.log = NemesisLog()
        self.stop_event = threading.Event()

    def run(self, faults: Iterable[str]) -> NemesisLog:
        """Perform `faults` in order (blocking: run it on a thread)."""
        for fault in faults:
            if self.stop_event.is_set():
                break
            getattr(self, fault.replace("-", "_"))()
            self.pair.wait_healthy()
            self.log.cycles += 1
            self.log.by_fault[fault] += 1
        return self.log

    def _hold(self, low: float, high: float) -> float:
        """A fault's duration (how long a fault lasts, never a timing assertion)."""
        seconds = self.rng.uniform(low, high)
        time.sleep(seconds)
        return seconds

    def _traffic(self, confirms: int = 20, timeout: float = 30.0) -> None:
        """Let some publishes be confirmed before the next fault."""
        target = self.workload.confirmed + confirms
        wait_for(lambda: self.workload.confirmed >= target, timeout, "confirms flowing")

    def failover(self) -> None:
        self._traffic()
        if not self.pair.failover():
            self.log.promotions_refused += 1

    def failover_link_down(self) -> None:
        """Cut the link, let the active go on alone for a while, then kill it."""
        self._traffic()
        pair = self.pair
        # Without consumers what the active confirms meanwhile stays in its queue.
        self.workload.pause_consumers(True)
        pair.link.cut() if self.rng.random() < 0.5 else pair.link.partition()
        held = self._hold(0.1, pair.replication_timeout * 3)
        pair.note(f"replication link down for {held:.2f}s")
        if not pair.failover(ready_timeout=2 * pair.replication_timeout):
            self.log.promotions_refused += 1
        pair.link.heal()
        self.workload.pause_consumers(False)

    def slow_link(self) -> None:
        """Delay everything on the replication link for a while (below and above the timeout)."""
        self._traffic()
        pair = self.pair
        latency = self.rng.uniform(0.05, 2.0) * pair.replication_timeout
        pair.link.delay(latency)
        held = self._hold(pair.replication_timeout, 3 * pair.replication_timeout)
        pair.link.heal()
        pair.note(f"replication link delayed {latency:.2f}s for {held:.2f}s")

    def failover_slow_link(self) -> None:
        """A link slower than the timeout: the active goes on alone, then dies."""
        self._traffic()
        pair = self.pair
        self.workload.pause_consumers(True)
        latency = self.rng.uniform(1.5, 3.0) * pair.replication_timeout
        pair.link.delay(latency)
        held = self._hold(1.5 * pair.replication_timeout, 3 * pair.replication_timeout)
        pair.note(f"replication link delayed {latency:.2f}s for {held:.2f}s")
        if not pair.failover(ready_timeout=2 * pair.replication_timeout):
            self.log.promotions_refused += 1
        pair.link.heal()
        self.workload.pause_consumers(False)

    def replace_paused_active(self) -> None:
        """SIGSTOP the active; promote the passive; SIGCONT the old one and demote it.

        To the operator a paused active looks like an unreachable one: the
        passive is promoted while its status says ready (not after), and the
        old active, when it runs again, is told to be passive (POST /role). It
        must not confirm anything on its own meanwhile.
        """
        self._traffic()
        pair = self.pair
        old, new = pair.active, pair.passive
        old.signal(signal.SIGSTOP)
        held = self._hold(0.0, pair.replication_timeout)
        pair.note(f"SIGSTOP active {old.name}, {held:.2f}s later:")
        if not (s := status(new)) or not s["replication"]["ready"]:
            old.signal(signal.SIGCONT)
            self.log.promotions_refused += 1
            pair.note(f"passive {new.name} not ready: SIGCONT {old.name}")
            return
        pair.promote_passive()
        old.signal(signal.SIGCONT)
        code, body = post_role(old, "passive", pair.epoch, pair.link.address)
        old.extra_args = pair.args("passive")  # what it would restart with
        pair.note(f"SIGCONT {old.name}, demoted: {code} {body.get('role')}")
        assert code == 200 and body["role"] == "passive", (code, body)

    def pause_active(self) -> None:
        self._traffic()
        broker = self.pair.active
        broker.signal(signal.SIGSTOP)
        held = self._hold(0.2, self.pair.replication_timeout * 3)
        broker.signal(signal.SIGCONT)
        self.pair.note(f"SIGSTOP active {broker.name} for {held:.2f}s")

    def pause_passive(self) -> None:
        self._traffic()
        broker = self.pair.passive
        broker.signal(signal.SIGSTOP)
        held = self._hold(0.2, self.pair.replication_timeout * 3)
        if status(self.pair.active, 0.5) is not None:
            active = status(self.pair.active)
            if active is not None and active["replication"]["degraded"]:
                self.log.degraded_seen += 1
        broker.signal(signal.SIGCONT)
        self.pair.note(f"SIGSTOP passive {broker.name} for {held:.2f}s")

    def cut_link(self) -> None:
        self._traffic()
        self.pair.link.cut()
        held = self._hold(0.1, self.pair.replication_timeout * 3)
        self.pair.link.heal()
        self.pair.note(f"replication link cut for {held:.2f}s")

    def partition_link(self) -> None:
        self._traffic()
        self.pair.link.partition()
        held = self._hold(0.1, self.pair.replication_timeout * 4)
        self.pair.link.heal()
        self.pair.note(f"replication link partitioned for {held:.2f}s")

    def restart_passive_mid_catchup(self, backlog: int = 3000) -> None:
        """kill -9 the passive, let a backlog build, restart it, kill it mid-catch-up."""
        pair, workload = self.pair, self.workload
        self._traffic()
        workload.pause_consumers(True)
        passive = pair.passive
        passive.kill()
        start = queue_counts(status(pair.active), *workload.queues) or (0, 0)
        wait_for(
            lambda: (
                (c := queue_counts(status(pair.active), *workload.queues)) is not None
                and c[0] >= start[0] + backlog
            ),
            60,
            f"a backlog of {backlog} on the active",
            interval=0.1,
        )
        pair.link.throttle(self.rng.choice([100_000, 200_000, 400_000]))
        passive.extra_args = pair.args("passive")
        passive.start()

        def catching_up() -> bool:
            s = status(pair.active, 1.0)
            return (
                s is not None
                and s["replication"]["link_connected"]
                and not s["replication"]["ready"]
            )

        mid = False
        with contextlib.suppress(TimeoutError):
            mid = wait_for(catching_up, 10, "catch-up under way", interval=0.01)
        if mid:
            time.sleep(self.rng.uniform(0, 0.5))
            mid = catching_up()
        passive.kill()
        self.log.interrupted_catchups += int(mid)
        pair.note(f"passive {passive.name} killed {'mid-' if mid else 'after '}catch-up")
        pair.link.heal()
        passive.extra_args = pair.args("passive")
        passive.start()
        workload.pause_consumers(False)


@dataclass
class Report:
    """The figures of one run."""

    verdict: Verdict
    nemesis: NemesisLog
    seconds: float
    events: list[str]
    epoch: int
    producer_connections: int
    consumer_connections: int
    passive_left: tuple[int, int] | None  # messages left on the passive after the drain

    def text(self) -> str:
        """A printable report."""
        n = self.nemesis
        faults = ", ".join(f"{k} {v}" for k, v in sorted(n.by_fault.items()))
        lines = [
            f"fault cycles: {n.cycles} ({faults})",
            f"wall time: {self.seconds:.1f}s, final epoch {self.epoch}, "
            f"interrupted catch-ups {n.interrupted_catchups}, "
            f"promotions refused (passive not ready) {n.promotions_refused}",
            f"client connections: producers {self.producer_connections}, "
            f"consumers {self.consumer_connections}",
            self.verdict.summary(),
            f"left on the passive after the drain (ready, unacked): {self.passive_left}",
        ]
        if self.verdict.lost:
            lines.append(f"LOST: {self.verdict.lost[:50]}")
        if self.verdict.unexpected:
            lines.append(f"UNEXPECTED: {self.verdict.unexpected[:20]}")
        if self.verdict.duplicates:
            dups = list(self.verdict.duplicates.items())[:20]
            lines.append(f"duplicates (first {len(dups)}): {dups}")
        return "\n".join(lines)


async def run_suite(pair: Pair, faults: list[str], seed: int, **workload: Any) -> Report:
    """Run a workload against a started pair while the nemesis performs `faults`."""
    started = time.monotonic()
    load = Workload(pair.amqp_addresses, **workload)
    load.start()
    nemesis = Nemesis(pair, load, random.Random(seed))
    try:
        await asyncio.to_thread(nemesis.run, faults)
        await asyncio.to_thread(nemesis._traffic)
        await load.finish(pair)
    except BaseException:
        print("\n".join(pair.events))
        for broker in pair.brokers.values():
            print(f"status of {broker.name}: {status(broker)}")
        for producer in load.producers:
            log = producer.log
            print(
                f"{log.name}: sent {len(log.sent)}, confirmed {len(log.confirmed)}, "
                f"outstanding {len(producer._outstanding)}, connections {log.connections}"
            )
        for consumer in load.consumers:
            print(f"{consumer.name}: received {len(consumer.received)}, paused {consumer.paused}")
        raise
    finally:
        nemesis.stop_event.set()
        clients: list[Producer | Consumer] = [*load.producers, *load.consumers]
        for client in clients:
            client.stopping = True
    return Report(
        verdict=load.verdict(),
        nemesis=nemesis.log,
        seconds=time.monotonic() - started,
        events=pair.events,
        epoch=pair.epoch,
        producer_connections=sum(p.log.connections for p in load.producers),
        consumer_connections=sum(c.connections for c in load.consumers),
        passive_left=load.passive_left,
    )
