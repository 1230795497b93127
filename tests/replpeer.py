"""A raw replication peer on loopback, for tests that play an attacker or a fake broker.

`RawLink` is one blocking-socket connection speaking the link's frames (or
any bytes); `FakeListener` accepts the connection of a passive that was
pointed at it (the role of a forged active); `hello_for` / `welcome_for`
compute the real proofs, for tests that play an authenticated peer.
"""

from __future__ import annotations

import socket
import time

from pydantic import BaseModel

from twinmq.broker.replication.handshake import new_nonce, transcript_proof
from twinmq.broker.replication.protocol import (
    PROTOCOL_VERSION,
    Challenge,
    FrameDecoder,
    FrameType,
    Hello,
    Welcome,
    encode,
)


def hello_for(token: str, challenge: Challenge, name: str, epoch: int) -> Hello:
    """A passive's valid HELLO answering `challenge` (for a test that knows the token)."""
    nonce = new_nonce()
    return Hello(
        name=name, epoch=epoch, nonce=nonce,
        proof=transcript_proof(
            token, "passive", active=challenge.name, passive=name,
            active_nonce=challenge.nonce, passive_nonce=nonce, epoch=epoch,
        ),
    )  # fmt: skip


def welcome_for(token: str, challenge: Challenge, hello: Hello, epoch: int) -> Welcome:
    """An active's valid WELCOME answering `hello` to `challenge`."""
    return Welcome(
        epoch=epoch,
        proof=transcript_proof(
            token, "active", active=challenge.name, passive=hello.name,
            active_nonce=challenge.nonce, passive_nonce=hello.nonce, epoch=epoch,
        ),
    )  # fmt: skip


class RawLink:
    """One replication connection driven by hand."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = FrameDecoder()

    @classmethod
    def connect(cls, host: str, port: int) -> RawLink:
        """Connect to a replication listener."""
        return cls(socket.create_connection((host, port), timeout=5))

    def send(self, ftype: FrameType, payload: bytes | BaseModel = b"") -> None:
        """Send one frame."""
        self.sock.sendall(encode(ftype, payload))

    def send_raw(self, data: bytes) -> None:
        """Send bytes as they are."""
        self.sock.sendall(data)

    def recv(self, timeout: float = 5.0) -> tuple[FrameType, bytes] | None:
        """The next frame, or None once the peer has closed the connection."""
        deadline = time.monotonic() + timeout
        while (frame := self.decoder.next()) is None:
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.decoder.push(data)
        return frame

    def expect(self, wanted: FrameType, timeout: float = 5.0) -> bytes:
        """The payload of the next frame, which must be `wanted`."""
        frame = self.recv(timeout)
        assert frame is not None, f"the peer closed the connection, {wanted.name} expected"
        assert frame[0] is wanted, f"{frame[0].name} instead of {wanted.name}: {frame[1]!r}"
        return frame[1]

    def closed_by_peer(self, timeout: float = 5.0) -> list[FrameType]:
        """Read until the peer closes the connection; the types of the frames it sent first.

        Raises TimeoutError if it is still open after `timeout`.
        """
        seen: list[FrameType] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                frame = self.recv(deadline - time.monotonic())
            except TimeoutError:
                break
            if frame is None:
                return seen
            seen.append(frame[0])
        raise TimeoutError(f"the peer kept the connection open for {timeout}s (sent {seen})")

    def close(self) -> None:
        """Close our end."""
        self.sock.close()

    def __enter__(self) -> RawLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FakeListener:
    """A listening socket a passive is pointed at: the test plays its active."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_server((host, 0))
        self.address = f"{host}:{self.sock.getsockname()[1]}"

    def accept(self, timeout: float = 10.0) -> RawLink:
        """The next connection (a passive retrying every second connects soon)."""
        self.sock.settimeout(timeout)
        conn, _ = self.sock.accept()
        conn.settimeout(5)
        return RawLink(conn)

    def challenge(self, name: str = "a", timeout: float = 10.0) -> tuple[RawLink, Challenge]:
        """Accept a passive, send it a CHALLENGE: (the link, the challenge sent)."""
        link = self.accept(timeout)
        challenge = Challenge(version=PROTOCOL_VERSION, name=name, nonce=new_nonce())
        link.send(FrameType.CHALLENGE, challenge)
        return link, challenge

    def close(self) -> None:
        """Stop listening."""
        self.sock.close()

    def __enter__(self) -> FakeListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
