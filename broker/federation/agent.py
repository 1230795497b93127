"""The exchange federation agent (the seed's EFA): one link from an upstream exchange into
a local one.

A link is an AMQP client connection (`wire.LinkClient`: content kept as received) to the
upstream with, in order:

1. the handshake: both sides announce their server identifier; a duplicate is refused
   (`identity.py`), here and on the upstream;
2. the upstream exchange and the link's durable queue (`federation:X:<our id>`)
   declared, the upstream bindings re-synchronised in full from the local exchange's
   bindings (`bindings.py`), then a consumer with manual acks: only then *running*
   (a verified round trip);
3. while running: local binding changes are propagated (incrementally); deliveries are
   republished into the local exchange, their dedup keys recorded in the same group
   commit, and acknowledged upstream only once that commit is durable (`BatchFutures`);
4. with `forward`: what this server's clients publish on the exchange (journaled in the
   exchange's outbox queue in the same batch as the local copies) is published to the
   upstream exchange in confirm mode, origin and path stamped, and settled here only once
   the upstream confirms it (durable there, its key in the upstream's window).

Any error ends the session; the next one starts after a pause that doubles up to the
upstream's `reconnect-max-seconds` (reset once a session ran). Sessions never overlap:
the old one's deliveries are all settled locally before the next one consumes, so a
redelivery always meets the key of its first copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, Literal, Protocol
from urllib.parse import quote

from twinmq.broker import codec, fieldtable
from twinmq.broker.definitions import BindingDef
from twinmq.broker.errors import AMQPError
from twinmq.broker.federation import bindings as fb
from twinmq.broker.federation import marks, metrics, peer
from twinmq.broker.federation.config import FederatedExchange, Upstream
from twinmq.broker.federation.dedup import DurableKeys, Told, scoped, scoped_origin
from twinmq.broker.federation.headers import HEADERS_FLAG, PATH, arrival, departure
from twinmq.broker.federation.identity import (
    DUPLICATE_ID,
    PEER_EXCHANGE,
    PEER_PROPERTY,
    SERVER_ID_PROPERTY,
    STATE_PROPERTY,
    duplicate_refusal,
)
from twinmq.broker.federation.marks import MARKS_PROPERTY, MARKS_VERSION, ToldMarks
from twinmq.broker.federation.state import STATE_EXCHANGE, StateMessage, StateView
from twinmq.broker.federation.wire import Delivery, LinkClient, LinkClosed
from twinmq.broker.journal import JournalOp, StoredMessage
from twinmq.broker.message import Entry, Message
from twinmq.broker.mirror.events import INTERNAL_PREFIX, INTERNAL_QID_BASE
from twinmq.broker.queue import Queue
from twinmq.broker.routing import Exchange
from twinmq.broker.vhost import Cancellable, PublishResult, VirtualHost

log = logging.getLogger(__name__)

QUEUE_PREFIX = "federation:"
HELD_QUEUE: Final = INTERNAL_PREFIX + "federation-held"
"""Deliveries this server cannot republish (past its bounds with the path added), kept."""
HELD_QID: Final = INTERNAL_QID_BASE + 0x101
OUTBOX_PREFIX: Final = INTERNAL_PREFIX + "federation-out:"
"""`<prefix><exchange>`: what waits to be forwarded upstream (a queue per forwarding exchange)."""
LinkState = Literal["connecting", "running", "refused"]
BATCH_MAX = 1024  # deliveries republished per local group commit wait at most
FIRST_PAUSE = 1.0  # seconds before the first reconnect
STATE_WAIT = 10.0  # seconds a resync waits for the upstream's full state at most


class Batches(Protocol):
    """Futures for group-commit batches (`broker/mirror/durable.BatchFutures`)."""

    def wait(self, batch: int) -> asyncio.Future[bool]:
        """A future resolved True once `batch` is durable, False if it failed."""
        ...


class Refused(Exception):
    """The peering is refused (a duplicate server identifier): not retried quickly."""


def queue_name(upstream_exchange: str, server_id: str) -> str:
    """The link's queue on the upstream (durable: it holds messages while the link is down).

    `federation:<exchange>:<downstream server id>`: the client library (pamqp) accepts only
    the spec's name characters (letters, digits, `-_.:`), so no spaces or arrows.
    """
    return f"{QUEUE_PREFIX}{upstream_exchange}:{server_id}"


class FederationLink:
    """One federated exchange's link to its upstream."""

    def __init__(
        self,
        fed: FederatedExchange,
        upstream_name: str,
        upstream: Upstream,
        server_id: str,
        vhost: VirtualHost,
        batches: Batches,
        alarm: Callable[[], str | None],
        state_dir: Path,
        keys: DurableKeys,
    ) -> None:
        self.fed = fed
        self.upstream_name = upstream_name
        self.upstream = upstream
        self.server_id = server_id
        # The local exchange's vhost; the dedup records and the held queue are the
        # server's, in `/` (`root`), as the window shared by every link is.
        self.vhost = vhost
        self.root = vhost.root
        # The vhost the link opens upstream (`upstream-vhost`, the URI's, or ours).
        self.upstream_vhost = fed.source_vhost(upstream)
        self.batches = batches
        self.alarm = alarm
        self.queue = queue_name(fed.source_exchange, server_id)
        stem = quote(fed.exchange, safe="")
        if fed.vhost != "/":
            # Another vhost's exchange of the same name has a record of its own.
            state_dir = state_dir / "vhosts" / quote(fed.vhost, safe="")
            state_dir.mkdir(parents=True, exist_ok=True)
        self.keys = keys  # the server's window, shared by its links
        self.link_id = fed.link_id
        # It waits for this link from the start, for any origin of the link's vhost.
        keys.register(self.link_id, vhost.name)
        # What may be bound upstream (a crash between recording and binding leaves more
        # here than there, never less): unbound at the next resync if not wanted.
        self._record = fb.Record(state_dir / f"{stem}.bindings.json")
        self.bound: set[fb.UpstreamBinding] = set()
        # The local exchange's bindings, normalised and reference counted, followed one
        # change at a time (`Exchange.watchers`) on the exchange object `_watched`.
        self.needed = fb.UpstreamSet(fed.type)
        self._watched: Exchange | None = None
        self._rebuilt = False  # `needed` rebuilt: the next sync compares whole sets
        self.state: LinkState = "connecting"
        self.error: str | None = None
        self.upstream_id: str | None = None
        self.running_since: float | None = None
        self.reconnect_pause: float | None = None  # while waiting to reconnect: how long
        self._ran = False  # the current (or last) session reached running
        # The running session's connection, when the upstream takes our status on its
        # amq.peer (announced at the handshake): link-up and link-status go there too.
        self._status_to: LinkClient | None = None
        self.received = 0
        self.duplicates = 0
        self.loops = 0
        self.unstamped = 0
        self.held = 0
        self.forwarded = 0
        self.forward_loops = 0
        # The upstream's definitions (state replication), renewed by each session.
        self.upstream_state: StateView | None = None
        self._state_full = asyncio.Event()
        self.stale_unbound = 0
        self.outbox: Queue | None = None  # set by `open_outbox` (active, `forward` only)
        self._forwarder: Forwarder | None = None
        self._dirty = asyncio.Event()
        # This session's upstream tells marks (marks.py), and no batch failed since: a
        # failed batch's deliveries come again after later ones, behind marks told since.
        self._told_ok = False
        self._session_no = 0  # sessions so far: what the upstream tells is per session
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._label = self.link_id
        metrics.LINK_RUNNING.labels(self._label).set(0)
        metrics.LINK_REFUSED.labels(self._label).set(0)
        metrics.BINDINGS.labels(self._label).set_function(lambda: len(self.bound))

    # -- control ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start connecting (and reconnecting) in the background."""
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"twinmq-federation-{self._label}"
        )

    async def stop(self) -> None:
        """Stop the link (its upstream queue stays: it is the link's, across restarts)."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._set_state("connecting", "stopped")

    @property
    def forward_pending(self) -> int:
        """Messages in the outbox: waiting, or sent and not yet confirmed upstream."""
        if self.outbox is None:
            return 0
        return self.outbox.message_count + len(self.outbox.delivered)

    def open_outbox(self) -> None:
        """With `forward`: make the exchange's outbox (active only) and tap the exchange."""
        if not self.fed.forward:
            return
        name = OUTBOX_PREFIX + self.fed.exchange
        queue = self.vhost.queues.get(name)
        if queue is None:
            # A qid of the ordinary sequence (saved with the definitions): an outbox per
            # exchange cannot have a fixed one, and a fixed one could meet a removed
            # exchange's records.
            qid = self.vhost.next_qid
            self.vhost.next_qid += 1
            queue = self.vhost.internal_queue(name, qid)
        else:
            queue = self.vhost.internal_queue(name, queue.definition.qid)
        self.outbox = queue
        self.vhost.forwarding[self.fed.exchange] = queue

    def close_outbox(self) -> None:
        """Stop tapping the exchange (demotion, shutdown); the outbox's messages stay."""
        self.vhost.forwarding.pop(self.fed.exchange, None)

    def declare_exchange(self) -> None:
        """The local federated exchange, made if missing (the file names it)."""
        fed = self.fed
        if fed.exchange not in self.vhost.exchanges:
            self.vhost.declare_exchange(
                fed.exchange, fed.type, passive=False, durable=True, auto_delete=False,
                internal=False, arguments={},
            )  # fmt: skip

    def follow(self, vhost: VirtualHost, *, active: bool) -> None:
        """The local vhost was made again (deleted, then served by the users file): the
        link republishes into the new one, its exchange made there, its outbox too, and
        the new exchange's bindings (none yet) propagated (`_sync` watches it)."""
        self.close_outbox()
        self.vhost = vhost
        if active:
            self.declare_exchange()
            self.open_outbox()
            self.bindings_changed()

    def bindings_changed(self) -> None:
        """The local exchange's bindings changed: propagate (the running session does)."""
        self._dirty.set()

    # -- sessions ---------------------------------------------------------------------------

    async def _run(self) -> None:
        pause = FIRST_PAUSE
        while not self._stopping:
            metrics.RECONNECTS.labels(self._label).inc()
            self.reconnect_pause = None
            self._ran = False
            try:
                await self._session()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if self._stopping or task is None or task.cancelling():
                    raise
                # Not this task's cancellation (a cancelled future awaited somewhere in
                # the session): a failure like any other, or the link would stay down.
                self._set_state("connecting", "the session was cancelled")
                log.warning("federation %s: session cancelled from within", self._label)
            except Refused as exc:
                self._refuse(str(exc))
            except Exception as exc:  # any failure of the session: reconnect later
                text = _describe(exc)
                if DUPLICATE_ID in text:
                    self._refuse(f"refused by the upstream: {text}")
                else:
                    self._set_state("connecting", text)
                    log.warning(
                        "federation %s <- %s (%s): link down: %s", self._label,
                        self.upstream_name, self.upstream.shown(), text,
                    )  # fmt: skip
            if self._ran:
                # A session that ran ends by an error too (the link cut): start over from
                # the first pause, or a link that flaps now and then would soon wait
                # `reconnect-max-seconds` after every cut.
                pause = FIRST_PAUSE
            self.reconnect_pause = pause
            await asyncio.sleep(pause)
            pause = min(pause * 2, self.upstream.reconnect_max_seconds)

    def _refuse(self, reason: str) -> None:
        if self.state != "refused" or self.error != reason:
            log.error(
                "federation %s <- %s (%s) REFUSED: %s",
                self._label, self.upstream_name, self.upstream.shown(), reason,
            )  # fmt: skip
        self._set_state("refused", reason)

    def _set_state(self, state: LinkState, error: str | None) -> None:
        event: peer.PeerEventName | None = None
        if state == "running" and self.state != "running":
            event = "link-up"
        elif state == "refused" and (self.state != "refused" or self.error != error):
            event = "link-refused"
        elif state == "connecting" and self.state == "running":
            event = "link-down"
        self.state = state
        self.error = error
        self.running_since = time.time() if state == "running" else None
        metrics.LINK_RUNNING.labels(self._label).set(1 if state == "running" else 0)
        metrics.LINK_REFUSED.labels(self._label).set(1 if state == "refused" else 0)
        if event is not None:
            message = peer.PeerEvent(
                event=event, server_id=self.server_id, peer=self.upstream_id,
                link=self.fed.exchange, upstream=self.upstream_name, reason=error,
                forward_pending=self.forward_pending, messages_received=self.received,
                messages_forwarded=self.forwarded, time=peer.now(),
            )  # fmt: skip
            peer.publish(self.vhost, message)
            if event == "link-up":  # the only one a running session can carry upstream
                self.send_status(message)

    def send_status(self, event: peer.PeerEvent) -> None:
        """Send a copy of `event` to the upstream's `amq.peer` on the running session's
        connection (seed 002: status goes to the peer's exchange, through the peering), if
        the upstream announced it takes them. Transient, unconfirmed, never an error of
        the link: a status is news (a link that is down sends nothing; its upstream sees
        `peer-disconnected` of its own)."""
        connection = self._status_to
        if connection is None:
            return
        try:
            header, body = peer.encode(event.model_copy(update={"to_peer": True}))
            connection.basic_publish(PEER_EXCHANGE, event.event, header, body)
        except (LinkClosed, OSError) as exc:  # the session ends on its own
            log.debug("federation %s: status not sent upstream: %r", self._label, exc)

    async def _session(self) -> None:
        """One connection, until it fails (`_ran`: it reached running)."""
        connection = await LinkClient.connect(
            self.upstream.connect_uri(self.upstream_vhost),
            {
                SERVER_ID_PROPERTY: self.server_id,
                "connection_name": f"federation {self.fed.exchange} -> {self.server_id}",
                # Tell this link its marks (marks.py).
                **({MARKS_PROPERTY: MARKS_VERSION} if marks.ENABLED else {}),
            },
            tls=self.upstream.tls_context(),
            server_name=self.upstream.tls_server_name,
        )
        inbox: asyncio.Queue[Delivery | ToldMarks | None] = asyncio.Queue()
        # What an upstream told an earlier session holds no more (restarted, failed over).
        self.keys.told_reset(self.link_id)
        self._session_no += 1
        self._told_ok = (
            marks.ENABLED and connection.server_properties.get(MARKS_PROPERTY) == MARKS_VERSION
        )
        processor: asyncio.Task[None] | None = None
        publisher: LinkClient | None = None
        try:
            peer = connection.server_properties.get(SERVER_ID_PROPERTY)
            if isinstance(peer, bytes):
                peer = peer.decode("utf-8", "replace")
            refusal = duplicate_refusal(self.server_id, peer, side="upstream")
            if refusal is not None:
                raise Refused(refusal)
            if not isinstance(peer, str) or not peer:
                raise ConnectionError(
                    "the upstream announces no server identifier (x-twinmq-server-id): "
                    "federation needs a TwinMQ upstream"
                )
            self.upstream_id = peer
            await connection.exchange_declare(self.fed.source_exchange, self._kind())
            await connection.queue_declare(self.queue)
            if _text(connection.server_properties.get(STATE_PROPERTY)) == STATE_EXCHANGE:
                await self._subscribe_state(connection)
            await self._sync(connection, full=True)
            await connection.basic_qos(self.fed.prefetch)
            forwarder = None
            if self.outbox is not None:
                # Forwarding has its own connection: a publish during the upstream's
                # resource alarm blocks the reads of its connection, and the consumer's
                # acks (which free the upstream's memory) must still go through.
                publisher = await LinkClient.connect(
                    self.upstream.connect_uri(self.upstream_vhost),
                    {
                        SERVER_ID_PROPERTY: self.server_id,
                        "connection_name": f"federation {self.fed.exchange} forward "
                        f"from {self.server_id}",
                    },
                    tls=self.upstream.tls_context(),
                    server_name=self.upstream.tls_server_name,
                )
                other = _text(publisher.server_properties.get(SERVER_ID_PROPERTY))
                if other != peer:
                    raise ConnectionError(
                        f"the forwarding connection reached server {other!r}, not {peer!r}"
                    )
                forwarder = Forwarder(self, publisher, self.outbox, peer)
                await publisher.confirm_select(forwarder.confirmed)
            processor = asyncio.get_running_loop().create_task(self._process(connection, inbox))
            # Exclusive: after a cut the upstream may hold the old session's consumer, with
            # its unacknowledged deliveries, until it notices the connection is gone (a
            # partition: its heartbeat timeout). Consuming beside it, this session would
            # get newer messages first and the old ones, requeued later, thousands of keys
            # behind the link's marks (traced: blocks of up to a prefetch window delivered
            # twice in a mesh); refused instead (403) and retried until the old one is gone
            # and its deliveries are back at the head of the queue, in order.
            await connection.basic_consume(
                self.queue, inbox.put_nowait, exclusive=True,
                on_marks=inbox.put_nowait if self._told_ok else None,
            )  # fmt: skip
            if forwarder is not None:
                self._forwarder = forwarder
                forwarder.open()
            if _text(connection.server_properties.get(PEER_PROPERTY)) == PEER_EXCHANGE:
                self._status_to = connection
            self._set_state("running", None)
            self._ran = True
            log.info(
                "federation %s <- %s (%s, server %s): running, %d upstream bindings",
                self._label, self.upstream_name, self.upstream.shown(), peer,
                len(self.bound),
            )  # fmt: skip
            closing = connection.closing
            while True:
                dirty = asyncio.ensure_future(self._dirty.wait())
                waiters: set[asyncio.Future[Any]] = {dirty, closing, processor}
                if publisher is not None:
                    waiters.add(publisher.closing)
                done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                if dirty not in done:
                    dirty.cancel()
                    if processor in done:
                        processor.result()  # its error ends the session
                    if publisher is not None and publisher.closing in done:
                        raise ConnectionError(
                            f"forwarding connection closed: {_closing_reason(publisher)}"
                        )
                    raise ConnectionError(f"connection closed: {_closing_reason(connection)}")
                self._dirty.clear()
                await self._sync(connection, full=False)
        finally:
            self._status_to = None
            if self._forwarder is not None:
                # Unconfirmed forwards go back to the outbox: sent again by the next
                # session, dropped upstream by their key if they had arrived.
                self._forwarder.close()
                self._forwarder = None
            if processor is not None:
                # Settle what was received locally before another session consumes.
                inbox.put_nowait(None)
                with contextlib.suppress(Exception):
                    await processor
            if publisher is not None:
                with contextlib.suppress(Exception):
                    await publisher.close()
            with contextlib.suppress(Exception):
                await connection.close()
            if self._ran:
                # The reason the session ends (in amq.peer's link-down too).
                ending = sys.exc_info()[1]
                self._set_state("connecting", _describe(ending) if ending else self.error)

    async def _subscribe_state(self, connection: LinkClient) -> None:
        """Subscribe to the upstream's definitions and wait (bounded) for the full state:
        the resync then also unbinds what the upstream says our queue holds and nothing
        here wants (a binding made by a pair's old active, whose record is not here)."""
        self.upstream_state = StateView()
        self._state_full.clear()
        queue = await connection.declare_private_queue()
        await connection.watch(queue, "state", self._state_message)
        await connection.queue_bind(queue, STATE_EXCHANGE, "", None)
        try:
            async with asyncio.timeout(STATE_WAIT):
                await self._state_full.wait()
        except TimeoutError:
            log.warning(
                "federation %s: no full state from the upstream in %.0f s; resync from the "
                "local record only", self._label, STATE_WAIT,
            )  # fmt: skip

    def _state_message(self, delivery: Delivery) -> None:
        view = self.upstream_state
        if view is None:
            return
        try:
            message = StateMessage.model_validate_json(delivery.body)
        except ValueError as exc:  # news only: a bad one is skipped, the link goes on
            log.warning("federation %s: unreadable state message: %s", self._label, exc)
            return
        view.apply(message)
        if message.kind == "full":
            self._state_full.set()

    def held_upstream(self) -> set[fb.UpstreamBinding]:
        """The bindings of the link's queue upstream, as the upstream's state says."""
        view = self.upstream_state
        if view is None or view.state is None:
            return set()
        source = self.fed.source_exchange
        return {
            fb.UpstreamBinding(b.routing_key, json.dumps(b.arguments, sort_keys=True, default=str))
            for b in view.state.bindings.values()
            if b.queue == self.queue and b.exchange == source
        }

    def _kind(self) -> str:
        exchange = self.vhost.exchanges.get(self.fed.exchange)
        return exchange.type if exchange is not None else self.fed.type

    # -- binding propagation ------------------------------------------------------------

    def _watch(self, exchange: Exchange | None) -> None:
        """Follow `exchange` (the local one now: created, replaced or gone since): the
        normalised set rebuilt from its bindings, then kept by its change callbacks."""
        if self._watched is not None and self._on_binding in self._watched.watchers:
            self._watched.watchers.remove(self._on_binding)
        self._watched = exchange
        if exchange is None:
            self.needed = fb.UpstreamSet(self.fed.type)
        else:
            self.needed = fb.UpstreamSet(exchange.type, exchange.bindings.values())
            exchange.watchers.append(self._on_binding)
        self._rebuilt = True

    def _on_binding(self, binding: BindingDef, added: bool) -> None:
        """`Exchange.watchers`: one local binding added or removed (no I/O here)."""
        if added:
            self.needed.add(binding)
        else:
            self.needed.remove(binding)

    async def _sync(self, channel: LinkClient, *, full: bool) -> None:
        """Make the upstream queue's bindings the normalised set of the local bindings:
        the changes since the last sync (or, `full`, everything: after a reconnect).

        Binds go first, then unbinds (a covered pattern is bound before its cover goes:
        no window where a message has no binding upstream); each list pipelined. A full
        resync binds first only what an unbind would leave uncovered, the rest last. The
        record gets a binding before it is sent and loses it once its unbind is answered,
        so after a crash anywhere it holds at least what the upstream does."""
        exchange = self.vhost.exchanges.get(self.fed.exchange)
        if full or exchange is not self._watched:
            self._watch(exchange)
        wanted = set(self.needed.roots)
        if full:
            seen = self.held_upstream()
            held = self._record.held
            self.stale_unbound += len(seen - wanted - held - self.bound)
            changes = fb.resync(held | self.bound | seen, wanted)
            self.needed.drain(self.bound)  # everything is in `changes`
        elif self._rebuilt:
            changes = fb.Changes(sorted(wanted - self.bound), sorted(self.bound - wanted))
            self.needed.drain(self.bound)
        else:
            changes = self.needed.drain(self.bound)
        self._rebuilt = False
        later: list[fb.UpstreamBinding] = []
        if full:
            # Only what a binding about to go covers must be bound before it goes; the
            # rest after the unbinds: a durable bind upstream costs in proportion to the
            # bindings there today, so the set is kept small while it changes.
            first = (
                fb.covered_by(changes.bind, changes.unbind, self.needed.kind)
                if self.needed.subsumes
                else []
            )
            later = sorted(set(changes.bind) - set(first))
            changes = fb.Changes(first, changes.unbind)
        await self._send(channel, changes.bind)
        if changes.unbind:
            unbinds = changes.unbind
            await channel.queue_bind_many(
                self.queue, self.fed.source_exchange,
                [(b.routing_key, b.arguments) for b in unbinds],
                lambda i: self.bound.discard(unbinds[i]), unbind=True,
            )  # fmt: skip
            self._record.remove(unbinds)
        await self._send(channel, later)
        if full:
            self._record.rewrite(wanted)  # the record compacted: exactly what is bound

    async def _send(self, channel: LinkClient, binds: list[fb.UpstreamBinding]) -> None:
        """Bind upstream (pipelined), recorded first."""
        if not binds:
            return
        self._record.add(binds)
        await channel.queue_bind_many(
            self.queue, self.fed.source_exchange, [(b.routing_key, b.arguments) for b in binds],
            lambda i: self.bound.add(binds[i]),
        )  # fmt: skip

    # -- messages -----------------------------------------------------------------------------

    async def _process(
        self, channel: LinkClient, inbox: asyncio.Queue[Delivery | ToldMarks | None]
    ) -> None:
        """Republish deliveries in batches, in order, until the session's end marker."""
        while True:
            first = await inbox.get()
            if first is None:
                return
            batch, last = [first], False
            while not inbox.empty() and len(batch) < BATCH_MAX:
                item = inbox.get_nowait()
                if item is None:
                    last = True
                    break
                batch.append(item)
            # The local resource alarm blocks this publisher too (as it blocks clients); the
            # monitor offers no event to wait on.
            while self.alarm() is not None and not last:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
            await self._republish(channel, batch)
            if last:
                return

    async def _republish(self, channel: LinkClient, items: list[Delivery | ToldMarks]) -> None:
        settled: list[tuple[int, bool]] = []  # (delivery tag, ack: True / requeue: False)
        batch = [item for item in items if isinstance(item, Delivery)]
        told = self._told([item for item in items if isinstance(item, ToldMarks)])
        # (tag, dedup key, the publish; None: kept in the held queue with the keys' record)
        waiting: list[tuple[int, str | None, PublishResult | None]] = []
        held: list[JournalOp] = []
        # Keys this link brought and settled (republished, or dropped as copies): how far
        # it has got per origin, which the window waits for before forgetting a key.
        passed: list[str] = []
        assert self.upstream_id is not None
        for message in batch:
            tag = message.delivery_tag
            try:
                table = codec.decode_headers(message.header)
            except ValueError as exc:
                # Past this server's bounds (the upstream's stamps grew it, or another
                # version's): kept as received, never republished with headers rewritten.
                # Its (origin, seq) cannot be read; the bytes name it (the upstream's
                # stamp is among them), so a redelivery after a crash is still a duplicate.
                held_key = scoped(
                    self.vhost.name,
                    "held\x00" + hashlib.sha256(message.header + message.body).hexdigest(),
                )
                if held_key in self.keys:
                    self.duplicates += 1
                    metrics.DUPLICATES.labels(self._label).inc()
                    settled.append((tag, True))
                    continue
                held.append(self._hold(message, exc))
                self.keys.claim(held_key)
                waiting.append((tag, held_key, None))
                continue
            headers = {name: fieldtable.to_python(value) for name, value in table.items}
            verdict = arrival(headers, self.upstream_id, self.server_id, self.fed.max_hops)
            key = verdict.dedup_key
            if key is not None:
                key = scoped(self.vhost.name, key)  # one window, a key space per vhost
            if verdict.verdict in ("loop", "too-many-hops"):
                self.loops += 1
                metrics.LOOPS.labels(self._label).inc()
                settled.append((tag, True))
                if key is not None:
                    passed.append(key)
                continue
            if key is not None and key in self.keys:  # republished, or in flight (claimed)
                self.duplicates += 1
                metrics.DUPLICATES.labels(self._label).inc()
                settled.append((tag, True))
                passed.append(key)
                continue
            if verdict.verdict == "unstamped":
                self.unstamped += 1  # no dedup possible (an upstream of another kind)
            exchange = self.vhost.exchanges.get(self.fed.exchange)
            if exchange is None:
                settled.append((tag, False))  # the local exchange is gone: retried later
                continue
            # Only the path changes: every other byte of the header goes on as received.
            path = fieldtable.Array(tuple(fieldtable.text(hop) for hop in verdict.path))
            stamped = fieldtable.Table((*table.without(PATH).items, (PATH, path)))
            try:
                header = codec.rebuild_header(
                    message.header, {HEADERS_FLAG: fieldtable.encode_table(stamped)}
                )
                info = codec.decode_content_header(header)
            except (AMQPError, ValueError) as exc:
                # Past this broker's bounds once the path is added (or from another
                # version): kept as received in the held queue, never dropped; the link
                # goes on.
                held.append(self._hold(message, exc))
                if key is not None:
                    self.keys.claim(key)
                waiting.append((tag, key, None))
                continue
            # Never forwarded back up (no echo): it came down this or another link.
            result = self.vhost.publish(
                exchange, message.routing_key or "", header, message.body, info, hold=True,
                forward=False, admission="link",
            )  # fmt: skip
            if key is not None:
                self.keys.claim(key)
            waiting.append((tag, key, result))
        # The keys' record joins the same group commit as the messages (no await since
        # their publishes): after a crash both are on disk or neither.
        record = self.keys.record(self.root, [key for _t, key, _r in waiting if key]) + held
        record_batch = self.root.committer.add(record) if record else 0
        fresh = self.keys.fresh()
        if fresh:
            self.root.visibility.hold(record_batch, fresh)  # withdrawn if it fails
        recorded = True if not record_batch else await self.batches.wait(record_batch)
        durable: list[str] = []
        failed: list[str] = []
        for tag, key, published in waiting:
            ok = recorded and (
                published is None or not published.batch or await self.batches.wait(published.batch)
            )
            settled.append((tag, ok))
            if ok:
                self.received += 1
                metrics.RECEIVED.labels(self._label).inc()
            if key is not None:
                (durable if ok else failed).append(key)
        self.keys.settle(durable, failed)
        if failed or any(not ok for _tag, ok in settled):
            # Requeued upstream, they come again after what this session gets next, and
            # the marks told meanwhile would pass them: none believed until the next one.
            self._told_ok = False
            told = None
        # In force once 4 prefetch windows later: a cut's re-deliveries come before that.
        self.keys.passed(
            self.link_id, passed + durable, max(4096, 4 * self.fed.prefetch),
            told if self._told_ok else None,
            (self._session_no, max((m.delivery_tag for m in batch), default=0)),
        )  # fmt: skip
        for tag, ok in sorted(settled):
            try:
                if ok:
                    channel.basic_ack(tag)
                else:
                    channel.basic_nack(tag, requeue=True)
            except Exception:
                # The channel is gone: the upstream redelivers; the keys drop the copies.
                return

    def _told(self, told: list[ToldMarks]) -> Told | None:
        """The marks the upstream told in a batch (the highest of each), as the window
        keeps them (origins scoped by the local vhost); None if nothing was told."""
        told = [each for each in told if each.queue == self.queue]
        if not told:
            return None
        vhost = self.vhost.name
        named: dict[str, int] = {}
        others = -1
        for each in told:
            for origin, seq in each.marks.items():
                scoped_name = scoped_origin(vhost, origin)
                named[scoped_name] = max(named.get(scoped_name, others), seq)
            others = max(others, each.others)
        return Told(named, others, max(each.acked for each in told))

    def _hold(self, message: Delivery, exc: Exception) -> JournalOp:
        """Keep a delivery that cannot be republished, as received, in `HELD_QUEUE`."""
        queue = self.root.internal_queue(HELD_QUEUE, HELD_QID, locked=False)
        mid = self.root.next_mid
        self.root.next_mid += 1
        stored = Message(mid, "", HELD_QUEUE, message.header, message.body, True, None, None)
        queue.entries.append(Entry(stored, None, True))
        queue.bytes += len(message.body)
        self.held += 1
        metrics.HELD.labels(self._label).inc()
        log.error(
            "federation %s: a message from %s cannot be republished here (%s): kept as "
            "received in %s",
            self._label, self.upstream_name, exc, HELD_QUEUE,
        )  # fmt: skip
        return StoredMessage(
            mid, queue.definition.qid, "", HELD_QUEUE, message.header, message.body, None
        )


RETRY_FIRST: Final = 0.5
RETRY_MAX: Final = 30.0
"""A forward the upstream nacked (a full queue there) is sent again after a pause that
doubles from `RETRY_FIRST` to `RETRY_MAX` seconds, back to none at the next ack."""


class Forwarder:
    """The link's consumer of its outbox (a `queue.Consumer`): each message is published
    upstream in confirm mode and settled here once confirmed; at most `prefetch` are
    unconfirmed. Sans-await: `deliver` and `confirmed` run in the event loop's turn."""

    tag = "federation-forward"
    exclusive = True

    def __init__(
        self, link: FederationLink, connection: LinkClient, queue: Queue, upstream_id: str
    ):
        self.link = link
        self.connection = connection
        self.queue = queue
        self.upstream_id = upstream_id
        self.unconfirmed: dict[int, Entry] = {}  # confirm sequence number -> entry
        self._open = False
        self._retry_delay = 0.0
        self._resume: Cancellable | None = None  # the pause after a nack, while it lasts

    def open(self) -> None:
        """Start taking the outbox's messages."""
        self._open = True
        self.queue.add_consumer(self)
        self.queue.dispatch(self.link.vhost.clock.time())

    def close(self) -> None:
        """Stop; unconfirmed messages go back to the head of the outbox."""
        self._open = False
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self.queue.remove_consumer(self)
        entries = list(self.unconfirmed.values())
        self.unconfirmed.clear()
        if entries:
            self.link.vhost.requeue(self.queue, entries)

    def ready(self) -> bool:
        """`queue.Consumer`: room in the unconfirmed window, and the connection up."""
        return (
            self._open
            and self._resume is None
            and not self.connection.closing.done()
            and len(self.unconfirmed) < self.link.fed.prefetch
        )

    def deliver(self, queue: Queue, entry: Entry) -> None:
        """`queue.Consumer`: forward one message (or drop a loop, hold what cannot go)."""
        link = self.link
        message = entry.message
        queue.delivered[message.mid] = entry
        try:
            verdict = departure(
                message.header, link.server_id, message.mid, self.upstream_id, link.fed.max_hops
            )
        except (AMQPError, ValueError) as exc:
            # Past the bounds once stamped: kept as it is, never sent rewritten or dropped.
            delivery = Delivery(0, False, message.exchange, message.routing_key, message.header,
                                message.body)  # fmt: skip
            link.vhost.committer.add([link._hold(delivery, exc)])
            link.vhost.settle(queue, [entry])
            return
        if verdict.verdict != "forward":
            # It came from the upstream (or passed through it) already, or too far.
            link.forward_loops += 1
            metrics.LOOPS.labels(link._label).inc()
            link.vhost.settle(queue, [entry])
            return
        try:
            seq = self.connection.basic_publish(
                link.fed.source_exchange, message.routing_key, verdict.header, message.body
            )
        except LinkClosed:
            # Gone since `ready`: back to the outbox for the next session.
            self._open = False
            link.vhost.requeue(queue, [entry])
            return
        self.unconfirmed[seq] = entry

    def confirmed(self, seq: int, multiple: bool, ack: bool) -> None:
        """The upstream's basic.ack / basic.nack: settle, or put back to send again."""
        if multiple:
            seqs = [s for s in self.unconfirmed if s <= seq]
        else:
            seqs = [seq] if seq in self.unconfirmed else []
        entries = [self.unconfirmed.pop(s) for s in seqs]
        if not entries:
            return
        vhost = self.link.vhost
        if ack:
            self._retry_delay = 0.0
            vhost.settle(self.queue, entries)
            self.link.forwarded += len(entries)
            metrics.FORWARDED.labels(self.link._label).inc(len(entries))
            self.queue.dispatch(vhost.clock.time())
            return
        # Refused upstream (a queue there full): sent again after a pause, not at once,
        # which spun both brokers for as long as the queue stayed full.
        self._retry_delay = min(RETRY_MAX, max(RETRY_FIRST, 2 * self._retry_delay))
        if self._resume is None:
            self._resume = vhost.clock.call_later(self._retry_delay, self._wake)
        vhost.requeue(self.queue, entries)

    def _wake(self) -> None:
        self._resume = None
        self.queue.dispatch(self.link.vhost.clock.time())


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _describe(exc: BaseException) -> str:
    text = " ".join(str(a) for a in exc.args) if exc.args else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _closing_reason(connection: Any) -> str:
    closing = connection.closing
    if closing.done() and not closing.cancelled():
        exc = closing.exception()
        if exc is not None:
            return _describe(exc)
    return "closed"
