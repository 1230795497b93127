"""The broker's status, as `GET /status` and `POST /role` report it.

The one place that reads the whole broker for a snapshot (roles, replication,
queues, journal, damage); the admin API serves what it builds.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from twinmq.broker import metrics
from twinmq.broker.api import (
    BrokerStatus,
    CatchupStatus,
    JournalStatus,
    QueueStatus,
    ReplicationStatus,
    TlsFilesStatus,
    TlsListenerName,
    VhostStatus,
)
from twinmq.broker.names import ACTIVE, PASSIVE

if TYPE_CHECKING:
    from twinmq.broker.server import Broker
    from twinmq.broker.tls import TlsListener


def replication_status(broker: Broker) -> ReplicationStatus:
    """The replication section of the status."""
    if broker.role == PASSIVE:
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
            link_tls=replica.connected and replica.tls,
            degraded=False, lag_messages=replica.pending_ops,
            lag_seconds=round(replica.lag_seconds, 3), lost_at=replica.lost_at,
            caught_up_epoch=replica.caught_up_epoch if replica.caught_up else None,
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
            dedup_keys=p.dedup_keys,
        )  # fmt: skip
    return ReplicationStatus(
        peer=None if link is None else f"{link.name} ({link.peer})",
        link_connected=link is not None and not link.closed,
        link_tls=link is not None
        and not link.closed
        and link.writer.get_extra_info("sslcontext") is not None,
        ready=in_sync,
        degraded=not in_sync,
        lag_messages=0 if link is None else link.lag_messages,
        lag_seconds=0.0 if link is None else round(link.lag_seconds, 3),
        catchup=catchup,
    )


def tls_status(broker: Broker) -> list[TlsFilesStatus]:
    """Each TLS listener's files as loaded now (`broker/tls.py`)."""
    listeners: list[tuple[TlsListenerName, TlsListener | None]] = [
        ("amqps", broker.tls), ("admin", broker.admin_tls),
        ("replication", broker.replication_tls), ("mirror", broker.mirroring.tls),
    ]  # fmt: skip
    return [listener.status(name) for name, listener in listeners if listener is not None]


def build_status(broker: Broker) -> BrokerStatus:
    """Snapshot the broker for `GET /status`."""
    vhost = broker.vhost
    replication = replication_status(broker)
    replication.epoch_refused = broker.epoch_refusal
    metrics.REPLICATION_LAG.set(replication.lag_messages)
    metrics.REPLICATION_LAG_SECONDS.set(replication.lag_seconds)
    queue_state = "ready" if replication.ready else "catching-up"
    queues = []
    # Set afresh at each scrape: a deleted queue's (or vhost's) series goes with it.
    metrics.QUEUE_MESSAGES.clear()
    metrics.QUEUE_UNACKED.clear()
    for q in vhost.all_queues():
        queues.append(
            QueueStatus(
                name=q.name,
                vhost=q.definition.vhost,
                durable=q.durable,
                exclusive=q.definition.exclusive,
                messages=q.message_count,
                unacked=q.unacked,
                consumers=len(q.consumers),
                bytes=q.bytes,
                replication=queue_state if q.durable else "unreplicated",
            )
        )
        metrics.QUEUE_MESSAGES.labels(q.name, q.definition.vhost).set(q.message_count)
        metrics.QUEUE_UNACKED.labels(q.name, q.definition.vhost).set(q.unacked)
    vhosts = [
        VhostStatus(
            name=v.name,
            served=v.name in broker.authenticator.vhosts,
            queues=len(v.queues),
            # The DR mirror carries every vhost (one-way, bidirectional, mesh).
            mirrored=True,
            federated=True,  # federation serves every vhost (docs/federation.md)
        )
        for v in vhost.vhosts.values()
    ]
    # The same per vhost on /metrics (a deleted vhost's series goes with it).
    metrics.VHOST_MIRRORED.clear()
    metrics.VHOST_FEDERATED.clear()
    for v in vhosts:
        metrics.VHOST_MIRRORED.labels(v.name).set(1 if v.mirrored else 0)
        metrics.VHOST_FEDERATED.labels(v.name).set(1 if v.federated else 0)
    stats = broker.journal.stats
    damage = broker.damage
    return BrokerStatus(
        name=broker.settings.name,
        version=broker.product_version,
        role=broker.role,
        epoch=broker.epoch,
        ready=broker.refusal() is None if broker.role == ACTIVE else replication.ready,
        uptime_seconds=round(time.time() - broker.started, 3),
        connections=len(broker.protocols),
        channels=sum(len(p.conn.channels) for p in broker.protocols if p.conn is not None),
        alarms=[broker.monitor.reason] if broker.monitor.reason else [],
        queues=queues,
        vhosts=vhosts,
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
        mirror=broker.mirroring.status(),
        server_id=broker.server_id,
        federation=broker.federation.status(),
        tls=tls_status(broker),
    )
