"""Failover and fencing with the chart-installed operator, under its own namespaced RBAC
(not a host process with the admin kubeconfig): least privilege on the paths that matter.

The scenarios are e2e/failover_scenarios.py's, as in e2e/test_operator.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from chart_release import (
    OperatorRelease,
    create_ready_cluster,
    operator_reconciles,
    operator_release,
)
from failover_scenarios import (
    cut_off_the_api_server_fences_before_the_backup_is_promoted,
    kill_9_of_the_active_fails_over_losing_nothing,
)
from support import Cluster

pytestmark = pytest.mark.e2e


@pytest.fixture
def release(cluster: Cluster) -> Iterator[OperatorRelease]:
    """The chart's operator in a fresh namespace (one per test: one BrokerCluster each)."""
    if not cluster.local:
        pytest.skip("needs the local cluster's fault tools and pod network from the host")
    with operator_release(cluster, "failover") as release:
        yield release


def test_chart_operator_fails_over_a_kill_9_at_once_losing_nothing(
    release: OperatorRelease,
) -> None:
    create_ready_cluster(release, "orders")
    kill_9_of_the_active_fails_over_losing_nothing(release.cluster, release.namespace, "orders")
    operator_reconciles(release)


def test_chart_operator_lets_a_primary_cut_off_the_api_fence_itself_first(
    release: OperatorRelease,
) -> None:
    create_ready_cluster(release, "orders")
    cut_off_the_api_server_fences_before_the_backup_is_promoted(
        release.cluster, release.namespace, "orders"
    )
    operator_reconciles(release)
