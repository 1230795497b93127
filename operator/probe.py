"""The brokers as the operator sees them: their admin API, through the one admin client.

`probe` reads a broker's `GET /status` (None when it does not answer in time);
`view_of` and `passive_lag` turn reports into what the failover algorithm and the
BrokerCluster's status need, without I/O. `admin` is the client the reconcile also
uses for `POST /role`; every broker shares one connection pool.
"""

from __future__ import annotations

import hashlib
import ssl
from datetime import UTC, datetime
from typing import Any

import httpx

from twinmq.broker.admin_client import AdminError, SyncAdminClient
from twinmq.broker.api import BrokerStatus as BrokerReport
from twinmq.broker.names import ADMIN_PORT, PASSIVE, REPLICATION_PORT
from twinmq.operator.builders import ADMIN_SCHEME
from twinmq.operator.failover import BrokerView
from twinmq.operator.models import BrokerName

PROBE_TIMEOUT = 1.0
# One connection pool for every broker's admin API (each call names its broker and token).
ADMIN_POOL = httpx.Client(limits=httpx.Limits(max_connections=32, max_keepalive_connections=8))


# HTTPS pools, one per CA and broker name: a pool verifies against one set of roots, and
# reuses a connection by address only (a pooled connection verified for one name must not
# serve a call that expects another).
_TLS_POOLS: dict[tuple[str, str], httpx.Client] = {}


def https_pool(ca_pem: str | None, server_name: str) -> httpx.Client:
    """The pool verifying the broker `server_name` against `ca_pem` (None: the system's
    roots)."""
    key = (hashlib.sha256((ca_pem or "").encode()).hexdigest(), server_name)
    pool = _TLS_POOLS.get(key)
    if pool is None:
        context = ssl.create_default_context(cadata=ca_pem) if ca_pem else True
        pool = _TLS_POOLS[key] = httpx.Client(
            verify=context, limits=httpx.Limits(max_connections=4, max_keepalive_connections=2)
        )
    return pool


def admin(ip: str, token: str) -> SyncAdminClient:
    """The admin API of the broker at `ip` over HTTP, on the operator's shared pool."""
    return SyncAdminClient(f"http://{ip}:{ADMIN_PORT}", token, http=ADMIN_POOL)


def admin_of(pod: dict[str, Any] | None, token: str, ca_pem: str | None) -> SyncAdminClient | None:
    """The admin API of the broker in `pod` (None: no IP yet): HTTPS when its template says
    so (`builders.ADMIN_SCHEME`), the certificate verified against the cluster's CA and for
    the pod's name (what the broker's own certificate names), at its IP."""
    ip = (pod or {}).get("status", {}).get("podIP")
    if not ip:
        return None
    meta = (pod or {}).get("metadata", {})
    if (meta.get("annotations") or {}).get(ADMIN_SCHEME) != "https":
        return admin(ip, token)
    name = str(meta.get("name") or "")
    return SyncAdminClient(f"https://{ip}:{ADMIN_PORT}", token, http=https_pool(ca_pem, name),
                           server_name=name)  # fmt: skip


def probe(pod: dict[str, Any] | None, token: str, ca_pem: str | None = None) -> BrokerReport | None:
    """The broker's `GET /status`, or None when it does not answer."""
    client = admin_of(pod, token, ca_pem)
    if client is None or (pod or {}).get("metadata", {}).get("deletionTimestamp"):
        return None
    try:
        # A short timeout: a cut-off broker must not stall the reconcile, whose timing
        # decides whether the backup is still promotable when the Lease lapses.
        return client.status(timeout=PROBE_TIMEOUT)
    except AdminError:
        return None


def view_of(report: BrokerReport, name: BrokerName, active_ip: str | None) -> BrokerView:
    """What the failover algorithm needs of a broker's status."""
    replication = report.replication
    return BrokerView(
        name=name,
        reachable=True,
        role=report.role,
        epoch=report.epoch,
        ready=replication.ready and report.role == PASSIVE,
        caught_up_epoch=replication.caught_up_epoch if report.role == PASSIVE else None,
        link_connected=replication.link_connected,
        replicating_from_active=active_ip is not None
        and replication.peer == f"{active_ip}:{REPLICATION_PORT}"
        and replication.link_connected,
        damaged=report.journal.damaged,
    )


def damage_text(report: BrokerReport) -> str:
    """Where a damaged broker's journal stands: since when, and where the unreadable files
    were moved (under its data directory's quarantine folder)."""
    journal = report.journal
    since = (
        "" if journal.damaged_since is None
        else " since " + datetime.fromtimestamp(journal.damaged_since, UTC).strftime(
            "%Y-%m-%dT%H:%M:%SZ")
    )  # fmt: skip
    moved = sorted({c.quarantined_as for c in journal.corruption if c.quarantined_as})
    where = (
        f"; damaged files moved to {', '.join(moved)}" if moved
        else f"; {journal.quarantined_files} file(s) in its quarantine folder"
        if journal.quarantined_files else ""
    )  # fmt: skip
    return (
        f"journal damaged{since} ({len(journal.corruption)} unreadable stretch(es)){where}: it "
        "may lack messages it confirmed and is not activated without a forced promote"
    )


def passive_lag(
    name: BrokerName, active: BrokerName | None, reports: dict[BrokerName, BrokerReport | None]
) -> tuple[int, float]:
    """(messages, seconds) the broker `name` lags behind the active: 0 for the active itself.

    The active counts what it sent its passive and the passive has not made durable, and
    knows it even when the passive cannot answer (paused, cut off); the passive counts what
    it received and has not written yet. The larger of the two is the lag."""
    if name == active:
        return 0, 0.0
    known = [
        (r.replication.lag_messages, r.replication.lag_seconds)
        for r in (reports.get(name), reports.get(active) if active else None)
        if r is not None
    ]
    if not known:
        return 0, 0.0
    return max(m for m, _ in known), max(s for _, s in known)
