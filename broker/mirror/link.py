"""The source's end of the mirror link: connect, authenticate, stream events, trim on acks.

    source (connects)                         mirror (listens, listener.py)
                                       <-     CHALLENGE {name, nonce}
    HELLO {origin, nonce, proof}       ->
                                       <-     WELCOME {proof} (or REFUSE)
                                       <-     ACK u64: the origin's applied mark
    BATCH seq|0|event ... (pipelined)  ->
                                       <-     ACK u64 once applied and durable there
    PING                              <->     either way when idle

Frames are the pair's replication frames (`broker/replication/protocol.py`).
Events go in order, as many as the window allows (`window_events`,
`window_bytes` unacknowledged); an ACK trims the replication queue and opens the
window. Any error closes the connection; the link tries again every `retry`
seconds, and resumes after the mark the mirror announces: what was sent but not
acknowledged is sent again and skipped there. Only an active broker connects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

from twinmq.broker.mirror import metrics
from twinmq.broker.mirror.auth import Transcript
from twinmq.broker.mirror.source import MirrorSource
from twinmq.broker.replication.handshake import new_nonce
from twinmq.broker.replication.link import FrameReader
from twinmq.broker.replication.protocol import (
    Challenge,
    FrameType,
    Hello,
    ProtocolError,
    Refuse,
    Welcome,
    decode_model,
    decode_u64,
    encode,
    encode_batch,
)

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
SILENCE = 15.0  # no frame (not even a PING) for this long: the link is dead
PING_EVERY = 1.0


class MirrorLink:
    """Keeps one mirror link up while this broker is active."""

    def __init__(
        self,
        source: MirrorSource,
        address: str,
        key: str,
        origin: str,
        *,
        retry: float = 2.0,
        window_events: int = 4096,
        window_bytes: int = 16 * 1024 * 1024,
    ) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port = host or "127.0.0.1", int(port)
        self.address = address
        self.source = source
        self.key = key
        self.origin = origin
        self.retry = retry
        self.window_events = window_events
        self.window_bytes = window_bytes
        self.connected = False
        self.last_error: str | None = None
        self._wake = asyncio.Event()
        source.on_change = self._wake.set
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start connecting (and reconnecting) in the background."""
        self._task = asyncio.get_running_loop().create_task(self.run(), name="twinmq-mirror-link")

    async def stop(self) -> None:
        """Close the link."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._set_connected(False)

    async def run(self) -> None:
        """Connect while active; after any failure wait `retry` seconds and connect again."""
        while True:
            if self.source.ensure_active():
                try:
                    await self._session()
                except (OSError, ConnectionError, ProtocolError, TimeoutError) as exc:
                    if self.last_error != str(exc):
                        log.warning("mirror link to %s: %s", self.address, exc)
                    self.last_error = str(exc)
                finally:
                    self._set_connected(False)
            await asyncio.sleep(self.retry)

    def _set_connected(self, connected: bool) -> None:
        if connected != self.connected:
            log.info("mirror link to %s %s", self.address, "up" if connected else "down")
        self.connected = connected
        metrics.CONNECTED.set(1 if connected else 0)

    async def _session(self) -> None:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port), HANDSHAKE_TIMEOUT
        )
        try:
            frames = FrameReader(reader, f"mirror {self.address}")
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                applied = await self._authenticate(frames, writer)
            if not self.source.ensure_active():
                return
            self.source.acked(applied)
            self.last_error = None
            self._set_connected(True)  # the mark came back: a verified round trip
            sender = asyncio.get_running_loop().create_task(self._send(writer, applied))
            try:
                await self._receive(frames)
            finally:
                sender.cancel()
                with contextlib.suppress(asyncio.CancelledError, ConnectionError, OSError):
                    await sender
        finally:
            writer.close()
            with contextlib.suppress(OSError, ConnectionError):
                await writer.wait_closed()

    async def _authenticate(self, frames: FrameReader, writer: asyncio.StreamWriter) -> int:
        """The handshake; returns the mirror's applied mark for this origin."""
        ftype, payload = await frames.next()
        if ftype is not FrameType.CHALLENGE:
            raise ProtocolError(f"expected CHALLENGE, got {ftype.name}")
        challenge = decode_model(Challenge, payload)
        nonce = new_nonce()
        transcript = Transcript(challenge.name, self.origin, challenge.nonce, nonce)
        hello = Hello(
            name=self.origin, epoch=0, nonce=nonce, proof=transcript.proof(self.key, "source")
        )
        writer.write(encode(FrameType.HELLO, hello))
        ftype, payload = await frames.next()
        if ftype is FrameType.REFUSE:
            raise ConnectionError(f"refused: {decode_model(Refuse, payload).reason}")
        if ftype is not FrameType.WELCOME:
            raise ProtocolError(f"expected WELCOME, got {ftype.name}")
        why = transcript.refusal(self.key, decode_model(Welcome, payload).proof, "mirror")
        if why is not None:
            raise ProtocolError(f"the mirror did not prove itself: {why}")
        frames.authenticated()
        ftype, payload = await frames.next()
        if ftype is not FrameType.ACK:
            raise ProtocolError(f"expected ACK, got {ftype.name}")
        return decode_u64(payload)

    async def _send(self, writer: asyncio.StreamWriter, after: int) -> None:
        """Stream sendable events, within the window; PING when idle."""
        inflight: deque[tuple[int, int]] = deque()  # (seq, bytes) sent, not acknowledged
        inflight_bytes = 0
        sent = after
        loop = asyncio.get_running_loop()
        last_write = loop.time()
        while True:
            if not self.source.active:
                raise ConnectionError("this broker is no longer active")
            acked = self.source.acked_seq
            while inflight and inflight[0][0] <= acked:
                inflight_bytes -= inflight.popleft()[1]
            sent = max(sent, acked)
            room = self.window_events - len(inflight)
            events = []
            if room > 0 and inflight_bytes < self.window_bytes:
                events = self.source.sendable(sent, room, self.window_bytes - inflight_bytes)
            if events:
                for seq, body in events:
                    writer.write(encode_batch(seq, 0, body))
                    inflight.append((seq, len(body)))
                    inflight_bytes += len(body)
                sent = events[-1][0]
                metrics.SENT.inc(len(events))
                await writer.drain()
                last_write = loop.time()
                continue
            self._wake.clear()
            if loop.time() - last_write >= PING_EVERY:
                writer.write(encode(FrameType.PING))
                await writer.drain()
                last_write = loop.time()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), PING_EVERY)

    async def _receive(self, frames: FrameReader) -> None:
        """ACKs trim the queue and open the window; silence or a REFUSE ends the session."""
        while True:
            ftype, payload = await frames.next(SILENCE)
            if not self.source.active:
                raise ConnectionError("this broker is no longer active")
            if ftype is FrameType.ACK:
                self.source.acked(decode_u64(payload))
                self._wake.set()
            elif ftype is FrameType.REFUSE:
                raise ConnectionError(f"refused: {decode_model(Refuse, payload).reason}")
            elif ftype is not FrameType.PING:
                raise ProtocolError(f"unexpected {ftype.name} from the mirror")
