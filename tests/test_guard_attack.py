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
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from aiohttp import web
from fakeclock import FakeClock
from test_lease import serving

from twinmq.broker.api import Role
from twinmq.broker.lease import GUARD_ANNOTATION, LeaseKeeper
from twinmq.broker.replication.replica import ReplicaClient
from twinmq.broker.server import Broker as RealBroker
from twinmq.broker.settings import BrokerSettings
from twinmq.operator import main as operator_main
from twinmq.operator.builders import ClusterRef, build_lease, lease_name
from twinmq.operator.kube import Kube
from twinmq.operator.leasewatch import LeaseWatch
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


# Long enough that the test never waits it out: the active must not go on alone sooner.
REPLICATION_TIMEOUT = 30.0


def _settings(tmp_path: Path, name: str, role: Role) -> BrokerSettings:
    return BrokerSettings.model_validate({
        "name": name, "data_dir": tmp_path / name, "host": "127.0.0.1", "port": 0,
        "admin_port": 0, "replication_port": 0, "fsync": False, "audit": False,
        "log_level": "WARNING", "role": role, "epoch": EPOCH,
        "replication_token": "guard-attack-token", "replication_timeout": REPLICATION_TIMEOUT,
    })  # fmt: skip


def test_a_mark_outlived_by_a_catch_up_does_not_send_the_active_on_alone_early(
    tmp_path: Path,
) -> None:
    """The lost passive's degrade starts a mark, which the API server holds; the passive
    comes back and catches up (it is ready: the active echoes its pings), and drops again.
    Its readiness lasts `replication_timeout` from the active's last echo, a promise the
    active keeps by waiting as long before it goes on alone. The first mark, answered
    now, must not cut that wait short: an active killed then (Kubernetes reports its
    process gone: promotion at once) would leave a ready passive that lacks what the
    active confirmed alone. A real active and passive in one loop, over loopback."""

    async def scenario() -> None:
        api = ApiServer()
        async with serving(api) as url:
            active = RealBroker(_settings(tmp_path, NAME, "active"))
            keeper = LeaseKeeper(active, url, DURATION)
            keeper.activated()
            active.lease = keeper
            await active.start()
            source = active.source
            address = f"127.0.0.1:{active.replication_port}"
            passive = RealBroker(_settings(tmp_path, "orders-backup", "passive"))
            await passive.start()

            async def replicate() -> ReplicaClient:
                replica = passive.replica = ReplicaClient(passive, address)
                replica.start()
                await until("the passive caught up", lambda: replica.caught_up)
                await until("the active is guarded", lambda: active.committer.guarded)
                return replica

            async def cut(replica: ReplicaClient) -> None:
                link = source.link
                await replica.stop()
                passive.replica = None
                await until("the active saw the link drop", lambda: source.link is not link)

            try:
                await cut(await replicate())  # the first link: its degrade timer runs
                api.held.clear()
                source._degrade()  # ... and runs out (not waited for: 30 s)
                await until("the mark's write is held", lambda: api.writes_waiting)
                assert active.committer.guarded, "confirms are held until the mark lands"
                second = await replicate()
                await cut(second)
                assert second.ready, "the passive stays promotable after the link's loss"
                api.held.set()
                await until(
                    "the mark settled",
                    lambda: source._marking is None or source._marking.done(),
                )
                assert active.committer.guarded, (
                    "the active went on alone on a mark older than its passive's catch-up, "
                    "sooner than replication_timeout after losing that ready passive"
                )
            finally:
                api.held.set()
                await passive.stop()
                await active.stop()

    run(scenario)


class Operator:
    """The operator's sight of one cluster's Lease on the real API server: `lease_state`
    with its own `LeaseWatch`, on a monotonic clock the test sets (`now`); the Lease
    written as a broker writes it (a renewal, a mark, a catch-up), straight to the API."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube = kube
        self.cluster = ClusterRef(namespace=namespace, name="orders", uid="u-1")
        kube.core.create_namespace({"metadata": {"name": namespace}})  # type: ignore[arg-type]
        self.watch = LeaseWatch()
        self.now = 1000.0

    def sees(self) -> tuple[object, ...]:
        """(holder, expired, guard) as the operator judges the Lease at `now`."""
        return operator_main.lease_state(self.cluster, self.watch, lambda: self.now)

    def restarted(self) -> None:
        """A new operator process: nothing seen yet."""
        self.watch = LeaseWatch()

    def written(self, guard: str, renewed_ago: float = 0.0) -> None:
        """The broker's write: the Lease named for the primary, renewed `renewed_ago`
        seconds ago by this process's wall clock (a broker clock that far behind), saying
        `guard`."""
        at = datetime.fromtimestamp(time.time() - renewed_ago, UTC)
        lease = build_lease(self.cluster, "orders-primary", int(DURATION),
                            at.strftime("%Y-%m-%dT%H:%M:%S.%fZ"))  # fmt: skip
        lease["metadata"]["annotations"] = {GUARD_ANNOTATION: guard}
        name = lease["metadata"]["name"]
        current = self.kube.get_lease(self.cluster.namespace, name)
        if current is None:
            self.kube.coordination.create_namespaced_lease(self.cluster.namespace, lease)  # type: ignore[arg-type]
            return
        current["spec"] = lease["spec"]
        current["metadata"]["annotations"] = lease["metadata"]["annotations"]
        self.kube.coordination.replace_namespaced_lease(name, self.cluster.namespace, current)  # type: ignore[arg-type]


@pytest.fixture
def operator(
    kube: Kube, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Operator:
    """The operator's Lease reading on the real API server, in a namespace of the test's."""
    monkeypatch.setattr(operator_main, "KUBE", kube)
    return Operator(kube, request.node.name.replace("_", "-")[:50].strip("-"))


def test_the_operator_trusts_a_zero_only_once_it_has_seen_the_lease_unchanged_for_two_durations(
    operator: Operator,
) -> None:
    """A `0` is trusted, and the Lease called lapsed, by how long this operator has seen
    the same record, on its own clock: a broker writes nothing that counts past its own
    deadline, and anything it writes changes the record."""
    operator.written(f"{EPOCH}:0")
    assert operator.sees() == ("primary", False, None)
    operator.now += DURATION - 0.1
    assert operator.sees() == ("primary", False, None)
    operator.now += 0.1
    assert operator.sees() == ("primary", True, None), "lapsed, but not yet trusted"
    operator.now += DURATION - 0.1
    assert operator.sees() == ("primary", True, None)
    operator.now += 0.1
    assert operator.sees() == ("primary", True, (EPOCH, False))


def test_a_renewal_or_a_mark_restarts_the_operators_observation(operator: Operator) -> None:
    """Seen unchanged for long enough, then written again: a renewal (its `0` is fresh
    news, not trusted), a mark (news at once), the catch-up's `0` after it (fresh news
    again): each restarts the count."""
    operator.written(f"{EPOCH}:0")
    operator.sees()
    operator.now += 2 * DURATION
    assert operator.sees() == ("primary", True, (EPOCH, False))
    operator.written(f"{EPOCH}:0")  # a renewal
    assert operator.sees() == ("primary", False, None)
    operator.now += 2 * DURATION - 0.1
    assert operator.sees() == ("primary", True, None)
    operator.written(f"{EPOCH}:1")  # a mark
    assert operator.sees() == ("primary", False, (EPOCH, True))
    operator.now += 2 * DURATION
    operator.written(f"{EPOCH}:0")  # the passive caught up: 0 at once
    assert operator.sees() == ("primary", False, None)
    operator.now += 2 * DURATION
    assert operator.sees() == ("primary", True, (EPOCH, False))


def test_a_renew_time_long_past_is_neither_lapsed_nor_trusted_until_seen_for_its_duration(
    operator: Operator,
) -> None:
    """A broker whose wall clock is far behind the operator's (or an operator's far
    ahead) writes a `renewTime` that looks an hour old: the operator that reads it fresh
    calls it neither lapsed nor its `0` trusted, and neither does one just restarted (it
    has seen nothing), until its own clock has counted the durations."""
    operator.written(f"{EPOCH}:0", renewed_ago=3600)
    assert operator.sees() == ("primary", False, None)
    operator.now += DURATION
    assert operator.sees() == ("primary", True, None)
    operator.restarted()
    assert operator.sees() == ("primary", False, None)
    operator.now += 2 * DURATION
    assert operator.sees() == ("primary", True, (EPOCH, False))


def test_no_lease_is_lapsed_and_carries_no_guard(operator: Operator) -> None:
    """A Lease deleted (or never written): nobody holds the role; its last record is
    forgotten, so a Lease written again is observed from scratch."""
    operator.written(f"{EPOCH}:0")
    operator.sees()
    operator.now += 2 * DURATION
    name = lease_name(operator.cluster)
    operator.kube.coordination.delete_namespaced_lease(name, operator.cluster.namespace)
    assert operator.sees() == (None, True, None)
    operator.written(f"{EPOCH}:0")
    assert operator.sees() == ("primary", False, None)


def handed_over(operator: Operator, holder: str, epoch: int) -> None:
    """The operator's handover after activating `holder` in `epoch` (`operator/main.py`)."""
    lease = build_lease(operator.cluster, holder, int(DURATION),
                        datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"))  # fmt: skip
    operator.kube.put_lease(lease, handover_epoch=epoch)


def test_an_active_frozen_before_its_first_renewal_still_leaves_a_guard_a_restarted_operator_trusts(
    operator: Operator,
) -> None:
    """The active is frozen right after the handover, before its first renewal, and the
    operator restarts: the Lease lapses saying the handover's `<epoch>:0` (the new active
    cannot have gone on alone: it marks first, and may write only once it holds the
    Lease), so the caught-up passive is promoted after two durations. Before, the Lease
    carried no guard, or the previous holder's, and no failover ever came
    (e2e test_an_operator_killed_mid_failover_finishes_it_after_a_restart, now and then)."""
    operator.written(f"{EPOCH - 1}:1")  # the previous epoch's holder went on alone once
    handed_over(operator, "orders-backup", EPOCH)
    operator.restarted()
    assert operator.sees() == ("backup", False, None)
    operator.now += 2 * DURATION
    assert operator.sees() == ("backup", True, (EPOCH, False))


def test_the_handover_never_overwrites_a_guard_the_broker_wrote_in_its_epoch(
    operator: Operator,
) -> None:
    """A broker re-activated while it still holds the Lease may mark it before the
    operator's handover lands: its `<epoch>:1` stays (and any later epoch's guard)."""
    operator.written(f"{EPOCH}:1")
    handed_over(operator, "orders-primary", EPOCH)
    operator.sees()
    operator.now += 2 * DURATION
    assert operator.sees() == ("primary", True, (EPOCH, True))
    handed_over(operator, "orders-primary", EPOCH - 1)  # a stale pass: nothing newer undone
    assert operator.sees()[2] == (EPOCH, True)
