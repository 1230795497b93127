"""`DeliveryMeter`: bytes the peer's host took, over a real loopback TCP connection."""

from __future__ import annotations

import asyncio

from twinmq.broker.replication.delivery import DeliveryMeter
from twinmq.testing.waiting import until

PAYLOAD = b"x" * (16 * 1024 * 1024)  # more than loopback's socket buffers hold


def test_delivered_stops_while_the_peer_reads_nothing_and_reaches_all_once_it_reads() -> None:
    async def scenario() -> None:
        accepted: asyncio.Queue[asyncio.StreamReader] = asyncio.Queue()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await accepted.put(reader)
            await asyncio.sleep(3600)

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        peer = await accepted.get()  # it reads nothing until told
        meter = DeliveryMeter(writer.transport)
        writer.write(PAYLOAD)
        meter.wrote(len(PAYLOAD))
        # The peer's kernel takes what its buffers hold, then nothing more.
        previous = -1
        while (now := meter.delivered()) != previous:
            previous = now
            await asyncio.sleep(0.2)
        assert 0 < previous < len(PAYLOAD)
        # The transport's buffer alone would count bytes the kernel holds unsent.
        assert previous < meter.written - writer.transport.get_write_buffer_size()

        async def read_all() -> None:
            await peer.readexactly(len(PAYLOAD))

        reading = asyncio.create_task(read_all())
        await until("all delivered", lambda: meter.delivered() == len(PAYLOAD))
        await reading
        writer.close()
        server.close()

    asyncio.run(scenario())
