"""The broker's protocol core without sockets: bytes in, bytes out (tests and fuzzing).

`Harness` wires `Connection` objects to a real `VirtualHost` over a real
`Journal` and `GroupCommitter` (on a private, normally idle event loop), with a
clock the test moves by hand. `Peer` is one client connection: feed it bytes,
read back exactly what the broker answered.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from twinmq.broker.auth import Authenticator, User
from twinmq.broker.channel import Channel
from twinmq.broker.codec import ContentHeaderInfo
from twinmq.broker.commit import GroupCommitter
from twinmq.broker.connection import Connection, Limits
from twinmq.broker.federation.identity import duplicate_refusal
from twinmq.broker.federation.marks import ToldMarks
from twinmq.broker.journal import Journal
from twinmq.broker.queue import NO_CAP, LengthCap
from twinmq.broker.routing import Exchange
from twinmq.broker.settings import BrokerSettings
from twinmq.broker.vhost import PublishResult, VirtualHost
from twinmq.testing.rawamqp import decode_frames, handshake_frames

PRODUCT_VERSION = "0.0.0-test"


@dataclass(order=True)
class _Timer:
    at: float
    seq: int
    callback: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """The virtual host's `Clock`: time stands still until `advance`."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now
        self._timers: list[_Timer] = []
        self._seq = itertools.count()

    def time(self) -> float:
        """The current (fake) wall-clock time."""
        return self.now

    def call_later(self, delay: float, callback: Callable[[], None]) -> _Timer:
        """Schedule `callback`; it runs from `advance`."""
        timer = _Timer(self.now + delay, next(self._seq), callback)
        heapq.heappush(self._timers, timer)
        return timer

    def advance(self, seconds: float) -> None:
        """Move time forward, running the timers that fall due, in order."""
        target = self.now + seconds
        while self._timers and self._timers[0].at <= target:
            timer = heapq.heappop(self._timers)
            self.now = max(self.now, timer.at)
            if not timer.cancelled:
                timer.callback()
        self.now = target


class Context:
    """A `ConnectionContext`: what the asyncio `Broker` gives its connections."""

    def __init__(
        self,
        vhost: VirtualHost,
        committer: GroupCommitter,
        authenticator: Authenticator,
        limits: Limits,
    ) -> None:
        self.vhost = vhost
        self.committer = committer
        self.authenticator = authenticator
        self.limits = limits
        self.product_version = PRODUCT_VERSION
        self.alarm_reason: str | None = None
        self.refusal_reason: str | None = None
        self.write_refusal_reason: str | None = None
        # Federation peers' status messages for amq.peer: (routing key, body, allowed).
        self.peer_statuses: list[tuple[str, bytes, bool]] = []

    def await_durable(self, channel: Channel) -> None:
        """Channels wait on the group committer, as in the broker."""
        self.committer.await_durable(channel)

    def served_vhost(self, name: str) -> VirtualHost | None:
        """The vhost `name` if the authenticator's users file declares it, as the broker."""
        if name not in self.authenticator.vhosts:
            return None
        return self.vhost.add_vhost(name)

    def alarm(self) -> str | None:
        """The resource alarm the test has raised, if any."""
        return self.alarm_reason

    def refusal(self) -> str | None:
        """Why clients are refused (a passive broker), if the test says so."""
        return self.refusal_reason

    def write_refusal(self) -> str | None:
        """Why clients may only read (a DR replica), if the test says so."""
        return self.write_refusal_reason

    def open_connections(self, user: str) -> int:
        """Nobody else's connections count here."""
        return 0

    @property
    def server_id(self) -> str:
        """The identifier the core announces."""
        return "sansio"

    def peer_refusal(self, peer: str, announced: object) -> str | None:
        """A peer announcing our own identifier is refused, as in the broker."""
        return duplicate_refusal(self.server_id, announced, side="downstream")

    def peer_connected(self, peer: str, announced: object) -> None:
        """No `amq.peer` news here: the core has no federation service."""

    def told_marks(self, vhost: str, queue: str) -> ToldMarks:
        """Nothing told: the core here has no federation (federation/marks.py)."""
        return ToldMarks(queue=queue)

    def marks_durable(self) -> tuple[int, int]:
        """Nothing outstanding."""
        return 0, 0

    def receive_forwarded(
        self,
        exchange: Exchange,
        routing_key: str,
        header: bytes,
        body: bytes,
        info: ContentHeaderInfo,
        *,
        hold: bool,
    ) -> PublishResult:
        """No federation here: published as any message."""
        return self.vhost.publish(exchange, routing_key, header, body, info, hold=hold)

    def receive_peer_status(
        self,
        routing_key: str,
        header: bytes,
        body: bytes,
        info: ContentHeaderInfo,
        *,
        allowed: bool,
        vhost: str = "/",
    ) -> None:
        """No federation here: recorded for the test."""
        self.peer_statuses.append((routing_key, body, allowed))


class Peer:
    """One client connection to the core; `feed` returns what the broker answered."""

    def __init__(self, conn: Connection, end_turn: Callable[[], None] = lambda: None) -> None:
        self.conn = conn
        self.wakes = 0
        # The end of the broker's loop turn: the topology changes staged by what was fed
        # are written (group commit) and their replies released.
        self.end_turn = end_turn

    def wake(self) -> None:
        """The transport's wake-up callback (counted, nothing to schedule)."""
        self.wakes += 1

    def feed(self, data: bytes, now: float = 0.0) -> bytes:
        """Give the broker bytes from the client; return every byte it wants to send."""
        self.conn.receive_data(data, now)
        self.end_turn()
        return self.conn.data_to_send()

    def handshake(self, **kwargs: object) -> bytes:
        """Run the opening handshake (guest/PLAIN unless told otherwise); return all output."""
        return b"".join(self.feed(step) for step in handshake_frames(**kwargs))  # type: ignore[arg-type]

    def exchange(self, data: bytes) -> list[tuple[int, object]]:
        """Feed bytes and decode the answer into (channel, frame) pairs."""
        return decode_frames(self.feed(data))  # type: ignore[return-value]


class Harness:
    """A virtual host and the connections on it; `close` releases the journal."""

    # guest as a broker without a users file has it: the one user that may link.
    USERS = (
        User(name="guest", password="guest", tags=["federation"]),
        User(name="alice", password="wonderland"),
    )

    def __init__(
        self, directory: Path, limits: Limits | None = None, queue_cap: LengthCap = NO_CAP
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.journal = Journal(directory / "journal", fsync=False)
        recovered = self.journal.open()
        self.committer = GroupCommitter(self.journal, self.loop)
        self.committer.start()
        self.clock = ManualClock()
        self.vhost = VirtualHost(self.committer, self.clock, recovered, queue_cap=queue_cap)
        self.ctx = Context(
            self.vhost, self.committer, Authenticator(list(self.USERS)), limits or Limits()
        )
        self.peers: list[Peer] = []

    def connect(self, *, loopback: bool = True, peer: str = "127.0.0.1:40000") -> Peer:
        """A new connection on the shared virtual host (nothing sent yet)."""
        holder: list[Peer] = []
        conn = Connection(self.ctx, peer, loopback=loopback, wake=lambda: holder[0].wake())
        client = Peer(conn, self.committer.flush_topology)
        holder.append(client)
        self.peers.append(client)
        return client

    def commit(self, timeout: float = 5.0) -> None:
        """Run the event loop until group commit has made everything durable."""

        async def drained() -> None:
            # The committer has no "idle" event to wait on; poll it on the private loop.
            while self.committer.confirm_point():  # noqa: ASYNC110
                await asyncio.sleep(0.001)

        self.loop.run_until_complete(asyncio.wait_for(drained(), timeout))

    def close(self) -> None:
        """Drop the connections, stop group commit, close the journal and the loop."""
        for client in self.peers:
            client.conn.connection_lost()  # as the transport does when the socket goes
        self.loop.run_until_complete(self.committer.stop())
        self.loop.run_until_complete(self.journal.close())
        self.loop.close()


class NullTransport:
    """A link's transport that never closes and ignores an abort (a replica driven
    sans-I/O)."""

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        pass


class NullWriter:
    """A replica's link writer that drops what it is given (its acknowledgements)."""

    transport = NullTransport()

    def write(self, data: bytes) -> None:
        pass


def passive_settings(data_dir: Path, *, fsync: bool = False) -> BrokerSettings:
    """A passive broker of epoch 1 on `data_dir`, no listener, no audit log: the broker
    whose replica loop a test drives with NullWriter and frames of its own."""
    return BrokerSettings.model_validate({
        "data_dir": data_dir, "port": 0, "admin_port": 0, "fsync": fsync, "audit": False,
        "log_level": "WARNING", "role": "passive", "epoch": 1,
    })  # fmt: skip
