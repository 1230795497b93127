"""The operator's leader election against a real kube-apiserver, on a fake clock.

Every elector talks to the same real API server (tests/apiserver.py) through the
operator's own `Kube`; time is a `FakeClock` the test moves one retry period at a time,
so the checks are about the order of events on that clock (the old leader stopped
before the new one could start), never about wall time. The last tests run whole
processes through `leader.run` (what `twinmq-operator` calls), with a stand-in for kopf:
a leader cut off from the API server exits with `LOST_EXIT_CODE`, a SIGTERMed one
releases the Lease, and the standby acts after either.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from apiserver import KubeApiServer
from fakeclock import FakeClock

from twinmq.operator.kube import Kube
from twinmq.operator.leader import (
    LOST_EXIT_CODE,
    ElectionSettings,
    LeaderElector,
    LeaseRecord,
    lead,
    may_take,
)
from twinmq.testing.launcher import free_port
from twinmq.testing.waiting import until, wait_for

NAMESPACE = "default"
SETTINGS = {"lease_seconds": 15.0, "renew_deadline_seconds": 10.0, "retry_seconds": 2.0}
RETRY = SETTINGS["retry_seconds"]
LEASE = SETTINGS["lease_seconds"]
RENEW_DEADLINE = SETTINGS["renew_deadline_seconds"]
LEASE_NAMES = (f"leader-test-{n}" for n in itertools.count())


def electors(kube: Kube, clock: FakeClock, *identities: str) -> list[LeaderElector]:
    """Candidates for one fresh Lease."""
    name = next(LEASE_NAMES)
    return [
        LeaderElector(kube, ElectionSettings(NAMESPACE, who, name, **SETTINGS), clock)
        for who in identities
    ]


def holder(kube: Kube, elector: LeaderElector) -> LeaseRecord:
    """The Lease as the API server has it."""
    lease = kube.get_lease(NAMESPACE, elector.settings.name)
    assert lease is not None
    return LeaseRecord.of(lease)


def lease_events(kube: Kube, elector: LeaderElector) -> list[str]:
    """The messages of the Events posted on the elector's Lease, sorted (their times have
    one-second resolution: no order to read)."""
    found = kube.core.list_namespaced_event(
        NAMESPACE, field_selector=f"involvedObject.name={elector.settings.name}"
    )
    events = found.items
    assert all(e.reason == "LeaderElection" and e.involved_object.kind == "Lease" for e in events)
    return sorted(e.message for e in events)


async def events_become(kube: Kube, elector: LeaderElector, expected: list[str]) -> None:
    """Wait until the Lease's Events are `expected`: the elector posts them from its I/O
    thread, so the last may still be on its way when the lease has changed hands (the
    check read it too early once, under load)."""
    await until(
        f"the Lease's events to be {expected}",
        lambda: lease_events(kube, elector) == sorted(expected) or None,
    )


async def step(clock: FakeClock, *running: LeaderElector) -> None:
    """One retry period on; wait until each of `running` has finished its attempt."""
    for _ in range(20):  # a task started just now reaches its first sleep on the clock
        await asyncio.sleep(0)
    before = [e.attempts for e in running]
    await clock.advance_to(clock.now + RETRY)
    pairs = list(zip(running, before, strict=True))
    await until("an attempt of each elector", lambda: all(e.attempts > n for e, n in pairs))


class Work:
    """The leader's work (kopf, in production): runs until cancelled or told to end."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.ended = asyncio.Event()
        self.cancelled = False

    async def __call__(self) -> None:
        self.started.set()
        try:
            await self.ended.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise


@contextlib.asynccontextmanager
async def tasks(*coros: Coroutine[Any, Any, Any]) -> AsyncIterator[list[asyncio.Task[Any]]]:
    """Run `coros` as tasks; cancel what is left at the end."""
    running = [asyncio.create_task(c) for c in coros]
    try:
        yield running
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)


@dataclass
class Pair:
    """op-a leading (`lead` running its work) and op-b standing by."""

    leader: LeaderElector
    standby: LeaderElector
    work: Work
    leading: asyncio.Task[Any]


@contextlib.asynccontextmanager
async def leader_and_standby(kube: Kube, clock: FakeClock) -> AsyncIterator[Pair]:
    """op-a leads first; then op-b stands by, once it has made its first attempt."""
    a, b = electors(kube, clock, "op-a", "op-b")
    work = Work()
    async with tasks(lead(a, work)) as (leading,):
        await until("op-a leads", work.started.is_set)
        async with tasks(b.acquire()):
            await until("the standby's first attempt", lambda: b.attempts >= 1)
            yield Pair(a, b, work, leading)


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 120))


# -- pure rules ------------------------------------------------------------------------------


def test_timings_must_leave_the_leader_time_to_stop_before_its_lease_lapses() -> None:
    with pytest.raises(ValueError, match="renew deadline < lease duration"):
        ElectionSettings(NAMESPACE, "a", lease_seconds=10, renew_deadline_seconds=10)
    with pytest.raises(ValueError, match="retry < renew deadline"):
        ElectionSettings(NAMESPACE, "a", renew_deadline_seconds=2, retry_seconds=2)


def test_settings_come_from_the_environment_only_when_election_is_on() -> None:
    assert ElectionSettings.from_environment({}) is None
    settings = ElectionSettings.from_environment({
        "TWINMQ_OPERATOR_LEADER_ELECTION": "true", "TWINMQ_OPERATOR_LEASE_NAMESPACE": "mq",
        "TWINMQ_OPERATOR_IDENTITY": "op-1", "TWINMQ_OPERATOR_LEASE_SECONDS": "30",
        "TWINMQ_OPERATOR_RENEW_DEADLINE_SECONDS": "20", "TWINMQ_OPERATOR_RETRY_SECONDS": "4",
    })  # fmt: skip
    assert settings == ElectionSettings("mq", "op-1", "twinmq-operator-leader", 30, 20, 4)
    with pytest.raises(ValueError, match="NAMESPACE"):
        ElectionSettings.from_environment({"TWINMQ_OPERATOR_LEADER_ELECTION": "true"})


def test_a_held_lease_is_taken_only_after_a_full_duration_unchanged_on_our_clock() -> None:
    held = LeaseRecord("a", 15.0, 0, None, None)
    assert not may_take(held, observed_at=100.0, now=114.9, identity="b")
    assert may_take(held, observed_at=100.0, now=115.0, identity="b")
    assert may_take(held, observed_at=100.0, now=100.0, identity="a")  # our own: renew
    assert may_take(LeaseRecord(None, 1.0, 3, None, None), 100.0, 100.0, "b")  # released


# -- against the API server ------------------------------------------------------------------


@pytest.mark.slow
def test_of_two_candidates_starting_together_exactly_one_leads(kube: Kube) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        a, b = electors(kube, clock, "op-a", "op-b")
        async with tasks(a.acquire(), b.acquire()):
            await until("one leader", lambda: a.leading or b.leading)
            leader, standby = (a, b) if a.leading else (b, a)
            async with tasks(leader.keep()):
                await until("the standby's first attempt", lambda: standby.attempts >= 1)
                for _ in range(int(3 * LEASE / RETRY)):  # three Lease durations of renewals
                    await step(clock, leader, standby)
                    assert leader.leading and not standby.leading
                assert holder(kube, leader).holder == leader.settings.identity

    run(scenario)


@pytest.mark.slow
def test_a_standby_takes_over_a_dead_leader_once_its_lease_lapsed_on_the_standbys_clock(
    kube: Kube,
) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        a, b = electors(kube, clock, "op-a", "op-b")
        await a.acquire()
        last_renewal = clock.now
        async with tasks(b.acquire()):
            await until("the standby's first attempt", lambda: b.attempts == 1)
            # op-a dies: no more renewals, no release.
            while not b.leading:
                assert clock.now < last_renewal + LEASE, "took over a Lease that may be held"
                await step(clock, b)
            assert clock.now <= last_renewal + LEASE + RETRY
            record = holder(kube, b)
            assert (record.holder, record.transitions) == ("op-b", 1)
            await events_become(kube, b, [
                "op-a became leader", "op-b became leader (op-a had let it lapse)"
            ])  # fmt: skip

    run(scenario)


@pytest.mark.slow
def test_a_leader_cut_off_from_the_api_server_stops_before_a_standby_can_take_over(
    kube: Kube, kube_apiserver: KubeApiServer
) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        async with leader_and_standby(kube, clock) as pair:
            a, b, work, leading = pair.leader, pair.standby, pair.work, pair.leading
            for _ in range(3):
                await step(clock, a, b)
            last_renewal = a.deadline - RENEW_DEADLINE
            pid = kube_apiserver.process.pid
            os.kill(pid, signal.SIGSTOP)  # every request now hangs
            try:
                await clock.advance_to(a.deadline - 0.5)
                assert not leading.done() and not work.cancelled
                await clock.advance_to(a.deadline)
                await until("op-a stops", leading.done)
                stopped_at = clock.now
                assert work.cancelled and "not renewed" in leading.result()
            finally:
                os.kill(pid, signal.SIGCONT)
            assert stopped_at < last_renewal + LEASE  # before anyone may see the Lease lapse
            while not b.leading:
                await step(clock, b)
            assert clock.now >= stopped_at + LEASE - RENEW_DEADLINE

    run(scenario)


@pytest.mark.slow
def test_a_leader_whose_lease_another_holder_took_stops_at_its_next_renewal(kube: Kube) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        (a,) = electors(kube, clock, "op-a")
        work = Work()
        async with tasks(lead(a, work)) as (leading,):
            await until("op-a leads", work.started.is_set)
            lease = kube.get_lease(NAMESPACE, a.settings.name)
            assert lease is not None
            lease["spec"]["holderIdentity"] = "intruder"  # e.g. someone edits the Lease
            kube.write_lease(lease, 5.0)
            await step(clock, a)
            await until("op-a stops", leading.done)
            assert work.cancelled and "'intruder'" in leading.result()

    run(scenario)


@pytest.mark.slow
def test_a_leader_that_stops_gracefully_hands_over_at_the_standbys_next_attempt(
    kube: Kube,
) -> None:
    async def scenario() -> None:
        clock = FakeClock()
        async with leader_and_standby(kube, clock) as pair:
            a, b = pair.leader, pair.standby
            pair.work.ended.set()  # SIGTERM: kopf returns
            await until("op-a released the Lease", pair.leading.done)
            assert pair.leading.result() is None and not a.leading
            await step(clock, b)
            assert b.leading and holder(kube, b).holder == "op-b"
            await events_become(kube, b, [
                "op-a became leader", "op-a stopped leading: released the Lease",
                "op-b became leader",
            ])  # fmt: skip
            async with tasks(b.keep()):
                for _ in range(3):  # nothing of op-a's renews behind the new leader's back
                    await step(clock, b)
                    assert holder(kube, b).holder == "op-b"

    run(scenario)


# -- whole processes (`leader.run`, as `twinmq-operator` calls it) ------------------------------

# Stands in for kopf: acts until SIGTERM (kopf's own handling), as `twinmq-operator` would.
OPERATOR_SCRIPT = """
import asyncio, signal
from twinmq.operator import leader

async def operator():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("acting", flush=True)
    await stop.wait()

leader.run(operator)
"""


class OperatorProcess:
    """A process running `leader.run` with leader election on the test API server."""

    def __init__(self, api: KubeApiServer, lease: str, identity: str) -> None:
        self.health = f"http://127.0.0.1:{free_port()}/healthz"
        env = dict(
            os.environ, KUBECONFIG=str(api.kubeconfig),
            TWINMQ_OPERATOR_LEADER_ELECTION="true", TWINMQ_OPERATOR_LEASE_NAMESPACE=NAMESPACE,
            TWINMQ_OPERATOR_LEASE_NAME=lease, TWINMQ_OPERATOR_IDENTITY=identity,
            TWINMQ_OPERATOR_LEASE_SECONDS="3", TWINMQ_OPERATOR_RENEW_DEADLINE_SECONDS="2",
            TWINMQ_OPERATOR_RETRY_SECONDS="0.5", TWINMQ_OPERATOR_HEALTH_ENDPOINT=self.health,
        )  # fmt: skip
        env.pop("KUBERNETES_SERVICE_HOST", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OPERATOR_SCRIPT], env=env, stdout=subprocess.PIPE, text=True
        )
        self.acting = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip() == "acting":
                self.acting.set()

    def healthy(self) -> bool:
        """Its /healthz answers 200."""
        try:
            with urllib.request.urlopen(self.health, timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@contextlib.contextmanager
def leader_and_standby_processes(api: KubeApiServer) -> Iterator[tuple[OperatorProcess, ...]]:
    """op-a acting, then op-b standing by with its /healthz answering."""
    lease = next(LEASE_NAMES)
    a = OperatorProcess(api, lease, "op-a")
    b: OperatorProcess | None = None
    try:
        wait_for("op-a acts", a.acting.is_set)
        b = OperatorProcess(api, lease, "op-b")
        wait_for("op-b's standby /healthz", b.healthy)
        assert not b.acting.is_set()
        yield a, b
    finally:
        for proc in (a, b):
            if proc is not None:
                proc.stop()


@pytest.mark.slow
def test_a_leader_process_cut_off_from_the_api_server_exits_before_the_standby_acts(
    kube_apiserver: KubeApiServer,
) -> None:
    with leader_and_standby_processes(kube_apiserver) as (a, b):
        os.kill(kube_apiserver.process.pid, signal.SIGSTOP)
        try:
            assert a.proc.wait(timeout=60) == LOST_EXIT_CODE
            assert not b.acting.is_set()
        finally:
            os.kill(kube_apiserver.process.pid, signal.SIGCONT)
        wait_for("op-b acts", b.acting.is_set)


@pytest.mark.slow
def test_a_leader_process_stopped_by_sigterm_releases_and_the_standby_acts(
    kube_apiserver: KubeApiServer,
) -> None:
    with leader_and_standby_processes(kube_apiserver) as (a, b):
        a.proc.send_signal(signal.SIGTERM)
        assert a.proc.wait(timeout=60) == 0
        wait_for("op-b acts", b.acting.is_set)
