"""One AMQP 0-9-1 connection as a state machine: bytes in, bytes out, no sockets.

The asyncio transport (`server.py`) feeds received bytes to `receive_data`,
writes what `data_to_send` returns, and looks at `closed`, `wants_read` and
`writable`; everything AMQP happens here and in `channel.py`.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cryptography import x509
from pamqp import commands
from pamqp.base import Frame as MethodFrame

from twinmq.broker import metrics
from twinmq.broker.auth import Authenticator, Login, LoginError
from twinmq.broker.channel import Channel
from twinmq.broker.codec import (
    FRAME_BODY,
    FRAME_HEADER,
    FRAME_HEARTBEAT,
    FRAME_METHOD,
    HEARTBEAT_FRAME,
    PROTOCOL_HEADER,
    Ack,
    ContentHeaderInfo,
    FrameReader,
    Publish,
    decode_method,
    encode_method,
)
from twinmq.broker.errors import AMQPError, ReplyCode, channel_error
from twinmq.broker.federation import marks as federation_marks
from twinmq.broker.federation.identity import (
    PEER_EXCHANGE,
    PEER_PROPERTY,
    SERVER_ID_PROPERTY,
    STATE_PROPERTY,
)
from twinmq.broker.federation.marks import MARKS_PROPERTY, MARKS_VERSION, MarkTeller, ToldMarks
from twinmq.broker.permissions import Operation, Resource
from twinmq.broker.routing import Exchange
from twinmq.broker.vhost import PublishResult, StagedChange, VirtualHost

log = logging.getLogger(__name__)

PRE_TUNE_FRAME_MAX = 131072
# A client property by which a publisher opts in to duplicate detection (twinmq.client does).
DEDUP_CLIENT_PROPERTY = "x-twinmq-deduplicate"
MIN_FRAME_MAX = 4096
GRANTS_CACHED = 1024  # permission answers a connection remembers (names are client-chosen)


@dataclass(frozen=True, slots=True)
class Limits:
    """What the server offers in `connection.tune`, and other per-connection limits."""

    frame_max: int = 131072
    channel_max: int = 2047
    heartbeat: int = 60
    max_message_size: int = 128 * 1024 * 1024
    max_connections_per_user: int = 0  # open connections per user (0: no limit)
    deduplicate_all: bool = False  # drop re-sent message ids for every client, not only opted-in
    handshake_timeout: float = 10.0  # seconds from the first byte to connection.open (RabbitMQ's)
    close_timeout: float = 30.0  # seconds our connection.close waits for close-ok


@functools.lru_cache(maxsize=64)
def _start_frame(version: str, server_id: str, mechanisms: str, marks: bool) -> bytes:
    """connection.start, encoded once per distinct answer: the server properties table
    is most of a connection's opening cost, and it is the same for every connection."""
    return encode_method(
        0,
        commands.Connection.Start(
            version_major=0,
            version_minor=9,
            server_properties={
                "product": "TwinMQ",
                "version": version,
                "platform": "Python",
                "copyright": "TwinMQ authors",
                "information": "https://twinmq.io",
                "capabilities": SERVER_CAPABILITIES,
                SERVER_ID_PROPERTY: server_id,
                STATE_PROPERTY: "amq.twinmq.state",
                PEER_PROPERTY: PEER_EXCHANGE,
                **({MARKS_PROPERTY: MARKS_VERSION} if marks else {}),
            },
            mechanisms=mechanisms,
            locales="en_US",
        ),
    )


class ConnectionContext(Protocol):
    """What a connection needs from the broker around it."""

    vhost: VirtualHost
    authenticator: Authenticator
    limits: Limits
    product_version: str

    def served_vhost(self, name: str) -> VirtualHost | None:
        """The vhost `name` if clients may open it now (the users file declares it), else
        None."""
        ...

    def await_durable(self, channel: Channel) -> None:
        """Call `channel.durable(batch)` as batches become durable."""
        ...

    def alarm(self) -> str | None:
        """The reason publishers are blocked, or None."""
        ...

    def refusal(self) -> str | None:
        """Why clients are refused right now (a passive broker), or None."""
        ...

    def write_refusal(self) -> str | None:
        """Why clients may read but not write here (a DR replica), or None."""
        ...

    def open_connections(self, user: str) -> int:
        """How many of `user`'s connections are open (past connection.open)."""
        ...

    @property
    def server_id(self) -> str:
        """This server's identifier (announced at connection.start; federation)."""
        ...

    def peer_refusal(self, peer: str, announced: object) -> str | None:
        """Why a federation peer announcing `announced` as its identifier is refused."""
        ...

    def peer_connected(self, peer: str, announced: object) -> None:
        """A federation peer announcing `announced` has logged in and opened its vhost."""
        ...

    def told_marks(self, vhost: str, queue: str) -> ToldMarks:
        """What to tell a federation link consuming `queue` in `vhost` (federation/marks.py)."""
        ...

    def marks_durable(self) -> tuple[int, int]:
        """(the batch covering every journal op so far, the newest batch complete)."""
        ...

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
        ...

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
        """A federation peer's status message for `amq.peer` of `vhost` (the one its link
        opened; published if `allowed`: its user may write there; else dropped and counted,
        never a channel error)."""
        ...


class State(enum.Enum):
    """Connection states, in the order a connection passes through them."""

    AWAIT_HEADER = "await-protocol-header"
    AWAIT_START_OK = "await-start-ok"
    AWAIT_LOGIN = "await-login"  # the password's KDF runs off the event loop
    AWAIT_TUNE_OK = "await-tune-ok"
    AWAIT_OPEN = "await-open"
    OPEN = "open"
    CLOSING = "closing"  # we sent connection.close and wait for close-ok
    CLOSED = "closed"


# States a connection must not linger in: the handshake, and waiting for close-ok.
_TIMED_PHASES: dict[State, str] = {
    State.AWAIT_HEADER: "handshake",
    State.AWAIT_START_OK: "handshake",
    State.AWAIT_LOGIN: "handshake",
    State.AWAIT_TUNE_OK: "handshake",
    State.AWAIT_OPEN: "handshake",
    State.CLOSING: "closing",
}


SERVER_CAPABILITIES: dict[str, Any] = {
    "publisher_confirms": True,
    "exchange_exchange_bindings": False,
    "basic.nack": True,
    "consumer_cancel_notify": True,
    "connection.blocked": True,
    "authentication_failure_close": True,
    "per_consumer_qos": True,
    "direct_reply_to": False,
}


class Connection:
    """An AMQP connection from `peer`; `loopback` tells whether `guest` may log in,
    `certificate` is the client's, verified by the TLS listener (EXTERNAL logins)."""

    def __init__(
        self,
        ctx: ConnectionContext,
        peer: str,
        *,
        loopback: bool,
        wake: Callable[[], None],
        certificate: x509.Certificate | None = None,
    ) -> None:
        self.ctx = ctx
        self.vhost = ctx.vhost
        self.peer = peer
        self.loopback = loopback
        self.certificate = certificate
        self.state = State.AWAIT_HEADER
        self.opened = False  # connection.open-ok sent: logged in, in a vhost
        self.user: str | None = None
        self.client_properties: dict[str, Any] = {}
        # This server's identifier when the peer is a federation link: deliveries to it
        # carry their origin and sequence (federation/headers.py); None for clients.
        self.origin_stamp: str | None = None
        # A federation link that asked for marks (federation/marks.py): told after its
        # deliveries how far its upstream will ever forward each origin.
        self.marks: MarkTeller | None = None
        self.capabilities: dict[str, Any] = {}
        self.channels: dict[int, Channel] = {}
        self.frame_max = PRE_TUNE_FRAME_MAX
        self.channel_max = ctx.limits.channel_max
        self.heartbeat = 0
        self.max_message_size = ctx.limits.max_message_size
        self.writable = True
        self.deduplicate = False  # drop re-sends by message id (the client opted in)
        self.blocked = False  # an alarm holds this connection's reads
        self._told_blocked = False  # connection.blocked sent for the current alarm
        self.close_reason: str | None = None
        self.last_received = 0.0
        self.last_sent = 0.0
        self._deadline: tuple[str, float] | None = None  # (phase, when) of a timed phase
        self._reader = FrameReader(PRE_TUNE_FRAME_MAX)
        self._grants: dict[tuple[str, str, str], bool] = {}  # authorize's answers
        self._grants_generation = 0
        self._header_buf = b""
        self._out: list[bytes] = []
        self._wake = wake
        # Per channel: its output held behind topology changes not yet durable, in order
        # (frames, and the changes' places among them). See `hold`.
        self._held: dict[int, deque[bytes | tuple[Channel, StagedChange]]] = {}

    # -- transport interface -------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """The transport should close the socket once it has written the output."""
        return self.state is State.CLOSED

    @property
    def wants_read(self) -> bool:
        """False while a resource alarm blocks this (publishing) connection."""
        return not self.blocked

    def send(self, data: bytes) -> None:
        """Queue bytes for the client and wake the transport if it was idle.

        `data` is whole frames of one channel (every caller sends so); a channel whose
        output is held (`hold`) keeps them until the changes before them are durable.
        """
        if self._held:
            held = self._held.get(int.from_bytes(data[1:3], "big"))
            if held is not None:
                held.append(data)
                return
        self._send_now(data)

    def _send_now(self, data: bytes) -> None:
        if not self._out:
            self._out.append(data)
            self._wake()
        else:
            self._out.append(data)

    def hold(self, channel: Channel, change: StagedChange) -> None:
        """Hold the channel's output from here until `change` is resolved.

        The method's reply (sent next) and whatever the channel sends after it wait
        for the group commit: AMQP wants the replies of a channel in order, and a
        later reply (a publish's confirm, a delivery) must not overtake an ok that
        is not yet allowed out. A refused change closes the channel with its error
        in the reply's place; what was held behind it is dropped (the client,
        closing, would discard it).
        """
        number = channel.number
        self._held.setdefault(number, deque()).append((channel, change))
        change.on_done = lambda: self._release(number)

    def _release(self, number: int) -> None:
        """Send what a channel holds, up to the first change not yet resolved."""
        held = self._held.get(number)
        if held is None:
            return
        while held:
            item = held[0]
            if isinstance(item, bytes):
                held.popleft()
                self._send_now(item)
                continue
            channel, change = item
            if not change.done:
                return
            held.popleft()
            if change.error is not None and self.channels.get(number) is channel:
                del self._held[number]
                self._refused_change(channel, change.error)
                return
            # Durable, or refused on a channel the client closed since: its close-ok
            # and anything later (a new channel of the number) still go, in order.
        del self._held[number]

    def _refused_change(self, channel: Channel, exc: AMQPError) -> None:
        """Close a channel in place of the ok of a change its group commit refused."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        metrics.PROTOCOL_ERRORS.labels(str(int(exc.code))).inc()
        log.info("closing channel %d of %s: %s", channel.number, self.peer, exc.reply_text)
        if not channel.closing:
            channel.release()
        # Even if a later error closed it already: that close was held behind this
        # change and dropped, and this error came first.
        self._send_now(
            encode_method(
                channel.number,
                commands.Channel.Close(
                    reply_code=int(exc.code),
                    reply_text=exc.reply_text,
                    class_id=exc.class_id,
                    method_id=exc.method_id,
                ),
            )
        )

    def await_durable(self, channel: Channel) -> None:
        """A channel waits for a journal batch (confirms, tx.commit-ok)."""
        self.ctx.await_durable(channel)

    def write_refusal(self) -> str | None:
        """Why publishes and topology changes are refused here (a DR replica), or None."""
        return self.ctx.write_refusal()

    def data_to_send(self) -> bytes:
        """Everything queued for the client since the last call."""
        if not self._out:
            return b""
        data = b"".join(self._out)
        self._out.clear()
        return data

    def receive_data(self, data: bytes, now: float = 0.0) -> None:
        """Process bytes from the client."""
        if self.state is State.CLOSED:
            return
        self.last_received = now
        if self.state is State.AWAIT_HEADER:
            self._header_buf += data
            if len(self._header_buf) < 8:
                if not PROTOCOL_HEADER.startswith(self._header_buf[:8]):
                    self._refuse_header()
                return
            header, data = self._header_buf[:8], self._header_buf[8:]
            self._header_buf = b""
            if header != PROTOCOL_HEADER:
                self._refuse_header()
                return
            self._start()
            if not data:
                return
        try:
            frames = self._reader.feed(data)
        except AMQPError as exc:
            # Nothing past a framing error can be parsed, not even the client's
            # close-ok: send connection.close, then hang up.
            self._connection_error(exc)
            self._closed(self.close_reason or exc.reply_text)
            return
        for ftype, channel, payload in frames:
            if self.closed:
                return
            try:
                self._frame(ftype, channel, payload)
            except AMQPError as exc:
                self._error(channel, exc)
            except Exception:
                log.exception("internal error on connection from %s", self.peer)
                self._connection_error(
                    AMQPError(ReplyCode.INTERNAL_ERROR, "internal error, see the broker log")
                )

    def heartbeat_due(self, now: float, stalled: bool = False) -> bool:
        """Send a heartbeat if idle; return False when the transport should drop the peer.

        That is: two missed heartbeats, a handshake not finished within
        `handshake_timeout`, or our connection.close unanswered for `close_timeout`
        (each timed from the first call that sees the phase). `stalled`: this check comes
        late, after the broker's loop was busy; what the peer sent meanwhile is unread.
        """
        phase = _TIMED_PHASES.get(self.state)
        if phase is not None:
            if self._deadline is None or self._deadline[0] != phase:
                limits = self.ctx.limits
                timeout = limits.close_timeout if phase == "closing" else limits.handshake_timeout
                self._deadline = (phase, now + timeout)
            elif now > self._deadline[1]:
                log.warning("%s timeout for %s, dropping it", phase, self.peer)
                self.close_reason = f"{phase} timeout"
                return False
            return True
        if not self.heartbeat or self.state is not State.OPEN:
            return True
        if self.blocked or stalled:
            # We are not reading (blocked, or busy: timers run before the reads waiting),
            # so the client's heartbeats are unseen (RabbitMQ's rule too for blocked).
            self.last_received = now
        elif now - self.last_received > 2 * self.heartbeat:
            log.warning("missed heartbeats from %s, closing", self.peer)
            self.close_reason = "missed heartbeats"
            return False
        if now - self.last_sent >= self.heartbeat / 2:
            self.send(HEARTBEAT_FRAME)
        return True

    def connection_lost(self) -> None:
        """The socket is gone: release channels, delete exclusive queues."""
        for channel in self.channels.values():
            if not channel.closing:
                channel.release()
        self.channels.clear()
        self._held.clear()
        if self.state is not State.CLOSED:
            self.state = State.CLOSED
        self.vhost.connection_closed(self)

    def set_alarm(self, reason: str | None) -> None:
        """A resource alarm was raised (reason) or cleared (None)."""
        if self.state is not State.OPEN:
            return
        if reason is not None:
            self._tell_blocked(reason)
        elif self._told_blocked:
            self._told_blocked = False
            self.send(encode_method(0, commands.Connection.Unblocked()))
        if reason is None and self.blocked:
            self.blocked = False
            self._wake()

    def _tell_blocked(self, reason: str) -> None:
        if self.capabilities.get("connection.blocked") and not self._told_blocked:
            self._told_blocked = True
            self.send(encode_method(0, commands.Connection.Blocked(reason=reason)))

    def force_close(self, code: ReplyCode, text: str) -> None:
        """Close the connection from the broker's side (shutdown, demotion)."""
        if self.state in (State.OPEN, State.AWAIT_OPEN, State.AWAIT_TUNE_OK):
            self._connection_error(AMQPError(code, text))

    # -- negotiation ---------------------------------------------------------------------

    def _refuse_header(self) -> None:
        # The spec's answer to a protocol header we do not speak: ours, then close.
        self.send(PROTOCOL_HEADER)
        self.close_reason = "unsupported protocol header"
        self.state = State.CLOSED
        self._wake()

    def _start(self) -> None:
        self.send(
            _start_frame(
                self.ctx.product_version,
                self.ctx.server_id,
                self.ctx.authenticator.mechanisms(self.certificate),
                federation_marks.ENABLED,
            )
        )
        self.state = State.AWAIT_START_OK

    def _start_ok(self, m: commands.Connection.StartOk) -> None:
        self.client_properties = dict(m.client_properties or {})
        self.capabilities = dict(self.client_properties.get("capabilities") or {})
        self.deduplicate = self.ctx.limits.deduplicate_all or bool(
            self.client_properties.get(DEDUP_CLIENT_PROPERTY)
        )
        announced = self.client_properties.get(SERVER_ID_PROPERTY)
        if announced is not None:
            # A federation link (docs/federation.md): refused if it claims our identifier,
            # else its deliveries carry their origin and sequence (the dedup key).
            refusal = self.ctx.peer_refusal(self.peer, announced)
            if refusal is not None:
                self._connection_error(AMQPError(ReplyCode.NOT_ALLOWED, refusal, 10, 11))
                return
            self.origin_stamp = self.ctx.server_id
            if (
                federation_marks.ENABLED
                and self.client_properties.get(MARKS_PROPERTY) == MARKS_VERSION
            ):
                self.marks = MarkTeller(
                    lambda queue: self.ctx.told_marks(self.vhost.name, queue),
                    self.send,
                    lambda: [
                        (consumer.queue, channel.number)
                        for channel in self.channels.values()
                        for consumer in channel.consumers.values()
                        if not consumer.no_ack
                    ],
                    self._acked_through,
                    self.ctx.marks_durable,
                )
        try:
            outcome = self.ctx.authenticator.login(
                m.mechanism, m.response, self.loopback, self.certificate
            )
        except LoginError as exc:
            self._refuse_login(exc)
            return
        if isinstance(outcome, Login):
            self.state = State.AWAIT_LOGIN
            loop = asyncio.get_running_loop()
            outcome.future.add_done_callback(
                lambda _: loop.call_soon_threadsafe(self._logged_in, outcome)
            )
            return
        self.user = outcome
        self._tune()

    def _logged_in(self, login: Login) -> None:
        """The KDF of a login is done (on the event loop again)."""
        if self.state is not State.AWAIT_LOGIN:
            return  # closed meanwhile
        try:
            self.user = login.result()
        except LoginError as exc:
            self._refuse_login(exc)
            return
        self._tune()

    def _refuse_login(self, exc: LoginError) -> None:
        metrics.AUTH_FAILURES.inc()
        log.warning("login refused for %s: %s", self.peer, exc)
        self._connection_error(AMQPError(ReplyCode.ACCESS_REFUSED, str(exc), 10, 11))

    def _tune(self) -> None:
        if self.origin_stamp is not None and self.user is not None:
            refusal = self.ctx.authenticator.link_refusal(self.user)
            if refusal is not None:
                self._refuse_login(LoginError(refusal))
                return
        limits = self.ctx.limits
        self.send(
            encode_method(
                0,
                commands.Connection.Tune(
                    channel_max=limits.channel_max,
                    frame_max=limits.frame_max,
                    heartbeat=limits.heartbeat,
                ),
            )
        )
        self.state = State.AWAIT_TUNE_OK

    def _tune_ok(self, m: commands.Connection.TuneOk) -> None:
        limits = self.ctx.limits
        frame_max = m.frame_max or limits.frame_max
        if frame_max < MIN_FRAME_MAX or frame_max > limits.frame_max:
            raise AMQPError(
                ReplyCode.NOT_ALLOWED,
                f"negotiated frame_max = {frame_max} is outside "
                f"{MIN_FRAME_MAX}..{limits.frame_max}",
                10,
                31,
            )
        channel_max = m.channel_max or limits.channel_max
        if channel_max > limits.channel_max:
            raise AMQPError(
                ReplyCode.NOT_ALLOWED,
                f"negotiated channel_max = {channel_max} is higher than {limits.channel_max}",
                10,
                31,
            )
        self.frame_max = frame_max
        self._reader.frame_max = frame_max
        self.channel_max = channel_max
        self.heartbeat = m.heartbeat
        self.state = State.AWAIT_OPEN

    def _open(self, m: commands.Connection.Open) -> None:
        vhost = self.ctx.served_vhost(m.virtual_host)
        if vhost is None:
            raise AMQPError(ReplyCode.NOT_ALLOWED, f"vhost '{m.virtual_host}' not found", 10, 40)
        if not self.ctx.authenticator.access.may_open(self.user or "", m.virtual_host):
            raise AMQPError(
                ReplyCode.NOT_ALLOWED,
                f"access to vhost '{m.virtual_host}' refused for user '{self.user}'",
                10,
                40,
            )
        refusal = self.ctx.refusal()
        if refusal is not None:
            raise AMQPError(ReplyCode.CONNECTION_FORCED, refusal, 10, 40)
        most = self.ctx.limits.max_connections_per_user
        if most and self.ctx.open_connections(self.user or "") >= most:
            metrics.CONNECTIONS_REFUSED.labels("per-user-limit").inc()
            raise AMQPError(
                ReplyCode.NOT_ALLOWED,
                f"access refused: user '{self.user}' has reached its limit of {most} connections",
                10,
                40,
            )
        self.vhost = vhost
        self.send(encode_method(0, commands.Connection.OpenOk()))
        self.state = State.OPEN
        self.opened = True
        if self.origin_stamp is not None:
            # News on amq.peer only once logged in: a stranger's attempts publish nothing.
            self.ctx.peer_connected(self.peer, self.client_properties.get(SERVER_ID_PROPERTY))

    # -- permissions ---------------------------------------------------------------------

    def allows(self, op: Operation, resource: Resource, name: str) -> bool:
        """Whether the user may do `op` on the resource. Answers are cached until the
        users file reloads."""
        auth = self.ctx.authenticator
        if auth.access.unrestricted:
            return True
        if self._grants_generation != auth.generation:
            self._grants.clear()
            self._grants_generation = auth.generation
        key = (op, resource, name)
        allowed = self._grants.get(key)
        if allowed is None:
            allowed = auth.access.allows(self.user or "", self.vhost.name, op, name)
            if len(self._grants) < GRANTS_CACHED:
                self._grants[key] = allowed
        return allowed

    def authorize(
        self, op: Operation, resource: Resource, name: str, method: tuple[int, int]
    ) -> None:
        """Raise 403 ACCESS_REFUSED (a channel error) unless the user may do `op` on the
        resource (RabbitMQ's words)."""
        if not self.allows(op, resource, name):
            raise channel_error(
                ReplyCode.ACCESS_REFUSED,
                f"{op} access to {resource} '{name}' in vhost '{self.vhost.name}' refused for "
                f"user '{self.user}'",
                method,
            )

    # -- frames --------------------------------------------------------------------------

    def _frame(self, ftype: int, number: int, payload: bytes) -> None:
        if ftype == FRAME_HEARTBEAT:
            if number != 0:
                raise AMQPError(ReplyCode.FRAME_ERROR, "heartbeat frame on a non-zero channel")
            return
        if number == 0:
            if ftype != FRAME_METHOD:
                raise AMQPError(ReplyCode.UNEXPECTED_FRAME, "content frame on channel 0")
            self._channel0(decode_method(payload))
            return
        if self.state is State.CLOSING:
            return
        if self.state is not State.OPEN:
            raise AMQPError(ReplyCode.CHANNEL_ERROR, "channel frame before connection.open-ok")
        channel = self.channels.get(number)
        if ftype == FRAME_METHOD:
            method = decode_method(payload)
            if channel is None:
                self._unopened_channel(number, method)
                return
            if channel.closing:
                if isinstance(method, commands.Channel.Close | commands.Channel.CloseOk):
                    self._closed_channel(number, method)
                return
            if channel.expecting_content:
                raise AMQPError(
                    ReplyCode.UNEXPECTED_FRAME,
                    f"expected content header for class 60, got a method frame on channel {number}",
                )
            if isinstance(method, Publish):
                alarm = self.ctx.alarm()
                if alarm is not None and not channel.peer_status(method):
                    # RabbitMQ's rule: stop reading from a connection that publishes
                    # while an alarm is on; this publish itself is still taken. Not for
                    # a federation link's status for amq.peer (transient, tiny): its
                    # connection's reads carry the acks that free this server's queues.
                    self.blocked = True
                    self._tell_blocked(alarm)
                channel.on_publish(method)
            elif isinstance(method, Ack):
                channel.on_ack(method)
            elif isinstance(method, commands.Channel.Close):
                channel.release()
                del self.channels[number]
                self.send(encode_method(number, commands.Channel.CloseOk()))
            elif isinstance(method, commands.Channel.CloseOk):
                raise AMQPError(ReplyCode.CHANNEL_ERROR, "unexpected channel.close-ok")
            elif isinstance(method, commands.Channel.Open):
                raise AMQPError(
                    ReplyCode.CHANNEL_ERROR,
                    f"second 'channel.open' seen on channel {number}",
                    20,
                    10,
                )
            else:
                channel.handle(method)
            return
        if channel is None:
            raise AMQPError(ReplyCode.CHANNEL_ERROR, f"expected 'channel.open' on channel {number}")
        if channel.closing:
            return
        if ftype == FRAME_HEADER:
            channel.on_header(payload)
        elif ftype == FRAME_BODY:
            channel.on_body(payload)

    def _unopened_channel(self, number: int, method: Any) -> None:
        if not isinstance(method, commands.Channel.Open):
            raise AMQPError(ReplyCode.CHANNEL_ERROR, f"expected 'channel.open' on channel {number}")
        if number > self.channel_max:
            raise AMQPError(
                ReplyCode.NOT_ALLOWED,
                f"channel {number} is above the negotiated channel_max {self.channel_max}",
                20,
                10,
            )
        self.channels[number] = Channel(self, number)
        self.send(encode_method(number, commands.Channel.OpenOk()))

    def _closed_channel(self, number: int, method: MethodFrame) -> None:
        # Both sides closing at once, or the client's close-ok to our channel.close.
        del self.channels[number]
        if isinstance(method, commands.Channel.Close):
            self.send(encode_method(number, commands.Channel.CloseOk()))

    def _channel0(self, method: Any) -> None:
        state = self.state
        if isinstance(method, commands.Connection.Close):
            self.send(encode_method(0, commands.Connection.CloseOk()))
            self._closed("client closed the connection")
        elif isinstance(method, commands.Connection.CloseOk) and state is State.CLOSING:
            self._closed(self.close_reason or "closed")
        elif state is State.CLOSING:
            return
        elif state is State.AWAIT_START_OK and isinstance(method, commands.Connection.StartOk):
            self._start_ok(method)
        elif state is State.AWAIT_TUNE_OK and isinstance(method, commands.Connection.TuneOk):
            self._tune_ok(method)
        elif state is State.AWAIT_OPEN and isinstance(method, commands.Connection.Open):
            self._open(method)
        elif state is State.OPEN and isinstance(method, commands.Connection.UpdateSecret):
            self.send(encode_method(0, commands.Connection.UpdateSecretOk()))
        else:
            raise AMQPError(
                ReplyCode.COMMAND_INVALID,
                f"unexpected {method.name} on channel 0 in state {state.value}",
            )

    # -- errors and closing --------------------------------------------------------------

    def channel_error(self, number: int, exc: AMQPError) -> None:
        """Close channel `number` (or the connection, for a connection-level error) with `exc`.

        For errors found outside a method handler, e.g. a transaction whose journal
        write failed after tx.commit was handled.
        """
        self._error(number, exc)

    def _error(self, number: int, exc: AMQPError) -> None:
        metrics.PROTOCOL_ERRORS.labels(str(int(exc.code))).inc()
        channel = self.channels.get(number)
        if exc.connection_level or channel is None or number == 0:
            self._connection_error(exc)
            return
        if channel.closing:
            return  # closed already (a refused staged change before this error): one close
        log.info("closing channel %d of %s: %s", number, self.peer, exc.reply_text)
        channel.release()
        self.send(
            encode_method(
                number,
                commands.Channel.Close(
                    reply_code=int(exc.code),
                    reply_text=exc.reply_text,
                    class_id=exc.class_id,
                    method_id=exc.method_id,
                ),
            )
        )

    def _connection_error(self, exc: AMQPError) -> None:
        if self.state in (State.CLOSING, State.CLOSED):
            return
        if exc.code != ReplyCode.ACCESS_REFUSED:
            metrics.PROTOCOL_ERRORS.labels(str(int(exc.code))).inc()
        log.info("closing connection from %s: %s", self.peer, exc.reply_text)
        self.close_reason = exc.reply_text
        if self.state is State.AWAIT_HEADER:
            self._closed(exc.reply_text)
            return
        self.send(
            encode_method(
                0,
                commands.Connection.Close(
                    reply_code=int(exc.code),
                    reply_text=exc.reply_text,
                    class_id=exc.class_id,
                    method_id=exc.method_id,
                ),
            )
        )
        for channel in self.channels.values():
            if not channel.closing:
                channel.release()
        self._held.clear()  # nothing of a channel goes after connection.close
        self.state = State.CLOSING
        if exc.code == ReplyCode.ACCESS_REFUSED and self.user is None:
            # RabbitMQ closes the socket right after refusing a login.
            self.state = State.CLOSED
            self._wake()

    def _acked_through(self, number: int) -> int:
        """Channel `number`'s highest delivery tag with every one up to it acknowledged."""
        channel = self.channels.get(number)
        if channel is None:
            return -1
        return min(channel.unacked, default=channel.next_tag) - 1

    def _closed(self, reason: str) -> None:
        if self.marks is not None:
            self.marks.close()
        for channel in self.channels.values():
            if not channel.closing:
                channel.release()
        self.channels.clear()
        self._held.clear()
        self.close_reason = reason
        self.state = State.CLOSED
        self._wake()
