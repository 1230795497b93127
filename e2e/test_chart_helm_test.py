"""`helm test`: the chart's test hook (helm/twinmq/templates/tests/) publishes messages with
confirms through a BrokerCluster's virtual IP from a Pod of the project's image and
consumes them back; it passes on a Ready cluster and fails when it cannot log in."""

from __future__ import annotations

import base64

import pytest
from chart_release import create_ready_cluster, operator_release
from support import CHART, Cluster, helm

pytestmark = pytest.mark.e2e

MESSAGES = 20


def test_helm_test_passes_on_a_ready_brokercluster_and_fails_with_wrong_credentials(
    cluster: Cluster,
) -> None:
    sets = ("test.brokerCluster.name=orders", f"test.messages={MESSAGES}")
    with operator_release(cluster, "e2e-helm-test", *sets) as release:
        create_ready_cluster(release)
        ns = release.namespace
        out = helm(cluster.kubeconfig, "test", release.name, "--namespace", ns, "--logs",
                   "--timeout", "180s")  # fmt: skip
        assert "Succeeded" in out, out
        assert f"{MESSAGES} messages published with confirms and consumed back" in out, out

        # The same check with a password the brokers refuse must fail.
        wrong = {"username": b"app", "password": b"not-the-password"}
        cluster.kube.create(f"/api/v1/namespaces/{ns}/secrets", {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "wrong-auth"},
            "data": {k: base64.b64encode(v).decode() for k, v in wrong.items()},
        })  # fmt: skip
        helm(cluster.kubeconfig, "upgrade", release.name, "--namespace", ns, "--reuse-values",
             "--set", "test.brokerCluster.secretName=wrong-auth", "--set", "test.timeoutSeconds=20",
             str(CHART), "--wait", "--timeout", "120s")  # fmt: skip
        with pytest.raises(AssertionError, match="FAIL"):
            helm(cluster.kubeconfig, "test", release.name, "--namespace", ns, "--logs",
                 "--timeout", "120s")  # fmt: skip
