"""The admin HTTP API: health, readiness, status and Prometheus metrics.

`/healthz` and `/readyz` are open (kubelet probes); everything else needs the
bearer token, or, when no token is configured, a loopback client.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, cast

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from twinmq.broker import metrics
from twinmq.broker.api import (
    BrokerStatus,
    CatchupStatus,
    ErrorBody,
    JournalStatus,
    QueueStatus,
    ReplicationStatus,
    RoleRequest,
)
from twinmq.broker.errors import DamagedBroker, StaleEpoch

if TYPE_CHECKING:
    from twinmq.broker.server import Broker

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OPEN_PATHS = frozenset({"/healthz", "/readyz"})


def error(status: int, message: str, detail: str = "") -> web.Response:
    """A JSON error response."""
    body = ErrorBody(error=message, detail=detail).model_dump_json()
    return web.Response(status=status, text=body, content_type="application/json")


def _loopback(request: web.Request) -> bool:
    try:
        return ipaddress.ip_address(request.remote or "").is_loopback
    except ValueError:
        return False


def replication_status(broker: Broker) -> ReplicationStatus:
    """The replication section of the status."""
    if broker.role == "passive":
        replica = broker.replica
        if replica is None:
            return ReplicationStatus(
                peer=None,
                link_connected=False,
                ready=False,
                degraded=False,
                lag_messages=0,
                lag_seconds=0.0,
            )
        return ReplicationStatus(
            peer=replica.address, link_connected=replica.connected, ready=replica.ready,
            degraded=False, lag_messages=replica.pending_ops,
            lag_seconds=round(replica.lag_seconds, 3), lost_at=replica.lost_at,
        )  # fmt: skip
    link = broker.source.link
    in_sync = link is not None and link.ready and broker.committer.guarded
    catchup: CatchupStatus | None = None
    if link is not None and link.catchup is not None:
        sender, p = link.catchup, link.catchup.progress
        catchup = CatchupStatus(
            in_progress=not sender.done, candidates=p.candidates, sent=p.sent, kept=p.kept,
            discarded=p.discarded, skipped=p.skipped, bytes=p.bytes, chunks=p.chunks,
            acked_chunks=sender.acked_chunk, acked_messages=sender.acked_messages,
        )  # fmt: skip
    return ReplicationStatus(
        peer=None if link is None else f"{link.name} ({link.peer})",
        link_connected=link is not None and not link.closed,
        ready=in_sync,
        degraded=not in_sync,
        lag_messages=0 if link is None else link.lag_messages,
        lag_seconds=0.0 if link is None else round(link.lag_seconds, 3),
        catchup=catchup,
    )


def build_status(broker: Broker) -> BrokerStatus:
    """Snapshot the broker for `GET /status`."""
    vhost = broker.vhost
    replication = replication_status(broker)
    replication.epoch_refused = broker.epoch_refusal
    metrics.REPLICATION_LAG.set(replication.lag_messages)
    metrics.REPLICATION_LAG_SECONDS.set(replication.lag_seconds)
    queue_state = "ready" if replication.ready else "catching-up"
    queues = []
    for q in vhost.queues.values():
        queues.append(
            QueueStatus(
                name=q.name,
                durable=q.durable,
                exclusive=q.definition.exclusive,
                messages=q.message_count,
                unacked=q.unacked,
                consumers=len(q.consumers),
                bytes=q.bytes,
                replication=queue_state if q.durable else "unreplicated",
            )
        )
        metrics.QUEUE_MESSAGES.labels(q.name).set(q.message_count)
        metrics.QUEUE_UNACKED.labels(q.name).set(q.unacked)
    stats = broker.journal.stats
    damage = broker.damage
    return BrokerStatus(
        name=broker.settings.name,
        version=broker.product_version,
        role=broker.role,
        epoch=broker.epoch,
        ready=broker.refusal() is None if broker.role == "active" else replication.ready,
        uptime_seconds=round(time.time() - broker.started, 3),
        connections=len(broker.protocols),
        channels=sum(len(p.conn.channels) for p in broker.protocols if p.conn is not None),
        alarms=[broker.monitor.reason] if broker.monitor.reason else [],
        queues=queues,
        replication=replication,
        journal=JournalStatus(
            segments=stats.segments,
            bytes=stats.disk_bytes,
            live_messages=stats.live_messages,
            durable_batch=broker.committer.durable_batch,
            damaged=broker.damaged,
            damaged_since=None if damage is None else damage.since,
            healed_by=None if damage is None else damage.healed_by,
            corruption=[] if damage is None else damage.corruption,
            quarantined_files=broker.quarantined_files(),
        ),
    )


def make_app(broker: Broker) -> web.Application:
    """The admin application."""
    token = broker.settings.admin_token

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        if token is None:
            if not _loopback(request):
                return error(401, "unauthorized", "no admin token configured: loopback only")
            return await handler(request)
        given = request.headers.get("Authorization", "")
        expected = "Bearer " + token.get_secret_value()
        if not hmac.compare_digest(given.encode(), expected.encode()):
            return error(401, "unauthorized", "missing or wrong bearer token")
        return await handler(request)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        reason = broker.refusal()
        if reason is not None:
            return web.json_response({"ready": False, "reason": reason}, status=503)
        return web.json_response({"ready": True})

    async def status(request: web.Request) -> web.Response:
        return web.Response(
            text=build_status(broker).model_dump_json(), content_type="application/json"
        )

    async def set_role(request: web.Request) -> web.Response:
        try:
            wanted = RoleRequest.model_validate_json(await request.read())
        except ValidationError as exc:
            return error(400, "invalid role request", str(exc))
        try:
            await broker.set_role(
                wanted.role, wanted.epoch, wanted.replicate_from, force=wanted.force
            )
        except StaleEpoch as exc:
            return error(409, "stale epoch", str(exc))
        except DamagedBroker as exc:
            return error(409, "broker damaged", str(exc))
        return web.Response(
            text=build_status(broker).model_dump_json(), content_type="application/json"
        )

    async def prometheus(request: web.Request) -> web.Response:
        build_status(broker)  # refreshes the per-queue gauges
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(middlewares=[auth])
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", prometheus)
    app.router.add_post("/role", set_role)
    return app


async def start_admin(broker: Broker) -> asyncio.AbstractServer:
    """Start the admin listener; returns the asyncio server (for its bound port)."""
    runner = web.AppRunner(make_app(broker), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, broker.settings.host, broker.settings.admin_port, reuse_address=True)
    await site.start()
    return cast(asyncio.AbstractServer, site._server)
