"""The chart end to end: its operator (namespace-scoped RBAC) comes up, answers its liveness
endpoint, makes a BrokerCluster Ready with the primary active, and `helm uninstall` removes
the operator and its RBAC. Runs on the local cluster (both node modes); written for kind
too, not run there."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from chart_release import (
    OperatorRelease,
    create_ready_cluster,
    liveness,
    operator_reconciles,
    operator_release,
)
from support import CHART, Cluster, helm

from twinmq.testing.waiting import wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def release(cluster: Cluster) -> Iterator[OperatorRelease]:
    """The chart installed with operator.rbac.scope=namespace in a fresh namespace."""
    with operator_release(cluster, "e2e-chart-op") as release:
        yield release


def test_operator_pod_becomes_ready_and_answers_its_liveness_endpoint(
    cluster: Cluster, release: OperatorRelease
) -> None:
    pod = wait_for("the operator pod Ready", release.ready_operator_pod, timeout=90)
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["twinmq-operator"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    if cluster.local:  # pod IPs are routed to this host only on the local cluster
        assert liveness(pod) == 200
    print(f"\n[timing] helm install --wait (operator Ready): {release.install_seconds:.1f}s")


def test_brokercluster_becomes_ready_with_the_primary_active(
    cluster: Cluster, release: OperatorRelease
) -> None:
    state = create_ready_cluster(release)
    assert state["activeBroker"] == "primary"
    assert state["epoch"] >= 1
    roles = {b["name"]: b["role"] for b in state["brokers"]}
    assert roles == {"primary": "active", "backup": "passive"}
    operator_reconciles(release)
    print(f"\n[timing] BrokerCluster Ready and replicating: {release.timings['orders Ready']:.1f}s")


def test_uninstall_removes_the_operator_and_its_rbac(
    cluster: Cluster, release: OperatorRelease
) -> None:
    ns = release.namespace
    name = release.deployment
    paths = [
        f"/apis/apps/v1/namespaces/{ns}/deployments/{name}",
        f"/api/v1/namespaces/{ns}/serviceaccounts/{name}",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/{name}",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings/{name}",
    ]
    assert all(cluster.kube.get(path) is not None for path in paths)
    release.uninstall()
    assert [path for path in paths if cluster.kube.get(path) is not None] == []
    wait_for("the operator pod gone", lambda: release.operator_pods() == [], timeout=60)
    crd = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/brokerclusters.twinmq.io"
    assert cluster.kube.get(crd) is not None  # Helm never deletes crds/ (other clusters use it)


def test_cluster_scope_grants_a_cluster_wide_operator_what_it_calls(cluster: Cluster) -> None:
    """Installed with replicas=0 (a second cluster-wide operator would reconcile other
    tests' clusters): the API server's own authorizer answers for the ServiceAccount."""
    namespace = f"e2e-chart-rbac-{uuid.uuid4().hex[:6]}"
    helm(
        cluster.kubeconfig, "install", "tmq", str(CHART), "--namespace", namespace,
        "--create-namespace", "--set", "operator.replicas=0", "--wait", "--timeout", "60s",
    )  # fmt: skip
    user = f"system:serviceaccount:{namespace}:tmq-twinmq-operator"

    def allowed(verb: str, group: str, resource: str, ns: str | None = None) -> bool:
        attributes = {"verb": verb, "group": group, "resource": resource.split("/")[0]}
        if "/" in resource:
            attributes["subresource"] = resource.split("/")[1]
        if ns is not None:
            attributes["namespace"] = ns
        review = cluster.kube.create(
            "/apis/authorization.k8s.io/v1/subjectaccessreviews",
            {"spec": {"user": user, "groups": ["system:serviceaccounts"],
                      "resourceAttributes": attributes}},
        )  # fmt: skip
        return bool(review["status"].get("allowed"))

    try:
        elsewhere = "some-other-namespace"
        for verb in ("list", "watch"):  # kopf, across namespaces
            assert allowed(verb, "twinmq.io", "brokerclusters")
            assert allowed(verb, "apiextensions.k8s.io", "customresourcedefinitions")
        assert allowed("patch", "twinmq.io", "brokerclusters/status", elsewhere)
        for verb, group, resource in [
            ("create", "", "pods"), ("patch", "", "pods"), ("delete", "", "pods"),
            ("watch", "", "pods"), ("get", "", "secrets"), ("patch", "", "secrets"),
            ("create", "", "persistentvolumeclaims"), ("create", "", "events"),
            ("update", "coordination.k8s.io", "leases"),
            ("create", "rbac.authorization.k8s.io", "roles"),
            ("create", "policy", "poddisruptionbudgets"),
            ("patch", "policy", "poddisruptionbudgets"),
        ]:  # fmt: skip
            assert allowed(verb, group, resource, elsewhere), (verb, group, resource)
        # Least privilege: nothing the operator does not call.
        assert not allowed("delete", "", "secrets", elsewhere)
        assert not allowed("delete", "", "persistentvolumeclaims", elsewhere)
        assert not allowed("list", "", "secrets", elsewhere)
        assert not allowed("delete", "policy", "poddisruptionbudgets", elsewhere)
        assert not allowed("list", "", "namespaces")
        assert not allowed("create", "rbac.authorization.k8s.io", "clusterroles")
    finally:
        helm(cluster.kubeconfig, "uninstall", "tmq", "--namespace", namespace, "--wait")
        cluster.kube.delete(f"/api/v1/namespaces/{namespace}")
