"""How many of the bytes written to a link the peer's host has taken.

A catch-up chunk is acknowledged only once the passive holds all of it, so on
a thin link the acknowledgements come further apart than `replication_timeout`
while the link moves all the time. What moves is visible on the active's side:
bytes leave the transport's write buffer for the kernel, and leave the kernel's
send queue once the peer's TCP acknowledges them (Linux `SIOCOUTQ`: bytes
written and not yet acknowledged by the peer). Counting only the transport's
buffer would miss a thin link whose chunks all fit in the kernel's buffers.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import termios

# SIOCOUTQ has the value of TIOCOUTQ (linux/sockios.h); for TCP it answers the bytes
# written and not yet acknowledged by the peer.
_SIOCOUTQ = termios.TIOCOUTQ


def unacknowledged(fd: int) -> int | None:
    """Bytes in the send queue of TCP socket `fd` the peer has not acknowledged (None: unknown)."""
    out = array.array("i", [0])
    try:
        fcntl.ioctl(fd, _SIOCOUTQ, out, True)
    except OSError:
        return None
    return out[0]


class DeliveryMeter:
    """Bytes written to a transport, and how many of them the peer's host has taken."""

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self._transport = transport
        self.written = 0
        self._fd: int | None = None
        self._last = 0
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                self._fd = sock.fileno()

    def wrote(self, n: int) -> None:
        """`n` more bytes were handed to the transport."""
        self.written += n

    def delivered(self) -> int:
        """Bytes written that left this host (or, where unknown, the transport's buffer).

        Monotonic: the peer only ever acknowledges more, and once the transport
        closes (its descriptor may be reused) the count stays where it was.
        """
        if self._transport.is_closing():
            return self._last
        buffered = self._transport.get_write_buffer_size()
        queued = None if self._fd is None else unacknowledged(self._fd)
        self._last = max(self._last, self.written - buffered - (queued or 0))
        return self._last
