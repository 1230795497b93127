"""The one frame reader of the replication link, for both of its ends.

Frames are bounded small (`MAX_HANDSHAKE_FRAME`) until the peer is
authenticated; `authenticated()` lifts the bound to `MAX_FRAME`.
"""

from __future__ import annotations

import asyncio

from twinmq.broker.replication.protocol import (
    MAX_FRAME,
    MAX_HANDSHAKE_FRAME,
    FrameDecoder,
    FrameType,
)


class FrameReader:
    """Frames from a stream, one at a time; `peer` names the other end in errors."""

    def __init__(self, reader: asyncio.StreamReader, peer: str, *, chunk: int = 1 << 16) -> None:
        self.peer = peer
        self._reader = reader
        self._decoder = FrameDecoder(MAX_HANDSHAKE_FRAME)
        self._chunk = chunk

    def authenticated(self) -> None:
        """The peer proved itself: frames up to `MAX_FRAME` from now on."""
        self._decoder.max_frame = MAX_FRAME

    async def next(self, silence: float | None = None) -> tuple[FrameType, bytes]:
        """The next frame; TimeoutError if no bytes come for `silence` seconds.

        Raises ConnectionError when the peer closes the link, ProtocolError on
        a malformed or oversized frame (before its payload is read).
        """
        while (frame := self._decoder.next()) is None:
            try:
                async with asyncio.timeout(silence):
                    data = await self._reader.read(self._chunk)
            except TimeoutError:
                # After this loop stalled (a long step, a full collection, SIGSTOP) the
                # timer and the peer's bytes come in the same turn, and the timer may win:
                # bytes already here are read (without waiting), not taken for silence.
                async with asyncio.timeout(0):
                    data = await self._reader.read(self._chunk)
            if not data:
                raise ConnectionError(f"{self.peer} closed the link")
            self._decoder.push(data)
        return frame

    def received(self) -> tuple[FrameType, bytes] | None:
        """The next frame if its bytes are already here, else None (never waits)."""
        return self._decoder.next()
