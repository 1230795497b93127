"""The passive broker's end of the replication link.

Connects to the active (reconnecting every second while it cannot); both
prove they know the shared token (`handshake.py`), within one deadline and
with small frames only, before anything the active says is acted upon. Then
it sends its snapshot and applies what arrives: the topology, the catch-up
chunks and the live batches between them, each journaled as one record group
and acknowledged only once it is on this broker's disk (chunks by CATCHUP_ACK,
live batches by ACK, withdrawals of batches that failed on the active by
WITHDRAWN). What a cut-short catch-up delivered is in the journal,
hence in the next snapshot: the next catch-up resumes after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable

from twinmq.broker import metrics
from twinmq.broker.definitions import Definitions, DefinitionsDelta
from twinmq.broker.heap import HEAP
from twinmq.broker.journal import JournalError, JournalOp, StoredMessage, decode_ops
from twinmq.broker.replication.context import ReplicationContext
from twinmq.broker.replication.handshake import new_nonce, transcript_proof, verify
from twinmq.broker.replication.link import FrameReader
from twinmq.broker.replication.peer import PeerUnresolved
from twinmq.broker.replication.protocol import (
    BATCH_CATCHUP,
    BATCH_CATCHUP_LAST,
    PROTOCOL_VERSION,
    WITHDRAW_FORGET,
    Challenge,
    FrameType,
    Hello,
    ProtocolError,
    Refuse,
    Snapshot,
    Welcome,
    decode_batch,
    decode_keys,
    decode_model,
    decode_u64,
    encode,
    encode_u64,
)
from twinmq.broker.replication.source import PING_INTERVAL
from twinmq.broker.tls import identity_refusal

log = logging.getLogger(__name__)

RETRY_INTERVAL = 1.0
LINK_SILENCE = 3.0  # seconds without a frame (the active pings every 0.5 s): link lost


# What an entry of `_Session.pending` acknowledges.
LIVE, CHUNK, WITHDRAWAL = 0, 1, 2


class _Session:
    """One connected stretch of the link: maps local journal batches to the active's."""

    def __init__(self, client: ReplicaClient, writer: asyncio.StreamWriter) -> None:
        self.client = client
        self.writer = writer
        # (local batch, remote batch or chunk, LIVE / CHUNK / WITHDRAWAL)
        self.pending: deque[tuple[int, int, int]] = deque()
        self.alive = True

    def durable(self, batch: int, failed: bool = False) -> bool:
        """Local batches up to `batch` are on disk: acknowledge the active's batches."""
        if self.alive and self.writer.transport.is_closing():
            # Reset by the active before our reader noticed: writing would raise (uvloop)
            # inside group commit's sync task and end it (no more acks, ever).
            self.alive = False
        if not self.alive:
            return False
        acked: int | None = None
        chunk: int | None = None
        withdrawn: int | None = None
        while self.pending and self.pending[0][0] <= batch:
            _, remote, kind = self.pending.popleft()
            if kind == CHUNK:
                chunk = remote
            elif kind == LIVE:
                acked = remote
            else:
                withdrawn = remote
        if not failed:
            if chunk is not None:
                self.writer.write(encode_u64(FrameType.CATCHUP_ACK, chunk))
            if withdrawn is not None:
                self.writer.write(encode_u64(FrameType.WITHDRAWN, withdrawn))
            if acked is not None:
                self.writer.write(encode_u64(FrameType.ACK, acked))
                self.client.on_acked(acked)
        else:
            log.error("could not journal replicated batches up to %s: dropping the link", acked)
            self.writer.transport.abort()
        return bool(self.pending)


class ReplicaClient:
    """Replicates from the active at `address` (host:port of its replication listener)."""

    def __init__(self, broker: ReplicationContext, address: str) -> None:
        self.broker = broker
        self.address = address
        self.connected = False
        self.tls = False  # the current link runs TLS
        self.caught_up = False
        self.caught_up_epoch = 0
        self.catchup_batch: int | None = None
        self.remote_batch = 0
        self.acked_batch = 0
        self.active_name: str | None = None
        self.connected_since: float | None = None
        self.lost_at: float | None = None
        # time.monotonic() at which we sent the newest ping the active has echoed
        self._last_contact = 0.0
        self._ping_seq = 0
        self._pings: dict[int, float] = {}  # ping number -> time.monotonic() sent
        self.pending_ops = 0
        self.catchup_chunks = 0  # catch-up chunks received on the current link
        self._catching_up = False
        # A staged topology change the disk refused: the passive is stopping (exit 75).
        self._topology_failed = False
        self._oldest_pending: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        """Start the connect/replicate loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="twinmq-replica")
        self._task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The loop only ends by `stop()`: any other end leaves a passive that neither
        replicates nor says so (finding 10), so it stops the broker, loudly."""
        if task.cancelled() or self._stopping:
            return
        exc = task.exception()
        self.broker.stop_passive(f"replication from {self.address} ended: {exc!r}")

    async def stop(self) -> None:
        """Stop replicating (promotion, shutdown, a new active)."""
        self._stopping = True
        task = self._task  # a concurrent stop (a self-fencing demotion) may clear it
        if task is not None:
            # A cancellation that races with the operation it interrupts can be lost
            # (3.11's wait_for did it; the broker's own timeouts are asyncio.timeout now,
            # but not every library below is): cancel again until the task is really
            # done (else a promotion waits here as long as the active stays unreachable).
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=0.1)
            if self._task is task:
                self._task = None
                if not task.cancelled() and task.exception() is not None:
                    log.error("replication from %s ended: %r", self.address, task.exception())
        self._set_connected(False)

    @property
    def ready(self) -> bool:
        """Promotable without loss: caught up, and in touch with the active (a lease).

        The active goes on alone once its passive has been silent, stalled or
        gone for `replication_timeout` seconds: from then on it may confirm
        messages this broker never gets. The active echoes our pings only while
        it counts on us, and never goes on alone sooner than `replication_timeout`
        after its last echo; so we are ready until `replication_timeout` after
        sending the newest ping it echoed. Measured from our own sending, not
        from receiving: a slow link or a pause of ours cannot make stale news
        look fresh.
        """
        timeout = self.broker.settings.replication_timeout
        return self.caught_up and time.monotonic() - self._last_contact < timeout

    @property
    def lag_seconds(self) -> float:
        """Age of the oldest batch received but not yet durable here."""
        return 0.0 if self._oldest_pending is None else time.time() - self._oldest_pending

    def on_acked(self, batch: int) -> None:
        """A batch was acknowledged to the active."""
        self.acked_batch = batch
        self.pending_ops = 0 if batch >= self.remote_batch else self.pending_ops
        self._oldest_pending = None if batch >= self.remote_batch else self._oldest_pending
        self._check_caught_up()

    def _check_caught_up(self) -> None:
        """Ready once CAUGHT_UP(n) came (every chunk on our disk) and live batch n is too."""
        if self.caught_up or self.catchup_batch is None or self.acked_batch < self.catchup_batch:
            return
        self.caught_up = True
        # The epoch its active serves in (the handshake refuses any other): a later role
        # request may raise this broker's epoch without a new session.
        self.caught_up_epoch = self.broker.epoch
        log.info("caught up with %s at batch %d: ready", self.active_name, self.acked_batch)
        metrics.REPLICATION_READY.set(1)

    def _set_connected(self, connected: bool) -> None:
        if connected == self.connected:
            return
        self.connected = connected
        metrics.REPLICATION_CONNECTED.set(1 if connected else 0)
        if connected:
            self.connected_since = time.time()
        else:
            self.lost_at = time.time()

    async def _run(self) -> None:
        host, _, port = self.address.rpartition(":")
        # The address is held to --peer until it passes once (a --replicate-from given at
        # start, as POST /role's replicate_from is): a passive never dials another broker.
        # Not at every reconnect: a DNS outage must not keep a proven link down.
        peer = self.broker.settings.replication_peer
        refused_for: str | None = None  # logged once per reason, not at every retry
        while peer is not None and not self._stopping:
            unresolved = False
            try:
                why = await peer.address_refusal(self.address)
            except PeerUnresolved as exc:
                why, unresolved = str(exc), True  # cannot be judged yet: no refusal
            if why is None:
                break
            if why != refused_for and unresolved:
                log.warning("not replicating from %s yet: %s (--peer)", self.address, why)
            elif why != refused_for:
                metrics.REPLICATION_REFUSED.labels("peer").inc()
                log.error("not replicating from %s: %s (--peer)", self.address, why)
            refused_for = why
            await asyncio.sleep(RETRY_INTERVAL)
        while not self._stopping:
            try:
                reader, writer = await self._connect(host, int(port))
                self.tls = writer.get_extra_info("sslcontext") is not None
            except ssl.SSLError as exc:
                # A certificate refused either way: the operator must hear of it.
                metrics.REPLICATION_REFUSED.labels("certificate").inc()
                log.warning("TLS with the active at %s failed: %s", self.address, exc)
                await asyncio.sleep(RETRY_INTERVAL)
                continue
            except (TimeoutError, OSError) as exc:
                log.debug("cannot reach the active at %s: %s", self.address, exc)
                await asyncio.sleep(RETRY_INTERVAL)
                continue
            session = _Session(self, writer)
            try:
                await self._replicate(reader, writer, session)
            except (TimeoutError, ConnectionError, ProtocolError, ValueError, RuntimeError) as exc:
                # RuntimeError: uvloop refuses a write to a transport the active just reset.
                log.warning("replication link to %s lost: %s", self.address, str(exc) or repr(exc))
            finally:
                session.alive = False
                self._set_connected(False)
                with contextlib.suppress(Exception):
                    writer.close()
            await asyncio.sleep(RETRY_INTERVAL)

    async def _dial(
        self, host: str, port: int, tls: ssl.SSLContext | None
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        # The active's certificate is checked (`check_hostname`) for the peer's name
        # (`--replication-tls-server-name`, else `--peer`'s host), else the host dialled.
        server_name = self.broker.settings.replication_peer_name or (
            self.broker.settings.replication_tls_server_name
        )
        async with asyncio.timeout(RETRY_INTERVAL * 3):
            return await asyncio.open_connection(
                host, port, ssl=tls,
                server_hostname=server_name if tls is not None and server_name else None,
            )  # fmt: skip

    async def _connect(
        self, host: str, port: int
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The link to the active: TLS with `--replication-tls-*`. While a pair moves to
        mutual TLS (`--replication-tls-mode` other than `required`) the active may still
        listen in plaintext: a TLS attempt it cannot answer falls back to plaintext at once
        (the token's proof still authenticates both ends; the listener's mode decides
        whether plaintext is taken)."""
        tls = self.broker.replication_tls
        if tls is None:
            return await self._dial(host, port, None)
        if self.broker.settings.replication_tls_mode == "required":
            return await self._dial(host, port, tls.client)
        try:
            return await self._dial(host, port, tls.client)
        except (ssl.SSLError, TimeoutError, OSError) as exc:
            log.info("TLS with the active at %s failed (%s): dialling plaintext (the pair is "
                     "moving to mutual TLS)", self.address, exc)  # fmt: skip
            return await self._dial(host, port, None)

    async def _authenticate(
        self, frames: FrameReader, writer: asyncio.StreamWriter
    ) -> tuple[Challenge, Welcome] | None:
        """CHALLENGE, HELLO, WELCOME within one deadline: the proven active, or None (closed).

        Nothing the peer says changes anything here before its proof is
        verified: a forged active gets a log line and a closed link.
        """
        broker = self.broker
        settings = broker.settings
        token = broker.replication_token()
        if token is None:
            raise ProtocolError("no replication token configured: cannot authenticate")
        try:
            async with asyncio.timeout(settings.replication_handshake_timeout):
                ftype, payload = await frames.next()
                if ftype is not FrameType.CHALLENGE:
                    raise ProtocolError(f"expected CHALLENGE, got {ftype.name}")
                challenge = decode_model(Challenge, payload)
                if challenge.version != PROTOCOL_VERSION:
                    raise ProtocolError(
                        f"protocol version {challenge.version}, this broker speaks "
                        f"{PROTOCOL_VERSION}: upgrade both brokers of the pair"
                    )
                if why := identity_refusal(writer, challenge.name):
                    metrics.REPLICATION_REFUSED.labels("certificate").inc()
                    log.warning("the active at %s claims to be %r but %s: closed",
                                self.address, challenge.name, why)  # fmt: skip
                    return None
                if challenge.name == settings.name:
                    # Our own listener's challenge, relayed: a proof would authenticate us
                    # to ourselves, with the relay in the middle.
                    raise ProtocolError(
                        f"challenged in this broker's own name {settings.name!r} (a reflection)"
                    )
                nonce, epoch = new_nonce(), broker.epoch
                writer.write(encode(FrameType.HELLO, Hello(
                    name=settings.name, epoch=epoch, nonce=nonce,
                    proof=transcript_proof(
                        token, "passive", active=challenge.name, passive=settings.name,
                        active_nonce=challenge.nonce, passive_nonce=nonce, epoch=epoch,
                    ),
                )))  # fmt: skip
                ftype, payload = await frames.next()
                if ftype is FrameType.REFUSE:
                    refuse = decode_model(Refuse, payload)
                    # Unproven: its epoch and reason are news of nothing.
                    log.warning(
                        "%s at %s refused the link before proving itself (ignored): %.200s",
                        challenge.name, self.address, refuse.reason,
                    )  # fmt: skip
                    return None
                if ftype is not FrameType.WELCOME:
                    raise ProtocolError(f"expected WELCOME, got {ftype.name}")
                welcome = decode_model(Welcome, payload)
        except TimeoutError:
            metrics.REPLICATION_REFUSED.labels("handshake-timeout").inc()
            log.warning(
                "the active at %s did not authenticate within %.1fs "
                "(replication_handshake_timeout): closed",
                self.address, settings.replication_handshake_timeout,
            )  # fmt: skip
            return None
        why = verify(
            token, welcome.proof, "active", active=challenge.name, passive=settings.name,
            active_nonce=challenge.nonce, passive_nonce=nonce, epoch=welcome.epoch,
        )  # fmt: skip
        if why is not None:
            metrics.REPLICATION_REFUSED.labels("bad-proof").inc()
            log.warning(
                "the active at %s (claims to be %r) failed authentication: %s: closed",
                self.address, challenge.name, why,
            )  # fmt: skip
            return None
        frames.authenticated()
        return challenge, welcome

    async def _replicate(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, session: _Session
    ) -> None:
        broker = self.broker
        frames = FrameReader(reader, "the active", chunk=1 << 20)
        proven = await self._authenticate(frames, writer)
        if proven is None:
            return
        challenge, welcome = proven
        # Authenticated both ways from here on.
        if welcome.epoch < broker.epoch:
            # A stale active: tell it the epoch it missed, so that it steps down.
            log.warning(
                "%s at %s is active in stale epoch %d (ours %d): refusing it",
                challenge.name, self.address, welcome.epoch, broker.epoch,
            )  # fmt: skip
            writer.write(encode(FrameType.REFUSE, Refuse(reason="stale epoch", epoch=broker.epoch)))
            await writer.drain()
            return
        if not broker.learn_epoch(welcome.epoch, f"active {challenge.name} at {self.address}"):
            writer.write(encode(FrameType.REFUSE, Refuse(
                reason=f"epoch {welcome.epoch} refused by {broker.settings.name} (epoch "
                f"{broker.epoch}): a jump of more than max_epoch_jump",
                epoch=broker.epoch)))  # fmt: skip
            await writer.drain()
            return
        writer.write(encode(FrameType.SNAPSHOT, Snapshot.of(broker.vhost.replication_snapshot())))
        self.active_name = challenge.name
        # The active pings every half second: a few missed pings mean the link is gone.
        # This must be well inside replication_timeout, the time this passive stays
        # promotable after losing the active: a failover needs both at once.
        silence = min(LINK_SILENCE, broker.settings.replication_timeout / 2)
        # Until its first frame the active is reading our snapshot and planning the
        # catch-up over it, and sends nothing (not even pings): over a slow link or on a
        # loaded active that outlasts `silence` for a large snapshot, and a passive that
        # gave up then retried with the same snapshot forever. It gets the handshake's
        # deadline once the snapshot is on its way; `silence` rules once we are connected.
        await writer.drain()
        attach_within = max(silence, broker.settings.replication_handshake_timeout)

        async def next_frame() -> tuple[FrameType, bytes]:
            return await frames.next(silence if self.connected else attach_within)

        # Connected only once the active accepts us (its topology comes first): a broker
        # that is not active answers the hello with a refusal, and a refused link must
        # neither look up (the operator would think the active alive) nor reset what
        # this passive knows (it stays promotable while it may be the only complete copy).
        committer = broker.committer
        committer.await_durable(session)
        pinger = asyncio.get_running_loop().create_task(self._ping(writer))
        try:
            await self._apply(next_frame, session)
        finally:
            pinger.cancel()

    async def _ping(self, writer: asyncio.StreamWriter) -> None:
        """Ping the active every PING_INTERVAL / 2; its echoes renew our readiness."""
        while not writer.transport.is_closing():
            self._ping_seq += 1
            self._pings[self._ping_seq] = time.monotonic()
            self._pings.pop(self._ping_seq - 64, None)
            writer.write(encode_u64(FrameType.PING, self._ping_seq))
            await asyncio.sleep(PING_INTERVAL / 2)

    def _end_catch_up(self) -> None:
        """The catch-up's last chunk: queues back in replication ID order."""
        self._catching_up = False
        self.broker.vhost.restore_order()

    def _topology_refused(self, error: JournalError | None) -> None:
        """A staged topology change's outcome: refused by the disk, the passive stops."""
        if error is not None:
            self._topology_failed = True
            self.broker.stop_passive(f"could not save the topology ({error})")

    async def _window_saved(self, what: str) -> bool:
        """The dedup window written before `what` is acknowledged. The discards before it
        forgot their messages' keys here in memory; a file still holding one would make
        this passive, restarted and promoted, drop that message's re-send after confirming
        it (a loss). Written before the discards are journaled: a crash between the two
        leaves a message without its key (its re-send a duplicate), never the reverse.
        A window that cannot be written is removed instead (no file holds no stale key);
        the passive stops only if even that fails."""
        if await self.broker.save_or_remove_dedup_window():
            return True
        self.broker.stop_passive(f"could not save nor remove the dedup window before {what}")
        return False

    def _journal(self, ops: list[JournalOp], raw: bytes, keys: list[str]) -> int:
        """Journal replicated `ops` (applied in memory); their local batch. `raw` is what
        they were decoded from, byte for byte: journaled as is."""
        committer = self.broker.committer
        local = committer.add(ops, raw) if ops else committer.confirm_point()
        if keys:
            self.broker.vhost.remember_when_durable(keys, local)
        return local

    async def _journal_after_window(
        self, what: str, ops: list[JournalOp], raw: bytes, keys: list[str]
    ) -> int | None:
        """Journal `ops`, applied in memory already, once the window is written
        (`_window_saved`); their local batch, or None if the passive stops.

        Journaled even when this task is cancelled while the window is written (a
        promotion stops the replica): memory holds them, and a new active whose journal
        lacked them (an undone ack's message stored again) would lose them at its next
        restart."""
        try:
            saved = await self._window_saved(what)
        except asyncio.CancelledError:
            self._journal(ops, raw, keys)
            raise
        return self._journal(ops, raw, keys) if saved else None

    def _acknowledge(self, session: _Session, local: int, remote: int, kind: int) -> None:
        """Acknowledge the active's batch, chunk or withdrawal `remote` (`kind`) once local
        batch `local` is durable."""
        session.pending.append((local, remote, kind))
        if local == 0:
            session.durable(0)
        else:
            self.broker.committer.await_durable(session)

    async def _apply(
        self, next_frame: Callable[[], Awaitable[tuple[FrameType, bytes]]], session: _Session
    ) -> None:
        broker = self.broker
        committer = broker.committer
        while True:
            ftype, payload = await next_frame()
            if ftype is not FrameType.DEFINITIONS_DELTA:
                # The run of topology changes before this frame, staged as they came
                # (the active sends one per change, a group commit's worth in a burst):
                # one append and one fsync of the definitions log for the run, done
                # before this frame is handled, so before anything after them is
                # acknowledged (an acknowledgement says all before it is durable).
                committer.flush_topology()
                if self._topology_failed:
                    return  # the write failed: the passive stops (`_topology_refused`)
            if ftype is FrameType.BATCH:
                remote, flags, raw = decode_batch(payload)
                ops = decode_ops(raw)
                chunk = bool(flags & BATCH_CATCHUP)
                # While chunks of older messages interleave with live batches, queue order
                # (by replication ID) is restored once, at the end, not per batch.
                keys = broker.vhost.apply_ops(ops, defer_sort=self._catching_up, catchup=chunk)
                if chunk:
                    self.catchup_chunks += 1
                    metrics.CATCHUP_RECEIVED.inc(sum(1 for op in ops if type(op) is StoredMessage))
                    # The chunk's messages are long-lived and never in a cycle: out of
                    # the collector's full walks (`broker/heap.py`, the broker's policy).
                    HEAP.freeze()
                if chunk and flags & BATCH_CATCHUP_LAST:
                    self._end_catch_up()
                    saved = await self._journal_after_window("the catch-up's end", ops, raw, keys)
                    if saved is None:
                        return
                    local = saved
                else:
                    local = self._journal(ops, raw, keys)
                if not chunk:
                    self.remote_batch = remote
                    self.pending_ops += len(ops)
                    if self._oldest_pending is None:
                        self._oldest_pending = time.time()
                self._acknowledge(session, local, remote, CHUNK if chunk else LIVE)
            elif ftype is FrameType.WITHDRAW:
                # A batch this passive applied failed on the active, which withdrew it
                # there: these ops do the same here (a catch-up's discards, the undone
                # acks' messages stored again), durably before WITHDRAWN; the active
                # tells its clients of the failure only then (docs/replication.md).
                remote, flags, raw = decode_batch(payload)
                if flags & WITHDRAW_FORGET:
                    # The keys of the failed batch's publishes, ahead of its ops: a discard
                    # forgets only the key of a message still here, and a later batch may
                    # have taken one off already (a purge, an expiry); promoted, this
                    # passive would drop its publisher's re-send as a duplicate (a loss).
                    # Saved with the window before the ops' WITHDRAWN.
                    broker.vhost.forget_dedup_keys(decode_keys(raw))
                    continue
                ops = decode_ops(raw)
                keys = broker.vhost.apply_ops(ops, defer_sort=self._catching_up, catchup=True)
                saved = await self._journal_after_window("a withdrawal", ops, raw, keys)
                if saved is None:
                    return
                local = saved
                log.warning(
                    "the active's batch %d failed there: %d ops withdrawn here", remote, len(ops)
                )
                self._acknowledge(session, local, remote, WITHDRAWAL)
            elif ftype is FrameType.DEDUP_KEYS:
                # The active's window, after every message chunk and discard: admitted once
                # everything received so far is durable here, so a key never gets ahead of
                # a message this passive would otherwise lack (it would swallow its re-send).
                remote, flags, raw = decode_batch(payload)
                keys = decode_keys(raw)
                self.catchup_chunks += 1
                if flags & BATCH_CATCHUP_LAST:
                    self._end_catch_up()
                    if not await self._window_saved("the catch-up's end"):
                        return
                local = committer.confirm_point()
                if keys:
                    broker.vhost.remember_when_durable(keys, local)
                self._acknowledge(session, local, remote, CHUNK)
            elif ftype is FrameType.DEFINITIONS:
                if not self.connected:
                    self.caught_up = False
                    self.catchup_batch = None
                    self.catchup_chunks = 0
                    self._catching_up = True
                    self.acked_batch = 0  # batch numbers are per active: start over
                    # The catch-up ends with the active's window (DEDUP_KEYS), the one
                    # that counts: a key kept here of a message withdrawn since (a saved
                    # window older than a discard, a kill in between) would swallow its
                    # re-send once promoted. Until then this passive is not ready.
                    broker.vhost.forget_dedup_window()
                    metrics.REPLICATION_READY.set(0)
                    self._set_connected(True)
                    log.info(
                        "replicating from %s at %s (epoch %d, %s)",
                        self.active_name,
                        self.address,
                        self.broker.epoch,
                        "mutual TLS" if self.tls else "plaintext",
                    )
                try:
                    broker.vhost.apply_definitions(
                        Definitions.model_validate_json(payload), broker.served_vhosts()
                    )
                except JournalError as exc:
                    # The topology file is not what memory holds (a full disk): stop, as
                    # for a batch that could not be journaled, never linger unlinked.
                    broker.stop_passive(f"could not save the topology ({exc})")
                    return
            elif ftype is FrameType.DEFINITIONS_DELTA:
                # One change after the whole topology this link began with (DEFINITIONS),
                # staged: written with the rest of its run (above, or at the end of the
                # loop turn if the next frame is not here yet).
                try:
                    broker.vhost.apply_delta(
                        decode_model(DefinitionsDelta, payload), self._topology_refused
                    )
                except JournalError as exc:
                    broker.stop_passive(f"could not save the topology ({exc})")
                    return
            elif ftype is FrameType.CAUGHT_UP:
                self.catchup_batch = decode_u64(payload)
                self._check_caught_up()
            elif ftype is FrameType.REFUSE:
                refuse = Refuse.model_validate_json(payload)
                broker.learn_epoch(refuse.epoch, f"{self.active_name} at {self.address}")
                if not self.connected:
                    # Refused at the hello: that broker is not (or no longer) the active,
                    # e.g. a restarted one that came back passive. It says nothing about
                    # what this passive holds, which may be the only complete copy.
                    log.info("%s refused replication: %s", self.address, refuse.reason)
                    return
                log.warning("the active dropped this passive: %s", refuse.reason)
                # Dropped (stalled, or a stale epoch): it may go on without us.
                self.caught_up = False
                metrics.REPLICATION_READY.set(0)
                return
            elif ftype is FrameType.PING:
                if payload:  # the echo of one of our pings
                    sent = self._pings.get(decode_u64(payload))
                    if sent is not None:
                        self._last_contact = max(self._last_contact, sent)
            else:
                raise ProtocolError(f"unexpected {ftype.name} from the active")
