"""The active broker's Lease keeper against a real HTTP server on loopback, on a fake clock.

The API server is an aiohttp server on 127.0.0.1 that serves the Lease, or hangs
(a network cut: the request never returns). Time is a fake clock the test moves
by hand, so the checks are about the order of events on that clock (fenced before
the Lease could lapse), never about wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Protocol

import aiohttp
import pytest
from aiohttp import web
from fakeclock import FakeClock
from prometheus_client import REGISTRY

from twinmq.broker.api import Role
from twinmq.broker.lease import (
    FENCE_MARGIN,
    GUARD_ANNOTATION,
    HANDOVER_RETRY,
    LeaseKeeper,
    ReplicationGuard,
)
from twinmq.broker.settings import BrokerSettings
from twinmq.testing.waiting import until

DURATION = 4.0


class Broker:
    """What the keeper sees of a broker: an active one that records its demotion."""

    def __init__(self) -> None:
        self.settings = BrokerSettings(name="orders-primary")
        self.role: Role = "active"
        self.epoch = 3
        self.demoted = asyncio.Event()

    async def set_role(self, role: Role, epoch: int, replicate_from: str | None) -> None:
        self.role = role
        if role == "passive":
            self.demoted.set()


class ApiServer:
    """The Lease's API: answers (`holder` holds it), or hangs every request."""

    def __init__(self, holder: str, hang: bool) -> None:
        self.holder = holder
        self.hang = hang
        self.requests = 0
        self.request_arrived = asyncio.Event()
        self.renewals: list[str] = []
        self.renew_time: str | None = None
        self.guards: list[str] = []  # the replication guard of every write, in order
        self.in_flight = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.request_arrived.set()
        if self.hang:
            self.in_flight += 1
            try:
                await asyncio.Event().wait()  # never answers
            finally:
                self.in_flight -= 1
        if request.method == "PUT":
            body = await request.json()
            self.guards.append(body["metadata"]["annotations"][GUARD_ANNOTATION])
            if body["spec"].get("renewTime") != self.renew_time:
                self.renew_time = body["spec"].get("renewTime")
                self.renewals.append(body["spec"]["renewTime"])
        return web.json_response({"spec": {"holderIdentity": self.holder,
                                           "renewTime": self.renew_time}})  # fmt: skip


class LeaseApi(Protocol):
    """A fake Lease API: one handler for every request to `/lease`."""

    async def handle(self, request: web.Request) -> web.Response:
        """Answer a GET or a PUT of the Lease."""
        ...


@contextlib.asynccontextmanager
async def serving(api: LeaseApi) -> AsyncIterator[str]:
    """The API server on a loopback port; yields the Lease's URL."""
    app = web.Application()
    app.router.add_route("*", "/lease", api.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/lease"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def keeping(
    api: ApiServer, clock: FakeClock, broker: Broker, request_timeout: float | None = None
) -> AsyncIterator[LeaseKeeper]:
    """A keeper of an active broker, running against `api`."""
    async with serving(api) as url:
        keeper = LeaseKeeper(broker, url, DURATION, clock=clock)
        if request_timeout is not None:
            keeper.request_timeout = request_timeout
        keeper.activated()  # the operator activated us and wrote renewTime: now (or later)
        task = asyncio.create_task(keeper.run())
        try:
            yield keeper
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def asleep(clock: FakeClock) -> Callable[[], bool]:
    """`until` check: both of the keeper's tasks (renewals, deadline) wait on the clock, so
    moving it now wakes them rather than a sleep that starts after the move."""
    return lambda: clock.sleeping == 2


def renewed(api: ApiServer, count: int) -> Callable[[], bool]:
    """`until` check: the API server has seen `count` renewals."""
    return lambda: len(api.renewals) == count


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_hanging_api_server_fences_the_active_before_its_lease_can_lapse() -> None:
    async def scenario() -> None:
        api, clock, broker = ApiServer("orders-primary", hang=True), FakeClock(), Broker()
        lapses_at = clock.now + DURATION  # renewTime (no earlier than activation) + duration
        # Requests hang for as long as the test runs: the timer must not wait for them.
        async with keeping(api, clock, broker, request_timeout=3600.0) as keeper:
            await until("the first renewal request", lambda: api.in_flight == 1)
            await clock.advance_to(lapses_at - FENCE_MARGIN - 0.5)
            assert broker.role == "active", "fenced while the Lease was still safely held"
            await clock.advance_to(lapses_at - FENCE_MARGIN)
            await until("the broker stepped down", broker.demoted.is_set)
            assert keeper.fenced_at is not None and keeper.fenced_at < lapses_at
            assert api.in_flight == 1, "the renewal request was expected to still hang"

    run(scenario)


def test_renewals_keep_an_active_broker_active_past_the_first_deadline() -> None:
    async def scenario() -> None:
        api, clock, broker = ApiServer("orders-primary", hang=False), FakeClock(), Broker()
        async with keeping(api, clock, broker) as keeper:
            first_deadline = keeper.deadline
            await until("the first renewal", lambda: len(api.renewals) == 1)
            for n in range(2, 11):  # three Lease durations and more, a renewal every period
                # Moved only once the keeper waits on the clock: a move before its sleep
                # starts wakes nothing, and renewal n never came (flaky under load).
                await until("the keeper waits for its next renewal", asleep(clock))
                await clock.advance_to(clock.now + keeper.period)
                await until(f"renewal {n}", renewed(api, n))
            assert clock.now > first_deadline and broker.role == "active"
            assert keeper.deadline > clock.now

    run(scenario)


def test_a_lease_taken_by_another_broker_after_the_handover_fences_at_once() -> None:
    async def scenario() -> None:
        api, clock, broker = ApiServer("orders-primary", hang=False), FakeClock(), Broker()
        async with keeping(api, clock, broker) as keeper:
            await until("the first renewal", renewed(api, 1))
            await until("the keeper waits for its next renewal", asleep(clock))
            api.holder = "orders-backup"
            await clock.advance_to(clock.now + keeper.period)
            await until("the broker stepped down", broker.demoted.is_set)
            assert keeper.fenced_at == clock.now < keeper.deadline  # not at the deadline
            assert len(api.renewals) == 1

    run(scenario)


def test_a_just_activated_broker_waits_for_the_operator_to_hand_the_lease_over() -> None:
    async def scenario() -> None:
        # The operator writes the Lease just after the activation: the first reads still
        # name the previous active. Fencing then cost a failover the Lease's duration.
        api, clock, broker = ApiServer("orders-backup", hang=False), FakeClock(), Broker()
        async with keeping(api, clock, broker) as keeper:
            for n in range(1, 4):
                await until(f"read {n} of the Lease", lambda: api.requests >= n)  # noqa: B023
                await until("the keeper waits to read it again", asleep(clock))
                await clock.advance_to(clock.now + HANDOVER_RETRY)
            await until("read 4 of the Lease", lambda: api.requests >= 4)
            await until("the keeper waits to read it again", asleep(clock))
            assert broker.role == "active" and not keeper.handed_over
            api.holder = "orders-primary"  # the operator's handover
            await clock.advance_to(clock.now + HANDOVER_RETRY)
            await until("the first renewal", renewed(api, 1))
            assert keeper.handed_over and broker.role == "active"
            assert keeper.fenced_at is None

    run(scenario)


def test_a_lease_never_handed_over_fences_the_activated_broker_at_its_deadline() -> None:
    async def scenario() -> None:
        api, clock, broker = ApiServer("orders-backup", hang=False), FakeClock(), Broker()
        lapses_at = clock.now + DURATION
        async with keeping(api, clock, broker) as keeper:
            await until("the first read of the Lease", lambda: api.requests >= 1)
            await until("the keeper waits to read it again", asleep(clock))
            await clock.advance_to(lapses_at - FENCE_MARGIN - 0.5)
            assert broker.role == "active", "fenced before its deadline"
            await clock.advance_to(lapses_at - FENCE_MARGIN)
            await until("the broker stepped down", broker.demoted.is_set)
            assert keeper.fenced_at is not None and keeper.fenced_at < lapses_at
            assert api.renewals == []

    run(scenario)


def test_a_renewal_request_times_out_well_inside_the_renewal_period() -> None:
    keeper = LeaseKeeper(Broker(), "http://127.0.0.1:9/lease", DURATION, clock=FakeClock())
    # Two attempts fit between a renewal and the deadline even when the first one hangs.
    assert keeper.request_timeout <= keeper.period / 2
    assert keeper.period + keeper.request_timeout + keeper.period / 4 < DURATION - FENCE_MARGIN


def test_the_request_timeout_abandons_a_hanging_renewal() -> None:
    async def scenario() -> None:
        api = ApiServer("orders-primary", hang=True)
        async with serving(api) as url:
            keeper = LeaseKeeper(Broker(), url, DURATION, clock=FakeClock())
            timeout = aiohttp.ClientTimeout(total=0.2)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                with pytest.raises(TimeoutError):
                    await keeper._renew(session)

    run(scenario)


def counted(name: str) -> float:
    """A broker counter's value in this process's registry (0 before its first increment)."""
    return REGISTRY.get_sample_value(name) or 0.0


def test_failed_renewals_and_the_self_fencing_are_counted_for_the_alerts() -> None:
    """`TwinMQLeaseNotRenewed` and `TwinMQSelfFenced` (docs/monitoring.md) read these."""

    async def scenario() -> None:
        failures = counted("twinmq_lease_renewal_failures_total")
        fencings = counted("twinmq_lease_self_fencings_total")
        api, clock, broker = ApiServer("orders-primary", hang=True), FakeClock(), Broker()
        lapses_at = clock.now + DURATION
        async with keeping(api, clock, broker, request_timeout=0.05):
            await until(
                "a renewal counted as failed",
                lambda: counted("twinmq_lease_renewal_failures_total") > failures,
            )
            assert counted("twinmq_lease_self_fencings_total") == fencings
            await clock.advance_to(lapses_at - FENCE_MARGIN)
            await until("the broker stepped down", broker.demoted.is_set)
        assert counted("twinmq_lease_self_fencings_total") == fencings + 1

    run(scenario)


def test_every_renewal_says_whether_the_active_may_have_confirmed_alone() -> None:
    async def scenario() -> None:
        api, clock, broker = ApiServer("orders-primary", hang=False), FakeClock(), Broker()
        async with keeping(api, clock, broker) as keeper:
            await until("the first renewal", renewed(api, 1))
            assert api.guards == ["3:0"]  # epoch 3, never alone
            await until("the keeper waits for its next renewal", asleep(clock))
            assert await keeper.record_alone()
            assert api.guards == ["3:0", "3:1"] and api.renewals == [api.renewals[0]]
            await clock.advance_to(clock.now + keeper.period)
            await until("the second renewal", renewed(api, 2))
            assert api.guards[-1] == "3:1", "a renewal undid the mark"
            await until("the keeper waits for its next renewal", asleep(clock))
            await clock.advance_to(clock.now + keeper.period)
            await until("the third renewal", renewed(api, 3))
            assert api.guards[-1] == "3:1", "a renewal undid the mark"

    run(scenario)


def test_a_passive_caught_up_after_a_mark_is_written_into_the_lease_at_once() -> None:
    """The catch-up's `0` does not wait for the next renewal (a third of the duration):
    until it lands, the operator does not promote even a ready passive against the `1`.
    One write, no renewal (the clock does not move); a catch-up with no mark to undo
    writes nothing."""

    async def scenario() -> None:
        api, clock, broker = ApiServer("orders-primary", hang=False), FakeClock(), Broker()
        async with keeping(api, clock, broker) as keeper:
            await until("the first renewal", renewed(api, 1))
            keeper.passive_in_sync()  # nothing marked: nothing to write
            assert await keeper.record_alone()
            assert api.guards == ["3:0", "3:1"]
            keeper.passive_in_sync()  # its catch-up carried what was confirmed alone
            await until("the catch-up's 0 written", lambda: len(api.guards) == 3)
            assert api.guards == ["3:0", "3:1", "3:0"] and len(api.renewals) == 1
            keeper.passive_in_sync()
            await until("the keeper waits for its next renewal", asleep(clock))
            await clock.advance_to(clock.now + keeper.period)
            await until("the second renewal", renewed(api, 2))
            assert api.guards == ["3:0", "3:1", "3:0", "3:0"], "one write per catch-up after a mark"

    run(scenario)


def test_an_active_that_cannot_mark_its_lease_does_not_go_on_alone() -> None:
    async def scenario() -> None:
        api, clock, broker = ApiServer("orders-primary", hang=True), FakeClock(), Broker()
        async with serving(api) as url:
            keeper = LeaseKeeper(broker, url, DURATION, clock=clock)
            keeper.request_timeout = 0.1
            keeper.activated()
            assert not await keeper.record_alone()  # the write hung: confirms stay held
            api.hang, api.holder = False, "orders-backup"
            assert not await keeper.record_alone()  # the Lease is another broker's
            assert api.guards == []

    run(scenario)


def test_a_mark_written_after_the_deadline_does_not_let_the_active_go_on_alone() -> None:
    async def scenario() -> None:
        # An operator that saw the Lease lapse read no mark: the write that lands after
        # it must not count (the broker fences at its deadline instead).
        api, clock, broker = ApiServer("orders-primary", hang=False), FakeClock(), Broker()
        async with serving(api) as url:
            keeper = LeaseKeeper(broker, url, DURATION, clock=clock)
            keeper.activated()
            clock.now = keeper.deadline
            assert not await keeper.record_alone()
            assert api.guards == ["3:1"]

    run(scenario)


def test_a_lease_guard_is_read_back_and_garbage_is_ignored() -> None:
    def lease(value: object) -> dict[str, object]:
        return {"metadata": {"annotations": {GUARD_ANNOTATION: value}}}

    assert ReplicationGuard.of_lease(lease("7:1")) == ReplicationGuard(7, True)
    assert ReplicationGuard.of_lease(lease(ReplicationGuard(4, False).encode())) == (
        ReplicationGuard(4, False)
    )
    for bad in ("7", "7:2", "x:0", "", None, 5):
        assert ReplicationGuard.of_lease(lease(bad)) is None
    assert ReplicationGuard.of_lease({"metadata": {}}) is None
    assert ReplicationGuard.of_lease({}) is None
