"""Raw AMQP 0-9-1 for the memory and backlog measurements, on the test rigs' `RawClient`.

No client library in between: the same handful of frames go to TwinMQ and to
RabbitMQ, so what the brokers hold for an idle connection or a queued message
is all that is measured. Publishes are pipelined: one write carries a batch of
marshalled messages, acks are read between writes.
"""

from __future__ import annotations

import contextlib
from typing import Any

from pamqp import commands

from twinmq.testing.rawamqp import RawClient, publish

WINDOW = 2000  # unconfirmed messages in flight
BATCH = 500  # messages per write


def server_properties(host: str, port: int) -> dict[str, Any]:
    """The broker's `connection.start` server properties (product, version, platform)."""
    with RawClient(host, port) as conn:
        conn.handshake()
        props = conn.server_properties
        close(conn)
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in props.items()}


def open_idle(host: str, port: int, count: int) -> list[RawClient]:
    """Open `count` idle connections (no channel, heartbeats off)."""
    conns: list[RawClient] = []
    try:
        for _ in range(count):
            conns.append(RawClient(host, port))
            conns[-1].handshake()
    except BaseException:
        close_all(conns)
        raise
    return conns


def close(conn: RawClient) -> None:
    """Close politely (best effort) and drop the socket."""
    with contextlib.suppress(Exception):
        conn.send_frame(0, commands.Connection.Close(reply_code=200, reply_text="bye"))
        conn.expect(commands.Connection.CloseOk, 0)
    conn.close()


def close_all(conns: list[RawClient]) -> None:
    """Close every connection."""
    for conn in conns:
        close(conn)


def open_channel(host: str, port: int, queue: str, durable: bool) -> RawClient:
    """A connection with channel 1 open, `queue` declared, publisher confirms on."""
    conn = RawClient(host, port, timeout=60)
    try:
        conn.handshake()
        conn.open_channel(1)
        declare = commands.Queue.Declare(
            queue=queue, durable=durable, exclusive=False, auto_delete=False
        )
        conn.send_frame(1, declare)
        conn.expect(commands.Queue.DeclareOk, 1)
        conn.send_frame(1, commands.Confirm.Select())
        conn.expect(commands.Confirm.SelectOk, 1)
    except BaseException:
        conn.close()
        raise
    return conn


def publish_confirmed(
    conn: RawClient, queue: str, count: int, size: int, delivery_mode: int, window: int = WINDOW
) -> None:
    """Publish `count` messages of `size` bytes on channel 1 of `conn` (confirms on), at
    most `window` unconfirmed; returns once the broker has confirmed them all."""
    properties = commands.Basic.Properties(delivery_mode=delivery_mode)
    one = publish(1, queue, b"x" * size, properties=properties)
    step = max(1, min(BATCH, window // 4))
    sent = acked = 0
    while acked < count:
        while sent < count and sent - acked < window:
            batch = min(step, count - sent, window - (sent - acked))
            conn.send(one * batch)
            sent += batch
        _, value = conn.read_frame()
        if isinstance(value, commands.Basic.Ack):
            acked = max(acked, value.delivery_tag or 0)
        elif isinstance(value, commands.Basic.Nack):
            raise RuntimeError(f"broker nacked message {value.delivery_tag}")
        elif isinstance(value, commands.Connection.Close | commands.Channel.Close):
            raise ConnectionError(f"closed by the broker: {value.reply_text}")


def fill_queue(host: str, port: int, queue: str, count: int, size: int) -> int:
    """Publish `count` transient messages of `size` bytes to a fresh non-durable queue.

    Publisher confirms tell when the broker has taken them all; returns the
    queue's message count from a passive declare afterwards.
    """
    conn = open_channel(host, port, queue, durable=False)
    try:
        publish_confirmed(conn, queue, count, size, delivery_mode=1)
        conn.send_frame(1, commands.Queue.Declare(queue=queue, passive=True))
        ok = conn.expect(commands.Queue.DeclareOk, 1)
        return int(ok.message_count)
    finally:
        close(conn)
