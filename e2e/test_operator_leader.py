"""Two operator replicas from the chart: one leads (holds the Lease, runs the handlers), the
other stands by Ready, and takes over when the leader is killed without a chance to release
its Lease. Short election timings (Lease 6 s) keep the takeover quick."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from chart_release import OperatorRelease, create_ready_cluster, operator_release
from support import Cluster, is_ready

from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e
LEASE = "tmq-twinmq-operator-leader"
TIMINGS = (
    "operator.replicas=2",
    "operator.leaderElection.leaseDurationSeconds=6",
    "operator.leaderElection.renewDeadlineSeconds=4",
    "operator.leaderElection.retryPeriodSeconds=1",
)


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> Iterator[OperatorRelease]:
    """The chart with two operator replicas, namespace scope, in a fresh namespace."""
    with operator_release(cluster, "e2e-op-leader", *TIMINGS) as release:
        yield release


def holder(release: OperatorRelease) -> str | None:
    """The leader Lease's holder (a pod name), or None."""
    path = f"/apis/coordination.k8s.io/v1/namespaces/{release.namespace}/leases/{LEASE}"
    lease = release.cluster.kube.get(path) or {}
    return (lease.get("spec") or {}).get("holderIdentity")


def both_ready(release: OperatorRelease) -> dict[str, bool] | None:
    """The two operator pods once both are Ready (for `wait_for`)."""
    pods = ready_pods(release)
    return pods if list(pods.values()) == [True, True] else None


def ready_pods(release: OperatorRelease) -> dict[str, bool]:
    """Operator pod name -> Ready, of the pods not being deleted."""
    pods = release.operator_pods()
    return {
        p["metadata"]["name"]: is_ready(p)
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
    }


def log(release: OperatorRelease, pod: str) -> str:
    """An operator pod's log."""
    return release.cluster.kube.text(f"/api/v1/namespaces/{release.namespace}/pods/{pod}/log")


def test_one_replica_leads_and_the_other_stands_by_ready(release: OperatorRelease) -> None:
    pods = wait_for("two Ready operator pods", lambda: both_ready(release), timeout=90)
    leader = wait_for("a leader", lambda: holder(release), timeout=30)
    (standby,) = set(pods) - {leader}
    create_ready_cluster(release)  # the leader acts
    assert f"{leader} acquired Lease {release.namespace}/{LEASE}" in log(release, leader)
    standby_log = log(release, standby)
    assert f"{standby} standing by" in standby_log
    assert "acquired" not in standby_log and "Timer 'tick'" not in standby_log  # never acted
    assert holder(release) == leader


def test_a_killed_leader_is_replaced_by_the_standby(release: OperatorRelease) -> None:
    leader = wait_for("a leader", lambda: holder(release), timeout=30)
    (standby,) = set(ready_pods(release)) - {leader}
    # No grace: the leader cannot release its Lease; the standby waits for it to lapse.
    release.cluster.kube.delete(
        f"/api/v1/namespaces/{release.namespace}/pods/{leader}", {"gracePeriodSeconds": 0}
    )
    wait_for("the standby leads", lambda: holder(release) == standby or None, timeout=60)
    acted = "Timer 'tick' succeeded"
    wait_for("the new leader acts", lambda: acted in log(release, standby) or None, timeout=60)
    # The Deployment's replacement pod comes up as the new standby.
    wait_for("two Ready operator pods again", lambda: both_ready(release), timeout=90)
    assert holder(release) == standby
