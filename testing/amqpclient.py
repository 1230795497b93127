"""A small asyncio AMQP 0-9-1 client for fault tests: every wait has a deadline.

The fault suite needs clients that never hang on a paused or vanished broker
and that report exactly what happened to each publish: confirmed (basic.ack),
refused (basic.nack), or unknown (the connection died first). Frames are
pamqp's, except content headers: those are sent and read as bytes, so a publisher
can send any header it means (odd or invalid) and a consumer is never stopped by
one pamqp cannot decode. The client speaks only what the workload uses: one
channel, queue declare, qos, publisher confirms, transactions, consume and ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable
from typing import Any, NamedTuple

from pamqp import commands, frame
from pamqp.body import ContentBody
from pamqp.header import ContentHeader
from pamqp.heartbeat import Heartbeat

from twinmq.testing.rawamqp import PROTOCOL_HEADER, start_ok

CHANNEL = 1
FRAME_MAX = 131072
PERSISTENT = commands.Basic.Properties(delivery_mode=2)
CONTENT_HEADER = 2  # frame type


class ClientError(Exception):
    """The connection failed or was closed."""


class Refused(ClientError):
    """The broker closed the connection with a reply code (320 from a passive broker)."""

    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{code} {text}")
        self.code = code
        self.text = text


# (multiple, delivery tag, ack?) for every basic.ack / basic.nack received.
ConfirmCallback = Callable[[int, bool, bool], None]


class RawHeader(NamedTuple):
    """A content header as the client reads it: its body size, the properties unread."""

    body_size: int


class Delivery:
    """One message delivered to a consumer."""

    __slots__ = ("body", "redelivered", "tag")

    def __init__(self, tag: int, redelivered: bool) -> None:
        self.tag = tag
        self.redelivered = redelivered
        self.body = b""


class AMQPClient:
    """One connection with one channel (number 1)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, heartbeat: float
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.heartbeat = heartbeat
        self._replies: asyncio.Queue[Any] = asyncio.Queue()
        self.deliveries: asyncio.Queue[Delivery | None] = asyncio.Queue()
        self.on_confirm: ConfirmCallback | None = None
        self.error: ClientError | None = None
        self.closed = asyncio.Event()
        self._buf = bytearray()
        self._partial: Delivery | None = None
        self._remaining = 0
        self._tasks: list[asyncio.Task[None]] = []
        self.next_seq = 1  # the delivery tag of the next confirmed publish

    # -- connecting ------------------------------------------------------------------------

    @classmethod
    async def connect(cls, address: str, *, within: float = 3.0, heartbeat: int = 1) -> AMQPClient:
        """Open a connection and channel 1 as guest; raises `ClientError` (`Refused`)."""
        host, _, port = address.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, int(port)), within
            )
        except (OSError, TimeoutError) as exc:
            raise ClientError(f"cannot connect to {address}: {exc!r}") from exc
        client = cls(reader, writer, heartbeat)
        try:
            await asyncio.wait_for(client._handshake(heartbeat), within)
        except BaseException as exc:
            client.abort()
            if isinstance(exc, ClientError):
                raise
            if isinstance(exc, (OSError, TimeoutError, asyncio.IncompleteReadError)):
                raise ClientError(f"handshake with {address} failed: {exc!r}") from exc
            raise
        return client

    async def _handshake(self, heartbeat: int) -> None:
        self._writer.write(PROTOCOL_HEADER)
        await self._expect(commands.Connection.Start)
        self._writer.write(start_ok())  # guest, PLAIN
        tune = await self._expect(commands.Connection.Tune)
        self._send(
            0,
            commands.Connection.TuneOk(
                channel_max=tune.channel_max,
                frame_max=min(tune.frame_max or FRAME_MAX, FRAME_MAX),
                heartbeat=heartbeat,
            ),
        )
        self._send(0, commands.Connection.Open(virtual_host="/"))
        await self._expect(commands.Connection.OpenOk)
        self._send(CHANNEL, commands.Channel.Open())
        await self._expect(commands.Channel.OpenOk)
        self._tasks.append(asyncio.ensure_future(self._read_loop()))
        if heartbeat:
            self._tasks.append(asyncio.ensure_future(self._heartbeat_loop()))

    async def _read_frame(self) -> tuple[int, Any]:
        head = await self._reader.readexactly(7)
        ftype, channel, size = struct.unpack(">BHI", head)
        rest = await self._reader.readexactly(size + 1)
        if ftype == CONTENT_HEADER:
            # Only the body size: pamqp raises on some valid properties (odd timestamps).
            return channel, RawHeader(struct.unpack_from(">Q", rest, 4)[0])
        _, channel, value = frame.unmarshal(head + rest)
        return channel, value

    async def _expect(self, kind: type[Any]) -> Any:
        """During the handshake: the next non-heartbeat frame, which must be `kind`."""
        while True:
            _, value = await self._read_frame()
            if isinstance(value, Heartbeat):
                continue
            if isinstance(value, (commands.Connection.Close, commands.Channel.Close)):
                raise Refused(value.reply_code or 0, value.reply_text or "")
            if not isinstance(value, kind):
                raise ClientError(f"expected {kind.__name__}, got {value!r}")
            return value

    # -- the running connection -------------------------------------------------------------

    def _send(self, channel: int, value: Any) -> None:
        self._writer.write(frame.marshal(value, channel))

    async def _read_loop(self) -> None:
        silence = 3 * self.heartbeat if self.heartbeat else None
        try:
            while True:
                channel, value = await asyncio.wait_for(self._read_frame(), silence)
                self._dispatch(channel, value)
        except TimeoutError:
            self._fail(ClientError(f"no frame from the broker in {silence}s"))
        except (OSError, asyncio.IncompleteReadError, ConnectionError) as exc:
            self._fail(ClientError(f"connection lost: {exc!r}"))
        except ClientError as exc:
            self._fail(exc)

    def _dispatch(self, channel: int, value: Any) -> None:
        if isinstance(value, Heartbeat):
            return
        if isinstance(value, commands.Basic.Ack | commands.Basic.Nack):
            if self.on_confirm is not None:
                self.on_confirm(
                    value.delivery_tag, value.multiple, isinstance(value, commands.Basic.Ack)
                )
        elif isinstance(value, commands.Basic.Deliver):
            self._partial = Delivery(value.delivery_tag or 0, bool(value.redelivered))
        elif isinstance(value, RawHeader):
            self._remaining = value.body_size
            if not self._remaining:
                self._deliver()
        elif isinstance(value, ContentBody):
            assert self._partial is not None
            self._partial.body += value.value
            self._remaining -= len(value.value)
            if self._remaining <= 0:
                self._deliver()
        elif isinstance(value, commands.Connection.Close):
            with contextlib.suppress(Exception):
                self._send(0, commands.Connection.CloseOk())
            raise Refused(value.reply_code or 0, value.reply_text or "")
        elif isinstance(value, commands.Channel.Close):
            raise Refused(value.reply_code or 0, value.reply_text or "")
        elif isinstance(value, commands.Connection.CloseOk):
            raise ClientError("closed")
        else:
            self._replies.put_nowait(value)

    def _deliver(self) -> None:
        if self._partial is not None:
            self.deliveries.put_nowait(self._partial)
            self._partial = None

    async def _heartbeat_loop(self) -> None:
        with contextlib.suppress(Exception):
            while True:
                await asyncio.sleep(self.heartbeat / 2)
                self._writer.write(frame.marshal(Heartbeat(), 0))

    def _fail(self, error: ClientError) -> None:
        if self.error is None:
            self.error = error
        self.closed.set()
        self.deliveries.put_nowait(None)
        self._replies.put_nowait(None)
        self.abort()

    def abort(self) -> None:
        """Drop the connection at once."""
        self.closed.set()
        with contextlib.suppress(Exception):
            self._writer.transport.abort()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def _call(self, method: Any, reply: type[Any], within: float) -> Any:
        self.check()
        self._send(CHANNEL, method)
        try:
            value = await asyncio.wait_for(self._replies.get(), within)
        except TimeoutError:
            self._fail(ClientError(f"no answer to {type(method).__name__} in {within}s"))
            raise self.error or ClientError("timeout") from None
        self.check()
        if not isinstance(value, reply):
            raise ClientError(f"expected {reply.__name__}, got {value!r}")
        return value

    def check(self) -> None:
        """Raise the connection's error once it is closed."""
        if self.closed.is_set():
            raise self.error or ClientError("connection closed")

    # -- AMQP --------------------------------------------------------------------------------

    async def queue_declare(
        self, name: str, arguments: dict[str, Any] | None = None, within: float = 5.0
    ) -> None:
        """A durable queue (with `arguments`, e.g. a TTL and a dead-letter target)."""
        declare = commands.Queue.Declare(queue=name, durable=True, arguments=arguments)
        await self._call(declare, commands.Queue.DeclareOk, within)

    async def confirm_select(self, within: float = 5.0) -> None:
        """Publisher confirms on channel 1."""
        await self._call(commands.Confirm.Select(), commands.Confirm.SelectOk, within)

    async def tx_select(self, within: float = 5.0) -> None:
        """Transactions on channel 1: publishes take effect at `tx_commit`."""
        await self._call(commands.Tx.Select(), commands.Tx.SelectOk, within)

    async def tx_commit(self, within: float = 10.0) -> None:
        """Commit the channel's transaction; returns on commit-ok only.

        A commit the broker could not make durable closes the channel (541):
        that arrives as `Refused` and the connection is dropped.
        """
        await self._call(commands.Tx.Commit(), commands.Tx.CommitOk, within)

    async def qos(self, prefetch: int, within: float = 5.0) -> None:
        """Prefetch limit of channel 1."""
        await self._call(commands.Basic.Qos(prefetch_count=prefetch), commands.Basic.QosOk, within)

    async def consume(self, queue: str, within: float = 5.0) -> None:
        """Start a consumer with acks; deliveries arrive in `self.deliveries`."""
        await self._call(commands.Basic.Consume(queue=queue), commands.Basic.ConsumeOk, within)

    def publish(
        self, routing_key: str, body: bytes, header: bytes | None = None, *, exchange: str = ""
    ) -> int:
        """Publish a message to `exchange` (default: the default exchange); returns its
        confirm tag.

        Persistent, no other property, unless `header` gives the content header
        payload to send as it is (its body size is the caller's to get right)."""
        self.check()
        publish = commands.Basic.Publish(exchange=exchange, routing_key=routing_key)
        data = frame.marshal(publish, CHANNEL)
        if header is None:
            data += frame.marshal(ContentHeader(0, len(body), PERSISTENT), CHANNEL)
        else:
            data += struct.pack(">BHI", CONTENT_HEADER, CHANNEL, len(header)) + header + b"\xce"
        if body:
            data += frame.marshal(ContentBody(body), CHANNEL)
        self._writer.write(data)
        seq = self.next_seq
        self.next_seq += 1
        return seq

    def ack(self, tag: int) -> None:
        """Acknowledge one delivery."""
        self.check()
        self._send(CHANNEL, commands.Basic.Ack(delivery_tag=tag))

    async def drain(self) -> None:
        """Wait for the socket's write buffer to drain (raises if the connection died)."""
        self.check()
        try:
            await self._writer.drain()
        except (OSError, ConnectionError) as exc:
            self._fail(ClientError(f"connection lost: {exc!r}"))
            raise self.error or ClientError("closed") from exc

    async def close(self, within: float = 2.0) -> None:
        """Close politely if the broker answers in time; abort otherwise."""
        if not self.closed.is_set():
            with contextlib.suppress(Exception):
                self._send(0, commands.Connection.Close(reply_code=200, reply_text="bye"))
                await asyncio.wait_for(self.closed.wait(), within)
        self.abort()
