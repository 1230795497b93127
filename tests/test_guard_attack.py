"""Attacks on the replication guard in the active's Lease (docs/replication.md, "The
replication guard in the Lease"): sequences in which a Lease that lapsed saying
`<epoch>:0` would let the operator promote a passive that lacks a confirmed message.

The invariant under attack: whenever the active's committer confirms without its
passive (it went on alone), the Lease it keeps says `alone` = 1 from before that
confirm until a passive catches up again. The real `LeaseKeeper` against a loopback
API server whose writes the test holds, and the real `ReplicationSource` going on
alone through it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from fakeclock import FakeClock

from twinmq.broker.api import Role
from twinmq.broker.lease import GUARD_ANNOTATION, LeaseKeeper
from twinmq.broker.settings import BrokerSettings
from twinmq.testing.waiting import until

DURATION = 4.0
NAME = "orders-primary"
EPOCH = 3


class ApiServer:
    """The Lease's API, held by this broker: a write waits while `held` is clear."""

    def __init__(self) -> None:
        self.held = asyncio.Event()
        self.held.set()
        self.writes_waiting = 0
        self.guards: list[str] = []  # the replication guard of every write that landed

    async def handle(self, request: web.Request) -> web.Response:
        if request.method == "PUT":
            body = await request.json()
            self.writes_waiting += 1
            try:
                await self.held.wait()
            finally:
                self.writes_waiting -= 1
            self.guards.append(body["metadata"]["annotations"][GUARD_ANNOTATION])
        return web.json_response({"spec": {"holderIdentity": NAME}})

    @property
    def says(self) -> str | None:
        """What the Lease says now: the guard of the last write that landed."""
        return self.guards[-1] if self.guards else None


@contextlib.asynccontextmanager
async def serving(api: ApiServer) -> AsyncIterator[str]:
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


class Broker:
    """What the keeper sees of an active broker."""

    def __init__(self) -> None:
        self.settings = BrokerSettings(name=NAME)
        self.role: Role = "active"
        self.epoch = EPOCH

    async def set_role(self, role: Role, epoch: int, replicate_from: str | None) -> None:
        self.role = role


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(60):
            await scenario()

    asyncio.run(bounded())


def test_a_passive_caught_up_while_the_mark_was_written_does_not_leave_a_spent_mark() -> None:
    """The mark is in flight (a slow API server); meanwhile a passive reconnects and
    catches up (`passive_in_sync`: `alone` = 0 for the next renewal), and its link drops
    again before the mark's answer. Going on alone on that answer would confirm alone
    while every later renewal writes `<epoch>:0`: a Lease that lapses then says the
    active never went on alone, and the passive (caught up in this epoch, then cut off)
    is promoted without what was confirmed since. The mark must not count: the caller
    marks again (or its passive is back in sync)."""

    async def scenario() -> None:
        api, clock, broker = ApiServer(), FakeClock(), Broker()
        async with serving(api) as url:
            keeper = LeaseKeeper(broker, url, DURATION, clock=clock)
            keeper.activated()
            api.held.clear()
            marking = asyncio.create_task(keeper.record_alone())
            await until("the mark's write reached the API server", lambda: api.writes_waiting)
            keeper.passive_in_sync()  # a passive caught up meanwhile (and is lost again)
            api.held.set()
            went_alone = await marking
            if not went_alone:  # the caller marks again (source.py `_mark_then_go_alone`)
                went_alone = await keeper.record_alone()
            assert went_alone
            # The active confirms alone from here on; the renewals that follow must say so.
            renewing = asyncio.create_task(keeper.run())
            try:
                writes = len(api.guards)
                await until("the next renewal", lambda: len(api.guards) > writes)
            finally:
                renewing.cancel()
                await asyncio.gather(renewing, return_exceptions=True)
            assert api.says == f"{EPOCH}:1", (
                "the active goes on alone while its Lease says it never did"
            )

    run(scenario)
