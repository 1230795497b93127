"""The broker process: the thin asyncio transport around the protocol core.

`Broker` wires the journal, the virtual host, group commit, resource alarms and
the admin API together; `AMQPProtocol` only moves bytes between a socket and a
`Connection` state machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from importlib import metadata
from typing import cast

from twinmq.broker import damage, metrics
from twinmq.broker.alarms import ResourceMonitor
from twinmq.broker.api import (
    BrokerStatus,
    MirrorDemoteRequest,
    MirrorPromoteRequest,
    MirrorReseed,
    MirrorSwitch,
    Role,
    VhostDeleted,
)
from twinmq.broker.auditlog import AuditLog
from twinmq.broker.auth import Authenticator
from twinmq.broker.channel import Channel
from twinmq.broker.codec import ContentHeaderInfo
from twinmq.broker.commit import GroupCommitter
from twinmq.broker.connection import Connection, Limits, State
from twinmq.broker.dedup import DedupWindow
from twinmq.broker.epoch import EpochStore, epoch_jump_refusal, first_mid
from twinmq.broker.errors import (
    DamagedBroker,
    ReplyCode,
    StaleEpoch,
    VhostNotFound,
    VhostRefused,
)
from twinmq.broker.federation import config as federation_config
from twinmq.broker.federation.identity import SERVER_ID_PROPERTY
from twinmq.broker.federation.marks import ToldMarks
from twinmq.broker.federation.service import Federation
from twinmq.broker.filewatch import reload_every
from twinmq.broker.journal import DefinitionsDamaged, Journal, JournalError
from twinmq.broker.lease import LeaseKeeper
from twinmq.broker.mirror.site import Mirroring
from twinmq.broker.queue import LengthCap
from twinmq.broker.replication.replica import ReplicaClient
from twinmq.broker.replication.source import ReplicationSource
from twinmq.broker.replication.withdrawal import withdraw_everywhere
from twinmq.broker.routing import Exchange
from twinmq.broker.settings import BrokerSettings
from twinmq.broker.status import build_status, tls_status
from twinmq.broker.tls import MutualTls, TlsListener, verified_peer_certificate
from twinmq.broker.vhost import PublishResult, VirtualHost

log = logging.getLogger(__name__)

LIMIT_LOG_INTERVAL = 10.0  # seconds between two "connection limit reached" log lines


def _version() -> str:
    try:
        return metadata.version("twinmq")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0.0.0"


# What the start-up line says of the AMQPS port's client certificates.
CLIENT_CERTS_LOG = {
    "none": "",
    "optional": " (client certificates verified when presented)",
    "required": " (client certificates required)",
}


class AMQPProtocol(asyncio.Protocol):
    """Feeds a socket's bytes to a `Connection` and writes back what it produces."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.loop = broker.loop
        self.transport: asyncio.Transport | None = None
        self.conn: Connection | None = None
        self._scheduled = False
        self._receiving = False
        self._reading = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, so no isinstance check.
        self.transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        most = self.broker.settings.max_connections
        if most and len(self.broker.protocols) >= most:
            # As RabbitMQ's connection_max: closed before a byte is read.
            metrics.CONNECTIONS_REFUSED.labels("total").inc()
            if self.loop.time() - self.broker.limit_logged > LIMIT_LOG_INTERVAL:
                self.broker.limit_logged = self.loop.time()
                log.warning("connections closed at once: the limit of %d is reached (%s, and "
                            "more in twinmq_connections_refused_total)", most, peer)  # fmt: skip
            transport.close()
            return
        host = peer[0] if isinstance(peer, tuple) else "local"
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = host == "local"
        self.conn = Connection(
            self.broker,
            f"{host}:{peer[1] if isinstance(peer, tuple) else 0}",
            loopback=loopback,
            wake=self._wake,
            certificate=verified_peer_certificate(transport),
        )
        self.broker.protocols.add(self)
        # Bound the write buffer so a slow consumer pauses deliveries, not the broker.
        self.transport.set_write_buffer_limits(high=4 * 1024 * 1024)

    def data_received(self, data: bytes) -> None:
        conn = self.conn
        if conn is None:
            return  # closed at once by the connection limit
        self._receiving = True
        try:
            conn.receive_data(data, self.loop.time())
        finally:
            self._receiving = False
        self._flush()

    def _wake(self) -> None:
        if not self._receiving and not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        conn, transport = self.conn, self.transport
        if conn is None or transport is None or transport.is_closing():
            return
        data = conn.data_to_send()
        if data:
            transport.write(data)
            conn.last_sent = self.loop.time()
        if conn.closed:
            transport.close()
            return
        wants = conn.wants_read
        if wants != self._reading:
            self._reading = wants
            if wants:
                transport.resume_reading()
            else:
                transport.pause_reading()

    def pause_writing(self) -> None:
        if self.conn is not None:
            self.conn.writable = False

    def resume_writing(self) -> None:
        conn = self.conn
        if conn is None:
            return
        conn.writable = True
        now = self.broker.vhost.clock.time()
        for channel in conn.channels.values():
            for consumer in list(channel.consumers.values()):
                consumer.queue.dispatch(now)
        self._flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.broker.protocols.discard(self)
        if self.conn is not None:
            self.conn.connection_lost()
            if self.conn.origin_stamp is not None and self.conn.opened:
                # A federation peer's connection (upstream side): news on amq.peer.
                self.broker.federation.peer_event(
                    "peer-disconnected",
                    self.conn.peer,
                    self.conn.client_properties.get(SERVER_ID_PROPERTY),
                )
            log.debug(
                "connection from %s closed: %s",
                self.conn.peer,
                self.conn.close_reason or exc or "socket closed",
            )

    def heartbeat(self, now: float, stalled: bool = False) -> None:
        """Heartbeat timer tick (`stalled`: a late one, see `Connection.heartbeat_due`)."""
        if self.conn is None or self.transport is None:
            return
        if not self.conn.heartbeat_due(now, stalled):
            self.transport.abort()
            return
        self._flush()


HEARTBEAT_TICK = 1.0
"""Seconds between the checks of every connection's heartbeats."""


class WallClock:
    """The virtual host's clock: wall time, loop timers."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def time(self) -> float:
        """Seconds since the epoch."""
        return time.time()

    def call_later(self, delay: float, callback: object) -> asyncio.TimerHandle:
        """Schedule a callback."""
        return self.loop.call_later(delay, callback)  # type: ignore[arg-type]


# Replication IDs skipped when a broker starts active (see Broker.__init__): more than
# could ever be streamed but not yet durable; 2^40 per epoch leaves 4,096 restarts.
RESTART_MID_GAP = 1 << 28

# The process's exit status when a passive stops after a failed journal write.
EXIT_JOURNAL_FAILED = 75  # EX_TEMPFAIL: a restart is the remedy


class Broker:
    """A running broker: listeners, journal, virtual host, alarms, admin API."""

    def __init__(self, settings: BrokerSettings) -> None:
        self.settings = settings
        # Read first: a bad federation file stops the start before anything is opened.
        federation = (
            None
            if settings.federation_config is None
            else federation_config.load(settings.federation_config)
        )
        self.loop = asyncio.get_running_loop()
        self.product_version = _version()
        self.limits = Limits(
            frame_max=settings.frame_max,
            channel_max=settings.channel_max,
            heartbeat=settings.heartbeat,
            max_message_size=settings.max_message_size,
            max_connections_per_user=settings.max_connections_per_user,
            deduplicate_all=settings.dedup_scope == "all",
        )
        self.authenticator = Authenticator.from_file(settings.users_file)
        self.authenticator.cert_login = settings.tls_cert_login
        self.protocols: set[AMQPProtocol] = set()
        self.limit_logged = -LIMIT_LOG_INTERVAL  # loop time of the last "limit reached" log
        self.started = time.time()
        # Set when the broker must stop by itself (`serve` exits with `exit_code`).
        self.exit_requested = asyncio.Event()
        self.exit_code = 0
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        self.epochs = EpochStore(settings.data_dir / "epoch.json")
        self.epochs.raise_to(settings.epoch)
        self.epoch_refusal: str | None = None  # the last peer epoch refused, for /status
        self.role: Role = settings.role
        self.replicate_from = settings.replicate_from
        self.journal = Journal(
            settings.data_dir / "journal",
            segment_bytes=settings.segment_bytes,
            fsync=settings.fsync,
            on_fsync=metrics.FSYNC_LATENCY.observe,
            quarantine=damage.quarantine_dir(settings.data_dir),
        )
        started = time.perf_counter()
        try:
            recovered = self.journal.open()
        except DefinitionsDamaged as exc:
            # The start is refused all the same; the marker says what was found, as for
            # a damaged segment (the operator's tools read it: docs/journal.md).
            with contextlib.suppress(OSError):
                damage.record_definitions(settings.data_dir, exc, time.time())
            raise
        log.info(
            "journal recovered: %d segments, %d records, %d live messages in %d queues, "
            "%d torn bytes truncated, %.2fs",
            recovered.segments,
            recovered.records,
            sum(len(m) for m in recovered.messages.values()),
            len(recovered.definitions.queues),
            recovered.torn_bytes,
            time.perf_counter() - started,
        )
        self.damage = damage.load(settings.data_dir)
        if recovered.corruption:
            metrics.JOURNAL_CORRUPTION.inc(len(recovered.corruption))
            self.damage = damage.record(settings.data_dir, recovered, time.time())
            log.error(
                "journal corruption: %d unreadable stretches (%d bytes), %d live messages "
                "re-appended, %d damaged files quarantined; this broker is DAMAGED (it may "
                "have lost messages it confirmed): it refuses activation without force and "
                "never tells a passive to discard; see `twinmq-broker journal check %s`",
                len(recovered.corruption), recovered.corrupt_bytes, recovered.reappended,
                len(recovered.quarantined), settings.data_dir,
            )  # fmt: skip
        elif self.damage is not None:
            log.error(
                "this broker is DAMAGED since %s (%s): run `twinmq-broker journal repair %s` "
                "once the loss is dealt with",
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.damage.since)),
                settings.data_dir / damage.MARKER, settings.data_dir,
            )  # fmt: skip
        self.committer = GroupCommitter(self.journal, self.loop)
        self.vhost = VirtualHost(
            self.committer,
            WallClock(self.loop),
            recovered,
            replica=self.role == "passive",
            dedup=DedupWindow(settings.dedup_window, settings.data_dir / "dedup.json"),
            max_queues=settings.max_queues,
            queue_cap=LengthCap(settings.max_queue_length, settings.max_queue_length_bytes),
        )
        if settings.server_id:
            # Server-named queues unique across a federation (global reply-to names).
            separator = federation.global_key_separator if federation is not None else "."
            self.vhost.server_named_prefix = f"amq.gen-{settings.server_id}{separator}"
            for other in self.vhost.vhosts.values():
                other.server_named_prefix = self.vhost.server_named_prefix
        self._serve_vhosts()
        if self.role == "active":
            # A batch is streamed to the passive before its own fdatasync: a previous
            # run in this epoch may have handed out mids that never reached this disk
            # but did reach the passive's. Reusing one would make catch-up keep the
            # passive's old message under the new message's id; skip past them.
            self.vhost.next_mid = max(self.vhost.next_mid, first_mid(self.epoch)) + RESTART_MID_GAP
        if settings.audit:
            self.committer.audit = AuditLog(
                settings.data_dir / "audit",
                settings.name,
                lambda: self.epoch,
                self._queue_name,
                lambda: self.role == "passive",
                queue_vhost=self._queue_vhost,
                segment_seconds=settings.audit_segment_seconds,
                fsync=settings.fsync,
                # ids are mapped per origin only in the bidirectional mode (format 5 lines)
                mirror_id=(settings.mirror_id or settings.name)
                if settings.mirror_first_role == "bidirectional"
                else "",
            )
        self.source = ReplicationSource(self)
        self.lease = LeaseKeeper.from_environment(self)
        self.replica: ReplicaClient | None = None
        self.monitor = ResourceMonitor(
            settings.data_dir,
            settings.disk_free_limit,
            settings.memory_high_watermark,
            self.committer,
            self._alarm_changed,
        )
        self.mirroring = Mirroring(
            settings, self.vhost, self.committer, self.monitor, close_clients=self.close_clients
        )
        if self.mirroring.listener is not None:
            # A vhost the DR source deleted is dropped here too unless this site serves it.
            self.mirroring.listener.applier.served = lambda: self.authenticator.vhosts
        self.federation = Federation(
            settings.effective_server_id,
            federation,
            self.vhost,
            self.committer,
            self.alarm,
            settings.data_dir / "federation",
            lambda: self.epoch,
        )
        self._servers: list[asyncio.AbstractServer] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._dedup_lock = asyncio.Lock()  # one write of the dedup window at a time
        self.tls: TlsListener | None = None
        self._amqps: asyncio.AbstractServer | None = None
        if settings.tls_cert is not None and settings.tls_key is not None:
            client_certs = settings.effective_tls_client_certs
            self.tls = TlsListener(
                settings.tls_cert,
                settings.tls_key,
                None if client_certs == "none" else settings.tls_ca,
                optional=client_certs == "optional",
                federation_ca=None if client_certs == "none" else settings.tls_federation_ca,
            )
            self.authenticator.login_scope = self.tls.login_refusal
        self.admin_tls: TlsListener | None = None
        if settings.admin_tls_cert is not None and settings.admin_tls_key is not None:
            self.admin_tls = TlsListener(settings.admin_tls_cert, settings.admin_tls_key)
        self._replication_tls: MutualTls | None = None
        cert, key, ca = (
            settings.replication_tls_cert, settings.replication_tls_key, settings.replication_tls_ca
        )  # fmt: skip
        if cert is not None and key is not None and ca is not None:
            self._replication_tls = MutualTls(cert, key, ca)
        metrics.TLS.source = lambda: tls_status(self)
        metrics.CONNECTIONS.set_function(lambda: len(self.protocols))
        metrics.BROKER_DAMAGED.set_function(lambda: 1 if self.damaged else 0)
        metrics.JOURNAL_QUARANTINED.set_function(self.quarantined_files)
        metrics.CHANNELS.set_function(
            lambda: sum(len(p.conn.channels) for p in self.protocols if p.conn is not None)
        )

    # -- vhosts --------------------------------------------------------------------------

    def _serve_vhosts(self) -> None:
        """Make the vhosts the users file declares (empty; their content comes with use or
        replication), and say which ones it no longer declares."""
        served = self.authenticator.vhosts
        for name in sorted(served):
            vhost = self.vhost.add_vhost(name)
            if vhost.retired:
                vhost.retired = False
                log.info("vhost %r is in the users file again: served", name)
        for vhost in self.vhost.vhosts.values():
            if vhost.name not in served and not vhost.retired:
                # The safe side of RabbitMQ's delete_vhost: nothing is deleted (docs/security.md).
                vhost.retired = True
                log.warning(
                    "vhost %r is not in the users file: new connections to it are refused; "
                    "its %d queues and their messages are kept (connections open to it stay "
                    "until they close)",
                    vhost.name,
                    len(vhost.queues),
                )

    def _reload_users(self) -> bool:
        """Read the users file again if it changed; serve its vhosts."""
        changed = self.authenticator.reload_if_changed()
        if changed:
            self._serve_vhosts()
        return changed

    def delete_vhost(self, name: str) -> VhostDeleted:
        """`DELETE /vhosts/{name}`: delete a retired vhost's content (docs/security.md)."""
        if name == "/":
            raise VhostRefused("the vhost '/' is never deleted")
        vhost = self.vhost.vhosts.get(name)
        if vhost is None:
            raise VhostNotFound(f"no vhost '{name}' on {self.settings.name}")
        if name in self.authenticator.vhosts:
            raise VhostRefused(
                f"vhost '{name}' is in the users file: remove it there first (new "
                "connections are refused then), then delete its content"
            )
        if self.role != "active":
            raise VhostRefused(
                f"{self.settings.name} is the passive broker: delete the vhost on the active "
                "(the passive follows)"
            )
        closed = 0
        for proto in list(self.protocols):
            conn = proto.conn
            if conn is not None and conn.vhost is vhost and conn.state is State.OPEN:
                conn.force_close(ReplyCode.CONNECTION_FORCED, f"vhost '{name}' is deleted")
                proto._flush()
                closed += 1
        queues, exchanges, messages = vhost.delete_content()
        return VhostDeleted(
            name=name, queues=queues, exchanges=exchanges, messages=messages, connections=closed
        )

    def served_vhosts(self) -> frozenset[str]:
        """The vhosts the users file declares (and `/`)."""
        return self.authenticator.vhosts

    def served_vhost(self, name: str) -> VirtualHost | None:
        """The vhost `name` if the users file declares it (`/` always), else None."""
        if name not in self.authenticator.vhosts:
            return None
        return self.vhost.add_vhost(name)

    # -- ConnectionContext ---------------------------------------------------------------

    def await_durable(self, channel: Channel) -> None:
        """Route durability notifications to a channel."""
        self.committer.await_durable(channel)

    def alarm(self) -> str | None:
        """The active resource alarm, if any."""
        return self.monitor.reason

    def open_connections(self, user: str) -> int:
        """How many of `user`'s client connections are open (past connection.open)."""
        return sum(
            1
            for p in self.protocols
            if p.conn is not None and p.conn.user == user and p.conn.state is State.OPEN
        )

    def refusal(self) -> str | None:
        """Why clients are refused now; None while active (and serving: a forced DR
        promotion's seed not durable yet keeps them out, `Mirroring.client_refusal`)."""
        if self.role == "active":
            return self.mirroring.client_refusal()
        where = self.replicate_from or "unknown"
        if self.replica is not None and self.replica.active_name:
            where = f"{self.replica.active_name} ({self.replicate_from})"
        return (
            f"{self.settings.name} is the passive broker (epoch {self.epoch}); "
            f"connect to the active broker: {where}"
        )

    async def mirror_demote(self, request: MirrorDemoteRequest) -> MirrorSwitch:
        """`POST /mirror/demote` (docs/mirror.md, "Switchover")."""
        return await self.mirroring.demote(request)

    async def mirror_promote(self, request: MirrorPromoteRequest) -> MirrorSwitch:
        """`POST /mirror/promote` (docs/mirror.md, "Switchover" and "Failover")."""
        return await self.mirroring.promote(request)

    async def mirror_reseed(self) -> MirrorReseed:
        """`POST /mirror/reseed` (docs/mirror.md, "Re-seed and orphans")."""
        return await self.mirroring.reseed()

    def write_refusal(self) -> str | None:
        """Why clients may not publish or change the topology here (a DR replica), or None."""
        return self.mirroring.write_refusal()

    @property
    def server_id(self) -> str:
        """This server's identifier (`--server-id`, else the broker name)."""
        return self.settings.effective_server_id

    def peer_refusal(self, peer: str, announced: object) -> str | None:
        """Why a federation peer is refused (it announces our identifier), or None."""
        return self.federation.peer_refusal(peer, announced)

    def peer_connected(self, peer: str, announced: object) -> None:
        """A federation peer logged in: news on `amq.peer`."""
        self.federation.peer_event("peer-connected", peer, announced)

    def told_marks(self, vhost: str, queue: str) -> ToldMarks:
        """What to tell a federation link consuming `queue` (federation/marks.py)."""
        return self.federation.told_marks(vhost, queue)

    def marks_durable(self) -> tuple[int, int]:
        """(the batch covering every journal op so far, the newest batch complete)."""
        return self.federation.marks_durable()

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
        """Publish what a federation peer forwarded (deduplicated on arrival)."""
        return self.federation.receive(exchange, routing_key, header, body, info, hold=hold)

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
        """A federation peer's status message for `amq.peer` (of the vhost its link opened)."""
        self.federation.receive_peer_status(
            routing_key, header, body, info, allowed=allowed, vhost=vhost
        )

    def close_clients(self, reason: str) -> None:
        """Close every client connection (connection.close 320 CONNECTION_FORCED)."""
        for proto in list(self.protocols):
            if proto.conn is not None:
                proto.conn.force_close(ReplyCode.CONNECTION_FORCED, reason)
                proto._flush()

    def _queue_name(self, qid: int) -> str:
        queue = self.vhost.queue_by_qid(qid)
        if queue is None:
            return f"qid:{qid}"
        return queue.name

    def _queue_vhost(self, qid: int) -> str:
        # The audit line's `vhost` (format 6): two vhosts' queues of one name stay two.
        queue = self.vhost.queue_by_qid(qid)
        return "/" if queue is None else queue.definition.vhost

    # -- damage (journal corruption) ------------------------------------------------------

    @property
    def damaged(self) -> bool:
        """Recovered with corruption, not repaired, not made whole by a catch-up since.

        A damaged broker may lack messages it confirmed: it must not become active
        unless forced, and as an active it never tells its passive to discard.
        """
        if self.damage is None or self.damage.healed_by is not None:
            return False
        return not self._caught_up()

    def _caught_up(self) -> bool:
        """A passive whose catch-up from the active is complete."""
        return self.role == "passive" and self.replica is not None and self.replica.caught_up

    def quarantined_files(self) -> int:
        """Files in the quarantine folder."""
        try:
            return sum(1 for _ in damage.quarantine_dir(self.settings.data_dir).iterdir())
        except OSError:
            return 0

    def _check_activation(self, force: bool) -> None:
        """Raise DamagedBroker if a damaged broker may not become active."""
        if self.damage is None or self.damage.healed_by is not None:
            return
        if self._caught_up():
            # Everything the active had reached this journal since the damage.
            assert self.replica is not None
            self.damage.healed_by = self.replica.active_name or self.replicate_from or "the active"
            damage.save(self.settings.data_dir, self.damage)
            log.warning(
                "damaged journal healed by a complete catch-up from %s", self.damage.healed_by
            )
            return
        if not force:
            raise DamagedBroker(
                f"{self.settings.name} recovered with journal corruption "
                f"({len(self.damage.corruption)} unreadable stretches) and has not caught up "
                "from an active since: it may lack messages it confirmed. Promote the peer, "
                "or force it (POST /role with force=true: it will then never tell its passive "
                "to discard anything), or run `twinmq-broker journal repair` once dealt with"
            )
        log.error(
            "forced activation of a damaged broker: its passive keeps every message this "
            "broker lacks (catch-up discards nothing)"
        )

    # -- roles and epochs ----------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The highest epoch this broker has seen (persisted)."""
        return self.epochs.epoch

    def replication_token(self) -> str | None:
        """The replication link's shared secret."""
        token = self.settings.replication_token or self.settings.admin_token
        return None if token is None else token.get_secret_value()

    @property
    def replication_tls(self) -> MutualTls | None:
        """The replication link's mutual TLS, if configured."""
        return self._replication_tls

    def learn_epoch(self, epoch: int, source: str) -> bool:
        """An authenticated peer knows `epoch`: persist it if higher; an active steps down.

        An implausible jump (`max_epoch_jump`) is refused, logged, counted and
        shown in `/status`; returns False then (the caller closes the link).
        """
        refusal = epoch_jump_refusal(self.epoch, epoch, self.settings.max_epoch_jump)
        if refusal is not None:
            self.epoch_refusal = f"{source}: {refusal}"
            metrics.EPOCH_REFUSED.inc()
            log.error(
                "refusing the epoch of %s: %s; if this broker's own epoch is the wrong one, "
                "see `twinmq-broker epoch show|set` (docs/replication.md)", source, refusal,
            )  # fmt: skip
            return False
        if not self.epochs.raise_to(epoch):
            return True
        metrics.EPOCH.set(epoch)
        log.warning("learned epoch %d from %s", epoch, source)
        if self.role == "active":
            log.warning("a newer epoch exists: stepping down to passive")
            self.loop.create_task(self.set_role("passive", epoch, None))
        return True

    async def set_role(
        self, role: Role, epoch: int, replicate_from: str | None, *, force: bool = False
    ) -> None:
        """Change role at `epoch` (POST /role).

        Raises StaleEpoch for an old epoch, DamagedBroker to activate a damaged
        broker without `force`.
        """
        current = self.epoch
        if epoch < current or (epoch == current and role == "active" and self.role != "active"):
            raise StaleEpoch(
                f"epoch {epoch} is stale: this broker has seen epoch {current}"
                + (" (activation needs a new epoch)" if epoch == current else "")
            )
        if role == "active" and self.role != "active":
            self._check_activation(force)
        self.epochs.raise_to(epoch)
        metrics.EPOCH.set(self.epoch)
        previous = self.role
        if role == "active" and self.replica is not None:
            # Before the role changes: an active whose Lease keeper has not been told of
            # the activation yet fences itself (it did, while this stop awaited).
            replica, self.replica = self.replica, None
            await replica.stop()
        self.role = role
        metrics.ROLE.set(1 if role == "active" else 0)
        if role == "active":
            self.replicate_from = None
            self.vhost.next_mid = max(self.vhost.next_mid, first_mid(self.epoch))
            if previous != "active":
                if self.lease is not None:
                    self.lease.activated()
                self.vhost.set_replica(False)
                self.mirroring.took_over()
                self.committer.guard(False)
                self.federation.start()
                log.warning("promoted to active in epoch %d", self.epoch)
            return
        if previous == "active":
            log.warning("demoted to passive in epoch %d: closing client connections", self.epoch)
            # Clients first: detaching drops the replication guard, and a publish still
            # waiting for the passive must not be confirmed on the way out.
            self.close_clients(f"{self.settings.name} is now passive (epoch {self.epoch})")
            self.source.detach("demoted")
            self.vhost.set_replica(True)
            await self.federation.stop()
        if replicate_from != self.replicate_from or self.replica is None:
            if self.replica is not None:
                await self.replica.stop()
                self.replica = None
            self.replicate_from = replicate_from
            if replicate_from:
                self.replica = ReplicaClient(self, replicate_from)
                self.replica.start()

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Open the listeners and background tasks."""
        from twinmq.broker.admin import start_admin

        self.committer.start()
        self.committer.on_failed = self._batch_failed
        self.committer.on_withdraw = self._withdraw_failed
        metrics.EPOCH.set(self.epoch)
        metrics.ROLE.set(1 if self.role == "active" else 0)
        server = await self.loop.create_server(
            lambda: AMQPProtocol(self),
            self.settings.host,
            self.settings.port,
            reuse_address=True,
            backlog=1024,
        )
        self._servers.append(server)
        admin_tls = self.admin_tls
        admin_context = admin_tls.context if admin_tls is not None else None
        self._servers.append(await start_admin(self, admin_context))
        if admin_tls is not None:
            self._tasks.append(self.loop.create_task(reload_every(admin_tls.reload_if_changed)))
        if self._replication_tls is not None:
            reload = self._replication_tls.reload_if_changed
            self._tasks.append(self.loop.create_task(reload_every(reload)))
        self._servers.append(
            await self.source.start(self.settings.host, self.settings.replication_port)
        )
        if self.tls is not None:
            self._amqps = await self.loop.create_server(
                lambda: AMQPProtocol(self),
                self.settings.host,
                self.settings.tls_port,
                ssl=self.tls.context,
                ssl_handshake_timeout=self.limits.handshake_timeout,
                reuse_address=True,
                backlog=1024,
            )
            self._servers.append(self._amqps)
            self._tasks.append(self.loop.create_task(reload_every(self.tls.reload_if_changed)))
        self._tasks.append(self.loop.create_task(self.source.ping_loop()))
        await self.mirroring.start(self.settings.host)
        if self.role == "active":
            self.federation.start()
        if self.role == "passive" and self.replicate_from:
            self.replica = ReplicaClient(self, self.replicate_from)
            self.replica.start()
        self._tasks.append(self.loop.create_task(self._heartbeats()))
        if self.lease is not None:
            self._tasks.append(self.loop.create_task(self.lease.run()))
        self._tasks.append(self.loop.create_task(self._save_dedup_periodically()))
        self._tasks.append(self.loop.create_task(self.monitor.run()))
        if self.authenticator.path is not None:
            self._tasks.append(self.loop.create_task(reload_every(self._reload_users)))
        log.info(
            "broker %s %s listening: amqp %s:%d%s, admin %s:%d, replication %s:%d, data %s; "
            "%s in epoch %d",
            self.settings.name, self.product_version, self.settings.host, self.amqp_port,
            "" if self.amqps_port is None else f", amqps {self.settings.host}:{self.amqps_port}"
            + CLIENT_CERTS_LOG[self.settings.effective_tls_client_certs],
            self.settings.host, self.admin_port, self.settings.host, self.replication_port,
            self.settings.data_dir, self.role, self.epoch,
        )  # fmt: skip

    @property
    def amqp_port(self) -> int:
        """The bound AMQP port (useful with --port 0)."""
        return int(self._servers[0].sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    @property
    def amqps_port(self) -> int | None:
        """The bound AMQPS port (None without --tls-cert)."""
        if self._amqps is None:
            return None
        return int(self._amqps.sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    @property
    def admin_port(self) -> int:
        """The bound admin port."""
        return int(self._servers[1].sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    @property
    def replication_port(self) -> int:
        """The bound replication port."""
        return int(self._servers[2].sockets[0].getsockname()[1])  # type: ignore[attr-defined]

    def status(self) -> BrokerStatus:
        """A snapshot for the admin API (`GET /status`)."""
        return build_status(self)

    def _withdraw_failed(self, batch: int, streamed: bool) -> bool:
        """A batch failed: withdrawn here at once, and an active's passive, streamed it
        already, drops it too; whether its outcome waits for the passive (withdrawal.py).

        Should building or sending the withdrawal fail, the passive is made to catch up
        again instead (`resync`, as one that takes no withdrawals): its catch-up discards
        what this broker does not hold, and the outcome waits for it as for a WITHDRAWN.
        """
        try:
            # The keys of its publishes, which never enter this window (the batch failed),
            # while the passive may have admitted them: it forgets them too.
            keys = self.vhost.root.dedup.waiting_for(batch)
            ops = withdraw_everywhere(self.vhost.root.vhosts.values(), batch, self.committer.tap)
            if self.role != "active" or not streamed:
                return False
            return self.source.withdraw(batch, ops, keys)
        except Exception:
            log.exception("the withdrawal of failed batch %d failed", batch)
            if self.role != "active" or not streamed:
                return False
            self.source.resync(f"the withdrawal of failed batch {batch} failed")
            return self.committer.guarded

    def _batch_failed(self, batch: int, error: JournalError) -> None:
        """A batch's journal write failed: a passive stops.

        A passive applies a replicated batch to its queues before writing it, so
        after a failed write its memory holds messages its disk does not. Its next
        catch-up snapshot (taken from memory) would tell the active it has them, and
        a confirmed message would then live on one disk only. The disk is the truth:
        the passive exits, and its restart recovers from the journal and catches up
        (the active meanwhile confirms alone, degraded). An active just nacks.
        """
        if self.role == "passive":
            self.stop_passive(f"replicated batch {batch} could not be journaled ({error})")

    def stop_passive(self, reason: str) -> None:
        """A passive that cannot go on (a local write failed) exits 75, saying why.

        Its memory then holds what its disk does not; a restart recovers from the
        disk and catches up. Never silent: a passive that neither acknowledges nor
        exits leaves the operator a pair that looks whole (finding 10).
        """
        if not self.exit_requested.is_set():
            log.critical(
                "passive: %s; exiting so that a restart recovers from the journal "
                "(memory and disk disagree)",
                reason,
            )
            self.exit_code = EXIT_JOURNAL_FAILED
            self.exit_requested.set()

    async def stop(self) -> None:
        """Close clients with 320, flush the journal, stop everything."""
        for server in self._servers:
            server.close()
        if self.replica is not None:
            await self.replica.stop()
        # Clients before the passive: see set_role.
        self.close_clients("broker shutdown")
        await self.source.close()
        await self.mirroring.stop()
        await self.federation.stop()
        for task in self._tasks:
            task.cancel()
        await self.save_dedup_window()
        await self.committer.stop()
        await self.journal.close()
        if self.committer.audit is not None:
            try:
                self.committer.audit.close()
            except OSError as exc:
                # A full disk must not turn a passive's exit 75 into a crash (exit 1).
                log.error("audit log: last records not written at shutdown: %s", exc)
        log.info("broker %s stopped", self.settings.name)

    async def _save_dedup_periodically(self, interval: float = 5.0) -> None:
        while True:
            await asyncio.sleep(interval)
            await self.save_dedup_window()

    async def save_dedup_window(self) -> bool:
        """Write the dedup window now if it changed; False if the write failed.

        Under a lock, snapshot and write: an older snapshot written in a worker thread
        never lands after a newer one. A window missing keys only lets a re-send through
        (a duplicate); one holding a key whose message was withdrawn since would drop that
        message's re-send after confirming it, so a passive writes the window before it
        acknowledges a withdrawal or a catch-up's end (`replication/replica.py`)."""
        async with self._dedup_lock:
            dedup = self.vhost.dedup
            if not dedup.dirty:
                return True
            try:
                await self.loop.run_in_executor(None, dedup.write, dedup.snapshot())
            except OSError as exc:
                dedup.dirty = True  # the old snapshot stays in place; tried again later
                log.error("cannot save the dedup window (%s): keeping the previous one", exc)
                return False
            return True

    async def save_or_remove_dedup_window(self) -> bool:
        """Write the dedup window now, or else remove its file; False only if both failed.

        What a passive needs before it acknowledges a withdrawal or a catch-up's end is a
        file holding no key forgotten here: no file at all will do (a missing key only
        lets a re-send through, a duplicate, never a loss). Stopping instead made a
        passive on a nearly full disk (a new copy of the window needs room beside the
        old one) exit at every catch-up's end, restart, catch up, and exit again: the
        active degraded for good."""
        if await self.save_dedup_window():
            return True
        async with self._dedup_lock:
            dedup = self.vhost.dedup
            try:
                await self.loop.run_in_executor(None, dedup.remove_file)
            except OSError as exc:
                log.error("cannot remove the dedup window's file either (%s)", exc)
                return False
            dedup.dirty = True  # written again by the next save that finds room
            log.warning("dedup window file removed: a restart starts without it")
            return True

    async def _heartbeats(self) -> None:
        previous = self.loop.time()
        while True:
            await asyncio.sleep(HEARTBEAT_TICK)
            now = self.loop.time()
            # A tick half a tick late found the loop busy with a long step (a large read
            # of durable binds, a slow disk): the loop runs timers before the reads that
            # waited meanwhile, so the clients' heartbeats among them are not yet seen.
            stalled = now - previous > 1.5 * HEARTBEAT_TICK
            previous = now
            for proto in list(self.protocols):
                proto.heartbeat(now, stalled)
            if self.committer.audit is not None:
                self.committer.audit.tick()

    def _alarm_changed(self, reason: str | None) -> None:
        if reason is None:
            log.warning("resource alarm cleared: publishers unblocked")
        else:
            log.warning("resource alarm: %s: blocking publishers", reason)
        for proto in list(self.protocols):
            if proto.conn is not None:
                proto.conn.set_alarm(reason)
                proto._flush()
