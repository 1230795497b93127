"""A federation link's AMQP 0-9-1 client: methods decoded, message content never touched.

An upstream delivers each message exactly as its publisher sent it. A general client
library decodes every content header into objects: pamqp (under aiormq) fails on a
timestamp past the year 9999 and closes the connection, so one such message, valid
AMQP that the broker accepted, stopped a link for good (redelivered, failing again);
and re-encoding decoded properties changes bytes it does not model (found by
`make fuzz`, content_header). This client keeps each delivery's content header as
the bytes received (the broker's own lossless codec reads what the link needs) and
uses pamqp only for methods, which the upstream broker itself writes.

What a link needs and nothing more: one channel, synchronous methods one at a time,
one consumer with manual acknowledgements, publishes in confirm mode (forwarding: the
content header sent as given, byte for byte), heartbeats, PLAIN login (or EXTERNAL: the
client certificate is the login), TLS for `amqps`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
import struct
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from pamqp import commands
from pamqp.base import Frame as Method
from pamqp.common import FieldTable
from pamqp.frame import marshal

from twinmq.broker import codec
from twinmq.broker.errors import AMQPError
from twinmq.broker.federation import marks
from twinmq.broker.federation.marks import ToldMarks

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_MAX = 131072  # what the link asks for (the broker's default)
CHANNEL = 1
OPEN_TIMEOUT = 30.0  # seconds for the TCP (and TLS) connection and the handshake
PIPELINE_WINDOW = 64  # synchronous methods sent ahead of their replies at most (see _sync)
_HEARTBEAT_FRAME = b"\x08\x00\x00\x00\x00\x00\x00\xce"
_BODY_SIZE = struct.Struct(">Q")


M = TypeVar("M", bound=Method)


class LinkClosed(ConnectionError):
    """The connection ended; the text says why (the upstream's reply, or ours)."""


@dataclass(frozen=True, slots=True)
class Delivery:
    """One message from the link's consumer, its content header as received."""

    delivery_tag: int
    redelivered: bool
    exchange: str
    routing_key: str
    header: bytes  # the content header frame's payload, untouched
    body: bytes


@dataclass(frozen=True, slots=True)
class Address:
    """Where and who, from an `amqp://` or `amqps://` URI (RabbitMQ's URI spec)."""

    host: str
    port: int
    tls: bool
    username: str
    password: str
    vhost: str
    heartbeat: int
    mechanism: str = "PLAIN"  # or EXTERNAL: the TLS client certificate is the login

    @classmethod
    def parse(cls, uri: str, heartbeat: int) -> Address:
        """The address in `uri`; `heartbeat=` in its query overrides `heartbeat`,
        `auth_mechanism=external` (RabbitMQ's URI parameter) logs in with the client
        certificate (SASL EXTERNAL) instead of the user and password."""
        parts = urlsplit(uri)
        if parts.scheme not in ("amqp", "amqps"):
            raise ValueError(f"not an AMQP URI: {parts.scheme}://")
        tls = parts.scheme == "amqps"
        query = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p)
        vhost = unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
        return cls(
            host=parts.hostname or "localhost",
            port=parts.port or (5671 if tls else 5672),
            tls=tls,
            username=unquote(parts.username or "guest"),
            password=unquote(parts.password or "guest"),
            vhost=vhost,
            heartbeat=int(query.get("heartbeat", heartbeat)),
            mechanism=auth_mechanism(uri),
        )


def auth_mechanism(uri: str) -> str:
    """The SASL mechanism `uri` asks for: `auth_mechanism=plain` (the default) or
    `external` in its query, as RabbitMQ's federation and shovel URIs say it."""
    values = [v for k, v in parse_qsl(urlsplit(uri).query) if k == "auth_mechanism"]
    wanted = (values[-1] if values else "plain").upper()
    if wanted not in ("PLAIN", "EXTERNAL"):
        raise ValueError(f"auth_mechanism={wanted.lower()}: plain or external")
    return wanted


class LinkClient:
    """One connection with one channel (see the module); `connect` opens it."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        server_properties: dict[str, Any],
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.server_properties = server_properties
        self.closing: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        """Done when the connection ended, with `LinkClosed` saying why."""
        self._frames = codec.FrameReader(FRAME_MAX)
        self._rpc_lock = asyncio.Lock()
        # Replies awaited, in the order their methods were sent (a channel answers in order).
        self._replies: collections.deque[asyncio.Future[object]] = collections.deque()
        self._on_delivery: Callable[[Delivery], None] | None = None
        # The upstream's marks (marks.py), in stream order with the deliveries.
        self._on_marks: Callable[[ToldMarks], None] | None = None
        # Other consumers of the channel (no-ack), by consumer tag: the state subscription.
        self._watchers: dict[str, Callable[[Delivery], None]] = {}
        self._on_confirm: Callable[[int, bool, bool], None] | None = None
        self.publish_seq = 0  # the last publish's confirm sequence number
        self._frame_max = FRAME_MAX
        self._partial: tuple[commands.Basic.Deliver, bytes, int, list[bytes]] | None = None
        self._heard = time.monotonic()
        self._heartbeat = 0
        self._tasks: list[asyncio.Task[None]] = []

    # -- opening ------------------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        uri: str,
        client_properties: dict[str, Any],
        *,
        heartbeat: int = 10,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
    ) -> LinkClient:
        """Open the connection and channel 1; `LinkClosed` with the upstream's reason.
        With amqps, `tls` (a CA of the upstream's, a client certificate) or the system's
        CAs verify the upstream, for `server_name` (default: the URI's host)."""
        address = Address.parse(uri, heartbeat)
        context = (tls or ssl.create_default_context()) if address.tls else None
        async with asyncio.timeout(OPEN_TIMEOUT):
            reader, writer = await asyncio.open_connection(
                address.host, address.port, ssl=context,
                server_hostname=(server_name or address.host) if context is not None else None,
            )  # fmt: skip
            try:
                writer.write(PROTOCOL_HEADER)
                start = await _expect(reader, commands.Connection.Start)
                client = cls(reader, writer, dict(start.server_properties or {}))
                await client._open(address, client_properties, start)
            except BaseException:
                writer.close()
                raise
        return client

    async def _open(
        self, address: Address, properties: dict[str, Any], start: commands.Connection.Start
    ) -> None:
        if address.mechanism.encode() not in (start.mechanisms or "").encode().split():
            raise LinkClosed(
                f"the upstream offers no {address.mechanism} login ({start.mechanisms})"
                + (": it needs --tls-cert-login and this link's certificate verified"
                   if address.mechanism == "EXTERNAL" else "")
            )  # fmt: skip
        capabilities: FieldTable = {"consumer_cancel_notify": True, "connection.blocked": True}
        # EXTERNAL's response is empty: the upstream takes the user from our certificate.
        response = (
            "" if address.mechanism == "EXTERNAL" else f"\0{address.username}\0{address.password}"
        )
        self._send(
            0,
            commands.Connection.StartOk(
                client_properties={**properties, "capabilities": capabilities},
                mechanism=address.mechanism,
                response=response,
                locale="en_US",
            ),
        )
        tune = await _expect(self._reader, commands.Connection.Tune)
        frame_max = min(tune.frame_max or FRAME_MAX, FRAME_MAX)
        self._frame_max = frame_max
        wanted = address.heartbeat
        self._heartbeat = min(wanted, tune.heartbeat) if wanted and tune.heartbeat else wanted
        self._send(
            0,
            commands.Connection.TuneOk(
                channel_max=1, frame_max=frame_max, heartbeat=self._heartbeat
            ),
        )
        self._send(0, commands.Connection.Open(virtual_host=address.vhost))
        await _expect(self._reader, commands.Connection.OpenOk)
        self._send(CHANNEL, commands.Channel.Open())
        await _expect(self._reader, commands.Channel.OpenOk)
        loop = asyncio.get_running_loop()
        self._heard = time.monotonic()
        self._tasks.append(loop.create_task(self._read_loop(), name="twinmq-federation-read"))
        if self._heartbeat:
            self._tasks.append(loop.create_task(self._beat(), name="twinmq-federation-beat"))

    # -- methods ------------------------------------------------------------------------------

    async def call(self, method: Method, reply: type[M]) -> M:
        """Send a synchronous method on the channel and wait for its reply."""
        async with self._rpc_lock:
            if self.closing.done():
                raise self._closed_error()
            future = self._expect_reply()
            self._send(CHANNEL, method)
            return await self._reply_of(future, reply)

    async def pipeline(
        self,
        methods: Iterable[Method],
        reply: type[Method],
        done: Callable[[int], None],
        *,
        window: int = PIPELINE_WINDOW,
    ) -> None:
        """Send synchronous methods without waiting for each reply: at most `window`
        unanswered, `done(i)` as the i-th is answered (in order). An error reply closes
        the channel, which ends the connection (`LinkClosed`), as for `call`."""
        async with self._rpc_lock:
            pending: collections.deque[tuple[int, asyncio.Future[object]]] = collections.deque()
            for i, method in enumerate(methods):
                if self.closing.done():
                    raise self._closed_error()
                pending.append((i, self._expect_reply()))
                self._send(CHANNEL, method)
                if len(pending) >= window:
                    n, future = pending.popleft()
                    await self._reply_of(future, reply)
                    done(n)
            while pending:
                n, future = pending.popleft()
                await self._reply_of(future, reply)
                done(n)

    def _expect_reply(self) -> asyncio.Future[object]:
        future: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        self._replies.append(future)
        return future

    async def _reply_of(self, future: asyncio.Future[object], reply: type[M]) -> M:
        waiters: set[asyncio.Future[Any]] = {future, self.closing}
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if future not in done or future.cancelled():
            # Cancelled: `_end` gave up the replies of a connection that closed (its
            # CancelledError must not escape: it would end the link's task for good).
            future.cancel()
            raise self._closed_error()
        answer = future.result()
        if not isinstance(answer, reply):
            raise LinkClosed(f"expected {reply.__name__}, got {type(answer).__name__}")
        return answer

    async def exchange_declare(self, exchange: str, kind: str) -> None:
        """Declare a durable exchange."""
        declare = commands.Exchange.Declare(exchange=exchange, exchange_type=kind, durable=True)
        await self.call(declare, commands.Exchange.DeclareOk)

    async def queue_declare(self, queue: str) -> None:
        """Declare a durable queue."""
        await self.call(commands.Queue.Declare(queue=queue, durable=True), commands.Queue.DeclareOk)

    async def queue_delete(self, queue: str) -> int:
        """Delete `queue` (in use or not, empty or not); the ready messages dropped with it
        (0 for a queue that does not exist)."""
        ok = await self.call(commands.Queue.Delete(queue=queue), commands.Queue.DeleteOk)
        return int(ok.message_count or 0)

    async def queue_bind(
        self, queue: str, exchange: str, routing_key: str, arguments: FieldTable | None
    ) -> None:
        """Bind `queue` to `exchange`."""
        bind = commands.Queue.Bind(
            queue=queue, exchange=exchange, routing_key=routing_key, arguments=arguments
        )
        await self.call(bind, commands.Queue.BindOk)

    async def queue_unbind(
        self, queue: str, exchange: str, routing_key: str, arguments: FieldTable | None
    ) -> None:
        """Remove a binding of `queue`."""
        unbind = commands.Queue.Unbind(
            queue=queue, exchange=exchange, routing_key=routing_key, arguments=arguments
        )
        await self.call(unbind, commands.Queue.UnbindOk)

    async def queue_bind_many(
        self,
        queue: str,
        exchange: str,
        bindings: Sequence[tuple[str, FieldTable | None]],
        done: Callable[[int], None],
        *,
        unbind: bool = False,
    ) -> None:
        """Bind (or unbind) `queue` with each `(routing key, arguments)`, pipelined (queue.unbind
        has no nowait flag; the replies, in order, say which are done): `done(i)` for each."""
        if unbind:
            methods: Iterable[Method] = (
                commands.Queue.Unbind(queue=queue, exchange=exchange, routing_key=key,
                                      arguments=args)
                for key, args in bindings
            )  # fmt: skip
            await self.pipeline(methods, commands.Queue.UnbindOk, done)
        else:
            methods = (
                commands.Queue.Bind(queue=queue, exchange=exchange, routing_key=key,
                                    arguments=args)
                for key, args in bindings
            )  # fmt: skip
            await self.pipeline(methods, commands.Queue.BindOk, done)

    async def declare_private_queue(self) -> str:
        """Declare a server-named exclusive queue (gone with the connection); its name."""
        declare = commands.Queue.Declare(queue="", exclusive=True, auto_delete=True)
        ok = await self.call(declare, commands.Queue.DeclareOk)
        if not ok.queue:
            raise LinkClosed("the upstream named no queue for a server-named declare")
        return ok.queue

    async def watch(self, queue: str, tag: str, on_delivery: Callable[[Delivery], None]) -> None:
        """Consume `queue` without acknowledgements (messages that are news, not data to
        keep), beside the link's own consumer; each delivery to `on_delivery`."""
        self._watchers[tag] = on_delivery
        consume = commands.Basic.Consume(queue=queue, consumer_tag=tag, no_ack=True)
        await self.call(consume, commands.Basic.ConsumeOk)

    async def basic_qos(self, prefetch_count: int) -> None:
        """Limit unacknowledged deliveries."""
        await self.call(commands.Basic.Qos(prefetch_count=prefetch_count), commands.Basic.QosOk)

    async def basic_consume(
        self,
        queue: str,
        on_delivery: Callable[[Delivery], None],
        *,
        exclusive: bool = False,
        on_marks: Callable[[ToldMarks], None] | None = None,
    ) -> None:
        """Consume `queue` with manual acknowledgements; each delivery to `on_delivery`.
        `exclusive`: refused (403) while another consumer has the queue. `on_marks`: the
        upstream's marks frames (marks.py; ignored without it), in order with them."""
        self._on_delivery = on_delivery
        self._on_marks = on_marks
        consume = commands.Basic.Consume(
            queue=queue, consumer_tag="federation", exclusive=exclusive
        )
        await self.call(consume, commands.Basic.ConsumeOk)

    async def confirm_select(self, on_confirm: Callable[[int, bool, bool], None]) -> None:
        """Publisher confirms: `on_confirm(sequence, multiple, ack)` for each basic.ack/nack."""
        self._on_confirm = on_confirm
        await self.call(commands.Confirm.Select(), commands.Confirm.SelectOk)

    def basic_publish(self, exchange: str, routing_key: str, header: bytes, body: bytes) -> int:
        """Publish with `header` (a content header frame's payload) sent as given; the
        confirm sequence number (`LinkClosed` once the connection ended)."""
        if self.closing.done():
            raise self._closed_error()
        publish = commands.Basic.Publish(exchange=exchange, routing_key=routing_key)
        frames = [marshal(publish, CHANNEL), _content_frame(2, header)]
        step = self._frame_max - 8
        frames += [_content_frame(3, body[i : i + step]) for i in range(0, len(body), step)]
        self._writer.write(b"".join(frames))
        self.publish_seq += 1
        return self.publish_seq

    def basic_ack(self, delivery_tag: int) -> None:
        """Acknowledge one delivery (`LinkClosed` once the connection ended)."""
        self._send_live(commands.Basic.Ack(delivery_tag=delivery_tag))

    def basic_nack(self, delivery_tag: int, *, requeue: bool) -> None:
        """Reject one delivery, back to the queue with `requeue`."""
        self._send_live(commands.Basic.Nack(delivery_tag=delivery_tag, requeue=requeue))

    async def close(self) -> None:
        """Close politely (a second at most), then drop the socket."""
        if not self.closing.done():
            self._send(0, commands.Connection.Close(reply_code=200, reply_text="link stopped"))
            with contextlib.suppress(Exception):
                async with asyncio.timeout(1.0):
                    await asyncio.shield(self.closing)
            self._end("closed by this server")
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        self._writer.close()

    # -- the connection's life ----------------------------------------------------------------

    def _send(self, channel: int, method: Method) -> None:
        self._writer.write(marshal(method, channel))

    def _send_live(self, method: Method) -> None:
        if self.closing.done():
            raise self._closed_error()
        self._send(CHANNEL, method)

    def _closed_error(self) -> LinkClosed:
        if self.closing.done() and not self.closing.cancelled():
            exc = self.closing.exception()
            if isinstance(exc, LinkClosed):
                return exc
        return LinkClosed("connection closed")

    def _end(self, reason: str) -> None:
        if not self.closing.done():
            self.closing.set_exception(LinkClosed(reason))
            self.closing.exception()  # retrieved: no "never retrieved" warning
        while self._replies:
            future = self._replies.popleft()
            if not future.done():
                future.cancel()

    async def _read_loop(self) -> None:
        try:
            while True:
                data = await self._reader.read(65536)
                if not data:
                    self._end("the upstream closed the connection")
                    return
                self._heard = time.monotonic()
                for ftype, channel, payload in self._frames.feed(data):
                    self._frame(ftype, channel, payload)
        except (AMQPError, LinkClosed, OSError, ValueError) as exc:
            self._end(f"{type(exc).__name__}: {exc}")
        finally:
            if not self.closing.done():
                self._end("reader stopped")
            self._writer.close()

    def _frame(self, ftype: int, channel: int, payload: bytes) -> None:
        if ftype == 8:
            return  # heartbeat: `_heard` was updated by the read
        if self._partial is not None:
            self._content(ftype, payload)
            return
        if ftype != 1:
            raise LinkClosed(f"unexpected frame type {ftype} outside a message")
        if marks.is_marks(payload):
            told = marks.decode(payload)
            if told is not None and self._on_marks is not None:
                self._on_marks(told)
            return
        method = codec.decode_method(payload)
        if isinstance(method, commands.Connection.Close):
            self._send(0, commands.Connection.CloseOk())
            self._end(f"closed by the upstream: {method.reply_code} {method.reply_text}")
        elif isinstance(method, commands.Connection.CloseOk):
            self._end("closed")
        elif isinstance(method, commands.Channel.Close):
            self._send(CHANNEL, commands.Channel.CloseOk())
            self._end(f"channel closed by the upstream: {method.reply_code} {method.reply_text}")
        elif isinstance(method, commands.Basic.Deliver):
            self._partial = (method, b"", 0, [])
        elif isinstance(method, commands.Basic.Cancel):
            self._end("the upstream cancelled the link's consumer (its queue was deleted?)")
        elif isinstance(method, codec.Ack | commands.Basic.Ack | commands.Basic.Nack):
            # Publisher confirms (the broker's codec decodes basic.ack on its fast path).
            if self._on_confirm is None:
                raise LinkClosed(f"a {type(method).__name__} with no publish in confirm mode")
            ack = not isinstance(method, commands.Basic.Nack)
            self._on_confirm(method.delivery_tag or 0, bool(method.multiple), ack)
        elif isinstance(method, commands.Connection.Blocked | commands.Connection.Unblocked):
            pass  # the upstream's alarm: our acks still go through
        elif self._replies:
            future = self._replies.popleft()
            if not future.done():
                future.set_result(method)
        else:
            raise LinkClosed(f"unexpected {type(method).__name__} from the upstream")

    def _content(self, ftype: int, payload: bytes) -> None:
        assert self._partial is not None
        deliver, header, size, parts = self._partial
        if not header:
            if ftype != 2 or len(payload) < 12:
                raise LinkClosed("a delivery without its content header")
            size = _BODY_SIZE.unpack_from(payload, 4)[0]
            header = payload
        elif ftype == 3:
            parts.append(payload)
            size -= len(payload)
        else:
            raise LinkClosed(f"frame type {ftype} inside a message body")
        if size < 0:
            raise LinkClosed("a message body longer than its header says")
        self._partial = (deliver, header, size, parts)
        if size == 0:
            self._partial = None
            watcher = self._watchers.get(deliver.consumer_tag or "")
            delivery = Delivery(
                delivery_tag=deliver.delivery_tag or 0,
                redelivered=bool(deliver.redelivered),
                exchange=deliver.exchange or "",
                routing_key=deliver.routing_key or "",
                header=header,
                body=b"".join(parts),
            )
            if watcher is not None:
                watcher(delivery)
            elif self._on_delivery is not None:
                self._on_delivery(delivery)

    async def _beat(self) -> None:
        interval = self._heartbeat
        while not self.closing.done():
            await asyncio.sleep(interval / 2)
            if time.monotonic() - self._heard > 2 * interval:
                self._end(f"no frame from the upstream for {2 * interval}s (heartbeat)")
                self._writer.close()
                return
            self._writer.write(_HEARTBEAT_FRAME)


def _content_frame(ftype: int, payload: bytes) -> bytes:
    return struct.pack(">BHI", ftype, CHANNEL, len(payload)) + payload + b"\xce"


async def _expect(reader: asyncio.StreamReader, kind: type[M]) -> M:
    """The next method during the opening handshake (one frame at a time, nothing pending)."""
    head = await reader.readexactly(7)
    if head.startswith(b"AMQP"):
        raise LinkClosed("the upstream does not speak AMQP 0-9-1 (protocol header refused)")
    ftype, _channel, size = struct.unpack(">BHI", head)
    if size > FRAME_MAX:
        raise LinkClosed(f"a handshake frame of {size} bytes")
    payload = (await reader.readexactly(size + 1))[:-1]
    if ftype != 1:
        raise LinkClosed(f"frame type {ftype} during the handshake")
    method = codec.decode_method(payload)
    if isinstance(method, commands.Connection.Close):
        raise LinkClosed(f"refused by the upstream: {method.reply_code} {method.reply_text}")
    if not isinstance(method, kind):
        raise LinkClosed(f"expected {kind.__name__}, got {type(method).__name__}")
    return method
