"""A BrokerCluster checked end to end: messages published with confirms come back.

    python3 -m twinmq.client.roundtrip [--count N] [--timeout S]

The chart's `helm test` hook runs it in the TwinMQ image (helm/twinmq/templates/tests/).
It reads where and who from the environment (`TWINMQ_CHECK_HOST`, `TWINMQ_CHECK_PORT`,
`TWINMQ_CHECK_USERNAME`, `TWINMQ_CHECK_PASSWORD`), declares a durable queue of its own,
publishes `count` persistent messages through the virtual IP with publisher confirms
(client/publisher.py), consumes and acknowledges them, checks they are exactly the ones
sent, and deletes the queue. Exit code 0 when they all came back, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from collections.abc import Awaitable, Mapping, Sequence
from urllib.parse import quote

import aio_pika

from twinmq.client.publisher import ReliablePublisher

ENV_PREFIX = "TWINMQ_CHECK_"
EXIT_OK, EXIT_FAILED = 0, 1


def amqp_url(env: Mapping[str, str]) -> str:
    """The AMQP URL of the environment's host, port and user (default vhost)."""
    user = quote(env[ENV_PREFIX + "USERNAME"], safe="")
    password = quote(env[ENV_PREFIX + "PASSWORD"], safe="")
    host = env[ENV_PREFIX + "HOST"]
    port = env.get(ENV_PREFIX + "PORT", "5672")
    return f"amqp://{user}:{password}@{host}:{port}/%2F"


def bodies(count: int) -> list[bytes]:
    """The messages a round trip sends, in order."""
    return [str(n).encode() for n in range(count)]


async def roundtrip(url: str, count: int) -> list[bytes]:
    """Publish `count` numbered messages with confirms to a new queue, consume them all
    back, delete the queue; return the bodies received, in order."""
    queue_name = f"twinmq-check-{uuid.uuid4().hex[:12]}"
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(queue_name, durable=True)
        publisher = ReliablePublisher([url])
        try:
            for body in bodies(count):
                await publisher.publish(body, queue_name)
        finally:
            await publisher.close()
        received: list[bytes] = []
        async with queue.iterator() as messages:
            async for message in messages:
                async with message.process():
                    received.append(message.body)
                if len(received) == count:
                    break
        await queue.delete(if_unused=False, if_empty=False)
        return received
    finally:
        await connection.close()


async def _within(seconds: float, work: Awaitable[list[bytes]]) -> list[bytes]:
    async with asyncio.timeout(seconds):
        return await work


def main(argv: Sequence[str] | None = None) -> int:
    """Run the round trip against the environment's broker; print what happened."""
    parser = argparse.ArgumentParser(prog="python3 -m twinmq.client.roundtrip")
    parser.add_argument("--count", type=int, default=100, help="messages to send (100)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds in all (120)")
    args = parser.parse_args(argv)
    url = amqp_url(os.environ)
    where = f"{os.environ[ENV_PREFIX + 'HOST']}:{os.environ.get(ENV_PREFIX + 'PORT', '5672')}"
    try:
        received = asyncio.run(_within(args.timeout, roundtrip(url, args.count)))
    except (TimeoutError, aio_pika.exceptions.AMQPError, OSError) as exc:
        print(f"FAIL {where}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if received != bodies(args.count):
        print(f"FAIL {where}: sent {args.count}, received {received!r}", file=sys.stderr)
        return EXIT_FAILED
    print(f"OK {where}: {args.count} messages published with confirms and consumed back")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
