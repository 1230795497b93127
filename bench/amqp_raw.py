"""A minimal asyncio AMQP 0-9-1 client on pamqp, for the memory measurements.

No client library in between: the same handful of frames go to TwinMQ and to
RabbitMQ, so what the brokers hold for an idle connection or a queued message
is all that is measured. Not a general client: no heartbeats, one channel.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field
from typing import Any

from pamqp import body as pbody
from pamqp import commands, frame, header
from pamqp.base import Frame

PLAIN = "\0guest\0guest"


@dataclass
class RawConnection:
    """One AMQP connection: a socket and a frame buffer."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    server_properties: dict[str, Any] = field(default_factory=dict)
    _buf: bytes = b""

    @classmethod
    async def open(cls, host: str, port: int, *, heartbeat: int = 0) -> RawConnection:
        """Connect, log in as guest and open the vhost "/" (heartbeats off by default)."""
        reader, writer = await asyncio.open_connection(host, port)
        conn = cls(reader, writer)
        try:
            writer.write(header.ProtocolHeader().marshal())
            start = await conn.expect(commands.Connection.Start)
            conn.server_properties = dict(start.server_properties or {})
            conn.send(
                0,
                commands.Connection.StartOk(
                    client_properties={"product": "twinmq-bench"},
                    mechanism="PLAIN",
                    response=PLAIN,
                    locale="en_US",
                ),
            )
            tune = await conn.expect(commands.Connection.Tune)
            conn.send(
                0,
                commands.Connection.TuneOk(
                    channel_max=tune.channel_max, frame_max=tune.frame_max, heartbeat=heartbeat
                ),
            )
            conn.send(0, commands.Connection.Open(virtual_host="/"))
            await conn.expect(commands.Connection.OpenOk)
        except BaseException:
            writer.close()
            raise
        return conn

    def send(self, channel: int, value: Frame) -> None:
        """Queue one frame."""
        self.writer.write(frame.marshal(value, channel))

    async def read_frame(self) -> tuple[int, Any]:
        """The next (channel, frame)."""
        while True:
            if len(self._buf) >= 8:
                size = int.from_bytes(self._buf[3:7], "big")
                if len(self._buf) >= size + 8:
                    consumed, channel, value = frame.unmarshal(self._buf)
                    self._buf = self._buf[consumed:]
                    return channel, value
            chunk = await self.reader.read(65536)
            if not chunk:
                raise ConnectionError("broker closed the connection")
            self._buf += chunk

    async def expect(self, kind: type[Frame]) -> Any:
        """Read frames until one of type `kind`; a close is an error."""
        while True:
            _, value = await self.read_frame()
            if isinstance(value, kind):
                return value
            if isinstance(value, commands.Connection.Close | commands.Channel.Close):
                raise ConnectionError(f"closed by the broker: {value.reply_text}")

    async def close(self) -> None:
        """Close politely (best effort) and drop the socket."""
        with contextlib.suppress(Exception):
            self.send(0, commands.Connection.Close(reply_code=200, reply_text="bye"))
            await asyncio.wait_for(self.expect(commands.Connection.CloseOk), 5)
        self.writer.close()
        with contextlib.suppress(Exception):
            await self.writer.wait_closed()


async def server_properties(host: str, port: int) -> dict[str, Any]:
    """The broker's `connection.start` server properties (product, version, platform)."""
    conn = await RawConnection.open(host, port)
    props = conn.server_properties
    await conn.close()
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in props.items()}


async def open_idle(host: str, port: int, count: int, parallel: int = 50) -> list[RawConnection]:
    """Open `count` idle connections (no channel, heartbeats off)."""
    conns: list[RawConnection] = []
    sem = asyncio.Semaphore(parallel)

    async def one() -> None:
        async with sem:
            conns.append(await RawConnection.open(host, port))

    await asyncio.gather(*(one() for _ in range(count)))
    return conns


async def close_all(conns: list[RawConnection]) -> None:
    """Close every connection."""
    await asyncio.gather(*(c.close() for c in conns))


async def fill_queue(host: str, port: int, queue: str, count: int, size: int) -> int:
    """Publish `count` transient messages of `size` bytes to a fresh non-durable queue.

    Publisher confirms tell when the broker has taken them all; returns the
    queue's message count from a passive declare afterwards.
    """
    conn = await RawConnection.open(host, port)
    try:
        conn.send(1, commands.Channel.Open())
        await conn.expect(commands.Channel.OpenOk)
        conn.send(
            1,
            commands.Queue.Declare(queue=queue, durable=False, exclusive=False, auto_delete=False),
        )
        await conn.expect(commands.Queue.DeclareOk)
        conn.send(1, commands.Confirm.Select())
        await conn.expect(commands.Confirm.SelectOk)
        payload = b"x" * size
        one = b"".join(
            (
                frame.marshal(commands.Basic.Publish(exchange="", routing_key=queue), 1),
                frame.marshal(
                    header.ContentHeader(0, size, commands.Basic.Properties(delivery_mode=1)),
                    1,
                ),
                frame.marshal(pbody.ContentBody(payload), 1),
            )
        )
        window = 2000
        sent = acked = 0
        while acked < count:
            while sent < count and sent - acked < window:
                batch = min(500, count - sent, window - (sent - acked))
                conn.writer.write(one * batch)
                sent += batch
            await conn.writer.drain()
            _, value = await conn.read_frame()
            if isinstance(value, commands.Basic.Ack):
                acked = value.delivery_tag
            elif isinstance(value, commands.Basic.Nack):
                raise RuntimeError(f"broker nacked message {value.delivery_tag}")
            elif isinstance(value, commands.Connection.Close | commands.Channel.Close):
                raise ConnectionError(f"closed by the broker: {value.reply_text}")
        conn.send(1, commands.Queue.Declare(queue=queue, passive=True))
        ok = await conn.expect(commands.Queue.DeclareOk)
        return int(ok.message_count)
    finally:
        await conn.close()
