"""The active broker keeps the active role's Lease, and fences itself when it cannot.

The operator gives the Lease to the broker it activates; while active, the
broker renews it every third of its duration through the Kubernetes API (its
pod's service account may touch that one Lease only). If it cannot renew for
long enough that the Lease may lapse, it steps down at once, before the
operator can see the Lease expired and promote the other broker: an isolated
old active never serves beside the new one (CloudNativePG's self-fencing).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import aiohttp

if TYPE_CHECKING:
    from twinmq.broker.api import Role
    from twinmq.broker.settings import BrokerSettings

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
FENCE_MARGIN = 1.0  # seconds before the Lease could lapse that the broker steps down


def now_rfc3339() -> str:
    """A MicroTime, as Leases carry it."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseContext(Protocol):
    """What the Lease keeper needs of the broker: who it is, its role, and stepping down."""

    @property
    def settings(self) -> BrokerSettings:
        """Its name and the Lease's settings."""
        ...

    @property
    def role(self) -> Role:
        """This broker's role now."""
        ...

    @property
    def epoch(self) -> int:
        """The highest epoch this broker has seen."""
        ...

    async def set_role(self, role: Role, epoch: int, replicate_from: str | None) -> None:
        """Change role (here: step down to passive, fencing)."""
        ...


class LeaseKeeper:
    """Renews `<namespace>/<name>` while this broker is active; fences on failure."""

    def __init__(self, broker: LeaseContext, name: str, namespace: str, duration: float) -> None:
        self.broker = broker
        self.name = name
        self.namespace = namespace
        self.duration = duration
        self.last_renewed = time.monotonic()
        self.fenced_at: float | None = None
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        self.url = (
            f"https://{host}:{port}/apis/coordination.k8s.io/v1/namespaces/"
            f"{namespace}/leases/{name}"
        )

    @classmethod
    def from_environment(cls, broker: LeaseContext) -> LeaseKeeper | None:
        """A keeper when running in a pod with a Lease configured, else None."""
        settings = broker.settings
        if settings.lease_name is None or not (SERVICE_ACCOUNT / "token").exists():
            return None
        if "KUBERNETES_SERVICE_HOST" not in os.environ:
            return None
        namespace = settings.lease_namespace or (SERVICE_ACCOUNT / "namespace").read_text()
        return cls(broker, settings.lease_name, namespace.strip(), settings.lease_seconds)

    def activated(self) -> None:
        """The operator just gave us the Lease with the activation: the clock starts now."""
        self.last_renewed = time.monotonic()

    async def run(self) -> None:
        """Renew every third of the duration while active; fence when renewal lapses."""
        context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.duration / 3))
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await asyncio.sleep(self.duration / 3)
                if self.broker.role != "active":
                    self.last_renewed = time.monotonic()
                    continue
                try:
                    await self._renew(session, context)
                    self.last_renewed = time.monotonic()
                except (aiohttp.ClientError, TimeoutError, LeaseLost) as exc:
                    log.warning("cannot renew Lease %s/%s: %s", self.namespace, self.name, exc)
                    if isinstance(exc, LeaseLost):
                        await self._fence(str(exc))
                        continue
                if time.monotonic() - self.last_renewed > self.duration - FENCE_MARGIN:
                    await self._fence("the Lease could not be renewed in time")

    async def _renew(self, session: aiohttp.ClientSession, context: ssl.SSLContext) -> None:
        token = (SERVICE_ACCOUNT / "token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        async with session.get(self.url, headers=headers, ssl=context) as resp:
            if resp.status != 200:
                raise aiohttp.ClientError(f"GET lease: HTTP {resp.status}")
            lease = await resp.json()
        holder = lease.get("spec", {}).get("holderIdentity")
        if holder != self.broker.settings.name:
            raise LeaseLost(f"the Lease is held by {holder!r}, not by us")
        lease["spec"]["renewTime"] = now_rfc3339()
        # An update with the read resourceVersion: a concurrent change by the operator wins.
        async with session.put(self.url, json=lease, headers=headers, ssl=context) as resp:
            if resp.status == 409:
                raise aiohttp.ClientError("the Lease changed under us; retrying")
            if resp.status != 200:
                raise aiohttp.ClientError(f"PUT lease: HTTP {resp.status}")

    async def _fence(self, reason: str) -> None:
        broker = self.broker
        if broker.role != "active":
            return
        log.error("self-fencing: %s; stepping down to passive (epoch %d)", reason, broker.epoch)
        self.fenced_at = time.time()
        await broker.set_role("passive", broker.epoch, None)


class LeaseLost(Exception):
    """Another broker holds the Lease: this one is no longer the active."""
