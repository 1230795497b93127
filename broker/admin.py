"""The admin HTTP API: health, readiness, status, Prometheus metrics, role changes and
the DR mirror's switchover (`POST /mirror/demote`, `POST /mirror/promote`).

`/healthz` and `/readyz` are open (kubelet probes); everything else needs the
bearer token, or, when no token is configured, a loopback client. A second,
read-only token (`--admin-read-token`) may read (`GET`: status, metrics) and
nothing else, so that a monitoring system's credentials cannot move a role. With
`--peer`, a `POST /role` whose `replicate_from` is not that peer is refused (403)
before anything changes (broker/replication/peer.py).
With `--admin-tls-cert` the API answers HTTPS only (the token never crosses the
network in clear), its certificate reloaded as the AMQPS one is (broker/tls.py).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol, cast

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import SecretStr, ValidationError

from twinmq.broker import metrics
from twinmq.broker.api import (
    BROKER_DAMAGED,
    FORBIDDEN,
    INVALID_ROLE_REQUEST,
    MIRROR_NOT_DRAINED,
    MIRROR_REFUSED,
    NOT_THE_PEER,
    PEER_UNRESOLVED,
    STALE_EPOCH,
    UNAUTHORIZED,
    VHOST_NOT_FOUND,
    VHOST_NOT_RECORDED,
    VHOST_REFUSED,
    BrokerStatus,
    ErrorBody,
    MirrorDemoteRequest,
    MirrorPromoteRequest,
    MirrorReseed,
    MirrorSwitch,
    Readiness,
    Role,
    RoleRequest,
    VhostDeleted,
)
from twinmq.broker.errors import (
    AMQPError,
    DamagedBroker,
    MirrorNotDrained,
    MirrorRefused,
    StaleEpoch,
    VhostNotFound,
    VhostRefused,
)
from twinmq.broker.journal import JournalError
from twinmq.broker.replication.peer import PeerUnresolved

if TYPE_CHECKING:
    from twinmq.broker.settings import BrokerSettings

log = logging.getLogger(__name__)


class AdminContext(Protocol):
    """What the admin API needs from the broker (as `ConnectionContext` for clients)."""

    @property
    def settings(self) -> BrokerSettings:
        """The admin token, host and port."""
        ...

    def refusal(self) -> str | None:
        """Why clients are refused right now (not ready), or None."""
        ...

    def status(self) -> BrokerStatus:
        """A snapshot for `GET /status` (also refreshes the per-queue gauges)."""
        ...

    async def set_role(
        self, role: Role, epoch: int, replicate_from: str | None, *, force: bool = False
    ) -> None:
        """Change role; raises StaleEpoch or DamagedBroker."""
        ...

    async def mirror_demote(self, request: MirrorDemoteRequest) -> MirrorSwitch:
        """The DR source hands over; raises MirrorRefused or MirrorNotDrained."""
        ...

    async def mirror_promote(self, request: MirrorPromoteRequest) -> MirrorSwitch:
        """The DR replica takes over; raises MirrorRefused."""
        ...

    async def mirror_reseed(self) -> MirrorReseed:
        """The DR source seeds its mirror again; raises MirrorRefused."""
        ...

    def delete_vhost(self, name: str) -> VhostDeleted:
        """Delete a retired vhost's content; raises VhostRefused or VhostNotFound."""
        ...


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/healthz", "/readyz"})
READ_METHODS = frozenset({"GET", "HEAD"})


def error(status: int, message: str, detail: str = "") -> web.Response:
    """A JSON error response."""
    body = ErrorBody(error=message, detail=detail).model_dump_json()
    return web.Response(status=status, text=body, content_type="application/json")


def _loopback(request: web.Request) -> bool:
    try:
        return ipaddress.ip_address(request.remote or "").is_loopback
    except ValueError:
        return False


def make_app(broker: AdminContext) -> web.Application:
    """The admin application."""
    token, read_token = broker.settings.admin_token, broker.settings.admin_read_token

    def bearer(request: web.Request, secret: SecretStr | None) -> bool:
        if secret is None:
            return False
        given = request.headers.get("Authorization", "").encode()
        return hmac.compare_digest(given, ("Bearer " + secret.get_secret_value()).encode())

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS or bearer(request, token):
            return await handler(request)
        if bearer(request, read_token):
            if request.method in READ_METHODS:
                return await handler(request)
            return error(403, FORBIDDEN, "the read-only admin token may not change anything")
        if token is None and _loopback(request):
            return await handler(request)
        if token is None:
            return error(401, UNAUTHORIZED, "no admin token configured: loopback only")
        return error(401, UNAUTHORIZED, "missing or wrong bearer token")

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        reason = broker.refusal()
        body = Readiness(ready=reason is None, reason=reason).model_dump_json()
        return web.Response(
            status=200 if reason is None else 503, text=body, content_type="application/json"
        )

    async def status(request: web.Request) -> web.Response:
        return web.Response(text=broker.status().model_dump_json(), content_type="application/json")

    async def set_role(request: web.Request) -> web.Response:
        try:
            wanted = RoleRequest.model_validate_json(await request.read())
        except ValidationError as exc:
            return error(400, INVALID_ROLE_REQUEST, str(exc))
        peer = broker.settings.replication_peer
        # Checked before anything changes: a passive refused keeps the link it has.
        if peer is not None and wanted.replicate_from is not None:
            try:
                why = await peer.address_refusal(wanted.replicate_from)
            except PeerUnresolved as exc:
                # A name being made again (the peer's pod restarting): not a refusal.
                log.info("POST /role from %s deferred: replicate_from %s", request.remote, exc)
                return error(503, PEER_UNRESOLVED, f"replicate_from {exc}")
            if why is not None:
                metrics.ROLE_REFUSED.labels("peer").inc()
                log.warning("POST /role from %s refused: replicate_from %s", request.remote, why)
                return error(403, NOT_THE_PEER, f"replicate_from {why}")
        try:
            await broker.set_role(
                wanted.role, wanted.epoch, wanted.replicate_from, force=wanted.force
            )
        except StaleEpoch as exc:
            return error(409, STALE_EPOCH, str(exc))
        except DamagedBroker as exc:
            return error(409, BROKER_DAMAGED, str(exc))
        return web.Response(text=broker.status().model_dump_json(), content_type="application/json")

    async def mirror_switch(switch: Awaitable[MirrorSwitch]) -> web.Response:
        try:
            done = await switch
        except MirrorRefused as exc:
            return error(409, MIRROR_REFUSED, str(exc))
        except MirrorNotDrained as exc:
            return error(503, MIRROR_NOT_DRAINED, str(exc))
        return web.Response(text=done.model_dump_json(), content_type="application/json")

    async def mirror_demote(request: web.Request) -> web.Response:
        try:
            wanted = MirrorDemoteRequest.model_validate_json(await request.read() or b"{}")
        except ValidationError as exc:
            return error(400, INVALID_ROLE_REQUEST, str(exc))
        return await mirror_switch(broker.mirror_demote(wanted))

    async def mirror_promote(request: web.Request) -> web.Response:
        try:
            wanted = MirrorPromoteRequest.model_validate_json(await request.read())
        except ValidationError as exc:
            return error(400, INVALID_ROLE_REQUEST, str(exc))
        return await mirror_switch(broker.mirror_promote(wanted))

    async def mirror_reseed(request: web.Request) -> web.Response:
        try:
            done = await broker.mirror_reseed()
        except MirrorRefused as exc:
            return error(409, MIRROR_REFUSED, str(exc))
        return web.Response(text=done.model_dump_json(), content_type="application/json")

    async def delete_vhost(request: web.Request) -> web.Response:
        try:
            done = broker.delete_vhost(request.match_info["name"])
        except VhostRefused as exc:
            return error(409, VHOST_REFUSED, str(exc))
        except VhostNotFound as exc:
            return error(404, VHOST_NOT_FOUND, str(exc))
        except (JournalError, AMQPError) as exc:
            # A full disk refused a deletion's record (a queue's deletion is undone then):
            # what was recorded before it is deleted, the rest is kept, the vhost stays
            # listed until a retry deletes it.
            return error(507, VHOST_NOT_RECORDED, f"{exc}: free space, then delete it again")
        return web.Response(text=done.model_dump_json(), content_type="application/json")

    async def prometheus(request: web.Request) -> web.Response:
        broker.status()  # refreshes the per-queue gauges
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(middlewares=[auth])
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", prometheus)
    app.router.add_post("/role", set_role)
    app.router.add_post("/mirror/demote", mirror_demote)
    app.router.add_post("/mirror/promote", mirror_promote)
    app.router.add_post("/mirror/reseed", mirror_reseed)
    # `{name:.+}`: a vhost's name may hold `/` (sent percent-encoded).
    app.router.add_delete("/vhosts/{name:.+}", delete_vhost)
    return app


async def start_admin(
    broker: AdminContext, tls: ssl.SSLContext | None = None
) -> asyncio.AbstractServer:
    """Start the admin listener (HTTPS with `tls`); returns the asyncio server (for its
    bound port)."""
    runner = web.AppRunner(make_app(broker), access_log=None)
    await runner.setup()
    site = web.TCPSite(
        runner,
        broker.settings.host,
        broker.settings.admin_port,
        reuse_address=True,
        ssl_context=tls,
    )
    await site.start()
    return cast(asyncio.AbstractServer, site._server)
