"""The active broker's end of the replication link.

A passive connects; both prove they know the shared token (`handshake.py`),
within one deadline and with small frames only, before anything either says
is acted upon; at most `replication_max_connections` connections are served
at once. The passive sends its snapshot; in
one step of the event loop (no await in between) the active closes its open
batch, plans the catch-up from its live messages, and from then on streams
every batch it journals. The passive's acknowledgements complete batches
(delayed completion); a passive that stops acknowledging for
`replication_timeout` seconds is dropped and the active goes on alone, degraded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from twinmq.broker import metrics
from twinmq.broker.definitions import Definitions
from twinmq.broker.journal import JournalOp, encode_ops
from twinmq.broker.replication.catchup import plan_catchup
from twinmq.broker.replication.context import ReplicationContext
from twinmq.broker.replication.handshake import new_nonce, transcript_proof, verify
from twinmq.broker.replication.link import FrameReader
from twinmq.broker.replication.protocol import (
    BATCH_CATCHUP,
    PROTOCOL_VERSION,
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
    encode_u64,
)

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0  # per frame, once the passive is authenticated (its snapshot)
PING_INTERVAL = 1.0
REFUSAL_LOG_INTERVAL = 5.0  # seconds between log lines about connections over the cap


class SourceLink:
    """One attached passive."""

    def __init__(self, peer: str, name: str, writer: asyncio.StreamWriter, catchup: int) -> None:
        self.peer = peer
        self.name = name
        self.writer = writer
        self.catchup_batch = catchup
        self.acked = 0
        self.ready = False
        self.closed = False
        self.attached_at = time.time()
        self.last_progress = time.monotonic()
        self.last_echo = 0.0  # time.monotonic() of the last ping echoed to the passive
        self.sent_batches: list[tuple[int, int, float]] = []  # (batch, ops, sent at)

    def write(self, data: bytes) -> bool:
        """Send to the passive; False once the link is gone.

        The peer may have reset the connection before our reader noticed: a
        closed transport raises on write (uvloop), and that must not escape
        into group commit, a topology change or the ping loop.
        """
        if self.closed or self.writer.transport.is_closing():
            return False
        self.writer.write(data)
        return True

    def send_batch(self, batch: int, ops: list[JournalOp]) -> None:
        """Stream one journaled batch."""
        if self.closed or self.writer.transport.is_closing():
            return
        if self.acked >= self.sent_last():
            self.last_progress = time.monotonic()  # the clock for a stall starts now
        buf = bytearray()
        encode_ops(ops, buf)
        self.write(encode_batch(batch, 0, buf))
        self.sent_batches.append((batch, len(ops), time.time()))

    def sent_last(self) -> int:
        """The newest batch sent."""
        return self.sent_batches[-1][0] if self.sent_batches else self.catchup_batch

    def echo(self, payload: bytes, timeout: float) -> None:
        """Answer the passive's ping: it renews the passive's readiness (its lease).

        Not while the passive lags half a timeout behind: its lease must run
        out before we may go on alone (check_stall waits `timeout` after the
        last echo too).
        """
        now = time.monotonic()
        lagging = self.acked < self.sent_last() and now - self.last_progress > timeout / 2
        if self.closed or lagging:
            return
        self.last_echo = now
        self.write(encode(FrameType.PING, payload))

    def send_definitions(self, definitions: Definitions) -> None:
        """Stream a topology change."""
        self.write(encode(FrameType.DEFINITIONS, definitions))

    def on_ack(self, batch: int) -> None:
        """The passive has everything up to `batch` on disk."""
        self.acked = max(self.acked, batch)
        self.last_progress = time.monotonic()
        while self.sent_batches and self.sent_batches[0][0] <= batch:
            self.sent_batches.pop(0)
        if not self.ready and batch >= self.catchup_batch:
            self.ready = True
            log.info(
                "passive %s (%s) caught up at batch %d in %.2fs: replication guarded",
                self.name, self.peer, batch, time.time() - self.attached_at,
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
        self._server: asyncio.AbstractServer | None = None
        self._connections = 0  # open replication connections, authenticated or not
        self._over_cap = 0  # connections closed over the cap since the last log line
        self._over_cap_logged = 0.0  # time.monotonic() of that line

    async def start(self, host: str, port: int) -> asyncio.AbstractServer:
        """Listen for passives."""
        self._server = await asyncio.start_server(self._handle, host, port, reuse_address=True)
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

    def check_stall(self) -> None:
        """Drop a passive that has not acknowledged for `replication_timeout` seconds."""
        link = self.link
        if link is None or link.closed:
            return
        if link.acked >= link.sent_last():
            return
        stalled = time.monotonic() - max(link.last_progress, link.last_echo)
        if stalled > self.broker.settings.replication_timeout:
            log.warning(
                "passive %s stalled for %.1fs with %d ops unacknowledged: continuing alone",
                link.name, stalled, link.lag_messages,
            )  # fmt: skip
            # Told so, a paused passive that runs again knows it is no longer ready.
            link.close(Refuse(reason="stalled: the active goes on alone", epoch=self.broker.epoch))
            self._lost(link, degrade_now=True)

    def _unhook(self, link: SourceLink) -> None:
        committer = self.broker.committer
        if committer.on_batch == link.send_batch:
            committer.on_batch = None
        vhost = self.broker.vhost
        if vhost.on_topology_change == link.send_definitions:
            vhost.on_topology_change = None

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
        timeout = self.broker.settings.replication_timeout
        log.warning(
            "replication link to %s lost: waiting %.1fs for it to return", link.name, timeout
        )
        self._cancel_degrade()
        self._degrade_timer = asyncio.get_running_loop().call_later(timeout, self._degrade)

    def _degrade(self) -> None:
        self._degrade_timer = None
        if self.link is not None and self.link.ready:
            return
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
                    self.broker.committer.replica_acked(batch)
                    if link.ready:
                        self._cancel_degrade()
                        self.degraded_since = None
                        metrics.REPLICATION_DEGRADED.set(0)
                elif ftype is FrameType.REFUSE:
                    refuse = Refuse.model_validate_json(payload)
                    log.warning("passive %s refused the link: %s", peer_text, refuse.reason)
                    self.broker.learn_epoch(refuse.epoch, f"passive {link.name} ({peer_text})")
                    return
                elif ftype is FrameType.PING:
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
        last = committer.flush_now()
        # A damaged active (journal corruption) may lack what it confirmed: no discards.
        plan = plan_catchup(vhost.live_messages(), snapshot.queues, discard=not broker.damaged)
        if self.link is not None:
            # Not detach(): that drops the guard, confirming what no passive has yet.
            log.info("dropping passive %s: replaced by a new link", self.link.name)
            self._unhook(self.link)
            self.link.close()
            self.link = None
        link = SourceLink(peer, hello.name, writer, last)
        writer.write(encode(FrameType.DEFINITIONS, vhost.definitions()))
        buf = bytearray()
        encode_ops(plan.ops, buf)
        writer.write(encode_batch(last, BATCH_CATCHUP, buf))
        writer.write(encode_u64(FrameType.CAUGHT_UP, last))
        self.link = link
        committer.on_batch = link.send_batch
        vhost.on_topology_change = link.send_definitions
        committer.guard(True)
        self._cancel_degrade()
        metrics.REPLICATION_CONNECTED.set(1)
        log.info(
            "passive %s (%s, epoch %d) attached: catch-up to batch %d sends %d messages, "
            "discards %d, keeps %d",
            hello.name, peer, hello.epoch, last, len(plan.send), len(plan.discard), plan.kept,
        )  # fmt: skip
        return link

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
