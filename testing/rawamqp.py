"""A tiny AMQP 0-9-1 client over a raw socket, for feeding a broker bad input.

Frames are encoded and decoded with pamqp; nothing here hides what goes on the
wire, so a test can send exactly the bytes it means (a torn frame, a body with
no header) and read exactly what the broker answers. The pure helpers
(`handshake_frames`, `decode_frames`, ...) also serve the sans-I/O tests.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

from pamqp import commands, frame
from pamqp.base import Frame as MethodFrame
from pamqp.body import ContentBody
from pamqp.header import ContentHeader, ProtocolHeader
from pamqp.heartbeat import Heartbeat

from twinmq.testing.launcher import BrokerProcess

PROTOCOL_HEADER = b"AMQP\x00\x00\x09\x01"
FRAME_END = b"\xce"

AnyFrame = MethodFrame | ContentHeader | ContentBody | Heartbeat | ProtocolHeader


def encode(channel: int, value: AnyFrame) -> bytes:
    """One complete frame."""
    return frame.marshal(value, channel)


def raw_frame(ftype: int, channel: int, payload: bytes, end: bytes = FRAME_END) -> bytes:
    """A frame built by hand (any type, any payload, any frame-end octet)."""
    return struct.pack(">BHI", ftype, channel, len(payload)) + payload + end


def plain_response(user: str, password: str) -> str:
    """The SASL PLAIN response."""
    return f"\x00{user}\x00{password}"


def start_ok(user: str = "guest", password: str = "guest", mechanism: str = "PLAIN") -> bytes:
    """`connection.start-ok` for PLAIN or AMQPLAIN."""
    if mechanism == "AMQPLAIN":
        from pamqp import encode as table_encode

        # AMQPLAIN's response is a field table without its 4-byte length prefix.
        table = table_encode.field_table({"LOGIN": user, "PASSWORD": password})[4:]
        response: Any = table.decode("latin-1")  # pamqp wants str; ASCII names only
    else:
        response = plain_response(user, password)
    return encode(
        0,
        commands.Connection.StartOk(
            client_properties={"product": "twinmq-testing", "capabilities": {}},
            mechanism=mechanism,
            response=response,
        ),
    )


def handshake_frames(
    *,
    user: str = "guest",
    password: str = "guest",
    mechanism: str = "PLAIN",
    frame_max: int = 131072,
    channel_max: int = 2047,
    heartbeat: int = 0,
) -> list[bytes]:
    """What a client sends to open a connection, one element per step."""
    return [
        PROTOCOL_HEADER,
        start_ok(user, password, mechanism),
        encode(
            0,
            commands.Connection.TuneOk(
                channel_max=channel_max, frame_max=frame_max, heartbeat=heartbeat
            ),
        )
        + encode(0, commands.Connection.Open(virtual_host="/")),
    ]


def content(
    channel: int, body: bytes, properties: commands.Basic.Properties | None = None
) -> bytes:
    """A content header frame and one body frame."""
    data = encode(channel, ContentHeader(0, len(body), properties or commands.Basic.Properties()))
    if body:
        data += encode(channel, ContentBody(body))
    return data


def publish(
    channel: int,
    routing_key: str,
    body: bytes,
    exchange: str = "",
    properties: commands.Basic.Properties | None = None,
) -> bytes:
    """`basic.publish` with its content."""
    return encode(
        channel, commands.Basic.Publish(exchange=exchange, routing_key=routing_key)
    ) + content(channel, body, properties)


def decode_frames(data: bytes) -> list[tuple[int, AnyFrame]]:
    """Every complete frame in `data` as (channel, frame); raises on a torn tail."""
    frames: list[tuple[int, AnyFrame]] = []
    pos = 0
    while pos < len(data):
        used, channel, value = frame.unmarshal(data[pos:])
        frames.append((channel, value))
        pos += used
    return frames


class RawClient:
    """A blocking socket speaking AMQP frame by frame."""

    def __init__(self, host: str, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.timeout = timeout
        self._buf = b""
        self.server_properties: dict[str, Any] = {}  # from connection.start, once handshaken

    def close(self) -> None:
        """Close the socket (idempotent)."""
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, data: bytes) -> None:
        """Write bytes as they are."""
        self.sock.sendall(data)

    def send_frame(self, channel: int, value: AnyFrame) -> None:
        """Write one encoded frame."""
        self.send(encode(channel, value))

    def _fill(self, deadline: float) -> bool:
        """Read more bytes; False when the broker closed the socket."""
        self.sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            return False
        self._buf += chunk
        return True

    def read_exact(self, n: int) -> bytes:
        """Exactly `n` bytes (raises EOFError if the socket closes first)."""
        deadline = time.monotonic() + self.timeout
        while len(self._buf) < n:
            if not self._fill(deadline):
                raise EOFError(f"socket closed after {self._buf!r}")
        data, self._buf = self._buf[:n], self._buf[n:]
        return data

    def read_frame(self) -> tuple[int, AnyFrame]:
        """The next frame from the broker, heartbeats included."""
        header = self.read_exact(7)
        _, _, size = struct.unpack(">BHI", header)
        rest = self.read_exact(size + 1)
        _, channel, value = frame.unmarshal(header + rest)
        return channel, value

    def expect(self, kind: type[Any], channel: int | None = None) -> Any:
        """The next non-heartbeat frame, which must be a `kind` (on `channel`, if given)."""
        while True:
            number, value = self.read_frame()
            if isinstance(value, Heartbeat):
                continue
            assert isinstance(value, kind), f"expected {kind.__name__}, got {value!r}"
            if channel is not None:
                assert number == channel, f"{value!r} on channel {number}, expected {channel}"
            return value

    def wait_closed(self, timeout: float | None = None) -> bytes:
        """Read until the broker closes the socket; return what came before EOF.

        Raises `TimeoutError` if the socket is still open after `timeout`.
        """
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            try:
                if not self._fill(deadline):
                    data, self._buf = self._buf, b""
                    return data
            except TimeoutError:
                break
        raise TimeoutError("the broker kept the socket open")

    def handshake(self, heartbeat: int = 0, **kwargs: Any) -> commands.Connection.Tune:
        """Open the connection (as guest, unless told otherwise); returns the broker's tune."""
        header, start_ok_frame, tune_ok_open = handshake_frames(heartbeat=heartbeat, **kwargs)
        self.send(header)
        start = self.expect(commands.Connection.Start, 0)
        self.server_properties = dict(start.server_properties or {})
        self.send(start_ok_frame)
        tune = self.expect(commands.Connection.Tune, 0)
        self.send(tune_ok_open)
        self.expect(commands.Connection.OpenOk, 0)
        return tune  # type: ignore[no-any-return]

    def open_channel(self, number: int = 1) -> None:
        """`channel.open` and wait for its open-ok."""
        self.send_frame(number, commands.Channel.Open())
        self.expect(commands.Channel.OpenOk, number)

    def expect_connection_close(self, code: int) -> commands.Connection.Close:
        """The broker's `connection.close` with `code`; answers it with close-ok."""
        close = self.expect(commands.Connection.Close, 0)
        assert close.reply_code == code, f"expected {code}, got {close!r}"
        self.send_frame(0, commands.Connection.CloseOk())
        return close  # type: ignore[no-any-return]


def connections(broker: BrokerProcess) -> int:
    """The broker's count of client connections (from its admin API)."""
    return broker.admin.status().connections


def pika_round_trip(url: str, queue: str = "rawamqp.round-trip") -> None:
    """Prove a real client (pika) still works: declare, publish with a confirm, get, ack."""
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        channel.queue_declare(queue, auto_delete=False)
        channel.queue_purge(queue)
        channel.basic_publish("", queue, b"still serving")
        method, _, body = channel.basic_get(queue)
        assert method is not None and body == b"still serving"
        channel.basic_ack(method.delivery_tag)
        channel.queue_delete(queue)
    finally:
        connection.close()


def split_frames(data: bytes) -> list[tuple[int, int, bytes]]:
    """Split a byte stream into (type, channel, payload), checking sizes and frame-ends.

    Independent of the broker's reader, for checking what the broker writes.
    """
    frames: list[tuple[int, int, bytes]] = []
    pos = 0
    while pos < len(data):
        assert len(data) - pos >= 8, f"torn frame header at {pos}: {data[pos:]!r}"
        ftype, channel, size = struct.unpack_from(">BHI", data, pos)
        end = pos + 7 + size
        assert end < len(data), f"torn frame at {pos}"
        assert data[end : end + 1] == FRAME_END, f"bad frame-end at {end}"
        assert ftype in (1, 2, 3, 8), f"frame type {ftype} at {pos}"
        frames.append((ftype, channel, data[pos + 7 : end]))
        pos = end + 1
    return frames
