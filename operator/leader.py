"""Leader election: only the operator replica that holds a Lease runs kopf; the others wait.

Two operators taking decisions at once is a split brain (each may promote a different
broker), so the replicas elect one leader with a coordination.k8s.io Lease in the
operator's namespace, as controller-runtime and client-go do: a candidate takes the Lease
when it is free, or when its record has not changed for `lease_seconds` on the candidate's
own monotonic clock (no trust in another node's wall clock), by an update carrying the
resourceVersion it read, so that of two candidates one wins and the other gets a conflict.

The leader renews every `retry_seconds`. Fencing: it stops acting once `renew_deadline_seconds`
have passed since the start of its last successful renewal, which is before any other
replica can see the Lease lapse (`lease_seconds` after it observed that renewal). A
deadline timer decides this without waiting for any request, so a hung API call cannot
delay it, and the process then exits at once (`run`): kopf's handlers run in threads that
a cancellation cannot stop, an exit does. A leader that stops gracefully (SIGTERM, an
upgrade) releases the Lease so a standby takes over at its next attempt.

A standby serves `/healthz` on the health port (live and ready: it is a sound candidate);
the leader hands the port to kopf's liveness endpoint. Why a Lease and not kopf's peering:
docs/operator.md, "Running more than one replica".
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import socket
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from aiohttp import web

from twinmq.broker.lease import Clock, SystemClock, now_rfc3339
from twinmq.operator import metrics
from twinmq.operator.kube import Conflict, Kube

log = logging.getLogger(__name__)
T = TypeVar("T")
Obj = dict[str, Any]

ELECTION_ENV = "TWINMQ_OPERATOR_LEADER_ELECTION"
LEASE_NAME_ENV = "TWINMQ_OPERATOR_LEASE_NAME"
LEASE_NAMESPACE_ENV = "TWINMQ_OPERATOR_LEASE_NAMESPACE"
IDENTITY_ENV = "TWINMQ_OPERATOR_IDENTITY"
LEASE_SECONDS_ENV = "TWINMQ_OPERATOR_LEASE_SECONDS"
RENEW_DEADLINE_ENV = "TWINMQ_OPERATOR_RENEW_DEADLINE_SECONDS"
RETRY_SECONDS_ENV = "TWINMQ_OPERATOR_RETRY_SECONDS"
HEALTH_ENDPOINT_ENV = "TWINMQ_OPERATOR_HEALTH_ENDPOINT"
HEALTH_ENDPOINT = "http://0.0.0.0:8080/healthz"
"""The standby's own `/healthz`, then kopf's liveness endpoint (the chart probes :8080)."""
LOST_EXIT_CODE = 3
"""The exit status of a leader that lost its Lease (the pod restarts it as a standby)."""


@dataclass(frozen=True)
class ElectionSettings:
    """Which Lease, who we are, and the timings (controller-runtime's defaults)."""

    namespace: str
    identity: str
    name: str = "twinmq-operator-leader"
    lease_seconds: float = 15.0
    renew_deadline_seconds: float = 10.0
    retry_seconds: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            raise ValueError(
                "leader election needs 0 < retry < renew deadline < lease duration; got "
                f"{self.retry_seconds}, {self.renew_deadline_seconds}, {self.lease_seconds}"
            )

    @property
    def request_timeout(self) -> float:
        """One API request's limit: a hung one leaves time for more attempts."""
        return self.retry_seconds

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> ElectionSettings | None:
        """The settings when `$TWINMQ_OPERATOR_LEADER_ELECTION` is true, else None (the
        operator then runs alone, as `kopf run` does)."""
        env = os.environ if env is None else env
        if env.get(ELECTION_ENV, "").lower() not in ("1", "true", "yes"):
            return None
        namespace = env.get(LEASE_NAMESPACE_ENV)
        if not namespace:
            raise ValueError(f"leader election needs ${LEASE_NAMESPACE_ENV}")
        timings = {
            field: float(env[var])
            for field, var in (
                ("lease_seconds", LEASE_SECONDS_ENV),
                ("renew_deadline_seconds", RENEW_DEADLINE_ENV),
                ("retry_seconds", RETRY_SECONDS_ENV),
            )
            if env.get(var)
        }
        return cls(
            namespace=namespace,
            identity=env.get(IDENTITY_ENV) or socket.gethostname(),
            name=env.get(LEASE_NAME_ENV) or cls.name,
            **timings,
        )


class LeaseStore(Protocol):
    """What the elector needs of the API (`kube.Kube` has it)."""

    def get_lease(self, namespace: str, name: str, timeout: float | None = None) -> Obj | None:
        """The Lease, or None."""
        ...

    def write_lease(self, lease: Obj, timeout: float) -> Obj:
        """Create it, or replace it at its resourceVersion; `kube.Conflict` on a race."""
        ...

    def record_event(
        self, involved: Obj, reason: str, message: str, timeout: float, warning: bool = False
    ) -> None:
        """Post an Event about `involved` (the Lease)."""
        ...


@dataclass(frozen=True)
class LeaseRecord:
    """The parts of a leader Lease that election reads."""

    holder: str | None
    duration: float
    transitions: int
    acquire_time: str | None
    renew_time: str | None

    @classmethod
    def of(cls, lease: Obj) -> LeaseRecord:
        """From a Lease as the API serves it."""
        spec = lease.get("spec") or {}
        return cls(
            holder=spec.get("holderIdentity") or None,
            duration=float(spec.get("leaseDurationSeconds") or 0),
            transitions=int(spec.get("leaseTransitions") or 0),
            acquire_time=spec.get("acquireTime"),
            renew_time=spec.get("renewTime"),
        )


def may_take(record: LeaseRecord, observed_at: float, now: float, identity: str) -> bool:
    """Whether `identity` may write itself into the Lease now: it is free, ours, or has not
    changed for its whole duration since we first saw it as it is (our clock, not theirs)."""
    if record.holder is None or record.holder == identity:
        return True
    return now >= observed_at + record.duration


class Outcome(enum.Enum):
    """What one attempt to acquire or renew found."""

    HELD = "held"  # we hold the Lease (written at this attempt)
    TAKEN = "taken"  # another replica holds it
    FAILED = "failed"  # no answer, an error, or a lost race: try again


class LeaderElector:
    """Acquires, renews and releases the leader Lease; knows when leadership is lost."""

    def __init__(
        self, store: LeaseStore, settings: ElectionSettings, clock: Clock | None = None
    ) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock or SystemClock()
        self.leading = False
        self.deadline = 0.0  # our clock: when the leader must have stopped acting
        self.holder: str | None = None  # who holds the Lease, as last seen
        self.taken_from: str | None = None  # the other holder our last acquisition replaced
        self._written: Obj | None = None  # the Lease as we last wrote it (Events name it)
        self.attempts = 0  # finished attempts (the tests wait on them)
        # The record as last seen and when it was first seen so (our clock).
        self._seen: tuple[Any, ...] | None = None
        self._seen_at = 0.0
        # Lease I/O has threads of its own: a busy default executor (kopf's handlers run
        # there) must not delay a renewal.
        self._io = ThreadPoolExecutor(max_workers=4, thread_name_prefix="twinmq-leader")

    @property
    def where(self) -> str:
        """namespace/name of the Lease (for logs)."""
        return f"{self.settings.namespace}/{self.settings.name}"

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        # The request has its own timeout; this one also covers a queued call.
        timeout = 2 * self.settings.request_timeout
        async with asyncio.timeout(timeout):
            return await loop.run_in_executor(self._io, fn, *args)

    def _lease(self, record: LeaseRecord | None, current: Obj | None) -> Obj:
        s, now = self.settings, now_rfc3339()
        ours = record is not None and record.holder == s.identity
        metadata: Obj = {"name": s.name, "namespace": s.namespace}
        if current is not None:
            metadata["resourceVersion"] = current["metadata"]["resourceVersion"]
        transitions = 0 if record is None else record.transitions + (0 if ours else 1)
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {
                "holderIdentity": s.identity,
                "leaseDurationSeconds": max(1, round(s.lease_seconds)),
                "acquireTime": record.acquire_time if ours and record else now,
                "renewTime": now,
                "leaseTransitions": transitions,
            },
        }

    async def attempt(self) -> Outcome:
        """Read the Lease and write ourselves into it if we may (acquire or renew). On
        success the deadline moves to this attempt's start plus the renew deadline: the
        renewTime written, and every other replica's sight of it, come later."""
        try:
            return await self._attempt()
        finally:
            self.attempts += 1

    async def _attempt(self) -> Outcome:
        s = self.settings
        started = self.clock.monotonic()
        try:
            current = await self._call(self.store.get_lease, s.namespace, s.name, s.request_timeout)
            record = None
            if current is not None:
                record = LeaseRecord.of(current)
                seen = (record.holder, record.renew_time, current["metadata"]["resourceVersion"])
                if seen != self._seen:
                    self._seen, self._seen_at = seen, started
                self.holder = record.holder
                if not may_take(record, self._seen_at, started, s.identity):
                    return Outcome.TAKEN
            lease = self._lease(record, current)
            self._written = await self._call(self.store.write_lease, lease, s.request_timeout)
        except Conflict:
            return Outcome.FAILED  # another candidate wrote first: read again next time
        except Exception as exc:  # any API trouble: try again; the deadline decides
            log.warning("leader Lease %s: %s: %s", self.where, type(exc).__name__, exc)
            return Outcome.FAILED
        if record is not None and record.holder not in (None, s.identity):
            self.taken_from = record.holder
        elif record is None or record.holder is None:
            self.taken_from = None
        self.holder = s.identity
        self.deadline = started + s.renew_deadline_seconds
        return Outcome.HELD

    async def _announce(self, reason: str, message: str) -> None:
        """An Event on the Lease, as client-go's leader election posts (best effort: the
        log has it too)."""
        if self._written is None:
            return
        try:
            await self._call(
                self.store.record_event, self._written, reason, message,
                self.settings.request_timeout,
            )  # fmt: skip
        except Exception as exc:
            log.warning("leader election: cannot post the %s Event: %s", reason, exc)

    async def acquire(self) -> None:
        """Stand by until this replica holds the Lease."""
        s = self.settings
        log.info("leader election: %s standing by for Lease %s", s.identity, self.where)
        metrics.LEADER.set(0)
        while await self.attempt() is not Outcome.HELD:
            await self.clock.sleep(s.retry_seconds)
        self.leading = True
        metrics.LEADER.set(1)
        took = "" if self.taken_from is None else f" ({self.taken_from} had let it lapse)"
        log.info("leader election: %s acquired Lease %s%s; leading", s.identity, self.where, took)
        await self._announce("LeaderElection", f"{s.identity} became leader{took}")

    async def keep(self) -> str:
        """Renew while leading; return why leadership was lost, no later than the deadline
        (whatever the requests do)."""
        renewing = asyncio.create_task(self._renew())
        timer = asyncio.create_task(self._deadline_timer())
        try:
            done, _ = await asyncio.wait({renewing, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when cancelled (a graceful stop): no renewal may outlive `keep`
            for task in (renewing, timer):
                task.cancel()
            await asyncio.gather(renewing, timer, return_exceptions=True)
        self.leading = False
        metrics.LEADER.set(0)
        reason = done.pop().result()
        log.error(
            "leader election: %s lost Lease %s: %s", self.settings.identity, self.where, reason
        )
        return reason

    async def _renew(self) -> str:
        while True:
            await self.clock.sleep(self.settings.retry_seconds)
            if await self.attempt() is Outcome.TAKEN:
                return f"the Lease is held by {self.holder!r}"

    async def _deadline_timer(self) -> str:
        while (remaining := self.deadline - self.clock.monotonic()) > 0:
            await self.clock.sleep(remaining)  # the deadline may have moved: look again
        return f"not renewed for {self.settings.renew_deadline_seconds:g} s"

    async def release(self) -> None:
        """Give the Lease up (a graceful stop): a standby takes it at its next attempt."""
        s = self.settings
        try:
            current = await self._call(self.store.get_lease, s.namespace, s.name, s.request_timeout)
            if current is None or LeaseRecord.of(current).holder != s.identity:
                return
            current["spec"].update(holderIdentity=None, leaseDurationSeconds=1,
                                   renewTime=now_rfc3339())  # fmt: skip
            self._written = await self._call(self.store.write_lease, current, s.request_timeout)
        except Exception as exc:  # a Conflict or any API trouble: it lapses by itself
            log.warning("leader election: cannot release the Lease (it will lapse): %s", exc)
            return
        finally:
            self.leading = False
            metrics.LEADER.set(0)
        log.info("leader election: %s released Lease %s", s.identity, self.where)
        await self._announce("LeaderElection", f"{s.identity} stopped leading: released the Lease")


async def lead(
    elector: LeaderElector,
    work: Callable[[], Coroutine[Any, Any, None]],
    settle: Callable[[], Coroutine[Any, Any, None]] | None = None,
) -> str | None:
    """Stand by, then run `work` while leading. Returns why leadership was lost (`work` is
    cancelled; the caller must stop acting at once), or None when `work` ended by itself:
    then `settle` (what work started, e.g. handler threads) finishes while the Lease is still
    renewed, and the Lease is released."""
    await elector.acquire()
    keeping = asyncio.create_task(elector.keep())
    working = asyncio.create_task(work())
    await asyncio.wait({keeping, working}, return_when=asyncio.FIRST_COMPLETED)
    if not keeping.done() and settle is not None:
        settling = asyncio.create_task(settle())
        await asyncio.wait({keeping, settling}, return_when=asyncio.FIRST_COMPLETED)
        settling.cancel()
    if keeping.done():
        working.cancel()
        return keeping.result()
    keeping.cancel()
    await asyncio.gather(keeping, return_exceptions=True)
    await elector.release()
    working.result()  # a crash of the operator is raised here
    return None


def health_endpoint() -> str:
    """Where `/healthz` is served: `$TWINMQ_OPERATOR_HEALTH_ENDPOINT`, else :8080 (tests
    move it to loopback)."""
    return os.environ.get(HEALTH_ENDPOINT_ENV) or HEALTH_ENDPOINT


async def serve_health(endpoint: str) -> web.AppRunner:
    """Serve `endpoint` (`http://host:port/path`) while standing by: the process runs and
    is a candidate (live and ready; a rolling update may go on). `cleanup()` frees it."""

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"leader": False, "standby": True})

    url = urlsplit(endpoint)
    app = web.Application()
    app.router.add_get(url.path or "/", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, url.hostname, url.port).start()
    return runner


async def run_elected(
    settings: ElectionSettings, operator: Callable[[], Coroutine[Any, Any, None]]
) -> None:
    """Stand by (serving health), then run `operator` while leading. A lost Lease ends the
    process at once, threads and all: nothing it started may act after the deadline."""
    elector = LeaderElector(Kube(), settings)
    health = await serve_health(health_endpoint())

    async def work() -> None:
        await health.cleanup()  # kopf's liveness endpoint takes the port over
        await operator()

    loop = asyncio.get_running_loop()
    reason = await lead(elector, work, settle=loop.shutdown_default_executor)
    if reason is not None:
        log.critical("leader election: leadership lost (%s): exiting to stop acting", reason)
        logging.shutdown()
        os._exit(LOST_EXIT_CODE)


def run(operator: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run `operator` (kopf), alone or, when leader election is configured
    (`ElectionSettings.from_environment`), only while this replica is the leader."""
    settings = ElectionSettings.from_environment()
    if settings is None:
        metrics.LEADER.set(1)  # alone: this process runs the handlers
        asyncio.run(operator())
    else:
        asyncio.run(run_elected(settings, operator))
