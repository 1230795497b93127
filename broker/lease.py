"""The active broker keeps the active role's Lease, and fences itself when it cannot.

The operator gives the Lease to the broker it activates; while active, the
broker renews it every third of its duration through the Kubernetes API (its
pod's service account may touch that one Lease only). Two tasks run side by
side: the renewals, each bounded by a timeout well inside the renewal period,
and a deadline timer that does not wait for any request. The timer steps the
broker down `FENCE_MARGIN` seconds before the Lease could lapse (its last
successful renewal's start plus the duration), even while a renewal request
hangs: an isolated old active stops serving before the operator can see the
Lease expired and promote the other broker (CloudNativePG's self-fencing).

A Lease held by another broker fences at once, except just after an activation
before the broker has seen the Lease named for it: the operator writes the Lease
right after the activation, so the previous holder's name is what a renewal in
that window reads (a newly promoted broker fenced itself that way, and the
failover then took the Lease's 4 s more: bench/failover_time.py). Until the
handover it retries; the deadline timer still fences if the handover never comes.
The operator never gives the Lease to the other broker within that deadline
unless this broker's process is gone or it was demoted first.

The Lease also carries the **replication guard** (`GUARD_ANNOTATION`, `<epoch>:<alone>`):
every renewal writes whether this active may have confirmed a message its passive lacks
since that passive last caught up. Before it goes on alone (its passive silent for
`replication_timeout`), the active writes `alone` = 1 and waits for the write: if the API
server cannot take it, confirms stay held, and the deadline fences the broker. So a
Lease that lapsed (or whose holder's process is gone) saying `<epoch>:0` proves that a
passive caught up in that epoch holds every confirmed message, however long after the
link's loss the operator looks: it promotes it without the passive's own readiness
window (8 s), which a slow or restarted operator could miss. When a passive catches up
again, `0` is written at once (`passive_in_sync`). The operator judges the Lease by how
long it has seen its record unchanged on its own monotonic clock, never by `renewTime`
(operator/leasewatch.py): every write here changes the record, and none counts after
this broker's deadline. An operator of an earlier version compared `renewTime`, written
with this broker's wall clock, with its own: so a broker whose clock is behind the API
server's (its `Date`) by more than half a Lease duration still never goes on alone
(docs/replication.md, "Clock skew").
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import aiohttp

from twinmq.broker import metrics

if TYPE_CHECKING:
    from twinmq.broker.api import Role
    from twinmq.broker.settings import BrokerSettings

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
FENCE_MARGIN = 1.0  # seconds before the Lease could lapse that the broker steps down
HANDOVER_RETRY = 0.2  # seconds between reads of a Lease not yet handed over after activation
GUARD_ANNOTATION = "twinmq.io/replication-guard"
# How far (a fraction of the Lease's duration) this broker's wall clock may run behind
# the API server's before it refuses to go on alone: `record_alone`.
MAX_CLOCK_LAG = 0.5


@dataclass(frozen=True)
class ReplicationGuard:
    """What the active's Lease says of its confirms in an epoch."""

    epoch: int
    alone: bool  # it may have confirmed what its caught-up passive lacks

    def encode(self) -> str:
        """The annotation's value."""
        return f"{self.epoch}:{int(self.alone)}"

    @classmethod
    def of_lease(cls, lease: dict[str, object]) -> ReplicationGuard | None:
        """The guard a Lease carries (None: none, or not readable)."""
        meta = lease.get("metadata")
        annotations = meta.get("annotations") if isinstance(meta, dict) else None
        value = annotations.get(GUARD_ANNOTATION) if isinstance(annotations, dict) else None
        epoch, _, alone = str(value or "").partition(":")
        if not epoch.isdigit() or alone not in ("0", "1"):
            return None
        return cls(int(epoch), alone == "1")


def now_rfc3339() -> str:
    """A MicroTime, as Leases carry it."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def clock_lag(date_header: str | None) -> float | None:
    """How far this process's wall clock is at least behind the server that answered
    with `date_header` (an HTTP Date, whole seconds, taken before the answer arrived:
    never more than the true lag). None: no readable Date."""
    if not date_header:
        return None
    try:
        served = parsedate_to_datetime(date_header).timestamp()
    except (TypeError, ValueError):
        return None
    return served - time.time()


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


class Clock(Protocol):
    """Monotonic time and sleeping on it (a fake one in tests)."""

    def monotonic(self) -> float:
        """Seconds, never going back."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` of this clock."""
        ...


class SystemClock:
    """The process's monotonic clock."""

    def monotonic(self) -> float:
        """`time.monotonic()`."""
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        """`asyncio.sleep`."""
        await asyncio.sleep(seconds)


@dataclass(frozen=True)
class ApiAccess:
    """How to reach the API server: TLS context and the bearer token's file (None: plain)."""

    ssl: ssl.SSLContext | None = None
    token_file: Path | None = None

    def headers(self) -> dict[str, str]:
        """The Authorization header (the token is re-read: it is rotated)."""
        if self.token_file is None:
            return {}
        return {"Authorization": f"Bearer {self.token_file.read_text().strip()}"}


class LeaseKeeper:
    """Renews the Lease at `url` while this broker is active; fences on failure, on time."""

    def __init__(
        self,
        broker: LeaseContext,
        url: str,
        duration: float,
        access: ApiAccess | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.broker = broker
        self.url = url
        self.duration = duration
        self.access = access or ApiAccess()
        self.clock = clock or SystemClock()
        self.period = duration / 3
        # Well inside the period: a hung request leaves time for another attempt.
        self.request_timeout = self.period / 2
        self.deadline = self.clock.monotonic() + duration - FENCE_MARGIN
        self.fenced_at: float | None = None  # the keeper's clock
        # Whether a renewal found the Lease named for this broker since its activation.
        self.handed_over = False
        # This active may have confirmed what its passive lacks (`record_alone`); every
        # renewal writes it. One write at a time: a renewal never undoes a newer mark.
        self.alone = False
        self._writing = asyncio.Lock()
        # The catch-up writes in flight (`passive_in_sync`), referenced until done.
        self._clearing: set[asyncio.Task[None]] = set()
        # How far this broker's wall clock was at least behind the API server's at the
        # last write (None: unknown): `record_alone` refuses past `MAX_CLOCK_LAG`.
        self.clock_lag: float | None = None

    @classmethod
    def from_environment(cls, broker: LeaseContext) -> LeaseKeeper | None:
        """A keeper when running in a pod with a Lease configured, else None."""
        settings = broker.settings
        if settings.lease_name is None or not (SERVICE_ACCOUNT / "token").exists():
            return None
        if "KUBERNETES_SERVICE_HOST" not in os.environ:
            return None
        namespace = (
            settings.lease_namespace or (SERVICE_ACCOUNT / "namespace").read_text()
        ).strip()
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        url = (
            f"https://{host}:{port}/apis/coordination.k8s.io/v1/namespaces/"
            f"{namespace}/leases/{settings.lease_name}"
        )
        access = ApiAccess(
            ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt")),
            SERVICE_ACCOUNT / "token",
        )
        return cls(broker, url, settings.lease_seconds, access)

    def activated(self) -> None:
        """The operator gives us the Lease with the activation (after it): the clock starts
        now, which is no later than the renewTime the operator writes."""
        self.deadline = self.clock.monotonic() + self.duration - FENCE_MARGIN
        self.handed_over = False
        self.alone = False  # its passive has not caught up in this epoch: it lacks nothing yet

    def passive_in_sync(self) -> None:
        """The passive caught up (everything confirmed alone included): the Lease says so
        at once, by one write of its own if it may say `alone` (not at the next renewal:
        until then the operator's veto keeps a ready passive from being promoted)."""
        was_alone, self.alone = self.alone, False
        if was_alone and self.broker.role == "active":
            task = asyncio.get_running_loop().create_task(self._write_caught_up())
            self._clearing.add(task)
            task.add_done_callback(self._clearing.discard)

    async def _write_caught_up(self) -> None:
        """One write of the guard as it is now (no renewal): serialised with the renewals
        and marks, so it writes `1` again if a mark came in between, never an older state.
        A failed write is left to the next renewal, which writes the same."""
        try:
            await self._write_now()
        except (aiohttp.ClientError, TimeoutError, LeaseLost) as exc:
            log.info("cannot write the passive's catch-up into the Lease now: %s", exc)

    async def _write_now(self) -> None:
        """One write of the Lease as this keeper holds it, outside the renewal loop."""
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await self._write(session, renew=False)

    async def record_alone(self) -> bool:
        """Write `alone` into the Lease before confirming without the passive: True once
        the Lease says so, no passive caught up while it was written (a `0` follows it),
        and this broker may still act as the active (its deadline has not passed: an
        operator that saw the Lease lapse never missed the mark)."""
        if self.broker.role != "active":
            return False
        self.alone = True  # (a failed write leaves it for the next renewal: conservative)
        try:
            await self._write_now()
        except (aiohttp.ClientError, TimeoutError, LeaseLost) as exc:
            log.warning("cannot record going on alone in the Lease: %s; confirms held", exc)
            return False
        if self.clock_lag is not None and self.clock_lag > MAX_CLOCK_LAG * self.duration:
            # An operator of an earlier version judges the Lease lapsed by `renewTime`,
            # written with this clock: one behind by more than a Lease duration makes a
            # live active's Lease look lapsed to it, and a guard of 0 read a moment ago
            # trusted, though this mark lands after it (tests/test_guard_skew.py; this
            # version's operator judges by what it observed). Confirms stay held.
            log.warning(
                "this broker's clock is %.1fs behind the API server's (more than %.1fs): "
                "not going on alone; confirms held",
                self.clock_lag, MAX_CLOCK_LAG * self.duration,
            )  # fmt: skip
            return False
        if not self.alone:
            # A passive caught up while the mark was written (`passive_in_sync`): a 0 is
            # written after it, so this mark no longer covers a confirm. If that passive is
            # gone again, the caller marks anew before it goes on alone.
            return False
        return self.broker.role == "active" and self.clock.monotonic() < self.deadline

    async def run(self) -> None:
        """Renew while active, and fence at the deadline whatever the requests do."""
        timeout = aiohttp.ClientTimeout(total=self.request_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(self.renew_loop(session), self.deadline_timer())

    async def deadline_timer(self) -> None:
        """Step down when the deadline passes while active; independent of any request."""
        while True:
            if self.broker.role != "active":
                await self.clock.sleep(self.period)
                continue
            remaining = self.deadline - self.clock.monotonic()
            if remaining <= 0:
                await self._fence("the Lease could not be renewed in time")
                continue
            # Re-checked at least every period: an activation moves the deadline.
            await self.clock.sleep(min(remaining, self.period))

    async def renew_loop(self, session: aiohttp.ClientSession) -> None:
        """Renew every period while active; retry sooner after a failure."""
        while True:
            if self.broker.role != "active":
                await self.clock.sleep(self.period)
                continue
            started = self.clock.monotonic()
            try:
                await self._renew(session)
            except (aiohttp.ClientError, TimeoutError) as exc:
                metrics.LEASE_RENEWAL_FAILURES.inc()
                log.warning("cannot renew the Lease at %s: %s", self.url, exc)
                await self.clock.sleep(self.period / 4)
                continue
            except LeaseLost as exc:
                if not self.handed_over:
                    # Not handed over yet (the operator writes it after the activation).
                    log.info("%s: waiting for the operator to hand it over", exc)
                    await self.clock.sleep(HANDOVER_RETRY)
                    continue
                await self._fence(str(exc))
                continue
            self.handed_over = True
            # The renewTime written was taken after `started`: the Lease lasts at least
            # until started + duration.
            self.deadline = max(self.deadline, started + self.duration - FENCE_MARGIN)
            await self.clock.sleep(self.period)

    async def _renew(self, session: aiohttp.ClientSession) -> None:
        await self._write(session, renew=True)

    async def _write(self, session: aiohttp.ClientSession, *, renew: bool) -> None:
        """Read the Lease and write it back with the guard (and, renewing, a new
        renewTime), if this broker holds it."""
        async with self._writing:
            await self._write_locked(session, renew)

    async def _write_locked(self, session: aiohttp.ClientSession, renew: bool) -> None:
        if not renew and self.broker.role != "active":
            return  # fenced or demoted meanwhile: the guard is the next active's to write
        headers = self.access.headers()
        tls = self.access.ssl if self.access.ssl is not None else False
        async with session.get(self.url, headers=headers, ssl=tls) as resp:
            if resp.status != 200:
                raise aiohttp.ClientError(f"GET lease: HTTP {resp.status}")
            lease = await resp.json()
        holder = lease.get("spec", {}).get("holderIdentity")
        if holder != self.broker.settings.name:
            raise LeaseLost(f"the Lease is held by {holder!r}, not by us")
        if renew:
            lease["spec"]["renewTime"] = now_rfc3339()
        guard = ReplicationGuard(self.broker.epoch, self.alone).encode()
        meta = lease.setdefault("metadata", {})
        meta["annotations"] = {**(meta.get("annotations") or {}), GUARD_ANNOTATION: guard}
        # An update with the read resourceVersion: a concurrent change by the operator wins.
        async with session.put(self.url, json=lease, headers=headers, ssl=tls) as resp:
            if resp.status == 409:
                raise aiohttp.ClientError("the Lease changed under us; retrying")
            if resp.status != 200:
                raise aiohttp.ClientError(f"PUT lease: HTTP {resp.status}")
            self.clock_lag = clock_lag(resp.headers.get("Date"))

    async def _fence(self, reason: str) -> None:
        broker = self.broker
        if broker.role != "active":
            return
        log.error("self-fencing: %s; stepping down to passive (epoch %d)", reason, broker.epoch)
        self.fenced_at = self.clock.monotonic()
        metrics.SELF_FENCINGS.inc()
        await broker.set_role("passive", broker.epoch, None)


class LeaseLost(Exception):
    """Another broker holds the Lease: this one is no longer the active."""
