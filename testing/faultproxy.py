"""A TCP proxy on loopback that a test controls: cut, partition, delay, heal.

The proxy runs its own event loop on a daemon thread, so a synchronous test
(or an asyncio one, on another loop) can drive it with plain method calls:

- `cut()`: reset every connection and refuse new ones (accepted, then reset at
  once), as when a peer's host goes away;
- `partition()`: keep the sockets open but stop moving bytes either way, as a
  network partition that drops packets does: nobody sees a reset, the peers
  see silence;
- `delay(seconds)`: a one-way latency: every chunk arrives that long after it was
  read, chunks pipelined (a long link, not a slow one);
- `throttle(bytes_per_second)`: a thin pipe (a catch-up that takes a while);
- `heal()`: back to a plain pipe (bytes held by a partition flow again);
- `retarget(address)`: new connections go to another upstream;
- `hold_after(predicate)`: pass the upstream's length-prefixed frames (the replication
  link's: a u32 big-endian length, then that many bytes) up to the end of the first one
  `predicate` accepts, then hold the rest of that connection's upstream bytes for good
  (the client has exactly the frames before and that one: `held` is set once written);
  `hold_after(predicate, passing)` lets whole frames `passing` accepts through after it
  (pings: a link that stays up while a frame is held back).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# Chunks read and not yet written, per direction (up to 64 KiB each): a long link's
# bytes in flight, bounded so a stalled reader still pushes back on the sender.
_IN_FLIGHT_CHUNKS = 64


def split_address(address: str) -> tuple[str, int]:
    """`host:port` -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host, int(port)


class FaultProxy:
    """Forwards `host:port` (loopback, a free port by default) to `upstream`."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.upstream = upstream
        self.host = host
        self.port = port
        self.mode = "open"  # open | cut | partition
        self.latency = 0.0
        self.rate: float | None = None  # bytes per second, per direction and connection
        self.accepted = 0  # connections accepted (including refused ones)
        self.refused = 0
        self.bytes_forwarded = 0
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        # `hold_after`'s predicates: the last frame passed, the frames passing after it
        self._gate: tuple[Callable[[bytes], bool], Callable[[bytes], bool] | None] | None = None
        self.held = threading.Event()  # `hold_after`: its frame was passed on, nothing since
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.AbstractServer | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    # -- control (any thread) ------------------------------------------------------------

    def start(self) -> FaultProxy:
        """Start listening; returns self."""
        self._thread.start()
        self._call(self._start())
        return self

    @property
    def address(self) -> str:
        """`host:port` clients connect to."""
        return f"{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        """Connections being forwarded now."""
        return len(self._pairs)

    def cut(self) -> None:
        """Reset every connection; reset new ones as soon as they are accepted."""
        self._call(self._set_mode("cut"))

    def partition(self) -> None:
        """Stop moving bytes (both ways) without closing anything."""
        self._call(self._set_mode("partition"))

    def heal(self) -> None:
        """Forward again (held bytes flow on), accept new connections, no delay, no gate."""
        self._gate = None
        self.latency = 0.0
        self.rate = None
        self._call(self._set_mode("open"))

    def delay(self, seconds: float) -> None:
        """Hold every chunk `seconds` before passing it on."""
        self.latency = seconds

    def throttle(self, bytes_per_second: float | None) -> None:
        """Limit every connection to `bytes_per_second` each way (None: no limit)."""
        self.rate = bytes_per_second

    def hold_after(
        self,
        predicate: Callable[[bytes], bool],
        passing: Callable[[bytes], bool] | None = None,
    ) -> None:
        """Gate new connections' upstream-to-client bytes by frame (`predicate` gets each
        frame's bytes after its length): those up to the end of the first frame it accepts
        pass, the rest is held (never passed on), but for whole frames `passing` accepts
        (pings, which carry no state: the link stays alive while the rest is held);
        `held` is set once that frame is written. Resets the current connections: a
        stream is followed by frame from its start."""
        self.held.clear()
        self._gate = (predicate, passing)
        self._call(self._drop_all())

    def retarget(self, upstream: str, *, drop: bool = True) -> None:
        """Send new connections to `upstream`; reset the current ones unless `drop` is False."""
        self.upstream = upstream
        if drop:
            self._call(self._drop_all())

    def close(self) -> None:
        """Stop listening, reset everything, stop the thread."""
        if not self._thread.is_alive():
            return
        self._call(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    # -- the proxy's own loop ------------------------------------------------------------

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(
            self._accept, self.host, self.port, reuse_address=True
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _set_mode(self, mode: str) -> None:
        assert self._flowing is not None
        self.mode = mode
        if mode == "open":
            self._flowing.set()
            return
        self._flowing.clear()
        if mode == "cut":
            await self._drop_all()

    async def _drop_all(self) -> None:
        for client, upstream in list(self._pairs):
            _abort(client)
            _abort(upstream)
        self._pairs.clear()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._drop_all()
        # Every connection's task ends here: one left pending when the loop stops is
        # finalised later by the garbage collector on a closed loop, an unraisable error
        # that crashed pytest's end-of-run summary (CPython 3.11: "AST constructor
        # recursion depth mismatch").
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self.mode == "cut":
            self.refused += 1
            _abort(writer)
            return
        host, port = split_address(self.upstream)
        try:
            up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
        except (OSError, TimeoutError):
            _abort(writer)
            return
        if self.mode == "cut":  # cut while we were connecting
            _abort(writer)
            _abort(up_writer)
            return
        pair = (writer, up_writer)
        self._pairs.add(pair)
        gate = _FrameGate(*self._gate) if self._gate is not None else None
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer)),
            asyncio.ensure_future(self._pump(up_reader, writer, gate)),
        ]
        try:
            # Either side closing (or failing) ends the pair: AMQP and the replication
            # link never half-close.
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            self._pairs.discard(pair)
            for end in pair:
                with contextlib.suppress(Exception):
                    end.close()

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        gate: _FrameGate | None = None,
    ) -> None:
        """Move one direction's bytes: a reader and a writer with the chunks in flight
        between them, so a delay is a latency (every chunk arrives `latency` after it was
        read, chunks pipelined as on a long link) rather than a pause between chunks."""
        in_flight: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_IN_FLIGHT_CHUNKS)
        sender = asyncio.ensure_future(self._send(in_flight, writer))
        try:
            await self._receive(reader, in_flight, gate)
            await sender
        finally:
            sender.cancel()

    async def _receive(
        self,
        reader: asyncio.StreamReader,
        in_flight: asyncio.Queue[tuple[float, bytes]],
        gate: _FrameGate | None = None,
    ) -> None:
        flowing = self._flowing
        assert flowing is not None
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError, ConnectionError):
            while True:
                data = await reader.read(8192 if self.rate else 1 << 16)
                if not data and self.mode != "partition":
                    break
                # A partition stops reading too, so the sender's socket fills and it
                # feels the stall (and a FIN is held as bytes are).
                await flowing.wait()
                if gate is not None and data:
                    data = gate.feed(data)
                    if not data:
                        continue  # held: read on, pass nothing
                await in_flight.put((loop.time() + self.latency, data))
                if not data:
                    return
        await in_flight.put((loop.time(), b""))

    async def _send(
        self, in_flight: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter
    ) -> None:
        flowing = self._flowing
        assert flowing is not None
        loop = asyncio.get_running_loop()
        with contextlib.suppress(OSError, ConnectionError):
            while True:
                due, data = await in_flight.get()
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                await flowing.wait()
                if not data or writer.is_closing():
                    return
                writer.write(data)
                self.bytes_forwarded += len(data)
                await writer.drain()
                if isinstance(data, _Last):
                    self.held.set()
                if self.rate:
                    await asyncio.sleep(len(data) / self.rate)


class _Last(bytes):
    """The bytes that end a gate's accepted frame (`held` is set once they are written)."""


class _FrameGate:
    """Follows one stream of length-prefixed frames; passes bytes up to the end of the first
    frame `predicate` accepts, then only whole frames `passing` accepts (none without it)."""

    _LENGTH = struct.Struct(">I")

    def __init__(
        self, predicate: Callable[[bytes], bool], passing: Callable[[bytes], bool] | None = None
    ) -> None:
        self.predicate = predicate
        self.passing = passing
        self.shut = False
        self._buf = bytearray()  # from the start of the first frame not yet judged

    def _frames(self) -> list[tuple[int, int]]:
        """(start, end) of each whole frame at the head of the buffer."""
        buf = self._buf
        found: list[tuple[int, int]] = []
        pos = 0
        while len(buf) - pos >= self._LENGTH.size:
            (length,) = self._LENGTH.unpack_from(buf, pos)
            end = pos + self._LENGTH.size + length
            if end > len(buf):
                break
            found.append((pos, end))
            pos = end
        return found

    def _after(self, data: bytes) -> bytes:
        """Once shut: the whole frames of `data` (and what was held before) that pass."""
        if self.passing is None:
            return b""
        self._buf += data
        out = bytearray()
        frames = self._frames()
        for start, end in frames:
            if self.passing(bytes(self._buf[start + self._LENGTH.size : end])):
                out += self._buf[start:end]
        if frames:
            del self._buf[: frames[-1][1]]
        return bytes(out)

    def feed(self, data: bytes) -> bytes:
        """The part of `data` to pass on (a `_Last` if it ends the accepted frame)."""
        if self.shut:
            return self._after(data)
        base = len(self._buf)  # bytes of an incomplete frame, passed on already
        self._buf += data
        frames = self._frames()
        for start, end in frames:
            if self.predicate(bytes(self._buf[start + self._LENGTH.size : end])):
                self.shut = True
                self._buf.clear()
                cut = end - base
                return _Last(data[:cut] + self._after(data[cut:]))
        if frames:
            del self._buf[: frames[-1][1]]
        return data


def _abort(writer: asyncio.StreamWriter) -> None:
    """Reset a connection (RST, not a FIN), ignoring one already gone."""
    with contextlib.suppress(Exception):
        writer.transport.abort()
