"""The source's end of the mirror link: connect, authenticate, stream events, trim on acks.

    source (connects)                         mirror (listens, listener.py)
                                       <-     CHALLENGE {name, nonce}
    HELLO {origin, nonce, proof}       ->
                                       <-     WELCOME {proof} (or REFUSE)
                                       <-     ACK u64: the origin's applied mark
    RECONCILE {probes} ...             ->     only when a seed is pending (its marks
                                              also without a snapshot to compare)
                                       <-     RECONCILE {answers}: what it lacks (delta.py)
    BATCH seq|0|event ... (pipelined)  ->
                                       <-     ACK u64 once applied and durable there
    PING {beat}                        ->     every second: a heartbeat (Heartbeat JSON)
                                       <-     PING {beat}: its echo, the round trip
    PING                               <-     the mirror's, when idle

Frames are the pair's replication frames (`broker/replication/protocol.py`).
Events go in order, as many as the window allows (`window_events`,
`window_bytes` unacknowledged); an ACK trims the replication queue and opens the
window. Any error closes the connection; the link tries again every `retry`
seconds, and resumes after the mark the mirror announces: what was sent but not
acknowledged is sent again and skipped there. Only an active broker connects.

"Connected" means a heartbeat came back: the handshake's mark proves the mirror
answered once, the echo proves the session still carries frames both ways
behind everything sent before it. The heartbeat also tells the mirror what a
forced promotion would lose (the source's newest event and backlog). HELLO and
REFUSE carry DR epochs (`role.py`): a REFUSE from a site at a higher epoch
fences this one (`on_fenced`).

A seed's snapshot events the mirror has not applied are compared with what it
holds first (`delta.py`, a mirror that announces CHALLENGE version 3) and sent
as DELTA events of the same seqs: only what it lacks crosses the link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable
from typing import NoReturn, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from twinmq.broker.mirror import metrics
from twinmq.broker.mirror.auth import Transcript
from twinmq.broker.mirror.delta import (
    RECONCILE_VERSION,
    Reconciler,
    ReconcileReply,
    ReconcileRequest,
    chunk_of,
    pending_snapshots,
    wire,
)
from twinmq.broker.mirror.events import KIND_DEFINITIONS, is_seed
from twinmq.broker.mirror.source import MirrorSource
from twinmq.broker.replication.handshake import new_nonce
from twinmq.broker.replication.link import FrameReader
from twinmq.broker.replication.protocol import (
    Challenge,
    FrameType,
    Hello,
    ProtocolError,
    Refuse,
    Welcome,
    decode_model,
    decode_u64,
    encode,
    encode_batch,
)
from twinmq.broker.tasks import cancel_and_wait
from twinmq.broker.tls import MutualTls

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
SILENCE = 15.0  # no frame (not even a PING) for this long: the link is dead
PING_EVERY = 1.0


class Heartbeat(BaseModel):
    """A PING's payload on the mirror link, echoed by the mirror as received."""

    n: int  # the source's counter: which beat an echo answers
    sent: float  # the source's clock (round trip = its own clock's difference)
    head: int  # the source's newest event
    backlog: int  # events not yet acknowledged by the mirror
    epoch: int  # the source's DR epoch


P = TypeVar("P", bound=BaseModel)


class MirrorBeat(BaseModel):
    """The mirror's own PING's payload (while idle): whether it applies events now."""

    model_config = ConfigDict(extra="forbid")  # never mistaken for an echoed Heartbeat

    blocked: str | None = None  # its resource alarm (disk, memory): it applies nothing


def _ping_payload(model: type[P], payload: bytes) -> P | None:
    """A PING's payload as `model`, or None (a bare PING, or another kind of payload)."""
    if not payload:
        return None
    try:
        return model.model_validate_json(payload)
    except ValidationError:
        return None


def decode_heartbeat(payload: bytes) -> Heartbeat | None:
    """A PING's heartbeat, or None for a bare PING (or one that is not a heartbeat)."""
    return _ping_payload(Heartbeat, payload)


def decode_mirror_beat(payload: bytes) -> MirrorBeat | None:
    """A mirror's PING payload, or None (a bare PING from an older mirror)."""
    return _ping_payload(MirrorBeat, payload)


def _seed_ahead(events: list[tuple[int, bytes]]) -> bool:
    """Whether a seed heads `events` (the queue after the mirror's mark): its SEED event
    before any event that is not part of a seed."""
    for _seq, body in events:
        if is_seed(body):
            return True
        if not body or body[0] != KIND_DEFINITIONS:
            return False
    return False


class MirrorLink:
    """Keeps one mirror link up while this broker is active."""

    def __init__(
        self,
        source: MirrorSource,
        address: str,
        key: str,
        origin: str,
        *,
        retry: float = 2.0,
        window_events: int = 4096,
        window_bytes: int = 16 * 1024 * 1024,
        epoch: Callable[[], int] = lambda: 0,
        on_fenced: Callable[[int, str], None] | None = None,
        expected_peer: Callable[[], str | None] = lambda: None,
        on_gap: Callable[[str], object] = lambda reason: None,
        tls: MutualTls | None = None,
        server_name: str | None = None,
        marks: Callable[[], dict[str, int]] = dict,
        target: str | None = None,
    ) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port = host or "127.0.0.1", int(port)
        self.address = address
        self.source = source
        self.key = key
        self.origin = origin
        self.retry = retry
        self.window_events = window_events
        self.window_bytes = window_bytes
        self.epoch = epoch
        self.on_fenced = on_fenced
        self.expected_peer = expected_peer
        self.on_gap = on_gap
        self.tls = tls  # mutual TLS: this site's certificate, the mirror's CA
        self.server_name = server_name or self.host  # what the mirror's certificate names
        self.marks = marks  # this site's applied marks per origin (its listener's)
        # A full mesh: the target this link serves (its own cursor on the source's one
        # queue, `MirrorSource.cursor`); None: the site's one mirror.
        self.target = target
        self.peer: str | None = None  # the mirror's name, as its last CHALLENGE said
        self._mirror_version = 0  # the mirror's CHALLENGE version (3: it answers RECONCILE)
        self._delta: dict[int, bytes] = {}  # seq -> a snapshot event as its DELTA event
        self.connected = False
        self.last_error: str | None = None
        self.round_trip: float | None = None  # the last heartbeat's, seconds
        self.heartbeat_at: float | None = None  # monotonic time its echo came back
        self.mirror_blocked: str | None = None  # the mirror applies nothing: its alarm
        self._beats = 0
        self._wake = asyncio.Event()
        if target is None:
            source.on_change = self._wake.set
        else:
            source.watchers.append(self._wake.set)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start connecting (and reconnecting) in the background."""
        name = "twinmq-mirror-link" if self.target is None else f"twinmq-mirror-link-{self.target}"
        self._task = asyncio.get_running_loop().create_task(self.run(), name=name)

    async def stop(self) -> None:
        """Close the link."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._set_connected(False)

    def heartbeat_age(self) -> float | None:
        """Seconds since the last heartbeat round trip completed (None: never)."""
        return None if self.heartbeat_at is None else time.monotonic() - self.heartbeat_at

    async def run(self) -> None:
        """Connect while active; after any failure wait `retry` seconds and connect again."""
        while True:
            if self.source.ensure_active():
                try:
                    await self._session()
                except ssl.SSLError as exc:
                    # The mirror's certificate failed verification (another CA, another
                    # name), it refused ours, or it speaks no TLS: nothing is sent, the
                    # backlog is kept until the two sites agree. (An EOF is a hang-up.)
                    if not isinstance(exc, ssl.SSLEOFError):
                        metrics.REFUSED.labels("certificate").inc()
                    why = f"TLS handshake failed: {exc}"
                    if self.last_error != why:
                        log.warning("mirror link to %s: %s", self.address, why)
                    self.last_error = why
                except (OSError, ConnectionError, ProtocolError, TimeoutError, RuntimeError) as exc:
                    # RuntimeError: uvloop refuses a write to a transport the mirror (or a
                    # cut in between) just reset; the link is down, not broken.
                    if self.last_error != str(exc):
                        log.warning("mirror link to %s: %s", self.address, exc)
                    self.last_error = str(exc)
                except Exception as exc:  # a bug must not stop the link for good: retry
                    log.exception("mirror link to %s failed", self.address)
                    self.last_error = f"{type(exc).__name__}: {exc}"
                finally:
                    self._set_connected(False)
            await asyncio.sleep(self.retry)

    def _set_connected(self, connected: bool) -> None:
        if not connected:
            self.mirror_blocked = None
        if connected != self.connected:
            log.info("mirror link to %s %s", self.address, "up" if connected else "down")
        self.connected = connected
        if self.target is None:
            metrics.CONNECTED.set(1 if connected else 0)
        else:
            metrics.TARGET_CONNECTED.labels(self.target).set(1 if connected else 0)

    async def _session(self) -> None:
        resync = self.source.target_resync.get(self.target) if self.target is not None else None
        if resync is not None:
            # Its backlog is no longer kept: nothing is sent until it is re-seeded.
            raise ConnectionError(f"NeedsResync: {resync}")
        tls = self.tls.client if self.tls is not None else None
        async with asyncio.timeout(HANDSHAKE_TIMEOUT):
            reader, writer = await asyncio.open_connection(
                self.host, self.port, ssl=tls,
                server_hostname=self.server_name if tls is not None else None,
            )  # fmt: skip
        try:
            frames = FrameReader(reader, f"mirror {self.address}")
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                applied, peer = await self._authenticate(frames, writer)
            if not self.source.ensure_active():
                return
            self.peer = peer
            if self.target is not None:
                self.source.target_peers[self.target] = peer  # journaled with its cursor
            else:
                self.source.peer = peer  # a bidirectional site forwards nothing back to it
            foreign = self.source.foreign(applied, peer)
            if foreign is not None:
                raise ConnectionError(foreign)  # never stream what the mirror would skip
            gap = self.source.gap(applied, peer, self.expected_peer(), self.target)
            if gap is not None:
                self.on_gap(gap)  # a seed: every event the mirror lacks is rebuilt by it
                # Its batch may fail (a full disk: the seed withdrawn, `batch_failed`), and
                # streaming on would skip what the mirror lacks. Once the seed's batch is
                # settled, a gap still there ends the session: the next one seeds again.
                await self._settled(self.source.head)
                again = self.source.gap(applied, peer, self.expected_peer(), self.target)
                if again is not None:
                    raise ConnectionError(f"the seed for the gap failed: {again}")
            self.source.acked(applied, self.target)
            self._delta = await self._reconcile(frames, writer, applied)
            self.last_error = None
            sender = asyncio.get_running_loop().create_task(self._send(writer, applied))
            try:
                await self._receive(frames)
            finally:
                await cancel_and_wait(sender)
        finally:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    async def _authenticate(
        self, frames: FrameReader, writer: asyncio.StreamWriter
    ) -> tuple[int, str]:
        """The handshake; returns the mirror's applied mark for this origin and its name."""
        try:
            ftype, payload = await frames.next()
        except ConnectionError as exc:
            if self.tls is None:
                # A mirror that requires mutual TLS waits for a TLS hello and closes at its
                # deadline: say so (the events stay queued here until both sites agree).
                raise ConnectionError(f"{exc} before its CHALLENGE: does the mirror require "
                                      "mutual TLS (--mirror-tls-*)?") from exc  # fmt: skip
            raise
        if ftype is not FrameType.CHALLENGE:
            raise ProtocolError(f"expected CHALLENGE, got {ftype.name}")
        challenge = decode_model(Challenge, payload)
        self._mirror_version = challenge.version
        nonce = new_nonce()
        transcript = Transcript(challenge.name, self.origin, challenge.nonce, nonce)
        hello = Hello(
            name=self.origin,
            epoch=self.epoch(),
            nonce=nonce,
            proof=transcript.proof(self.key, "source"),
        )
        writer.write(encode(FrameType.HELLO, hello))
        ftype, payload = await frames.next()
        if ftype is FrameType.REFUSE:  # not proven by the mirror: never fences
            raise ConnectionError(f"refused: {decode_model(Refuse, payload).reason}")
        if ftype is not FrameType.WELCOME:
            raise ProtocolError(f"expected WELCOME, got {ftype.name}")
        why = transcript.refusal(self.key, decode_model(Welcome, payload).proof, "mirror")
        if why is not None:
            raise ProtocolError(f"the mirror did not prove itself: {why}")
        frames.authenticated()
        ftype, payload = await frames.next()
        if ftype is FrameType.REFUSE:
            self._refused(decode_model(Refuse, payload))
        if ftype is not FrameType.ACK:
            raise ProtocolError(f"expected ACK, got {ftype.name}")
        return decode_u64(payload), challenge.name

    async def _send(self, writer: asyncio.StreamWriter, after: int) -> None:
        """Stream sendable events, within the window; PING when idle."""
        inflight: deque[tuple[int, int]] = deque()  # (seq, bytes) sent, not acknowledged
        inflight_bytes = 0
        sent = after
        loop = asyncio.get_running_loop()
        writer.write(self._heartbeat())  # "connected" waits for its echo
        last_beat = loop.time()
        while True:
            if not self.source.active:
                raise ConnectionError("this broker is no longer active")
            if self.target is not None and self.target in self.source.target_resync:
                raise ConnectionError(f"NeedsResync: {self.source.target_resync[self.target]}")
            acked = self.source.cursor(self.target)
            while inflight and inflight[0][0] <= acked:
                inflight_bytes -= inflight.popleft()[1]
            sent = max(sent, acked)
            room = self.window_events - len(inflight)
            events = []
            if room > 0 and inflight_bytes < self.window_bytes:
                events = self.source.sendable(
                    sent, room, self.window_bytes - inflight_bytes, self.target
                )
            if events:
                if self._delta:
                    events = self._as_delta(events)
                before = inflight_bytes
                for seq, body in events:
                    writer.write(encode_batch(seq, 0, body))
                    inflight.append((seq, len(body)))
                    inflight_bytes += len(body)
                sent = events[-1][0]
                metrics.SENT.inc(len(events))
                metrics.SENT_BYTES.inc(inflight_bytes - before)
                await writer.drain()
                if loop.time() - last_beat >= PING_EVERY:
                    writer.write(self._heartbeat())  # also under load: lag is visible
                    last_beat = loop.time()
                continue
            self._wake.clear()
            if loop.time() - last_beat >= PING_EVERY:
                writer.write(self._heartbeat())
                await writer.drain()
                last_beat = loop.time()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PING_EVERY):
                    await self._wake.wait()

    def _as_delta(self, events: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Snapshot events the mirror compared this session, as their DELTA events."""
        delta = self._delta
        return [(seq, delta.pop(seq, body)) for seq, body in events]

    async def _reconcile(
        self, frames: FrameReader, writer: asyncio.StreamWriter, applied: int
    ) -> dict[int, bytes]:
        """Compare the seed's snapshot events after `applied` with what the mirror holds
        (`delta.py`); each one as the DELTA event to send instead, by seq."""
        source = self.source
        if self._mirror_version < RECONCILE_VERSION or source.ids is not None:
            return {}  # an older mirror, or a bidirectional site (no snapshot events)
        await self._settled(source.head)
        durable = source.durable_seq
        events = [
            (e.message.mid, e.message.body)
            for e in source.queue.entries
            if applied < e.message.mid <= durable
        ]
        pending = pending_snapshots(events)
        if not pending and not _seed_ahead(events):
            return {}
        chunks = []
        for seq, body in pending:
            chunks.append(chunk_of(seq, body))
            await asyncio.sleep(0)  # a million messages to read: clients get turns between
        marks = self.marks()
        if self.peer is not None:
            # No mark of the mirror's own origin: this site applied none of its events
            # (forced before it ever heard from it). Said as 0, so a fenced old source
            # counts and drops its whole backlog; without a mark it kept it, and a
            # failback replayed it here: messages it had orphaned came back live.
            marks.setdefault(self.peer, 0)
        reconciler = Reconciler(chunks, marks)
        exchanged = 0
        request = reconciler.request()
        if request is None and marks:
            # A seed without a snapshot event (this site holds no durable queue): nothing
            # to compare, but the marks are said all the same. Without them an old source
            # fenced by this site's forced promotion counted nothing lost, though its
            # confirmed messages never reached this site.
            request = ReconcileRequest(probes=[], marks=marks)
        while request is not None:
            frame = encode(FrameType.RECONCILE, wire(request))
            writer.write(frame)
            await writer.drain()
            payload = await self._reconcile_reply(frames)
            exchanged += len(frame) + len(payload) + 5
            try:
                reconciler.answered(decode_model(ReconcileReply, payload))
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            request = reconciler.request()
        metrics.RECONCILE_BYTES.inc(exchanged)
        skipped = reconciler.skipped()
        metrics.SEED_SKIPPED.inc(skipped)
        delta = reconciler.bodies()
        log.info("mirror link to %s: the seed's %d snapshot events compared in %d round "
                 "trips (%d bytes): %d messages held there already, %d to send",
                 self.address, len(chunks), reconciler.rounds, exchanged, skipped,
                 sum(len(c.send) for c in chunks))  # fmt: skip
        return delta

    async def _settled(self, newest: int) -> None:
        """Wait until every event up to `newest` is complete (or withdrawn). A seed queued
        as the session began (the first activation, a gap's re-seed) is still in its group
        commit: streamed without its comparison, the mirror would get it whole and an old
        source fenced by a forced failover would never count what it lost (the marks ride
        on the comparison: docs/mirror.md, "DR failover")."""
        async with asyncio.timeout(HANDSHAKE_TIMEOUT):
            while not self.source.settled_through(newest):
                self._wake.clear()
                await self._wake.wait()

    async def _reconcile_reply(self, frames: FrameReader) -> bytes:
        """The mirror's RECONCILE answer (its idle PINGs on the way are skipped)."""
        while True:
            ftype, payload = await frames.next(SILENCE)
            if ftype is FrameType.RECONCILE:
                return payload
            if ftype is FrameType.REFUSE:
                self._refused(decode_model(Refuse, payload))
            if ftype is not FrameType.PING:
                raise ProtocolError(f"expected RECONCILE, got {ftype.name}")

    def _heartbeat(self) -> bytes:
        """The next heartbeat's PING frame."""
        self._beats += 1
        beat = Heartbeat(
            n=self._beats,
            sent=time.monotonic(),
            head=self.source.head,
            backlog=self.source.backlog(self.target),
            epoch=self.epoch(),
        )
        return encode(FrameType.PING, beat)

    def _refused(self, refuse: Refuse) -> NoReturn:
        """An authenticated REFUSE: fenced if it comes from a site at a higher DR epoch;
        then closed."""
        if refuse.epoch > self.epoch() and self.on_fenced is not None:
            self.on_fenced(refuse.epoch, refuse.reason)
        raise ConnectionError(f"refused: {refuse.reason}")

    async def _receive(self, frames: FrameReader) -> None:
        """ACKs trim the queue and open the window; silence or a REFUSE ends the session."""
        while True:
            ftype, payload = await frames.next(SILENCE)
            if not self.source.active:
                raise ConnectionError("this broker is no longer active")
            if ftype is FrameType.ACK:
                self.source.acked(decode_u64(payload), self.target)
                self.mirror_blocked = None  # it applies again
                self._wake.set()
            elif ftype is FrameType.REFUSE:
                self._refused(decode_model(Refuse, payload))
            elif ftype is FrameType.PING:
                beat = decode_heartbeat(payload)
                own = decode_mirror_beat(payload) if beat is None else None
                if own is not None:
                    if own.blocked != self.mirror_blocked:
                        log.warning("mirror link to %s: the mirror %s", self.address,
                                    f"applies nothing: {own.blocked} alarm" if own.blocked
                                    else "applies again")  # fmt: skip
                    self.mirror_blocked = own.blocked
                elif beat is not None and beat.n <= self._beats:
                    now = time.monotonic()
                    self.round_trip = now - beat.sent
                    self.heartbeat_at = now
                    self._set_connected(True)  # a verified round trip
            else:
                raise ProtocolError(f"unexpected {ftype.name} from the mirror")
