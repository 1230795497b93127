"""Exactly-once enqueue across a failover: confirms, stable message ids, re-send on reconnect.

Every publish gets a `message_id` (a UUID unless the caller gives one) and is
kept until the broker confirms it. When the connection breaks (the active
broker died, or became passive and refused us) the publisher reconnects to
whichever address serves it and re-sends every unconfirmed message under the
same id; the broker's duplicate detection drops the copies it already had, so
each message is enqueued exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Sequence

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractConnection
from aio_pika.exceptions import AMQPError, DeliveryError

# Opts this connection in to the broker's duplicate detection by message id.
DEDUP_CLIENT_PROPERTY = "x-twinmq-deduplicate"

log = logging.getLogger(__name__)

RETRYABLE = (AMQPError, ConnectionError, OSError, asyncio.TimeoutError, RuntimeError)


class ReliablePublisher:
    """Publishes with confirms to a pair, surviving failovers without losing or doubling.

    `urls` are the brokers to try in turn (typically the virtual-IP Service alone,
    or both brokers' addresses).
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        confirm_timeout: float = 30.0,
        reconnect_delay: float = 0.2,
        give_up_after: float = 120.0,
    ) -> None:
        if not urls:
            raise ValueError("at least one broker URL is needed")
        self.urls = list(urls)
        self.confirm_timeout = confirm_timeout
        self.reconnect_delay = reconnect_delay
        self.give_up_after = give_up_after
        self.resends = 0
        self.reconnects = 0
        self._conn: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._next_url = 0
        self._lock = asyncio.Lock()
        self._generation = 0

    async def _connected(self) -> tuple[AbstractChannel, int]:
        """The current channel, connecting (round-robin over the URLs) if needed."""
        async with self._lock:
            if self._channel is not None and not self._channel.is_closed:
                return self._channel, self._generation
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.give_up_after
            while True:
                url = self.urls[self._next_url % len(self.urls)]
                self._next_url += 1
                try:
                    async with asyncio.timeout(10):
                        conn = await aio_pika.connect(
                            url, client_properties={DEDUP_CLIENT_PROPERTY: True}
                        )
                    channel = await conn.channel(publisher_confirms=True)
                except RETRYABLE as exc:
                    if loop.time() > deadline:
                        raise ConnectionError(f"no broker accepted us: {exc}") from exc
                    log.info("broker %s unavailable (%s); trying the next", url, exc)
                    await asyncio.sleep(self.reconnect_delay)
                    continue
                if self._generation:
                    self.reconnects += 1
                self._conn, self._channel = conn, channel
                self._generation += 1
                return channel, self._generation

    async def _drop(self, generation: int) -> None:
        async with self._lock:
            if generation != self._generation or self._conn is None:
                return
            conn, self._conn, self._channel = self._conn, None, None
        with contextlib.suppress(Exception):  # the connection is already broken
            async with asyncio.timeout(2):
                await conn.close()

    async def publish(
        self,
        body: bytes,
        routing_key: str,
        *,
        exchange: str = "",
        message_id: str | None = None,
        headers: dict[str, object] | None = None,
        persistent: bool = True,
    ) -> str:
        """Publish and return once the broker confirmed it; returns the message id.

        Raises `DeliveryError` if the broker refused the message (a nack that is
        not a lost connection, e.g. a full queue with reject-publish).
        """
        message_id = message_id or str(uuid.uuid4())
        message = aio_pika.Message(
            body,
            message_id=message_id,
            headers=headers or {},  # type: ignore[arg-type]
            delivery_mode=(
                aio_pika.DeliveryMode.PERSISTENT
                if persistent
                else aio_pika.DeliveryMode.NOT_PERSISTENT
            ),
        )
        attempt = 0
        while True:
            channel, generation = await self._connected()
            if attempt:
                self.resends += 1
            attempt += 1
            try:
                target = (
                    channel.default_exchange
                    if not exchange
                    else await channel.get_exchange(exchange)
                )
                await target.publish(message, routing_key, timeout=self.confirm_timeout)
                return message_id
            except DeliveryError:
                raise
            except RETRYABLE as exc:
                log.info("publish of %s not confirmed (%s): re-sending", message_id, exc)
                await self._drop(generation)

    async def close(self) -> None:
        """Close the connection."""
        if self._conn is not None:
            await self._drop(self._generation)
