"""Attacks on the replication guard in the active's Lease under clock skew (docs/replication.md,
"The replication guard in the Lease").

The operator no longer compares the broker's wall clock (in `renewTime`) with its own: it
judges the Lease lapsed, and trusts a guard of `<epoch>:0`, by how long it has seen the
same record on its own monotonic clock (`operator/leasewatch.py`). Each test runs a real
pair of broker processes (the active under libfaketime, its Lease kept by the real
`LeaseKeeper` on a real kube-apiserver), real publisher confirms (aio-pika), and decides
as the operator does: its `lease_state` on the real Lease, the
passive's real `/status` through `view_of`, and `failover.decide`. The loss, when there is
one, is a message the old active confirmed that the promoted passive lacks.

A broker outside a pod has no service account, so a `sitecustomize` (on the active's
PYTHONPATH only) points `LeaseKeeper.from_environment` at the test API server: the broker
process is otherwise started exactly as `twinmq-broker` is.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import os
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from email.utils import formatdate
from pathlib import Path

import aio_pika
import pytest
from aiohttp import web
from apiserver import KubeApiServer
from fakeclock import FakeClock
from test_lease import Broker as KeeperBroker
from test_lease import serving

import twinmq.operator.main as operator_main
from twinmq.broker.api import BrokerStatus
from twinmq.broker.lease import GUARD_ANNOTATION, LeaseKeeper
from twinmq.operator.builders import ClusterRef, build_lease, lease_name, pod_name
from twinmq.operator.failover import BrokerView, Decision, Observation, SetRole, decide
from twinmq.operator.kube import Kube
from twinmq.operator.leasewatch import LeaseWatch
from twinmq.operator.models import parse_iso
from twinmq.operator.probe import view_of
from twinmq.testing.launcher import BrokerProcess
from twinmq.testing.pair import FAKETIME_LIBRARY, Pair, status
from twinmq.testing.waiting import until

DURATION = 4  # the Lease's duration (seconds): the operator's default is longer
REPLICATION_TIMEOUT = 2.0
SKEW = 5 * DURATION  # a wall clock off by this much: well past the one-duration margin
QUEUE = "skew"
EPOCH = 1  # the pair's first epoch

needs_faketime = pytest.mark.skipif(
    not FAKETIME_LIBRARY.exists(), reason="libfaketime is not installed"
)

SITECUSTOMIZE = '''
"""Test shim: the Lease keeper of a broker outside a pod, on the test API server."""
import os

if os.environ.get("TWINMQ_TEST_LEASE_URL"):
    import ssl
    from pathlib import Path

    from twinmq.broker import lease

    # The test API server's certificate was issued seconds ago: a clock set behind would
    # not trust it yet (OpenSSL's X509_V_FLAG_NO_CHECK_TIME). A cluster's is older.
    NO_CHECK_TIME = 0x200000

    def _from_environment(cls, broker):
        context = ssl.create_default_context(cafile=os.environ["TWINMQ_TEST_LEASE_CA"])
        context.verify_flags |= NO_CHECK_TIME
        access = lease.ApiAccess(context, Path(os.environ["TWINMQ_TEST_LEASE_TOKEN"]))
        url = os.environ["TWINMQ_TEST_LEASE_URL"]
        return cls(broker, url, broker.settings.lease_seconds, access)

    lease.LeaseKeeper.from_environment = classmethod(_from_environment)
'''


@dataclass(frozen=True)
class LeaseSite:
    """The operator's client and what a broker needs to keep a Lease on the API server."""

    kube: Kube
    server: str
    env: dict[str, str]  # for the active broker: its keeper's URL, CA and token

    def url(self, cluster: ClusterRef) -> str:
        """The Lease's URL, as `from_environment` builds it in a pod."""
        return (
            f"{self.server}/apis/coordination.k8s.io/v1/namespaces/{cluster.namespace}"
            f"/leases/{lease_name(cluster)}"
        )


@pytest.fixture
def site(
    kube_apiserver: KubeApiServer, kube: Kube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> LeaseSite:
    """The test API server, the operator's client on it, and the active's keeper shim."""
    monkeypatch.setattr(operator_main, "KUBE", kube)
    config = json.loads(kube_apiserver.kubeconfig.read_text())
    cluster = config["clusters"][0]["cluster"]
    ca, token, shim = tmp_path / "ca.crt", tmp_path / "token", tmp_path / "shim"
    ca.write_bytes(base64.b64decode(cluster["certificate-authority-data"]))
    token.write_text(config["users"][0]["user"]["token"])
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    env = {
        "PYTHONPATH": path,
        "TWINMQ_TEST_LEASE_CA": str(ca),
        "TWINMQ_TEST_LEASE_TOKEN": str(token),
    }
    return LeaseSite(kube, cluster["server"], env)


def wall_offset(seconds: float) -> dict[str, str]:
    """libfaketime: the broker's wall clock off by `seconds`, its monotonic clock true (an
    NTP-less node: the monotonic clock never jumps)."""
    return {
        "LD_PRELOAD": str(FAKETIME_LIBRARY),
        "FAKETIME": f"{seconds:+.0f}",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


@dataclass
class Scene:
    """A pair whose active keeps the cluster's Lease, as the operator sees it."""

    pair: Pair
    cluster: ClusterRef
    # The operator's sight of the Lease, kept across its decisions as its memory is.
    watch: LeaseWatch = field(default_factory=LeaseWatch)

    @property
    def active(self) -> BrokerProcess:
        """The old active (primary)."""
        return self.pair.brokers["orders-primary"]

    @property
    def passive(self) -> BrokerProcess:
        """The passive (backup): the one the operator may promote."""
        return self.pair.brokers["orders-backup"]

    def guard(self) -> str | None:
        """The replication guard the Lease carries now."""
        lease = operator_main.kube().get_lease(self.cluster.namespace, lease_name(self.cluster))
        annotations = ((lease or {}).get("metadata") or {}).get("annotations") or {}
        return annotations.get(GUARD_ANNOTATION)

    def backup_view(self) -> BrokerView:
        """The passive as the operator's probe sees it now."""
        report = status(self.passive)
        assert report is not None, "the passive answers the operator"
        return view_of(BrokerStatus.model_validate(report), "backup", None)

    def operator_decides(
        self, *, active_stopped: bool = False, backup: BrokerView | None = None
    ) -> Decision:
        """One reconcile's decision with the active cut off from the operator (unreachable
        past the failure threshold), or its process gone: the passive probed first, then
        the Lease read, as `operator/main.py` does."""
        backup = backup or self.backup_view()
        holder, expired, guard = operator_main.lease_state(self.cluster, self.watch)
        primary = BrokerView("primary", reachable=False, stopped=active_stopped)
        return decide(Observation(
            brokers={"primary": primary, "backup": backup}, active="primary", epoch=EPOCH,
            lease_holder=holder, lease_expired=expired, lease_guard=guard, routed="primary",
        ))  # fmt: skip


def promotes_backup(decision: Decision) -> bool:
    """The decision activates the passive."""
    return any(
        isinstance(a, SetRole) and a.broker == "backup" and a.role == "active"
        for a in decision.actions
    )


@pytest.fixture
def scenes() -> Iterator[list[Scene]]:
    """The scenes a test starts, stopped at its end."""
    scenes: list[Scene] = []
    yield scenes
    for scene in scenes:
        scene.pair.stop()


def start_scene(
    site: LeaseSite,
    tmp_path: Path,
    namespace: str,
    active_clock: dict[str, str],
    passive_clock: dict[str, str] | None = None,
    replication_timeout: float = REPLICATION_TIMEOUT,
) -> Scene:
    """The Lease named for the primary (as the operator writes it at activation), then a
    pair whose active keeps it under `active_clock` (the passive under `passive_clock`),
    in sync."""
    cluster = ClusterRef(namespace=namespace, name="orders", uid="u-1")
    site.kube.core.create_namespace({"metadata": {"name": cluster.namespace}})  # type: ignore[arg-type]
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    site.kube.put_lease(build_lease(cluster, "orders-primary", DURATION, now))
    pair = Pair(
        tmp_path / "pair",
        replication_timeout=replication_timeout,
        broker_args=["--lease-seconds", str(DURATION)],
        names=("orders-primary", "orders-backup"),
    )
    pair.active.env.update({**site.env, "TWINMQ_TEST_LEASE_URL": site.url(cluster), **active_clock})
    pair.passive.env.update(passive_clock or {})
    scene = Scene(pair.start(), cluster)
    return scene


async def publish(url: str, body: bytes) -> None:
    """One persistent message to QUEUE on its own connection; returns once confirmed."""
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(QUEUE, durable=True)
        message = aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        await channel.default_exchange.publish(message, routing_key=QUEUE)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    """Run an async scenario, bounded."""

    async def bounded() -> None:
        async with asyncio.timeout(120):
            await scenario()

    asyncio.run(bounded())


def passive_not_ready(scene: Scene) -> bool:
    """The passive's readiness window ran out (it says so in its /status)."""
    report = status(scene.passive)
    return report is not None and not report["replication"]["ready"]


def clock_file(path: Path, *, wall_only: bool = False) -> dict[str, str]:
    """libfaketime: the broker's clocks (wall and monotonic, or its wall clock only)
    offset by what `path` says, re-read every second (`+0` to start with)."""
    path.write_text("+0\n")
    return {
        "LD_PRELOAD": str(FAKETIME_LIBRARY),
        "FAKETIME_TIMESTAMP_FILE": str(path),
        "FAKETIME_CACHE_DURATION": "1",
        **({"FAKETIME_DONT_FAKE_MONOTONIC": "1"} if wall_only else {}),
    }


def renewed_ago(scene: Scene) -> float:
    """How old the Lease's renewTime looks by this process's wall clock (the operator's)."""
    lease = operator_main.kube().get_lease(scene.cluster.namespace, lease_name(scene.cluster))
    renew = ((lease or {}).get("spec") or {}).get("renewTime")
    assert renew, f"the Lease carries a renewTime: {lease}"
    return time.time() - parse_iso(renew).timestamp()


PROBE = 0.5  # seconds between the operator's looks (its default probe interval is 1 s)


@pytest.mark.slow
@needs_faketime
@pytest.mark.parametrize("stepped", [False, True], ids=["from-the-start", "stepped-back"])
def test_an_active_clock_far_behind_never_makes_its_live_lease_look_lapsed_or_its_zero_trusted(
    site: LeaseSite, tmp_path: Path, scenes: list[Scene], stepped: bool
) -> None:
    """The active's wall clock is SKEW behind the operator's: every `renewTime` it writes
    looks long lapsed. An operator that compared `renewTime` with its own clock trusted
    the live active's `1:0`; with the pair partitioned and the passive's readiness run
    out, it decided to promote the passive, and the old active, marking its Lease before
    the promotion landed, confirmed a message alone that the promoted passive lacked.
    Judged by what it observed, the live active's Lease changes with every renewal: over
    three Lease durations of the operator's own clock, probing as it does, it is never
    lapsed, its `0` never trusted, the passive never promoted. Behind from the start, or
    stepped back mid-run (an NTP step: the wall clock only) once the pair is in sync."""
    offset = tmp_path / "active.faketime"
    clock = clock_file(offset, wall_only=True) if stepped else wall_offset(-SKEW)
    scene = start_scene(site, tmp_path, f"skew-behind-{int(stepped)}", clock)
    scenes.append(scene)

    async def scenario() -> None:
        await publish(scene.active.url, b"m1")
        await until("the active renews its Lease", lambda: scene.guard() == f"{EPOCH}:0")
        if stepped:
            offset.write_text(f"-{SKEW}\n")
        await until(
            "the live active's renewTime looks lapsed for two durations (the premise)",
            lambda: renewed_ago(scene) > 2 * DURATION,
        )
        scene.pair.link.partition()
        await until("the passive's readiness ran out", lambda: passive_not_ready(scene))
        started = time.monotonic()
        while time.monotonic() - started < 3 * DURATION:
            seen = operator_main.lease_state(scene.cluster, scene.watch)
            assert seen == ("primary", False, None), (
                f"the live active's Lease judged lapsed or its 0 trusted: {seen}"
            )
            decision = scene.operator_decides()
            assert not promotes_backup(decision), f"a live active failed over: {decision}"
            await asyncio.sleep(PROBE)

    run(scenario)


@pytest.mark.slow
@needs_faketime
def test_an_active_clock_ahead_never_gets_a_passive_promoted_past_what_it_confirmed_alone(
    site: LeaseSite, tmp_path: Path, scenes: list[Scene]
) -> None:
    """The active's wall clock is SKEW ahead (its renewTime means nothing to the operator
    now). Cut off from the operator and from its passive, it is not failed over while it
    lives; it drops the stalled passive, marks the Lease and confirms a message alone, and
    dies (Kubernetes reports its process gone). The operator must not promote the passive:
    its readiness ran out, and the Lease says `1:1` (read at once)."""
    scene = start_scene(site, tmp_path, "skew-ahead", wall_offset(SKEW))
    scenes.append(scene)

    async def scenario() -> None:
        await publish(scene.active.url, b"m1")
        await until("the active renews its Lease", lambda: scene.guard() == f"{EPOCH}:0")
        scene.pair.link.partition()
        await until("the passive's readiness ran out", lambda: passive_not_ready(scene))
        alive = scene.operator_decides()
        assert not promotes_backup(alive), f"a live active's Lease looks fresh: {alive}"
        await publish(scene.active.url, b"m2")  # confirmed alone
        assert scene.guard() == f"{EPOCH}:1", "the Lease says so before the confirm"
        scene.active.kill()
        gone = scene.operator_decides(active_stopped=True)
        assert not promotes_backup(gone), (
            f"the passive lacks m2, confirmed alone by the active now gone: {gone}"
        )

    run(scenario)


@pytest.mark.slow
@needs_faketime
def test_a_passive_whose_clock_missed_a_freeze_is_not_promoted_past_a_confirm_made_alone(
    site: LeaseSite, tmp_path: Path, scenes: list[Scene]
) -> None:
    """The passive is frozen (SIGSTOP) and its link partitioned; the active, clocks true,
    drops the stalled passive, marks its Lease (`1:1`), confirms a message alone, and
    dies (Kubernetes reports its process gone). The passive resumes with a monotonic
    clock that did not count the freeze (libfaketime steps it back by the freeze): by
    its clock, the active's last echo is recent, so it reports ready. Promoting it would
    lose the message: the Lease's mark, read at once whatever its age, vetoes the
    readiness (`_promotion_blocked`)."""
    offset = tmp_path / "passive.faketime"
    timeout = 2 * REPLICATION_TIMEOUT  # the passive's readiness outlives the status read
    scene = start_scene(site, tmp_path, "skew-freeze", {}, clock_file(offset), timeout)
    scenes.append(scene)

    async def scenario() -> None:
        await publish(scene.active.url, b"m1")
        scene.passive.signal(signal.SIGSTOP)
        frozen = time.monotonic()
        scene.pair.link.partition()  # its Refuse ("stalled: the active goes on alone") too
        await publish(scene.active.url, b"m2")  # confirmed alone, replication_timeout later
        assert scene.guard() == f"{EPOCH}:1", "the Lease says so before the confirm"
        scene.active.kill()
        offset.write_text(f"-{math.ceil(time.monotonic() - frozen)}\n")
        scene.passive.signal(signal.SIGCONT)
        backup = scene.backup_view()
        decision = scene.operator_decides(active_stopped=True, backup=backup)
        assert backup.ready and backup.caught_up_epoch == EPOCH, (
            f"the passive resumed ready by its clock (the attack's premise): {backup}"
        )
        assert not promotes_backup(decision), (
            f"m2 was confirmed alone by the active, now gone; the passive lacks it: {decision}"
        )

    run(scenario)


class DatedApi:
    """The Lease's API on loopback, held by the keeper's broker, answering with the Date
    of a server clock `ahead` seconds of this process's."""

    def __init__(self, ahead: float) -> None:
        self.ahead = ahead
        self.guards: list[str] = []

    async def handle(self, request: web.Request) -> web.Response:
        if request.method == "PUT":
            body = await request.json()
            self.guards.append(body["metadata"]["annotations"][GUARD_ANNOTATION])
        date = formatdate(time.time() + self.ahead, usegmt=True)
        lease = {"spec": {"holderIdentity": KeeperBroker().settings.name}}
        return web.json_response(lease, headers={"Date": date})


@pytest.mark.parametrize(
    ("ahead", "goes_alone"),
    [(0.0, True), (SKEW, False), (-SKEW, True)],
    ids=["in-step", "behind", "ahead"],
)
def test_a_keeper_whose_clock_is_behind_the_api_servers_holds_its_confirms(
    ahead: float, goes_alone: bool
) -> None:
    """The real keeper against a loopback API server whose clock is `ahead` of this one:
    the mark is written either way (`1`: conservative), but the active goes on alone only
    if its clock is not behind by more than half a Lease duration (ahead is safe: its
    Lease looks fresh longer, and its guard is trusted later)."""

    async def scenario() -> None:
        api = DatedApi(ahead)
        async with serving(api) as url:
            keeper = LeaseKeeper(KeeperBroker(), url, DURATION, clock=FakeClock())
            keeper.activated()
            assert await keeper.record_alone() is goes_alone
            assert api.guards == [f"{KeeperBroker().epoch}:1"]

    run(scenario)


def test_a_ready_passive_is_not_promoted_against_the_mark_of_the_active_it_caught_up_with() -> None:
    """`decide` alone: the active's process is gone, its passive says ready, and the
    Lease says `1:1` (read at once: `lease_state`). Not promoted; a mark of an older
    epoch, or `0`, or `allowDataLoss` leave the readiness rule as it was."""
    backup = BrokerView("backup", True, "passive", EPOCH, ready=True, caught_up_epoch=EPOCH)
    observed = Observation(
        brokers={"primary": BrokerView("primary", False, stopped=True), "backup": backup},
        active="primary", epoch=EPOCH, lease_holder="primary", lease_expired=False,
        lease_guard=(EPOCH, True),
    )  # fmt: skip
    assert not promotes_backup(decide(observed))
    assert promotes_backup(decide(replace(observed, lease_guard=(EPOCH - 1, True))))
    assert promotes_backup(decide(replace(observed, lease_guard=(EPOCH, False))))
    assert promotes_backup(decide(replace(observed, lease_guard=None)))
    assert promotes_backup(decide(replace(observed, allow_data_loss=True)))


def test_the_operator_reads_a_mark_at_once_and_a_zero_only_once_seen_for_two_durations(
    kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`lease_state` on the real API server: a fresh Lease saying `1` is news at once (the
    mark precedes any confirm alone, whatever the clocks); one saying `0` is not, until
    this operator has seen it unchanged for two Lease durations (tests/test_guard_attack.py
    counts them)."""
    namespace = "guard-skew-mark"
    kube.core.create_namespace({"metadata": {"name": namespace}})  # type: ignore[arg-type]
    monkeypatch.setattr(operator_main, "KUBE", kube)

    def says(guard: str) -> tuple[object, ...]:
        # A cluster of its own per guard: a Lease replaced keeps its annotations.
        cluster = ClusterRef(namespace=namespace, name=f"orders-{guard[-1]}", uid="u-1")
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        lease = build_lease(cluster, pod_name(cluster, "primary"), DURATION, now)
        lease["metadata"]["annotations"] = {GUARD_ANNOTATION: guard}
        kube.put_lease(lease)
        return operator_main.lease_state(cluster, LeaseWatch())

    assert says("3:1") == ("primary", False, (3, True))
    assert says("3:0") == ("primary", False, None)
