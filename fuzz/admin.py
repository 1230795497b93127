"""The admin API under fuzzed requests: a real broker's admin application, in process.

One input is one raw HTTP request (method, path, token choice, body from the fuzzer)
to the admin app of a real, unstarted `Broker` (its journal open, no AMQP listener),
served in this process so the fuzzer sees the coverage. The request's bytes go to the
protocol aiohttp's server makes for each accepted socket (`web.Server`'s
`RequestHandler`: the same HTTP parser, middleware and handlers as `start_admin`), over
a transport that keeps what it writes instead of a socket: no connect, accept or
poll per request (fuzzing speed). Checks: never a 500; `/healthz` always answers; and
the token boundary holds: without the admin token no request changes the broker's
role or epoch (the read-only token may only read). A role request that would make the
broker replicate from a host elsewhere is pointed at a closed loopback port instead
(tests never reach other addresses).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from aiohttp import web

from twinmq.broker.admin import make_app
from twinmq.broker.server import Broker
from twinmq.broker.settings import BrokerSettings

TOKEN = "fuzz-admin-token"
READ_TOKEN = "fuzz-read-token"
PATHS = ("/status", "/metrics", "/role", "/mirror/demote", "/mirror/promote",
         "/mirror/reseed", "/healthz", "/readyz", "/nothing")  # fmt: skip
METHODS = ("GET", "POST", "PUT", "HEAD", "DELETE")
CLOSED_PORT = "127.0.0.1:9"  # discard: nothing listens on loopback here


class _Transport(asyncio.Transport):
    """Where one request's protocol writes its answer instead of a socket.

    It behaves as asyncio's socket transport does for the server: `close` is told to
    the protocol (`connection_lost`) on the next loop turn, then `closed` resolves.
    """

    def __init__(self, protocol: asyncio.BaseProtocol, closed: asyncio.Future[None]) -> None:
        super().__init__()
        self.sent = bytearray()
        self._protocol = protocol
        self._closed = closed
        self._closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """A loopback client's addresses (the app's `request.remote`)."""
        return _EXTRA.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Keep the answer's bytes."""
        self.sent += data

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        """Keep the answer's bytes."""
        for data in list_of_data:
            self.sent += data

    def is_closing(self) -> bool:
        """Whether the server closed the connection."""
        return self._closing

    def close(self) -> None:
        """The server is done with the connection."""
        if not self._closing:
            self._closing = True
            self._closed.get_loop().call_soon(self._lost)

    def abort(self) -> None:
        """As `close` (nothing is buffered here)."""
        self.close()

    def pause_reading(self) -> None:
        """Nothing more is fed after the request."""

    def resume_reading(self) -> None:
        """Nothing more is fed after the request."""

    def _lost(self) -> None:
        self._protocol.connection_lost(None)
        if not self._closed.done():
            self._closed.set_result(None)


_EXTRA = {"peername": ("127.0.0.1", 40000), "sockname": ("127.0.0.1", 8081)}


class AdminFuzzer:
    """The admin app of one real broker, its HTTP server protocol driven in process."""

    def __init__(self, directory: Path) -> None:
        self.loop = asyncio.new_event_loop()
        settings = BrokerSettings.model_validate({
            "data_dir": directory, "port": 0, "admin_port": 0, "fsync": False,
            "audit": False, "log_level": "CRITICAL", "role": "passive", "epoch": 1,
            "admin_token": TOKEN, "admin_read_token": READ_TOKEN,
        })  # fmt: skip
        self.broker = self.loop.run_until_complete(self._open(settings))
        # As `start_admin` serves it, without the listening socket.
        self.runner = web.AppRunner(make_app(self.broker), access_log=None)
        self.loop.run_until_complete(self.runner.setup())
        server = self.runner.server
        assert server is not None
        self.server = server

    @staticmethod
    async def _open(settings: BrokerSettings) -> Broker:
        broker = Broker(settings)
        broker.committer.start()
        return broker

    def one_input(self, data: bytes) -> None:
        """Send the request `data` describes; check the answer and the token boundary."""
        self.loop.run_until_complete(self._one(data))

    async def _one(self, data: bytes) -> None:
        choice = data[:3].ljust(3, b"\0")
        method = METHODS[choice[0] % len(METHODS)]
        path = PATHS[choice[1] % len(PATHS)]
        token = (None, TOKEN, READ_TOKEN, TOKEN[:-1])[choice[2] % 4]  # the last: almost right
        body = _loopback_only(data[3:])
        before = (self.broker.role, self.broker.epoch)
        status = await self._request(method, path, token, body)
        assert status != 500, f"{method} {path}: internal error"
        if token != TOKEN:
            changed = (self.broker.role, self.broker.epoch) != before
            assert not changed, f"{method} {path}: a role changed without the admin token"
        assert await self._request("GET", "/healthz", None, b"") == 200

    async def _request(self, method: str, path: str, token: str | None, body: bytes) -> int:
        """One request on a connection of its own, as a client closing after it sends;
        the answer's status."""
        head = f"{method} {path} HTTP/1.1\r\nHost: admin\r\nConnection: close\r\n"
        if token is not None:
            head += f"Authorization: Bearer {token}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        protocol = self.server()  # what the server makes for each accepted socket
        closed: asyncio.Future[None] = self.loop.create_future()
        transport = _Transport(protocol, closed)
        protocol.connection_made(transport)
        protocol.data_received(head.encode("latin-1") + body)
        await closed
        status_line = bytes(transport.sent).split(b"\r\n", 1)[0]
        return int(status_line.split()[1])

    def close(self) -> None:
        """Stop the server and close the broker's journal."""
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.run_until_complete(self.broker.committer.stop())
        self.loop.run_until_complete(self.broker.journal.close())
        self.loop.close()


def _loopback_only(body: bytes) -> bytes:
    """A role request naming another host names a closed loopback port instead."""
    try:
        wanted = json.loads(body)
    except ValueError:
        return body
    if isinstance(wanted, dict) and isinstance(wanted.get("replicate_from"), str):
        wanted["replicate_from"] = CLOSED_PORT
        return json.dumps(wanted).encode()
    return body


def seeds() -> list[bytes]:
    """Valid requests: each path with each token, role requests, mirror requests."""
    out = []
    for m in range(2):  # GET, POST
        for p in range(len(PATHS)):
            for t in range(3):
                out.append(bytes((m, p, t)))
    role = json.dumps({"role": "passive", "epoch": 1, "replicate_from": CLOSED_PORT})
    out.append(bytes((1, 2, 1)) + role.encode())
    out.append(bytes((1, 2, 2)) + role.encode())
    out.append(bytes((1, 3, 1)) + b"{}")
    return out


def make_fuzzer() -> AdminFuzzer:
    """One per process, in a temporary folder of its own."""
    return AdminFuzzer(Path(tempfile.mkdtemp(prefix="twinmq-fuzz-admin-")))
