"""Attacks on the operator's judgment of the Lease's replication guard during a switchover
(docs/replication.md, "Attacks tried").

A failover (`_failover`) never activates a passive against a mark (`<epoch>:1`) of the
active it caught up with, nor a passive that is not ready unless the guard says `0`. A
switchover (a manual promote, a recovery) checked its target's readiness only when it
began: it then demotes the source and, once the source reports passive, or is gone, or
its Lease has lapsed, activates the target without looking again. A source the operator
cannot reach does not take the demotion; cut from its passive as well, it marks its
Lease, goes on alone and confirms; once it dies (or its Lease lapses) the target, which
lacks those confirms, was activated. The mark was on the Lease all along: the operator
read it (at once, as any `1`) and did not look.

The Lease lives on a real kube-apiserver and is read with the operator's own
`lease_state` by an operator restarted just before (a `LeaseWatch` that has seen
nothing: the switchover is resumed from the status); `decide` is the operator's.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime

import pytest

import twinmq.operator.main as operator_main
from twinmq.broker.lease import GUARD_ANNOTATION
from twinmq.operator.builders import ClusterRef, build_lease, pod_name
from twinmq.operator.failover import (
    BrokerView,
    Decision,
    Observation,
    Record,
    SetRole,
    Switchover,
    decide,
)
from twinmq.operator.kube import Kube
from twinmq.operator.leasewatch import LeaseWatch
from twinmq.operator.models import BrokerName

DURATION = 4
SOURCE_EPOCH = 3  # the epoch the source was active in when the switchover began


def _activates(decision: Decision, broker: BrokerName) -> bool:
    """The decision activates `broker`."""
    return any(
        isinstance(a, SetRole) and a.broker == broker and a.role == "active"
        for a in decision.actions
    )


def _lease_says(
    kube: Kube, namespace: str, guard: str
) -> tuple[BrokerName | None, bool, tuple[int, bool] | None]:
    """Write the source's Lease on the real API server as the primary wrote it last,
    saying `guard`, and read it as a just-restarted operator does: (holder, expired, guard)."""
    kube.core.create_namespace({"metadata": {"name": namespace}})  # type: ignore[arg-type]
    cluster = ClusterRef(namespace=namespace, name="orders", uid="u-1")
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    lease = build_lease(cluster, pod_name(cluster, "primary"), DURATION, now)
    lease["metadata"]["annotations"] = {GUARD_ANNOTATION: guard}
    kube.put_lease(lease)
    return operator_main.lease_state(cluster, LeaseWatch())


def _switchover_resumed(
    holder: str | None, expired: bool, guard: tuple[int, bool] | None, **source: object
) -> Observation:
    """A promote of the backup begun in epoch `SOURCE_EPOCH` (the status recorded it and no
    active): its source, the primary, never took the demotion; the backup, ready when the
    promote began, has since lost its link (not ready now), caught up last with the
    primary in `SOURCE_EPOCH`."""
    primary = BrokerView("primary", reachable=False, **source)  # type: ignore[arg-type]
    backup = BrokerView(
        "backup", True, "passive", SOURCE_EPOCH, ready=False, caught_up_epoch=SOURCE_EPOCH
    )
    return Observation(
        brokers={"primary": primary, "backup": backup},
        active=None,
        epoch=SOURCE_EPOCH + 1,
        lease_holder="primary" if holder == "primary" else None,
        lease_expired=expired,
        lease_guard=guard,
        switchover=Switchover("p1", "promote", "backup", SOURCE_EPOCH + 1),
    )


@pytest.fixture
def namespace(request: pytest.FixtureRequest) -> str:
    """A namespace named for the test."""
    return str(request.node.name).replace("_", "-")[:50].strip("-")


def test_a_switchover_does_not_activate_its_target_past_a_mark_its_source_wrote_after_it_began(
    kube: Kube, monkeypatch: pytest.MonkeyPatch, namespace: str
) -> None:
    """The source, unreachable from the operator, went on alone (its Lease says `3:1`)
    and then died (Kubernetes reports its process gone): the restarted operator reads the
    mark at once and does not activate the target, which lacks what the source confirmed
    alone. It says why, and waits (the source may come back and be re-activated)."""
    monkeypatch.setattr(operator_main, "KUBE", kube)
    holder, expired, guard = _lease_says(kube, namespace, f"{SOURCE_EPOCH}:1")
    assert (holder, guard) == ("primary", (SOURCE_EPOCH, True))
    observed = _switchover_resumed(holder, expired, guard, stopped=True)
    decision = decide(observed)
    assert not _activates(decision, "backup"), decision.actions
    assert decision.degraded is not None and "went on alone" in decision.degraded
    # Its Lease lapsed rather than its process gone (a source cut from the API server
    # too, fenced at its deadline): the same.
    lapsed = decide(replace(observed, lease_expired=True, brokers={
        **observed.brokers, "primary": BrokerView("primary", reachable=False)}))  # fmt: skip
    assert not _activates(lapsed, "backup"), lapsed.actions


def test_a_switchover_still_activates_its_target_when_the_source_never_went_on_alone(
    kube: Kube, monkeypatch: pytest.MonkeyPatch, namespace: str
) -> None:
    """The veto is the mark alone: a Lease saying `3:0` (not yet trusted: the restarted
    operator has just seen it; a switchover does not need it), one of an older epoch, or
    a forced promote or `allowDataLoss` leave the switchover as it was."""
    monkeypatch.setattr(operator_main, "KUBE", kube)
    holder, expired, guard = _lease_says(kube, namespace, f"{SOURCE_EPOCH}:0")
    assert guard is None
    observed = _switchover_resumed(holder, expired, None, stopped=True)
    assert _activates(decide(observed), "backup")
    older = replace(observed, lease_guard=(SOURCE_EPOCH - 1, True))
    assert _activates(decide(older), "backup")
    marked = replace(observed, lease_guard=(SOURCE_EPOCH, True))
    forced = replace(marked, switchover=replace(observed.switchover, force=True))  # type: ignore[type-var]
    assert _activates(decide(forced), "backup")
    assert _activates(decide(replace(marked, allow_data_loss=True)), "backup")


def test_a_recovery_does_not_activate_the_primary_past_a_mark_of_the_backup() -> None:
    """The same for a failback: the backup, active in epoch 3 and unreachable from the
    operator once the recovery began, went on alone and died; the primary is not
    activated over its mark."""
    primary = BrokerView("primary", True, "passive", SOURCE_EPOCH, caught_up_epoch=SOURCE_EPOCH)
    observed = Observation(
        brokers={"primary": primary, "backup": BrokerView("backup", False, stopped=True)},
        active=None, epoch=SOURCE_EPOCH + 1, lease_holder="backup", lease_expired=False,
        lease_guard=(SOURCE_EPOCH, True),
        switchover=Switchover("r1", "recover", "primary", SOURCE_EPOCH + 1),
    )  # fmt: skip
    decision = decide(observed)
    assert not _activates(decision, "primary"), decision.actions
    assert decision.degraded is not None and "went on alone" in decision.degraded


def test_a_source_back_as_a_passive_after_its_mark_is_re_activated_the_promote_aborted() -> None:
    """The source that went on alone comes back (restarted, or the demotion took after
    its mark): it holds what it confirmed alone and the target does not, so it is
    re-activated in a new epoch and the promote is handled, aborted; the target catches
    up from it and may be promoted again."""
    observed = _switchover_resumed("primary", False, (SOURCE_EPOCH, True))
    demoted = BrokerView("primary", True, "passive", SOURCE_EPOCH + 1)
    decision = decide(replace(observed, brokers={**observed.brokers, "primary": demoted}))
    assert SetRole("primary", "active", SOURCE_EPOCH + 2) in decision.actions
    assert not _activates(decision, "backup")
    (record,) = (a for a in decision.actions if isinstance(a, Record))
    assert (record.active, record.handled_promote, record.switchover) == ("primary", "p1", None)


def test_no_active_recorded_does_not_activate_a_ready_passive_past_the_holders_mark() -> None:
    """The status lost (restored without it: the epoch is learned from the brokers, no
    active recorded) or the active fenced while unreachable: the steady state activates a
    ready broker once the Lease's holder is known not to serve. A passive whose readiness
    missed a freeze (tests/test_guard_skew.py) says ready although the holder went on
    alone since it caught up: its mark vetoes it, as it does a failover's promotion."""
    backup = BrokerView(
        "backup", True, "passive", SOURCE_EPOCH, ready=True, caught_up_epoch=SOURCE_EPOCH
    )
    observed = Observation(
        brokers={"primary": BrokerView("primary", False, stopped=True), "backup": backup},
        active=None, epoch=SOURCE_EPOCH, lease_holder="primary", lease_expired=True,
        lease_guard=(SOURCE_EPOCH, True),
    )  # fmt: skip
    assert not _activates(decide(observed), "backup")
    # Fenced while unreachable: the status's epoch is one past the mark's; still vetoed.
    assert not _activates(decide(replace(observed, epoch=SOURCE_EPOCH + 1)), "backup")
    # A mark older than the backup's catch-up, no mark, or allowDataLoss: activated.
    older = replace(observed, lease_guard=(SOURCE_EPOCH - 1, True))
    assert _activates(decide(older), "backup")
    assert _activates(decide(replace(observed, lease_guard=None)), "backup")
    assert _activates(decide(replace(observed, allow_data_loss=True)), "backup")
