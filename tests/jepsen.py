"""A Jepsen-style total-queue test of a TwinMQ pair: checker, clients, nemesis.

- `check` is the checker, a pure function over what the clients saw: every
  producer's sent and confirmed message numbers and the bodies the consumers
  received. Lost (confirmed, never received) and unexpected (received, never
  sent) must both be empty; duplicates are counted.
- `Workload` runs numbered producers with publisher confirms and consumers with
  acks on one asyncio loop. They know both brokers' addresses and reconnect to
  whichever is active (a passive one refuses them with 320).
- The pair is `twinmq.testing.pair.Pair`: two broker processes, active and passive,
  the passive replicating through a `FaultProxy` the test controls; its `failover`
  is the operator's procedure over the admin API.
- `Nemesis` performs faults on the pair (kill -9 and promote, SIGSTOP/SIGCONT,
  cut or partitioned replication link, passive restarted mid-catch-up) and
  waits for the pair to be whole again after each.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from poison import POISON, sample_headers

from twinmq.broker.codec import rebuild_header
from twinmq.broker.journal.segment import HEADER, REC
from twinmq.broker.names import ACTIVE, PASSIVE
from twinmq.broker.server import EXIT_JOURNAL_FAILED
from twinmq.testing.amqpclient import AMQPClient, ClientError, Delivery, Refused
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import FAKETIME_LIBRARY, NoSmallDisk, Pair, post_role, status
from twinmq.testing.waiting import wait_for

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


def catchup_status(broker: BrokerProcess) -> dict[str, Any] | None:
    """An active's `/status` `replication.catchup` (its passive's catch-up), if any."""
    data = status(broker)
    return None if data is None else data["replication"].get("catchup")


def queue_counts(data: dict[str, Any] | None, *queues: str) -> tuple[int, int] | None:
    """(ready, unacked) over `queues` in a status, None if one is absent."""
    if data is None:
        return None
    found = {q["name"]: (int(q["messages"]), int(q["unacked"])) for q in data["queues"]}
    if any(name not in found for name in queues):
        return None
    return sum(found[n][0] for n in queues), sum(found[n][1] for n in queues)


class DiskFiller:
    """Keeps a file system full until `release`: a filler file takes every free byte
    and a thread tops it up whenever the broker frees some (compaction deletes
    segments), so the broker's next write fails for certain."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "filler"
        self._stop = threading.Event()
        self._file = self.path.open("wb", buffering=0)
        self._top_up()
        self._thread = threading.Thread(target=self._run, name="disk-filler", daemon=True)
        self._thread.start()

    def _top_up(self) -> None:
        for size in (1024 * 1024, 4096, 512):
            try:
                while True:
                    self._file.write(b"\0" * size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self._top_up()

    def release(self) -> None:
        """Stop topping up and give the space back."""
        self._stop.set()
        self._thread.join()
        self._file.close()
        self.path.unlink()


# The active's log lines for a write that failed in a completion path: a group commit
# (broker/commit.py, journal/), or the audit records a confirm waits for (held, retried).
# The audit write can fail first: the confirms are then held, the disk alarm blocks
# publishers, and with every window full no journal write comes to fail (finding 7).
WRITE_FAILED = re.compile(r"journal write failed|groups rolled back|audit write failed")
# A passive's log line when a local write failed and it exits 75 (broker/server.py
# `stop_passive`: a replicated batch, or the topology file, could not be written).
PASSIVE_STOPPED = "exiting so that a restart recovers from the journal"


def stack_dump(broker: BrokerProcess) -> str:
    """Every thread's Python stack of a live broker (`py-spy dump`, when installed next to
    this interpreter or on PATH): where a broker that neither answers nor exits is stuck."""
    spy = Path(sys.executable).with_name("py-spy")
    tool = str(spy) if spy.exists() else shutil.which("py-spy")
    if tool is None or broker.proc is None or broker.proc.poll() is not None:
        return "(no stack: py-spy not installed or the broker is gone)"
    try:
        done = subprocess.run(
            [tool, "dump", "--pid", str(broker.proc.pid)], capture_output=True, text=True,
            timeout=30,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"(no stack: {exc})"
    return done.stdout + done.stderr


def process_state(broker: BrokerProcess) -> str | None:
    """The kernel's one-letter state of the broker's process (T: stopped), None if gone."""
    if broker.proc is None:
        return None
    try:
        stat = Path(f"/proc/{broker.proc.pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def log_size(broker: BrokerProcess) -> int:
    """Bytes in the broker's log so far (to read only what follows)."""
    try:
        return broker.log_path.stat().st_size if broker.log_path else 0
    except OSError:
        return 0


def log_since(broker: BrokerProcess, offset: int) -> str:
    """The broker's log from byte `offset` on."""
    if broker.log_path is None:
        return ""
    with broker.log_path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def journal_records(data: bytes) -> list[tuple[int, int]]:
    """(offset, length) of every whole record of a segment, up to a torn tail."""
    pos, records = HEADER.size, []
    while pos + REC.size <= len(data):
        length, _ = REC.unpack_from(data, pos)
        end = pos + REC.size + length
        if end > len(data) or length == 0:
            break
        records.append((pos, length))
        pos = end
    return records


def corrupt_journal(journal: Path, rng: random.Random) -> tuple[Path, int] | None:
    """Flip one bit inside a record that has whole records after it, in a segment that is
    not the newest (so it can never pass for a torn tail). Returns (segment, offset)."""
    segments = sorted(journal.glob("*.seg"))[:-1]
    candidates = [
        (seg, recs) for seg in segments if len(recs := journal_records(seg.read_bytes())) >= 3
    ]
    if not candidates:
        return None
    segment, records = rng.choice(candidates)
    start, length = records[rng.randrange(len(records) - 2)]
    offset = start + REC.size + rng.randrange(length)
    data = bytearray(segment.read_bytes())
    data[offset] ^= 1 << rng.randrange(8)
    segment.write_bytes(bytes(data))
    return segment, offset


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
    commits: int = 0  # tx.commit-ok received (transactional producers)
    failed_commits: int = 0  # tx.commit answered with channel.close 541
    rolled_back: set[int] = field(default_factory=set)  # the messages of those commits
    stalls: int = 0  # gave up on a connection: no confirm / commit-ok for CONFIRM_PATIENCE


# How long a producer waits for any confirm (or a commit-ok) before it gives up on the
# connection as a real client would: what is outstanding stays unconfirmed, and the stall
# is counted (a broker that neither confirms nor nacks is a liveness failure, not loss).
CONFIRM_PATIENCE = 15.0


class Producer:
    """Publishes numbered persistent messages with confirms, `window` unconfirmed at most.

    A transactional producer (`transactional=True`) instead publishes `window`
    messages per transaction and counts them confirmed once `tx.commit-ok`
    arrives; a commit refused (channel closed, 541) or never answered leaves
    them unconfirmed: sent, fate unknown.
    """

    def __init__(
        self, name: str, addresses: list[str], queues: list[str], *, window: int,
        interval: float, padding: int, transactional: bool = False,
        headers: Callable[[int, bytes], bytes] | None = None, limit: int | None = None,
    ) -> None:  # fmt: skip
        """`headers(number, body)` gives a message's content header (default: persistent,
        nothing else); `limit` stops the producer after that many messages."""
        self.log = ProducerLog(name)
        self.transactional = transactional
        self.headers = headers
        self.limit = limit
        self.addresses = addresses
        self.queues = queues
        self.window = window
        self.interval = interval
        self.padding = padding
        self.stopping = False
        self.held = False  # set from the nemesis thread: publish nothing new meanwhile
        self.note: Callable[[str], None] = lambda text: None  # into the run's events
        self._next = 0
        self._outstanding: dict[int, int] = {}  # confirm tag -> message number
        self._room = asyncio.Event()
        self._settled = asyncio.Event()  # nothing outstanding
        self.done = asyncio.Event()  # `run` returned

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

    @property
    def exhausted(self) -> bool:
        """It sent its `limit` of messages."""
        return self.limit is not None and self._next >= self.limit

    @property
    def settled(self) -> bool:
        """Exhausted, and every message it sent is confirmed, nacked or given up."""
        return self.exhausted and self.done.is_set()

    async def run(self) -> None:
        """Publish until `stopping` (or `limit`); then wait a little for the last confirms."""
        try:
            await self._run()
        finally:
            self.done.set()

    async def _run(self) -> None:
        while not self.stopping and not self.exhausted:
            client = await connect_active(self.addresses, lambda: self.stopping)
            if client is None:
                return
            self.log.connections += 1
            self._outstanding = {}
            self._room.set()
            try:
                client.on_confirm = self._on_confirm
                for queue in self.queues:
                    await client.queue_declare(queue, QUEUE_ARGUMENTS.get(queue))
                if self.transactional:
                    await client.tx_select()
                    await self._publish_transactions(client)
                else:
                    await client.confirm_select()
                    await self._publish(client)
                    # Stopping: give the last publishes a chance to be confirmed.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._confirmed_all(client), 10)
                await client.close()
            except Refused as exc:
                if exc.code == 541 and self.transactional:
                    self.log.failed_commits += 1
            except ClientError:
                pass  # what is outstanding stays unconfirmed: sent, fate unknown
            finally:
                client.abort()

    def _stalled(self, outstanding: int) -> None:
        self.log.stalls += 1
        self.note(f"{self.log.name}: stall, {outstanding} unconfirmed for {CONFIRM_PATIENCE}s")

    async def _while_held(self) -> None:
        """Publish nothing new while `held` (what is outstanding is still answered)."""
        # Polled: `held` is set from the nemesis thread (an asyncio.Event is not thread-safe).
        while self.held and not self.stopping:  # noqa: ASYNC110
            await asyncio.sleep(0.05)

    def _send(self, client: AMQPClient, number: int) -> int:
        """Publish message `number` (its queue by number); returns the confirm tag."""
        queue = self.queues[number % len(self.queues)]
        body = encode_body(self.log.name, number, self.padding)
        header = None if self.headers is None else self.headers(number, body)
        self.log.sent.add(number)
        return client.publish(queue, body, header)

    async def _publish(self, client: AMQPClient) -> None:
        while not self.stopping and not self.exhausted:
            if len(self._outstanding) >= self.window:
                self._room.clear()
                waiter = asyncio.ensure_future(self._room.wait())
                closed = asyncio.ensure_future(client.closed.wait())
                done, _ = await asyncio.wait(
                    {waiter, closed}, timeout=CONFIRM_PATIENCE,
                    return_when=asyncio.FIRST_COMPLETED,
                )  # fmt: skip
                waiter.cancel()
                closed.cancel()
                client.check()  # raises once the connection is gone
                if not done:
                    self._stalled(len(self._outstanding))
                    raise ClientError(f"no confirm in {CONFIRM_PATIENCE}s")
                continue
            await self._while_held()
            if self.stopping:
                break
            number = self._next
            self._next += 1
            self._outstanding[self._send(client, number)] = number
            await client.drain()
            if self.interval:
                await asyncio.sleep(self.interval)

    async def _publish_transactions(self, client: AMQPClient) -> None:
        while not self.stopping:
            await self._while_held()
            if self.stopping:
                break
            numbers = list(range(self._next, self._next + self.window))
            self._next += self.window
            for number in numbers:
                self._send(client, number)
            await client.drain()
            try:
                await client.tx_commit(within=CONFIRM_PATIENCE)
            except Refused as exc:
                if exc.code == 541:
                    self.log.rolled_back.update(numbers)
                raise
            except ClientError:
                if "no answer" in str(client.error):
                    self._stalled(len(numbers))
                raise
            self.log.commits += 1
            self.log.confirmed.update(numbers)
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

    def __init__(
        self, name: str, addresses: list[str], queues: list[str], prefetch: int, *,
        late: bool = False,
    ) -> None:  # fmt: skip
        """A `late` consumer starts only for the final drain (its queue is a backlog)."""
        self.name = name
        self.addresses = addresses
        self.queues = queues
        self.prefetch = prefetch
        self.received: list[bytes] = []
        self.stopping = False
        self.late = late
        self.paused = late  # set from the nemesis thread
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
                    await client.queue_declare(queue, QUEUE_ARGUMENTS.get(queue))
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


# The poison family's queues: odd messages expire here after 50 ms and are dead-lettered
# into a consumed queue (an x-death is written into their odd headers); the bulk
# producer's backlog waits in its own queue for the final drain.
EXPIRING_QUEUE = "jepsen-expiring"
BACKLOG_QUEUE = "jepsen-backlog"
QUEUE_ARGUMENTS: dict[str, dict[str, Any]] = {
    EXPIRING_QUEUE: {
        "x-message-ttl": 50,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": "jepsen-1",
    },
}
DELIVERY_MODE_FLAG, EXPIRATION_FLAG = 0x1000, 0x0100


def odd_header(template: bytes, body: bytes) -> bytes:
    """An odd header drawn by tests/poison.py, made persistent and fitted to `body`
    (its own expiration dropped: the message must stay until a consumer takes it)."""
    replace: dict[int, bytes | None] = {DELIVERY_MODE_FLAG: b"\x02", EXPIRATION_FLAG: None}
    return rebuild_header(template, replace, body_size=len(body))


class PoisonSender:
    """Publishes the headers the broker must refuse (tests/poison.py `POISON`), one per
    connection, in turn, and counts the answers: refused with the documented code
    (docs/poison-input.md), or anything else (accepted, another code)."""

    def __init__(self, addresses: list[str], queue: str, interval: float = 0.1) -> None:
        self.addresses = addresses
        self.queue = queue
        self.interval = interval
        self.stopping = False
        self.refused: Counter[str] = Counter()  # by POISON name, as documented
        self.wrong: list[str] = []  # answered otherwise: a failure
        self.cut = 0  # the connection died first (a fault): no answer to judge

    async def run(self) -> None:
        """Until `stopping`: connect to the active, publish one poison header, judge."""
        names = sorted(POISON)
        sent = 0
        while not self.stopping:
            client = await connect_active(self.addresses, lambda: self.stopping)
            if client is None:
                return
            name = names[sent % len(names)]
            build, code = POISON[name]
            sent += 1
            try:
                client.publish(self.queue, b"", build())
                await client.drain()
                await asyncio.wait_for(client.closed.wait(), 5.0)
            except TimeoutError:
                self.wrong.append(f"{name}: accepted (no close within 5 s)")
            except ClientError:
                pass
            finally:
                client.abort()
            error = client.error
            if isinstance(error, Refused):
                if error.code == code:
                    self.refused[name] += 1
                else:
                    self.wrong.append(f"{name}: {error.code} {error.text}, expected {code}")
            elif error is not None:
                self.cut += 1
            await asyncio.sleep(self.interval)


class Workload:
    """Producers and consumers on one asyncio loop, against a pair's two addresses."""

    def __init__(
        self,
        addresses: list[str],
        queues: int = 2,
        *,
        producers: int = 3,
        tx_producers: int = 0,
        consumers: int = 2,
        window: int = 20,
        interval: float = 0.002,
        padding: int = 100,
        prefetch: int = 50,
        poison_seed: int | None = None,
        backlog: int = 0,
    ) -> None:
        """`poison_seed`: add a producer of odd headers and a sender of poison ones
        (`PoisonSender`); `backlog`: add a bulk producer of that many messages into a
        queue read only by the final drain."""
        self.queues = [f"jepsen-{i}" for i in range(queues)]
        self.producers = [
            Producer(
                f"p{i}", addresses, self.queues, window=window, interval=interval, padding=padding
            )
            for i in range(producers)
        ] + [
            Producer(
                f"t{i}",
                addresses,
                self.queues,
                window=window,
                interval=interval,
                padding=padding,
                transactional=True,
            )
            for i in range(tx_producers)
        ]
        self.consumers = [
            Consumer(f"c{i}", addresses, self.queues, prefetch) for i in range(consumers)
        ]
        self.counted = list(self.queues)  # every queue that must end empty
        self.odd: Producer | None = None
        self.poison: PoisonSender | None = None
        if poison_seed is not None:
            # Odd (valid) headers on every message of one more producer; a third of them
            # go through a queue whose TTL dead-letters them into the consumed queues.
            templates = sample_headers(poison_seed, 200)
            self.odd = Producer(
                "o0", addresses, [*self.queues, EXPIRING_QUEUE], window=window,
                interval=interval, padding=padding,
                headers=lambda n, body: odd_header(templates[n % len(templates)], body),
            )  # fmt: skip
            self.producers.append(self.odd)
            self.counted.append(EXPIRING_QUEUE)
            self.poison = PoisonSender(addresses, self.queues[0])
        self.bulk: Producer | None = None
        if backlog:
            # Loaded once at full speed and consumed only by the final drain.
            self.bulk = Producer(
                "b0", addresses, [BACKLOG_QUEUE], window=1000, interval=0.0, padding=20,
                limit=backlog,
            )  # fmt: skip
            self.producers.append(self.bulk)
            self.consumers.append(Consumer("cb", addresses, [BACKLOG_QUEUE], 1000, late=True))
            self.counted.append(BACKLOG_QUEUE)
        self._tasks: list[asyncio.Task[None]] = []
        self._poison_task: asyncio.Task[None] | None = None
        self.passive_left: tuple[int, int] | None = None  # (ready, unacked) at the end

    def start(self) -> None:
        """Start every client task (on the running loop)."""
        clients: list[Producer | Consumer] = [*self.producers, *self.consumers]
        for client in clients:
            self._tasks.append(asyncio.ensure_future(client.run()))
        if self.poison is not None:
            self._poison_task = asyncio.ensure_future(self.poison.run())

    def pause_consumers(self, paused: bool) -> None:
        """Disconnect the consumers (a backlog builds up) or let them back in."""
        for consumer in self.consumers:
            if not consumer.late:
                consumer.paused = paused

    def hold_producers(self, held: bool) -> None:
        """Stop or resume publishing new messages (the bulk producer is not held)."""
        for producer in self.producers:
            if producer is not self.bulk:
                producer.held = held

    @property
    def backlog_loaded(self) -> bool:
        """The bulk producer (if any) has sent its backlog and heard every answer."""
        return self.bulk is None or self.bulk.settled

    @property
    def confirmed(self) -> int:
        """Confirms so far, over all producers."""
        return sum(len(p.log.confirmed) for p in self.producers)

    async def finish(self, pair: Pair, within: float = 60.0) -> None:
        """Stop the producers, let the consumers drain the queue, stop them."""
        for producer in self.producers:
            producer.stopping = True
        if self.poison is not None:
            self.poison.stopping = True
        for consumer in self.consumers:
            consumer.paused = False
        producing = [*self._tasks[: len(self.producers)], *filter(None, [self._poison_task])]
        await asyncio.wait_for(asyncio.gather(*producing), within)

        def drained() -> bool:
            counts = queue_counts(status(pair.active), *self.counted)
            idle = min(time.monotonic() - c.last_delivery for c in self.consumers)
            return counts == (0, 0) and idle > 1.0

        # A bulk backlog takes its time to drain (a few thousand messages a second).
        drain_within = within + (self.bulk.limit or 0) / 2000 if self.bulk else within
        await asyncio.to_thread(wait_for, "queue drained", drained, drain_within, 0.2)
        for consumer in self.consumers:
            consumer.stopping = True
        await asyncio.wait_for(asyncio.gather(*self._tasks), within)

        # The passive must have followed every dequeue: its queues end empty too.
        def passive_left() -> tuple[int, int] | None:
            self.passive_left = queue_counts(status(pair.passive), *self.counted)
            return None if self.passive_left != (0, 0) else self.passive_left

        with contextlib.suppress(TimeoutError):
            await asyncio.to_thread(wait_for, "passive drained", passive_left, 15, 0.2)

    def failed_delivered(self) -> set[Key]:
        """Messages a consumer received although their publish was nacked or their
        transaction's commit was answered 541."""
        failed = {(p.log.name, n) for p in self.producers for n in p.log.nacked | p.log.rolled_back}
        received = {decode_body(body) for c in self.consumers for body in c.received}
        return failed & {key for key in received if key is not None}

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
    # The matrix's faults prove they hit their path: a hit per cycle, or a miss named.
    hits: int = 0
    misses: list[str] = field(default_factory=list)
    proofs: Counter[str] = field(default_factory=Counter)  # what was observed, counted
    back_to_ready: list[float] = field(default_factory=list)  # seconds, one per cycle
    max_depth: int = 0  # most ready messages on the active at a bounded cycle's start


class Nemesis:
    """Faults on a pair, one at a time; after each, the pair must be whole again.

    A fault method may return whether its fault provably hit the path it targets
    (True/False; None: not checked) and call `_fault_over` when it gives back what
    it broke (restart, SIGCONT, heal, space): the time from there to the pair in
    sync again is its time back to ready.
    """

    def __init__(self, pair: Pair, workload: Workload, rng: random.Random) -> None:
        self.pair = pair
        self.workload = workload
        self.rng = rng
        self.log = NemesisLog()
        self.stop_event = threading.Event()
        self._over: float | None = None

    def run(self, faults: Iterable[str], healthy_within: float = 30.0) -> NemesisLog:
        """Perform `faults` in order (blocking: run it on a thread)."""
        for fault in faults:
            if self.stop_event.is_set():
                break
            self._over = None
            started = time.monotonic()
            hit = getattr(self, fault.replace("-", "_"))()
            self.pair.wait_healthy(healthy_within)
            self.log.back_to_ready.append(time.monotonic() - (self._over or started))
            self.log.cycles += 1
            self.log.by_fault[fault] += 1
            if hit is True:
                self.log.hits += 1
            elif hit is False:
                self.log.misses.append(f"cycle {self.log.cycles}: {fault}")
                self.pair.note(f"MISS: {fault} did not hit its path")
        return self.log

    def _fault_over(self) -> None:
        """The fault is given back now: the time back to ready starts here."""
        self._over = time.monotonic()

    def _proof(self, what: str, seen: bool = True) -> bool:
        """Count an observation that shows the fault hit; returns `seen`."""
        if seen:
            self.log.proofs[what] += 1
        return seen

    def _hold(self, low: float, high: float) -> float:
        """A fault's duration (how long a fault lasts, never a timing assertion)."""
        seconds = self.rng.uniform(low, high)
        time.sleep(seconds)
        return seconds

    def _traffic(self, confirms: int = 20, timeout: float = 30.0) -> None:
        """Let some publishes be confirmed before the next fault."""
        target = self.workload.confirmed + confirms
        wait_for("confirms flowing", lambda: self.workload.confirmed >= target, timeout)

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
        code, body = post_role(old, PASSIVE, pair.epoch, pair.link.address)
        old.extra_args = pair.args(PASSIVE)  # what it would restart with
        pair.note(f"SIGCONT {old.name}, demoted: {code} {body.get('role')}")
        assert code == 200 and body["role"] == PASSIVE, (code, body)

    def _seen(self, predicate: Callable[[], object], timeout: float) -> bool:
        """Whether `predicate` comes true within `timeout` (an observation, not a deadline)."""
        try:
            wait_for("observation", predicate, timeout, interval=0.05)
        except TimeoutError:
            return False
        return True

    def _sigstop(self, broker: BrokerProcess, low: float, high: float) -> tuple[bool, float]:
        """SIGSTOP `broker` for a while; whether the kernel showed it stopped (state T)."""
        broker.signal(signal.SIGSTOP)
        stopped = self._seen(lambda: process_state(broker) == "T", 5)
        held = self._hold(low, high)
        return stopped, held

    def pause_active(self) -> bool:
        self._traffic()
        broker = self.pair.active
        stopped, held = self._sigstop(broker, 0.2, self.pair.replication_timeout * 3)
        broker.signal(signal.SIGCONT)
        self._fault_over()
        self.pair.note(f"SIGSTOP active {broker.name} for {held:.2f}s")
        return self._proof("process stopped (state T)", stopped)

    def pause_passive(self) -> bool:
        self._traffic()
        broker = self.pair.passive
        stopped, held = self._sigstop(broker, 0.2, self.pair.replication_timeout * 3)
        if status(self.pair.active, 0.5) is not None:
            active = status(self.pair.active)
            if active is not None and active["replication"]["degraded"]:
                self.log.degraded_seen += 1
        broker.signal(signal.SIGCONT)
        self._fault_over()
        self.pair.note(f"SIGSTOP passive {broker.name} for {held:.2f}s")
        return self._proof("process stopped (state T)", stopped)

    def _link_lost(self, lost_before: object) -> bool:
        """The passive saw its link go (its `lost_at` moved)."""

        def moved() -> bool:
            s = status(self.pair.passive, 0.5)
            return s is not None and s["replication"]["lost_at"] not in (None, lost_before)

        return self._seen(moved, 3 * self.pair.replication_timeout + 2)

    def _lost_at(self) -> object:
        s = status(self.pair.passive)
        return None if s is None else s["replication"]["lost_at"]

    def cut_link(self) -> bool:
        self._traffic()
        before = self._lost_at()
        self.pair.link.cut()
        held = self._hold(0.1, self.pair.replication_timeout * 3)
        lost = self._link_lost(before)
        self.pair.link.heal()
        self._fault_over()
        self.pair.note(f"replication link cut for {held:.2f}s")
        return self._proof("passive lost the link", lost)

    def partition_link(self) -> bool:
        """Bytes stop both ways, nothing is closed: long enough for the timeout to notice."""
        self._traffic()
        before = self._lost_at()
        self.pair.link.partition()
        held = self._hold(1.5 * self.pair.replication_timeout, self.pair.replication_timeout * 4)
        lost = self._link_lost(before)
        self.pair.link.heal()
        self._fault_over()
        self.pair.note(f"replication link partitioned for {held:.2f}s")
        return self._proof("passive lost the link", lost)

    def _backlog(self, count: int) -> None:
        """Wait until the active's queues hold `count` more ready messages."""
        pair, workload = self.pair, self.workload
        start = queue_counts(status(pair.active), *workload.queues) or (0, 0)
        wait_for(
            f"a backlog of {count} on the active",
            lambda: (
                (c := queue_counts(status(pair.active), *workload.queues)) is not None
                and c[0] >= start[0] + count
            ),
            60,
            interval=0.1,
        )

    def _drain(self, bound: int, within: float = 120.0) -> int:
        """Bound the backlog: hold the producers until the consumers have brought the
        active's queues down to `bound` ready messages; returns the depth found first."""
        pair, workload = self.pair, self.workload
        depth = (queue_counts(status(pair.active), *workload.queues) or (0, 0))[0]
        if depth > bound:
            workload.hold_producers(True)
            try:
                wait_for(
                    f"the consumers down to {bound} ready messages",
                    lambda: (
                        (c := queue_counts(status(pair.active), *workload.queues)) is not None
                        and c[0] <= bound
                    ),
                    within,
                    interval=0.1,
                )
            finally:
                workload.hold_producers(False)
        self.log.max_depth = max(self.log.max_depth, depth)
        return depth

    def _kill_mid_stream(self, passive: BrokerProcess) -> bool:
        """Start the passive over a throttled link and kill -9 it once 1 to 4 catch-up
        chunks are durable on it and more are to come (the active's /status
        `replication.catchup`); whether that was seen. Leaves it dead, the link healed."""
        pair = self.pair
        # Fast enough for live traffic and a chunk well within the replication timeout
        # (finding 8), slow enough for a catch-up of seconds.
        pair.link.throttle(self.rng.choice([600_000, 1_000_000, 1_500_000]))
        passive.extra_args = pair.args(PASSIVE)
        passive.start()
        chunks = self.rng.randint(1, 4)

        def streaming() -> dict[str, Any] | None:
            c = catchup_status(pair.active)
            if not c or not c["in_progress"] or c["acked_chunks"] < chunks:
                return None
            return c if c["kept"] + c["skipped"] + c["acked_messages"] < c["candidates"] else None

        at: dict[str, Any] | None = None
        with contextlib.suppress(TimeoutError):
            at = wait_for("catch-up streaming", streaming, 30, interval=0.02)
        passive.kill()
        pair.link.heal()
        self.log.interrupted_catchups += int(at is not None)
        pair.note(
            f"passive {passive.name} killed "
            + (f"mid-catch-up: {at['acked_chunks']} chunks on it" if at else "(catch-up not seen)")
            + f"; catch-up {at or catchup_status(pair.active)}"
        )
        return at is not None

    def restart_passive_mid_catchup(self, backlog: int = 3000) -> bool:
        """kill -9 the passive, let a backlog build, restart it, kill it mid-catch-up."""
        pair, workload = self.pair, self.workload
        self._traffic()
        workload.pause_consumers(True)
        passive = pair.passive
        passive.kill()
        self._backlog(backlog)
        mid = self._kill_mid_stream(passive)
        passive.extra_args = pair.args(PASSIVE)
        passive.start()
        self._fault_over()
        workload.pause_consumers(False)
        return self._proof("catch-up interrupted with chunks durable", mid)

    # -- the fault matrix's families (each proves it hit the path it targets) -------------

    def kill_active(self) -> bool:
        """kill -9 the active, promote the passive: the epoch must have risen."""
        self._traffic()
        pair = self.pair
        before = pair.epoch
        self._fault_over()  # from the kill on, the operator's procedure is the recovery
        if not pair.failover():
            self.log.promotions_refused += 1
            return False
        s = status(pair.active)
        return self._proof(
            "promoted: epoch rose", s is not None and s["epoch"] == pair.epoch > before
        )

    def kill_passive(self) -> bool:
        """kill -9 the passive; the active goes on alone (confirms flow); restart it."""
        self._traffic()
        pair = self.pair
        passive = pair.passive
        passive.kill()
        killed = passive.proc is not None and passive.proc.returncode == -signal.SIGKILL

        def alone() -> bool:
            s = status(pair.active)
            return s is not None and not s["replication"]["ready"]

        noticed = self._seen(alone, 10)
        self._traffic(5)  # confirmed while the passive is down
        self._hold(0.0, pair.replication_timeout)
        passive.extra_args = pair.args(PASSIVE)
        passive.start()
        self._fault_over()
        pair.note(f"passive {passive.name} killed -9 and restarted")
        return self._proof("passive killed", killed) and self._proof("active alone", noticed)

    def disk_full_active(self) -> bool:
        """Fill the active's disk under traffic: a write fails (nack, 541), the disk alarm
        blocks publishers; space returns and the alarm clears."""
        self._traffic()
        pair = self.pair
        active = pair.active
        mark = log_size(active)
        filler = DiskFiller(active.data_dir)
        failed = self._seen(lambda: WRITE_FAILED.search(log_since(active, mark)), 20)
        alarm = self._seen(lambda: "disk" in ((status(active) or {}).get("alarms") or []), 10)
        held = self._hold(0.1, 1.0)
        filler.release()
        self._fault_over()
        failure = WRITE_FAILED.search(log_since(active, mark))
        pair.note(
            f"active {active.name}: disk full for {held:.2f}s "
            f"(write failed: {failure.group(0) if failure else None})"
        )
        wait_for("alarm gone", lambda: (s := status(active)) is not None and not s["alarms"], 30)
        return self._proof("active write failed: disk full", failed) and self._proof(
            "disk alarm raised", alarm
        )

    def _fill_passive(self, passive: BrokerProcess) -> tuple[DiskFiller, bool]:
        """Fill the passive's disk; it must exit 75 (a write of a replicated batch failed)."""
        mark = log_size(passive)
        filler = DiskFiller(passive.data_dir)
        assert passive.proc is not None
        try:
            code: int | None = passive.proc.wait(15)
        except subprocess.TimeoutExpired:
            # Neither acknowledging nor exiting: a miss, shown in the table; kill -9 it so
            # the run goes on (the checker still judges what the pair confirmed).
            code = None
            self._proof("passive neither acked nor exited within 15s: killed -9")
            self.pair.note(f"passive {passive.name} stuck on a full disk:\n{stack_dump(passive)}")
            passive.kill()
        exited = code == EXIT_JOURNAL_FAILED and PASSIVE_STOPPED in log_since(passive, mark)
        self.pair.note(f"passive {passive.name}: disk full, exit code {code}")
        return filler, exited

    def disk_full_passive(self) -> bool:
        """Fill the passive's disk: it exits 75; space returns, the nemesis restarts it."""
        self._traffic()
        pair = self.pair
        passive = pair.passive
        filler, exited = self._fill_passive(passive)
        self._hold(0.1, 1.0)  # the active goes on alone
        filler.release()
        passive.extra_args = pair.args(PASSIVE)
        passive.start()
        self._fault_over()
        return self._proof("passive exited 75 (EXIT_JOURNAL_FAILED)", exited)

    def disk_full_passive_then_kill_mid_catchup(
        self, backlog: int = 3000, bound: int = 2000
    ) -> bool:
        """Compound: the passive's disk fills (exit 75), a backlog builds on the active,
        space returns, the passive restarts and is killed -9 in the middle of its catch-up
        (chunks durable on it, more to come)."""
        pair, workload = self.pair, self.workload
        # The consumers first bring the queues down to `bound`: the transactional producer
        # outran them and the queues grew without end (365,000 messages after 18 cycles).
        depth = self._drain(bound)
        pair.note(f"queues at the cycle's start: {depth} ready (brought down to {bound} or less)")
        self._traffic()
        passive = pair.passive
        filler, exited = self._fill_passive(passive)
        # Consumers pause for the backlog only: paused while the disk fills too (seconds
        # on a loaded machine), the queues grew by ~10,000 messages a cycle, without end.
        workload.pause_consumers(True)
        self._backlog(backlog)
        filler.release()
        mid = self._kill_mid_stream(passive)
        passive.extra_args = pair.args(PASSIVE)
        passive.start()
        self._fault_over()
        workload.pause_consumers(False)
        return self._proof("passive exited 75 (EXIT_JOURNAL_FAILED)", exited) and self._proof(
            "catch-up interrupted with chunks durable", mid
        )

    def corrupt_passive(self) -> bool:
        """Stop the passive, flip a bit in an older segment, restart it (see `_corrupt`)."""
        return self._corrupt(failover=False)

    def corrupt_old_active(self) -> bool:
        """kill -9 the active, promote the passive, flip a bit in the old active's journal,
        bring it back as passive (see `_corrupt`)."""
        return self._corrupt(failover=True)

    def _corrupt(self, *, failover: bool) -> bool:
        """The restarted broker reports damage and quarantines the segment, refuses
        activation without force, and is made whole by catch-up."""
        pair, workload = self.pair, self.workload
        self._traffic()
        workload.pause_consumers(True)  # live messages in older segments
        victim = pair.active if failover else pair.passive
        wait_for(
            f"{victim.name}: journal segments to corrupt",
            lambda: (s := status(victim)) is not None and s["journal"]["segments"] >= 4,
            60,
            interval=0.1,
        )
        victim.kill()
        if failover:
            ready = self._seen(
                lambda: (s := status(pair.passive)) is not None and s["replication"]["ready"], 10
            )
            if not ready:
                # Its lease (replication_timeout after the last echo) ran out before it was
                # seen ready, as on a loaded machine: the operator's procedure does not
                # promote it, the old active comes back as it was. A miss, nothing flipped.
                self.log.promotions_refused += 1
                pair.note(f"passive {pair.passive.name} not ready: {victim.name} restarted")
                victim.extra_args = pair.args("active")
                victim.start()
                workload.pause_consumers(False)
                return False
            pair.promote_passive()
            pair.brokers[victim.name].extra_args = pair.args(PASSIVE)
        flipped = corrupt_journal(victim.data_dir / "journal", self.rng)
        # Cut: the damage must show before a catch-up makes the broker whole.
        pair.link.cut()
        victim.extra_args = pair.args(PASSIVE)
        victim.start()
        self._fault_over()
        journal = (status(victim) or {}).get("journal") or {}
        segment = flipped[0].name if flipped else "?"
        detected = journal.get("damaged") is True and any(
            c["segment"] == segment for c in journal.get("corruption", [])
        )
        kept = (victim.data_dir / "quarantine" / segment).exists()
        code, body = post_role(victim, ACTIVE, pair.epoch + 1)
        refused = code == 409 and body.get("error") == "broker damaged"
        pair.note(
            f"{victim.name}: bit flipped in {segment} at {flipped and flipped[1]}; damaged "
            f"{detected}, quarantined {kept}, activation {code}"
        )
        pair.link.heal()
        workload.pause_consumers(False)
        pair.wait_healthy(60)
        healed = ((status(victim) or {}).get("journal") or {}).get("damaged") is False
        return all(
            [
                self._proof("corruption detected (/status journal.damaged)", detected),
                self._proof("segment quarantined", kept),
                self._proof("activation refused without force (409)", refused),
                self._proof("healed by catch-up", healed),
            ]
        )

    def poison_kill_active(self) -> bool:
        """Odd and poison headers flow (tests/poison.py), then kill -9 of the active and
        failover: the old active recovers a journal full of odd headers and catches up."""
        pair, load = self.pair, self.workload
        assert load.odd is not None and load.poison is not None
        odd, poison = load.odd.log, load.poison
        confirmed, refused, wrong = len(odd.confirmed), poison.refused.total(), len(poison.wrong)
        marks = {name: log_size(b) for name, b in pair.brokers.items()}
        flowing = self._seen(
            lambda: len(odd.confirmed) > confirmed and poison.refused.total() > refused, 30
        )
        promoted = self.kill_active()
        pair.wait_healthy(60)  # the old active is back: its recovery completed
        logs = "".join(log_since(b, marks[name]) for name, b in pair.brokers.items())
        clean = "Traceback" not in logs and "quarantined" not in logs
        pair.note(f"poison: refused {dict(poison.refused)}, cut {poison.cut}, odd confirmed "
                  f"{len(odd.confirmed)}; logs clean {clean}")  # fmt: skip
        return all(
            [
                promoted,
                self._proof("odd headers confirmed, poison refused as documented", flowing),
                self._proof("no poison answered otherwise", len(poison.wrong) == wrong),
                self._proof("no traceback or quarantine in the logs", clean),
            ]
        )

    def huge_backlog_kill_passive(self) -> bool:
        """A new passive (empty volume) catches up the huge backlog; kill -9 it mid-stream."""
        return self._huge_catchup(kill=True)

    def huge_backlog_cut_link(self) -> bool:
        """A new passive (empty volume) catches up the huge backlog; cut the link mid-stream."""
        return self._huge_catchup(kill=False)

    def _huge_catchup(self, *, kill: bool) -> bool:
        """The passive is replaced by one with an empty data dir, so the whole backlog
        streams to it in chunks; after a few chunks are durable on it, it is killed -9 (or
        the link is cut). The next catch-up must keep what was acknowledged (resume) and
        complete: the backlog queue holds as many messages on both brokers."""
        pair, load = self.pair, self.workload
        wait_for("the backlog loaded", lambda: load.backlog_loaded, 900, interval=0.5)
        self._traffic()
        passive = pair.passive
        passive.kill()
        shutil.rmtree(passive.data_dir)  # a new volume: the whole backlog to catch up
        # Throttled until the fault so that it can be seen under way, but not below
        # 1.5 MB/s: a chunk (up to 4096 messages, ~350 KB here) must cross well within the
        # replication timeout, or the active drops the passive as stalled at every chunk.
        pair.link.throttle(self.rng.choice([1.5e6, 3e6, 6e6]))
        passive.extra_args = pair.args("passive")
        passive.start()
        share = self.rng.uniform(0.05, 0.5)  # of the catch-up durable on the passive first

        def streaming() -> dict[str, Any] | None:
            c = catchup_status(pair.active)
            if not c or not c["in_progress"] or not c["acked_chunks"]:
                return None
            return c if c["kept"] + c["acked_messages"] >= share * c["candidates"] else None

        at: dict[str, Any] | None = None
        with contextlib.suppress(TimeoutError):
            at = wait_for("catch-up streaming", streaming, 60, interval=0.02)
        passive.kill() if kill else pair.link.cut()
        durable = 0 if at is None else at["kept"] + at["acked_messages"]  # on the passive
        mid = at is not None and durable < at["candidates"]
        self._hold(0.0, pair.replication_timeout)
        pair.link.heal()
        if kill:
            passive.start()
        self._fault_over()
        pair.note(
            f"passive {passive.name}: catch-up of a new volume "
            f"{'killed -9' if kill else 'link cut'} at {at and at['acked_chunks']} chunks "
            f"({durable} of {at and at['candidates']} messages on the passive)"
        )
        pair.wait_healthy(120)
        after = catchup_status(pair.active) or {}
        # What the passive acknowledged is found on it again: kept, or discarded if it was
        # consumed from a live queue meanwhile. Nothing acknowledged is sent twice.
        found = after.get("kept", 0) + after.get("discarded", 0)
        resumed = at is not None and found >= durable > 0
        backlog = [queue_counts(status(b), BACKLOG_QUEUE) for b in (pair.active, passive)]
        complete = after.get("in_progress") is False and backlog[0] == backlog[1] is not None
        pair.note(f"catch-up after the fault: {after}; backlog (active, passive) {backlog}")
        return all(
            [
                self._proof("catch-up interrupted mid-stream", mid),
                self._proof("resumed: acknowledged chunks kept", resumed),
                self._proof("catch-up completed: backlog the same on both", complete),
            ]
        )

    def clock_jump(self) -> bool:
        """Jump one broker's clocks forward (libfaketime): timers fire at once, ages leap."""
        self._traffic()
        pair = self.pair
        broker = self.rng.choice([pair.active, pair.passive])
        seconds = self.rng.choice([3 * pair.replication_timeout, 60.0, 3600.0])
        before = (status(broker) or {}).get("uptime_seconds", 0.0)
        started = time.monotonic()
        pair.jump_clock(broker, seconds)

        def jumped() -> bool:
            s = status(broker)
            elapsed = time.monotonic() - started
            return s is not None and s["uptime_seconds"] - before - elapsed > 0.9 * seconds - 1

        seen = self._seen(jumped, 10)
        self._fault_over()
        held = self._hold(0.5, 2 * pair.replication_timeout)
        pair.note(f"{broker.name}: clock jumped +{seconds:.0f}s ({held:.2f}s)")
        return self._proof("broker clock jumped (uptime leapt)", seen)


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


async def run_suite(
    pair: Pair,
    faults: list[str],
    seed: int,
    *,
    loads: list[Workload] | None = None,
    healthy_within: float = 30.0,
    **workload: Any,
) -> Report:
    """Run a workload against a started pair while the nemesis performs `faults`
    (the workload is appended to `loads` for a caller that wants its clients' logs)."""
    started = time.monotonic()
    load = Workload(pair.amqp_addresses, **workload)
    if loads is not None:
        loads.append(load)
    for producer in load.producers:
        producer.note = pair.note  # a confirm stall is an event of the run
    load.start()
    nemesis = Nemesis(pair, load, random.Random(seed))
    try:
        await asyncio.to_thread(nemesis.run, faults, healthy_within)
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


# -- the fault matrix -----------------------------------------------------------------------


@dataclass(frozen=True)
class FaultClass:
    """One row of the fault matrix: a family of nemesis faults and the pair it needs."""

    name: str
    faults: tuple[str, ...]  # performed round robin, one per cycle
    targets: str  # the path the class attacks (docs/reliability.md)
    proof: str  # what each cycle must observe
    small_disks: bool = False  # a tmpfs per broker (root only)
    faketime: bool = False  # brokers under libfaketime
    poison: bool = False  # a producer of odd headers and a sender of poison ones
    backlog: int = 0  # messages of a backlog loaded first, drained last
    catchup_chunk_bytes: int | None = None  # the brokers' (small: many chunks to interrupt)


MATRIX = (
    FaultClass(
        "kill-active", ("kill-active",),
        "kill -9 of the active and the operator's failover (promote the ready passive, "
        "restart the old active as its passive)",
        "the new active's /status epoch is the promoted epoch, higher than before",
    ),
    FaultClass(
        "kill-passive", ("kill-passive", "restart-passive-mid-catchup"),
        "kill -9 of the passive: the active degrades and confirms alone, the restarted "
        "passive catches up (every other cycle it is killed again in the middle of it)",
        "the process died of SIGKILL and the active's /status stopped saying ready; at "
        "the second kill 1-4 catch-up chunks durable on the passive and more to come "
        "(the active's /status replication.catchup)",
        catchup_chunk_bytes=32 * 1024,
    ),
    FaultClass(
        "sigstop", ("pause-active", "pause-passive"),
        "SIGSTOP/SIGCONT of the active or the passive (a frozen process: VM pause, GC, swap)",
        "/proc/<pid>/stat shows the process stopped (state T)",
    ),
    FaultClass(
        "link-cut", ("cut-link", "partition-link"),
        "the replication link reset (every connection, and new ones) or partitioned "
        "(bytes held both ways) through the FaultProxy",
        "the passive's /status replication.lost_at moved",
    ),
    FaultClass(
        "disk-full-active", ("disk-full-active",),
        "ENOSPC on the active's journal under confirms and transactions: nack / 541, the "
        "disk alarm, recovery when space returns",
        "the broker's log shows the failed write (disk full) and /status the disk alarm",
        small_disks=True,
    ),
    FaultClass(
        "disk-full-passive", ("disk-full-passive",),
        "ENOSPC on the passive's journal: it must not acknowledge what it could not write; "
        "it exits 75 and the nemesis restarts it once space is back",
        "the passive exited with 75 (EXIT_JOURNAL_FAILED) and logged the failed write",
        small_disks=True,
    ),
    FaultClass(
        "corruption", ("corrupt-passive", "corrupt-old-active"),
        "a flipped bit in an older journal segment (not the last group) of the passive, or "
        "of the old active after a failover",
        "/status journal.damaged names the segment, the file is in quarantine/, activation "
        "without force is refused (409), and after catch-up the broker is no longer damaged",
    ),
    FaultClass(
        "compound", ("disk-full-passive-then-kill-mid-catchup",),
        "the passive's disk fills (exit 75), a backlog builds, space returns, the passive "
        "restarts and is killed -9 in the middle of its catch-up",
        "exit code 75, then at the kill 1-4 catch-up chunks durable on the passive and "
        "more to come (the active's /status replication.catchup)",
        small_disks=True,
        catchup_chunk_bytes=32 * 1024,
    ),
    FaultClass(
        "clock-jump", ("clock-jump",),
        "a forward jump of one broker's clocks (wall and monotonic, libfaketime): every "
        "timer due at once, wall-clock ages leap by 3 s, 1 min or 1 h",
        "the broker's /status uptime_seconds (wall clock) leapt by the jump",
        faketime=True,
    ),
    FaultClass(
        "poison", ("poison-kill-active",),
        "odd (valid) headers on confirmed messages, some dead-lettered by expiry, and "
        "poison headers (docs/poison-input.md) while the active is killed -9 and fails "
        "over: recovery, catch-up and delivery of odd headers, refusals with their codes",
        "odd messages confirmed and poison refused with its documented code in the cycle, "
        "none answered otherwise, the epoch rose, no traceback or quarantine in the logs",
        poison=True,
    ),
    FaultClass(
        "huge-backlog", ("huge-backlog-kill-passive", "huge-backlog-cut-link"),
        "a backlog of 300,000 messages (about 75 chunks) caught up by a passive with an "
        "empty volume; the passive killed -9 or the link cut mid-stream",
        "the catch-up was under way with chunks acknowledged at the fault; the next one "
        "kept them (resumed) and completed (the backlog queue equal on both brokers)",
        backlog=300_000,
    ),
)  # fmt: skip

MATRIX_BROKER_ARGS = ["--segment-bytes", "65536", "--disk-free-limit", "0"]
MATRIX_DISK_BYTES = 512 * 1024 * 1024  # the journal and the audit log (kept: no retention)


class Unavailable(Exception):
    """A fault class cannot run here (no root for a tmpfs, no libfaketime)."""


@dataclass
class ClassResult:
    """One fault class's run: the checker's figures and the nemesis's proofs."""

    name: str
    cycles: int
    hits: int
    misses: list[str]
    proofs: dict[str, int]
    sent: int
    confirmed: int  # publisher confirms and messages of committed transactions
    commits: int
    failed_commits: int  # tx.commit answered 541
    nacked: int
    stalls: int  # connections given up: nothing confirmed or nacked for CONFIRM_PATIENCE
    lost: int
    unexpected: int
    duplicates: int
    recovered: int  # received though never confirmed
    ready_p50: float
    ready_max: float
    seconds: float
    final_epoch: int
    passive_left: tuple[int, int] | None
    lost_sample: list[Key] = field(default_factory=list)
    poison_refused: dict[str, int] = field(default_factory=dict)  # as documented, by name
    poison_wrong: list[str] = field(default_factory=list)  # answered otherwise
    # The most ready messages on the active at a bounded cycle's start, before its drain:
    # one cycle's growth at most, not growing from cycle to cycle.
    max_depth: int = 0
    # Messages nacked or of a commit answered 541 that a consumer was delivered anyway
    # (the write failed and was rolled back: docs/journal.md "Visibility" says never).
    failed_delivered: int = 0

    @property
    def ok(self) -> bool:
        """Nothing confirmed lost, nothing unexpected, every cycle hit its path, every
        poison header refused as documented, no failed message delivered."""
        return (
            not self.lost
            and not self.unexpected
            and self.hits == self.cycles
            and not self.poison_wrong
            and not self.failed_delivered
        )


def run_class(
    root: Path,
    fault_class: FaultClass,
    cycles: int,
    seed: int,
    *,
    replication_timeout: float = 1.0,
    backlog: int | None = None,
    keep: Path | None = None,
    keep_always: bool = False,
) -> tuple[ClassResult, Report]:
    """A fresh pair under confirms and transactions while `cycles` faults of the class run
    (`backlog` overrides the class's backlog size: the short matrix's is smaller). If the
    class does not finish or fails (or `keep_always`), the brokers' logs and the events are
    copied to `keep`."""
    if fault_class.faketime and not FAKETIME_LIBRARY.exists():
        raise Unavailable(f"libfaketime is not installed ({FAKETIME_LIBRARY})")
    faults = [fault_class.faults[i % len(fault_class.faults)] for i in range(cycles)]
    pair = Pair(
        root,
        replication_timeout=replication_timeout,
        broker_args=MATRIX_BROKER_ARGS,
        disk_bytes=MATRIX_DISK_BYTES if fault_class.small_disks else None,
        faketime=fault_class.faketime,
    )
    if fault_class.catchup_chunk_bytes is not None:
        for broker in pair.brokers.values():
            broker.env["TWINMQ_CATCHUP_CHUNK_BYTES"] = str(fault_class.catchup_chunk_bytes)
    try:
        pair.start()
    except NoSmallDisk as exc:
        pair.stop()
        raise Unavailable(str(exc)) from None
    except BaseException:
        pair.stop()
        raise
    error: BaseException | None = None
    try:
        report, load = asyncio.run(
            _run_with_load(
                pair,
                faults,
                seed,
                producers=2,
                tx_producers=1,
                consumers=2,
                poison_seed=seed if fault_class.poison else None,
                backlog=fault_class.backlog if backlog is None else backlog,
            )
        )
    except BaseException as exc:
        error = exc
        raise
    finally:
        pair.stop()
        if error is not None and keep is not None:
            print(f"logs kept in {pair.keep_logs(keep, f'did not finish: {error!r}')}")
    verdict, nemesis = report.verdict, report.nemesis
    times = nemesis.back_to_ready or [0.0]
    result = ClassResult(
        name=fault_class.name,
        cycles=nemesis.cycles,
        hits=nemesis.hits,
        misses=nemesis.misses,
        proofs=dict(nemesis.proofs),
        sent=verdict.sent,
        confirmed=verdict.confirmed,
        commits=sum(p.log.commits for p in load.producers),
        failed_commits=sum(p.log.failed_commits for p in load.producers),
        nacked=sum(len(p.log.nacked) for p in load.producers),
        stalls=sum(p.log.stalls for p in load.producers),
        lost=len(verdict.lost),
        unexpected=len(verdict.unexpected),
        duplicates=verdict.duplicate_count,
        recovered=verdict.recovered,
        ready_p50=statistics.median(times),
        ready_max=max(times),
        seconds=report.seconds,
        final_epoch=report.epoch,
        passive_left=report.passive_left,
        lost_sample=verdict.lost[:20],
        poison_refused=dict(load.poison.refused) if load.poison else {},
        poison_wrong=list(load.poison.wrong) if load.poison else [],
        max_depth=nemesis.max_depth,
        failed_delivered=len(load.failed_delivered()),
    )
    if (keep_always or not result.ok) and keep is not None:
        why = f"lost {result.lost}, unexpected {result.unexpected}, misses {result.misses}"
        print(f"logs kept in {pair.keep_logs(keep, why)}")
    return result, report


async def _run_with_load(
    pair: Pair, faults: list[str], seed: int, **workload: Any
) -> tuple[Report, Workload]:
    holder: list[Workload] = []
    report = await run_suite(pair, faults, seed, loads=holder, healthy_within=60.0, **workload)
    return report, holder[0]


def results_markdown(
    results: list[ClassResult], header: str = "", errors: Mapping[str, str] | None = None
) -> str:
    """The matrix as a markdown table (docs/reliability.md); classes that could not
    finish (the pair never came back, traffic stopped) are listed after it."""
    lines = [header] if header else []
    lines += [
        "| fault class | cycles | fault hit | confirmed | lost | duplicates | "
        "commits ok / 541 | nacked | confirm stalls | back to ready p50 | max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.cycles} | {r.hits}/{r.cycles} | {r.confirmed} | {r.lost} | "
            f"{r.duplicates} | {r.commits} / {r.failed_commits} | {r.nacked} | {r.stalls} | "
            f"{r.ready_p50:.1f} s | {r.ready_max:.1f} s |"
        )
    for name, error in (errors or {}).items():
        lines.append(f"\n**{name}: did not finish**: {error}")
    return "\n".join(lines) + "\n"


def write_results(
    results: list[ClassResult],
    path: Path,
    header: str = "",
    errors: Mapping[str, str] | None = None,
) -> None:
    """`<path>.json` and `<path>.md`: every class's figures and proofs."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data: dict[str, Any] = {
        "header": header,
        "classes": [{**r.__dict__, "ok": r.ok} for r in results],
        "did_not_finish": dict(errors or {}),
    }
    path.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    path.with_suffix(".md").write_text(results_markdown(results, header, errors))
