"""Projected service-account tokens are refreshed by the node (issue 13): a BrokerCluster
stays healthy across several token lifetimes.

The active broker renews its Lease with the pod's projected token and fences itself when
the API server refuses it (401 once the token expired), so a node that never refreshes
tokens loses every broker after one lifetime (the demo died after an hour). The operator
here gives the broker pods a 600 s token (`TWINMQ_OPERATOR_BROKER_TOKEN_SECONDS`, the
TokenRequest API's minimum) and the test keeps confirmed traffic flowing through the
virtual IP for `TWINMQ_TOKEN_LIFETIMES` (default 3) lifetimes: the same broker stays
active in the same epoch, its Lease is still renewed at the end, nothing is lost.
Slow (half an hour): not in `make e2e`'s default run; run it with
`make e2e E2E_ARGS="-m slow -k token_rotation"` (see docs/local-cluster.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from datetime import datetime

import pytest
from brokerclusters import (
    OperatorProcess,
    amqp_url,
    cluster_status,
    create_cluster,
    drain,
    operator_fixture,
    publish_confirmed,
)
from support import Cluster, pod_path

from twinmq.operator.builders import BROKER_TOKEN_SECONDS_ENV, MIN_TOKEN_SECONDS

TOKEN_SECONDS = MIN_TOKEN_SECONDS
LIFETIMES = int(os.environ.get("TWINMQ_TOKEN_LIFETIMES", "3"))
PUBLISH_EVERY = 20.0  # seconds between confirmed messages: about 30 per token lifetime

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def short_token_operator(cluster: Cluster) -> Iterator[OperatorProcess]:
    """The operator, giving broker pods tokens of the API server's minimum lifetime."""
    yield from operator_fixture(cluster, {BROKER_TOKEN_SECONDS_ENV: str(TOKEN_SECONDS)})


def _renewed_at(cluster: Cluster, namespace: str, name: str) -> tuple[str, datetime]:
    lease = cluster.kube.get(
        f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}-active"
    ) or {}  # fmt: skip
    spec = lease.get("spec") or {}
    renewed = datetime.fromisoformat(str(spec["renewTime"]).replace("Z", "+00:00"))
    return str(spec.get("holderIdentity")), renewed


@pytest.mark.timeout(LIFETIMES * TOKEN_SECONDS + 900)
def test_a_brokercluster_stays_active_across_several_token_lifetimes(
    cluster: Cluster, short_token_operator: OperatorProcess, namespace: str
) -> None:
    name = create_cluster(cluster, namespace)
    pod = cluster.kube.get(pod_path(namespace, f"{name}-primary")) or {}
    sources = [s for v in pod["spec"]["volumes"] if "projected" in v
               for s in v["projected"]["sources"] if "serviceAccountToken" in s]  # fmt: skip
    assert [s["serviceAccountToken"]["expirationSeconds"] for s in sources] == [TOKEN_SECONDS]
    start = cluster_status(cluster, namespace, name)
    holder, _ = _renewed_at(cluster, namespace, name)
    url = amqp_url(cluster, namespace, name)
    began = time.time()
    sent: list[int] = []
    while time.time() < began + LIFETIMES * TOKEN_SECONDS + 60:
        publish_confirmed(url, "rotation", str(len(sent)).encode())
        sent.append(len(sent))
        status = cluster_status(cluster, namespace, name)
        assert (status.get("activeBroker"), status.get("epoch")) == (
            start["activeBroker"], start["epoch"],
        ), status  # fmt: skip
        time.sleep(PUBLISH_EVERY)
    # The Lease was renewed, by the same broker, after the first LIFETIMES tokens expired.
    last_holder, renewed = _renewed_at(cluster, namespace, name)
    assert last_holder == holder
    assert renewed.timestamp() > began + LIFETIMES * TOKEN_SECONDS
    assert drain(url, "rotation") == sent
