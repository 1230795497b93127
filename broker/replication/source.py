"""The active broker's end of the replication link.

A passive connects; both prove they know the shared token (`handshake.py`),
within one deadline and with small frames only, before anything either says
is acted upon; at most `replication_max_connections` connections are served
at once. The passive sends its snapshot; in
one step of the event loop (no await in between) the active closes its open
batch, captures what the catch-up must compare, and from then on streams every
batch it journals, while the catch-up streams alongside in bounded chunks
(`catchup.py`). A passive still catching up holds up no confirm; once it has
every chunk on its disk it is in sync, and from then on its acknowledgements
complete batches (delayed completion). A passive that stops acknowledging for
`replication_timeout` seconds is dropped and the active goes on alone, degraded;
one still catching up also progresses while its link delivers bytes and it pings
(a thin link carries less than a chunk per timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Awaitable, Sequence

from twinmq.broker import metrics
from twinmq.broker.definitions import Definitions, DefinitionsDelta
from twinmq.broker.journal import JournalOp, encode_ops
from twinmq.broker.replication.catchup import CatchupSender, CatchupStream, capture
from twinmq.broker.replication.context import ReplicationContext
from twinmq.broker.replication.delivery import DeliveryMeter
from twinmq.broker.replication.handshake import new_nonce, transcript_proof, verify
from twinmq.broker.replication.link import FrameReader
from twinmq.broker.replication.peer import certificate_refusal
from twinmq.broker.replication.protocol import (
    BATCH_HEAD_BYTES,
    MAX_FRAME,
    PROTOCOL_VERSION,
    WITHDRAW_FORGET,
    Challenge,
    FrameType,
    Hello,
    ProtocolError,
    Refuse,
    Snapshot,
    Welcome,
    decode_model,
    decode_u64,
    encode,
    encode_batch,
    encode_key,
    encode_u64,
)
from twinmq.broker.tls import identity_refusal, report_refused_handshakes

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0  # per frame, once the passive is authenticated (its snapshot)
PING_INTERVAL = 1.0
ALONE_RETRY = 0.5  # seconds between attempts to mark the Lease before going on alone
REFUSAL_LOG_INTERVAL = 5.0  # seconds between log lines about connections over the cap


class SourceLink:
    """One attached passive: catching up, then in sync."""

    def __init__(
        self,
        peer: str,
        name: str,
        writer: asyncio.StreamWriter,
        start: int,
        *,
        withdrawals: bool = False,
        withdrawal_keys: bool = False,
    ) -> None:
        self.peer = peer
        self.name = name
        self.withdrawals = withdrawals  # the passive takes WITHDRAW frames
        self.withdrawal_keys = withdrawal_keys  # ... and forgets WITHDRAW_FORGET's keys
        self.writer = writer
        self.start_batch = start  # batches up to this one reach the passive by the catch-up
        self.catchup: CatchupSender | None = None
        # In sync: every catch-up chunk is on the passive's disk, its acknowledgements
        # complete batches (the guard), and it is ready once it has acknowledged the
        # live batch named in CAUGHT_UP (what the active confirmed alone meanwhile).
        self.in_sync = False
        self.caught_up_batch: int | None = None
        self.live_sent = 0  # the newest live batch sent
        self.acked = 0
        self.ready = False
        self.closed = False
        self.attached_at = time.time()
        self.last_progress = time.monotonic()
        self.last_echo = 0.0  # time.monotonic() of the last ping echoed to the passive
        self.last_heard = time.monotonic()  # of the passive's last ping: it runs
        self.meter = DeliveryMeter(writer.transport)
        self._delivered = 0  # the meter's count at the last look
        self.sent_batches: list[tuple[int, int, float]] = []  # (batch, ops, sent at)
        # The newest WITHDRAW sent and not yet acknowledged (0: none): outstanding too,
        # so a passive that stops answering is dropped even when no batch follows it.
        self.withdrawal_sent = 0

    def write(self, data: bytes) -> bool:
        """Send to the passive; False once the link is gone.

        The peer may have reset the connection before our reader noticed: a
        closed transport raises on write (uvloop), and that must not escape
        into group commit, a topology change or the ping loop.
        """
        if self.closed or self.writer.transport.is_closing():
            return False
        self.writer.write(data)
        self.meter.wrote(len(data))
        return True

    def drain(self) -> Awaitable[None]:
        """Wait for the transport's write buffer to drain below its high-water mark."""
        return self.writer.drain()

    @property
    def outstanding(self) -> bool:
        """Live batches or catch-up chunks sent and not yet acknowledged."""
        return (
            bool(self.sent_batches)
            or bool(self.withdrawal_sent)
            or (self.catchup is not None and self.catchup.unacked)
        )

    def send_batch(self, batch: int, ops: list[JournalOp]) -> None:
        """Stream one journaled batch."""
        if self.closed or self.writer.transport.is_closing():
            return
        if not self.outstanding:
            self.last_progress = time.monotonic()  # the clock for a stall starts now
        if self.catchup is not None and not self.catchup.done:
            ops = self.catchup.filter_live(ops)
        buf = bytearray()
        encode_ops(ops, buf)
        self.write(encode_batch(batch, 0, buf))
        self.live_sent = batch
        self.sent_batches.append((batch, len(ops), time.time()))

    def send_withdrawal(self, batch: int, ops: list[JournalOp], keys: Sequence[str] = ()) -> bool:
        """Stream the ops that take failed batch `batch` out of the passive again, after
        the dedup keys of its publishes to forget (if any); False (nothing sent) if
        either does not fit in one frame.

        A withdrawal is one frame, and it can be large: an undone ack stores its message
        again, body and all, and a failed retention drop or re-seed of the DR mirror puts
        its whole backlog back. Over `MAX_FRAME` the passive's reader would refuse it
        (the link resets); over 4 GiB its length would not even pack.
        """
        buf = bytearray()
        encode_ops(ops, buf)
        forget = bytearray()
        for key in keys:
            encode_key(forget, key)
        if max(len(buf), len(forget)) + BATCH_HEAD_BYTES > MAX_FRAME:
            return False
        if not self.outstanding:
            self.last_progress = time.monotonic()  # the clock for a stall starts now
        if keys:
            self.write(encode_batch(batch, WITHDRAW_FORGET, forget, FrameType.WITHDRAW))
        self.write(encode_batch(batch, 0, buf, FrameType.WITHDRAW))
        self.withdrawal_sent = batch
        return True

    def on_withdrawn(self, batch: int) -> None:
        """The passive has the withdrawal of failed batch `batch` (and earlier) on disk."""
        self.last_progress = time.monotonic()
        if batch >= self.withdrawal_sent:
            self.withdrawal_sent = 0

    def echo(self, payload: bytes, timeout: float) -> None:
        """Answer the passive's ping: it renews the passive's readiness (its lease).

        Not while the passive lags half a timeout behind: its lease must run
        out before we may go on alone (check_stall waits `timeout` after the
        last echo too).
        """
        now = time.monotonic()
        lagging = self.outstanding and now - self.last_progress > timeout / 2
        if self.closed or lagging:
            return
        self.last_echo = now
        self.write(encode(FrameType.PING, payload))

    def send_definitions(self, definitions: Definitions) -> None:
        """Stream a topology change, whole (a passive that does not take deltas)."""
        self.write(encode(FrameType.DEFINITIONS, definitions))

    def send_delta(self, delta: DefinitionsDelta) -> None:
        """Stream a topology change as the change alone."""
        self.write(encode(FrameType.DEFINITIONS_DELTA, delta))

    def on_ack(self, batch: int) -> None:
        """The passive has every live batch up to `batch` on disk."""
        self.acked = max(self.acked, batch)
        self.last_progress = time.monotonic()
        while self.sent_batches and self.sent_batches[0][0] <= batch:
            self.sent_batches.pop(0)
        self._check_ready()

    def note_delivery(self) -> None:
        """While catching up, a link that moves is progress, as long as the passive runs.

        A chunk is acknowledged only once all of it is on the passive's disk: on a
        link thinner than a chunk per timeout the acknowledgements come too far
        apart, while the passive takes bytes all along. Bytes delivered since the
        last look move the stall clock to the passive's last ping (not to now): a
        passive that stops (SIGSTOP) pings no more, its kernel's buffers may still
        take bytes for a while, but it is dropped `replication_timeout` after its
        last ping all the same; a cut link moves nothing. An in-sync passive holds
        up confirms: only its acknowledgements count.
        """
        if self.in_sync or self.closed:
            return
        delivered = self.meter.delivered()
        if delivered > self._delivered:
            self._delivered = delivered
            self.last_progress = max(self.last_progress, self.last_heard)

    def on_catchup_ack(self, chunk: int) -> None:
        """The passive has every catch-up chunk up to `chunk` on disk."""
        self.last_progress = time.monotonic()
        if self.catchup is not None:
            self.catchup.on_ack(chunk)

    def synced(self) -> int:
        """The catch-up is complete: from now on this passive guards; returns CAUGHT_UP's batch."""
        self.in_sync = True
        self.caught_up_batch = self.live_sent
        self._check_ready()
        return self.caught_up_batch

    def _check_ready(self) -> None:
        if self.ready or self.caught_up_batch is None or self.acked < self.caught_up_batch:
            return
        self.ready = True
        log.info(
            "passive %s (%s) ready at batch %d, %.2fs after attaching",
            self.name, self.peer, self.acked, time.time() - self.attached_at,
        )  # fmt: skip

    @property
    def lag_messages(self) -> int:
        """Ops sent but not yet acknowledged."""
        return sum(n for _, n, _ in self.sent_batches)

    @property
    def lag_seconds(self) -> float:
        """Age of the oldest unacknowledged batch."""
        return time.time() - self.sent_batches[0][2] if self.sent_batches else 0.0

    def close(self, refuse: Refuse | None = None) -> None:
        """Drop the connection; with `refuse`, tell the passive why (after what is queued)."""
        if self.catchup is not None:
            self.catchup.cancel()
        if not self.closed:
            if refuse is None or not self.write(encode(FrameType.REFUSE, refuse)):
                self.writer.transport.abort()
            else:
                self.writer.close()
            self.closed = True


class ReplicationSource:
    """Accepts passives on the replication port while this broker is active."""

    def __init__(self, broker: ReplicationContext) -> None:
        self.broker = broker
        self.link: SourceLink | None = None
        self.degraded_since: float | None = None
        self._degrade_timer: asyncio.TimerHandle | None = None
        self._marking: asyncio.Task[None] | None = None  # writing `alone` into the Lease
        self._server: asyncio.AbstractServer | None = None
        self._connections = 0  # open replication connections, authenticated or not
        self._over_cap = 0  # connections closed over the cap since the last log line
        self._over_cap_logged = 0.0  # time.monotonic() of that line

    async def start(self, host: str, port: int) -> asyncio.AbstractServer:
        """Listen for passives (over mutual TLS with --replication-tls-*, unless the
        listener is still plaintext: `plain-listener`, a step of moving a running pair to
        mutual TLS). The listener does the TLS handshake: a passive's certificate is
        verified before `_handle` runs, and a refused one counted and logged."""
        tls = self.broker.replication_tls
        if tls is None or self.broker.settings.replication_tls_mode == "plain-listener":
            self._server = await asyncio.start_server(self._handle, host, port, reuse_address=True)
            return self._server
        report_refused_handshakes(tls.context, _refused_handshake)
        self._server = await asyncio.start_server(
            self._handle, host, port, reuse_address=True, ssl=tls.context,
            ssl_handshake_timeout=self.broker.settings.replication_handshake_timeout,
        )  # fmt: skip
        return self._server

    def detach(self, reason: str) -> None:
        """Drop the passive (this broker steps down, or shuts down)."""
        if self.link is not None:
            log.info("dropping passive %s: %s", self.link.name, reason)
            self._unhook(self.link)
            self.link.close()
            self.link = None
        self.broker.committer.guard(False)
        self._cancel_degrade()

    def withdraw(self, batch: int, ops: list[JournalOp], keys: Sequence[str] = ()) -> bool:
        """Failed batch `batch` was streamed: make the passive drop it (`ops` undo it,
        `keys`: the dedup keys of its publishes, which the passive forgets).

        Returns whether its outcome must wait (`GroupCommitter.withdrawn`): while the
        passive guards, it may be promoted holding the batch. An in-sync passive gets
        the ops in a WITHDRAW frame, ahead of any later batch, and acknowledges them
        once durable (WITHDRAWN). One catching up (or of an older version) is made to
        catch up again (`resync`); then the next passive in sync holds what this broker
        holds; so is an in-sync one whose withdrawal would not fit in one frame, and
        one that would not forget the keys (a discard alone misses the key of a
        message a later batch already took off the passive: a purge, an expiry). No
        link: the one that comes back catches up the same way, or the active goes on
        alone (the Lease marked first: the passive is not promotable); either ends the
        wait.
        """
        if not ops and not keys:
            return False  # nothing a client was told of is left on the passive
        link = self.link
        if link is not None and not link.closed:
            if link.in_sync and link.withdrawals and (link.withdrawal_keys or not keys):
                log.warning(
                    "batch %d failed here after it was streamed: withdrawing %d ops from %s",
                    batch, len(ops), link.name,
                )  # fmt: skip
                if not link.send_withdrawal(batch, ops, keys if link.withdrawal_keys else ()):
                    self.resync(f"the withdrawal of failed batch {batch} exceeds a frame")
            else:
                self.resync(f"batch {batch} failed here after it was streamed")
        return self.broker.committer.guarded

    def resync(self, reason: str) -> None:
        """Make the passive catch up again: what it was streamed is not what we hold.

        A batch is streamed before its write; if the write fails here, the active
        withdraws its messages and undoes its acks (visibility.py) while the
        passive applied them. Dropping the link (guarding on, as for any lost link)
        makes the passive reconnect; its catch-up discards what the active does not
        hold and sends what it lacks, so nothing of the failed batch stays accepted
        (a passive that takes no WITHDRAW frames, or one still catching up).
        """
        link = self.link
        if link is not None and not link.closed:
            log.warning("replication link to %s reset: %s", link.name, reason)
            self._lost(link, degrade_now=False)

    def check_stall(self) -> None:
        """Drop a passive that has not acknowledged for `replication_timeout` seconds.

        One still catching up counts as progressing while its link delivers bytes
        and it pings (`SourceLink.note_delivery`).
        """
        link = self.link
        if link is None or link.closed:
            return
        if not link.outstanding:
            return
        link.note_delivery()
        stalled = time.monotonic() - max(link.last_progress, link.last_echo)
        if stalled > self.broker.settings.replication_timeout:
            log.warning(
                "passive %s stalled for %.1fs with %d ops unacknowledged%s: continuing alone",
                link.name, stalled, link.lag_messages, "" if link.in_sync else " (catching up)",
            )  # fmt: skip
            # Told so, a paused passive that runs again knows it is no longer ready.
            link.close(Refuse(reason="stalled: the active goes on alone", epoch=self.broker.epoch))
            # One still catching up held up nothing: a degrade timer still running for a
            # lost in-sync link (the passive's lease) runs out on its own.
            self._lost(link, degrade_now=link.in_sync)

    def _unhook(self, link: SourceLink) -> None:
        committer = self.broker.committer
        if committer.on_batch == link.send_batch:
            committer.on_batch = None
        vhost = self.broker.vhost
        if vhost.on_topology_change == link.send_definitions:
            vhost.on_topology_change = None
        if vhost.on_topology_delta == link.send_delta:
            vhost.on_topology_delta = None

    def _lost(self, link: SourceLink, *, degrade_now: bool) -> None:
        """The link is gone: keep guarding for the timeout (it may come back), then degrade."""
        self._unhook(link)
        link.close()
        if self.link is not link:
            return
        self.link = None
        metrics.REPLICATION_CONNECTED.set(0)
        if degrade_now:
            self._degrade()
            return
        if not link.in_sync:
            # It guarded nothing: confirms go on as before (alone, or held until a timer
            # for an earlier in-sync link runs out). A reconnect loop extends nothing.
            log.info("replication link to %s lost during its catch-up", link.name)
            return
        timeout = self.broker.settings.replication_timeout
        log.warning(
            "replication link to %s lost: waiting %.1fs for it to return", link.name, timeout
        )
        self._cancel_degrade()
        self._degrade_timer = asyncio.get_running_loop().call_later(timeout, self._degrade)

    def _degrade(self) -> None:
        self._degrade_timer = None
        if self.link is not None and self.link.in_sync:
            return
        lease = self.broker.lease
        if lease is None or not self.broker.committer.guarded:
            self._go_alone()
        elif self._marking is None or self._marking.done():
            # The Lease says so first (its replication guard), or confirms stay held.
            self._marking = asyncio.get_running_loop().create_task(self._mark_then_go_alone())

    async def _mark_then_go_alone(self) -> None:
        lease = self.broker.lease
        assert lease is not None
        while self.broker.role == "active" and not (self.link and self.link.in_sync):
            if await lease.record_alone():
                if self.link is None or not self.link.in_sync:  # (not back meanwhile)
                    self._go_alone()
                return
            await asyncio.sleep(ALONE_RETRY)

    def _go_alone(self) -> None:
        if self.broker.committer.guarded:
            log.warning("no passive in sync: confirms now wait for the local disk only (degraded)")
        self.broker.committer.guard(False)
        self.degraded_since = time.time()
        metrics.REPLICATION_DEGRADED.set(1)

    def _cancel_degrade(self) -> None:
        if self._degrade_timer is not None:
            self._degrade_timer.cancel()
            self._degrade_timer = None

    def _refuse_over_cap(self, peer: str, writer: asyncio.StreamWriter) -> None:
        """Close a connection over the cap at once; one log line per interval, with a count."""
        writer.transport.abort()
        metrics.REPLICATION_REFUSED.labels("over-cap").inc()
        self._over_cap += 1
        now = time.monotonic()
        if now - self._over_cap_logged >= REFUSAL_LOG_INTERVAL:
            log.warning(
                "replication connection from %s closed at once: %d connections open, the cap "
                "(replication_max_connections); %d closed over the cap since the last such line",
                peer, self._connections, self._over_cap,
            )  # fmt: skip
            self._over_cap = 0
            self._over_cap_logged = now

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        peer_text = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if self._connections >= self.broker.settings.replication_max_connections:
            self._refuse_over_cap(peer_text, writer)
            return
        self._connections += 1
        frames = FrameReader(reader, f"passive {peer_text}")
        link: SourceLink | None = None
        try:
            link = await self._handshake(peer_text, frames, writer)
            if link is None:
                return
            while True:
                ftype, payload = await frames.next()
                if ftype is FrameType.ACK:
                    batch = decode_u64(payload)
                    link.on_ack(batch)
                    if link.in_sync:
                        # Only an in-sync passive completes batches: one catching up may
                        # acknowledge live batches before it holds what they build on.
                        self.broker.committer.replica_acked(batch)
                    if link.ready:
                        self._cancel_degrade()
                        self.degraded_since = None
                        metrics.REPLICATION_DEGRADED.set(0)
                elif ftype is FrameType.WITHDRAWN:
                    withdrawn = decode_u64(payload)
                    link.on_withdrawn(withdrawn)
                    if link.in_sync:
                        self.broker.committer.withdrawn(withdrawn)
                elif ftype is FrameType.CATCHUP_ACK:
                    link.on_catchup_ack(decode_u64(payload))
                elif ftype is FrameType.REFUSE:
                    refuse = Refuse.model_validate_json(payload)
                    log.warning("passive %s refused the link: %s", peer_text, refuse.reason)
                    self.broker.learn_epoch(refuse.epoch, f"passive {link.name} ({peer_text})")
                    return
                elif ftype is FrameType.PING:
                    link.last_heard = time.monotonic()
                    if payload:
                        link.echo(payload, self.broker.settings.replication_timeout)
                else:
                    raise ProtocolError(f"unexpected {ftype.name} from a passive")
        except (TimeoutError, ConnectionError, ProtocolError, ValueError, RuntimeError) as exc:
            # RuntimeError: uvloop refuses a write to a transport the passive just reset.
            log.info("replication link from %s closed: %s", peer_text, exc or type(exc).__name__)
        finally:
            self._connections -= 1
            if link is not None:
                self._lost(link, degrade_now=False)
            with contextlib.suppress(Exception):
                writer.close()

    async def _authenticate(
        self, peer: str, frames: FrameReader, writer: asyncio.StreamWriter
    ) -> Hello | None:
        """CHALLENGE, HELLO, WELCOME within one deadline; the proven hello, or None (closed).

        Nothing the peer says changes anything here before its proof is
        verified; an unproven peer only ever gets a log line and a closed link.
        """
        settings = self.broker.settings
        nonce = new_nonce()
        challenge = Challenge(version=PROTOCOL_VERSION, name=settings.name, nonce=nonce)
        writer.write(encode(FrameType.CHALLENGE, challenge))
        try:
            async with asyncio.timeout(settings.replication_handshake_timeout):
                ftype, payload = await frames.next()
                hello = self._verify_hello(peer, nonce, ftype, payload)
                if hello is not None and (why := identity_refusal(writer, hello.name)):
                    metrics.REPLICATION_REFUSED.labels("certificate").inc()
                    log.warning("replication peer %s claims to be %r but %s: closed",
                                peer, hello.name, why)  # fmt: skip
                    hello = None
                if hello is not None and (
                    why := certificate_refusal(writer, settings.replication_peer_name)
                ):
                    metrics.REPLICATION_REFUSED.labels("peer").inc()
                    log.warning("replication peer %s (%r) is not the peer: %s: closed",
                                peer, hello.name, why)  # fmt: skip
                    hello = None
                if hello is None:
                    writer.write(
                        encode(FrameType.REFUSE, Refuse(reason="authentication failed", epoch=0))
                    )
                    return None
        except TimeoutError:
            metrics.REPLICATION_REFUSED.labels("handshake-timeout").inc()
            log.warning(
                "replication peer %s did not authenticate within %.1fs "
                "(replication_handshake_timeout): closed",
                peer, settings.replication_handshake_timeout,
            )  # fmt: skip
            return None
        except ProtocolError as exc:
            metrics.REPLICATION_REFUSED.labels("protocol-error").inc()
            log.warning("replication peer %s broke the handshake: %s: closed", peer, exc)
            return None
        frames.authenticated()
        return self._welcome(peer, nonce, hello, writer)

    def _verify_hello(
        self, peer: str, nonce: str, ftype: FrameType, payload: bytes
    ) -> Hello | None:
        """The first frame of a connection: a HELLO whose proof holds, or None (logged)."""
        broker = self.broker
        if ftype is FrameType.REFUSE:
            metrics.REPLICATION_REFUSED.labels("unauthenticated-refuse").inc()
            log.warning(
                "unauthenticated refusal from %s ignored (no epoch or role is taken from a "
                "peer before it proves itself): %.200r", peer, payload,
            )  # fmt: skip
            return None
        if ftype is not FrameType.HELLO:
            raise ProtocolError(f"expected HELLO, got {ftype.name}")
        hello = decode_model(Hello, payload)
        why = verify(
            broker.replication_token(), hello.proof, "passive",
            active=broker.settings.name, passive=hello.name,
            active_nonce=nonce, passive_nonce=hello.nonce, epoch=hello.epoch,
        )  # fmt: skip
        if why is not None:
            metrics.REPLICATION_REFUSED.labels("bad-proof").inc()
            log.warning(
                "replication link from %s (claims to be %r): authentication failed: %s",
                peer, hello.name, why,
            )  # fmt: skip
            return None
        return hello

    def _welcome(
        self, peer: str, nonce: str, hello: Hello, writer: asyncio.StreamWriter
    ) -> Hello | None:
        """The passive is proven: take its epoch (if plausible) and prove ourselves to it."""
        broker = self.broker
        settings = broker.settings
        token = broker.replication_token()
        assert token is not None  # verify() proves nobody without one
        if not broker.learn_epoch(hello.epoch, f"passive {hello.name} ({peer})"):
            writer.write(encode(FrameType.REFUSE, Refuse(
                reason=f"epoch {hello.epoch} refused by {settings.name} (epoch "
                f"{broker.epoch}): a jump of more than max_epoch_jump",
                epoch=broker.epoch)))  # fmt: skip
            return None
        welcome = Welcome(
            epoch=broker.epoch,
            proof=transcript_proof(
                token, "active", active=settings.name, passive=hello.name,
                active_nonce=nonce, passive_nonce=hello.nonce, epoch=broker.epoch,
            ),
        )  # fmt: skip
        writer.write(encode(FrameType.WELCOME, welcome))
        return hello

    async def _handshake(
        self, peer: str, frames: FrameReader, writer: asyncio.StreamWriter
    ) -> SourceLink | None:
        """Authenticate, take the snapshot, attach the passive (None: the link closes)."""
        broker = self.broker
        hello = await self._authenticate(peer, frames, writer)
        if hello is None:
            return None
        # The passive is proven; it proves us from the WELCOME before it sends more.
        if broker.role != "active":
            writer.write(encode(FrameType.REFUSE, Refuse(
                reason=f"{broker.settings.name} is not active (epoch {broker.epoch})",
                epoch=broker.epoch)))  # fmt: skip
            return None
        ftype, payload = await frames.next(HANDSHAKE_TIMEOUT)
        if ftype is FrameType.REFUSE:
            refuse = Refuse.model_validate_json(payload)
            log.warning("passive %s (%s) refused us: %s", hello.name, peer, refuse.reason)
            broker.learn_epoch(refuse.epoch, f"passive {hello.name} ({peer})")
            return None
        if ftype is not FrameType.SNAPSHOT:
            raise ProtocolError(f"expected SNAPSHOT, got {ftype.name}")
        snapshot = Snapshot.model_validate_json(payload)
        # From here to the end of the function nothing awaits: the snapshot, the plan
        # and the hook for live batches see one and the same state.
        if broker.role != "active":
            writer.write(encode(FrameType.REFUSE, Refuse(
                reason=f"{broker.settings.name} stepped down (epoch {broker.epoch})",
                epoch=broker.epoch)))  # fmt: skip
            return None
        committer, vhost = broker.committer, broker.vhost
        if self.link is not None:
            # Not detach(): that drops the guard, confirming what no passive has yet. Lost
            # like any link: an in-sync one leaves the guard on for the timeout.
            log.info("dropping passive %s: replaced by a new link", self.link.name)
            self._lost(self.link, degrade_now=False)
        last = committer.flush_now()
        link = SourceLink(
            peer, hello.name, writer, last,
            withdrawals=snapshot.withdrawals, withdrawal_keys=snapshot.withdrawal_keys,
        )  # fmt: skip
        stream = CatchupStream(
            capture(vhost.all_queues()),
            snapshot.ids(),
            vhost.next_mid,
            queue_exists=lambda qid: vhost.queue_by_qid(qid) is not None,
            chunk_bytes=broker.settings.catchup_chunk_bytes,
            # A damaged active (journal corruption) may lack what it confirmed: no discards.
            discard=not broker.damaged,
            # Last in the stream: the ids the passive cannot learn from messages
            # (consumed while it was away, or discarded from it now).
            window=vhost.dedup.keys,
        )
        link.catchup = CatchupSender(
            stream,
            link,
            on_done=lambda: self._in_sync(link),
            committer=committer,
            max_rate=broker.settings.catchup_max_rate,
        )
        link.write(encode(FrameType.DEFINITIONS, vhost.all_definitions()))
        self.link = link
        committer.on_batch = link.send_batch
        vhost.on_topology_change = link.send_definitions
        # A passive of an older version knows no DEFINITIONS_DELTA frame: whole ones.
        vhost.on_topology_delta = link.send_delta if snapshot.definitions_delta else None
        metrics.REPLICATION_CONNECTED.set(1)
        log.info(
            "passive %s (%s, epoch %d) attached: catch-up from batch %d over %d messages",
            hello.name, peer, hello.epoch, last, stream.progress.candidates,
        )  # fmt: skip
        link.catchup.start()
        return link

    def _in_sync(self, link: SourceLink) -> None:
        """Every catch-up chunk is on the passive's disk: it guards from now on."""
        if self.link is not link or link.closed:
            return
        committer = self.broker.committer
        caught_up = link.synced()
        committer.guard(True)
        if self._marking is not None:
            # A mark for an earlier loss: this passive now holds everything, and its
            # readiness (our echoes) lasts `replication_timeout` past its link's loss, so
            # going on alone waits for that loss's own degrade timer.
            self._marking.cancel()
            self._marking = None
        if self.broker.lease is not None:
            self.broker.lease.passive_in_sync()
        # Batches up to the catch-up's start reached the passive as chunks, later ones
        # as the live batches it acknowledged.
        committer.replica_acked(max(link.start_batch, link.acked))
        # It caught up from what this broker holds after any failed batch withdrawn
        # before it attached (one that failed since was made to catch up again,
        # `resync`, and never gets here): the withdrawals waiting end.
        committer.withdrawn()
        self._cancel_degrade()
        link.write(encode_u64(FrameType.CAUGHT_UP, caught_up))
        assert link.catchup is not None
        p = link.catchup.progress
        log.info(
            "passive %s (%s) caught up in %.2fs: catch-up sent %d messages, discarded %d, "
            "kept %d, skipped %d, %d dedup keys (%d bytes in %d chunks); replication guarded",
            link.name, link.peer, time.time() - link.attached_at, p.sent, p.discarded,
            p.kept, p.skipped, p.dedup_keys, p.bytes, p.chunks,
        )  # fmt: skip

    async def ping_loop(self) -> None:
        """Keep the link's liveness visible to the passive; drop stalled passives."""
        loop = asyncio.get_running_loop()
        while True:
            slept = loop.time()
            await asyncio.sleep(PING_INTERVAL / 2)
            link = self.link
            if link is not None and loop.time() - slept > PING_INTERVAL:
                # This broker itself did not run (SIGSTOP, a frozen host): the passive's
                # silence meanwhile is not its stall. Give it a full timeout from now.
                link.last_progress = time.monotonic()
            if link is not None:
                link.write(encode(FrameType.PING))
            self.check_stall()

    async def close(self) -> None:
        """Stop listening and drop the passive."""
        self.detach("shutdown")
        if self._server is not None:
            self._server.close()


def _refused_handshake(exc: ssl.SSLError) -> None:
    metrics.REPLICATION_REFUSED.labels("certificate").inc()
    log.warning("replication peer failed the TLS handshake: %s: closed", exc)
