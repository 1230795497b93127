"""A link's silence timers against this broker's own stalls: a loop busy past a deadline
(a long synchronous step, a full garbage collection, SIGSTOP) must not read as the
peer's silence. The replication and mirror links time their reads with
`asyncio.timeout` (`FrameReader.next`), which after a stall may fire with the bytes that
came meanwhile unread: the reader then reads what is already there before calling it
silence (checked under uvloop, the broker's loop); the AMQP heartbeat, a periodic
check, needed `Connection.heartbeat_due(stalled=...)` instead. These keep it so.
Real sockets on loopback, real uvloop loops."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import uvloop

from twinmq.broker.replication.link import FrameReader
from twinmq.broker.replication.protocol import FrameType, encode

SILENCE = 0.5


def _block_the_loop(seconds: float) -> None:
    """This broker's own stall: the loop runs nothing meanwhile."""
    time.sleep(seconds)


def _run(main: Callable[[], Awaitable[None]]) -> None:
    uvloop.run(main())


_KEPT: list[asyncio.StreamWriter] = []  # our ends' writers: a collected one closes the socket


async def _pair() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Server]:
    """A connected socket pair on loopback: (our reader, the peer's writer, its server)."""
    accepted: asyncio.Future[asyncio.StreamWriter] = asyncio.get_running_loop().create_future()

    async def on_client(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set_result(writer)

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, ours = await asyncio.open_connection("127.0.0.1", port)
    _KEPT.append(ours)
    return reader, await accepted, server


def test_a_frame_that_came_while_the_loop_stalled_past_the_silence_is_read_not_timed_out() -> None:
    async def main() -> None:
        reader, peer, server = await _pair()
        frames = FrameReader(reader, "peer")
        waiting = asyncio.create_task(frames.next(SILENCE))
        await asyncio.sleep(0.05)  # the silence timer is armed
        peer.write(encode(FrameType.PING))
        await peer.drain()
        _block_the_loop(SILENCE * 3)  # this loop busy past the deadline, the PING unread
        ftype, _ = await waiting
        assert ftype is FrameType.PING
        server.close()

    _run(main)


def test_a_peer_that_really_stays_silent_still_times_out() -> None:
    async def main() -> None:
        reader, _peer, server = await _pair()
        frames = FrameReader(reader, "peer")
        try:
            await frames.next(SILENCE)
        except TimeoutError:
            pass
        else:
            raise AssertionError("a silent peer was not timed out")
        waiting = asyncio.create_task(frames.next(SILENCE))
        await asyncio.sleep(0.05)
        _block_the_loop(SILENCE * 3)  # a stall, and nothing sent: still a timeout, only later
        try:
            await waiting
        except TimeoutError:
            pass
        else:
            raise AssertionError("a silent peer was not timed out after a stall")
        server.close()

    _run(main)
